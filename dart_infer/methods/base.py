"""The interface every draft method implements (`DraftMethod`) and what it hands the decoding loop
(`Drafter`). The registry that finds a method by name, head or config is `dart_infer.methods`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from dart_infer.tree.settings import DraftTree

__all__ = ["DraftMethod", "Drafter"]


class Drafter(Protocol):
    """One request's drafting state for the shared loop (`dart_infer.decoding.loop.decode_steps`)."""

    propose_phase: str  # the timer phase `propose` is counted in ("search", "draft")

    def update(self, aux_hidden_new: torch.Tensor, next_ids_new: torch.Tensor) -> Any:
        """Take n newly accepted prefix positions: the target's aux states [1,n,3H] and next tokens [1,n]."""

    def propose(self, history: torch.Tensor) -> DraftTree:
        """The tree to verify next; `history` holds the CPU tokens so far, ending with the root."""


class DraftMethod(ABC):
    """A draft method: its head and config classes, its tree settings, and its drafter.

    One instance per method, registered in `dart_infer.methods`. Everything outside the method's own
    modules asks the method (`method_of(head)`, `method_for_config(config)`) instead of testing types.
    Training-side hooks (the training forward, simulated τ) live in dart_train, keyed by `name`.
    """

    name: str  # the name configs use: `draft.method`, dart-train's registry, dart-eval's method column
    display_name: str  # in messages and on the app's page
    architectures: tuple[str, ...]  # `architectures` entries in config.json that name this method's heads
    config_class: type
    head_class: type
    tree_settings_class: type  # a frozen dataclass with `with_overrides(mapping)`
    tree_size_field: str  # the tree setting that bounds the verified nodes (the app's "tree size")
    uses_trie: bool  # whether its trees use an n-gram trie

    @abstractmethod
    def default_tree(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Any:
        """The tree settings a model on `device` in `dtype` uses unless told otherwise."""

    @abstractmethod
    def drafter(self, model: Any, settings: Any) -> Drafter:
        """A new request's drafter for a `DartModel` holding a head of this method."""

    @abstractmethod
    def max_depth(self, head: Any, settings: Any) -> int:
        """The deepest draft level a tree can reach (acceptance columns of result tables)."""

    def max_tree_nodes(self, settings: Any) -> int:
        """The most nodes (root included) one of its trees can have under `settings`: what a
        fixed-shape verification (`dart_infer.target.compiled`) must make room for."""
        return 1 + int(getattr(settings, self.tree_size_field))

    def padded_tree_sizes(self, settings: Any) -> set[int]:
        """The node counts a compiled target pads trees of `settings` to: the usual tree (the size
        setting's nodes + root) and the largest one (`max_tree_nodes`; DART: plus a copy span)."""
        return {1 + int(getattr(settings, self.tree_size_field)), self.max_tree_nodes(settings)}

    def load(self, path: str | Path, *, dtype: torch.dtype | None = None) -> Any:
        """A head of this method from a directory, embedded name or Hub id; anything missing fails."""
        from dart_infer.methods.loading import load_draft_model

        return load_draft_model(path, dtype=dtype, model_class=self.head_class, kind=self.display_name)

    def check_tree(self, spec: Any) -> Any:
        """`spec` as given (settings, None) or as a dict of overrides, refused now if a name or value is bad."""
        if spec is None or isinstance(spec, self.tree_settings_class):
            return spec
        if not isinstance(spec, Mapping):
            raise TypeError(
                f"{self.display_name} tree settings must be {self.tree_settings_class.__name__} or a mapping of "
                f"its fields, got {type(spec).__name__}"
            )
        spec = dict(spec)
        self.tree_settings_class().with_overrides(spec)  # unknown names and bad values fail here
        return spec

    def resolve_tree(self, spec: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> Any:
        """Settings from `spec`: settings as they are, else overrides (or None) of `default_tree`."""
        spec = self.check_tree(spec)
        if isinstance(spec, self.tree_settings_class):
            return spec
        return self.default_tree(device, dtype).with_overrides(spec)

    def __repr__(self) -> str:
        return f"<draft method {self.name!r}>"
