"""The registry of draft methods: one interface (`DraftMethod`), one implementation per method.

- `dart` (`dart_infer.methods.dart`): DART's one-forward head + the n-gram-enforced tree search;
- `eagle3` (`dart_infer.methods.eagle3`): EAGLE-3's sequential head + EAGLE-2's dynamic tree.

`DartModel` takes a head of any registered method and decodes with that method's drafter in the one
shared loop; a head on disk is mapped to its method by its config.json (`method_for_config`), and a
loaded head by its class (`method_of`). `load_head` is the one loader of heads by name or path.
A new method implements `DraftMethod` and calls `register_method` (its training hooks register in
`dart_train.objectives.methods` under the same name).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import import_module
from pathlib import Path
from typing import Any

import torch

from dart_infer.methods.base import Drafter, DraftMethod

__all__ = [
    "DEFAULT_METHOD",
    "DraftMethod",
    "Drafter",
    "get_method",
    "load_head",
    "method_for_config",
    "method_names",
    "method_of",
    "register_method",
]

# The built-in methods, imported when first asked for (each module defines `METHOD`).
_BUILTIN = {"dart": "dart_infer.methods.dart", "eagle3": "dart_infer.methods.eagle3"}
# A config.json that names no registered architecture is a DART head (the authors' layout and ours).
DEFAULT_METHOD = "dart"

_registry: dict[str, DraftMethod] = {}


def register_method(method: DraftMethod) -> DraftMethod:
    """Add `method` under `method.name` (a name already taken by another class is an error)."""
    known = _registry.get(method.name)
    if known is not None and type(known) is not type(method):
        raise ValueError(f"draft method {method.name!r} is already registered ({known!r})")
    _registry[method.name] = method
    return method


def _all() -> dict[str, DraftMethod]:
    for name, module in _BUILTIN.items():
        if name not in _registry:
            register_method(import_module(module).METHOD)
    return _registry


def method_names() -> list[str]:
    return list(_all())


def get_method(name: str) -> DraftMethod:
    """The method registered as `name` ("dart", "eagle3", ...)."""
    methods = _all()
    if name not in methods:
        raise KeyError(f"no draft method {name!r}; known: {sorted(methods)}")
    return methods[name]


def method_of(head: Any) -> DraftMethod:
    """The method whose head class `head` is (the one place head types are tested)."""
    for method in _all().values():
        if isinstance(head, method.head_class):
            return method
    raise TypeError(f"no draft method serves a {type(head).__name__}; known methods: {method_names()}")


def method_for_config(config: Mapping[str, Any]) -> DraftMethod:
    """The method of a head from its config.json: the one whose architecture it names, else DART."""
    architectures = set(config.get("architectures") or [])
    for method in _all().values():
        if architectures & set(method.architectures):
            return method
    return get_method(DEFAULT_METHOD)


def _head_config(name_or_path: str | Path) -> dict[str, Any] | None:
    """A head's config.json as a dict, or None when it cannot be read (the loader then says why)."""
    from dart_infer.data.assets import check_model_reference, resolve_model

    try:
        check_model_reference(str(name_or_path), head=True)  # a typo is not looked up on the Hub
        source = resolve_model(name_or_path)
        if Path(source).exists():
            return json.loads((Path(source) / "config.json").read_text())
        from transformers import PretrainedConfig

        return PretrainedConfig.get_config_dict(source)[0]
    except Exception:  # missing, unreadable or not JSON: the default method's loader reports it in its words
        return None


def load_head(name_or_path: str | Path, *, dtype: torch.dtype | None = None) -> tuple[Any, DraftMethod]:
    """(head, its method) from an embedded head name, a directory or a Hub id (through
    `dart_infer.data.assets.resolve_model`). The method comes from the head's config.json; a reference that
    cannot load fails with the loader's one-line error."""
    config = _head_config(name_or_path)
    method = method_for_config(config) if config is not None else get_method(DEFAULT_METHOD)
    return method.load(name_or_path, dtype=dtype), method
