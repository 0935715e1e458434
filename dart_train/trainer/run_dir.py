"""A training run's directory: when it holds a run, what resume=false|true|auto does with it, the
config a resumed run continues with.

A directory holds a run when it has checkpoints, config.yaml, metrics or an exported head.
`resume=false` (default) starts a new run and refuses a directory that holds one (nothing is ever
overwritten silently); `resume=true` continues the run and refuses a directory that holds none (a
mistyped path is an error, not a new run from step 0); `resume=auto` continues the run if there is
one and starts a new one otherwise. Every refusal comes before the model loads.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dart_infer.common.configs import flatten_dotted
from dart_infer.common.errors import InputError

__all__ = ["RUN_MARKERS", "RunDirError", "prepare_run_dir", "resume_mode", "resumed_config", "save_config"]


# Files whose presence means "a run lives here" (config.yaml alone: a run stopped before its first
# checkpoint, or one that only regenerated its data).
RUN_MARKERS = ("checkpoints", "config.yaml", "metrics.jsonl", "head", "summary.json")
RESUME_MODES = ("false", "true", "auto")


class RunDirError(InputError):
    """The output directory cannot be used: it holds a run and resume=false, holds none and
    resume=true, or is not writable."""


def resume_mode(value: Any) -> str:
    """The `resume` setting as "false", "true" or "auto" (configs/train.yaml); YAML booleans or those words."""
    if value is None or isinstance(value, bool):
        return "true" if value else "false"
    text = str(value).strip().lower()
    if text not in RESUME_MODES:
        raise InputError(
            f"resume={value!r} is not a resume mode: use resume=true to continue the run in output_dir, "
            "resume=false to start a new one, or resume=auto to continue it if it exists and start one otherwise."
        )
    return text


def prepare_run_dir(run_dir: Path, resume: bool | str) -> bool:
    """Create/check the run dir for `resume` (true, false or auto); True when an existing run is to be resumed.

    Refusals come before anything is created or loaded: a mistyped output_dir with resume=true must not
    silently become a new run from step 0, and an existing run is never overwritten."""
    mode = resume_mode(resume)
    existing = [m for m in RUN_MARKERS if (run_dir / m).exists()]
    if existing and mode == "false":
        raise RunDirError(
            f"run directory {run_dir} already holds a run ({', '.join(existing)}). Pass resume=true to "
            "continue it, or choose another output_dir: dart-train never overwrites a run."
        )
    if not existing and mode == "true":
        raise RunDirError(
            f"resume=true: {run_dir} holds no run to resume (no checkpoints/, config.yaml or metrics). Check "
            "output_dir, or use resume=auto to continue a run if it exists and start a new one otherwise."
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write_test-{os.getpid()}"  # one per process: ranks probe at once
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise RunDirError(f"output directory {run_dir} is not writable: {exc}") from exc
    return bool(existing)


def save_config(run_dir: Path, cfg: DictConfig) -> None:
    """`<run_dir>/config.yaml`: the resolved config a later resume continues with (complete or absent)."""
    from dart_infer.common.files import atomic_write_bytes

    atomic_write_bytes(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True).encode())


_ALWAYS_NEW = ("resume", "output_dir")


def resumed_config(
    cfg: DictConfig, saved: DictConfig, explicit: list[str] | None
) -> tuple[DictConfig, list[str]]:
    """The config a resumed run continues with, and the differences from the saved run (as text).

    `dart-train output_dir=X resume=true` continues the run as it was configured (its saved
    `config.yaml`), not with the defaults; keys named on this command line (`explicit`: override
    keys like `trainer.max_steps`, or a group like `trainer`) are the deliberate changes and win.
    `explicit=None` (a Python caller passing a whole cfg): every key of `cfg` wins.
    """
    new = flatten_dotted(OmegaConf.to_container(cfg, resolve=True))
    old = flatten_dotted(OmegaConf.to_container(saved, resolve=True))
    merged = copy.deepcopy(cfg)
    changes: list[str] = []
    for key, value in new.items():
        if key in _ALWAYS_NEW or key not in old or old[key] == value:
            continue
        named = explicit is None or any(key == e or key.startswith(e + ".") for e in explicit)
        if named:
            changes.append(f"{key}: {old[key]!r} -> {value!r}")
        else:
            OmegaConf.update(merged, key, old[key], merge=False)
    # Keys only the saved run has come from a group option not chosen again (e.g. `draft=eagle3`
    # resumed without naming it): the saved run keeps them unless this command line names them.
    missing = [k for k in old if k not in new and k not in _ALWAYS_NEW]
    if explicit is not None and missing:
        struct = OmegaConf.is_struct(merged)
        OmegaConf.set_struct(merged, False)
        for key in missing:
            if not any(key == e or key.startswith(e + ".") for e in explicit):
                OmegaConf.update(merged, key, old[key], merge=False)
        OmegaConf.set_struct(merged, struct)
    return merged, changes
