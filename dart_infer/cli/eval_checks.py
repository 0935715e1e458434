"""dart-eval's checks before anything slow, and the settings a resumed run must share.

Bad input is refused (`InputError`, one line naming the key) before the model loads, so a run that
starts can finish; `run_settings` is what `<out_dir>/records.jsonl` compares to decide whether its
records can be reused (`dart_infer.evaluation.records`).
"""

from __future__ import annotations

import platform
import tempfile
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from dart_infer.common.dtypes import DTYPE_NAMES
from dart_infer.common.errors import InputError


def check_out_dir(value: Any) -> Path:
    """`out_dir` created if needed and writable (InputError naming it otherwise), before anything slow."""
    out = Path(str(value)).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):  # a real write: permission bits alone miss read-only mounts
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise InputError(f"out_dir={value}: cannot write there ({reason}); give a writable directory, "
                         "e.g. out_dir=runs/eval/<name>") from err
    return out


def check_count(cfg: DictConfig, key: str, *, allow_none: bool = False) -> None:
    """`key` is a whole number >= 1 (or null where that means 'all'); InputError naming it otherwise."""
    value = OmegaConf.select(cfg, key)
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        expected = "null (all of them) or a whole number >= 1" if allow_none else "a whole number >= 1"
        raise InputError(f"{key}={value}: expected {expected}, e.g. {key}=8")


def benchmark_names(cfg: DictConfig) -> list[str]:
    """`benchmarks` as a list (a single name is one benchmark, not its letters)."""
    value = cfg.benchmarks
    names = [str(value)] if isinstance(value, str) else [str(v) for v in value or []]
    if not names:
        raise InputError("benchmarks=[]: give at least one, e.g. benchmarks=[mtbench]")
    return names


def check_eval_inputs(cfg: DictConfig) -> None:
    """dart-eval's checks that need no model or data (the benchmarks are checked as they load next)."""
    check_count(cfg, "limit", allow_none=True)
    check_count(cfg, "max_new_tokens")
    benchmark_names(cfg)
    if "eagle3" in list(cfg.methods) and not cfg.get("eagle3_model"):
        raise InputError("methods: 'eagle3' needs eagle3_model=<an EAGLE-3 head directory>")
    if cfg.get("bf16_weights", False) and (DTYPE_NAMES.get(str(cfg.model.dtype).lower()) is not torch.float32
                                           or torch.cuda.is_available()):
        raise InputError(f"bf16_weights=true is for float32 serving on a CPU (model.dtype={cfg.model.dtype}"
                         f"{', a GPU here' if torch.cuda.is_available() else ''}): use model.dtype=float32 on a CPU")
    check_out_dir(cfg.out_dir)


def resolve_compile(cfg: DictConfig) -> bool:
    """`compile` as true/false: `auto` is `compile_pays` for the model on this device (compiled on CPUs
    for full-attention targets). Written back into `cfg`, so the records and the fit say what ran."""
    choice = cfg.get("compile", False)
    if choice not in (True, False, "auto"):
        raise InputError(f"compile={choice}: use true, false or auto (compiled where it is faster)")
    if choice == "auto":
        from transformers import AutoConfig

        from dart_infer.common.dtypes import default_device
        from dart_infer.data.assets import resolve_model
        from dart_infer.decoding.compile import compile_pays

        config = AutoConfig.from_pretrained(resolve_model(str(cfg.model.name_or_path)))
        choice = compile_pays(config, default_device(), bf16_weights=bool(cfg.get("bf16_weights", False)))
        print(f"compile=auto: {'compiled' if choice else 'eager'} decoding steps on this "
              f"{default_device().type} (compile=true|false to choose)", flush=True)
    cfg.compile = bool(choice)
    return cfg.compile


def _files_stamp(value: Any) -> dict[str, int] | None:
    """Size and modification time of a local file or a directory's files: a head retrained in the
    same directory is a different head. None for names (embedded models, Hub ids)."""
    path = Path(str(value)).expanduser() if value else None
    if path is None or not path.exists():
        return None
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
    stats = [p.stat() for p in files]
    return {"files": len(stats), "bytes": sum(s.st_size for s in stats),
            "modified": int(max((s.st_mtime for s in stats), default=0))}


def run_settings(cfg: DictConfig, trie: str | None, settings: Any) -> dict[str, Any]:
    """Everything a measurement depends on: records.jsonl resumes only records made with exactly
    these (`limit` and `benchmarks` may change: each record names its benchmark and prompt)."""
    eagle3 = "eagle3" in settings.methods
    return {
        "model": {"name_or_path": str(cfg.model.name_or_path), "stamp": _files_stamp(cfg.model.name_or_path),
                  "dtype": str(cfg.model.dtype), "chat_template": cfg.model.get("chat_template")},
        "draft_model": {"name": str(cfg.draft_model), "stamp": _files_stamp(cfg.draft_model)},
        "ngram_model": {"path": trie, "stamp": _files_stamp(trie), "mmap": bool(cfg.ngram_mmap)},
        "tree": OmegaConf.to_container(cfg.tree, resolve=True),
        "eagle3_model": {"name": str(cfg.eagle3_model), "stamp": _files_stamp(cfg.eagle3_model)} if eagle3 else None,
        "eagle3_tree": OmegaConf.to_container(cfg.eagle3_tree, resolve=True) if eagle3 and cfg.get("eagle3_tree")
        else None,
        "methods": list(settings.methods),
        "compile": bool(cfg.get("compile", False)),
        **({"bf16_weights": True} if cfg.get("bf16_weights") else {}),  # named only when set: old records resume
        "baseline_dtypes": [str(d) for d in cfg.get("baseline_dtypes") or []],
        "samplings": [s.label for s in settings.samplings],
        "max_new_tokens": settings.max_new_tokens,
        "multi_turn": settings.multi_turn,
        "prompt_lookup_num_tokens": settings.prompt_lookup_num_tokens,
        "warmup_tokens": settings.warmup_tokens,
        "threads": settings.threads or torch.get_num_threads(),
        "seed": settings.seed,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu {platform.machine()}",
        "torch": torch.__version__,
    }
