"""DeepSpeed training of a DART head: engine, schedule, checkpoints with exact resume, export, logging.

- `TrainSettings`: optimiser / schedule / DeepSpeed / checkpoint knobs (the `trainer`, `optim` and
  `train_eval` config groups map onto it).
- `init_distributed()`: joins the process group the `deepspeed` launcher set up, or creates a
  world of one (env vars RANK/WORLD_SIZE/MASTER_ADDR/...) when started as a plain process;
  gloo on CPU, nccl on GPU.
- `DartTrainer(draft_model, state_source, loader, settings, run_dir, evaluator=None)`:
  `.train()` runs until `max_steps` optimiser steps (or `epochs` passes over the loader).
  Only the head's trainable parameters are given to DeepSpeed (`torch.optim.AdamW` passed in,
  cosine schedule with linear warm-up, clipping, gradient accumulation, ZeRO 0-3, bf16). The frozen
  target lives in the state source and the frozen embedding outside the head's module registry
  (`DartDraftModel.set_target_embedding`), so neither is wrapped, sharded or checkpointed.

Run directory layout:
  checkpoints/step_00000100/   DeepSpeed checkpoint (model, optimizer, scheduler) + client state
                               (step, data-loader position, anchor sampler and global RNG states)
  checkpoints/latest           tag of the newest checkpoint (DeepSpeed's own pointer)
  checkpoints/aside-<tag>-<t>/ a checkpoint newer than the one a resume loaded (unreadable, or an
                               unfinished save), kept for inspection; never loaded or rotated
  best/                        exported head of the evaluation with the highest simulated τ
                               (+ best.json: step, τ); kept outside the keep-last-N rotation
  head/                        the final exported head (`save_pretrained`: config.json +
                               model.safetensors with the authors' key names)
  metrics.jsonl                one line per logged step / eval (loss, α_j, tokens/s, τ)

Exact resume: checkpoints are written only at optimiser-step boundaries; loading one restores the
weights, AdamW moments, LR schedule, and on every rank its loader's (epoch, batch) position and RNGs
(`checkpoints/<tag>/rank_state_<rank>.pt`: with ZeRO 0-2 DeepSpeed keeps client state from rank 0
only), so the resumed loss curve equals the uninterrupted one (tests/test_train_engine.py, 2 ranks in
tests/test_multirank.py). Anchors are sampled from a generator seeded by the micro-batch's global
position (step, micro-batch, rank), so 2 ranks x 1 micro-batch sample what 1 rank x 2 does.

Which checkpoint `resume()` loads (`dart_train.checkpoints.select_checkpoint`): the one `latest`
names, or, when its files are unreadable (truncated, corrupt, missing) or `latest` is stale, the
newest intact older one, with a warning naming both and the bad file; none intact: `InputError`.
Nothing of the run is changed until the checkpoint has loaded.

Resume under changes (`resume()`): the optimiser / schedule settings (`_APPLIED_ON_RESUME` in
`dart_train.checkpoints`) may differ from the checkpoint's and are applied to the restored optimiser
and LambdaLR (logged); the others (ZeRO stage, bf16, seed, grad_accum, world size) are refused with
a `ResumeError` (an `InputError`) that says which value to pass. `metrics.jsonl` continues from the
checkpoint's step: lines logged after it are moved to `metrics.dropped-<step>-<time>.jsonl` (logged),
never lost silently.

Interrupts: SIGINT (Ctrl-C) or SIGTERM during `train()` stops at the end of the current optimiser step
(all ranks at the same one), saves a checkpoint when a step was taken since the last one, logs where and
the command that continues the run, and raises KeyboardInterrupt (the console script exits 130). A
second signal stops at once, without a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dart_infer.errors import InputError
from dart_infer.files import atomic_path
from dart_train.checkpoints import (
    CHECKPOINT_DIR,
    RANK_STATE,
    ResumeError,
    StopOnSignal,
    all_ranks_agree,
    check_resumable,
    commit_resume,
    latest_tag,
    rng_state,
    rotate,
    select_checkpoint,
    set_rng_state,
    truncate_metrics,
)
from dart_train.dist import rank_and_world_size
from dart_train.objective import ObjectiveOutput, annealed_kl_loss, build_layout, draft_forward

log = logging.getLogger(__name__)

# Re-exported: the settings check and its error belong to the checkpoints but are the engine's API.
__all__ = ["CHECKPOINT_DIR", "RANK_STATE", "DartTrainer", "ResumeError", "TrainSettings", "check_resumable",
           "cosine_with_warmup", "estimate_step_memory", "init_distributed"]

BEST_DIR = "best"
HEAD_DIR = "head"
METRICS_FILE = "metrics.jsonl"


@dataclass
class TrainSettings:
    """Everything the engine needs besides the model and data (paper defaults, dart-method.md §2)."""

    lr: float = 2e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_ratio: float = 0.02
    warmup_steps: int | None = None  # overrides warmup_ratio
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio
    grad_clip: float = 0.5
    gamma: float = 0.6
    epochs: int = 3
    max_steps: int | None = None  # optimiser steps; overrides epochs when set
    grad_accum: int = 1
    zero_stage: int = 0
    bf16: bool = False
    # The head's forward under torch autocast in this dtype (DeepSpeed's torch_autocast: fp32 weights,
    # optimiser and loss; matmuls in bf16), e.g. "bfloat16"; None = no autocast.
    autocast_dtype: str | None = None
    max_anchors: int | None = None  # per row; None = every loss-masked anchor
    attention: str = "auto"  # auto (flex on GPU, dense on CPU) | dense | flex
    seed: int = 0
    log_every: int = 10
    eval_every: int | None = None  # optimiser steps; None = only at the end
    save_every: int | None = None  # optimiser steps; None = only at the end
    keep_last: int = 2
    progress: bool = True
    extra_ds_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.max_steps is None and self.epochs < 1:
            raise ValueError("set max_steps or epochs >= 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        if self.attention not in ("auto", "dense", "flex"):
            raise ValueError(f"attention must be auto, dense or flex, got {self.attention!r}")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
        if self.autocast_dtype not in (None, "bfloat16", "float16"):
            raise ValueError(f"autocast_dtype must be bfloat16, float16 or None, got {self.autocast_dtype!r}")
        if self.autocast_dtype and self.bf16:
            raise ValueError("bf16 (bf16 weights) and autocast_dtype exclude each other: choose one")
        self.betas = (float(self.betas[0]), float(self.betas[1]))


def cosine_with_warmup(total_steps: int, warmup_steps: int, min_lr_ratio: float = 0.0) -> Callable[[int], float]:
    """LR multiplier: linear warm-up from 1/warmup to 1, then cosine down to `min_lr_ratio`.

    Kept by hand on purpose: transformers' `get_cosine_with_min_lr_schedule_with_warmup` gives the
    same cosine part but warms up from 0 (step 0 trains at lr 0: 0, 1/W, ... instead of 1/W, 2/W, ...)
    and DeepSpeed's `WarmupCosineLR` (linear) also starts at 0 and reaches the cosine one step early
    (measured with W=2, T=10, min 0.1). Either would change the schedule of existing runs and of
    resumed checkpoints.
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@dataclass
class MemoryEstimate:
    """Peak memory of the head's training forward + backward for the largest micro-batch (bytes).

    slots = T + A(d-1) per row (T padded tokens, A anchors, d draft length). Attention: the dense
    mask path (CPU) and eager flex_attention hold B·H·S² scores and probabilities (+ a B·S² mask);
    compiled flex attention (CUDA) holds only B·H·S·head_dim blocks (q, k, v, output and their
    gradients) and a block mask. Logits: B·A·d·draft_vocab fp32 rows, their log-probs and gradient."""

    rows: int
    tokens: int
    anchors: int
    slots: int
    attention: int
    logits: int
    kind: str

    @property
    def total(self) -> int:
        return self.attention + self.logits

    def describe(self) -> str:
        gib = 1024**3
        return (f"peak memory estimate of the head's step ({self.kind} attention), largest micro-batch "
                f"{self.rows} row(s) x {self.tokens} tokens + {self.anchors} anchors = {self.slots} slots: attention "
                f"{self.attention / gib:.3g} GiB, logits {self.logits / gib:.3g} GiB, together {self.total / gib:.3g} GiB")


def estimate_step_memory(
    batches: Any,
    lengths: list[int],
    loss_tokens: list[int],
    *,
    draft_config: Any,
    max_anchors: int | None,
    compiled_flex: bool,
    activation_bytes: int = 4,
) -> MemoryEstimate:
    """`MemoryEstimate` of the largest of `batches` (a sampler's batches: lists of dataset indices, or
    of rows of indices when packed), with the anchors `build_layout` would keep per row."""
    d = int(draft_config.draft_length)
    heads, head_dim = int(draft_config.num_attention_heads), int(draft_config.head_dim)
    vocab = int(draft_config.draft_vocab_size)
    best: MemoryEstimate | None = None
    for batch in batches:
        rows = [row if isinstance(row, list) else [row] for row in batch]
        tokens = max(sum(lengths[i] for i in row) for row in rows)
        anchors = max(sum(loss_tokens[i] for i in row) for row in rows)
        anchors = min(anchors, max_anchors) if max_anchors is not None else anchors
        b, slots = len(rows), tokens + anchors * (d - 1)
        if compiled_flex:
            blocks = -(-slots // 128)
            attention = 8 * b * heads * slots * head_dim * activation_bytes + b * heads * slots * 4 + 2 * b * blocks**2 * 4
        else:
            attention = 2 * b * heads * slots * slots * activation_bytes + b * slots * slots
        logits = 3 * b * anchors * d * vocab * 4
        estimate = MemoryEstimate(b, tokens, anchors, slots, attention, logits,
                                  "compiled flex" if compiled_flex else "dense-mask")
        if best is None or estimate.total > best.total:
            best = estimate
    if best is None:
        raise ValueError("no batch to estimate")
    return best


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed() -> None:
    """Join (or create) the process group DeepSpeed uses; a world of one when not launched."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    if "RANK" not in os.environ:  # plain `python`/console-script start: a single-process world
        os.environ.update(
            {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        )
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend)


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


class DartTrainer:
    """Trains a `DartDraftModel` with DeepSpeed on batches from a resumable loader + state source.

    `loader`: a `dart_train.batching.ResumableLoader` (or anything iterable with `state_dict`/
    `load_state_dict` and `__len__`); `state_source(batch)` adds "aux_hidden" and the target's
    soft labels (`dart_train.online_states`, `dart_train.state_cache_reader`). `evaluator(draft_model) -> dict` (e.g. simulated τ from
    `dart_train.evaluate`) runs every `eval_every` steps; its "tau" picks the best checkpoint.
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
            from dart_infer.model import use_compiled_flex_attention

            use_compiled_flex_attention()
        module = _ObjectiveModule(draft_model, settings.gamma, use_flex)
        if settings.zero_stage == 3 and hasattr(draft_model.midlayer, "mask_rep"):  # (EAGLE-3 has none)
            # mask_rep is read directly (not through a submodule's forward): gather it with the wrapper.
            deepspeed.zero.register_external_parameter(module, draft_model.midlayer.mask_rep)
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
        """Train to the end (resuming from the last checkpoint is `resume()` before this).

        SIGINT (Ctrl-C) / SIGTERM stop the run at the end of the current optimiser step, with a
        checkpoint when a step was taken since the last one (`StopOnSignal`), then raise
        KeyboardInterrupt; a second signal raises it at once, without a checkpoint."""
        from tqdm.auto import tqdm

        quiet = not self.settings.progress or rank_and_world_size()[0] != 0
        bar = tqdm(total=self.total_steps, initial=self.step, disable=quiet, desc="dart-train", dynamic_ncols=True)
        started = time.perf_counter()
        with StopOnSignal() as stop:
            self._train_loop(bar, stop)
        bar.close()
        self.export(self.run_dir / HEAD_DIR)
        summary = {
            "steps": self.step,
            "final_loss": self.history[-1]["loss"] if self.history else None,
            "seconds": time.perf_counter() - started,
            "best": self.best,
            "head": str(self.run_dir / HEAD_DIR),
            "timings": dict(self.timings),
            # The device's high-water mark of this process (target, head, optimiser, activations).
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        }
        if rank_and_world_size()[0] == 0:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _train_loop(self, bar: Any, stop: StopOnSignal) -> None:
        s = self.settings
        window = _Window(self.draft_model.config.draft_length)
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
                if self.step % s.log_every == 0 or self.step == self.total_steps:
                    self._log(metrics)
                last = self.step == self.total_steps
                if self.evaluator is not None and (last or (s.eval_every and self.step % s.eval_every == 0)):
                    self._update_best(self._evaluate())
                if last or (s.save_every and self.step % s.save_every == 0):
                    self.save_checkpoint()
                if last:  # the run is complete: finishing it is the quickest way out, signal or not
                    return
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

    # --------------------------------------------------------------------------------- checkpoints
    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / CHECKPOINT_DIR

    def _update_best(self, result: Mapping[str, Any]) -> None:
        """Export the head to `best/` when this evaluation's simulated τ (the paper's search) is the
        highest so far; the served-tree τ is kept beside it, labelled (`dart_train.evaluate`)."""
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
        """Load the given checkpoint, or the newest intact one (`dart_train.checkpoints`); False when the
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


class _Window:
    """Accumulates micro-batch statistics between optimiser steps (exact α_j / KL over rows)."""

    def __init__(self, draft_length: int) -> None:
        self.d = draft_length
        self.reset()

    def reset(self) -> None:
        self.loss = 0.0
        self.micro = 0
        self.kl_sum = torch.zeros(self.d)
        self.correct = torch.zeros(self.d)
        self.rows = torch.zeros(self.d)
        self.tokens = 0
        self.loss_tokens = 0
        self.started = time.perf_counter()

    def add(self, out: ObjectiveOutput, tokens: int, loss_tokens: int) -> None:
        self.loss += float(out.loss.detach())
        self.micro += 1
        self.kl_sum += out.kl_sum.detach().float().cpu()
        self.correct += out.correct.detach().float().cpu()
        self.rows += out.rows.detach().float().cpu()
        self.tokens += tokens
        self.loss_tokens += loss_tokens

    def _all_reduce(self) -> None:
        """Sum the window over ranks: the logged numbers are the global batch's, not rank 0's share."""
        if rank_and_world_size()[1] == 1:
            return
        d = self.d
        packed = torch.cat([torch.tensor([self.loss, self.micro, self.tokens, self.loss_tokens], dtype=torch.float64),
                            self.kl_sum.double(), self.correct.double(), self.rows.double()])
        torch.distributed.all_reduce(packed)
        self.loss, self.micro, self.tokens, self.loss_tokens = (float(packed[0]), int(packed[1]), int(packed[2]),
                                                                int(packed[3]))
        self.kl_sum, self.correct, self.rows = (packed[4 : 4 + d].float(), packed[4 + d : 4 + 2 * d].float(),
                                                packed[4 + 2 * d :].float())

    def flush(self, *, lr: float, step: int) -> dict[str, Any]:
        self._all_reduce()
        seconds = max(time.perf_counter() - self.started, 1e-9)
        rows = self.rows.clamp(min=1)
        metrics: dict[str, Any] = {
            "step": step,
            "loss": self.loss / max(self.micro, 1),
            "lr": lr,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / seconds,
        }
        for j in range(self.d):
            metrics[f"alpha_{j + 1}"] = float(self.correct[j] / rows[j])
            metrics[f"kl_{j + 1}"] = float(self.kl_sum[j] / rows[j])
        self.reset()
        return metrics
