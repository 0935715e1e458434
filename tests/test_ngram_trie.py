"""NgramTrie semantics: golden fixtures of the original, brute-force references, capsule, API."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from ngram_builder import NgramFormatError, NgramMismatchError, NgramTrie, _core

FIX = Path(__file__).parent / "fixtures"


def _golden_docs() -> tuple[int, list[list[int]]]:
    d = json.loads((FIX / "golden60_docs.json").read_text())
    return d["order"], d["docs"]


def _golden_queries() -> list[dict]:
    return [json.loads(line) for line in (FIX / "golden60_queries.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def golden_built() -> NgramTrie:
    order, docs = _golden_docs()
    t = NgramTrie(order)
    for doc in docs:
        t.add_tokens(doc)
    return t


def _assert_golden(trie: NgramTrie) -> None:
    queries = _golden_queries()
    assert len(queries) == 500
    for q in queries:
        probs, matched = trie.probability(q["context"], q["tokens"])
        assert matched == q["matched"], q
        np.testing.assert_allclose(probs, q["probs"], rtol=0, atol=1e-6)


def test_golden_build_matches_original(golden_built: NgramTrie) -> None:
    assert golden_built.num_nodes == 87_893
    assert golden_built.order == 3
    _assert_golden(golden_built)


def test_golden_original_file_matches(golden_built: NgramTrie) -> None:
    loaded = NgramTrie.load_dart(FIX / "golden60.trie")
    assert loaded.num_nodes == 87_893
    _assert_golden(loaded)
    # Same counts as our build: identical compact images.
    assert loaded.info()["levels"] == golden_built.info()["levels"]


def test_batched_forms_agree_with_single(golden_built: NgramTrie) -> None:
    queries = _golden_queries()
    ctxs = [q["context"] for q in queries]
    toks = [q["tokens"] for q in queries]
    probs, matched = golden_built.probability_batch(ctxs, toks)
    for q, p, m in zip(queries, probs, matched, strict=True):
        assert m == q["matched"]
        np.testing.assert_allclose(p, q["probs"], atol=1e-6)
    # Array form: contexts left-aligned with lengths; all rows need the same candidate count.
    k = min(len(t) for t in toks)
    width = max(len(c) for c in ctxs)
    arr = np.zeros((len(ctxs), max(width, 1)), dtype=np.int64)
    lens = np.array([len(c) for c in ctxs])
    for i, c in enumerate(ctxs):
        arr[i, : len(c)] = c
    tok_arr = np.array([t[:k] for t in toks])
    p_arr, m_arr = golden_built.probability_batch(arr, tok_arr, context_lengths=lens)
    assert p_arr.dtype == np.float32 and m_arr.dtype == np.int32
    for i, q in enumerate(queries):
        assert list(m_arr[i]) == q["matched"][:k]
        np.testing.assert_allclose(p_arr[i], q["probs"][:k], atol=1e-6)


def _edge_rows(docs: list[list[int]], vocab: int, rows: int, seed: int) -> list[list[int]]:
    """Contexts of 0..4 tokens from the documents, some with ids outside the vocabulary, many
    ending in the same token (the tree search's beams do)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        doc = rng.choice(docs)
        i = rng.randrange(len(doc))
        ctx = doc[max(0, i - rng.randrange(5)) : i]
        if ctx and rng.random() < 0.1:
            ctx[rng.randrange(len(ctx))] = rng.choice([vocab, vocab + 7, 2**31 - 1])
        if out and rng.random() < 0.4:
            ctx = [rng.choice(docs[0])] + out[-1][-1:]  # same last token as the previous row
        out.append(ctx)
    return out


@pytest.mark.parametrize("order", [3, 4])
@pytest.mark.parametrize("k", [25, 100])
def test_batched_edge_rows_agree_with_single(order: int, k: int) -> None:
    # Batches overlap their rows' queries (a pipeline) and share what rows with the same last
    # token and candidates have in common: every row must still answer like a single query.
    _, docs = _golden_docs()
    t = NgramTrie(order)
    for doc in docs:
        t.add_tokens(doc)
    rng = random.Random(k + order)
    ctxs = _edge_rows(docs, t.vocab_size, 300, seed=order)
    pool = [tok for doc in docs[:5] for tok in doc] + [t.vocab_size, t.vocab_size + 3]
    shared = [rng.choice(pool) for _ in range(k)]
    toks = [[rng.choice(pool) for _ in range(k)] for _ in ctxs]
    singles = [t.probability(c, tk) for c, tk in zip(ctxs, toks, strict=True)]
    probs, matched = t.probability_batch(ctxs, toks)
    assert [(p, m) for p, m in zip(probs, matched, strict=True)] == singles
    # Shared candidates, through the interface the tree search uses.
    p_flat, m_flat = _core.query_capsule_batch(t._ngram_query_capsule(), ctxs, shared)
    for r, c in enumerate(ctxs):
        p, m = t.probability(c, shared)
        assert m_flat[r * k : (r + 1) * k] == m
        assert p_flat[r * k : (r + 1) * k] == p


def test_capsule_answers_like_the_trie(golden_built: NgramTrie) -> None:
    cap = golden_built._ngram_query_capsule()
    assert type(cap).__name__ == "PyCapsule"
    for q in _golden_queries()[:100]:
        probs, matched, order = _core.query_capsule(cap, q["context"], q["tokens"])
        assert order == 3
        assert matched == q["matched"]
        np.testing.assert_allclose(probs, q["probs"], atol=1e-6)


def test_capsule_keeps_snapshot_alive_after_mutation_and_drop() -> None:
    t = NgramTrie(3)
    t.add_tokens([1, 2, 3, 1, 2, 4])
    cap = t._ngram_query_capsule()
    t.add_tokens([1, 2, 5, 5, 5])
    del t
    probs, matched, _ = _core.query_capsule(cap, [1, 2], [3, 4, 5])
    assert matched == [2, 2, 0]
    assert probs == pytest.approx([0.5, 0.5, 0.0])


# --- brute-force references ---------------------------------------------------------------------

def _ref_counts(docs: list[list[int]], order: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {(): 0}
    for doc in docs:
        for s in range(len(doc)):
            sl = tuple(doc[s : s + order])
            for k in range(len(sl) + 1):
                counts[sl[:k]] = counts.get(sl[:k], 0) + 1
    return counts


def _ref_probability(counts: dict, order: int, context: list[int], tokens: list[int]):
    probs = [0.0] * len(tokens)
    matched = [0] * len(tokens)
    for ln in range(min(order - 1, len(context)), 0, -1):
        ctx = tuple(context[len(context) - ln :])
        if ctx not in counts:
            continue
        # A zero context count (only after pruning) gives 0.0 here, NaN in the original.
        inv = np.float32(1.0) / np.float32(counts[ctx]) if counts[ctx] else np.float32(0.0)
        for i, tok in enumerate(tokens):
            if matched[i] == 0 and ctx + (tok,) in counts:
                probs[i] = float(np.float32(counts[ctx + (tok,)]) * inv)
                matched[i] = ln
    return probs, matched


def _ref_prune(counts: dict, threshold: int) -> dict:
    """The original's recursive reduce on a dict trie (root starts from its own count here)."""
    children: dict[tuple, list[tuple]] = {}
    for key in counts:
        if key:
            children.setdefault(key[:-1], []).append(key)
    out: dict[tuple, int] = {}

    def rec(node: tuple) -> int:
        reduced = 0
        for child in children.get(node, []):
            if counts[child] >= threshold:
                out[child] = counts[child]
                r = rec(child)
                out[child] -= r
                reduced += r
            else:
                reduced += counts[child]
        return reduced

    out[()] = counts[()] - rec(())
    return out


def _random_docs(seed: int, n_docs: int = 30, vocab: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(0, 40))] for _ in range(n_docs)]


def _all_counts(trie: NgramTrie, order: int, vocab: int) -> dict[tuple[int, ...], int]:
    """Walk the trie through top_continuations (exact context lookups)."""
    out: dict[tuple[int, ...], int] = {}
    frontier: list[tuple[int, ...]] = [()]
    while frontier:
        ctx = frontier.pop()
        if len(ctx) >= order:
            continue
        for tok, cnt, _ in trie.top_continuations(list(ctx), vocab + 1):
            out[ctx + (tok,)] = cnt
            frontier.append(ctx + (tok,))
    return out


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_counts_and_queries_match_bruteforce(order: int) -> None:
    docs = _random_docs(order)
    t = NgramTrie(order)
    for d in docs:
        t.add_tokens(d)
    ref = _ref_counts(docs, order)
    assert t.num_nodes == len(ref)
    assert _all_counts(t, order, 12) == {k: v for k, v in ref.items() if k}
    rng = random.Random(99)
    for _ in range(200):
        ctx = [rng.randrange(13) for _ in range(rng.randrange(0, 5))]
        toks = [rng.randrange(13) for _ in range(6)]
        assert t.probability(ctx, toks) == _ref_probability(ref, order, ctx, toks)


def _wide_docs(vocab: int) -> tuple[list[list[int]], list[tuple[int, int]], list[int]]:
    """Documents whose contexts have child runs of every size the query's search strategies switch
    at (SIMD blocks, segments, binary search ending in a window, the level-2 hash)."""
    rng = random.Random(7)
    docs: list[list[int]] = []
    pairs, singles = [], []
    for i, size in enumerate([1, 7, 8, 9, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 200, 511, 512, 513, 1500]):
        a, b = 2 * i + 1, 2 * i + 2  # a distinct 2-token context per size
        pairs.append((a, b))
        for tok in rng.sample(range(100, vocab), size):
            docs.extend([[a, b, tok]] * rng.choice([1, 1, 2, 300]))  # some counts escape one byte
    for i, size in enumerate([40, 48, 300, 600, 2000]):
        c = 60 + i
        singles.append(c)
        for tok in rng.sample(range(100, vocab), size):
            docs.extend([[c, tok]] * rng.choice([1, 2, 3]))
    docs.extend([rng.randrange(vocab) for _ in range(rng.randrange(2, 50))] for _ in range(300))
    return docs, pairs, singles


@pytest.mark.parametrize("vocab", [5000, 80_000])  # 2- and 4-byte tokens
@pytest.mark.parametrize("load", ["built", "mmap", "in_memory"])
def test_wide_child_runs_match_bruteforce(load: str, vocab: int, tmp_path: Path) -> None:
    docs, pairs, singles = _wide_docs(vocab)
    t = NgramTrie(3, vocab_size=vocab)
    for d in docs:
        t.add_tokens(d)
    if load != "built":
        t.save(tmp_path / "w.ngt")
        t = NgramTrie.load(tmp_path / "w.ngt", verify=True, mmap=load == "mmap")
        # In memory, the contexts whose candidates would go through the hash get an index.
        assert (t.info()["candidate_index_bytes"] > 0) == (load == "in_memory")
    ref = _ref_counts(docs, 3)
    rng = np.random.default_rng(3)
    contexts, cands = [], []

    def children_of(ctx: list[int]) -> list[int]:
        return sorted(k[-1] for k in ref if len(k) == len(ctx) + 1 and list(k[:-1]) == ctx)

    for ctx in [*map(list, pairs), *([99, c] for c in singles), *([c] for c in singles)]:
        # Present children (the run's first and last too; [99, c] is unseen: those of [c]), absent
        # tokens around them, ids outside the vocabulary.
        children = children_of(ctx) or children_of(ctx[-1:])
        present = [children[0], children[-1], *rng.choice(children, size=10)]
        absent = [*rng.integers(0, vocab, size=9), vocab - 1, vocab, 90_000]
        cand = [int(x) for x in (*present, *absent)][:25]
        assert t.probability(ctx, cand) == _ref_probability(ref, 3, ctx, cand), ctx
        contexts.append(([0] + ctx)[-2:])
        cands.append(cand)
    # The batched form (a pipeline of several queries) gives the same answers.
    probs, matched = t.probability_batch(np.array(contexts), np.array(cands))
    for row, (ctx, cand) in enumerate(zip(contexts, cands, strict=True)):
        assert (probs[row].tolist(), matched[row].tolist()) == _ref_probability(ref, 3, ctx, cand), ctx


@pytest.mark.parametrize("threshold", [0, 1, 2, 3, 5, 20])
def test_prune_matches_original_reduce(threshold: int) -> None:
    docs = _random_docs(7, n_docs=40, vocab=8)
    t = NgramTrie(3)
    for d in docs:
        t.add_tokens(d)
    ref = _ref_prune(_ref_counts(docs, 3), threshold)
    pruned = t.prune(threshold)
    assert pruned.num_nodes == len(ref)
    assert _all_counts(pruned, 3, 8) == {k: v for k, v in ref.items() if k}
    assert pruned.info()["root_count"] == ref[()]
    rng = random.Random(threshold)
    for _ in range(100):
        ctx = [rng.randrange(9) for _ in range(rng.randrange(1, 3))]
        toks = list(range(9))
        p, m = pruned.probability(ctx, toks)
        rp, rm = _ref_probability(ref, 3, ctx, toks)
        assert m == rm
        assert p == pytest.approx(rp)
    # The source trie is unchanged.
    assert t.num_nodes == len(_ref_counts(docs, 3))


def test_merge_equals_building_everything() -> None:
    docs = _random_docs(3, n_docs=50)
    a, b, both = NgramTrie(3), NgramTrie(3), NgramTrie(3)
    for i, d in enumerate(docs):
        (a if i % 2 else b).add_tokens(d)
        both.add_tokens(d)
    a.merge(b)
    assert a.info() == both.info()
    assert _all_counts(a, 3, 12) == _all_counts(both, 3, 12)
    # Adding after a query (freeze) then more documents merges incrementally.
    c = NgramTrie(3)
    for d in docs[:25]:
        c.add_tokens(d)
    assert c.num_nodes > 1
    for d in docs[25:]:
        c.add_tokens(d)
    assert _all_counts(c, 3, 12) == _all_counts(both, 3, 12)
    self_merged = NgramTrie(3)
    self_merged.add_tokens([1, 2, 3])
    self_merged.merge(self_merged)
    assert self_merged.top_continuations([1], 5) == [(2, 2, 1.0)]


def test_merge_pruned_tries_sums_nodewise() -> None:
    docs = _random_docs(11, n_docs=40, vocab=6)
    t = NgramTrie(3)
    for d in docs:
        t.add_tokens(d)
    p = t.prune(3)
    q = t.prune(3)
    p.merge(q)
    assert _all_counts(p, 3, 6) == {k: 2 * v for k, v in _all_counts(q, 3, 6).items()}


def test_bad_input_is_rejected_cleanly() -> None:
    t = NgramTrie(3, vocab_size=10)
    with pytest.raises(ValueError, match="negative"):
        t.add_tokens([1, -2, 3])
    with pytest.raises(ValueError, match="out of range"):
        t.add_tokens([1, 10])
    with pytest.raises(TypeError):
        t.add_tokens([1, "a"])
    with pytest.raises(TypeError):
        t.add_tokens(np.array([1.5, 2.0]))
    with pytest.raises(ValueError, match="negative"):
        t.probability([1, -1], [2])
    with pytest.raises(ValueError):
        NgramTrie(0)
    with pytest.raises(ValueError):
        NgramTrie(99)
    with pytest.raises(ValueError):
        NgramTrie(3, tokenizer_fingerprint="x" * 65)
    with pytest.raises(ValueError):
        t.merge(NgramTrie(2))  # different order
    # Nothing was counted by the failed calls.
    assert t.num_nodes == 1
    # Ids >= vocab in queries are simply unseen.
    t.add_tokens([1, 2, 3])
    assert t.probability([1, 2], [3, 10**12]) == ([1.0, 0.0], [2, 0])


def test_empty_and_degenerate_queries() -> None:
    t = NgramTrie(3)
    assert t.probability([1, 2], [3]) == ([0.0], [0])
    t.add_tokens([])
    t.add_tokens(np.array([], dtype=np.int64))
    t.add_tokens([5])
    assert t.num_nodes == 2
    assert t.probability([], [5]) == ([0.0], [0])
    assert t.probability([5], []) == ([], [])
    # Context longer than order-1: only the last two tokens matter.
    t.add_tokens(np.array([7, 8, 9], dtype=np.int32))
    assert t.probability([1, 2, 3, 7, 8], [9]) == ([1.0], [2])


def test_fingerprint_and_compatibility() -> None:
    t = NgramTrie(3, tokenizer_fingerprint="tok-abc")
    t.add_tokens([1, 2, 3])
    assert t.tokenizer_fingerprint == "tok-abc"
    t.check_compatible(vocab_size=10, tokenizer_fingerprint="tok-abc")
    with pytest.raises(NgramMismatchError, match="tokenizer"):
        t.check_compatible(tokenizer_fingerprint="other")
    with pytest.raises(NgramMismatchError, match="vocabulary"):
        t.check_compatible(vocab_size=3)
    assert issubclass(NgramFormatError, ValueError)


def test_large_counts_use_escapes() -> None:
    # One count of 300 among ~2000 ones: 1-byte counts with one escaped entry on level 1.
    t = NgramTrie(2)
    t.add_tokens([3] * 300 + list(range(10, 2000)))
    info = t.info()
    assert info["levels"][0]["count_bytes"] == 1
    assert info["levels"][0]["escaped_counts"] == 1
    p, m = t.probability([3], [3, 10])
    assert m == [1, 1]
    assert p == pytest.approx([299 / 300, 1 / 300], rel=1e-6)
    t.verify()
    # Huge counts that dominate a level get a wide count field instead.
    w = NgramTrie(2)
    w.add_tokens([5] * 70_000 + [6])
    assert w.info()["levels"][0]["count_bytes"] == 4
    p, m = w.probability([5], [5, 6])
    assert m == [1, 1]
    assert p == pytest.approx([69_999 / 70_000, 1 / 70_000], rel=1e-6)


def test_large_batches_split_over_threads_agree(golden_built: NgramTrie) -> None:
    rng = np.random.default_rng(3)
    _, docs = _golden_docs()
    flat = np.concatenate([np.asarray(d) for d in docs])
    pos = rng.integers(0, len(flat) - 3, size=3000)  # >= 2048 rows: the threaded path
    ctx = np.stack([flat[pos], flat[pos + 1]], axis=1)
    cand = flat[rng.integers(0, len(flat), size=(3000, 25))]
    cand[:, 0] = flat[pos + 2]
    probs, matched = golden_built.probability_batch(ctx, cand)
    assert (matched[:, 0] > 0).mean() > 0.9  # windows may straddle two documents
    for i in range(0, 3000, 97):
        p, m = golden_built.probability(ctx[i].tolist(), cand[i].tolist())
        assert list(matched[i]) == m
        np.testing.assert_array_equal(probs[i], np.float32(p))


def test_benchmark_helpers_measure_and_reject_bad_arguments(golden_built: NgramTrie) -> None:
    # The query and memory timers behind scripts/bench_ngram.py: real, positive measurements.
    ctx = np.array([[1, 2], [3, 4]], dtype=np.int32)
    cand = np.arange(50, dtype=np.int32).reshape(2, 25)
    wall_ns, cpu_ns = golden_built._t.bench_queries(ctx, cand, 2)
    assert wall_ns > 0 and cpu_ns > 0
    dependent_ns, independent_ns = _core.bench_memory(4.0, 20_000)
    assert dependent_ns > 0 and independent_ns > 0
    for bad in ({"mb": 0.5}, {"mb": 1e6}, {"reads": 0}, {"reads": 10**9}):
        with pytest.raises(ValueError, match="mb|reads"):
            _core.bench_memory(**bad)
