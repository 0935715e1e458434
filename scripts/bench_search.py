"""Benchmark of the C++ tree search on the golden inputs (8 levels x top-25, beam 20, keep 60).

Prints the median µs per search, with and without the n-gram trie, and with a context n-gram
model (`--context-weight`; its history: one of the trie's documents, up to 2,000 tokens, then the
case's prompt), through the public API (`dart_infer.tree.search.tree_search` on torch tensors) and
through the bare binding (numpy in/out), next to the original implementation's 1.9 ms
(measured on a 2-core Xeon, docs/results/measured.md); then the per-step cost of keeping a context model up to date
(`ContextNgram.sync` with 4 new tokens).

    python scripts/bench_search.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from dart_infer import _search
from dart_infer.tree.search import ContextNgram, tree_search

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
ORIGINAL_US = 1900.0  # anchors.md: the original's tree search, same inputs and settings, this machine
EOS = 2


def load_trie(source: str):
    """The golden trie, built from the 60 documents or loaded from the original's file; None if the
    n-gram package is not available."""
    try:
        from ngram_builder import NgramTrie
    except ImportError:
        return None
    if source == "loaded":
        return NgramTrie.load_dart(str(FIXTURES / "golden60.trie"))
    spec = json.loads((FIXTURES / "golden60_docs.json").read_text())
    trie = NgramTrie(order=spec["order"])
    for doc in spec["docs"]:
        trie.add_tokens(doc)
    return trie


def time_calls(call, cases: list, repeats: int) -> tuple[list[float], list[float]]:
    """Per-call wall-clock and thread-CPU µs (CPU time is robust to other jobs sharing the cores)."""
    for case in cases[:20]:  # warm-up: buffers, caches
        call(case)
    wall, cpu = [], []
    for _ in range(repeats):
        for case in cases:
            start_cpu = time.thread_time_ns()
            start = time.perf_counter_ns()
            call(case)
            wall.append((time.perf_counter_ns() - start) / 1000.0)
            cpu.append((time.thread_time_ns() - start_cpu) / 1000.0)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="passes over the 200 golden cases")
    parser.add_argument("--trie", choices=["built", "loaded"], default="built", help="golden trie source")
    parser.add_argument("--context-weight", type=float, default=0.3, help="context n-gram weight (0: skip)")
    args = parser.parse_args()
    docs = json.loads((FIXTURES / "golden60_docs.json").read_text())["docs"]

    rows = [json.loads(line) for line in (FIXTURES / "golden60_search.jsonl").open()]
    cases = [
        {
            "tokens": torch.tensor(row["topk_tokens"], dtype=torch.int64),
            "probs": torch.tensor(row["topk_probs"], dtype=torch.float32),
            "prompt": torch.tensor(row["prompt"], dtype=torch.int64),
        }
        for row in rows
    ]
    for index, case in enumerate(cases):
        case["np"] = (case["tokens"].numpy(), case["probs"].numpy(), case["prompt"].numpy())
        case["history"] = torch.tensor(docs[index % len(docs)][:2000] + case["prompt"].tolist())
        case["context"] = ContextNgram(3, case["history"])
    trie = load_trie(args.trie)

    # (name, trie, ngram_weight, context_weight)
    modes = [("no trie (ngram_weight=0)", None, 0.0, 0.0)]
    if trie is not None:
        modes.append((f"trie ({args.trie}, ngram_weight=0.5)", trie, 0.5, 0.0))
    else:
        print("ngram_builder.NgramTrie is not available: timing the no-trie mode only")
    if args.context_weight > 0:
        modes.append((f"context only (w={args.context_weight:g})", None, 0.5, args.context_weight))
        if trie is not None:
            modes.append((f"trie + context (w={args.context_weight:g})", trie, 0.5, args.context_weight))

    print(f"torch threads: {torch.get_num_threads()}; {len(cases)} cases x {args.repeats} repeats")
    print(
        f"{'mode':36s} {'path':20s} {'wall median µs':>15s} {'p10':>7s} {'p90':>7s} "
        f"{'CPU median µs':>14s} {'vs original 1.9 ms':>19s}"
    )
    for name, mode_trie, weight, context_weight in modes:

        def api_call(case, mode_trie=mode_trie, weight=weight, context_weight=context_weight):
            return tree_search(
                case["tokens"],
                case["probs"],
                mode_trie,
                case["history"] if context_weight > 0 else case["prompt"],
                eos_token_id=EOS,
                ngram_weight=weight,
                context=case["context"] if context_weight > 0 else None,
                context_weight=context_weight,
            )

        def binding_call(case, mode_trie=mode_trie, weight=weight, context_weight=context_weight):
            tokens, probs, prompt = case["np"]
            if context_weight > 0:
                # ..., context model, context_weight, context_propose
                return _search.search(tokens, probs, mode_trie, case["history"].numpy(), EOS, 20, 60, weight,
                                      None, None, False, 0, case["context"], context_weight, True)
            # eos, beam_width, remain_total, ngram_weight, level/logit weights, first level, vocab
            return _search.search(tokens, probs, mode_trie, prompt, EOS, 20, 60, weight, None, None, False, 0)

        for path, call in (("tree_search (torch)", api_call), ("_search (numpy)", binding_call)):
            wall, cpu = time_calls(call, cases, args.repeats)
            median = statistics.median(wall)
            p10, p90 = np.percentile(wall, [10, 90])
            cpu_median = statistics.median(cpu)
            print(
                f"{name:36s} {path:20s} {median:15.1f} {p10:7.1f} {p90:7.1f} {cpu_median:14.1f} "
                f"{ORIGINAL_US / median:18.1f}x"
            )

    if args.context_weight > 0:
        # One decoding step's update: the history grows by 4 tokens (a typical acceptance + bonus).
        stream = torch.tensor([token for doc in docs for token in doc])
        model, end = ContextNgram(3), 0
        wall = []
        for _ in range(min(len(stream) // 4, 20000)):
            end += 4
            start = time.perf_counter_ns()
            model.sync(stream[:end])
            wall.append((time.perf_counter_ns() - start) / 1000.0)
        print(f"context sync, +4 tokens per step (model grows to {end} tokens): median {statistics.median(wall):.1f} µs")


if __name__ == "__main__":
    main()
