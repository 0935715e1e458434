"""`dart-eval action=fit_tree`: the tree size that is fastest on this machine, measured."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from dart_infer.decoding.dart_model import DartModel

log = logging.getLogger(__name__)


def fit_tree(
    model: DartModel,
    prompts: Sequence[torch.Tensor],
    grid: Sequence[dict[str, int]],
    max_new_tokens: int,
) -> list[dict[str, Any]]:
    """Measure DART's speedup over AR on this machine for each tree setting; best first.

    A GPU verifies 60 nodes for about the cost of one; a CPU does not, so the tree that maximises
    speedup depends on the hardware and has to be measured. Each setting is timed against AR runs
    interleaved with its own, prompt by prompt, so drift of the machine's speed cancels in the ratio.
    The settings are those of the model's head's method: a model with an EAGLE-3 head is fitted the
    same way over its dynamic tree's settings (top_k, depth, total_tokens).
    """
    for setting in grid:
        model.tree.with_overrides(setting)  # validates names and values before timing
    speculative = model.dart_generate
    results = []
    # Warm-up: first calls pay one-time kernel and allocator set-up that would flatter the later ones.
    model.ar_generate(prompts[0], max_new_token_num=8)
    speculative(prompts[0], max_new_token_num=8)
    for setting in grid:
        stats: dict[str, list[Any]] = {"ar": [], "dart": []}
        for i, ids in enumerate(prompts):
            for kind in ("ar", "dart") if i % 2 == 0 else ("dart", "ar"):  # alternate which goes first
                generate = model.ar_generate if kind == "ar" else partial(speculative, tree=setting)
                stats[kind].append(generate(ids, max_new_token_num=max_new_tokens, return_stats=True)[1])
        ar, dart = stats["ar"], stats["dart"]
        rate = sum(s.new_tokens for s in dart) / sum(s.wall_time for s in dart)
        speedup = rate / (sum(s.new_tokens for s in ar) / sum(s.wall_time for s in ar))
        tau = sum(sum(s.emitted) for s in dart) / sum(s.steps for s in dart)
        nodes = sum(sum(s.tree_sizes) for s in dart) / max(1, sum(len(s.tree_sizes) for s in dart))
        results.append({**setting, "tau": tau, "tree_nodes": nodes, "tokens_per_second": rate,
                        "speedup_vs_ar": speedup})
        log.info("tree %s: τ %.2f, %.1f tok/s, %.2f× AR", setting, tau, rate, speedup)
    return sorted(results, key=lambda r: r["speedup_vs_ar"], reverse=True)


def tree_sizes(model: DartModel, grid: Sequence[dict[str, int]]) -> tuple[int, ...]:
    """The node counts a compiled target (`compile_decoding(model, tree_sizes=...)`) needs so that every
    setting of `grid` is verified as it would be served on its own: each setting's usual tree and its
    largest one (DART: the kept nodes, and those plus a copy span)."""
    sizes: set[int] = set()
    for setting in grid:
        sizes |= model.method.padded_tree_sizes(model.tree.with_overrides(setting))
    return tuple(sorted(sizes))
