"""Short A/B training runs at an equal token budget, each scored by held-out simulated τ.

    python scripts/recipe_ab.py --out runs/ab --steps 150 \
        --train-data runs/regenerated/sharegpt-train-first-turns.jsonl \
        --eval-data runs/regenerated/sharegpt-heldout-first-turns.jsonl \
        --trie runs/ngram/sharegpt/full.ngt [--only base,lr3e-3] [--extra optim.warmup_steps=20]

Every variant is the base recipe plus a few `dart-train` overrides (VARIANTS below), trained for the
same number of optimiser steps of `trainer.max_tokens` packed tokens, so every run sees the same
number of tokens. τ is simulated on held-out conversations the target answered itself (greedy), where
it equals what serving measures (docs/reference-head.md). Runs already finished
(their `summary.json` exists) are not repeated; a killed run resumes. Prints and writes a table
(`<out>/ab.md`, `<out>/ab.json`) of τ, α_1, loss, tokens and seconds per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# name -> overrides on top of the base recipe (one factor at a time)
VARIANTS: dict[str, list[str]] = {
    "base": [],
    "sharegpt-original": ["data=sharegpt"],  # ShareGPT's (ChatGPT) answers instead of the target's own
    "lr3e-3": ["optim.lr=3e-3"],
    "lr3e-4": ["optim.lr=3e-4"],
    "init-output": ["draft.init_output_from_target=true"],
    "anchors192": ["trainer.max_anchors=192"],
    "anchors48": ["trainer.max_anchors=48"],
    "vocab32k": ["draft.draft_vocab_size=32768"],
    # conversations cut at 512 / 2,048 tokens (rows stay trainer.max_tokens = 2,048 packed tokens)
    "maxlen512": ["preprocess.max_length=512"],
    "maxlen2048": ["preprocess.max_length=2048"],
}


def base_overrides(args: argparse.Namespace, run_dir: Path) -> list[str]:
    data = ["data=sharegpt"] if args.train_data == "sharegpt" else ["data=jsonl", f"data.source={args.train_data}"]
    return [
        f"output_dir={run_dir}", *data,
        "preprocess.max_length=1024", "trainer.max_tokens=2048", "trainer.grad_accum=1",
        f"trainer.max_steps={args.steps}", "trainer.max_anchors=96", f"trainer.save_every={args.steps}",
        "optim.lr=1e-3", "optim.warmup_steps=10",
        f"train_eval.source={args.eval_data}", "train_eval.split=null", f"train_eval.limit={args.eval_limit}",
        f"train_eval.every={args.steps}", f"train_eval.ngram_model={args.trie}",
        "logging.wandb.enabled=false", "logging.progress=false", "logging.log_every=10",
    ]


def result(run_dir: Path) -> dict[str, float] | None:
    metrics = run_dir / "metrics.jsonl"
    if not (run_dir / "summary.json").exists() or not metrics.exists():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/tau" in r]
    steps = [r for r in rows if "loss" in r and "eval/tau" not in r]
    if not evals:
        return None
    last = evals[-1]
    return {
        "tau": last["eval/tau"], "tau_target": last.get("eval/tau_target", float("nan")),
        "alpha_1": last.get("eval/alpha_1", float("nan")), "eval_loss": last.get("eval/loss", float("nan")),
        "train_loss": steps[-1]["loss"] if steps else float("nan"),
        # Rows are logged every log_every steps and describe that step: scale their mean to all steps.
        "tokens": steps[-1]["step"] * sum(r["tokens"] for r in steps) / len(steps) if steps else 0,
        "seconds": steps[-1]["step"] * sum(r["tokens"] / r["tokens_per_s"] for r in steps) / len(steps)
        if steps else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/ab"))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--train-data", required=True, help="a JSONL of conversations, or 'sharegpt' (train split)")
    parser.add_argument("--eval-data", required=True)
    parser.add_argument("--eval-limit", type=int, default=64)
    parser.add_argument("--trie", required=True)
    parser.add_argument("--only", default=None, help="comma-separated variant names (default: all)")
    parser.add_argument("--extra", action="append", default=[], help="an override added to every variant")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "WANDB_MODE": "disabled"}
    table = {}
    for name in names:
        run_dir = args.out / name
        if result(run_dir) is None:
            resume = ["resume=true"] if (run_dir / "config.yaml").exists() else []
            # the console script, not `python -m`: it preloads tcmalloc as users get it (dart_infer.allocator)
            command = [str(Path(sys.executable).parent / "dart-train"), *base_overrides(args, run_dir), *VARIANTS[name],
                       *args.extra, *resume, f"hydra.run.dir={run_dir / 'hydra'}"]
            print(f"# {name}: dart-train {' '.join(command[1:])}", flush=True)
            started = time.time()
            with open(args.out / f"{name}.log", "a") as log:
                done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
            if done.returncode != 0:
                print(f"# {name} failed (exit {done.returncode}), see {args.out / f'{name}.log'}", flush=True)
                continue
            print(f"# {name} done in {time.time() - started:.0f} s", flush=True)
        table[name] = {"overrides": VARIANTS[name], **(result(run_dir) or {})}
        row = table[name]
        print(f"{name:18s} tau {row.get('tau', float('nan')):.3f}  alpha_1 {row.get('alpha_1', float('nan')):.3f}  "
              f"train loss {row.get('train_loss', float('nan')):.3f}  {row.get('tokens', 0):,.0f} tokens", flush=True)
    (args.out / "ab.json").write_text(json.dumps(table, indent=2))
    lines = ["| variant | overrides | held-out τ | τ (target argmax) | α_1 | eval loss | train loss | tokens | train s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in table.items():
        lines.append(
            f"| {name} | {' '.join(row['overrides']) or '–'} | {row.get('tau', float('nan')):.3f} | "
            f"{row.get('tau_target', float('nan')):.3f} | {row.get('alpha_1', float('nan')):.3f} | "
            f"{row.get('eval_loss', float('nan')):.3f} | {row.get('train_loss', float('nan')):.3f} | "
            f"{row.get('tokens', 0):,.0f} | {row.get('seconds', 0):.0f} |"
        )
    (args.out / "ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
