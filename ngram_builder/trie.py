"""`NgramTrie`: the Python face of the C++ trie (counting, queries, formats, merge, prune)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import _core

#: Malformed, truncated or corrupt trie data (a `ValueError`).
NgramFormatError = _core.NgramFormatError


class NgramMismatchError(ValueError):
    """The trie was built for another tokenizer (fingerprint or vocabulary size differ)."""


class CorruptTrieError(NgramFormatError):
    """A trie file whose data breaks the format's invariants (a count above its parent's, a token id
    outside the vocabulary, child offsets out of order, a checksum mismatch with `verify=True`).
    The message is one line: the file, what is wrong and where, and how to rebuild it."""


def _corrupt(path: str | os.PathLike[str], err: Exception) -> CorruptTrieError:
    where = Path(path)
    return CorruptTrieError(f"{where}: corrupt trie ({err}); rebuild it with "
                            f"`dart-ngram out_dir={where.parent} overwrite=true` (and the ngram= it was built from)")


TokenIds = Sequence[int] | np.ndarray

_DEFAULT_ORDER = 3
#: First bytes of a compact trie file.
COMPACT_MAGIC = b"DARTNGRM"


def _readable_file(path: str | os.PathLike[str]) -> str:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"n-gram trie file not found: {p}")
    if p.is_dir():
        raise IsADirectoryError(f"expected an n-gram trie file, got a directory: {p}")
    if not os.access(p, os.R_OK):
        raise PermissionError(f"n-gram trie file is not readable: {p}")
    return str(p)


def _writable_target(path: str | os.PathLike[str], overwrite: bool) -> str:
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"output path is a directory: {p}")
    if p.exists() and not overwrite:
        raise FileExistsError(f"{p} exists; pass overwrite=True to replace it")
    if not p.parent.is_dir():
        raise FileNotFoundError(f"output directory does not exist: {p.parent}")
    return str(p)


class NgramTrie:
    """Counts of all 1..order-grams of a corpus with the original DART semantics.

    `add_tokens(doc)` inserts, for every start position of `doc`, the slice of up to `order` tokens
    starting there (callers append EOS themselves). Documents are counted lazily and folded into an
    immutable compact image on the first query, save, merge or prune.
    """

    def __init__(self, order: int = _DEFAULT_ORDER, *, vocab_size: int | None = None,
                 tokenizer_fingerprint: str = "") -> None:
        if vocab_size is not None and vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self._t = _core.Trie(int(order), int(vocab_size or 0), tokenizer_fingerprint)

    @classmethod
    def _wrap(cls, core: Any) -> NgramTrie:
        obj = cls.__new__(cls)
        obj._t = core
        return obj

    # -- building ----------------------------------------------------------------------------
    def add_tokens(self, token_ids: TokenIds) -> None:
        """Count one document (the original's `add_conversation`)."""
        if isinstance(token_ids, np.ndarray) and token_ids.size == 0:
            return
        self._t.add_tokens(token_ids)

    def merge(self, other: NgramTrie) -> None:
        """Add `other`'s counts node by node (the original's `add_all`), in place."""
        if not isinstance(other, NgramTrie):
            raise TypeError(f"can only merge an NgramTrie, got {type(other).__name__}")
        self._t.merge(other._t)

    def prune(self, min_count: int) -> NgramTrie:
        """The original's `reduce(min_count)`: a new trie keeping nodes with count >= min_count;
        a kept node's count drops by the counts of the topmost pruned nodes below it."""
        if min_count < 0:
            raise ValueError(f"min_count must be >= 0, got {min_count}")
        return NgramTrie._wrap(self._t.prune(int(min_count)))

    # -- queries -----------------------------------------------------------------------------
    def probability(self, context: TokenIds, tokens: TokenIds) -> tuple[list[float], list[int]]:
        """Back-off probability of each candidate after `context` and the context length used."""
        return self._t.probability(context, tokens)

    def probability_batch(
        self, contexts: Sequence[TokenIds] | np.ndarray, tokens: Sequence[TokenIds] | np.ndarray,
        context_lengths: np.ndarray | None = None,
    ) -> tuple[Any, Any]:
        """Many (context, candidates) pairs in one call, without the GIL.

        With 2-D integer arrays (`contexts` [B, C], row b using its first `context_lengths[b]`
        entries, all C if None; `tokens` [B, K]) returns (float32 [B, K], int32 [B, K]) arrays;
        with sequences of sequences returns lists of lists.
        """
        if isinstance(contexts, np.ndarray) or isinstance(tokens, np.ndarray):
            ctx = np.asarray(contexts)
            tok = np.asarray(tokens)
            for name, arr in (("contexts", ctx), ("tokens", tok)):
                if arr.ndim != 2 or (arr.size and arr.dtype.kind not in "iu"):
                    raise TypeError(f"{name} must be a 2-D integer array")
            if ctx.size and int(ctx.max(initial=0)) > np.iinfo(np.int32).max:
                raise ValueError("contexts contain ids beyond int32")
            return self._t.probability_array(ctx.astype(np.int32, copy=False), context_lengths,
                                             np.minimum(tok, np.iinfo(np.int32).max).astype(np.int32))
        return self._t.probability_batch(contexts, tokens)

    def top_continuations(self, context: TokenIds, k: int = 10) -> list[tuple[int, int, float]]:
        """Most frequent next tokens after exactly `context`: (token, count, count/context count)."""
        return self._t.top_continuations(context, int(k))

    # -- properties --------------------------------------------------------------------------
    @property
    def order(self) -> int:
        return self._t.order

    @property
    def num_nodes(self) -> int:
        return self._t.num_nodes

    @property
    def vocab_size(self) -> int:
        return self._t.vocab_size

    @property
    def tokenizer_fingerprint(self) -> str:
        return self._t.fingerprint

    @tokenizer_fingerprint.setter
    def tokenizer_fingerprint(self, value: str) -> None:
        self._t.fingerprint = value

    @property
    def nbytes(self) -> int:
        """Bytes of RAM the queryable form uses (image + level-1 index)."""
        return self._t.ram_bytes

    @property
    def file_bytes(self) -> int:
        """Size of the compact image (= the `.save` file size)."""
        return self._t.image_bytes

    def info(self) -> dict[str, Any]:
        """Header fields and per-level layout."""
        return self._t.info()

    def check_compatible(self, *, vocab_size: int | None = None, tokenizer_fingerprint: str | None = None) -> None:
        """Raise `NgramMismatchError` if the trie was built for a different tokenizer."""
        fp = self.tokenizer_fingerprint
        if tokenizer_fingerprint is not None and fp and fp != tokenizer_fingerprint:
            raise NgramMismatchError(
                f"n-gram trie was built with tokenizer {fp!r}, but the model's tokenizer is {tokenizer_fingerprint!r}")
        if vocab_size is not None and self.vocab_size > vocab_size:
            raise NgramMismatchError(
                f"n-gram trie holds token ids up to {self.vocab_size - 1}, beyond the model's vocabulary of {vocab_size}")

    def verify(self) -> None:
        """Full check of the image (payload checksum, every offset, sort order, escapes)."""
        try:
            self._t.verify()
        except _core.CorruptTrieData as err:
            raise CorruptTrieError(f"corrupt trie ({err})") from None

    def _ngram_query_capsule(self) -> Any:
        """PyCapsule `DART_NGRAM_QUERY_CAPSULE` holding a `const dart::NgramQuery*` (see package doc)."""
        return self._t.ngram_query_capsule()

    # -- formats -----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write the compact memory-mappable format (atomically: temp file + rename)."""
        self._t.save(_writable_target(path, overwrite))

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, verify: bool = False, mmap: bool = True,
             vocab_size: int | None = None, tokenizer_fingerprint: str | None = None) -> NgramTrie:
        """Memory-map a compact trie. Header, section table and the payload's structure are always
        checked (one pass over the nodes: token ids, sort order, child offsets, escapes, no count
        above its parent's; `CorruptTrieError` names what and where); `verify=True` also checks the
        payload checksum and the level-2 hash. `vocab_size` / `tokenizer_fingerprint` (of the model
        it will be used with) raise `NgramMismatchError` when they disagree.

        `mmap=False` is the faster-query load: the file is read into 2 MB transparent huge pages
        (fewer TLB misses) and a per-context candidate index is built (one cache line less per
        candidate): ~15% faster queries on the ShareGPT trie, for ~30 ms of load per 56 MB and
        ~15% more memory, private instead of the shared page cache. Huge pages need transparent
        huge pages set to `madvise` or `always` (/sys/kernel/mm/transparent_hugepage/enabled)."""
        try:
            trie = cls._wrap(_core.Trie.load(_readable_file(path), bool(verify), not mmap))
        except _core.CorruptTrieData as err:
            raise _corrupt(path, err) from None
        trie.check_compatible(vocab_size=vocab_size, tokenizer_fingerprint=tokenizer_fingerprint)
        return trie

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, verify: bool = False, mmap: bool = True,
             vocab_size: int | None = None, tokenizer_fingerprint: str | None = None) -> NgramTrie:
        """Load either format, told apart by the compact format's magic bytes (`mmap`: see `load`;
        the original format is always read into memory)."""
        src = _readable_file(path)
        with open(src, "rb") as f:
            magic = f.read(len(COMPACT_MAGIC))
        if magic == COMPACT_MAGIC:
            return cls.load(src, verify=verify, mmap=mmap, vocab_size=vocab_size,
                            tokenizer_fingerprint=tokenizer_fingerprint)
        trie = cls.load_dart(src, vocab_size=vocab_size)
        trie.check_compatible(vocab_size=vocab_size)
        return trie

    @classmethod
    def load_dart(cls, path: str | os.PathLike[str], *, vocab_size: int | None = None,
                  tokenizer_fingerprint: str = "") -> NgramTrie:
        """Read the original DART `.trie` format (fully validated, counts too: `CorruptTrieError`)."""
        if vocab_size is not None and vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        try:
            core = _core.Trie.load_dart(_readable_file(path), int(vocab_size or 0), tokenizer_fingerprint)
        except _core.CorruptTrieData as err:
            raise _corrupt(path, err) from None
        return cls._wrap(core)

    def save_dart(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write the original DART `.trie` format (readable by the authors' code)."""
        self._t.save_dart(_writable_target(path, overwrite))

    def __repr__(self) -> str:
        return (f"NgramTrie(order={self.order}, num_nodes={self.num_nodes}, vocab_size={self.vocab_size}, "
                f"tokenizer_fingerprint={self.tokenizer_fingerprint!r})")
