"""DART as a draft method: the head and config (`dart_infer.methods.dart.model`), the tree settings and search
(`dart_infer.tree.settings`), and `DartDrafter`, its side of the shared decoding loop."""

from __future__ import annotations

from typing import Any

import torch

from dart_infer.methods.base import DraftMethod
from dart_infer.methods.dart.model import AUTHORS_ARCHITECTURE, DartDraftConfig, DartDraftModel
from dart_infer.methods.draft_head import DraftKVCache
from dart_infer.tree.settings import DraftTree, TreeSearchSettings, default_tree, draft_trees, request_context

__all__ = ["METHOD", "DartDrafter", "DartMethod"]


class DartDrafter:
    """DART's side of the loop: `update` runs the head's one draft forward over the new prefix
    positions (its d logit rows), `propose` turns them into a tree (or a chain) with the C++ search."""

    propose_phase = "search"

    def __init__(self, model: Any, settings: TreeSearchSettings) -> None:
        self.draft, self.trie, self.eos_token_ids = model.draft_model, model.trie, model.eos_token_ids
        self.settings = settings
        compiled = getattr(model, "compiled_draft", None)  # `compile_decoding`'s fixed-shape draft step
        self.step = compiled or self.draft.draft_step
        self.cache = compiled.new_cache() if compiled is not None else DraftKVCache()
        self.context = request_context(settings)  # this request's context n-grams (None: off)
        self.logits: torch.Tensor | None = None

    def update(self, aux_hidden_new: torch.Tensor, next_ids_new: torch.Tensor) -> None:
        self.logits = self.step(aux_hidden_new, next_ids_new, self.cache)

    def propose(self, history: torch.Tensor) -> DraftTree:
        assert self.logits is not None, "update() first"
        return draft_trees(
            self.logits[None], self.draft, [history], trie=self.trie, settings=self.settings,
            eos_token_ids=self.eos_token_ids, contexts=[self.context],
        )[0]


class DartMethod(DraftMethod):
    name = "dart"
    display_name = "DART"
    # Ours save the class name; the authors' released heads name their own class.
    architectures = ("DartDraftModel", AUTHORS_ARCHITECTURE)
    config_class = DartDraftConfig
    head_class = DartDraftModel
    tree_settings_class = TreeSearchSettings
    tree_size_field = "remain_total"
    uses_trie = True

    def default_tree(self, device: torch.device | str, dtype: torch.dtype | None = None) -> TreeSearchSettings:
        return default_tree(device, dtype)

    def drafter(self, model: Any, settings: TreeSearchSettings) -> DartDrafter:
        return DartDrafter(model, settings)

    def max_tree_nodes(self, settings: TreeSearchSettings) -> int:
        # A copy span joins a tree's kept nodes; a chain (no copy spans) is the root + at most
        # remain_total nodes (min(remain_total, d): a remain_total above d pads beyond the chain).
        return 1 + settings.remain_total + settings.copy_span_tokens

    def max_depth(self, head: Any, settings: TreeSearchSettings) -> int:
        depth = int(head.config.draft_length)
        return min(depth, settings.remain_total) if settings.shape == "chain" else depth


METHOD = DartMethod()
