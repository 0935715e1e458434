"""DeepSpeed training of a DART head: the training loop, checkpoints with exact resume, export, logging.

- `TrainSettings` (`dart_train.trainer.settings`): optimiser / schedule / DeepSpeed / checkpoint knobs (the `optim` and
  `trainer` groups' structured configs, field by field by name; `dart_train.builders.settings_from_config`).
- `init_distributed()`: joins the process group the `deepspeed` launcher set up, or creates a
  world of one (env vars RANK/WORLD_SIZE/MASTER_ADDR/...) when started as a plain process;
  gloo on CPU, nccl on GPU.
- `DartTrainer(draft_model, state_source, loader, settings, run_dir, evaluator=None)`:
  `.train()` runs until `max_steps` optimiser steps (or `epochs` passes over the loader), or until
  `max_minutes` of wall-clock time in this process, whichever comes first; `summary.json` says which.
  Only the head's trainable parameters are given to DeepSpeed (`torch.optim.AdamW` passed in,
  cosine schedule with linear warm-up, clipping, gradient accumulation, ZeRO 0-3, bf16). The frozen
  target lives in the state source and the frozen embedding outside the head's module registry
  (`DartDraftModel.set_target_embedding`), so neither is wrapped, sharded or checkpointed.

Run directory, checkpoints, exact resume, resume under changes and interrupts: docs/training.md
("The engine"); which checkpoint a resume loads: `dart_train.trainer.checkpoints`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dart_train.common.dist import init_distributed, rank_and_world_size
from dart_train.objectives import ObjectiveOutput, annealed_kl_loss, build_layout, draft_forward
from dart_train.trainer.checkpointed import HEAD_DIR, METRICS_FILE, CheckpointedTraining
from dart_train.trainer.checkpoints import (
    CHECKPOINT_DIR,
    RANK_STATE,
    ResumeError,
    StopOnSignal,
    all_ranks_agree,
    check_resumable,
)
from dart_train.trainer.memory import MemoryEstimate, estimate_step_memory
from dart_train.trainer.metrics import MetricsWindow
from dart_train.trainer.schedule import cosine_with_warmup
from dart_train.trainer.settings import TrainSettings

log = logging.getLogger(__name__)

# Re-exported: the settings check and its error belong to the checkpoints but are the engine's API.
# Re-exported too: the schedule, the memory estimate and the process group, which callers reach through here.
__all__ = ["CHECKPOINT_DIR", "RANK_STATE", "SUMMARY_FILE", "DartTrainer", "MemoryEstimate", "ResumeError",
           "TrainSettings", "check_resumable", "cosine_with_warmup", "estimate_step_memory", "init_distributed"]

SUMMARY_FILE = "summary.json"
# The clock of the time budget (`max_minutes`) and of the summary's seconds.
_clock = time.perf_counter


def _anchor_seed(seed: int, global_micro: int) -> int:
    """Seed of the anchor sample of one micro-batch, from its position in the global batch order."""
    return (seed * 1_000_003 + 7919 * global_micro + 1) % (2**63 - 1)


class _ObjectiveModule(nn.Module):
    """What DeepSpeed wraps: the head plus the loss (so ZeRO hooks run around the whole forward)."""

    def __init__(self, draft_model: nn.Module, gamma: float, use_flex: bool | None) -> None:
        super().__init__()
        self.draft = draft_model
        self.gamma = gamma
        self.use_flex = use_flex

    def forward(self, batch: Mapping[str, Any], layout: Any) -> ObjectiveOutput:
        device = self.draft.fc.weight.device
        logits = draft_forward(
            self.draft,
            batch["aux_hidden"].to(device),
            batch["input_ids"].to(device),
            layout.to(device),
            use_flex=self.use_flex,
        )
        ids = batch.get("target_topk_ids")
        return annealed_kl_loss(
            logits,
            layout,
            self.draft.d2t,
            target_logprobs=batch["target_topk_logprobs"].to(device),
            target_ids=ids.to(device) if ids is not None else None,
            gamma=self.gamma,
        )


class DartTrainer(CheckpointedTraining):
    """Trains a `DartDraftModel` with DeepSpeed on batches from a resumable loader + state source.

    `loader`: a `dart_train.data.batching.ResumableLoader` (or anything iterable with `state_dict`/
    `load_state_dict` and `__len__`); `state_source(batch)` adds "aux_hidden" and the target's
    soft labels (`dart_train.states.online`, `dart_train.states.cache_reader`). `evaluator(draft_model) -> dict` (e.g. simulated τ from
    `dart_train.trainer.simulated_tau`) runs every `eval_every` steps; its "tau" picks the best checkpoint.
    """

    def __init__(
        self,
        draft_model: nn.Module,
        state_source: Callable[[Mapping[str, Any]], dict[str, Any]],
        loader: Any,
        settings: TrainSettings,
        run_dir: str | os.PathLike[str],
        *,
        evaluator: Callable[[nn.Module], dict[str, float]] | None = None,
        wandb_run: Any = None,
    ) -> None:
        import deepspeed

        self.settings = settings
        self.run_dir = Path(run_dir)
        self.loader = loader
        self.state_source = state_source
        self.evaluator = evaluator
        self.wandb_run = wandb_run
        self.run_dir.mkdir(parents=True, exist_ok=True)

        init_distributed()
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        torch.manual_seed(settings.seed)
        if torch.cuda.is_available():
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            draft_model.to(f"cuda:{local_rank}")
        self.anchor_rng = torch.Generator()

        batches_per_epoch = max(1, len(loader))
        steps_per_epoch = max(1, batches_per_epoch // settings.grad_accum)
        self.total_steps = settings.max_steps or settings.epochs * steps_per_epoch
        warmup = (
            settings.warmup_steps
            if settings.warmup_steps is not None
            else int(round(settings.warmup_ratio * self.total_steps))
        )
        self.warmup_steps = max(1, min(warmup, self.total_steps))

        trainable = [p for p in draft_model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("the draft model has no trainable parameters")
        optimizer = torch.optim.AdamW(
            trainable, lr=settings.lr, betas=settings.betas, eps=settings.eps, weight_decay=settings.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, cosine_with_warmup(self.total_steps, self.warmup_steps, settings.min_lr_ratio)
        )
        use_flex = {"auto": None, "dense": False, "flex": True}[settings.attention]
        if use_flex is not False and torch.cuda.is_available():
            # BlockMask attention through the compiled kernel (compiled at its first call, once per
            # process): eager flex_attention materialises the whole score matrix. CUDA only: the
            # compiled kernel has no backward on CPU (torch 2.13), where training uses the dense mask.
            from dart_infer.methods.dart.model import use_compiled_flex_attention

            use_compiled_flex_attention()
        module = _ObjectiveModule(draft_model, settings.gamma, use_flex)
        if settings.zero_stage == 3:  # parameters read outside a submodule's forward: gathered with the wrapper
            for parameter in draft_model.external_parameters():
                deepspeed.zero.register_external_parameter(module, parameter)
        self.ds_config = self._deepspeed_config()
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            model_parameters=trainable,
            config=self.ds_config,
        )
        self.step = 0  # optimiser steps done
        self.saved_step = 0  # the step of the newest checkpoint written or resumed (0: none)
        self._micro_in_step = 0  # micro-batches of the current step done (anchor seeding)
        self.best: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []
        # Seconds spent getting target states (target forward or cache read) vs the draft's step.
        self.timings: dict[str, float] = {"states": 0.0, "draft": 0.0}

    # ------------------------------------------------------------------------------ configuration
    def _deepspeed_config(self) -> dict[str, Any]:
        s = self.settings
        config: dict[str, Any] = {
            # Batches are variable-size (length bucketing); these numbers only satisfy DeepSpeed's
            # bookkeeping (train_batch = micro x accumulation x world).
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": s.grad_accum,
            "train_batch_size": s.grad_accum * self.world_size,
            "gradient_clipping": s.grad_clip,
            "zero_optimization": {"stage": s.zero_stage},
            "bf16": {"enabled": bool(s.bf16)},
            "torch_autocast": {"enabled": s.autocast_dtype is not None, "dtype": s.autocast_dtype or "bfloat16"},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        for key, value in s.extra_ds_config.items():
            if isinstance(value, Mapping) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}
            else:
                config[key] = value
        return config

    @property
    def draft_model(self) -> nn.Module:
        return self.engine.module.draft

    # ------------------------------------------------------------------------------------ training
    def _micro_step(self, batch: Mapping[str, Any]) -> tuple[ObjectiveOutput, int]:
        started = time.perf_counter()
        with torch.no_grad():
            states = self.state_source(batch)
        after_states = time.perf_counter()
        rank, world = rank_and_world_size()
        global_micro = (self.step * self.settings.grad_accum + self._micro_in_step) * world + rank
        self.anchor_rng.manual_seed(_anchor_seed(self.settings.seed, global_micro))
        position_ids = states.get("position_ids")
        layout = build_layout(
            states["loss_mask"],
            self.draft_model.config.draft_length,
            position_ids=position_ids,
            document_ids=states.get("document_ids"),
            max_anchors=self.settings.max_anchors,
            generator=self.anchor_rng,
        )
        out = self.engine(states, layout)
        self.engine.backward(out.loss)
        self.engine.step()
        self.timings["states"] += after_states - started
        self.timings["draft"] += time.perf_counter() - after_states
        return out, int(states["loss_mask"].sum())

    def train(self) -> dict[str, Any]:
        """Train to the end (resuming from the last checkpoint is `resume()` before this): `max_steps`
        (or `epochs`), or the end of the optimiser step that reaches `max_minutes` of this call, with a
        final evaluation, checkpoint, exported head and `summary.json` either way. A resumed run with
        no step left keeps the finished run's head and summary (`_already_finished`).

        SIGINT (Ctrl-C) / SIGTERM stop the run at the end of the current optimiser step, with a
        checkpoint when a step was taken since the last one (`StopOnSignal`), then raise
        KeyboardInterrupt; a second signal raises it at once, without a checkpoint."""
        from tqdm.auto import tqdm

        if self.step >= self.total_steps:  # resumed at (or past) the end of a finished run
            return self._already_finished()
        quiet = not self.settings.progress or rank_and_world_size()[0] != 0
        bar = tqdm(total=self.total_steps, initial=self.step, disable=quiet, desc="dart-train", dynamic_ncols=True)
        started = _clock()
        with StopOnSignal() as stop:
            timed_out = self._train_loop(bar, stop, started)
        bar.close()
        self.export(self.run_dir / HEAD_DIR)
        summary = self._summary(_clock() - started, "time_budget" if timed_out else "max_steps")
        if rank_and_world_size()[0] == 0:
            (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        return summary

    def _summary(self, seconds: float, stopped_on: str) -> dict[str, Any]:
        """What `summary.json` records of this process's part of the run (steps count from step 1)."""
        return {
            "steps": self.step,
            "total_steps": self.total_steps,
            # max_steps (or optim.epochs' steps) reached, or the time budget trainer.max_minutes
            "stopped_on": stopped_on,
            "max_minutes": self.settings.max_minutes,
            "minutes": seconds / 60,
            "tokens": sum(int(m["tokens"]) for m in self.history),  # trained in this process, all ranks
            "final_loss": self.history[-1]["loss"] if self.history else None,
            "seconds": seconds,
            "best": self.best,
            "head": str(self.run_dir / HEAD_DIR),
            "timings": dict(self.timings),
            # The device's high-water mark of this process (target, head, optimiser, activations).
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        }

    def _already_finished(self) -> dict[str, Any]:
        """`train()` of a resumed run that has no step left (`resume=true` on a finished run): what the
        finished run measured stays as it is, `summary.json` and `head/` untouched (written only where
        missing: a run killed after its last checkpoint). Returns the kept summary."""
        rank = rank_and_world_size()[0]
        head, summary_file = self.run_dir / HEAD_DIR, self.run_dir / SUMMARY_FILE
        if all_ranks_agree(rank == 0 and not (head / "model.safetensors").is_file()):
            self.export(head)
        try:
            summary = json.loads(summary_file.read_text())
            kept = "summary.json and head/ kept as they are"
        except (OSError, ValueError):  # missing (or unreadable): this process's (empty) summary
            summary = self._summary(0.0, "max_steps")
            kept = "summary.json written (it was missing)"
            if rank == 0:
                summary_file.write_text(json.dumps(summary, indent=2))
        if rank == 0:
            log.warning("the run in %s was already finished at step %d (of %d): nothing to train, %s; raise "
                        "trainer.max_steps to train it further", self.run_dir, self.step, self.total_steps, kept)
        return summary

    def _out_of_time(self, started: float) -> bool:
        """True on every rank once any rank has spent `max_minutes` since `started` (a collective when
        a budget is set: every rank calls it at every step boundary)."""
        budget = self.settings.max_minutes
        return bool(budget) and all_ranks_agree(_clock() - started >= budget * 60)

    def _train_loop(self, bar: Any, stop: StopOnSignal, started: float) -> bool:
        """The steps up to `total_steps`; True when it stopped earlier, on the time budget."""
        s = self.settings
        window = MetricsWindow(self.draft_model.config.draft_length)
        micro = 0
        empty_passes = 0
        while self.step < self.total_steps:
            progressed = False
            for batch in self.loader:
                progressed = True
                empty_passes = 0
                out, loss_tokens = self._micro_step(batch)
                window.add(out, int(batch["attention_mask"].sum()) if "attention_mask" in batch else
                           int(batch["input_ids"].numel()), loss_tokens)
                micro += 1
                self._micro_in_step = micro % s.grad_accum
                if self._micro_in_step:
                    continue
                self.step += 1
                metrics = window.flush(lr=self.scheduler.get_last_lr()[0], step=self.step)
                self.history.append(metrics)
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", a1=f"{metrics['alpha_1']:.3f}",
                                tok_s=f"{metrics['tokens_per_s']:.0f}")
                timed_out = self.step < self.total_steps and self._out_of_time(started)
                last = self.step == self.total_steps or timed_out
                if timed_out and rank_and_world_size()[0] == 0:
                    log.warning("time budget trainer.max_minutes=%g reached at step %d of %d (%.1f minutes): the run "
                                "ends here; dart-train output_dir=%s resume=true continues it, with a fresh budget",
                                s.max_minutes, self.step, self.total_steps, (_clock() - started) / 60, self.run_dir)
                if self.step % s.log_every == 0 or last:
                    self._log(metrics)
                if self.evaluator is not None and (last or (s.eval_every and self.step % s.eval_every == 0)):
                    self._update_best(self._evaluate())
                if last or (s.save_every and self.step % s.save_every == 0):
                    self.save_checkpoint()
                if last:  # the run is complete: finishing it is the quickest way out, signal or not
                    return timed_out
                if all_ranks_agree(stop.signal_name is not None):
                    self._stop_interrupted(stop.signal_name or "a signal on another rank")
            # A resumed loader may sit at the very end of an epoch: one empty pass is normal.
            empty_passes += not progressed
            if empty_passes > 1:
                raise ValueError(
                    f"the training loader yielded no batch on rank {rank_and_world_size()[0]}: empty dataset, or "
                    "fewer batches than ranks (every rank takes every world_size-th batch): use smaller batches "
                    "(trainer.max_tokens / batch_size / pack_length) or fewer ranks"
                )
        return False

    def _stop_interrupted(self, why: str) -> None:
        """At an optimiser-step boundary after SIGINT/SIGTERM: checkpoint the steps not saved yet (this
        boundary is exactly resumable), say how to continue, raise KeyboardInterrupt (exit 130)."""
        resume = f"dart-train output_dir={self.run_dir} resume=true"
        if self.step > self.saved_step:
            tag = self.save_checkpoint()
            where = f"checkpoint saved to {self.checkpoint_dir / tag}"
        else:
            where = f"nothing to save, the checkpoint of step {self.saved_step} holds every step"
        if rank_and_world_size()[0] == 0:
            log.warning("interrupted by %s at step %d: %s; continue with: %s", why, self.step, where, resume)
        raise KeyboardInterrupt(f"interrupted by {why} at step {self.step}")

    def _evaluate(self) -> dict[str, Any]:
        model = self.draft_model
        model.eval()
        with torch.no_grad(), self._gathered(model):
            result = dict(self.evaluator(model))
        model.train()
        result = {f"eval/{k}": v for k, v in result.items()}
        result["step"] = self.step
        self._log(result)
        return result

    def _log(self, metrics: Mapping[str, Any]) -> None:
        if rank_and_world_size()[0] != 0:
            return
        with open(self.run_dir / METRICS_FILE, "a") as fh:
            fh.write(json.dumps(dict(metrics)) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(dict(metrics), step=int(metrics["step"]))
