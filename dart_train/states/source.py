"""The one target pass both modes share, and what every state source returns.

API (the training engine calls a `StateSource` on every batch from `dart_train.data.batching.collate`;
`_target_states` is the one place the target runs, for the online source and the cache writer alike):

- `StateSource`: `source(batch) -> dict` returns the batch plus
    "aux_hidden"            [B,T,3Ht]  the target's aux hidden states (inputs of layers 2, L//2, L-3),
                                       `hidden_dtype` (bf16 by default in both modes), zeros at padding;
    "target_topk_logprobs"  [B,T,k]    float32 log-probabilities of the target's top-k next tokens,
                                       normalised over the FULL target vocabulary (a log-softmax of
                                       the full logits, then top-k), sorted descending; zeros at padding;
    "target_topk_ids"       [B,T,k]    int64 target token ids of those entries; zeros at padding.
  Position t holds the distribution of token t+1 given tokens ≤ t (logits[t], unshifted).
  With `topk=None` (online only) the full distribution is returned: "target_topk_logprobs" is
  [B,T,V] and "target_topk_ids" is None (ids = 0..V-1).
  `source.topk`, `source.hidden_size` (= 3Ht) describe the output.

Probability mass outside the top-k: the stored log-probabilities are exact for the kept entries
(normalised with the full-vocabulary logsumexp), so the mass outside the top-k is
1 - Σ exp(logprobs), known per position but not where it goes. The training loss
(`dart_train.objectives.annealed_kl_loss`) restricts the target distribution to the top-k ∩ draft
vocabulary and renormalises it there; the target's argmax (for α_j) is always entry 0 of the top-k.
With k=64 the dropped mass is small for a chat model (4.4% of SmolLM2's on loss positions).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F

STATE_KEYS = ("aux_hidden", "target_topk_logprobs", "target_topk_ids")


class StateSource(Protocol):
    """Adds target states to a collated batch (see module doc)."""

    topk: int | None
    hidden_size: int

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]: ...


def topk_logprobs(logits: torch.Tensor, k: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs [...,k] float32 normalised over the full vocab, ids [...,k] int64), sorted descending."""
    logprobs = F.log_softmax(logits.float(), dim=-1)
    if k is None:
        return logprobs, None
    if not 0 < k <= logprobs.shape[-1]:
        raise ValueError(f"topk must be in 1..vocab ({logprobs.shape[-1]}), got {k}")
    values, ids = torch.topk(logprobs, k, dim=-1, sorted=True)
    return values, ids


def label_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B,T] bool: positions t whose next-token distribution is a training label (x_{t+1} is in the
    loss mask). Every row of the objective and every α_j reads only these (`build_layout`)."""
    labels = torch.zeros_like(loss_mask, dtype=torch.bool)
    labels[:, :-1] = loss_mask[:, 1:]
    return labels


def _target_states(
    target: Any,
    batch: Mapping[str, Any],
    topk: int | None,
    hidden_dtype: torch.dtype,
    autocast_dtype: torch.dtype | None,
    labels_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The one place both modes run the target: (aux [B,T,3H] hidden_dtype, logprobs, ids).

    A batch from `collate_packed` (it has "document_ids") runs with its position_ids and no attention
    mask: transformers then keeps the packed items (and the padding) apart, each item exactly as if it
    ran alone. Other batches run with their 2D padding mask. `labels_only`: the full-vocabulary
    log-softmax and top-k (~30% of a SmolLM2 states pass) only at `label_positions`, zeros elsewhere."""
    device = target.device
    autocast = (
        torch.autocast(device_type=device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    attention_mask = batch.get("attention_mask")
    with torch.no_grad(), autocast:
        if "document_ids" in batch:
            aux, logits = target.states(batch["input_ids"], position_ids=batch["position_ids"])
        else:
            mask = attention_mask.to(device) if attention_mask is not None else None
            aux, logits = target.states(batch["input_ids"].to(device), mask)
    if labels_only and topk is not None:
        where = label_positions(batch["loss_mask"].to(logits.device))
        picked_values, picked_ids = topk_logprobs(logits[where], topk)
        values = logits.new_zeros((*where.shape, topk), dtype=torch.float32)
        ids = torch.zeros((*where.shape, topk), dtype=torch.long, device=logits.device)
        values[where], ids[where] = picked_values, picked_ids
    else:
        values, ids = topk_logprobs(logits, topk)
    aux = aux.to(hidden_dtype)
    if attention_mask is not None:
        pad = ~attention_mask.to(device=device, dtype=torch.bool)
        aux = aux.masked_fill(pad[..., None], 0)
        values = values.masked_fill(pad[..., None], 0.0)
        if ids is not None:
            ids = ids.masked_fill(pad[..., None], 0)
    return aux, values, ids
