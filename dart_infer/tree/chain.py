"""A draft chain: the n-gram-enforced beam search's best path (`best_chain`), for engines that
verify only a chain (vLLM) and for `TreeSearchSettings(shape="chain")` in our loop."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["best_chain", "best_path", "chain_search_nodes"]


def chain_search_nodes(levels: int, k: int, beam_width: int) -> int:
    """The number of nodes the search generates over `levels` rows of `k` candidates (no context
    proposals): all of them are kept for a chain, so its deepest node is the best of its level."""
    total, parents = 0, 1
    for _ in range(levels):
        children = parents * k
        total += children
        parents = min(children, beam_width)
    return total


def best_path(parents: Sequence[int] | torch.Tensor, positions: Sequence[int] | torch.Tensor) -> list[int]:
    """Node indices root (0) .. best node of a `tree_search` result: the best node is the first one
    of the deepest level, i.e. the highest-scoring one there (nodes come sorted by depth, then by
    descending score). `parents`: each node's parent (-1 for the root); `positions`: its depth."""
    parents = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    positions = positions.tolist() if isinstance(positions, torch.Tensor) else list(positions)
    deepest = max(positions)
    node = positions.index(deepest)
    path = [node]
    while parents[node] >= 0:
        node = parents[node]
        path.append(node)
    return path[::-1]


def best_chain(
    topk_tokens: torch.Tensor | np.ndarray,
    topk_probs: torch.Tensor | np.ndarray,
    trie: Any,
    history: torch.Tensor | np.ndarray | Sequence[int],
    *,
    settings: Any,
    eos_token_id: int | None,
) -> list[int]:
    """The chain's tokens after the root: the best path of depth K = min(settings.remain_total, d)
    of the n-gram-enforced beam search. THE definition of a chain, for our loop
    (`TreeSearchSettings(shape="chain")` through `draft_trees`) and a vLLM proposer alike.

    "Best": the search's node score is its path's cumulative score (draft log-probability plus
    n-gram term, per-level weights), so a child never outscores its parent and "the highest score
    of all nodes" would always be a depth-1 node. The chain is the beam search's own answer at
    depth K instead: the highest-scoring path of depth K the beam reached (ties: the search's order,
    lower node index first; a path ending in EOS is not put last here: a chain may end there). To
    read it off the search's result the search runs over the first K rows only (a level's beam
    depends only on the levels above it, so these nodes are exactly the full search's) and keeps
    every node it generates (`chain_search_nodes`); its output is sorted by depth, then by
    descending score, so the chain ends at the first node of the deepest level (`best_path`).
    Without a trie the score is a weighted sum of per-row draft log-probabilities, so the chain is
    the per-row argmax chain (unless a row's argmax is EOS and the beam drops that path); with
    draft_top_k=1 each row has one candidate: exactly the argmax chain, trie or not.

    topk_tokens / topk_probs: [d, k] target ids and their softmax per row, as `tree_search` takes
    them (`draft_trees` makes them from the head's logits); trie: an `NgramTrie` or None; history:
    the tokens so far ending with the root. `settings`: draft_top_k is already applied to the rows;
    beam_width, ngram_weight, level/logit weights and ngram_on_first_level shape the search,
    remain_total is K; its context n-gram and copy-span fields are not read (a chain has none)."""
    from dart_infer.tree.search import (  # C++ extension: loaded when first needed
        search_arguments,
        tree_search,
    )

    depth, k = int(topk_tokens.shape[0]), int(topk_tokens.shape[1])
    levels = min(settings.remain_total, depth)
    kwargs = search_arguments(settings, trie, eos_token_id)
    kwargs.update(remain_total=chain_search_nodes(levels, k, settings.beam_width), context_weight=0.0)
    for name in ("level_weight", "logit_weight"):
        if name in kwargs:
            kwargs[name] = kwargs[name][:levels]
    tokens, _, _, positions, parents = tree_search(
        topk_tokens[:levels], topk_probs[:levels], trie, history, return_parents=True, **kwargs
    )
    tokens = tokens.tolist()
    return [tokens[node] for node in best_path(parents, positions)[1:]]

