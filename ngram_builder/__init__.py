"""N-gram tries for DART's n-gram-enforced tree search: build, prune, merge, compact format.

`NgramTrie` counts 1..order-grams with the original DART semantics, answers back-off
probability queries, and reads/writes both the project's compact memory-mapped format
(`save`/`load`) and the original `.trie` format (`save_dart`/`load_dart`).

Sharing a trie with C++ (the tree search): `NgramTrie._ngram_query_capsule()` returns a
PyCapsule named `DART_NGRAM_QUERY_CAPSULE` ("dart.NgramQuery", from
`csrc/include/dart/ngram_query.hpp`) whose pointer is a `const dart::NgramQuery*`. It answers
queries on a snapshot of the trie taken when the capsule is made: the capsule itself keeps that
snapshot (and, for a loaded trie, its memory map) alive, so the pointer is valid for as long as
the capsule object lives, even if the NgramTrie is later mutated (`add_tokens`, `merge`) or
dropped; later mutations are not seen through an old capsule (make a new one). `probability` is
const, thread-safe for concurrent readers, never touches Python and never reads out of bounds;
on a corrupt (unverified) file it reports the affected candidates as unseen (0.0, 0), whereas the
Python methods raise `NgramFormatError`.
"""

from .trie import CorruptTrieError, NgramFormatError, NgramMismatchError, NgramTrie

__all__ = ["CorruptTrieError", "NgramFormatError", "NgramMismatchError", "NgramTrie"]
