"""DART's n-gram-enforced tree search (dart-method.md §4), one C++ call per decoding step.

The search runs in C++ (``dart_infer._search``) with the GIL released; this module only turns
tensors into numpy views and the results back into tensors (no copies of the inputs beyond a
dtype conversion when needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dart_infer import _search

__all__ = ["ContextNgram", "search_arguments", "tree_search"]

_TOKEN_DTYPES = (torch.int64, torch.int32)


def _numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a CPU tensor (one copy to the host for other devices)."""
    if tensor.requires_grad or not tensor.is_cpu:
        tensor = tensor.detach().cpu()
    return tensor.numpy()


def _tokens_array(tokens: Any, name: str) -> Any:
    """A numpy int32/int64 view of `tokens` (torch tensor, numpy array, or list for prompts)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype not in _TOKEN_DTYPES:
            if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
                raise ValueError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
            tokens = tokens.to(torch.int64)
        return _numpy_view(tokens)
    return tokens


def _probs_array(probs: Any) -> Any:
    """A numpy float32/float64 view of `probs`; other float dtypes are converted once."""
    if isinstance(probs, torch.Tensor):
        if not probs.dtype.is_floating_point:
            raise ValueError(f"topk_probs must be a floating-point tensor, got dtype {probs.dtype}")
        if probs.dtype not in (torch.float32, torch.float64):
            probs = probs.to(torch.float32)
        return _numpy_view(probs)
    if isinstance(probs, np.ndarray) and probs.dtype not in (np.float32, np.float64):
        if not np.issubdtype(probs.dtype, np.floating):
            raise ValueError(f"topk_probs must be floating point, got dtype {probs.dtype}")
        return probs.astype(np.float32)
    return probs


def _weights(weights: Sequence[float] | torch.Tensor | np.ndarray | None) -> Any:
    if isinstance(weights, torch.Tensor):
        return weights.detach().cpu().to(torch.float64).numpy()
    return weights


class ContextNgram(_search.ContextNgram):
    """The request's own n-gram model (prompt + accepted tokens), a second n-gram source for the
    tree search next to the corpus trie (beyond the paper; see ``tree_search``'s ``context``).

    Counts every n-gram of up to ``order`` tokens (2..5) of the tokens seen, in C++ hash maps that
    grow by ``order - 1`` updates per token: keep one per request and ``sync`` it with the history
    before each search, which adds only the new tokens. Queries answer exactly as the corpus trie's
    (``NgramTrie.probability``): ``count(ctx + tok) / count(ctx)`` at the longest suffix of the
    context that was followed by ``tok``, where ``count(ctx)`` counts the times ``ctx`` was followed
    by a token.

    Methods: ``extend(tokens)``, ``sync(history)``, ``probability(context, tokens) -> (probs,
    matched)`` (numpy float32/int32), ``top_continuation(context) -> (token, prob, matched) | None``
    (most frequent continuation of the longest seen suffix; ties: the most recent); ``len()``,
    ``order``, ``num_contexts``. Token ids: 1-D int tensors/arrays or lists of ints >= 0.
    """

    def __init__(self, order: int = 3, tokens: torch.Tensor | np.ndarray | Sequence[int] | None = None) -> None:
        super().__init__(order)
        if tokens is not None:
            self.extend(tokens)

    def extend(self, tokens: torch.Tensor | np.ndarray | Sequence[int]) -> None:
        """Adds `tokens` after those seen (all or nothing: a negative id adds none)."""
        super().extend(_tokens_array(tokens, "tokens"))

    def sync(self, history: torch.Tensor | np.ndarray | Sequence[int]) -> None:
        """Brings the model up to `history` (everything seen so far, then the new tokens): adds
        ``history[len(self):]``. Raises ValueError when `history` is shorter than what was seen or
        does not continue it (checked on the last ``order - 1`` tokens seen)."""
        super().sync(_tokens_array(history, "history"))

    def probability(self, context: Any, tokens: Any) -> tuple[np.ndarray, np.ndarray]:
        return super().probability(_tokens_array(context, "context"), _tokens_array(tokens, "tokens"))

    def top_continuation(self, context: Any) -> tuple[int, float, int] | None:
        return super().top_continuation(_tokens_array(context, "context"))


# Stands in for a missing EOS id: candidate ids are vocabulary ids, so this one never matches.
_NO_EOS = 2**31 - 1


def tree_search(
    topk_tokens: torch.Tensor | np.ndarray,
    topk_probs: torch.Tensor | np.ndarray,
    trie: Any,
    prompt_tokens: torch.Tensor | np.ndarray | Sequence[int],
    *,
    eos_token_id: int | None,
    beam_width: int = 20,
    remain_total: int = 60,
    ngram_weight: float = 0.5,
    level_weight: Sequence[float] | torch.Tensor | np.ndarray | None = None,
    logit_weight: Sequence[float] | torch.Tensor | np.ndarray | None = None,
    ngram_on_first_level: bool = False,
    vocab_size: int | None = None,
    return_parents: bool = False,
    context: ContextNgram | None = None,
    context_weight: float = 0.0,
    context_propose: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Builds one draft tree from the draft head's top-k candidates (dart-method.md §4).

    Beam search over the ``d`` levels: each beam path is extended by the level's ``k`` tokens; a
    child's score is ``parent + level_weight[l] * (logit_weight[l] * log(p + 1e-10)
    + ngram_weight * log(p_ngram + 1e-10))``, with ``p_ngram`` the trie's back-off probability of
    the token after the last ``order - 1`` tokens of ``prompt_tokens + path``. The n-gram term is
    left out at level 0 unless ``ngram_on_first_level``. After each level the best ``beam_width``
    children (paths ending in ``eos_token_id`` after all others) form the next beam; of all
    children generated, the best ``remain_total`` by score form the tree (a child never outscores
    its parent, and ties keep the shallower node, so the kept set is always a tree).

    Context n-grams (beyond the paper): with a ``context`` model and ``context_weight`` w > 0, the
    n-gram term's probability is ``(1 - w) * p_trie + w * p_context`` (``p_trie`` = 0 without a
    trie; the term then applies even with ``trie=None``), at the same levels and with the same
    ``ngram_weight``; at w = 0 the search is exactly the one without a context model. With
    ``context_propose``, wherever that term applies, the context's most frequent continuation of
    each beam path (after its longest seen context) becomes one more child of that path when the
    level's candidates lack it, scored with the level's smallest draft probability (it was not in
    the draft's top k) and its n-gram term: this is how spans that repeat the context get into the
    tree when the draft does not propose them.

    Args:
        topk_tokens: int32/int64 ``[d, k]`` TARGET token ids per level (draft ids already mapped
            through ``d2t``), distinct within a level, ``d >= 1``, ``k >= 1``. Torch tensors (any
            device) or numpy arrays.
        topk_probs: float ``[d, k]``, each row a softmax over its ``k`` values (every entry in
            ``[0, 1]``). float16/bfloat16 tensors are converted to float32 once.
        trie: an ``ngram_builder.NgramTrie`` or ``None``. With ``None`` (and no context model)
            the n-gram term is left out at every level, i.e. the search behaves exactly as with
            ``ngram_weight=0`` (``ngram_weight`` is then ignored).
        prompt_tokens: 1-D int tensor/array or list of ints; its last element is the tree's root
            (the target's own next token). Only its last ``order - 1`` tokens are read.
        eos_token_id: paths ending in this token go last when choosing the beam (``None``: a
            model without an end-of-sequence token; no path is put last).
        beam_width: beam paths kept per level (>= 1). ``k < beam_width`` is allowed: the first
            level's beam then simply holds the ``k`` children.
        remain_total: number of tree nodes kept, root excluded (>= 1); fewer when the search
            generates fewer children.
        ngram_weight: weight of the n-gram log-probability (>= 0).
        level_weight: ``d`` per-level weights, default ``(l + 1) ** -0.7``.
        logit_weight: ``d`` per-level weights of the draft log-probability, default ``0.9 ** l``.
        ngram_on_first_level: include the n-gram term at level 0 (context = prompt tail).
        vocab_size: if given, every token id must be below it.
        return_parents: also return ``parents`` (int64 ``[1 + n]``, index of each node's parent,
            ``-1`` for the root).
        context: a ``ContextNgram`` that has seen exactly ``prompt_tokens`` (same length, same last
            tokens; checked), or ``None``. Read only when ``context_weight > 0``.
        context_weight: the context model's share ``w`` in ``[0, 1]`` of the n-gram probability.
        context_propose: let the context model add its continuation as a candidate (see above).

    Returns:
        ``(draft_tokens, retrieve_indices, tree_mask, tree_positions)`` as CPU torch tensors,
        with ``n`` the number of kept nodes (``1 + n`` rows including the root at index 0):

        - ``draft_tokens``: int64 ``[1 + n]``: the root token, then the nodes sorted by depth
          (within a depth by descending score; siblings are thus in descending score order).
        - ``retrieve_indices``: int64 ``[n_leaves, max_depth + 1]``: one row per leaf, the node
          indices on the path root (0) .. leaf, padded with ``-1``. Rows are in node order.
        - ``tree_mask``: bool ``[1 + n, 1 + n]``: ``tree_mask[i, j]`` is True iff ``j`` is ``i``,
          an ancestor of ``i``, or the root.
        - ``tree_positions``: int64 ``[1 + n]``: depth of each node (root 0).

    Raises:
        ValueError: bad shapes or dtypes, ``d`` or ``k`` < 1, ``beam_width`` or ``remain_total``
            < 1, an empty prompt, negative (or ``>= vocab_size``) token ids, a token twice in one
            level's candidates, probabilities outside
            ``[0, 1]``, negative or non-finite weights, or a ``trie`` that is not an NgramTrie;
            a ``context_weight`` outside ``[0, 1]``, a ``context`` that is not a ``ContextNgram``
            or has not seen exactly ``prompt_tokens``.
        RuntimeError: the trie returned a probability outside ``[0, 1]``.
    """
    if not isinstance(topk_tokens, torch.Tensor | np.ndarray) or not isinstance(
        topk_probs, torch.Tensor | np.ndarray
    ):
        raise ValueError("topk_tokens and topk_probs must be torch tensors or numpy arrays")
    if vocab_size is not None and vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1 (or None), got {vocab_size}")
    # Positional: keyword matching in the binding costs more than the rest of the call's overhead.
    draft_tokens, retrieve_indices, tree_mask, tree_positions, parents = _search.search(
        _tokens_array(topk_tokens, "topk_tokens"),
        _probs_array(topk_probs),
        trie,
        _tokens_array(prompt_tokens, "prompt_tokens"),
        _NO_EOS if eos_token_id is None else eos_token_id,
        beam_width,
        remain_total,
        ngram_weight,
        _weights(level_weight),
        _weights(logit_weight),
        ngram_on_first_level,
        0 if vocab_size is None else vocab_size,
        context,
        context_weight,
        context_propose,
    )
    result = (
        torch.from_numpy(draft_tokens),
        torch.from_numpy(retrieve_indices),
        torch.from_numpy(tree_mask),
        torch.from_numpy(tree_positions),
    )
    if return_parents:
        return (*result, torch.from_numpy(parents))
    return result


def search_arguments(settings: Any, trie: Any, eos_token_id: int | None) -> dict[str, Any]:
    """The keyword arguments of `tree_search` for `settings` (trees and chains alike)."""
    use_context = settings.context_ngram_weight > 0
    kwargs: dict[str, Any] = dict(
        eos_token_id=eos_token_id,
        beam_width=settings.beam_width,
        remain_total=settings.remain_total,
        ngram_weight=settings.ngram_weight if trie is not None or use_context else 0.0,
        ngram_on_first_level=settings.ngram_on_first_level,
        context_weight=settings.context_ngram_weight,
        context_propose=settings.context_ngram_propose,
    )
    if settings.level_weight is not None:
        kwargs["level_weight"] = list(settings.level_weight)
    if settings.logit_weight is not None:
        kwargs["logit_weight"] = list(settings.logit_weight)
    return kwargs

