"""Fitted-tree files: `dart-eval action=fit_tree` writes `<out_dir>/fit_tree.yaml`; `tree=<that file or
its directory>` (dart-eval, dart-app, dart-demo) turns it into the `tree.<field>` overrides it holds."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig

from dart_infer.common.files import atomic_write_bytes

FIT_FILE = "fit_tree.yaml"
FIT_HEADER = "# Written by `dart-eval action=fit_tree`"


def tree_file(value: str) -> Path | None:
    """The fitted-tree file a `tree=` value names, or None for a config-group option (cpu, gpu, auto)."""
    if not ("/" in value or value.endswith((".yaml", ".yml")) or value.startswith((".", "~"))):
        return None  # a bare name is a config-group option
    path = Path(value).expanduser()
    if path.is_dir():
        path = path / FIT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"tree={value}: no such tree file (dart-eval action=fit_tree writes <out_dir>/{FIT_FILE})")
    return path.resolve()


def read_tree_file(path: str | Path) -> dict[str, Any]:
    """The tree settings in a `fit_tree.yaml` (its `tree:` mapping) or in a plain settings file."""
    from dart_infer.tree.settings import TreeSearchSettings

    data = yaml.safe_load(Path(path).read_text()) or {}
    settings = data.get("tree", data) if isinstance(data, dict) else None
    if not isinstance(settings, dict) or not settings:
        raise ValueError(f"{path} holds no tree settings (expected a `tree:` mapping or settings fields)")
    TreeSearchSettings().with_overrides(settings)  # unknown names and bad values fail here
    return settings


def tree_file_overrides(args: Sequence[str]) -> list[str]:
    """Hydra overrides with `tree=<file or run dir>` turned into that file's settings.

    `tree` is a config group (cpu, gpu, auto); a path there is replaced by `tree.<field>=<value>`
    overrides for the file's fields (fields the same command sets explicitly win) and `tree_file=<path>`,
    so the run's saved config says where its tree came from.
    """
    args = list(args)
    explicit = {a.split("=", 1)[0].lstrip("+") for a in args if a.lstrip("+").startswith("tree.")}
    out: list[str] = []
    for arg in args:
        key, _, value = arg.partition("=")
        path = tree_file(value) if key == "tree" and value else None
        if path is None:
            out.append(arg)
            continue
        for name, setting in read_tree_file(path).items():
            if f"tree.{name}" not in explicit:
                rendered = yaml.safe_dump(setting, default_flow_style=True).strip().removesuffix("...").strip()
                out.append(f"++tree.{name}={rendered}")
        out.append(f"tree_file={path}")
    return out


def write_fit(out_dir: str | Path, best: dict[str, Any], results: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    """`<out_dir>/fit_tree.yaml`: the best tree (`tree:`), where it was measured, and every result."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / FIT_FILE
    body = yaml.safe_dump({"tree": best, **meta, "all": results}, sort_keys=False)
    use = "eagle3_tree.<field>=<value> of `tree:`" if meta.get("method") == "eagle3" else f"dart-eval tree={path}"
    atomic_write_bytes(path, f"{FIT_HEADER}; evaluate with it: {use}\n{body}".encode())
    return path


def check_tree_file(cfg: DictConfig) -> None:
    """Say so when the tree file was measured in another dtype or on another kind of device."""
    if not cfg.get("tree_file"):
        return
    data = yaml.safe_load(Path(cfg.tree_file).read_text()) or {}
    measured = data.get("dtype")
    if measured and measured != str(cfg.model.dtype):
        print(f"note: the tree in {cfg.tree_file} was fitted in {measured}; this run serves in "
              f"{cfg.model.dtype} (fit one per dtype: dart-eval action=fit_tree model.dtype={cfg.model.dtype})",
              flush=True)
