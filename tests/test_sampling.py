"""Sampling is lossless: the multi-candidate tree rule emits tokens with the target's distribution.

Chi-square tests over many seeded draws, each with a negative control showing the test has the
power to reject a distribution that is only slightly different.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import check_first_step_follows_the_target, chi_square_p_value, small_vocab_dart
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dart_infer.decoding.sampling import Sampler, greedy_tokens, sampling_accept


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 0, 0.0), (1.0, 5, 0.0), (1.3, 0, 0.8), (1.0, 7, 0.9)]
)
def test_sampler_matches_transformers_warpers(temperature: float, top_k: int, top_p: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    warped = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p:
        warped = TopPLogitsWarper(top_p)(None, warped)
    expected = torch.softmax(warped, dim=-1)
    actual = Sampler(temperature, top_p, top_k).probs(logits)
    assert torch.allclose(actual, expected, atol=1e-6)
    if top_k:
        assert ((actual > 0).sum(-1) <= top_k).all()


def hand_tree_and_logits(vocab: int = 8):
    """root(0) with children tokens 1, 2, 3 (nodes 1-3); node 1 has children 4, 5 (nodes 4, 5)."""
    tokens = torch.tensor([0, 1, 2, 3, 4, 5])
    parents = torch.tensor([-1, 0, 0, 0, 1, 1])
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, vocab, generator=g)
    return tokens, parents, logits


def test_tree_acceptance_rule_reproduces_the_target_distribution() -> None:
    tokens, parents, logits = hand_tree_and_logits()
    sampler = Sampler(temperature=1.0, generator=torch.Generator().manual_seed(0))
    draws = 10000
    first = torch.zeros(8)
    second_after_1 = torch.zeros(8)
    accepted_depths = torch.zeros(3)
    for _ in range(draws):
        nodes, bonus = sampling_accept(tokens, parents, logits, sampler)
        emitted = tokens[nodes[1:]].tolist() + [bonus]
        first[emitted[0]] += 1
        if emitted[0] == 1:
            second_after_1[emitted[1]] += 1
        accepted_depths[len(nodes) - 1] += 1
    p_root = torch.softmax(logits[0], -1)
    p_after_1 = torch.softmax(logits[1], -1)
    assert chi_square_p_value(first, p_root) > 1e-3
    assert chi_square_p_value(second_after_1, p_after_1) > 1e-3
    # Both levels of the tree were used, and bonus-only steps happened too.
    assert (accepted_depths > 100).all()
    # Negative control: a slightly different distribution is rejected with these counts.
    assert chi_square_p_value(first, torch.softmax(logits[0] * 1.1, -1)) < 1e-3


def test_rejected_candidates_are_renormalised_away() -> None:
    """A candidate the target cannot emit (top-k removes it) is never accepted."""
    tokens, parents, logits = hand_tree_and_logits()
    logits[0, 1] = -30.0  # token 1 (node 1) outside the top-3 at the root
    sampler = Sampler(temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(1))
    allowed = Sampler(temperature=1.0, top_k=3).probs(logits[0])
    counts = torch.zeros(8)
    for _ in range(5000):
        nodes, bonus = sampling_accept(tokens, parents, logits, sampler)
        assert 1 not in nodes.tolist()
        counts[(tokens[nodes[1:]].tolist() + [bonus])[0]] += 1
    assert counts[allowed == 0].sum() == 0
    assert chi_square_p_value(counts, allowed) > 1e-3


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 0.0), (0.8, 6, 0.9)])
def test_dart_sampling_emits_the_targets_distribution(temperature: float, top_k: int, top_p: float) -> None:
    model = small_vocab_dart(10)
    check_first_step_follows_the_target(model, model.dart_generate, temperature, top_k, top_p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_take_the_lowest_index_among_ties_like_argmax(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        # Few distinct values: most rows have their maximum many times over.
        logits = torch.randint(0, 3, (13, 49152), generator=generator).to(dtype)
        logits[:, :100] = -1  # the first maximum never sits at index 0
        assert torch.equal(greedy_tokens(logits), torch.argmax(logits, dim=-1))
        assert int(greedy_tokens(logits[0])) == int(torch.argmax(logits[0]))


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"temperature": float("nan")}, ValueError, "temperature must be a finite number >= 0 (0 = greedy), got nan"),
    ({"temperature": float("inf")}, ValueError, "temperature must be a finite number >= 0 (0 = greedy), got inf"),
    ({"temperature": -0.5}, ValueError, "temperature must be a finite number >= 0"),
    ({"temperature": True}, TypeError, "temperature must be a number, got True (bool)"),
    ({"temperature": "0.7"}, TypeError, "temperature must be a number, got '0.7' (str)"),
    ({"top_p": float("nan")}, ValueError, "top_p must be in [0, 1] (0 = off), got nan"),
    ({"top_p": None}, TypeError, "top_p must be a number, got None"),
    ({"top_k": 2.5}, TypeError, "top_k must be an int >= 0 (0 = off), got 2.5 (float)"),
    ({"top_k": 3.0}, TypeError, "top_k must be an int >= 0 (0 = off), got 3.0 (float)"),
    ({"top_k": True}, TypeError, "top_k must be an int >= 0 (0 = off), got True (bool)"),
    ({"top_k": -1}, ValueError, "top_k must be >= 0"),
])
def test_sampler_rejects_non_finite_and_mistyped_settings(kwargs: dict, error: type, message: str) -> None:
    # NaN used to pass `temperature < 0` and sample as if at temperature 1; inf sampled uniformly.
    with pytest.raises(error, match=re.escape(message)) as raised:
        Sampler(**kwargs)
    assert "\n" not in str(raised.value)


def test_sampler_accepts_ints_for_floats_and_numpy_numbers() -> None:
    import numpy as np

    sampler = Sampler(temperature=1, top_p=np.float64(0.9), top_k=np.int64(5))
    assert (sampler.temperature, sampler.top_p, sampler.top_k) == (1.0, 0.9, 5) and not sampler.greedy
    assert Sampler(0, 1, 0).greedy
