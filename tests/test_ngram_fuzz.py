"""Seeded mutations and truncations of valid files (both formats): clean errors or valid tries only."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np
import pytest

from ngram_builder import NgramFormatError, NgramTrie

N_MUTATIONS = 300
# What a damaged file may raise: a format error (a ValueError) or, for counts that do not fit the
# original format on re-export, OverflowError. Anything else (or a crash) fails the test.
CLEAN = (NgramFormatError, ValueError, OverflowError)


def _small_trie() -> NgramTrie:
    rng = random.Random(5)
    t = NgramTrie(3, tokenizer_fingerprint="fuzz")
    for _ in range(12):
        t.add_tokens([rng.randrange(40) for _ in range(rng.randrange(1, 30))])
    t.add_tokens([7] * 300)  # an escaped (large) count
    return t


def _wide_trie() -> NgramTrie:
    """Contexts with enough children for the query's hash paths: token 0 has 700 (its candidates
    are looked up through the level-2 hash), token 5 has 100 (the 2-token contexts (5, x) are)."""
    rng = random.Random(6)
    t = NgramTrie(3, vocab_size=1000, tokenizer_fingerprint="fuzz")
    for x in range(700):
        t.add_tokens([0, x, (x * 7) % 1000])
    for x in range(100):
        t.add_tokens([5, x, 0, x])
    for _ in range(20):
        t.add_tokens([rng.randrange(1000) for _ in range(30)])
    t.add_tokens([7] * 300)
    return t


def _mutate(raw: bytes, rng: random.Random) -> bytes:
    b = bytearray(raw)
    kind = rng.randrange(6)
    if kind == 0:  # truncate
        return bytes(b[: rng.randrange(len(b))])
    if kind == 1:  # extend
        return bytes(b + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))))
    if kind == 2:  # flip bits
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == 3:  # random bytes run
        pos = rng.randrange(len(b))
        for i in range(pos, min(len(b), pos + rng.randrange(1, 16))):
            b[i] = rng.randrange(256)
        return bytes(b)
    if kind == 4:  # a huge or small 64-bit value at an 8-aligned or 4-aligned spot
        pos = rng.randrange(0, max(1, len(b) - 8)) // 4 * 4
        val = rng.choice([0, 1, 2**31 - 1, 2**32, 2**63 - 1, 2**64 - 1, rng.randrange(2**64)])
        struct.pack_into("<Q", b, pos, val)
        return bytes(b)
    # swap two chunks
    i, j = sorted(rng.randrange(len(b)) for _ in range(2))
    n = min(8, len(b) - j)
    b[i : i + n], b[j : j + n] = b[j : j + n], b[i : i + n]
    return bytes(b)


def _exercise(trie: NgramTrie, tmp: Path) -> None:
    """Use a trie that loaded: queries, walks, merge, prune, re-export must be clean."""
    ctx = np.array([[1, 2], [7, 7], [3, 0], [39, 38], [0, 5], [5, 0]])
    cand = np.tile(np.arange(0, 350, 7), (6, 1))
    try:
        trie.probability_batch(ctx, cand)
        trie.probability_batch(ctx, cand[:, :25])
        trie.probability([7, 7], list(range(50)))
        trie.top_continuations([7], 5)
        trie.top_continuations([], 5)
        pruned = trie.prune(2)
        pruned.probability([7], [7])
        other = NgramTrie(trie.order)
        other.add_tokens([1, 2, 3])
        other.merge(trie)
        trie.save_dart(tmp / "re.trie", overwrite=True)
        NgramTrie.load_dart(tmp / "re.trie")
    except CLEAN:
        pass


@pytest.mark.parametrize("shape", ["small", "wide"])
@pytest.mark.parametrize("fmt", ["compact", "dart"])
def test_mutated_files_never_crash(fmt: str, shape: str, tmp_path: Path) -> None:
    src = tmp_path / ("t.ngt" if fmt == "compact" else "t.trie")
    trie = _small_trie() if shape == "small" else _wide_trie()
    if fmt == "compact":
        trie.save(src)
    else:
        trie.save_dart(src)
    raw = src.read_bytes()
    rng = random.Random(1234 if fmt == "compact" else 4321)
    outcomes = {"error": 0, "loaded": 0}
    bad = tmp_path / "bad"
    for i in range(N_MUTATIONS):
        bad.write_bytes(_mutate(raw, rng))
        for verify in ((False, True) if fmt == "compact" else (None,)):
            try:
                # Every other file is read into memory, which builds the candidate index from it.
                t = (NgramTrie.load(bad, verify=bool(verify), mmap=i % 2 == 0) if fmt == "compact"
                     else NgramTrie.load_dart(bad))
            except CLEAN as e:
                assert str(e)  # names the problem
                outcomes["error"] += 1
                continue
            outcomes["loaded"] += 1
            if verify or fmt == "dart":
                # Fully validated: a valid trie must work end to end without error.
                t.verify()
                t.probability([7, 7], [7])
            _exercise(t, tmp_path)
    assert outcomes["error"] > N_MUTATIONS // 2
    # Unmutated file still loads.
    loaded = NgramTrie.load(src, verify=True) if fmt == "compact" else NgramTrie.load_dart(src)
    assert loaded.num_nodes == trie.num_nodes


def test_garbage_files(tmp_path: Path) -> None:
    rng = random.Random(9)
    p = tmp_path / "g"
    for n in (0, 1, 15, 16, 24, 100, 255, 256, 4096):
        p.write_bytes(bytes(rng.randrange(256) for _ in range(n)))
        with pytest.raises(CLEAN):
            NgramTrie.load(p)
        with pytest.raises(CLEAN):
            NgramTrie.load_dart(p)
