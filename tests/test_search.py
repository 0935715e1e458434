"""Tests of the C++ tree search `dart_infer.tree.search.tree_search` (dart-method.md §4).

- golden: the original implementation's trees on 200 real cases (set of root-to-node paths);
- an independent, slow-but-obvious Python reference of §4 on random inputs (with and without trie);
- the encoding invariants (mask / retrieve_indices / positions / order) on every output;
- input validation, dtype handling, ties, threads.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
from helpers import EOS, FIXTURES, check_encoding, golden_trie, node_paths, reference_beam_levels

from dart_infer.tree.search import tree_search
from ngram_builder import NgramTrie


@pytest.fixture(scope="module")
def golden_cases() -> list[dict]:
    with open(FIXTURES / "golden60_search.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def golden_trie_built():
    return golden_trie()


@pytest.fixture(scope="module")
def golden_trie_loaded():
    return NgramTrie.load_dart(str(FIXTURES / "golden60.trie"))


def test_the_compiled_trie_exposes_its_query_hook_to_the_search() -> None:
    # The trie-guided search reads the trie through this capsule; without it every test with a trie
    # fails (as it should: a stale or partial build of the extension is a broken install, not a skip).
    assert hasattr(NgramTrie, "_ngram_query_capsule"), "rebuild ngram_builder (`make venv` / pip install -e .)"


def reference_search(topk_tokens, topk_probs, prompt, *, remain_total=60, **search) -> set[tuple[int, ...]]:
    """dart-method.md §4 written as plainly as possible (`helpers.reference_beam_levels`): the
    `remain_total` best of all generated nodes."""
    generated = [child for level in reference_beam_levels(topk_tokens, topk_probs, prompt, **search) for child in level]
    generated.sort(key=lambda child: -child[1])
    return {path for path, _ in generated[:remain_total]}


def random_inputs(rng: np.random.Generator, levels: int, k: int, vocab: int = 60, eos_rate: float = 0.0):
    tokens = np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(levels)])
    if eos_rate > 0:  # put EOS among the candidates of some levels
        for level in range(levels):
            if rng.random() < eos_rate and EOS not in tokens[level]:
                tokens[level, rng.integers(k)] = EOS
    logits = rng.normal(0, 2.0, size=(levels, k))
    probs = torch.softmax(torch.tensor(logits), dim=-1).to(torch.float32)
    prompt = rng.integers(0, vocab, size=int(rng.integers(1, 6)))
    return torch.tensor(tokens, dtype=torch.int64), probs, torch.tensor(prompt, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# Golden compatibility with the original implementation


def _golden_check(cases: list[dict], trie) -> None:
    mismatches = []
    for index, case in enumerate(cases):
        out = tree_search(
            torch.tensor(case["topk_tokens"]),
            torch.tensor(case["topk_probs"]),
            trie,
            torch.tensor(case["prompt"]),
            eos_token_id=EOS,
        )
        check_encoding(*out, root=case["prompt"][-1])
        ours = set(node_paths(out[0], out[2]))
        theirs = set(node_paths(case["draft_tokens"], case["tree_mask"]))
        if ours != theirs:
            mismatches.append(index)
    assert not mismatches, f"{len(mismatches)} of {len(cases)} golden trees differ: {mismatches[:10]}"


def test_golden_trees_with_built_trie(golden_cases, golden_trie_built):
    _golden_check(golden_cases, golden_trie_built)


def test_golden_trees_with_loaded_original_trie(golden_cases, golden_trie_loaded):
    _golden_check(golden_cases, golden_trie_loaded)


def test_golden_fixture_encoding_matches_our_conventions(golden_cases):
    # The original's own outputs satisfy the invariants we check on ours (guards the checker).
    for case in golden_cases[:40]:
        check_encoding(
            torch.tensor(case["draft_tokens"]),
            torch.tensor(case["retrieve_indices"]),
            torch.tensor(case["tree_mask"], dtype=torch.bool),
            torch.tensor(case["tree_positions"]),
            root=case["prompt"][-1],
        )


def test_golden_inputs_match_reference_with_trie(golden_cases, golden_trie_built):
    for case in golden_cases[:25]:
        out = tree_search(
            torch.tensor(case["topk_tokens"]),
            torch.tensor(case["topk_probs"]),
            golden_trie_built,
            case["prompt"],
            eos_token_id=EOS,
        )
        expected = reference_search(
            case["topk_tokens"], case["topk_probs"], case["prompt"], trie=golden_trie_built
        )
        assert set(node_paths(out[0], out[2])) == expected


# ----------------------------------------------------------------------------------------------
# Against the Python reference on random inputs


@pytest.mark.parametrize(
    "levels,k,beam_width,remain_total",
    [
        (8, 25, 20, 60),
        (4, 10, 3, 15),
        (1, 7, 20, 60),
        (3, 5, 20, 500),
        (6, 4, 1, 6),
        (5, 3, 8, 1),
        (4, 50, 40, 300),
    ],
)
def test_no_trie_matches_reference(levels, k, beam_width, remain_total):
    rng = np.random.default_rng(levels * 100 + k)
    for _ in range(15):
        tokens, probs, prompt = random_inputs(rng, levels, k, eos_rate=0.3)
        out = tree_search(
            tokens, probs, None, prompt, eos_token_id=EOS, beam_width=beam_width, remain_total=remain_total
        )
        check_encoding(*out, root=int(prompt[-1]))
        expected = reference_search(
            tokens.tolist(), probs.tolist(), prompt.tolist(), beam_width=beam_width, remain_total=remain_total
        )
        assert set(node_paths(out[0], out[2])) == expected
        assert out[0].shape[0] == 1 + len(expected)


def test_custom_weights_match_reference():
    rng = np.random.default_rng(7)
    tokens, probs, prompt = random_inputs(rng, 5, 9)
    level_weight = [1.0, 0.2, 0.9, 0.05, 0.7]
    logit_weight = [0.3, 1.0, 0.5, 2.0, 0.0]
    for as_type in (list, np.asarray, torch.tensor):
        out = tree_search(
            tokens,
            probs,
            None,
            prompt,
            eos_token_id=EOS,
            beam_width=4,
            remain_total=20,
            level_weight=as_type(level_weight),
            logit_weight=as_type(logit_weight),
        )
        expected = reference_search(
            tokens.tolist(),
            probs.tolist(),
            prompt.tolist(),
            beam_width=4,
            remain_total=20,
            level_weight=level_weight,
            logit_weight=logit_weight,
        )
        assert set(node_paths(out[0], out[2])) == expected


def test_eos_paths_go_last_in_the_beam():
    # Level 0: EOS has by far the best probability but must not enter a beam of width 1.
    tokens = torch.tensor([[EOS, 10, 11], [20, 21, 22]])
    probs = torch.tensor([[0.9, 0.06, 0.04], [0.5, 0.3, 0.2]])
    out = tree_search(tokens, probs, None, [5], eos_token_id=EOS, beam_width=1, remain_total=100)
    paths = set(node_paths(out[0], out[2]))
    assert (EOS,) in paths and (10, 20) in paths and (EOS, 20) not in paths
    assert len(paths) == 6
    # When only EOS paths remain, they do fill the beam (as the original does).
    tokens = torch.tensor([[EOS], [20]])
    out = tree_search(tokens, torch.ones(2, 1), None, [5], eos_token_id=EOS, beam_width=2)
    assert set(node_paths(out[0], out[2])) == {(EOS,), (EOS, 20)}
    # A model without an EOS token: nothing is put last, the best path takes the beam.
    tokens = torch.tensor([[EOS, 10, 11], [20, 21, 22]])
    out = tree_search(tokens, probs, None, [5], eos_token_id=None, beam_width=1, remain_total=100)
    paths = set(node_paths(out[0], out[2]))
    assert (EOS, 20) in paths and (10, 20) not in paths


@pytest.mark.parametrize("order_case", ["default", "first_level", "short_prompt", "weights"])
def test_with_trie_matches_reference(golden_trie_built, golden_cases, order_case):
    # Real tokens and a real trie, random probabilities and candidate sets.
    rng = np.random.default_rng(11)
    vocab_tokens = sorted({t for case in golden_cases[:50] for row in case["topk_tokens"] for t in row})
    for case in golden_cases[50:60]:
        tokens = torch.tensor(np.stack([rng.choice(vocab_tokens, size=12, replace=False) for _ in range(6)]))
        probs = torch.softmax(torch.tensor(rng.normal(0, 1.5, size=(6, 12))), dim=-1)
        prompt = case["prompt"][-1:] if order_case == "short_prompt" else case["prompt"]
        kwargs = dict(beam_width=6, remain_total=30, ngram_on_first_level=order_case == "first_level")
        if order_case == "weights":
            kwargs.update(ngram_weight=1.3, level_weight=[1.0] * 6, logit_weight=[0.5] * 6)
        out = tree_search(tokens, probs, golden_trie_built, prompt, eos_token_id=EOS, **kwargs)
        check_encoding(*out, root=prompt[-1])
        expected = reference_search(tokens.tolist(), probs.tolist(), prompt, trie=golden_trie_built, **kwargs)
        assert set(node_paths(out[0], out[2])) == expected


@pytest.mark.parametrize("order", [1, 2, 4])
def test_other_trie_orders_match_reference(golden_cases, order):
    # Contexts of order - 1 tokens: none (unigram), the last token only, or three tokens taken from
    # both the prompt and the path (short prompts included).
    with open(FIXTURES / "golden60_docs.json") as f:
        docs = json.load(f)["docs"][:12]
    trie = NgramTrie(order=order)
    for doc in docs:
        trie.add_tokens(doc)
    for index, case in enumerate(golden_cases[100:112]):
        prompt = case["prompt"][-(index % 4 + 1) :]
        kwargs = dict(beam_width=8, remain_total=40, ngram_on_first_level=index % 2 == 0)
        out = tree_search(
            torch.tensor(case["topk_tokens"]), torch.tensor(case["topk_probs"]), trie, prompt, eos_token_id=EOS,
            **kwargs,
        )  # fmt: skip
        check_encoding(*out, root=prompt[-1])
        expected = reference_search(case["topk_tokens"], case["topk_probs"], prompt, trie=trie, **kwargs)
        assert set(node_paths(out[0], out[2])) == expected


def test_no_trie_equals_zero_ngram_weight(golden_cases, golden_trie_built):
    for case in golden_cases[:20]:
        args = (torch.tensor(case["topk_tokens"]), torch.tensor(case["topk_probs"]))
        without = tree_search(*args, None, case["prompt"], eos_token_id=EOS)
        zero_weight = tree_search(
            *args, golden_trie_built, case["prompt"], eos_token_id=EOS, ngram_weight=0.0
        )
        for a, b in zip(without, zero_weight, strict=True):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# Encoding details, dtypes, ties, threads


def test_output_order_depth_then_score():
    tokens = torch.tensor([[10, 11, 12], [20, 21, 22]])
    probs = torch.tensor([[0.2, 0.7, 0.1], [0.6, 0.3, 0.1]])
    draft, retrieve, mask, positions, parents = tree_search(
        tokens,
        probs,
        None,
        [1, 2, 3, 9],
        eos_token_id=EOS,
        beam_width=2,
        remain_total=100,
        return_parents=True,
    )
    assert draft[:4].tolist() == [9, 11, 10, 12]  # root, then level 0 by descending probability
    assert positions.tolist() == [0, 1, 1, 1] + [2] * 6
    assert parents[:4].tolist() == [-1, 0, 0, 0]
    # Level 1 children of 11 (best) come before those of 10, each by descending probability.
    assert draft[4:].tolist() == [20, 21, 22, 20, 21, 22] and parents[4:].tolist() == [1, 1, 1, 2, 2, 2]
    assert retrieve.tolist()[0] == [0, 3, -1]


def test_input_dtypes_and_containers_agree():
    rng = np.random.default_rng(3)
    tokens, probs, prompt = random_inputs(rng, 6, 10)
    expected = tree_search(tokens, probs, None, prompt, eos_token_id=EOS, beam_width=5, remain_total=25)
    variants = [
        (tokens.to(torch.int32), probs, prompt.to(torch.int32)),
        (tokens.numpy(), probs.numpy(), prompt.numpy()),
        (tokens, probs.to(torch.float64), prompt.tolist()),
        (tokens.t().contiguous().t(), probs.t().contiguous().t(), tuple(prompt.tolist())),  # strided
        (tokens, probs.requires_grad_(True), prompt),
    ]
    for variant_tokens, variant_probs, variant_prompt in variants:
        out = tree_search(
            variant_tokens,
            variant_probs,
            None,
            variant_prompt,
            eos_token_id=EOS,
            beam_width=5,
            remain_total=25,
        )
        for a, b in zip(out, expected, strict=True):
            assert torch.equal(a, b)
    # Half precision: converted once; rounding may reorder near-ties, the encoding stays valid.
    for dtype in (torch.float16, torch.bfloat16):
        out = tree_search(
            tokens, probs.detach().to(dtype), None, prompt, eos_token_id=EOS, beam_width=5, remain_total=25
        )
        check_encoding(*out, root=int(prompt[-1]))
        assert out[0].shape == expected[0].shape


def test_only_the_prompt_tail_is_read():
    tokens = torch.tensor([[10, 11], [20, 21]])
    probs = torch.tensor([[0.6, 0.4], [0.5, 0.5]])
    long_prompt = list(range(100_000)) + [7]
    out = tree_search(tokens, probs, None, long_prompt, eos_token_id=EOS)
    assert int(out[0][0]) == 7


def test_ties_still_give_a_tree():
    # Probability 1.0 -> log term 0 -> children tie with their parent; equal probs tie siblings.
    tokens = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]])
    probs = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    for remain_total in range(1, 14):
        out = tree_search(tokens, probs, None, [5], eos_token_id=EOS, beam_width=4, remain_total=remain_total)
        check_encoding(*out, root=5)
        assert out[0].shape[0] == remain_total + 1
        if remain_total >= 3:
            assert {(10,), (10, 20), (10, 20, 30)} <= set(node_paths(out[0], out[2]))


def test_concurrent_threads_give_identical_results():
    rng = np.random.default_rng(5)
    inputs = [random_inputs(rng, 8, 25) for _ in range(8)]
    expected = [
        tree_search(tokens, probs, None, prompt, eos_token_id=EOS) for tokens, probs, prompt in inputs
    ]
    failures = []

    def worker(offset: int) -> None:
        for i in range(40):
            j = (i + offset) % len(inputs)
            tokens, probs, prompt = inputs[j]
            out = tree_search(tokens, probs, None, prompt, eos_token_id=EOS)
            if not all(torch.equal(a, b) for a, b in zip(out, expected[j], strict=True)):
                failures.append(j)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def test_concurrent_threads_with_trie(golden_cases, golden_trie_loaded):
    # The GIL is released during the search: threads really run searches (and trie queries) at once.
    cases = golden_cases[:16]
    inputs = [(torch.tensor(c["topk_tokens"]), torch.tensor(c["topk_probs"]), c["prompt"]) for c in cases]
    expected = [tree_search(t, p, golden_trie_loaded, prompt, eos_token_id=EOS) for t, p, prompt in inputs]
    failures = []

    def worker(offset: int) -> None:
        for i in range(48):
            j = (i + offset) % len(inputs)
            tokens, probs, prompt = inputs[j]
            out = tree_search(tokens, probs, golden_trie_loaded, prompt, eos_token_id=EOS)
            if not all(torch.equal(a, b) for a, b in zip(out, expected[j], strict=True)):
                failures.append(j)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


# ----------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(topk_probs=torch.full((3, 4), 0.25)), "same shape"),
        (dict(topk_tokens=torch.tensor([10, 11, 12, 13])), "2-D"),
        (dict(topk_tokens=torch.zeros((0, 4), dtype=torch.int64), topk_probs=torch.zeros((0, 4))), "level"),
        (dict(topk_tokens=torch.zeros((2, 0), dtype=torch.int64), topk_probs=torch.zeros((2, 0))), "k >= 1"),
        (dict(topk_tokens=torch.tensor([[10.0, 11, 12, 13]] * 2)), "integer"),
        (dict(topk_probs=torch.tensor([[1, 0, 0, 0]] * 2)), "floating"),
        (dict(topk_tokens=torch.tensor([[10, -1, 12, 13]] * 2)), "-1"),
        (dict(topk_tokens=torch.tensor([[10, 2**40, 12, 13]] * 2)), "int32"),
        (
            dict(topk_tokens=torch.tensor([[10, 11, 12, 13], [14, 15, 14, 17]])),
            "14 more than once at level 1",
        ),
        (dict(topk_probs=torch.tensor([[0.5, 0.5, 0.5, float("nan")]] * 2)), r"\[0, 1\]"),
        (dict(topk_probs=torch.tensor([[1.5, 0.0, 0.0, 0.0]] * 2)), r"\[0, 1\]"),
        (dict(prompt_tokens=[]), "empty"),
        (dict(prompt_tokens=torch.zeros(0, dtype=torch.int64)), "empty"),
        (dict(prompt_tokens=[1, 2, -5]), "-5"),
        (dict(prompt_tokens=[1, 2.0]), "ints"),
        (dict(prompt_tokens=torch.tensor([[1, 2]])), "1-D"),
        (dict(prompt_tokens=torch.tensor([1.0, 2.0])), "integer"),
        (dict(prompt_tokens="hello"), "list of ints"),
        (dict(beam_width=0), "beam_width"),
        (dict(remain_total=0), "remain_total"),
        (dict(remain_total=-3), "remain_total"),
        (dict(ngram_weight=-0.5), "ngram_weight"),
        (dict(ngram_weight=float("inf")), "ngram_weight"),
        (dict(eos_token_id=-1), "eos_token_id"),
        (dict(level_weight=[1.0]), "level_weight"),
        (dict(logit_weight=[1.0, -1.0]), "logit_weight"),
        (dict(logit_weight="ab"), "logit_weight"),
        (dict(vocab_size=12), r"outside \[0, 12\)"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(trie=object()), "NgramTrie"),
        (dict(topk_tokens=[[10, 11, 12, 13]] * 2), "torch tensors or numpy"),
    ],
)
def test_bad_input_raises_value_error(change, message):
    args = dict(
        topk_tokens=torch.tensor([[10, 11, 12, 13], [14, 15, 16, 17]]),
        topk_probs=torch.full((2, 4), 0.25),
        trie=None,
        prompt_tokens=[1, 2, 3],
        eos_token_id=EOS,
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        tree_search(
            args.pop("topk_tokens"),
            args.pop("topk_probs"),
            args.pop("trie"),
            args.pop("prompt_tokens"),
            **args,
        )


def test_too_large_search_is_rejected():
    # 3 levels x 2000 candidates with an unbounded beam: 2000 + 4e6 + 8e9 nodes.
    tokens = torch.arange(2000).repeat(3, 1)
    with pytest.raises(ValueError, match="nodes"):
        tree_search(tokens, torch.full((3, 2000), 1 / 2000), None, [1], eos_token_id=EOS, beam_width=10**9)
