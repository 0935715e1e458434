"""Copy spans in the tree (beyond the paper: prompt lookup inside DART's tree): what `copy_span`
finds in a history, how `with_copy_span` merges it into a tree, and both consumers through
`draft_trees`: serving (lossless, deeper acceptance than the draft's d levels on text that repeats
itself); simulated τ is checked against serving anchor by anchor in test_context_ngram.py
(test_simulated_tau_sees_tree_extras_as_serving_does)."""

from __future__ import annotations

import pytest
import torch
from helpers import bigram_machine, reference, tiny_pair

from dart_infer import DartModel
from dart_infer.tree.settings import (
    DraftTree,
    TreeSearchSettings,
    copy_span,
    tree_from_parents,
    with_copy_span,
)


def history(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long)


def test_copy_span_takes_what_followed_the_most_recent_longest_match() -> None:
    # The history ends in 1 2: the 2-token matches win over the later 1-token match of "2", and of
    # the two 2-token matches the most recent one that max_tokens tokens follow.
    h = history(1, 2, 3, 4, 9, 1, 2, 6, 7, 2, 5, 1, 2)
    assert copy_span(h, 3, 1) == [6, 7, 2]
    assert copy_span(h, 6, 1) == [6, 7, 2, 5, 1, 2]
    assert copy_span(h, 7, 1) == [3, 4, 9, 1, 2, 6, 7]  # no recent one is followed by 7: the oldest
    # A 3-token match beats any shorter one even when it is older.
    h = history(4, 1, 2, 8, 1, 2, 9, 3, 4, 1, 2)
    assert copy_span(h, 2, 1) == [8, 1]
    # Only a 1-token match: found with min_match 1, not with 2.
    h = history(5, 6, 7, 3, 5)
    assert copy_span(h, 4, 1) == [6, 7, 3, 5]
    assert copy_span(h, 4, 2) == []
    assert copy_span(history(1, 2, 3), 4, 1) == []  # nothing repeats
    assert copy_span(history(7), 4, 1) == []  # a lone root


def test_copy_span_in_a_loop_copies_from_far_enough_back() -> None:
    # A loop of period 3: the latest match (one period back) has only 3 tokens after it; the copy
    # comes from the latest match with 5 after it, and may run into the suffix it matched.
    assert copy_span(history(1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2), 5, 2) == [3, 1, 2, 3, 1]
    assert copy_span(history(1, 2, 3, 1, 2, 3, 1, 2), 3, 2) == [3, 1, 2]


def chain_tree() -> DraftTree:
    # root 0 -> 10 -> 11, root -> 20
    return tree_from_parents([0, 10, 20, 11], [-1, 0, 0, 1], [0, 1, 1, 2])


def check_tree(tree: DraftTree) -> None:
    parents = tree.parents.tolist()
    n = len(parents)
    for node in range(n):
        ancestors = {node}
        p = parents[node]
        while p >= 0:
            ancestors.add(p)
            p = parents[p]
        assert set(tree.mask[node].nonzero().flatten().tolist()) == ancestors
        assert tree.positions[node] == len(ancestors) - 1
    leaves = [i for i in range(n) if i not in parents]
    rows = [[x for x in row if x >= 0] for row in tree.retrieve_indices.tolist()]
    assert sorted(r[-1] for r in rows) == leaves
    for row in rows:
        assert row[0] == 0 and all(parents[b] == a for a, b in zip(row, row[1:], strict=False))


def test_with_copy_span_follows_the_tree_then_adds_a_chain() -> None:
    tree = chain_tree()
    check_tree(tree)
    merged = with_copy_span(tree, [10, 11, 12, 13])
    check_tree(merged)
    assert merged.tokens.tolist() == [0, 10, 20, 11, 12, 13]
    assert merged.parents.tolist() == [-1, 0, 0, 1, 3, 4]
    assert merged.positions.tolist() == [0, 1, 1, 2, 3, 4]
    # A span that leaves the tree at the root is a new root branch.
    merged = with_copy_span(tree, [30, 31])
    check_tree(merged)
    assert merged.parents.tolist() == [-1, 0, 0, 1, 0, 4]
    # A span the tree already holds leaves it as it is.
    assert with_copy_span(tree, [10, 11]) is tree
    assert with_copy_span(tree, [20]) is tree


def test_tree_from_parents_rejects_a_child_before_its_parent() -> None:
    with pytest.raises(ValueError, match="parent must come before"):
        tree_from_parents([0, 1, 2], [-1, 2, 0], [0, 2, 1])
    with pytest.raises(ValueError, match="root"):
        tree_from_parents([0, 1], [0, 0], [0, 1])


def test_settings_validate_the_copy_span_knobs() -> None:
    with pytest.raises(ValueError, match="copy_span_tokens"):
        TreeSearchSettings(copy_span_tokens=-1)
    with pytest.raises(ValueError, match="copy_span_min_match"):
        TreeSearchSettings(copy_span_min_match=0)
    with pytest.raises(ValueError, match="copy_span_min_match"):
        TreeSearchSettings(copy_span_min_match=5)


COPY_TREES = [
    TreeSearchSettings(draft_top_k=5, beam_width=3, remain_total=6, copy_span_tokens=10, copy_span_min_match=1),
    TreeSearchSettings(draft_top_k=1, beam_width=1, remain_total=1, copy_span_tokens=6),
    TreeSearchSettings(draft_top_k=8, beam_width=6, remain_total=12, copy_span_tokens=8, context_ngram_weight=0.3),
]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("tree", COPY_TREES, ids=["small", "single", "with_context"])
def test_greedy_output_with_copy_spans_is_identical_to_generate(kind: str, tree: TreeSearchSettings) -> None:
    # gemma3: a sliding window of 3, narrower than the copied chains.
    base, head = tiny_pair(kind, draft_vocab_size=40 if kind == "qwen3" else None)
    model = DartModel(base, head, tree=tree)
    deepest = 0
    for i in range(4):
        gen = torch.Generator().manual_seed(i)
        piece = torch.randint(3, 48, (1, 6 + i), generator=gen)
        prompt = torch.cat([piece, torch.randint(3, 48, (1, 3), generator=gen), piece], dim=1)  # repeats
        out, stats = model.dart_generate(prompt, max_new_token_num=32, return_stats=True)
        assert torch.equal(out, reference(base, prompt, 32)), (kind, i)
        deepest = max(deepest, max(stats.accept_lengths))
    print(f"{kind}: longest acceptance {deepest}")


def test_serving_accepts_past_the_draft_depth_on_text_that_repeats_itself() -> None:
    base, head = bigram_machine()  # its greedy text soon repeats; d = 4
    tree = dict(draft_top_k=8, beam_width=6, remain_total=12)
    with_copy = DartModel(base, head, tree=TreeSearchSettings(**tree, copy_span_tokens=10))
    without = DartModel(base, head, tree=TreeSearchSettings(**tree))
    taus, plain_taus, longest = [], [], 0
    for i in range(4):
        start = torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(30 + i))
        prompt = reference(base, start, 24)  # the model's own walk: what follows repeats it
        want = reference(base, prompt, 40)
        out, stats = with_copy.dart_generate(prompt, max_new_token_num=40, return_stats=True)
        assert torch.equal(out, want)
        plain_out, plain = without.dart_generate(prompt, max_new_token_num=40, return_stats=True)
        assert torch.equal(plain_out, want)
        taus.append(stats.tau)
        plain_taus.append(plain.tau)
        longest = max(longest, max(stats.accept_lengths))
    print(f"tau with copy spans {taus}, without {plain_taus}")
    assert longest > head.config.draft_length  # deeper than the draft's levels
    assert sum(taus) / 4 > sum(plain_taus) / 4 + 3.0, (taus, plain_taus)
