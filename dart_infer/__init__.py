"""DART inference: draft model, target adapter, C++ tree search, lossless generation.

`from dart_infer import DartModel, DartDraftConfig, DartDraftModel` — resolved lazily, so importing
the package (e.g. for `dart_infer.assets`) does not pull in torch/transformers. `DartModel` serves a
head of any draft method (`load_head` loads one by name or path with its method); EAGLE-3's pieces
are in `dart_infer.methods.eagle3`.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "DartModel": "dart_infer.generate",
    "TreeSearchSettings": "dart_infer.tree",
    "GenerationStats": "dart_infer.stats",
    "DartDraftConfig": "dart_infer.model",
    "DartDraftModel": "dart_infer.model",
    "TargetModel": "dart_infer.target",
    "load_head": "dart_infer.methods",
}

__all__ = [
    "DartDraftConfig",
    "DartDraftModel",
    "DartModel",
    "GenerationStats",
    "TargetModel",
    "TreeSearchSettings",
    "load_head",
]

if TYPE_CHECKING:
    from dart_infer.generate import DartModel
    from dart_infer.methods import load_head
    from dart_infer.model import DartDraftConfig, DartDraftModel
    from dart_infer.stats import GenerationStats
    from dart_infer.target import TargetModel
    from dart_infer.tree import TreeSearchSettings


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dart_infer' has no attribute '{name}'")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
