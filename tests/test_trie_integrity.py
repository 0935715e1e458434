"""A trie whose header and size are intact but whose payload is corrupt is refused at load, with one
line naming the file, what is wrong, where, and how to rebuild it; `ngram_model=auto` then runs DART
without a trie, an explicit `ngram_model` fails before any model loads, and the full check
(`ngram_verify`, the payload checksum) is reachable from the configs.

No skips: without the C++ extension these tests fail (the import below) instead of passing unnoticed.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from ngram_builder import CorruptTrieError, NgramFormatError, NgramTrie
from ngram_builder.build import CorpusSource, build_tries

HEADER_BYTES = 256
TOKENS, COUNTS, ESC_IDX, ESC_VAL, CHILD = 1, 2, 3, 4, 5
WORDS = ("the", "cat", "dog", "sat", "on", "a", "mat", "and", "ran", "to", "see", "big", "red", "blue",
         "house", "tree", "river", "under", "over", "with", "from", "it", "is", "was", "we", "they", "go")


# ----------------------------------------------------------------------------------- the files


@pytest.fixture(scope="module")
def built(smollm2_tokenizer, tmp_path_factory) -> dict[str, Any]:
    """full.ngt from the project's builder, with the SmolLM2 tokenizer (so `ngram_model=auto` accepts
    it when intact), and the same trie in the original .trie format."""
    from dart_infer.data.assets import tokenizer_fingerprint

    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(5, 40))) for _ in range(600)]
    docs.append(" ".join(["ok"] * 400))  # a trigram seen ~400 times: an escaped 1-byte count
    out = tmp_path_factory.mktemp("built")
    tok = smollm2_tokenizer
    build_tries([CorpusSource("words", lambda: docs)], lambda texts: tok(texts)["input_ids"], out,
                vocab_size=len(tok), eos_id=tok.eos_token_id, fingerprint=tokenizer_fingerprint(tok),
                progress=False)
    full = out / "full.ngt"
    NgramTrie.load(full, verify=True)  # intact: passes every check
    dart = out / "full.trie"
    NgramTrie.load(full).save_dart(dart)
    return {"ngt": full, "trie": dart, "vocab": len(tok)}


def _sections(raw: bytes) -> dict[tuple[int, int], tuple[int, int, int]]:
    """(level, kind) -> (offset, elem_bytes, count) from the section table."""
    (num,) = struct.unpack_from("<I", raw, 60)
    out = {}
    for i in range(num):
        level, kind, elem, _, offset, count = struct.unpack_from("<IIIIQQ", raw, HEADER_BYTES + 32 * i)
        out[(level, kind)] = (offset, elem, count)
    return out


def _array(raw: bytes | bytearray, sec: tuple[int, int, int]) -> np.ndarray:
    offset, elem, count = sec
    return np.frombuffer(raw, dtype=f"<u{elem}", count=count, offset=offset).copy()


def _put(raw: bytearray, sec: tuple[int, int, int], index: int, value: int) -> None:
    offset, elem, _ = sec
    raw[offset + index * elem: offset + (index + 1) * elem] = int(value).to_bytes(elem, "little")


def _level_counts(raw: bytes, s: dict, level: int) -> np.ndarray:
    """Real counts of a level (escapes resolved)."""
    counts = _array(raw, s[(level, COUNTS)]).astype(np.uint64)
    idx, val = _array(raw, s[(level, ESC_IDX)]), _array(raw, s[(level, ESC_VAL)])
    counts[idx.astype(np.int64)] = val
    return counts


def _write_corrupt(src: Path, dst: Path, corrupt) -> str:
    """`corrupt(raw, sections)` edits the payload; header, section table and size must stay as they
    were. Returns what the change should be reported as."""
    raw = bytearray(src.read_bytes())
    s = _sections(bytes(raw))
    expected = corrupt(raw, s)
    table_end = HEADER_BYTES + 32 * len(s)
    assert bytes(raw[:table_end]) == src.read_bytes()[:table_end] and len(raw) == src.stat().st_size
    dst.write_bytes(bytes(raw))
    return expected


def count_above_parent(raw: bytearray, s: dict) -> str:
    """A level-3 count set just above its level-2 parent's: a probability above 1."""
    parents = _level_counts(bytes(raw), s, 2)
    child = _array(raw, s[(2, CHILD)])
    width = s[(3, COUNTS)][1]
    p = next(i for i in range(len(parents))
             if child[i + 1] > child[i] and parents[i] + 1 < (1 << (8 * width)) - 1)
    c = int(child[p])
    _put(raw, s[(3, COUNTS)], c, int(parents[p]) + 1)
    return f"count {int(parents[p]) + 1} above its parent's {int(parents[p])}, at level-3 node {c}"


def flipped_count_bytes(raw: bytearray, s: dict) -> str:
    """The top bit of a level-3 count flipped, under a parent whose count is below it then."""
    parents = _level_counts(bytes(raw), s, 2)
    child = _array(raw, s[(2, CHILD)])
    offset, width, _ = s[(3, COUNTS)]
    top = 1 << (8 * width - 1)
    p = next(i for i in range(len(parents)) if child[i + 1] > child[i] and parents[i] < top)
    raw[offset + (int(child[p]) + 1) * width - 1] ^= 0x80
    return f"above its parent's {int(parents[p])}, at level-3 node {int(child[p])}"


def token_out_of_vocabulary(raw: bytearray, s: dict) -> str:
    vocab = struct.unpack_from("<Q", raw, 24)[0]
    n3 = s[(3, TOKENS)][2]
    _put(raw, s[(3, TOKENS)], n3 - 1, vocab)
    return f"token id {vocab} outside the vocabulary of {vocab}, at level-3 node {n3 - 1}"


def siblings_swapped(raw: bytearray, s: dict) -> str:
    child = _array(raw, s[(2, CHILD)])
    tokens = _array(raw, s[(3, TOKENS)])
    p = next(i for i in range(len(child) - 1) if child[i + 1] - child[i] >= 2)
    a = int(child[p])
    _put(raw, s[(3, TOKENS)], a, int(tokens[a + 1]))
    _put(raw, s[(3, TOKENS)], a + 1, int(tokens[a]))
    return f"sibling tokens out of order, at level-3 node {a + 1}"


def child_offset_backwards(raw: bytearray, s: dict) -> str:
    child = _array(raw, s[(2, CHILD)])
    p = next(i for i in range(1, len(child) - 1) if child[i] > 1)
    _put(raw, s[(2, CHILD)], p + 1, int(child[p]) - 1)
    return f"child offset {int(child[p]) - 1} out of order or beyond level 3's"


def child_offset_beyond(raw: bytearray, s: dict) -> str:
    n3 = s[(3, TOKENS)][2]
    _put(raw, s[(2, CHILD)], 1, n3 + 5)
    return f"child offset {n3 + 5} out of order or beyond level 3's {n3} nodes, at level-2 node 0"


def escape_entry_moved(raw: bytearray, s: dict) -> str:
    level = next(k for k in (3, 2, 1) if s[(k, ESC_IDX)][2] > 0)
    idx = _array(raw, s[(level, ESC_IDX)])
    _put(raw, s[(level, ESC_IDX)], 0, int(idx[0]) + 1)
    return f"escaped count without its escape-table entry, at level-{level} node {int(idx[0])}"


def lower_a_leaf(raw: bytearray, s: dict) -> str:
    """A leaf count lowered by one: every invariant still holds, only the checksum tells."""
    counts = _array(raw, s[(3, COUNTS)])
    i = int(np.flatnonzero((counts >= 2) & (counts < 255))[0])
    _put(raw, s[(3, COUNTS)], i, int(counts[i]) - 1)
    return "payload checksum mismatch"


CORRUPTIONS = [count_above_parent, flipped_count_bytes, token_out_of_vocabulary, siblings_swapped,
               child_offset_backwards, child_offset_beyond, escape_entry_moved]


def _refusal(path: Path, **kwargs: Any) -> str:
    """Loading `path` fails with one line: the file, "corrupt trie (...)", how to rebuild it."""
    with pytest.raises(CorruptTrieError) as info:
        NgramTrie.open(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: corrupt trie (")
    assert f"rebuild it with `dart-ngram out_dir={path.parent} overwrite=true`" in message
    assert isinstance(info.value, NgramFormatError) and isinstance(info.value, ValueError)
    return message


# ----------------------------------------------------------------------------------- the library


def test_the_built_trie_has_what_the_corruptions_need(built) -> None:
    s = _sections(built["ngt"].read_bytes())
    assert any(s[(k, ESC_IDX)][2] for k in (1, 2, 3))  # an escaped count to move
    assert s[(3, TOKENS)][1] == 2  # 2-byte tokens: a vocabulary of 49152 leaves room above it


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("mmap", [True, False])
def test_corrupt_payload_is_refused_at_load(built, tmp_path: Path, corrupt, mmap: bool) -> None:
    bad = tmp_path / "full.ngt"
    expected = _write_corrupt(built["ngt"], bad, corrupt)
    message = _refusal(bad, mmap=mmap)
    assert expected in message
    assert _refusal(bad, verify=True, mmap=mmap)  # the full check refuses it too

    from dart_infer.data.loaders import load_trie

    with pytest.raises(CorruptTrieError, match="corrupt trie"):
        load_trie(tmp_path)  # the directory form, as `from_pretrained` and the commands load it


def test_a_change_within_the_invariants_needs_the_checksum(built, tmp_path: Path) -> None:
    bad = tmp_path / "full.ngt"
    _write_corrupt(built["ngt"], bad, lower_a_leaf)
    NgramTrie.load(bad)  # structurally valid: only the checksum can tell
    assert "payload checksum mismatch" in _refusal(bad, verify=True)
    with pytest.raises(CorruptTrieError, match="payload checksum mismatch"):
        NgramTrie.load(bad).verify()


def test_original_format_counts_are_checked(built, tmp_path: Path) -> None:
    raw = bytearray(built["trie"].read_bytes())
    _, n = struct.unpack_from("<QQ", raw, 0)
    pos, freq_at, freq, parent = 16, [], [], []
    for _ in range(n):
        _, par, fr, cc = struct.unpack_from("<iqiQ", raw, pos)
        parent.append(par)
        freq.append(fr)
        freq_at.append(pos + 12)
        pos += 24 + 12 * cc
    node = next(i for i in range(1, n) if parent[i] != 0 and freq[parent[i]] < 1000)
    struct.pack_into("<i", raw, freq_at[node], freq[parent[node]] + 1)
    bad = tmp_path / "full.trie"
    bad.write_bytes(bytes(raw))
    assert f"above its parent's {freq[parent[node]]}" in _refusal(bad)


def test_intact_files_still_load(built) -> None:
    for path in (built["ngt"], built["trie"]):
        for kwargs in ({}, {"verify": True}, {"mmap": False}):
            assert NgramTrie.open(path, **kwargs).num_nodes > 1000


def test_a_level_split_over_threads_is_checked_as_one(tmp_path: Path) -> None:
    """A level of over 2^21 nodes is checked in chunks on several threads (where there are several
    cores): no false alarm at a chunk boundary, the same findings as one pass."""
    rng = np.random.default_rng(2)
    t = NgramTrie(2, vocab_size=60000)
    ids = rng.integers(0, 60000, 2_600_000)
    for start in range(0, len(ids), 1000):
        t.add_tokens(ids[start:start + 1000])
    for a in (1000, 20000, 40000, 59000):  # escaped counts on both levels, in every chunk
        t.add_tokens([a, a + 1] * 300)
    path = tmp_path / "full.ngt"
    t.save(path)
    s = _sections(path.read_bytes())
    n2 = s[(2, TOKENS)][2]
    assert n2 > 2 << 20 and s[(2, ESC_IDX)][2] >= 4
    NgramTrie.load(path)
    NgramTrie.load(path, mmap=False, verify=True)

    def late_token(raw: bytearray, s: dict) -> str:
        _put(raw, s[(2, TOKENS)], n2 - 3, 60000)
        return f"token id 60000 outside the vocabulary of 60000, at level-2 node {n2 - 3}"

    def late_escape(raw: bytearray, s: dict) -> str:
        idx = _array(raw, s[(2, ESC_IDX)])
        _put(raw, s[(2, ESC_IDX)], len(idx) - 1, int(idx[-1]) + 1)
        return f"escaped count without its escape-table entry, at level-2 node {int(idx[-1])}"

    def unsorted_escapes(raw: bytearray, s: dict) -> str:
        idx = _array(raw, s[(2, ESC_IDX)])
        _put(raw, s[(2, ESC_IDX)], 0, int(idx[-1]))
        _put(raw, s[(2, ESC_IDX)], len(idx) - 1, int(idx[0]))
        return "escape"

    for corrupt in (late_token, late_escape, unsorted_escapes):
        bad = tmp_path / corrupt.__name__ / "full.ngt"
        bad.parent.mkdir()
        assert _write_corrupt(path, bad, corrupt) in _refusal(bad)


# ----------------------------------------------------------------------------------- the commands


def _compose(name: str, *overrides: str) -> Any:
    from hydra import compose, initialize_config_dir

    from dart_infer.common.configs import configs_dir

    with initialize_config_dir(config_dir=str(configs_dir()), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def test_every_command_that_loads_a_trie_has_ngram_verify() -> None:
    assert _compose("eval").ngram_verify is False
    assert _compose("app").ngram_verify is False
    assert _compose("train").train_eval.ngram_verify is False
    assert _compose("train", "train_eval=off").train_eval.ngram_verify is False


def test_eval_auto_runs_without_a_corrupt_default_trie(built, tmp_path: Path, capsys) -> None:
    from dart_infer.cli.eval import methods_for, resolve_trie

    cfg = _compose("eval", "ngram_model=auto", f"default_ngram_model={built['ngt']}")
    assert resolve_trie(cfg) == str(built["ngt"])  # intact and built with this tokenizer: used
    bad = tmp_path / "full.ngt"
    _write_corrupt(built["ngt"], bad, count_above_parent)
    capsys.readouterr()
    cfg = _compose("eval", "ngram_model=auto", f"default_ngram_model={bad}")
    assert resolve_trie(cfg) is None
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1
    assert said[0].startswith(f"ngram_model=auto: {bad}: corrupt trie (count ")
    assert said[0].endswith("; DART runs without a trie")
    assert methods_for(["ar", "dart"], None) == ["ar", "dart_no_trie"]


def test_eval_refuses_an_explicit_corrupt_trie_before_the_model_loads(built, tmp_path: Path) -> None:
    from dart_infer.cli.eval import resolve_trie
    from dart_infer.common.errors import InputError

    bad = tmp_path / "full.ngt"
    _write_corrupt(built["ngt"], bad, token_out_of_vocabulary)
    # resolve_trie runs before any model loads (run_eval, run_fit_tree).
    with pytest.raises(InputError, match=f"^{bad}: corrupt trie \\(token id"):
        resolve_trie(_compose("eval", f"ngram_model={bad}"))


def test_eval_ngram_verify_reaches_the_load(built, tmp_path: Path) -> None:
    from dart_infer.cli.eval import resolve_trie
    from dart_infer.common.errors import InputError

    bad = tmp_path / "full.ngt"
    _write_corrupt(built["ngt"], bad, lower_a_leaf)
    assert resolve_trie(_compose("eval", f"ngram_model={bad}")) == str(bad)
    with pytest.raises(InputError, match="payload checksum mismatch"):
        resolve_trie(_compose("eval", f"ngram_model={bad}", "ngram_verify=true"))


@pytest.mark.parametrize("auto", [True, False])
def test_app_serves_without_a_corrupt_trie_and_says_why(built, tmp_path: Path, auto: bool) -> None:
    from dart_infer.cli.app import load_trie

    bad = tmp_path / "full.ngt"
    _write_corrupt(built["ngt"], bad, child_offset_backwards)
    given = ("ngram_model=auto", f"default_ngram_model={bad}") if auto else (f"ngram_model={bad}",)
    model = SimpleNamespace(tokenizer=None, target=SimpleNamespace(vocab_size=built["vocab"]))
    trie, notice = load_trie(_compose("app", *given), model)
    assert trie is None
    said = "ngram_model=auto: " if auto else ""  # as dart-eval says it (dart_infer.data.resolve)
    assert notice.startswith(f"{said}{bad}: corrupt trie (child offset ")
    assert notice.endswith("; DART runs without a trie.") and "\n" not in notice
