"""`dart-train`: distil a target model into a DART draft head (Hydra config tree `configs/train.yaml`).

    dart-train model=smollm2-135m-instruct data=sharegpt trainer=cpu
    dart-train model=custom model.name_or_path=/ckpt data=jsonl data.source=/data.jsonl trainer.max_steps=100
    deepspeed --num_gpus 8 $(which dart-train) trainer=zero2 model=custom model.name_or_path=Qwen/Qwen3-8B
    deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 $(which dart-train) trainer=zero2 ...
    torchrun --nproc_per_node 8 -m dart_train.cli trainer=zero2 ...
(`hostfile` lines: `<host> slots=<gpus>`; every node needs the same environment and data paths.
Each rank trains on every world_size-th batch; rank 0 logs, writes checkpoints' metadata and exports.)

The entry point only wires library pieces: conversations (`dart_infer.data.conversations`) → tokens, loss
masks (`dart_train.data.template`, `dart_train.data.dataset`), draft vocabulary (`dart_train.data.vocab`), batches
(`dart_train.data.batching`) → target states online (`dart_train.states.online`) or from an offline cache
(`dart_train.state_cache_*`) → DeepSpeed training (`dart_train.trainer.engine`) with simulated-τ evaluation
(`dart_train.trainer.simulated_tau`) → an exported head in `<run_dir>/head` that `DartModel.from_pretrained` loads.

Run directory: Hydra's run dir unless `output_dir` is set; what `resume=false|true|auto` does with it:
`dart_train.trainer.run_dir`. The pieces wired here are built by `dart_train.builders`. A resumed run's config
is written to `<run_dir>/config.yaml` only once its checkpoint has loaded (a new run's at its start).
Which checkpoint is loaded, and what an unreadable one does: `dart_train.trainer.checkpoints`. Ctrl-C / SIGTERM
while training saves a checkpoint at the end of the optimiser step and exits (docs/training.md).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from dart_infer.cli import hydra_app
from dart_train.builders import (
    build_head,
    evaluate_other_head,
    load_target,
    make_evaluator,
    make_loader,
    make_state_source,
    regenerate_conversations,
    regenerate_output,
    settings_from_config,
    start_wandb,
    template_kwargs,
    trainer_config,
    vocab_mapping_fn,
)
from dart_train.trainer.run_dir import RunDirError, prepare_run_dir, resumed_config, save_config

# Re-exported: tests and scripts reach these through the entry point's module.
__all__ = ["RunDirError", "build_head", "evaluate_other_head", "load_target", "main", "prepare_run_dir",
           "regenerate_output", "resumed_config", "settings_from_config", "train"]

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run one training job from a resolved `train` config; returns the trainer's summary."""
    from hydra.core.hydra_config import HydraConfig

    from dart_infer.data.conversations import load_conversations
    from dart_train.data.dataset import build_dataset
    from dart_train.trainer.checkpoints import CHECKPOINT_DIR, check_resumable, select_checkpoint
    from dart_train.trainer.engine import DartTrainer, estimate_step_memory, init_distributed

    if cfg.output_dir:
        run_dir = Path(str(cfg.output_dir))
    elif HydraConfig.initialized():
        run_dir = Path(HydraConfig.get().runtime.output_dir)
    else:
        raise RunDirError("set output_dir (no Hydra run directory available)")
    # Every refusal of a resume comes before the model loads and before any file of the run changes.
    resuming = prepare_run_dir(run_dir, cfg.resume)
    saved = run_dir / "config.yaml"
    if resuming and saved.is_file():  # a run stopped before its first checkpoint too
        # Under the CLI only what this command line names may change; a Python caller's cfg is
        # taken as a whole. Either way the differences from the saved run are logged.
        explicit = (
            # `group@package=option` changes the keys under `package`
            [o.split("=", 1)[0].lstrip("+~").split("@")[-1] for o in HydraConfig.get().overrides.task]
            if HydraConfig.initialized() else None
        )
        cfg, changes = resumed_config(cfg, OmegaConf.load(saved), explicit)
        for change in changes:
            log.warning("resume: %s", change)
    settings = settings_from_config(cfg)  # validate before the expensive loading
    init_distributed()
    rank = int(os.environ.get("RANK", "0"))
    # The checkpoint to continue (InputError when the run has some and none loads).
    checkpoint = select_checkpoint(run_dir / CHECKPOINT_DIR) if resuming else None
    if checkpoint is not None and checkpoint.state is not None:  # what it cannot continue with: refused now
        check_resumable(checkpoint.state, checkpoint.tag, settings, int(os.environ.get("WORLD_SIZE", "1")))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has checked the run dir before rank 0 marks it as a run
    if rank == 0 and not resuming:  # a new run: config.yaml marks the directory as a run from the start
        save_config(run_dir, cfg)

    target, tokenizer, embedding = load_target(cfg)
    conversations = load_conversations(str(cfg.data.source), split=cfg.data.split, limit=cfg.data.limit)
    regen = cfg.preprocess.regenerate
    if regen.enabled:
        conversations = regenerate_conversations(cfg, target, tokenizer, conversations)
        if regen.get("stop_after"):
            if rank == 0 and resuming:  # a new run saved it already
                save_config(run_dir, cfg)
            print(f"# dart-train: regenerated data in {regenerate_output(cfg)}; stopping "
                  "(preprocess.regenerate.stop_after)",
                  flush=True)
            return {"regenerated": str(regenerate_output(cfg)), "conversations": len(conversations)}
    cache_dir = cfg.preprocess.get("cache_dir")
    dataset = build_dataset(
        conversations, tokenizer, int(cfg.preprocess.max_length), template_kwargs=template_kwargs(cfg),
        cache_dir=str(cache_dir) if cache_dir else None,
    )
    log.info("training data: %s", dataset.stats.as_dict())

    head = build_head(target, cfg, vocab_mapping_fn(cfg, dataset, tokenizer, target.vocab_size), embedding)
    t = trainer_config(cfg)
    loader = make_loader(cfg, dataset, tokenizer, rank, int(os.environ.get("WORLD_SIZE", "1")))
    if rank == 0:  # before the expensive part: what the largest micro-batch will need
        compiled_flex = torch.cuda.is_available() and t.attention != "dense"
        estimate = estimate_step_memory(
            loader.batch_sampler.batches(0), dataset.lengths, [int(s["loss_mask"].sum()) for s in dataset.sequences],
            draft_config=head.config, max_anchors=settings.max_anchors, compiled_flex=compiled_flex,
            activation_bytes=2 if settings.bf16 or settings.autocast_dtype else 4,
        )
        print(f"# dart-train: {estimate.describe()}", flush=True)
    source = make_state_source(cfg, target, dataset, run_dir)
    evaluator = make_evaluator(cfg, target, tokenizer, cfg)
    trainer = DartTrainer(head, source, loader, settings, run_dir, evaluator=evaluator)
    resumed = resuming and trainer.resume(checkpoint.tag if checkpoint is not None else None)
    if resuming and not resumed:
        log.warning("resume: %s holds no checkpoint yet (stopped before its first one): starting from step 0",
                    run_dir)
    if resuming and rank == 0:  # only once the checkpoint has loaded: a refused resume leaves it as it was
        save_config(run_dir, cfg)
    if not resumed and t.skip_batches:  # a resumed loader already sits past them
        loader.skip(t.skip_batches)
        log.info("trainer.skip_batches=%d: starting at epoch %d, batch %d", t.skip_batches,
                 loader.epoch, loader.position)
    # After resume: the wandb run a resumed segment logs into depends on the checkpoint's step.
    wandb_run = start_wandb(cfg, run_dir, trainer.step) if rank == 0 else None
    trainer.wandb_run = wandb_run
    summary = trainer.train()
    if evaluator is not None and cfg.train_eval.get("compare_head") and rank == 0:
        summary["compare"] = evaluate_other_head(evaluator, str(cfg.train_eval.compare_head), trainer.draft_model)
    if wandb_run is not None:
        wandb_run.finish()
    budget = (f" of {summary['total_steps']} (time budget trainer.max_minutes={summary['max_minutes']:g} reached)"
              if summary.get("stopped_on") == "time_budget" else "")
    print(f"# dart-train done: {summary['steps']}{budget} steps, head at {summary['head']}", flush=True)
    return summary


_hydra_main = hydra_app("train")(train)


def main() -> None:
    """Console script. Accepts the `--local_rank=N` argument the `deepspeed` launcher appends
    (Hydra would reject it): it becomes LOCAL_RANK, as with `deepspeed --no_local_rank`/torchrun."""
    import sys

    kept = []
    args = iter(sys.argv[1:])
    for arg in args:
        if arg.startswith("--local_rank"):
            value = arg.split("=", 1)[1] if "=" in arg else next(args, "0")
            os.environ.setdefault("LOCAL_RANK", value)
        else:
            kept.append(arg)
    sys.argv[1:] = kept
    _hydra_main()


if __name__ == "__main__":
    main()
