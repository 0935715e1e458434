"""DART inference: draft model, target adapter, C++ tree search, lossless generation.

`from dart_infer import DartModel, DartDraftConfig, DartDraftModel` — resolved lazily, so importing
the package (e.g. for `dart_infer.data.assets`) does not pull in torch/transformers. `DartModel` serves a
head of any draft method (`load_head` loads one by name or path with its method); EAGLE-3's pieces
are in `dart_infer.methods.eagle3`.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "DartModel": "dart_infer.decoding.dart_model",
    "TreeSearchSettings": "dart_infer.tree.settings",
    "GenerationStats": "dart_infer.decoding.stats",
    "DartDraftConfig": "dart_infer.methods.dart.model",
    "DartDraftModel": "dart_infer.methods.dart.model",
    "TargetModel": "dart_infer.target.adapter",
    "load_head": "dart_infer.methods",
    "compile_decoding": "dart_infer.decoding.compile",
}

__all__ = [
    "DartDraftConfig",
    "DartDraftModel",
    "DartModel",
    "GenerationStats",
    "TargetModel",
    "TreeSearchSettings",
    "compile_decoding",
    "load_head",
]

if TYPE_CHECKING:
    from dart_infer.decoding.compile import compile_decoding
    from dart_infer.decoding.dart_model import DartModel
    from dart_infer.decoding.stats import GenerationStats
    from dart_infer.methods import load_head
    from dart_infer.methods.dart.model import DartDraftConfig, DartDraftModel
    from dart_infer.target.adapter import TargetModel
    from dart_infer.tree.settings import TreeSearchSettings


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dart_infer' has no attribute '{name}'")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
