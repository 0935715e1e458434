"""EAGLE-3's draft tree: EAGLE-2's dynamic tree (`expand_tree`), its settings and default sizes, and
the draft cache that stages a tree's nodes after the committed prefix (`TreeDraftCache`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dart_infer.methods.draft_head import DraftKVCache
from dart_infer.methods.eagle3.model import Eagle3DraftModel
from dart_infer.tree.settings import DraftTree, tree_from_parents, with_field_overrides

__all__ = ["CPU_EAGLE3_TREE", "Eagle3TreeSettings", "TreeDraftCache", "default_eagle3_tree", "expand_tree"]


@dataclass(frozen=True)
class Eagle3TreeSettings:
    """EAGLE-2's dynamic tree: every level expands the `top_k` nodes of highest cumulative
    probability (each proposing its `top_k` best children) for `depth` levels; the tree keeps the
    `total_tokens` nodes of highest cumulative probability. `depth` counts draft levels under the
    root (EAGLE's own `depth` argument is one less: its first level comes before its loop)."""

    top_k: int = 10
    depth: int = 8
    total_tokens: int = 60

    def __post_init__(self) -> None:
        for name in ("top_k", "depth", "total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> Eagle3TreeSettings:
        return with_field_overrides(self, overrides, "EAGLE-3 tree")  # type: ignore[no-any-return]


# On a CPU a verification's cost grows with its nodes (docs/results/measured.md, "Verification cost"): a tree about the
# size of DART's CPU tree when the two were compared (12 nodes); on GPUs EAGLE-3's published setting (60 nodes, top-10, 8 levels).
CPU_EAGLE3_TREE = Eagle3TreeSettings(top_k=4, depth=5, total_tokens=12)


def default_eagle3_tree(device: torch.device | str) -> Eagle3TreeSettings:
    return CPU_EAGLE3_TREE if torch.device(device).type == "cpu" else Eagle3TreeSettings()


class TreeDraftCache(DraftKVCache):
    """The draft's K/V cache for EAGLE-3: committed prefix positions, then the tree nodes of the
    current expansion staged after them (each `extend` appends after the staged ones). `commit(n)`
    keeps the first n staged entries (prefix updates stage nothing else); `discard()` drops them."""

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        staged = self._pending
        self.length += staged  # write after the staged entries (the parent grows the storage)
        try:
            out = super().extend(keys, values)
        finally:
            self.length -= staged
        self._pending = staged + keys.shape[-2]
        return out

    def discard(self) -> None:
        self._pending = 0


def _tree_from_candidates(
    root: int, tokens: list[int], parents: list[int], depths: list[int], chosen: list[int]
) -> DraftTree:
    """A `DraftTree` (the layout `dart_infer.tree.settings` produces) of the root + the chosen candidates."""
    node_of = {c: i + 1 for i, c in enumerate(chosen)}
    return tree_from_parents(
        [root] + [tokens[c] for c in chosen],
        [-1] + [node_of[parents[c]] if parents[c] >= 0 else 0 for c in chosen],
        [0] + [depths[c] for c in chosen],
    )


@torch.no_grad()
def expand_tree(
    model: Eagle3DraftModel,
    cache: TreeDraftCache,
    last_hidden: torch.Tensor,
    last_logits: torch.Tensor,
    root: int,
    settings: Eagle3TreeSettings,
) -> DraftTree:
    """EAGLE-2's dynamic draft tree after the prefix in `cache` (batch size 1).

    last_hidden [H] / last_logits [draft_vocab]: the step output at the last committed prefix
    position (whose paired token is the root). Nodes are scored by cumulative draft log-probability;
    a level's `top_k` best nodes are run through the head (attending to the prefix and their own
    ancestors) and propose their `top_k` best children. Staged tree K/V are discarded before
    returning. Node tokens are target ids.
    """
    k = settings.top_k
    device = last_hidden.device
    past = cache.length
    cache.discard()
    logp = torch.log_softmax(last_logits.float(), dim=-1)
    top = torch.topk(logp, min(k, logp.numel()))
    # Candidates (every proposed node): target token, cumulative score, parent candidate (-1 = root), depth.
    tokens: list[int] = model.draft_to_target(top.indices).tolist()
    scores: list[float] = top.values.tolist()
    parents: list[int] = [-1] * len(tokens)
    depths: list[int] = [1] * len(tokens)
    frontier = list(range(len(tokens)))
    frontier_hidden = last_hidden.reshape(1, 1, -1).expand(1, len(frontier), -1)
    slot_of: dict[int, int] = {}  # expanded candidate → its staged cache slot
    for level in range(1, settings.depth):
        m = len(frontier)
        for c in frontier:
            slot_of[c] = len(slot_of)
        staged = len(slot_of)
        # Each frontier node sees the prefix, its expanded ancestors and itself.
        mask = torch.zeros(m, past + staged, dtype=torch.bool, device=device)
        mask[:, :past] = True
        for i, c in enumerate(frontier):
            node = c
            while node >= 0:
                mask[i, past + slot_of[node]] = True
                node = parents[node]
        ids = torch.tensor([tokens[c] for c in frontier], device=device)[None]
        positions = torch.full((1, m), past - 1 + level, device=device)
        hidden, logits = model.step(frontier_hidden, ids, positions, mask[None, None], cache)
        child = torch.topk(torch.log_softmax(logits[0].float(), dim=-1), min(k, logits.shape[-1]))
        cumulative = child.values + torch.tensor([scores[c] for c in frontier], device=device)[:, None]
        first_new = len(tokens)
        child_tokens = model.draft_to_target(child.indices).tolist()
        for i, c in enumerate(frontier):
            tokens.extend(child_tokens[i])
            scores.extend(cumulative[i].tolist())
            parents.extend([c] * child.indices.shape[1])
            depths.extend([level + 1] * child.indices.shape[1])
        best = torch.topk(cumulative.flatten(), min(k, cumulative.numel())).indices
        rows = (best // child.indices.shape[1]).to(device)
        frontier = [first_new + int(b) for b in best.tolist()]
        frontier_hidden = hidden[:, rows]
    cache.discard()
    # A child never outscores its parent (log-probs <= 0) and ties keep the shallower node first,
    # so the best `total_tokens` candidates always form a tree.
    order = sorted(range(len(tokens)), key=lambda c: (-scores[c], depths[c], c))
    chosen = sorted(order[: settings.total_tokens])
    return _tree_from_candidates(root, tokens, parents, depths, chosen)

