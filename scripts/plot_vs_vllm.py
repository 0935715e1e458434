"""Tokens/s of every method as a multiple of vLLM's plain decoding, per benchmark, from a `dart-eval`
run that included the `vllm` method (its results.json): the README's engine plot.

    python scripts/plot_vs_vllm.py runs/eval/engines2_2026-12-03/results.json docs/results/engines_vs_vllm.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

NAMES = {  # dart-eval labels -> what a reader recognises
    "hf_generate@fp32": "HF generate fp32", "hf_generate": "HF generate bf16", "ar@fp32": "our AR fp32",
    "ar": "our AR bf16", "vllm": "vLLM plain", "vllm_ngram": "vLLM prompt lookup",
    "vllm_eagle3": "vLLM + our EAGLE-3 head", "vllm_dart": "vLLM + our DART head (plugin)",
    "eagle3": "our EAGLE-3 loop", "prompt_lookup": "HF prompt lookup", "dart_no_trie": "our DART, no trie",
    "dart": "our DART loop",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="a dart-eval results.json with the vllm method")
    parser.add_argument("out", type=Path, help="the .png to write")
    parser.add_argument("--setting", default="T=0")
    args = parser.parse_args()
    summary = json.loads(args.results.read_text())["summary"]
    benchmarks = [b for b in summary if "vllm" in summary[b].get(args.setting, {})]
    if not benchmarks:
        raise SystemExit(f"{args.results}: no benchmark has the vllm method at {args.setting}; run dart-eval with it")
    labels = [label for label in NAMES if any(label in summary[b][args.setting] for b in benchmarks)]
    fig, ax = plt.subplots(figsize=(11, 4.2))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        ratios = [summary[b][args.setting][label]["tokens_per_second"] / summary[b][args.setting]["vllm"]["tokens_per_second"]
                  if label in summary[b][args.setting] else 0.0 for b in benchmarks]
        bars = ax.bar([j + i * width for j in range(len(benchmarks))], ratios, width, label=NAMES[label])
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(benchmarks))], benchmarks)
    ax.set_ylabel("tokens/s ÷ vLLM plain (same run)")
    ax.set_title("Greedy decoding on this CPU, methods interleaved per prompt")
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
