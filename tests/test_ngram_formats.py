"""Compact (.ngt) and original (.trie) formats: round trips, header, errors, external build."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from ngram_builder import NgramFormatError, NgramMismatchError, NgramTrie, _core

FIX = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def golden() -> NgramTrie:
    return NgramTrie.load_dart(FIX / "golden60.trie", tokenizer_fingerprint="smollm2-test")


def _queries() -> list[dict]:
    return [json.loads(line) for line in (FIX / "golden60_queries.jsonl").read_text().splitlines()]


def _check_golden(trie: NgramTrie) -> None:
    for q in _queries():
        probs, matched = trie.probability(q["context"], q["tokens"])
        assert matched == q["matched"]
        np.testing.assert_allclose(probs, q["probs"], atol=1e-6)


def test_compact_round_trip_is_mapped_and_exact(golden: NgramTrie, tmp_path: Path) -> None:
    path = tmp_path / "g.ngt"
    golden.save(path)
    loaded = NgramTrie.load(path, verify=True)
    info = loaded.info()
    assert info["memory_mapped"] is True
    assert info["num_nodes"] == 87_893
    assert info["order"] == 3
    assert info["vocab_size"] == golden.vocab_size
    assert info["tokenizer_fingerprint"] == "smollm2-test"
    assert path.stat().st_size == loaded.file_bytes == golden.file_bytes
    assert path.stat().st_size / 87_893 < 8  # bytes per node on disk
    _check_golden(loaded)
    # Read into memory (huge pages + candidate index) instead of mapped: the same answers.
    copied = NgramTrie.load(path, verify=True, mmap=False)
    assert copied.info()["memory_mapped"] is False
    assert copied.info()["candidate_index_bytes"] > 0  # golden60 has contexts with > 512 children
    assert copied.nbytes > loaded.nbytes
    _check_golden(copied)
    with pytest.raises(FileNotFoundError):
        NgramTrie.load(tmp_path / "missing.ngt", mmap=False)
    # Saving a loaded trie again gives the same bytes.
    path2 = tmp_path / "g2.ngt"
    loaded.save(path2)
    assert path2.read_bytes() == path.read_bytes()


def test_header_layout(golden: NgramTrie, tmp_path: Path) -> None:
    path = tmp_path / "g.ngt"
    golden.save(path)
    raw = path.read_bytes()
    assert raw[:8] == b"DARTNGRM"
    version, header_bytes, order, token_bytes = struct.unpack_from("<4I", raw, 8)
    assert (version, header_bytes, order, token_bytes) == (_core.FORMAT_VERSION, 256, 3, 2)
    vocab, nodes, size = struct.unpack_from("<3Q", raw, 24)
    assert (vocab, nodes, size) == (golden.vocab_size, 87_893, len(raw))
    assert len(raw) % 64 == 0


def test_fingerprint_is_stored_and_checked(tmp_path: Path) -> None:
    t = NgramTrie(3, vocab_size=100, tokenizer_fingerprint="tok-1")
    t.add_tokens([1, 2, 3, 4])
    path = tmp_path / "t.ngt"
    t.save(path)
    assert NgramTrie.load(path).tokenizer_fingerprint == "tok-1"
    assert NgramTrie.load(path).vocab_size == 100
    NgramTrie.load(path, vocab_size=100, tokenizer_fingerprint="tok-1")
    with pytest.raises(NgramMismatchError):
        NgramTrie.load(path, tokenizer_fingerprint="tok-2")
    with pytest.raises(NgramMismatchError):
        NgramTrie.load(path, vocab_size=50)
    t.tokenizer_fingerprint = "tok-3"
    t.save(path, overwrite=True)
    assert NgramTrie.load(path, verify=True).tokenizer_fingerprint == "tok-3"


def test_no_silent_overwrite_and_bad_paths(golden: NgramTrie, tmp_path: Path) -> None:
    path = tmp_path / "g.ngt"
    golden.save(path)
    with pytest.raises(FileExistsError):
        golden.save(path)
    with pytest.raises(FileExistsError):
        golden.save_dart(path)
    golden.save(path, overwrite=True)
    with pytest.raises(FileNotFoundError):
        NgramTrie.load(tmp_path / "missing.ngt")
    with pytest.raises(FileNotFoundError):
        NgramTrie.load_dart(tmp_path / "missing.trie")
    with pytest.raises(IsADirectoryError):
        NgramTrie.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        golden.save(tmp_path / "no" / "such" / "dir.ngt")
    assert not list(tmp_path.glob("*partial*"))


def test_wrong_magic_version_and_format_mixups(golden: NgramTrie, tmp_path: Path) -> None:
    compact = tmp_path / "g.ngt"
    dart = tmp_path / "g.trie"
    golden.save(compact)
    golden.save_dart(dart)
    with pytest.raises(NgramFormatError, match="load_dart"):
        NgramTrie.load(dart)
    with pytest.raises(NgramFormatError, match="NgramTrie.load"):
        NgramTrie.load_dart(compact)
    raw = bytearray(compact.read_bytes())
    raw[8] = 99  # version
    bad = tmp_path / "v.ngt"
    bad.write_bytes(raw)
    with pytest.raises(NgramFormatError, match="version"):
        NgramTrie.load(bad)
    raw = bytearray(compact.read_bytes())
    raw[200] ^= 1  # reserved header byte -> header checksum
    bad.write_bytes(raw)
    with pytest.raises(NgramFormatError, match="checksum"):
        NgramTrie.load(bad)
    bad.write_bytes(compact.read_bytes()[:-64])
    with pytest.raises(NgramFormatError, match="size"):
        NgramTrie.load(bad)
    bad.write_bytes(b"")
    with pytest.raises(NgramFormatError):
        NgramTrie.load(bad)
    with pytest.raises(NgramFormatError):
        NgramTrie.load_dart(bad)


def test_payload_corruption_caught_by_verify(golden: NgramTrie, tmp_path: Path) -> None:
    path = tmp_path / "g.ngt"
    golden.save(path)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(raw)
    NgramTrie.load(path)  # cheap checks pass: header and table are intact
    with pytest.raises(NgramFormatError, match="checksum"):
        NgramTrie.load(path, verify=True)


def test_dart_round_trip(golden: NgramTrie, tmp_path: Path) -> None:
    path = tmp_path / "rt.trie"
    golden.save_dart(path)
    # 24 bytes per node + 12 per edge, as the original writes.
    assert path.stat().st_size == 16 + 24 * 87_893 + 12 * 87_892
    assert path.stat().st_size == (FIX / "golden60.trie").stat().st_size
    again = NgramTrie.load_dart(path)
    assert again.num_nodes == 87_893
    _check_golden(again)
    c1, c2 = tmp_path / "a.ngt", tmp_path / "b.ngt"
    golden.save(c1)
    again.tokenizer_fingerprint = golden.tokenizer_fingerprint
    again.save(c2)
    assert c1.read_bytes() == c2.read_bytes()


def test_dart_vocab_check(tmp_path: Path) -> None:
    with pytest.raises(NgramFormatError, match="vocabulary"):
        NgramTrie.load_dart(FIX / "golden60.trie", vocab_size=1000)
    t = NgramTrie.load_dart(FIX / "golden60.trie", vocab_size=49152)
    assert t.vocab_size == 49152


def test_dart_root_overflow_and_negative_root(tmp_path: Path) -> None:
    # A pruned trie written by the original has a negative root count: accepted.
    t = NgramTrie(2)
    t.add_tokens([1, 2, 1, 3])
    path = tmp_path / "p.trie"
    t.save_dart(path)
    raw = bytearray(path.read_bytes())
    struct.pack_into("<i", raw, 16 + 4 + 8, -7)
    path.write_bytes(raw)
    loaded = NgramTrie.load_dart(path)
    assert loaded.probability([1], [2, 3]) == t.probability([1], [2, 3])
    assert loaded.info()["root_count"] == 4


def test_unsaved_and_mapped_tries_answer_identically(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    t = NgramTrie(3, vocab_size=70_000)  # > 65536: 4-byte tokens
    for _ in range(20):
        t.add_tokens(rng.integers(0, 70_000, size=300))
    t.add_tokens([69_999, 69_998, 69_999, 69_998])
    path = tmp_path / "w.ngt"
    t.save(path)
    m = NgramTrie.load(path, verify=True)
    assert m.info()["token_bytes"] == 4
    ctx = rng.integers(0, 70_000, size=(50, 2))
    ctx[0] = [69_999, 69_998]
    cand = rng.integers(0, 70_000, size=(50, 25))
    a = t.probability_batch(ctx, cand)
    b = m.probability_batch(ctx, cand)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert m.probability([69_999, 69_998], [69_999]) == ([0.5], [2])  # 2nd occurrence ends the doc


def test_external_build_is_byte_identical(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 500, size=rng.integers(1, 400)).astype(np.int32) for _ in range(300)]
    mem = _core.SliceCounter(3, 500, 0, "", 2)
    capped = _core.SliceCounter(3, 500, 64 * 1024, str(tmp_path), 2)  # 64 KiB: many spilled runs
    for d in docs:
        mem.add_tokens(d)
    flat = np.concatenate(docs)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    capped.add_flat(flat, offsets)
    assert mem.tokens == capped.tokens == len(flat)
    in_memory = NgramTrie._wrap(mem.build("", "fp"))
    a = tmp_path / "mem.ngt"
    in_memory.save(a)
    b = tmp_path / "capped.ngt"
    assert capped.build(str(b), "fp") is None
    assert a.read_bytes() == b.read_bytes()
    # Same as counting through NgramTrie.add_tokens.
    ref = NgramTrie(3, vocab_size=500, tokenizer_fingerprint="fp")
    for d in docs:
        ref.add_tokens(d)
    c = tmp_path / "ref.ngt"
    ref.save(c)
    assert c.read_bytes() == a.read_bytes()
    # Pruning to a file under a spill directory matches pruning in memory.
    p_mem = tmp_path / "p_mem.ngt"
    ref.prune(2).save(p_mem)
    p_ext = _core.Trie.load(str(b)).prune(2, str(tmp_path / "p_ext.ngt"), str(tmp_path))
    assert p_ext.num_nodes == NgramTrie.load(p_mem).num_nodes
    assert (tmp_path / "p_ext.ngt").read_bytes() == p_mem.read_bytes()
    assert not [p for p in tmp_path.iterdir() if "ngram-" in p.name]  # temp files gone
