"""A training run's checkpoints on disk: which one a resume loads, what it may change, keeping them tidy.

`checkpoints/<tag>/` (tag `step_<8 digits>`) holds DeepSpeed's files (`*model_states.pt`; with ZeRO 1-3
one `*optim_states.pt` per rank, with ZeRO-3 one `*model_states.pt` per rank too) and one
`rank_state_<rank>.pt` per rank (step, data position, RNGs, settings). `checkpoints/latest` names the
newest tag: DeepSpeed writes it once every file of that tag is written.

Which checkpoint a resume loads (`select_checkpoint`): the tag `latest` names when its files are
intact (`checkpoint_problem`: every rank state loads, every DeepSpeed file is a whole torch archive,
none missing), else the newest intact older tag keep-last-N kept, with a warning naming both tags
and the unreadable file. Tags newer than `latest` are saves that never finished and are not used.
`latest` naming a missing tag is stale: the newest intact tag on disk is used (warning). No intact
tag: `InputError` (the message says what to do), except when no save ever finished (no `latest`):
that run starts again from step 0, like one killed before its first checkpoint. Once a resume
succeeded, `commit_resume` moves the tags newer than the loaded one (the resumed run writes those
steps again) to `checkpoints/aside-<tag>-<time>/` and points `latest` at the loaded tag.

`check_resumable` refuses (`ResumeError`) settings a checkpoint cannot continue with; `rotate`
keeps the newest N tags; `truncate_metrics` moves metrics logged after the resumed step aside;
`rng_state`/`set_rng_state` are the RNG part of a rank state. `StopOnSignal` turns SIGINT/SIGTERM
into a stop at the next optimiser-step boundary, where the trainer saves a checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import threading
import time
import zipfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dart_infer.common.errors import InputError
from dart_infer.common.files import atomic_write_bytes
from dart_train.common.dist import rank_and_world_size
from dart_train.trainer.settings import CONFIG_KEYS

if TYPE_CHECKING:
    from dart_train.trainer.settings import TrainSettings

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
RANK_STATE = "rank_state_{rank:05d}.pt"
_TAG = re.compile(r"step_(\d+)")


class ResumeError(InputError):
    """A checkpoint cannot be continued with these settings (the message says how to resume it)."""


# Settings a resumed run may change: the optimiser's hyper-parameters and the LR schedule are applied
# to the restored optimiser/scheduler; the rest is read afresh every step (max_minutes: a fresh budget
# for each process).
_APPLIED_ON_RESUME = frozenset({
    "lr", "betas", "eps", "weight_decay", "warmup_ratio", "warmup_steps", "min_lr_ratio", "max_steps",
    "epochs", "grad_clip", "gamma", "autocast_dtype", "max_anchors", "attention", "log_every", "eval_every",
    "save_every", "keep_last", "progress", "max_minutes",
})
_WHY_REFUSED = {
    "zero_stage": "DeepSpeed stores the optimiser state per ZeRO stage",
    "bf16": "the optimiser's master weights are stored differently with bf16",
    "seed": "the data order of the rest of the run depends on it",
    "grad_accum": "it changes the global batch the data position and schedule were counted in",
    "extra_ds_config": "it may change how DeepSpeed stores the checkpoint",
}


def check_resumable(saved: Mapping[str, Any], tag: str, settings: TrainSettings, world: int) -> list[str]:
    """Refuse (`ResumeError`) what checkpoint `tag` (a saved rank state) cannot continue with under
    `settings` and `world` ranks; returns the changes that will be applied, as text."""
    saved_world = int(saved.get("world_size", 1))
    if saved_world != world:
        raise ResumeError(
            f"checkpoint {tag} was written by {saved_world} rank(s), this run has {world}: each rank "
            f"resumes its own data position and RNGs. Launch {saved_world} rank(s) to resume it, or start "
            f"a new run from its exported head (draft.init_from=<run>/head)."
        )
    old = dict(saved.get("settings") or {})
    if "betas" in old:
        old["betas"] = tuple(float(b) for b in old["betas"])
    changes, refused = [], []
    for key, value in asdict(settings).items():
        if key not in old or old[key] == value:
            continue
        name = CONFIG_KEYS.get(key, key)
        if key in _APPLIED_ON_RESUME:
            changes.append(f"{name}: {old[key]!r} -> {value!r}")
        else:
            why = _WHY_REFUSED.get(key, "it is not applied to a restored run")
            refused.append(f"{name}: the checkpoint has {old[key]!r}, this run {value!r} ({why}); "
                           f"resume with {name}={old[key]!r}")
    if refused:
        raise ResumeError(
            f"cannot resume checkpoint {tag} with changed settings: " + "; ".join(refused)
            + "; or start a new run from its exported head (draft.init_from=<run>/head)."
        )
    return changes


@dataclass
class Checkpoint:
    """A checkpoint to resume: its tag, folder and rank 0's saved state (None: written before
    per-rank states, rank 0's state is DeepSpeed's client state)."""

    tag: str
    path: Path
    state: dict[str, Any] | None


def tag_step(tag: str) -> int | None:
    """The optimiser step of a `step_<n>` tag, None for another name."""
    match = _TAG.fullmatch(tag)
    return int(match.group(1)) if match else None


def tags_on_disk(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """The `step_<n>` checkpoint folders in `checkpoint_dir`, newest first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    tags = [p.name for p in root.iterdir() if p.is_dir() and tag_step(p.name) is not None]
    return sorted(tags, key=lambda t: tag_step(t) or 0, reverse=True)


def latest_tag(checkpoint_dir: str | os.PathLike[str]) -> str | None:
    """The tag `checkpoints/latest` names ("" when it is empty), None without that file."""
    pointer = Path(checkpoint_dir) / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _load_rank_state(path: Path) -> dict[str, Any]:
    # Not weights_only: the state holds numpy's and Python's RNG states (written by this engine).
    state = torch.load(path, weights_only=False, map_location="cpu")
    if not isinstance(state, dict) or "dart_step" not in state:
        raise ValueError("not a rank state of this trainer")
    return state


def _torch_archive_problem(path: Path) -> str | None:
    """Why `path` is not a whole torch.save archive (zip), None when it is. Reads only the zip's
    central directory at the file's end: a truncated file (a kill mid-write, a full disk) has none."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        return f"{path} is not a complete torch file ({_one_line(exc)})"
    if not any(name.endswith("data.pkl") for name in names):
        return f"{path} is not a torch checkpoint file (no data.pkl)"
    return None


def inspect_checkpoint(tag_dir: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, str | None]:
    """(rank 0's saved state or None, why the checkpoint in `tag_dir` cannot be loaded or None).

    Cheap: the small rank states are loaded, DeepSpeed's (large) files only checked for being whole
    archives and present in the number the saved ZeRO stage and world size need."""
    folder = Path(tag_dir)
    if not folder.is_dir():
        return None, f"{folder} does not exist"
    first = folder / RANK_STATE.format(rank=0)
    state: dict[str, Any] | None = None
    world, stage = 1, 0
    if first.exists() or any(folder.glob("rank_state_*.pt")):
        try:
            state = _load_rank_state(first)
        except Exception as exc:  # any failure to read a file of arbitrary content makes it unusable
            return None, f"{first} cannot be read ({_one_line(exc)})"
        world = int(state.get("world_size", 1))
        stage = int((state.get("settings") or {}).get("zero_stage", 0))
        for rank in range(1, world):
            path = folder / RANK_STATE.format(rank=rank)
            try:
                _load_rank_state(path)
            except Exception as exc:  # as above
                return state, f"{path} cannot be read ({_one_line(exc)})"
    names = {p.name: p for p in folder.glob("*.pt") if not p.name.startswith("rank_state_")}
    for path in sorted(names.values()):
        problem = _torch_archive_problem(path)
        if problem:
            return state, problem
    model = [n for n in names if n.endswith("model_states.pt")]
    optim = [n for n in names if n.endswith("optim_states.pt")]
    need_model = world if stage == 3 else 1
    if len(model) < need_model:
        return state, (f"{folder} has {len(model)} of the {need_model} DeepSpeed model state file(s) "
                       "(*model_states.pt): the save did not finish")
    if stage >= 1 and len(optim) < world:
        return state, (f"{folder} has {len(optim)} of the {world} DeepSpeed optimizer state file(s) "
                       "(*optim_states.pt): the save did not finish")
    return state, None


def checkpoint_problem(tag_dir: str | os.PathLike[str]) -> str | None:
    """Why the checkpoint in `tag_dir` cannot be loaded (naming the file), None when it is intact."""
    return inspect_checkpoint(tag_dir)[1]


def _start_again(root: Path) -> str:
    return (f"Move {root} away (rename it) to start the run again from step 0 with its saved config, "
            "or start a new run in another output_dir.")


def select_checkpoint(checkpoint_dir: str | os.PathLike[str], tag: str | None = None) -> Checkpoint | None:
    """The checkpoint a resume loads (module doc): `tag` if given, else the newest intact one; None
    when the run has none (yet). Raises `InputError` when it has checkpoints and none can be loaded.

    Every rank calls this on the same files (DeepSpeed's checkpoint folder is shared), so all choose
    the same tag."""
    root = Path(checkpoint_dir)
    if tag is not None:
        state, problem = inspect_checkpoint(root / tag)
        if problem:
            raise InputError(f"checkpoint {root / tag} cannot be resumed: {problem}. Move it out of {root} to "
                             "resume from the one before it, or start a new run in another output_dir.")
        return Checkpoint(tag, root / tag, state)
    on_disk = tags_on_disk(root)
    pointer = latest_tag(root)
    if pointer is not None and pointer in on_disk:
        newer = on_disk[: on_disk.index(pointer)]
        if newer:
            log.warning("resume: %s in %s: newer than checkpoints/latest (%s), a save that never finished; "
                        "not used", ", ".join(newer), root, pointer)
        candidates = on_disk[on_disk.index(pointer):]
    else:
        if pointer is not None:
            log.warning("resume: %s names checkpoint %r, which is not in %s (stale): using the newest intact "
                        "checkpoint there", root / LATEST, pointer, root)
        candidates = on_disk
    broken: list[tuple[str, str]] = []
    for name in candidates:
        state, problem = inspect_checkpoint(root / name)
        if problem is None:
            for bad, why in broken:
                log.warning("resume: checkpoint %s cannot be loaded (%s): resuming from %s instead",
                            bad, why, name)
            return Checkpoint(name, root / name, state)
        broken.append((name, problem))
    if pointer is None:  # no save ever finished: like a run killed before its first checkpoint
        for bad, why in broken:
            log.warning("resume: checkpoint %s never finished (%s; no %s): starting from step 0",
                        bad, why, root / LATEST)
        return None
    if broken:
        found = "; ".join(f"{bad}: {why}" for bad, why in broken)
        raise InputError(f"{root} holds no intact checkpoint to resume ({found}). {_start_again(root)}")
    raise InputError(f"{root / LATEST} names checkpoint {pointer!r}, but {root} holds no checkpoint folder. "
                     f"{_start_again(root)}")


def commit_resume(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> list[Path]:
    """After a successful resume from `tag` (None: from step 0): tags newer than it move to
    `aside-<tag>-<time>/` (kept, never deleted: the resumed run writes those steps again, and
    rotation and later resumes must not take them for its own) and `latest` names `tag`.
    Returns the new places of the moved tags."""
    root = Path(checkpoint_dir)
    step = 0 if tag is None else tag_step(tag)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    moved = []
    for name in tags_on_disk(root) if step is not None else []:  # (a tag by another name: nothing to order)
        if (tag_step(name) or 0) <= step:
            continue
        aside = root / f"aside-{name}-{stamp}"
        os.replace(root / name, aside)
        log.warning("resume: %s moved to %s (the resumed run writes that step again)", root / name, aside)
        moved.append(aside)
    if tag is not None and latest_tag(root) != tag:
        atomic_write_bytes(root / LATEST, tag.encode())
        log.warning("resume: %s now names %s", root / LATEST, tag)
    return moved


def rotate(checkpoint_dir: str | os.PathLike[str], keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoint tags."""
    root = Path(checkpoint_dir)
    for old in tags_on_disk(root)[keep_last:]:
        shutil.rmtree(root / old, ignore_errors=True)


def truncate_metrics(path: str | os.PathLike[str], step: int) -> Path | None:
    """The metrics file continues from `step`: lines logged after it (a killed run's steps past its last
    checkpoint) move to `metrics.dropped-<step>-<time>.jsonl` beside it, so the file has no duplicate
    steps. Returns that file, None when nothing moved."""
    path = Path(path)
    if not path.is_file():
        return None
    kept, dropped = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            logged = int(json.loads(line).get("step", 0))
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
            logged = step + 1  # a line cut by the kill
        (kept if logged <= step else dropped).append(line)
    if not dropped:
        return None
    backup = path.with_name(f"metrics.dropped-{step:08d}-{time.strftime('%Y%m%dT%H%M%S')}.jsonl")
    atomic_write_bytes(backup, "".join(dropped).encode())
    atomic_write_bytes(path, "".join(kept).encode())
    log.warning("resume: %d line(s) of %s logged after step %d moved to %s", len(dropped), path, step, backup)
    return backup


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class StopOnSignal:
    """While training: the first SIGINT/SIGTERM only asks the loop to stop at the next optimiser-step
    boundary (where a checkpoint resumes exactly; an exception mid-step could leave the optimiser
    half-updated); a second one raises KeyboardInterrupt at once. Handlers can be set only from the
    main thread: elsewhere signals keep their handlers."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal_name is not None:
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} again: stopped without a checkpoint")
        self.signal_name = signal.Signals(signum).name
        log.warning("%s: stopping at the end of this optimiser step with a checkpoint (send it again to stop "
                    "at once, without one)", self.signal_name)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)  # None: set outside Python


def all_ranks_agree(local: bool) -> bool:
    """True on every rank when any rank's `local` is (ranks stop at the same step: saving is collective)."""
    _, world = rank_and_world_size()
    if world == 1:
        return local
    import torch.distributed as dist

    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(local)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
