"""Online target states: the frozen target runs in the training process on every batch.

- `OnlineStateSource(target: dart_infer.target.adapter.TargetModel, *, topk=64, hidden_dtype=torch.bfloat16,
  autocast_dtype=None)`: runs the frozen target under no_grad per batch (optionally in bf16 autocast).
  Output: the `StateSource` contract (`dart_train.states.source`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dart_train.states.source import _target_states


class OnlineStateSource:
    """Runs the frozen target on every batch (no grad; bf16 autocast optional). `labels_only`: soft
    labels only where training reads them (`label_positions`; zeros elsewhere) — for training, not
    for simulated τ, which follows the target's argmax past the loss mask. `compile`: run the target
    through `torch.compile` (for long runs on fixed-shape batches, i.e. packed rows)."""

    def __init__(
        self,
        target: Any,
        *,
        topk: int | None = 64,
        hidden_dtype: torch.dtype = torch.bfloat16,
        autocast_dtype: torch.dtype | None = None,
        labels_only: bool = False,
        compile: bool = False,
    ) -> None:
        self.target = target
        self.topk = topk
        self.labels_only = labels_only
        self.hidden_dtype = hidden_dtype
        self.autocast_dtype = autocast_dtype
        self.hidden_size = 3 * int(target.hidden_size)
        for parameter in target.model.parameters():  # frozen: never trained, never in an optimiser
            parameter.requires_grad_(False)
        target.model.eval()
        if compile:
            # A compiled view of the same weights, used by this source only (other users of the
            # target, e.g. simulated τ with its many shapes, stay eager). Static shapes: packed
            # rows are full-width, so it compiles once per rows-per-batch (~40 s each for SmolLM2
            # here) and then runs the target ~1.35x faster (fused norms, rotary and activations).
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
            self.target = type(target)(torch.compile(target.model, dynamic=False), target.aux_layer_ids)

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        aux, values, ids = _target_states(
            self.target, batch, self.topk, self.hidden_dtype, self.autocast_dtype, self.labels_only
        )
        return {**batch, "aux_hidden": aux, "target_topk_logprobs": values, "target_topk_ids": ids}
