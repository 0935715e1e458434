"""Training throughput of a DART head on this machine: the old and the new data paths, interleaved.

    python scripts/bench_train.py [--conversations 64] [--steps 8] [--max-length 1024] [--max-tokens 2048]

Loads SmolLM2-135M-Instruct (embedded) and ShareGPT train conversations, then trains fresh heads with
the real DeepSpeed engine, one micro-step of each variant in turn (the machine is noisy: interleaving
keeps drift out of the ratios; the first round is warm-up and not counted):
- online (the frozen target runs on every batch), target states from
    `autocast`  fp32 weights under bf16 autocast (the old default),
    `bf16`      a bf16 copy of the target (weights cast once: `states.target_dtype=auto` here),
  with padded length buckets (`buckets`) or packed rows (`packed`, `trainer.pack_length`), and the
  head in fp32 or under bf16 autocast (`autocast`, `trainer.autocast=auto` here); `labels`: the
  target's top-k soft labels only at positions training reads (what `dart-train` does online);
  `compiled`: the target through torch.compile (`states.compile=true`; the warm-up round compiles);
- offline: states precomputed once with the bf16 target (timed; bytes per token reported), then
  training reads them: old (buckets, fp32 head) vs new (packed, autocast head).
Prints real (non-padding) tokens per second of micro-steps, the share of time getting target states,
and the ratios new/old measured in this run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


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

    from transformers import AutoModelForCausalLM

    from dart_infer.assets import resolve_model
    from dart_infer.conversations import load_conversations
    from dart_infer.dtypes import cast_parameters
    from dart_infer.loading import load_tokenizer
    from dart_infer.model import DartDraftConfig, DartDraftModel
    from dart_infer.target import TargetModel
    from dart_train.batching import LengthBucketBatchSampler, PackedBatchSampler, ResumableLoader
    from dart_train.dataset import build_dataset
    from dart_train.engine import DartTrainer, TrainSettings
    from dart_train.online_states import OnlineStateSource
    from dart_train.state_cache import cache_bytes_per_token
    from dart_train.state_cache_reader import OfflineStateSource
    from dart_train.state_cache_writer import precompute_states
    from dart_train.vocab import build_vocab_mapping

    path = resolve_model(args.model)
    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    embedding = fp32.get_input_embeddings().weight.detach()
    target_fp32 = TargetModel(fp32)
    target_bf16 = TargetModel(cast_parameters(copy.deepcopy(fp32), torch.bfloat16))  # as dart-train does
    tokenizer = load_tokenizer(path, args.chat_template)
    conversations = load_conversations("sharegpt", split="train", limit=args.conversations)
    dataset = build_dataset(conversations, tokenizer, args.max_length)
    mapping = build_vocab_mapping(dataset.sequences, target_fp32.vocab_size, args.draft_vocab)
    pack_length = max(args.pack_length or args.max_length, max(dataset.lengths))

    def sampler(kind: str):
        if kind == "packed":
            return PackedBatchSampler(dataset.lengths, row_tokens=pack_length,
                                      max_tokens=max(args.max_tokens, pack_length), seed=0)
        return LengthBucketBatchSampler(dataset.lengths, max_tokens=max(args.max_tokens, pack_length), seed=0)

    def trainer(source, kind: str, run_dir: Path, draft_autocast: str | None = None) -> DartTrainer:
        torch.manual_seed(0)
        config = DartDraftConfig.from_target_config(fp32.config, draft_length=8, draft_vocab_size=args.draft_vocab)
        head = DartDraftModel(config)
        head.set_target_embedding(embedding)
        head.set_vocab_mapping(mapping)
        settings = TrainSettings(max_steps=10**6, grad_accum=1, max_anchors=args.max_anchors, progress=False,
                                 log_every=10**6, warmup_steps=1, autocast_dtype=draft_autocast)
        return DartTrainer(head, source, ResumableLoader(dataset, sampler(kind)), settings, run_dir)

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
        autocast = OnlineStateSource(target_fp32, topk=args.topk, autocast_dtype=torch.bfloat16)
        bf16 = OnlineStateSource(target_bf16, topk=args.topk)
        bf16_labels = OnlineStateSource(target_bf16, topk=args.topk, labels_only=True)
        compiled = OnlineStateSource(target_bf16, topk=args.topk, labels_only=True, compile=True)
        old, new = "online OLD autocast/buckets/fp32", "online NEW bf16/packed/autocast/labels/compiled"
        variants = {  # built lazily: --only skips the others' set-up
            old: lambda: trainer(autocast, "buckets", tmp_path / "a"),
            "online bf16/buckets/fp32": lambda: trainer(bf16, "buckets", tmp_path / "b"),
            "online bf16/packed/fp32": lambda: trainer(bf16, "packed", tmp_path / "c"),
            "online bf16/packed/autocast": lambda: trainer(bf16, "packed", tmp_path / "d", "bfloat16"),
            "online bf16/packed/autocast/labels": lambda: trainer(bf16_labels, "packed", tmp_path / "g", "bfloat16"),
            new: lambda: trainer(compiled, "packed", tmp_path / "h", "bfloat16"),
        }
        unknown = set(args.only or ()) - set(variants)
        if unknown:
            raise SystemExit(f"--only: no such variant {sorted(unknown)}; the variants: {list(variants)}")
        online = interleaved({name: make() for name, make in variants.items() if not args.only or name in args.only})
        results["online"] = online
        if old in online and new in online:
            ratio = online[new]["tokens_per_s"] / online[old]["tokens_per_s"]
            results["online_new_over_old"] = ratio
            print(f"online new/old: {ratio:.2f}x", flush=True)
        if not args.skip_offline and not args.only:
            started = time.perf_counter()
            manifest = precompute_states(target_bf16, dataset, tmp_path / "cache", topk=args.topk, progress=False)
            seconds = time.perf_counter() - started
            results["precompute"] = {"seconds": seconds, "tokens_per_s": sum(dataset.lengths) / seconds,
                                     "bytes_per_token": cache_bytes_per_token(manifest)}
            print(f"precompute (bf16 target): {results['precompute']}", flush=True)
            cache = OfflineStateSource(tmp_path / "cache", dataset)
            offline = interleaved({
                "offline OLD buckets/fp32": trainer(cache, "buckets", tmp_path / "e"),
                "offline NEW packed/autocast": trainer(cache, "packed", tmp_path / "f", "bfloat16"),
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
