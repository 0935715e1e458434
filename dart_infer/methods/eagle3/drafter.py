"""EAGLE-3's drafter for the shared decoding loop (`dart_infer.decoding.loop`), and the same draft loop
at training-data anchors: the trees simulated τ scores (`anchor_trees`) and the logits along a chain
(`chain_logits`, the reference the training-time test is checked against)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dart_infer.methods.draft_head import causal_mask
from dart_infer.methods.eagle3.model import Eagle3DraftModel
from dart_infer.methods.eagle3.tree import Eagle3TreeSettings, TreeDraftCache, expand_tree
from dart_infer.tree.settings import DraftTree

__all__ = ["Eagle3Drafter", "anchor_trees", "chain_logits"]


class Eagle3Drafter:
    """EAGLE-3's side of the shared decoding loop (`dart_infer.decoding.loop.decode_steps`): `update` appends
    accepted prefix positions to the draft cache, `propose` grows the dynamic tree after them."""

    propose_phase = "draft"  # the tree's draft forwards dominate its cost

    def __init__(self, model: Eagle3DraftModel, settings: Eagle3TreeSettings) -> None:
        self.model = model
        self.settings = settings
        self.cache = TreeDraftCache()
        self.last_hidden: torch.Tensor | None = None
        self.last_logits: torch.Tensor | None = None

    @torch.no_grad()
    def update(self, aux_hidden_new: torch.Tensor, next_ids_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """n new prefix positions [1,n,3Ht] with their next tokens [1,n] → their (h, logits) [1,n,·]."""
        n = aux_hidden_new.shape[1]
        cache = self.cache
        cache.discard()
        past = cache.length
        device = self.model.fc.weight.device
        positions = torch.arange(past, past + n, device=device)[None]
        hidden, logits = self.model.step(
            self.model.project(aux_hidden_new), next_ids_new, positions, causal_mask(n, past + n, device), cache
        )
        cache.commit(n)
        self.last_hidden, self.last_logits = hidden[0, -1], logits[0, -1]
        return hidden, logits

    def propose(self, history: torch.Tensor) -> DraftTree:
        assert self.last_hidden is not None and self.last_logits is not None, "update() first"
        return expand_tree(
            self.model, self.cache, self.last_hidden, self.last_logits, int(history[-1]), self.settings
        )


@torch.no_grad()
def anchor_trees(
    model: Eagle3DraftModel,
    aux_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    anchors: Sequence[int],
    settings: Eagle3TreeSettings,
) -> list[DraftTree]:
    """The tree serving builds at each anchor t of one sequence (prefix 0..t verified, root x_{t+1}),
    for simulated τ: one prefix forward over the sequence [1,T,3Ht] / [1,T], then per anchor the
    cache cut back to t+1 and `expand_tree`. Anchors run from the last: a tree's staged K/V overwrite
    only positions after its own prefix. Needs t + 1 < T for every anchor."""
    if not anchors:
        return []
    end = max(anchors) + 1
    drafter = Eagle3Drafter(model, settings)
    hidden, logits = drafter.update(aux_hidden[:, :end], input_ids[:, 1 : end + 1])
    trees: dict[int, DraftTree] = {}
    for t in sorted(set(anchors), reverse=True):
        drafter.cache.crop(t + 1)
        trees[t] = expand_tree(model, drafter.cache, hidden[0, t], logits[0, t], int(input_ids[0, t + 1]), settings)
    return [trees[t] for t in anchors]


def chain_logits(
    model: Eagle3DraftModel, aux_hidden: torch.Tensor, next_ids: torch.Tensor, tokens: Sequence[int]
) -> torch.Tensor:
    """The inference draft loop along a given chain: prefix positions 0..t from `aux_hidden`
    [1,t+1,3Ht] and `next_ids` [1,t+1], then one step per token of `tokens` (each fed with the
    previous step's own hidden output). Returns the logits of every step [1 + len(tokens), draft_vocab].
    Reference for the training-time-test equivalence (and a plain chain drafter)."""
    drafter = Eagle3Drafter(model, Eagle3TreeSettings())
    drafter.update(aux_hidden, next_ids)
    assert drafter.last_hidden is not None and drafter.last_logits is not None
    rows = [drafter.last_logits]
    hidden = drafter.last_hidden
    cache = drafter.cache
    past = cache.length
    device = hidden.device
    with torch.no_grad():
        for j, token in enumerate(tokens):
            mask = torch.ones(1, 1, 1, past + j + 1, dtype=torch.bool, device=device)
            h, logits = model.step(
                hidden.reshape(1, 1, -1), torch.tensor([[token]], device=device),
                torch.tensor([[past + j]], device=device), mask, cache,
            )
            hidden = h[0, -1]
            rows.append(logits[0, -1])
    cache.discard()
    return torch.stack(rows)
