"""The training side of each draft method, keyed by the names of `dart_infer.methods` (the serving
side: head and config classes, trees, drafters). What differs per method when training:

- `new_config`: a random head's config, shaped from the target's (`draft.<length_key>` rows per anchor);
- `draft_forward`: the training forward over a prefix-shared layout → logits [B,A,d,draft_vocab]
  (DART: one parallel forward, `dart_train.objectives.dart.dart_forward`; EAGLE-3: its training-time test,
  `dart_train.objectives.eagle3.ttt_forward`). Loss, anchors, data and the engine are shared;
- `simulated_trees`: the trees held-out τ scores at the evaluation anchors (`dart_train.trainer.simulated_tau`),
  the ones serving would build; `own_tree` resolves the settings of a method that has its own tree.

A new method registers a `TrainMethod` here under its `dart_infer.methods` name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from dart_train.objectives.dart import PrefixSharedLayout

__all__ = ["TrainMethod", "draft_forward", "get_train_method", "register_train_method", "train_method_of"]


class TrainMethod:
    """The DART method's training hooks; other methods override what differs."""

    name = "dart"
    length_key = "draft_length"  # the draft config's key for logit rows per anchor
    # Held-out τ also reports the configured tree's serving extras (context n-grams, copy spans).
    search_extras = True

    def new_config(self, target: Any, draft_vocab_size: int, length: int) -> Any:
        from dart_infer.methods.dart.model import DartDraftConfig

        config = DartDraftConfig.from_target_config(
            target.model.config, draft_length=length, draft_vocab_size=draft_vocab_size
        )
        config.aux_layer_ids = list(target.aux_layer_ids)
        return config

    def draft_forward(self, head: Any, aux_hidden: Tensor, input_ids: Tensor, layout: Any, use_flex: bool | None) -> Tensor:
        from dart_train.objectives.dart import dart_forward

        return dart_forward(head, aux_hidden, input_ids, layout, use_flex=use_flex)

    def own_tree(self, spec: Any) -> Any:
        """Settings of the method's own tree for simulated τ; DART's is the evaluator's `tree`."""
        return None

    def simulated_trees(
        self, head: Any, batch: dict[str, Any], logits: Tensor, layout: Any, anchors: list[tuple[int, int]],
        settings: Sequence[Any], *, trie: Any, eos_token_ids: Sequence[int], own_tree: Any,
    ) -> list[list[Any]]:
        """Per tree setting, one tree per anchor (b, t) in `anchors`' order (row-major)."""
        from dart_infer.tree.settings import draft_trees

        seq_index, slot = layout.anchor_valid.nonzero(as_tuple=True)
        anchor_logits = logits[seq_index.to(logits.device), slot.to(logits.device)]
        histories = [batch["input_ids"][b, : t + 2] for b, t in anchors]
        return [
            draft_trees(anchor_logits, head, histories, trie=trie, settings=tree, eos_token_ids=eos_token_ids)
            for tree in settings
        ]


class Eagle3TrainMethod(TrainMethod):
    name = "eagle3"
    length_key = "ttt_length"
    search_extras = False  # EAGLE-3 has no trie, context n-grams or copy spans

    def new_config(self, target: Any, draft_vocab_size: int, length: int) -> Any:
        from dart_infer.methods.eagle3 import Eagle3DraftConfig

        config = Eagle3DraftConfig.from_target_config(
            target.model.config, draft_vocab_size=draft_vocab_size, ttt_length=length
        )
        config.eagle_aux_hidden_state_layer_ids = list(target.aux_layer_ids)
        return config

    def draft_forward(self, head: Any, aux_hidden: Tensor, input_ids: Tensor, layout: Any, use_flex: bool | None) -> Tensor:
        from dart_train.objectives.eagle3 import ttt_forward

        return ttt_forward(head, aux_hidden, input_ids, layout)  # the same rows from sequential steps

    def own_tree(self, spec: Any) -> Any:
        """EAGLE-2's dynamic tree: settings, or overrides of the CPU default (training evaluates there)."""
        from dart_infer.methods import get_method

        return get_method(self.name).resolve_tree(spec, "cpu")

    def simulated_trees(
        self, head: Any, batch: dict[str, Any], logits: Tensor, layout: Any, anchors: list[tuple[int, int]],
        settings: Sequence[Any], *, trie: Any, eos_token_ids: Sequence[int], own_tree: Any,
    ) -> list[list[Any]]:
        """EAGLE-3 serves its own dynamic tree: the same trees for every DART setting."""
        from dart_infer.methods.eagle3 import anchor_trees

        device = head.fc.weight.device
        trees: list[Any] = []
        for b in dict.fromkeys(b for b, _ in anchors):  # row-major: each row's anchors in a run
            trees += anchor_trees(
                head, batch["aux_hidden"][b : b + 1].to(device), batch["input_ids"][b : b + 1].to(device),
                [t for row, t in anchors if row == b], own_tree if own_tree is not None else self.own_tree(None),
            )
        return [trees] * len(settings)


_registry: dict[str, TrainMethod] = {}


def register_train_method(method: TrainMethod) -> TrainMethod:
    _registry[method.name] = method
    return method


register_train_method(TrainMethod())
register_train_method(Eagle3TrainMethod())


def get_train_method(name: str) -> TrainMethod:
    """The training hooks of the draft method `name` (`draft.method` in dart-train's config)."""
    if name not in _registry:
        raise KeyError(f"no training hooks for draft method {name!r}; known: {sorted(_registry)}")
    return _registry[name]


def train_method_of(head: torch.nn.Module) -> TrainMethod:
    """The training hooks of a head's method (looked up by `dart_infer.methods.method_of`)."""
    from dart_infer.methods import method_of

    return get_train_method(method_of(head).name)


def draft_forward(
    draft_model: torch.nn.Module,
    aux_hidden: Tensor,
    input_ids: Tensor,
    layout: PrefixSharedLayout,
    *,
    use_flex: bool | None = None,
) -> Tensor:
    """All anchors in one forward → draft logits [B,A,d,draft_vocab].

    aux_hidden [B,T,3Ht] are the target's aux hidden states on `input_ids` [B,T]. Clean slot t gets
    (aux_hidden[t], x_{t+1}); the last position has no next token and takes x_{T-1} as a stand-in
    (no row ever reads it: row validity needs x_{t+2}). use_flex: BlockMask + flex_attention
    (default: on CUDA), else the dense SDPA mask. The forward is the head's method's
    (`TrainMethod.draft_forward`): DART's is `dart_train.objectives.dart.dart_forward`; an EAGLE-3 head gives the same rows from
    its training-time test (`dart_train.objectives.eagle3.ttt_forward`; `use_flex` does not apply).
    """
    batch, seq_len = input_ids.shape
    if aux_hidden.shape[:2] != (batch, seq_len):
        raise ValueError(
            f"aux_hidden {tuple(aux_hidden.shape)} does not match input_ids {tuple(input_ids.shape)}"
        )
    if layout.seq_len != seq_len:
        raise ValueError(f"layout built for T={layout.seq_len}, batch has T={seq_len}")
    return train_method_of(draft_model).draft_forward(draft_model, aux_hidden, input_ids, layout, use_flex)

