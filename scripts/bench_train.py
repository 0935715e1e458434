"""Training throughput of a DART head on this machine: online vs offline target states.

    python scripts/bench_train.py [--conversations 16] [--steps 6] [--max-length 512] [--autocast bf16]

Loads SmolLM2-135M-Instruct (embedded) and ShareGPT train conversations, then trains a fresh head
with the real DeepSpeed engine for a few optimiser steps in each mode:
- online: the frozen target runs on every batch (`OnlineStateSource`);
- offline: the states are precomputed once into a sharded cache (`precompute_states`, timed
  separately, bytes per token reported) and training reads them (`OfflineStateSource`).
Prints tokens/s (real tokens of the training batches per second of training steps) and the share
of step time spent getting target states vs the draft head's forward + backward + optimiser step.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=2048, help="padded tokens per micro-batch")
    parser.add_argument("--max-anchors", type=int, default=64)
    parser.add_argument("--draft-vocab", type=int, default=16384)
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--autocast", choices=["none", "bf16"], default="none", help="target autocast")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dart_infer.assets import resolve_model
    from dart_infer.conversations import load_conversations
    from dart_infer.model import DartDraftConfig, DartDraftModel
    from dart_infer.target import TargetModel
    from dart_train.data import LengthBucketBatchSampler, ResumableLoader, build_dataset, build_vocab_mapping
    from dart_train.engine import DartTrainer, TrainSettings
    from dart_train.states import (
        OfflineStateSource,
        OnlineStateSource,
        cache_bytes_per_token,
        precompute_states,
    )

    path = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    target = TargetModel(model)
    dataset = build_dataset(
        load_conversations("sharegpt", split="train", limit=args.conversations), tokenizer, args.max_length
    )
    mapping = build_vocab_mapping(dataset.sequences, target.vocab_size, args.draft_vocab)
    autocast = torch.bfloat16 if args.autocast == "bf16" else None
    print(f"# {len(dataset)} sequences, {sum(dataset.lengths)} tokens, threads={torch.get_num_threads()}")

    def run(source, run_dir: Path) -> dict:
        torch.manual_seed(0)
        config = DartDraftConfig.from_target_config(model.config, draft_length=8, draft_vocab_size=args.draft_vocab)
        head = DartDraftModel(config)
        head.set_target_embedding(target.embedding_weight)
        head.set_vocab_mapping(mapping)
        loader = ResumableLoader(dataset, LengthBucketBatchSampler(dataset.lengths, max_tokens=args.max_tokens, seed=0))
        settings = TrainSettings(max_steps=args.steps, grad_accum=1, max_anchors=args.max_anchors, progress=False,
                                 log_every=1, warmup_steps=1)
        trainer = DartTrainer(head, source, loader, settings, run_dir)
        trainer.train()
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        tokens = sum(x["tokens"] for x in lines[1:])  # step 1 includes one-time warm-up
        seconds = sum(x["tokens"] / x["tokens_per_s"] for x in lines[1:])
        total = trainer.timings["states"] + trainer.timings["draft"]
        return {
            "tokens_per_s": tokens / seconds,
            "states_share": trainer.timings["states"] / total,
            "draft_share": trainer.timings["draft"] / total,
            "final_loss": lines[-1]["loss"],
        }

    results: dict[str, object] = {"sequences": len(dataset), "tokens": sum(dataset.lengths), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        online = OnlineStateSource(target, topk=args.topk, autocast_dtype=autocast)
        results["online"] = run(online, tmp_path / "online")
        print(f"online : {results['online']}")
        started = time.perf_counter()
        manifest = precompute_states(target, dataset, tmp_path / "cache", topk=args.topk, autocast_dtype=autocast,
                                     progress=False)
        seconds = time.perf_counter() - started
        results["precompute"] = {
            "seconds": seconds,
            "tokens_per_s": sum(dataset.lengths) / seconds,
            "bytes_per_token": cache_bytes_per_token(manifest),
        }
        print(f"precompute: {results['precompute']}")
        offline = OfflineStateSource(tmp_path / "cache", dataset)
        results["offline"] = run(offline, tmp_path / "offline")
        print(f"offline: {results['offline']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
