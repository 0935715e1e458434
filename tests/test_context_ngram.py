"""Context n-grams in the tree search (beyond the paper): the per-request model (`ContextNgram`),
the search with it (against a plain Python reference, bit-identical when off, copied spans enter
the tree), and both consumers through `draft_trees`: serving (lossless, higher acceptance on
self-repeating text) and simulated τ (the same acceptance as serving, anchor by anchor)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import EOS, FIXTURES, bigram_machine, check_encoding, node_paths, reference, tiny_pair

from dart_infer import DartDraftConfig, DartDraftModel, DartModel
from dart_infer.tree.search import ContextNgram, tree_search
from dart_infer.tree.settings import TreeSearchSettings, draft_trees, request_context
from ngram_builder import NgramTrie

# ----------------------------------------------------------------------------------------------
# References


class ReferenceContext:
    """The context model's semantics written plainly: dicts of counts, the trie's back-off rule,
    the most frequent continuation (ties: the one that reached the count most recently)."""

    def __init__(self, order: int, tokens=()) -> None:
        self.order = order
        self.tokens: list[int] = []
        self.children: dict[tuple[int, ...], dict[int, int]] = {}
        self.best: dict[tuple[int, ...], tuple[int, int]] = {}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for token in tokens:
            for n in range(1, min(self.order - 1, len(self.tokens)) + 1):
                ctx = tuple(self.tokens[-n:])
                counts = self.children.setdefault(ctx, {})
                counts[token] = counts.get(token, 0) + 1
                if counts[token] >= self.best.get(ctx, (-1, 0))[1]:
                    self.best[ctx] = (token, counts[token])
            self.tokens.append(token)

    def _prob(self, ctx: tuple[int, ...], token: int) -> float:
        counts = self.children[ctx]
        return float(np.float32(counts[token]) * (np.float32(1.0) / np.float32(sum(counts.values()))))

    def probability(self, context, token: int) -> tuple[float, int]:
        for n in range(min(self.order - 1, len(context)), 0, -1):
            ctx = tuple(context[-n:])
            if token in self.children.get(ctx, {}):
                return self._prob(ctx, token), n
        return 0.0, 0

    def top(self, context) -> tuple[int, float, int] | None:
        for n in range(min(self.order - 1, len(context)), 0, -1):
            ctx = tuple(context[-n:])
            if ctx in self.best:
                token = self.best[ctx][0]
                return token, self._prob(ctx, token), n
        return None


def reference_search_with_context(
    topk_tokens, topk_probs, prompt, *, context: ReferenceContext, weight: float, propose: bool, trie=None,
    beam_width: int = 20, remain_total: int = 60, ngram_weight: float = 0.5, ngram_on_first_level: bool = False,
) -> set[tuple[int, ...]]:
    """dart-method.md §4 plus the context model, in float64 Python: the n-gram probability is
    (1 - w) p_trie + w p_context; a proposal (the context's top continuation, when no candidate is
    that token) is one more child with the level's smallest draft probability."""
    levels = len(topk_tokens)
    level_weight = [(level + 1) ** -0.7 for level in range(levels)]
    logit_weight = [0.9**level for level in range(levels)]

    def trie_prob(ctx, tokens):
        if trie is None:
            return [0.0] * len(tokens)
        return [float(p) for p in trie.probability(ctx[-(trie.order - 1) :], tokens)[0]]

    beam: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    generated: list[tuple[tuple[int, ...], float]] = []
    for level in range(levels):
        tokens = [int(t) for t in topk_tokens[level]]
        logit_terms = [logit_weight[level] * math.log(float(p) + 1e-10) for p in topk_probs[level]]
        use_ngram = ngram_weight > 0 and (level > 0 or ngram_on_first_level)
        children = []
        for path, score in beam:
            ctx = list(prompt) + list(path)
            terms = [0.0] * len(tokens)
            if use_ngram:
                mixed = [
                    (1 - weight) * pt + weight * context.probability(ctx, t)[0]
                    for t, pt in zip(tokens, trie_prob(ctx, tokens), strict=True)
                ]
                terms = [ngram_weight * math.log(p + 1e-10) for p in mixed]
            for j, token in enumerate(tokens):
                children.append((path + (token,), score + level_weight[level] * (logit_terms[j] + terms[j])))
            top = context.top(ctx) if use_ngram and propose else None
            if top is not None and top[0] not in tokens:
                mixed = (1 - weight) * trie_prob(ctx, [top[0]])[0] + weight * top[1]
                term = min(logit_terms) + ngram_weight * math.log(mixed + 1e-10)
                children.append((path + (top[0],), score + level_weight[level] * term))
        generated.extend(children)
        children.sort(key=lambda child: (child[0][-1] == EOS, -child[1]))  # stable: generation order
        beam = children[:beam_width]
    generated.sort(key=lambda child: -child[1])
    return {path for path, _ in generated[:remain_total]}


def small_trie(seed: int, vocab: int) -> NgramTrie:
    rng = np.random.default_rng(seed)
    trie = NgramTrie(order=3)
    for _ in range(20):
        trie.add_tokens(rng.integers(0, vocab, size=30).tolist())
    return trie


@pytest.fixture(scope="module")
def golden() -> tuple[list[dict], NgramTrie]:
    """test_search's golden cases and the trie built from their 60 documents."""
    with open(FIXTURES / "golden60_search.jsonl") as f:
        cases = [json.loads(line) for line in f]
    with open(FIXTURES / "golden60_docs.json") as f:
        spec = json.load(f)
    trie = NgramTrie(order=spec["order"])
    for doc in spec["docs"]:
        trie.add_tokens(doc)
    return cases, trie


# ----------------------------------------------------------------------------------------------
# The context model


@pytest.mark.parametrize("order", [2, 3, 4, 5])
def test_context_model_matches_reference(order: int) -> None:
    rng = np.random.default_rng(order)
    tokens = rng.integers(0, 12, size=300).tolist()  # a small vocabulary: contexts repeat often
    model, ref = ContextNgram(order, tokens), ReferenceContext(order, tokens)
    assert len(model) == 300 and model.order == order and model.num_contexts == len(ref.children)
    candidates = list(range(14))  # 12, 13: never seen
    for _ in range(300):
        context = rng.integers(0, 13, size=int(rng.integers(0, 7))).tolist()
        probs, matched = model.probability(context, candidates)
        expected = [ref.probability(context, t) for t in candidates]
        assert probs.dtype == np.float32 and probs.tolist() == [p for p, _ in expected]
        assert matched.tolist() == [m for _, m in expected]
        assert model.top_continuation(context) == ref.top(context)
    assert model.top_continuation([]) is None and model.top_continuation([13]) is None


def test_updates_are_incremental_and_equal_one_build() -> None:
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 20, size=500).tolist()
    whole = ContextNgram(3, tokens)
    chunked = ContextNgram(3)
    for start in range(0, 500, 37):
        chunked.extend(torch.tensor(tokens[start : start + 37]))
    synced = ContextNgram(3)
    for end in [*range(1, 500, 23), 500]:
        history = np.array(tokens[:end], dtype=np.int64)
        # sync reads only the last tokens seen and the new ones: the rest may be anything.
        history[: max(len(synced) - 2, 0)] = -1
        synced.sync(history)
        assert len(synced) == end
    contexts = [[a, b] for a in range(21) for b in range(21)] + [[a] for a in range(21)]
    for model in (chunked, synced):
        assert len(model) == 500 and model.num_contexts == whole.num_contexts
        for context in contexts:
            for got, want in zip(model.probability(context, list(range(21))), whole.probability(context, list(range(21))),
                                 strict=True):
                assert np.array_equal(got, want)
            assert model.top_continuation(context) == whole.top_continuation(context)


def test_context_model_rejects_bad_input_and_keeps_its_state() -> None:
    for order in (1, 6):
        with pytest.raises(ValueError, match="order must be between 2 and 5"):
            ContextNgram(order)
    model = ContextNgram(3, [5, 6, 7])
    bad = [
        ([8, -1], "token id -1"),
        ([2**40], "int32"),
        (torch.tensor([1.0]), "integer"),
        (np.array([[1, 2]]), "1-D"),
        ("abc", "list of ints"),
    ]
    for tokens, message in bad:
        with pytest.raises(ValueError, match=message):
            model.extend(tokens)
    with pytest.raises(ValueError, match="fewer than the 3"):
        model.sync([5, 6])
    with pytest.raises(ValueError, match="does not continue"):
        model.sync([5, 9, 7, 8])
    with pytest.raises(ValueError, match="token id -4"):
        model.sync([5, 6, 7, 8, -4])
    assert len(model) == 3 and model.top_continuation([6]) == (7, 1.0, 1)


# ----------------------------------------------------------------------------------------------
# The search with a context model


def context_inputs(rng: np.random.Generator, levels: int, k: int, vocab: int = 14, prompt_len: int = 40):
    tokens = np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(levels)])
    probs = torch.softmax(torch.tensor(rng.normal(0, 2.0, size=(levels, k))), dim=-1).to(torch.float32)
    prompt = rng.integers(0, vocab, size=prompt_len)
    return torch.tensor(tokens, dtype=torch.int64), probs, torch.tensor(prompt, dtype=torch.int64)


@pytest.mark.parametrize("with_trie", [False, True], ids=["no_trie", "trie"])
@pytest.mark.parametrize("propose", [True, False], ids=["propose", "no_propose"])
@pytest.mark.parametrize("first_level", [False, True], ids=["from_level_1", "first_level"])
def test_search_with_context_matches_reference(with_trie: bool, propose: bool, first_level: bool) -> None:
    rng = np.random.default_rng(100 + 4 * with_trie + 2 * propose + first_level)
    trie = small_trie(3, 14) if with_trie else None
    # k = 3 < most contexts' continuations (per-candidate lookups), k = 10 > them (continuation walk).
    for levels, k, beam_width, remain_total, order, weight in [
        (5, 3, 4, 20, 3, 0.5), (6, 10, 6, 30, 3, 0.3), (4, 6, 8, 40, 2, 0.8), (5, 4, 5, 25, 4, 1.0),
    ]:
        for _ in range(6):
            tokens, probs, prompt = context_inputs(rng, levels, k, prompt_len=int(rng.integers(1, 60)))
            kwargs = dict(beam_width=beam_width, remain_total=remain_total, ngram_on_first_level=first_level)
            model = ContextNgram(order, prompt)
            out = tree_search(tokens, probs, trie, prompt, eos_token_id=EOS, context=model, context_weight=weight,
                              context_propose=propose, **kwargs)
            check_encoding(*out, root=int(prompt[-1]))
            expected = reference_search_with_context(
                tokens.tolist(), probs.tolist(), prompt.tolist(), context=ReferenceContext(order, prompt.tolist()),
                weight=weight, propose=propose, trie=trie, **kwargs,
            )
            assert set(node_paths(out[0], out[2])) == expected


def test_weight_zero_reproduces_todays_trees_bit_for_bit(golden) -> None:
    golden_cases, golden_trie = golden
    for with_trie in (True, False):
        trie = golden_trie if with_trie else None
        for case in golden_cases[:40]:
            args = (torch.tensor(case["topk_tokens"]), torch.tensor(case["topk_probs"]), trie, case["prompt"])
            plain = tree_search(*args, eos_token_id=EOS, return_parents=True)
            model = ContextNgram(3, case["prompt"])
            for kwargs in (dict(context=model, context_weight=0.0), dict(context=None, context_weight=0.7)):
                out = tree_search(*args, eos_token_id=EOS, return_parents=True, **kwargs)
                assert all(torch.equal(a, b) for a, b in zip(plain, out, strict=True))


def test_golden_inputs_with_context_match_reference(golden) -> None:
    # Real candidates and trie; the context has seen one of the trie's documents, then the prompt.
    golden_cases, golden_trie = golden
    with open(FIXTURES / "golden60_docs.json") as f:
        docs = json.load(f)["docs"]
    for index, case in enumerate(golden_cases[:12]):
        history = docs[index][:400] + case["prompt"]
        out = tree_search(torch.tensor(case["topk_tokens"]), torch.tensor(case["topk_probs"]), golden_trie,
                          history, eos_token_id=EOS, context=ContextNgram(3, history), context_weight=0.3)
        check_encoding(*out, root=case["prompt"][-1])
        assert out[0].numel() == 61
        expected = reference_search_with_context(
            case["topk_tokens"], case["topk_probs"], history, context=ReferenceContext(3, history), weight=0.3,
            propose=True, trie=golden_trie,
        )
        assert set(node_paths(out[0], out[2])) == expected


SPAN = [40, 41, 42, 43, 44, 45, 46, 47]


def span_case(with_span_candidates: bool):
    """The history shows SPAN once and ends with its first token (the root): the copy continues
    with SPAN[1:]. Draft candidates: SPAN[1] at level 0 (the worst of four); deeper levels hold
    other tokens, plus (optionally) the span's token as the worst candidate."""
    history = [3, 4, 5, *SPAN, 6, 7, 8, 9, SPAN[0]]
    levels = 6
    rows = []
    for level in range(levels):
        others = [10 + 4 * level + i for i in range(3)]
        rows.append([*others, SPAN[1 + level]] if level == 0 or with_span_candidates else [*others, 99])
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * levels)
    return torch.tensor(rows), probs, history


@pytest.mark.parametrize("propose", [True, False])
def test_a_repeated_span_gets_its_continuation_into_the_tree(propose: bool) -> None:
    # Without proposals the span's tokens must be among the candidates (at the lowest probability).
    tokens, probs, history = span_case(with_span_candidates=not propose)
    copy = tuple(SPAN[1:7])
    kwargs = dict(eos_token_id=EOS, beam_width=4, remain_total=16)
    without = set(node_paths(*tree_search(tokens, probs, None, history, **kwargs)[0:3:2]))
    assert not any(path[:2] == copy[:2] for path in without)  # the draft alone does not follow the copy
    model = ContextNgram(3, history)
    out = tree_search(tokens, probs, None, history, context=model, context_weight=0.5, context_propose=propose,
                      **kwargs)
    check_encoding(*out, root=SPAN[0])
    assert copy in set(node_paths(out[0], out[2]))  # the whole copied span, one node per level
    if propose:  # switched off, the proposals are gone again
        off = tree_search(tokens, probs, None, history, context=model, context_weight=0.5, context_propose=False,
                          **kwargs)
        assert not any(path[:2] == copy[:2] for path in node_paths(off[0], off[2]))


def test_first_level_proposal_when_the_draft_misses_the_copy() -> None:
    tokens, probs, history = span_case(with_span_candidates=False)
    tokens[0, 3] = 98  # the draft does not propose the copy even at level 0
    kwargs = dict(eos_token_id=EOS, beam_width=4, remain_total=16, ngram_on_first_level=True)
    model = ContextNgram(3, history)
    out = tree_search(tokens, probs, None, history, context=model, context_weight=0.5, **kwargs)
    assert tuple(SPAN[1:7]) in set(node_paths(out[0], out[2]))
    # From level 1 only (the default), level 0 is the draft's: the copy cannot start.
    out = tree_search(tokens, probs, None, history, context=model, context_weight=0.5,
                      **{**kwargs, "ngram_on_first_level": False})
    assert not any(path[0] == SPAN[1] for path in node_paths(out[0], out[2]))


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(context_weight=1.5), r"context_weight must lie in \[0, 1\]"),
        (dict(context_weight=float("nan")), "context_weight"),
        (dict(context="not a model"), "ContextNgram"),
        (dict(context=ContextNgram(3, [1, 2])), "out of step"),  # saw fewer tokens than the prompt
        (dict(context=ContextNgram(3, [1, 9, 3])), "ends differently"),
        # 50 followed 3 earlier: the proposal after the root 3 is 50, outside the vocabulary.
        (dict(context=ContextNgram(3, [3, 50, 1, 2, 3]), prompt=[3, 50, 1, 2, 3], vocab_size=48),
         r"proposal contains token id 50, outside \[0, 48\)"),
    ],
)
def test_bad_context_arguments_raise_value_error(change, message) -> None:
    args = dict(context=ContextNgram(3, [1, 2, 3]), context_weight=0.5, prompt=[1, 2, 3])
    args.update(change)
    history = args.pop("prompt")
    with pytest.raises(ValueError, match=message):
        tree_search(torch.tensor([[10, 11], [12, 13]]), torch.full((2, 2), 0.5), None, history, eos_token_id=EOS,
                    ngram_on_first_level=True, **args)


# ----------------------------------------------------------------------------------------------
# draft_trees: the one path serving and simulated τ share


class IdentityDraft:
    """Stands in for a DartDraftModel whose draft vocabulary is the target's."""

    @staticmethod
    def draft_to_target(ids: torch.Tensor) -> torch.Tensor:
        return ids


def test_draft_trees_builds_or_syncs_the_context_models() -> None:
    rng = np.random.default_rng(4)
    histories = [torch.tensor(rng.integers(0, 30, size=n)) for n in (25, 60, 3)]
    logits = torch.randn(3, 5, 30, generator=torch.Generator().manual_seed(0))
    settings = TreeSearchSettings(draft_top_k=6, beam_width=4, remain_total=12, context_ngram_weight=0.4)
    kwargs = dict(trie=None, settings=settings, eos_token_ids=[EOS])
    built = draft_trees(logits, IdentityDraft(), histories, **kwargs)  # from each whole history
    stale = request_context(settings)
    stale.extend(histories[1][:10])  # seen part of its history: synced up to the rest
    given = [None, stale, ContextNgram(3, histories[2])]
    kept = draft_trees(logits, IdentityDraft(), histories, contexts=given, **kwargs)
    assert len(stale) == 60
    for a, b in zip(built, kept, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values(), strict=True))
    off = draft_trees(logits, IdentityDraft(), histories, **{**kwargs, "settings": TreeSearchSettings(
        draft_top_k=6, beam_width=4, remain_total=12)})
    assert any(not torch.equal(a.tokens, b.tokens) for a, b in zip(built, off, strict=True))
    assert request_context(TreeSearchSettings()) is None
    with pytest.raises(ValueError, match="2 context models for 3 histories"):
        draft_trees(logits, IdentityDraft(), histories, contexts=given[:2], **kwargs)
    with pytest.raises(ValueError, match="order 4"):
        draft_trees(logits, IdentityDraft(), histories, contexts=[ContextNgram(4), None, None], **kwargs)
    with pytest.raises(ValueError, match="does not continue"):
        draft_trees(logits, IdentityDraft(), histories, contexts=[None, ContextNgram(3, [99, 98]), None], **kwargs)


def test_settings_validate_the_context_knobs() -> None:
    with pytest.raises(ValueError, match="context_ngram_weight"):
        TreeSearchSettings(context_ngram_weight=-0.1)
    with pytest.raises(ValueError, match="context_ngram_weight"):
        TreeSearchSettings(context_ngram_weight=1.5)
    with pytest.raises(ValueError, match="context_ngram_order"):
        TreeSearchSettings(context_ngram_order=6)
    assert TreeSearchSettings().with_overrides({"context_ngram_weight": 0.3}).context_ngram_weight == 0.3


# ----------------------------------------------------------------------------------------------
# Serving: lossless, and higher acceptance where the text repeats itself


CONTEXT_TREES = [
    TreeSearchSettings(draft_top_k=48, beam_width=20, remain_total=40, context_ngram_weight=0.5),
    TreeSearchSettings(draft_top_k=5, beam_width=3, remain_total=6, context_ngram_weight=0.3,
                       ngram_on_first_level=True),
    TreeSearchSettings(draft_top_k=4, beam_width=4, remain_total=10, context_ngram_weight=1.0,
                       context_ngram_order=4),
]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("tree", CONTEXT_TREES, ids=["wide", "small_first_level", "order4"])
def test_greedy_output_with_context_ngrams_is_identical_to_generate(kind: str, tree: TreeSearchSettings) -> None:
    base, head = tiny_pair(kind, draft_vocab_size=40 if kind == "qwen3" else None)
    trie = small_trie(5, 48)
    for model in (DartModel(base, head, tree=tree), DartModel(base, head, trie=trie, tree=tree)):
        for i in range(4):
            gen = torch.Generator().manual_seed(i)
            piece = torch.randint(3, 48, (1, 5 + i), generator=gen)
            prompt = torch.cat([piece, torch.randint(3, 48, (1, 3), generator=gen), piece], dim=1)  # repeats
            out = model.dart_generate(prompt, max_new_token_num=32)
            assert torch.equal(out, reference(base, prompt, 32)), (kind, i)


def test_serving_accepts_more_on_text_that_repeats_itself() -> None:
    # The random head's first token is rarely right, so the n-gram term (and the context's
    # proposals) start at level 0 here; test_a_repeated_span_gets_its_continuation_into_the_tree
    # covers the default, where the copy continues below a first token the draft got right.
    base, head = bigram_machine()
    tree = dict(draft_top_k=8, beam_width=6, remain_total=12, ngram_on_first_level=True)
    with_context = DartModel(base, head, tree=TreeSearchSettings(**tree, context_ngram_weight=0.5))
    without = DartModel(base, head, tree=TreeSearchSettings(**tree))
    taus, plain_taus = [], []
    for i in range(4):
        start = torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(30 + i))
        prompt = reference(base, start, 24)  # the model's own walk: what follows repeats it
        want = reference(base, prompt, 40)
        out, stats = with_context.dart_generate(prompt, max_new_token_num=40, return_stats=True)
        assert torch.equal(out, want)
        plain_out, plain = without.dart_generate(prompt, max_new_token_num=40, return_stats=True)
        assert torch.equal(plain_out, want)
        taus.append(stats.tau)
        plain_taus.append(plain.tau)
    mean, plain_mean = sum(taus) / 4, sum(plain_taus) / 4
    print(f"tau with context n-grams {taus}, without {plain_taus}")
    assert mean > plain_mean + 2.0, (taus, plain_taus)


def test_serving_keeps_one_context_model_per_request(monkeypatch) -> None:
    import dart_infer.methods.dart as dart_method

    seen: list[tuple[ContextNgram, int, int]] = []  # (the model, its length after the call, history length)

    def recording(*args, contexts=None, **kwargs):
        trees = draft_trees(*args, contexts=contexts, **kwargs)
        seen.append((contexts[0], len(contexts[0]), len(args[2][0])))
        return trees

    monkeypatch.setattr(dart_method, "draft_trees", recording)
    base, head = bigram_machine()
    model = DartModel(base, head, tree=TreeSearchSettings(draft_top_k=4, beam_width=4, remain_total=8,
                                                          context_ngram_weight=0.5))
    prompt = torch.randint(3, 48, (1, 9), generator=torch.Generator().manual_seed(3))
    models = []
    for _ in range(2):  # two requests: a new model each, the same one step after step
        start = len(seen)
        model.dart_generate(prompt, max_new_token_num=20)
        assert len(seen) - start >= 2 and all(s[0] is seen[start][0] for s in seen[start:])
        assert all(length == history for _, length, history in seen[start:])  # up to date at each search
        assert seen[start][1] == 10  # prompt + the prefill's root
        models.append(seen[start][0])
    assert models[0] is not models[1]


# ----------------------------------------------------------------------------------------------
# Simulated τ: the same acceptance as serving, anchor by anchor


# Each extra source of tree nodes, on and off: (settings with it on, the same with it off, how far past
# the draft's 4 levels a tree can reach, the new tokens each prompt generates).
TREE_EXTRAS = {
    "context_ngrams": (
        {"draft_top_k": 6, "beam_width": 4, "remain_total": 10, "context_ngram_weight": 0.5, "ngram_on_first_level": True},
        {"context_ngram_weight": 0.0}, 0, 30,
    ),
    "copy_spans": (
        {"draft_top_k": 6, "beam_width": 4, "remain_total": 10, "copy_span_tokens": 8},
        {"copy_span_tokens": 0}, 8, 40,
    ),
}


@pytest.mark.parametrize("extra", list(TREE_EXTRAS))
def test_simulated_tau_sees_tree_extras_as_serving_does(extra: str) -> None:
    from dart_infer.target.adapter import TargetModel
    from dart_train.data.dataset import TokenizedDataset
    from dart_train.states import OnlineStateSource
    from dart_train.trainer.simulated_tau import SimulatedTau

    tree, off, reach, new_tokens = TREE_EXTRAS[extra]
    base, _ = bigram_machine(seed=1)
    target = TargetModel(base)
    vocab = base.config.vocab_size
    torch.manual_seed(11)
    head = DartDraftModel(DartDraftConfig.from_target_config(base.config, draft_length=4, draft_vocab_size=vocab))
    head.eval()
    dart = DartModel(base, head, tree=TreeSearchSettings(**tree))  # given whole: no CPU-default extras
    sequences, steps = [], []
    for i in range(3):
        prompt = torch.randint(3, vocab, (8 + i,), generator=torch.Generator().manual_seed(40 + i))
        out, stats = dart.dart_generate(prompt[None], max_new_token_num=new_tokens, return_stats=True)
        assert torch.equal(out, reference(base, prompt[None], new_tokens))
        seq = out[0]
        mask = torch.zeros(seq.numel(), dtype=torch.bool)
        mask[prompt.numel() :] = True
        sequences.append({"input_ids": seq, "loss_mask": mask})
        history = prompt.numel() + 1
        for accepted, emitted in zip(stats.accept_lengths, stats.emitted, strict=True):
            steps.append((len(sequences) - 1, history - 2, accepted))
            history += emitted
    source = OnlineStateSource(target, topk=None, hidden_dtype=torch.float32)
    results = {}
    for name, settings in (("on", tree), ("off", {**tree, **off})):
        evaluator = SimulatedTau(
            TokenizedDataset(sequences), source, eos_token_ids=dart.eos_token_ids, tree=settings,
            anchors_per_sequence=10_000, batch_size=2,
        )
        results[name] = {(r[0], r[1]): r[2] for r in evaluator.anchor_results(head)[0]}
    compared = 0
    for index, t, accepted in steps:
        # Skip anchors whose tree may reach past the sequence's end (serving saw more tokens there).
        if t + 2 + 4 + reach > sequences[index]["input_ids"].numel() or (index, t) not in results["on"]:
            continue
        assert results["on"][(index, t)] == accepted, (index, t)
        compared += 1
    assert compared >= 5 and any(a > 1 + reach // 2 for _, _, a in steps)
    tau_on, tau_off = (sum(r.values()) / len(r) for r in (results["on"], results["off"]))
    assert tau_on > tau_off + 1.0
