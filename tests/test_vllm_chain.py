"""The trie-chosen chain of the vLLM plugin (`dart_infer.engines.vllm.plugin.chain`), run here in our own
venv (it imports nothing of vLLM): the roots it reads off vLLM's draft-row layout, and that the chain it
proposes is our loop's chain (`draft_trees` with `tree=chain`, the whole history) on the same rows.
In vLLM itself: tests/test_vllm_plugin.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import tiny_pair

from dart_infer.engines.vllm.plugin.chain import ChainDrafter, LayoutError, roots_from_input_ids
from dart_infer.tree.settings import TreeSearchSettings, draft_trees
from ngram_builder import NgramTrie

MASK = 1000  # a mask id outside the vocabulary, as the export writes it


def test_roots_are_the_ids_before_each_requests_first_mask_slot() -> None:
    # vLLM's layout per request: accepted tokens, bonus, k - 1 masks, rejected slots (id 0); padding after.
    ids = torch.tensor([5, 6, 7, 11, MASK, MASK, MASK, 0, 0,   # request 0: bonus 11, two rejected slots
                        12, MASK, MASK, MASK,                  # request 1: bonus 12 only
                        3, 4, 13, MASK, MASK, MASK,            # request 2
                        MASK, MASK])                           # stale padding from an earlier step
    assert roots_from_input_ids(ids, MASK, 3).tolist() == [11, 12, 13]
    with pytest.raises(LayoutError, match="layout changed"):
        roots_from_input_ids(ids[:13], MASK, 3)  # fewer runs of masks than requests
    with pytest.raises(LayoutError, match="layout changed"):
        roots_from_input_ids(torch.tensor([MASK, MASK, 4]), MASK, 1)  # no bonus slot before the masks


def structured_trie(vocab: int, path: Path) -> NgramTrie:
    """An order-3 trie over a few fixed token walks: its n-gram term disagrees with random rows often."""
    generator = torch.Generator().manual_seed(1)
    trie = NgramTrie(order=3, vocab_size=vocab)
    for _ in range(40):
        trie.add_tokens(torch.randint(0, vocab, (30,), generator=generator).tolist())
    trie.save(path)
    return NgramTrie.open(path)


def test_the_plugins_chain_is_our_loops_chain_on_the_same_rows(tmp_path: Path) -> None:
    """Same rows, same trie: the plugin (the root alone, target-vocabulary logits) proposes what our loop's
    `tree=chain` search (the whole history, the head's draft vocabulary) drafts, and the trie changes it."""
    _, head = tiny_pair(draft_length=4)
    vocab = head.config.vocab_size
    trie = structured_trie(vocab, tmp_path / "t.ngt")
    settings = TreeSearchSettings(shape="chain", draft_top_k=8, beam_width=4, remain_total=4, ngram_weight=0.5)
    drafter = ChainDrafter({"ngram_model": str(tmp_path / "t.ngt"), "draft_top_k": 8, "beam_width": 4,
                            "ngram_weight": 0.5, "level_weight": None, "logit_weight": None,
                            "ngram_on_first_level": False, "eos_token_id": 2})
    generator = torch.Generator().manual_seed(0)
    requests, k = 24, 4
    logits = torch.randn(requests * k, vocab, generator=generator) * 2
    histories = [torch.randint(0, vocab, (int(n),), generator=generator)
                 for n in torch.randint(3, 20, (requests,), generator=generator)]
    roots = torch.tensor([int(h[-1]) for h in histories])
    proposed = drafter.point_mass_logits(logits, roots)
    assert torch.isfinite(proposed).sum(-1).eq(1).all()  # one token per row: a point mass
    ours = draft_trees(logits.view(requests, k, vocab), head, histories, trie=trie, settings=settings,
                       eos_token_ids=[2])
    chains = proposed.argmax(-1).view(requests, k)
    for i, tree in enumerate(ours):
        n = len(tree.tokens) - 1  # a chain the search ended early is padded with the rows' argmax
        assert tree.tokens[0] == roots[i] and n >= 1
        assert chains[i, :n].tolist() == tree.tokens[1:].tolist(), i
    assert (chains != logits.argmax(-1).view(requests, k)).any(), "the trie never changed a chain: no teeth"


def test_a_trie_of_order_above_3_is_refused(tmp_path: Path) -> None:
    trie = NgramTrie(order=4, vocab_size=16)
    trie.add_tokens(list(range(10)))
    trie.save(tmp_path / "o4.ngt")
    with pytest.raises(ValueError, match="order 4.*order <= 3"):
        ChainDrafter({"ngram_model": str(tmp_path / "o4.ngt"), "draft_top_k": 4, "beam_width": 2,
                      "ngram_weight": 0.5, "eos_token_id": None})
