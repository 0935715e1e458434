"""Where the Hydra config tree lives, and flattening nested settings into dotted keys (saved run
and eval settings are compared key by key)."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import Any

__all__ = ["configs_dir", "flatten_dotted"]


def configs_dir() -> Path:
    """The Hydra config tree: `configs/` of a source checkout, else the copy installed in the wheel."""
    checkout = Path(__file__).resolve().parents[2] / "configs"
    if checkout.is_dir():
        return checkout
    spec = find_spec("dart_configs")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    raise FileNotFoundError(
        "Cannot find the Hydra configs: neither configs/ next to the packages nor an installed "
        "dart_configs/ directory. Reinstall the package (`pip install .`)."
    )



def flatten_dotted(value: Any, prefix: str = "") -> dict[str, Any]:
    """A plain nested mapping (a config as a container, saved settings) as {dotted key: leaf}."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten_dotted(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}

