"""DART inference: draft model, target adapter, C++ tree search, lossless generation.

`from dart_infer import DartModel, DartDraftConfig, DartDraftModel` (and `Eagle3Model`, `Eagle3DraftModel`,
`Eagle3DraftConfig` for EAGLE-3 in the same framework) — resolved lazily, so importing
the package (e.g. for `dart_infer.assets`) does not pull in torch/transformers.
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
    "Eagle3Model": "dart_infer.eagle3",
    "Eagle3DraftConfig": "dart_infer.eagle3",
    "Eagle3DraftModel": "dart_infer.eagle3",
}

__all__ = [
    "DartDraftConfig",
    "DartDraftModel",
    "DartModel",
    "Eagle3DraftConfig",
    "Eagle3DraftModel",
    "Eagle3Model",
    "GenerationStats",
    "TargetModel",
    "TreeSearchSettings",
]

if TYPE_CHECKING:
    from dart_infer.eagle3 import Eagle3DraftConfig, Eagle3DraftModel, Eagle3Model
    from dart_infer.generate import DartModel
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
