"""Training throughput of a DART head on this machine: the old and the new data paths, interleaved.

    python scripts/bench_train.py [--conversations 64] [--steps 8] [--max-length 1024] [--max-tokens 2048]

Loads SmolLM2-135M-Instruct (embedded) and ShareGPT train conversations, then trains fresh heads with
the real DeepSpeed engine, one micro-step of each variant in turn (the machine is noisy: interleaving
keeps drift out of the ratios; the first round is warm-up and not counted). Each variant is what
`dart-train` builds (`dart_train.builders`: target, state source, head, loader, settings) from the
`train` config composed with this script's sizes and the variant's overrides (`ONLINE`, `OFFLINE`):
- online (the frozen target runs on every batch), target states from
    `autocast`  fp32 weights under bf16 autocast (the old default),
    `bf16`      a bf16 copy of the target (weights cast once: `states.target_dtype=bfloat16`, what
                auto gives where bf16 is native),
  with padded length buckets (`buckets`) or packed rows (`packed`, `trainer.pack_length`), and the
  head in fp32 or under bf16 autocast (`autocast`, `trainer.autocast=bfloat16`); `labels`: the
  target's top-k soft labels only at positions training reads (what `dart-train` does online);
  `compiled`: the target through torch.compile (`states.compile=true`; the warm-up round compiles);
- offline: states precomputed once with the bf16 target (timed; bytes per token reported), then
  training reads them: old (buckets, fp32 head) vs new (packed, autocast head).
Prints real (non-padding) tokens per second of micro-steps, the share of time getting target states,
and the ratios new/old measured in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

# Every variant is dart-train's own wiring (`dart_train.builders`) of the `train` config composed with
# these overrides; (overrides, soft labels only where training reads them).
BF16, OLD_TARGET = ["states.target_dtype=bfloat16"], ["states.target_dtype=float32", "states.autocast_dtype=bfloat16"]
BUCKETS, FP32_HEAD, AUTOCAST_HEAD = ["trainer.pack_length=null"], ["trainer.autocast=null"], ["trainer.autocast=bfloat16"]
OLD, NEW = "online OLD autocast/buckets/fp32", "online NEW bf16/packed/autocast/labels/compiled"
ONLINE: dict[str, tuple[list[str], bool]] = {
    OLD: ([*OLD_TARGET, *BUCKETS, *FP32_HEAD], False),
    "online bf16/buckets/fp32": ([*BF16, *BUCKETS, *FP32_HEAD], False),
    "online bf16/packed/fp32": ([*BF16, *FP32_HEAD], False),
    "online bf16/packed/autocast": ([*BF16, *AUTOCAST_HEAD], False),
    "online bf16/packed/autocast/labels": ([*BF16, *AUTOCAST_HEAD], True),
    NEW: ([*BF16, *AUTOCAST_HEAD, "states.compile=true"], True),
}
OFFLINE = {"offline OLD buckets/fp32": [*BUCKETS, *FP32_HEAD], "offline NEW packed/autocast": AUTOCAST_HEAD}


def base_overrides(args: argparse.Namespace) -> list[str]:
    """The `train` config of every variant: this script's sizes, a fresh head, no evaluation or wandb."""
    return [
        "model=custom", f"model.name_or_path={args.model}", "data=sharegpt", f"data.limit={args.conversations}",
        f"preprocess.max_length={args.max_length}", "trainer=cpu", "trainer.grad_accum=1",
        "trainer.max_steps=1000000", f"trainer.max_tokens={args.max_tokens}",
        f"trainer.pack_length={args.pack_length or args.max_length}", f"trainer.max_anchors={args.max_anchors}",
        "trainer.save_every=null", "optim.warmup_steps=1", "draft=default", f"draft.draft_vocab_size={args.draft_vocab}",
        f"states.topk={args.topk}", "train_eval=off", "logging.progress=false", "logging.log_every=1000000",
        "logging.wandb.enabled=false", "seed=0",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--chat-template", default=None,
                        help="for a base model without one: gemma-turns | plain | a .jinja file (as model.chat_template)")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="counted micro-steps per variant (after 1 warm-up)")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=2048, help="tokens per micro-batch (padded or packed)")
    parser.add_argument("--pack-length", type=int, default=None, help="packed row length (default: --max-length)")
    parser.add_argument("--max-anchors", type=int, default=96)
    parser.add_argument("--draft-vocab", type=int, default=16384)
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--only", action="append", default=None, metavar="VARIANT",
                        help="run only this online variant (its printed name; repeatable); implies --skip-offline")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir
    from omegaconf import DictConfig, open_dict

    from dart_infer.common.configs import configs_dir
    from dart_infer.data.conversations import load_conversations
    from dart_train.builders import (
        build_head,
        load_target,
        make_loader,
        make_state_source,
        settings_from_config,
        states_target_dtype,
        template_kwargs,
        vocab_mapping_fn,
    )
    from dart_train.data.dataset import build_dataset
    from dart_train.states.cache import cache_bytes_per_token
    from dart_train.trainer.engine import DartTrainer

    initialize_config_dir(config_dir=str(configs_dir()), version_base="1.3")

    def config(*overrides: str) -> DictConfig:
        cfg = compose(config_name="train", overrides=[*base_overrides(args), *overrides])
        with open_dict(cfg):  # set here, not as an override: a Jinja string would need Hydra quoting
            cfg.model.chat_template = args.chat_template
        return cfg

    targets: dict[object, tuple] = {}  # (target, tokenizer, embedding) per states dtype: loaded once each

    def target_for(cfg: DictConfig) -> tuple:
        dtype = states_target_dtype(cfg)
        if dtype not in targets:
            targets[dtype] = load_target(cfg)
        return targets[dtype]

    base = config(*BF16)
    _, tokenizer, _ = target_for(base)
    conversations = load_conversations(str(base.data.source), split=base.data.split, limit=base.data.limit)
    dataset = build_dataset(conversations, tokenizer, int(base.preprocess.max_length), template_kwargs=template_kwargs(base))
    pack_length = max(args.pack_length or args.max_length, max(dataset.lengths))

    def trainer(cfg: DictConfig, run_dir: Path, source: object = None, labels_only: bool = True) -> DartTrainer:
        target, _, embedding = target_for(cfg)
        if source is None:
            source = make_state_source(cfg, target, dataset, run_dir)
            # dart-train computes soft labels only where training reads them; False: every position
            # (what it did before), which no config key selects.
            source.labels_only = labels_only
        head = build_head(target, cfg, vocab_mapping_fn(cfg, dataset, tokenizer, target.vocab_size), embedding)
        return DartTrainer(head, source, make_loader(cfg, dataset, tokenizer), settings_from_config(cfg), run_dir)

    def batches(loader):
        while True:
            yield from loader

    def interleaved(variants: dict[str, DartTrainer]) -> dict[str, dict[str, float]]:
        streams = {name: batches(t.loader) for name, t in variants.items()}
        times: dict[str, list[float]] = {name: [] for name in variants}
        tokens: dict[str, list[int]] = {name: [] for name in variants}
        states = {name: 0.0 for name in variants}
        for step in range(args.steps + 1):
            for name, t in variants.items():
                batch = next(streams[name])
                before = dict(t.timings)
                started = time.perf_counter()
                t._micro_step(batch)
                if step == 0:
                    continue  # warm-up
                times[name].append(time.perf_counter() - started)
                tokens[name].append(int(batch["attention_mask"].sum()))
                states[name] += t.timings["states"] - before["states"]
        out = {}
        for name in variants:
            seconds = sum(times[name])
            out[name] = {
                "tokens_per_s": sum(tokens[name]) / seconds,
                "states_share": states[name] / seconds,
                "median_step_s": statistics.median(times[name]),
                "real_tokens_per_step": sum(tokens[name]) / len(tokens[name]),
            }
            print(f"{name:28s} {out[name]['tokens_per_s']:7.0f} tok/s  states {out[name]['states_share']:.0%}  "
                  f"{out[name]['real_tokens_per_step']:.0f} real tokens/step", flush=True)
        return out

    results: dict[str, object] = {
        "sequences": len(dataset), "tokens": sum(dataset.lengths), "threads": torch.get_num_threads(),
        "args": vars(args),
    }
    print(f"# {len(dataset)} sequences, {sum(dataset.lengths)} tokens, threads={torch.get_num_threads()}, "
          f"rows of {pack_length} tokens", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        variants = {  # built lazily: --only skips the others' set-up
            name: (lambda overrides=overrides, labels=labels, run=tmp_path / f"online{i}":
                   trainer(config(*overrides), run, labels_only=labels))
            for i, (name, (overrides, labels)) in enumerate(ONLINE.items())
        }
        unknown = set(args.only or ()) - set(variants)
        if unknown:
            raise SystemExit(f"--only: no such variant {sorted(unknown)}; the variants: {list(variants)}")
        online = interleaved({name: make() for name, make in variants.items() if not args.only or name in args.only})
        results["online"] = online
        if OLD in online and NEW in online:
            ratio = online[NEW]["tokens_per_s"] / online[OLD]["tokens_per_s"]
            results["online_new_over_old"] = ratio
            print(f"online new/old: {ratio:.2f}x", flush=True)
        if not args.skip_offline and not args.only:
            offline_cfg = config(*BF16, "states=offline", f"states.cache_dir={tmp_path / 'cache'}")
            started = time.perf_counter()
            cache = make_state_source(offline_cfg, target_for(offline_cfg)[0], dataset, tmp_path)  # precomputes
            seconds = time.perf_counter() - started
            results["precompute"] = {"seconds": seconds, "tokens_per_s": sum(dataset.lengths) / seconds,
                                     "bytes_per_token": cache_bytes_per_token(cache.manifest)}
            print(f"precompute (bf16 target): {results['precompute']}", flush=True)
            offline = interleaved({
                name: trainer(config(*BF16, "states=offline", f"states.cache_dir={tmp_path / 'cache'}", *overrides),
                              tmp_path / f"offline{i}", source=cache)
                for i, (name, overrides) in enumerate(OFFLINE.items())
            })
            results["offline"] = offline
            ratio = offline["offline NEW packed/autocast"]["tokens_per_s"] / offline["offline OLD buckets/fp32"]["tokens_per_s"]
            results["offline_new_over_old"] = ratio
            print(f"offline new/old: {ratio:.2f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
