"""What `DartTrainer` does with checkpoints: save (with every rank's data position and RNG), resume
exactly (or under changed optimiser settings), keep the best head by simulated τ, export the head.

A mixin: the trainer holds the state (`run_dir`, `engine`, `loader`, `scheduler`, `settings`, `step`,
`saved_step`, `best`); which checkpoint a resume loads and what it may change: `dart_train.trainer.checkpoints`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dart_infer.common.errors import InputError
from dart_infer.common.files import atomic_path
from dart_train.common.dist import rank_and_world_size
from dart_train.trainer.checkpoints import (
    CHECKPOINT_DIR,
    RANK_STATE,
    check_resumable,
    commit_resume,
    latest_tag,
    rng_state,
    rotate,
    select_checkpoint,
    set_rng_state,
    truncate_metrics,
)

log = logging.getLogger(__name__)

__all__ = ["BEST_DIR", "HEAD_DIR", "METRICS_FILE", "CheckpointedTraining"]

BEST_DIR = "best"
HEAD_DIR = "head"
METRICS_FILE = "metrics.jsonl"


class CheckpointedTraining:
    """Checkpoint, resume, best-head and export methods of `dart_train.trainer.engine.DartTrainer`."""

    run_dir: Path
    engine: Any
    loader: Any
    scheduler: Any
    settings: Any
    step: int
    saved_step: int
    best: dict[str, Any] | None
    draft_model: nn.Module

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / CHECKPOINT_DIR

    def _update_best(self, result: Mapping[str, Any]) -> None:
        """Export the head to `best/` when this evaluation's simulated τ (the paper's search) is the
        highest so far; the served-tree τ is kept beside it, labelled (`dart_train.trainer.simulated_tau`)."""
        tau = result.get("eval/tau")
        if tau is None or (self.best is not None and tau <= self.best["tau"]):
            return
        self.best = {"tau": float(tau), "step": self.step}
        if result.get("eval/tau_served") is not None:
            self.best["tau_served"] = float(result["eval/tau_served"])
        self.export(self.run_dir / BEST_DIR)
        if rank_and_world_size()[0] == 0:
            (self.run_dir / BEST_DIR / "best.json").write_text(json.dumps(self.best, indent=2))

    def _rank_state(self) -> dict[str, Any]:
        rank, world = rank_and_world_size()
        return {
            "rank": rank, "world_size": world, "dart_step": self.step, "loader": self.loader.state_dict(),
            "rng": rng_state(), "settings": asdict(self.settings),
        }

    def save_checkpoint(self) -> str:
        """DeepSpeed checkpoint of this step + every rank's state (data position, RNG); keep-last-N."""
        tag = f"step_{self.step:08d}"
        rank_state = self._rank_state()
        tag_dir = self.checkpoint_dir / tag
        tag_dir.mkdir(parents=True, exist_ok=True)
        # Written before DeepSpeed's save, which starts with a barrier and ends by pointing `latest`
        # at the tag: a tag that `latest` names has every rank's state.
        with atomic_path(tag_dir / RANK_STATE.format(rank=rank_state["rank"])) as tmp:
            torch.save(rank_state, tmp)
        client_state = {**rank_state, "best": self.best}
        self.engine.save_checkpoint(str(self.checkpoint_dir), tag=tag, client_state=client_state)
        self.saved_step = self.step
        if rank_and_world_size()[0] == 0:
            rotate(self.checkpoint_dir, self.settings.keep_last)
        return tag

    def latest_tag(self) -> str | None:
        return latest_tag(self.checkpoint_dir)

    def _check_resumable(self, saved: Mapping[str, Any], tag: str) -> list[str]:
        return check_resumable(saved, tag, self.settings, rank_and_world_size()[1])

    def _apply_optimizer_settings(self) -> None:
        """Put this run's optimiser settings and schedule into the restored optimiser/LambdaLR.

        The restored LambdaLR keeps its step but its lambda is this run's (a closure is not saved), so
        the schedule follows this run's max_steps/warm-up; the base LR, betas, eps and weight decay
        come back from the checkpoint and are replaced here. Unchanged settings give the restored
        values again (the same formula)."""
        s = self.settings
        scheduler = self.scheduler
        step = scheduler.last_epoch
        scheduler.base_lrs = [s.lr for _ in scheduler.base_lrs]
        lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
        groups = self.engine.optimizer.param_groups
        for group, lr in zip(groups, lrs, strict=True):
            group.update(lr=lr, initial_lr=s.lr, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay)
        scheduler._last_lr = lrs

    def resume(self, tag: str | None = None) -> bool:
        """Load the given checkpoint, or the newest intact one (`dart_train.trainer.checkpoints`); False when the
        run has none yet (it starts again from step 0).

        Raises `ResumeError` for settings the checkpoint cannot continue with (module doc), `InputError`
        when no checkpoint can be loaded; either way before anything of the run is changed."""
        rank, _ = rank_and_world_size()
        chosen = select_checkpoint(self.checkpoint_dir, tag)
        if chosen is None:  # killed before its first checkpoint: it starts again from step 0
            if rank == 0:
                commit_resume(self.checkpoint_dir, None)
                truncate_metrics(self.run_dir / METRICS_FILE, 0)
            return False
        own: dict[str, Any] | None = None
        if chosen.state is not None:  # every rank checks rank 0's record, so all refuse (or go on) together
            changes = self._check_resumable(chosen.state, chosen.tag)
            own = chosen.state if rank == 0 else torch.load(
                chosen.path / RANK_STATE.format(rank=rank), weights_only=False)
        try:
            path, client = self.engine.load_checkpoint(str(self.checkpoint_dir), tag=chosen.tag)
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as exc:  # its files passed the cheap check: one is corrupt inside (or unreadable)
            why = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            raise InputError(
                f"checkpoint {chosen.path} could not be loaded ({why}): a file of it may be damaged. Move "
                f"{chosen.path} out of {self.checkpoint_dir} to resume from the checkpoint before it, or start "
                "a new run in another output_dir."
            ) from exc
        if path is None or client is None:
            raise InputError(f"DeepSpeed could not load checkpoint {chosen.path}: move it out of "
                             f"{self.checkpoint_dir} to resume from the one before it, or use another output_dir.")
        if own is None:  # written before per-rank files: rank 0's state from DeepSpeed's client state
            changes = self._check_resumable(client, chosen.tag)
            own = client
        self.step = self.saved_step = int(own["dart_step"])
        self.loader.load_state_dict(own["loader"])
        set_rng_state(own["rng"])
        self.best = client.get("best")
        self._apply_optimizer_settings()
        for change in changes:
            log.warning("resume: %s (applied to the restored optimiser/schedule)", change)
        if rank == 0:  # only now, after everything loaded: a refused resume changes no file of the run
            commit_resume(self.checkpoint_dir, chosen.tag)
            truncate_metrics(self.run_dir / METRICS_FILE, self.step)
        log.info("resumed from %s at step %d", chosen.tag, self.step)
        return True

    def export(self, out_dir: str | os.PathLike[str]) -> Path:
        """Write the head in HF format (config.json + model.safetensors, authors' key names)."""
        out = Path(out_dir)
        model = self.draft_model
        with self._gathered(model):
            if rank_and_world_size()[0] == 0:
                state = {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
                model.save_pretrained(out, state_dict=state)
        return out

    def _gathered(self, model: nn.Module) -> Any:
        """Full parameters for code that runs outside the engine's forward (ZeRO-3 shards them)."""
        if self.settings.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
