"""From a draft forward to token trees: the ONE path serving and simulated τ share.

`draft_trees` takes the draft head's logit rows (one [d, draft_vocab] block per decoding state),
keeps the top-k draft-vocabulary entries per row, maps them to target ids (d2t) with their softmax
over those k, and runs the C++ n-gram-enforced beam search (`dart_infer.tree.search.tree_search`) on the
token history of each state (ending with the root); with `shape="chain"` it keeps that search's best
path (`best_chain`, for engines that verify only a chain: vLLM). `DartModel.dart_generate` calls it once per
step; `dart_train.trainer.simulated_tau.SimulatedTau` once per batch of held-out anchors. Anything that changes
how candidates become a tree (extra candidate sources, scoring) belongs here, so both sides see it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from dart_infer.tree.search import ContextNgram

__all__ = [
    "CPU_FP32_TREE",
    "CPU_TREE",
    "TREE_SHAPES",
    "DraftTree",
    "TreeSearchSettings",
    "chain_tree",
    "copy_span",
    "default_tree",
    "draft_trees",
    "request_context",
    "tree_from_parents",
]


def with_field_overrides(settings: Any, overrides: Mapping[str, Any] | None, kind: str) -> Any:
    """A copy of the dataclass `settings` with the named fields replaced (None values are skipped);
    unknown names are a TypeError naming the known ones."""
    if not overrides:
        return settings
    known = {f.name for f in dataclasses.fields(settings)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"unknown {kind} settings {unknown}; known: {sorted(known)}")
    return dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})


COPY_SPAN_MAX_MATCH = 4  # the longest history suffix a copy span is matched on
TREE_SHAPES = ("tree", "chain")  # TreeSearchSettings.shape


@dataclass(frozen=True)
class TreeSearchSettings:
    """Knobs of the draft tree. The defaults are the paper's GPU setting (a 60-node tree); on a CPU
    verifying 60 nodes costs several single-token steps, so smaller trees are usually faster there.

    `shape="chain"` drafts one path instead of a tree (what an engine that verifies only a chain,
    vLLM, can take): the same n-gram-enforced beam search over the head's top-k rows, then its best
    path of depth K = min(remain_total, d) (`best_chain` says what "best" is); remain_total is
    then the chain's length bound, so a chain verifies 1 + min(K, d) nodes and a compiled target
    pads to 1 + remain_total (`DartMethod.max_tree_nodes`).
    Chains take no context n-grams or copy spans (set to anything but 0 they are refused).
    `draft_top_k=1` makes it the argmax chain (each row's argmax, what vLLM's own proposer drafts).
    """

    draft_top_k: int = 25  # candidates per draft position
    beam_width: int = 20
    # Nodes kept in the final tree (root excluded); with shape="chain" the chain's length bound K
    # (the chain has min(K, d) nodes, d = the head's draft length).
    remain_total: int = 60
    ngram_weight: float = 0.5
    level_weight: tuple[float, ...] | None = None  # per-level weights; None = search default (l+1)^-0.7
    logit_weight: tuple[float, ...] | None = None  # None = search default 0.9^l
    ngram_on_first_level: bool = False
    # Context n-grams (beyond the paper): the request's own n-gram model (prompt + tokens so far)
    # shares the n-gram term with the trie, p = (1 - w) * p_trie + w * p_context with
    # w = context_ngram_weight (0 = off: exactly the search without it); with
    # context_ngram_propose its most frequent continuation of each beam path joins the candidates.
    context_ngram_weight: float = 0.0
    context_ngram_order: int = 3  # 2..5: contexts of up to order - 1 tokens
    context_ngram_propose: bool = True
    # Copy spans (beyond the paper; prompt lookup inside the tree): when the last tokens of the
    # history (>= copy_span_min_match of them, longest match first, most recent occurrence) occurred
    # before, the up to copy_span_tokens tokens that followed join the tree as one more root path,
    # deeper than the draft's d levels where the copy is longer. 0 = off.
    copy_span_tokens: int = 0
    copy_span_min_match: int = 2
    # "tree" (the search's best remain_total nodes) or "chain" (its best path; see the class docstring).
    shape: str = "tree"

    def __post_init__(self) -> None:
        if self.shape not in TREE_SHAPES:
            raise ValueError(f"shape must be one of {', '.join(TREE_SHAPES)}, got {self.shape!r}")
        if self.shape == "chain" and (self.context_ngram_weight > 0 or self.copy_span_tokens > 0):
            raise ValueError(
                "shape=chain drafts from the head's rows and the trie only: set context_ngram_weight=0 and "
                f"copy_span_tokens=0 (got {self.context_ngram_weight} and {self.copy_span_tokens}; tree=chain does)"
            )
        for name in ("draft_top_k", "beam_width", "remain_total"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ngram_weight < 0:
            raise ValueError(f"ngram_weight must be >= 0, got {self.ngram_weight}")
        if not 0.0 <= self.context_ngram_weight <= 1.0:
            raise ValueError(f"context_ngram_weight must lie in [0, 1], got {self.context_ngram_weight}")
        if not 2 <= self.context_ngram_order <= 5:
            raise ValueError(f"context_ngram_order must be between 2 and 5, got {self.context_ngram_order}")
        if self.copy_span_tokens < 0:
            raise ValueError(f"copy_span_tokens must be >= 0 (0 = off), got {self.copy_span_tokens}")
        if not 1 <= self.copy_span_min_match <= COPY_SPAN_MAX_MATCH:
            raise ValueError(
                f"copy_span_min_match must be between 1 and {COPY_SPAN_MAX_MATCH}, got {self.copy_span_min_match}"
            )

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> TreeSearchSettings:
        return with_field_overrides(self, overrides, "tree-search")

    @classmethod
    def coerce(cls, tree: TreeSearchSettings | Mapping[str, Any] | None) -> TreeSearchSettings:
        """Settings from an instance, a mapping of field overrides, or None (the defaults)."""
        return tree if isinstance(tree, cls) else cls().with_overrides(dict(tree) if tree else None)


# The trees for CPUs, where verifying n nodes costs more the larger n (configs/tree/cpu.yaml and
# cpu-fp32.yaml), fitted with `dart-eval action=fit_tree` on ShareGPT train prompts with the shipped
# head (2-core AVX512-BF16 Xeon): in bfloat16 (a tree costs little more than one token) top-16, beam 4,
# 24 nodes, context n-grams at 0.3 and copy spans of up to 10 tokens after a 3-token match: 1.83x bf16
# AR against 1.58x without copy spans and 1.50x for the earlier 12-node tree; in float32 (every node
# costs) top-4, beam 4, 6 nodes with the same n-gram and copy settings: 1.04x fp32 AR.
CPU_TREE = TreeSearchSettings(
    draft_top_k=16, beam_width=4, remain_total=24, context_ngram_weight=0.3, copy_span_tokens=10, copy_span_min_match=3
)
CPU_FP32_TREE = dataclasses.replace(CPU_TREE, draft_top_k=4, remain_total=6)


def default_tree(device: torch.device | str, dtype: torch.dtype | None = None) -> TreeSearchSettings:
    """DART's tree unless a model is given one: on a CPU `CPU_FP32_TREE` for float32 and `CPU_TREE`
    otherwise (see their comment); the paper's 60-node tree on GPUs, where verifying 60 nodes costs
    about one token's forward. `dart-eval action=fit_tree` measures the best one for a machine and dtype."""
    if torch.device(device).type != "cpu":
        return TreeSearchSettings()
    return CPU_FP32_TREE if dtype == torch.float32 else CPU_TREE


@dataclass(frozen=True)
class DraftTree:
    """One token tree, as `tree_search` returns it (CPU tensors; node 0 is the root)."""

    tokens: torch.Tensor  # int64 [1 + n]
    retrieve_indices: torch.Tensor  # int64 [leaves, depth + 1], root-to-leaf node indices, -1 padded
    mask: torch.Tensor  # bool [1 + n, 1 + n], ancestor-or-self
    positions: torch.Tensor  # int64 [1 + n], depth of each node
    parents: torch.Tensor  # int64 [1 + n], -1 for the root


def tree_from_parents(tokens: Sequence[int], parents: Sequence[int], positions: Sequence[int]) -> DraftTree:
    """A `DraftTree` from per-node lists: node 0 is the root (parent -1) and every parent comes
    before its children (the order verification, keep-path and the acceptance rules rely on)."""
    n = len(tokens)
    node_parents = torch.tensor(parents, dtype=torch.long)
    if n == 0 or len(parents) != n or len(positions) != n or parents[0] != -1:
        raise ValueError("a tree needs a root (node 0, parent -1) and one parent and position per node")
    if any(not 0 <= parents[i] < i for i in range(1, n)):
        raise ValueError(f"every parent must come before its child, got parents {list(parents)}")
    mask = torch.eye(n, dtype=torch.bool)
    for node in range(1, n):  # parents come first: copy the parent's row
        mask[node] |= mask[parents[node]]
    has_child = torch.zeros(n, dtype=torch.bool)
    has_child[node_parents[1:]] = True
    leaves = (~has_child).nonzero().flatten().tolist()
    node_positions = torch.tensor(positions, dtype=torch.long)
    retrieve = torch.full((len(leaves), int(node_positions.max()) + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        path = mask[leaf].nonzero().flatten()  # ancestors in node order = root-to-leaf order
        retrieve[row, : path.numel()] = path
    return DraftTree(torch.tensor(tokens, dtype=torch.long), retrieve, mask, node_positions, node_parents)


def copy_span(history: torch.Tensor, max_tokens: int, min_match: int) -> list[int]:
    """At most `max_tokens` tokens that followed an earlier occurrence of the history's last n tokens
    (n from `COPY_SPAN_MAX_MATCH` down to `min_match`, longest first; the most recent occurrence
    followed by `max_tokens` tokens, else the oldest); [] when no suffix of >= min_match tokens
    occurred before. Prompt lookup's proposal, over prompt + output."""
    tokens = history.numpy() if isinstance(history, torch.Tensor) else np.asarray(history)
    length = tokens.shape[0]
    for n in range(min(COPY_SPAN_MAX_MATCH, length - 1), min_match - 1, -1):
        # Windows that start before length - n, so at least one token follows the match.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            # The most recent occurrence with max_tokens after it; else the oldest (the longest copy:
            # in a loop the latest one is a period back and its copy ends where the history does).
            full = hits[hits <= length - n - max_tokens]
            start = int(full[-1] if full.size else hits[0]) + n
            return tokens[start : start + max_tokens].tolist()
    return []


def with_copy_span(tree: DraftTree, span: Sequence[int]) -> DraftTree:
    """`tree` with `span` (the tokens expected after the root) as one more root path: the span
    follows the tree's nodes as far as they hold its tokens and continues as a new chain."""
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    node, matched = 0, 0
    while matched < len(span):
        token = span[matched]
        child = next((c for c in range(node + 1, len(tokens)) if parents[c] == node and tokens[c] == token), None)
        if child is None:
            break
        node, matched = child, matched + 1
    if matched == len(span):
        return tree  # the whole span is already a path of the tree
    positions = tree.positions.tolist()
    for token in span[matched:]:
        tokens.append(token)
        parents.append(node)
        positions.append(positions[node] + 1)
        node = len(tokens) - 1
    return tree_from_parents(tokens, parents, positions)


def chain_tree(history: torch.Tensor | Sequence[int], chain: Sequence[int]) -> DraftTree:
    """The `DraftTree` of a chain: the root (the history's last token), then `chain`, each node the
    child of the one before (one leaf, depth = position)."""
    root = int(history[-1])
    n = 1 + len(chain)
    tokens = torch.tensor([root, *chain], dtype=torch.long)
    retrieve = torch.arange(n, dtype=torch.long)[None]
    mask = torch.ones(n, n, dtype=torch.bool).tril_()
    positions = torch.arange(n, dtype=torch.long)
    parents = torch.arange(-1, n - 1, dtype=torch.long)
    return DraftTree(tokens, retrieve, mask, positions, parents)


def request_context(settings: TreeSearchSettings) -> ContextNgram | None:
    """A new request's context n-gram model (None when `settings` leave it off): serving makes one
    per request and passes it to every `draft_trees` call, which brings it up to date."""
    if settings.context_ngram_weight <= 0:
        return None
    from dart_infer.tree.search import ContextNgram  # C++ extension; imported when first needed

    return ContextNgram(settings.context_ngram_order)


def draft_trees(
    draft_logits: torch.Tensor,
    draft_model: Any,
    histories: Sequence[torch.Tensor],
    *,
    trie: Any,
    settings: TreeSearchSettings,
    eos_token_ids: Sequence[int],
    contexts: Sequence[ContextNgram | None] | None = None,
) -> list[DraftTree]:
    """One tree per decoding state from the draft head's logits (a chain, a tree of one path, with
    `settings.shape == "chain"`: `best_chain`).

    draft_logits: [N, d, draft_vocab], the d rows of N states (any device). draft_model: the
    `DartDraftModel` (its d2t maps draft ids to target ids). histories: N 1-D CPU token tensors,
    each the tokens so far ending with that state's root (only the last order - 1 are read, and
    with context n-grams the ones the context model has not seen yet).
    trie: an `ngram_builder.NgramTrie` or None (no trie term). eos_token_ids: the model's EOS
    set (`dart_infer.data.loaders.eos_token_ids`); paths ending in its first id go last in the beam.
    contexts: with `settings.context_ngram_weight` > 0, each state's context n-gram model
    (`request_context`, kept across a request's steps), synced here with its history (only new
    tokens are added); a missing one (None, or no list) is built from the whole history
    (simulated τ: each anchor's prefix). Ignored when the weight is 0.
    """
    from dart_infer.tree.chain import best_chain
    from dart_infer.tree.search import (  # C++: loaded when first needed
        ContextNgram,
        search_arguments,
        tree_search,
    )

    if draft_logits.dim() != 3 or draft_logits.shape[0] != len(histories):
        raise ValueError(
            f"draft_logits must be [N, d, vocab] with one history per state, got {tuple(draft_logits.shape)} "
            f"and {len(histories)} histories"
        )
    use_context = settings.context_ngram_weight > 0
    models: list[ContextNgram | None] = [None] * len(histories)
    if use_context:
        if contexts is not None and len(contexts) != len(histories):
            raise ValueError(f"got {len(contexts)} context models for {len(histories)} histories")
        for i, history in enumerate(histories):
            model = contexts[i] if contexts is not None else None
            if model is None:
                model = ContextNgram(settings.context_ngram_order)
            elif model.order != settings.context_ngram_order:
                raise ValueError(
                    f"context model of order {model.order}, but context_ngram_order={settings.context_ngram_order}"
                )
            model.sync(history)
            models[i] = model
    top = torch.topk(draft_logits.float(), min(settings.draft_top_k, draft_logits.shape[-1]), dim=-1)
    candidates = draft_model.draft_to_target(top.indices).cpu()
    probs = torch.softmax(top.values, dim=-1).cpu()
    eos_token_id = eos_token_ids[0] if eos_token_ids else None
    if settings.shape == "chain":  # the search's best path (no context n-grams, no copy spans: refused)
        return [
            chain_tree(history, best_chain(candidates[i], probs[i], trie, history, settings=settings,
                                           eos_token_id=eos_token_id))
            for i, history in enumerate(histories)
        ]
    search_kwargs = search_arguments(settings, trie, eos_token_id)
    trees = [
        DraftTree(
            *tree_search(
                candidates[i], probs[i], trie, history, return_parents=True, context=models[i], **search_kwargs
            )
        )
        for i, history in enumerate(histories)
    ]
    if settings.copy_span_tokens > 0:
        for i, history in enumerate(histories):
            span = copy_span(history, settings.copy_span_tokens, settings.copy_span_min_match)
            if span:
                trees[i] = with_copy_span(trees[i], span)
    return trees
