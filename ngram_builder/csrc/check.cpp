// The structural check every load of a trie file runs (TrieView::check_structure): one pass over
// each level's tokens, counts, escape tables and child offsets, O(nodes), no hashing; a level of
// millions of nodes is split over threads.
//
// Bounds checks alone keep a corrupt payload from being read out of range, but let it answer
// wrongly: a count above its parent's is a probability above 1 (a flipped high byte gives ~1e14),
// a token outside the vocabulary or out of order hides n-grams from the binary searches, an escape
// table that disagrees with the counts fails only when a query meets it. This pass refuses those
// files at load instead. The level-2 hash is left to `verify` (a bad slot can only make a present
// n-gram look unseen), as is the checksum (a count changed within these invariants passes here).
#include <algorithm>
#include <exception>
#include <functional>
#include <system_error>
#include <thread>

#include "trie.hpp"

namespace ngb {

namespace {

constexpr uint64_t kChildrenPerThread = 1 << 20;  // below this a thread costs more than it saves
constexpr unsigned kMaxThreads = 8;

std::string at(int k, uint64_t i) { return ", at level-" + std::to_string(k) + " node " + std::to_string(i); }

// The counts of one level in node order from node `first` on, escapes resolved by a cursor (the
// escape table is sorted by node, so a sequential reader needs no binary search) and checked.
class CountCursor {
 public:
  CountCursor(const LevelView& L, int k, uint64_t first)
      : L_(L), k_(k), sent_(sentinel(L.count_bytes)), esc_(first_escape(L, first)) {}

  // Count of node i, for i = first, first + 1, ... in order (or `escaped` for the escaped ones).
  uint64_t next(uint64_t i) {
    const uint64_t v = read_uint(L_.counts, L_.count_bytes, i);
    return L_.count_bytes == 8 || v != sent_ ? v : escaped(i);
  }
  // The real count of escaped node i, from the next escape-table entry.
  uint64_t escaped(uint64_t i) {
    uint64_t idx = UINT64_MAX, val = 0;
    if (esc_ < L_.n_esc) {
      std::memcpy(&idx, L_.esc_idx + esc_, 8);
      std::memcpy(&val, L_.esc_val + esc_, 8);
    }
    if (idx != i) throw CorruptError("escaped count without its escape-table entry" + at(k_, i));
    if (val < sent_)
      throw CorruptError("escape-table count " + std::to_string(val) + " below the escape value" + at(k_, i));
    ++esc_;
    return val;
  }
  uint64_t position() const { return esc_; }

 private:
  const LevelView& L_;
  int k_;
  uint64_t sent_;
  uint64_t esc_;
};

// Parents [p0, p1) of one level and their children; the escape-table entries each side used.
struct Chunk {
  uint64_t p0 = 0, p1 = 0;
  uint64_t parent_esc[2] = {}, child_esc[2] = {};
  std::exception_ptr error;
};

// Child offsets of parents [p0, p1) on level k, and their children's tokens (TT) and counts (CT) on
// level k + 1. The loop over children is the whole cost: typed reads, no data-dependent branch on
// valid data.
template <class TT, class CT>
void check_chunk(const LevelView& L, const LevelView& N, int k, uint64_t vocab, Chunk& ch) {
  constexpr uint64_t kEscape = sizeof(CT) == 8 ? UINT64_MAX : (1ull << (8 * sizeof(CT))) - 1;
  const TT* tokens = reinterpret_cast<const TT*>(N.tokens);
  const CT* counts = reinterpret_cast<const CT*>(N.counts);
  uint64_t begin = read_uint(L.child, L.child_bytes, ch.p0);  // chunk 0: 0, checked with the layout
  if (begin > N.n)
    throw CorruptError("child offset " + std::to_string(begin) + " beyond level " + std::to_string(k + 1) + "'s " +
                       std::to_string(N.n) + " nodes" + at(k, ch.p0));
  CountCursor parents(L, k, ch.p0), children(N, k + 1, begin);
  ch.parent_esc[0] = parents.position();
  ch.child_esc[0] = children.position();
  for (uint64_t i = ch.p0; i < ch.p1; ++i) {
    const uint64_t limit = parents.next(i);
    const uint64_t end = read_uint(L.child, L.child_bytes, i + 1);
    if (end < begin || end > N.n)
      throw CorruptError("child offset " + std::to_string(end) + " out of order or beyond level " +
                         std::to_string(k + 1) + "'s " + std::to_string(N.n) + " nodes" + at(k, i));
    uint64_t prev = 0;
    for (uint64_t c = begin; c < end; ++c) {
      TT t;
      CT raw;
      std::memcpy(&t, tokens + c, sizeof(TT));
      std::memcpy(&raw, counts + c, sizeof(CT));
      uint64_t count = raw;
      if (sizeof(CT) < 8 && count == kEscape) count = children.escaped(c);
      if ((t >= vocab) | ((c > begin) & (t <= prev)) | (count > limit)) {
        if (t >= vocab)
          throw CorruptError("token id " + std::to_string(t) + " outside the vocabulary of " +
                             std::to_string(vocab) + at(k + 1, c));
        if (count > limit)
          throw CorruptError("count " + std::to_string(count) + " above its parent's " + std::to_string(limit) +
                             at(k + 1, c));
        throw CorruptError("sibling tokens out of order" + at(k + 1, c));
      }
      prev = t;
    }
    begin = end;
  }
  ch.parent_esc[1] = parents.position();
  ch.child_esc[1] = children.position();
}

// The escape entries the chunks used, side by side, are the whole table: each entry was matched by
// exactly one escaped count, in node order.
void check_escapes_used(const std::vector<Chunk>& chunks, bool parents, const LevelView& L, int k) {
  uint64_t pos = 0;
  for (const Chunk& ch : chunks) {
    const uint64_t* used = parents ? ch.parent_esc : ch.child_esc;
    if (used[0] != pos)  // only an unsorted table makes a chunk's binary search disagree
      throw CorruptError("escape table of level " + std::to_string(k) + " out of node order, at its entry " +
                         std::to_string(std::min(pos, used[0])));
    pos = used[1];
  }
  if (pos != L.n_esc) {
    uint64_t node = 0;
    if (pos < L.n_esc) std::memcpy(&node, L.esc_idx + pos, 8);
    throw CorruptError("escape-table entry " + std::to_string(pos) + " of level " + std::to_string(k) +
                       " matches no escaped count" + at(k, node));
  }
}

template <class TT, class CT>
void check_level(const LevelView& L, const LevelView& N, int k, uint64_t vocab) {
  const uint64_t hw = std::max(1u, std::thread::hardware_concurrency());
  const uint64_t n_chunks = std::max<uint64_t>(1, std::min<uint64_t>({hw, kMaxThreads, N.n / kChildrenPerThread}));
  // Chunks of about equal numbers of children: chunk j starts at the first parent whose children
  // start at or after j/n of level k + 1 (corrupt offsets only make the chunks uneven).
  std::vector<Chunk> chunks(n_chunks);
  for (uint64_t j = 1; j < n_chunks; ++j) {
    const uint64_t target = N.n / n_chunks * j;
    uint64_t lo = chunks[j - 1].p0, hi = L.n;
    while (lo < hi) {
      const uint64_t mid = lo + (hi - lo) / 2;
      if (read_uint(L.child, L.child_bytes, mid) < target)
        lo = mid + 1;
      else
        hi = mid;
    }
    chunks[j - 1].p1 = chunks[j].p0 = lo;
  }
  chunks.back().p1 = L.n;
  auto run = [&](Chunk& ch) {
    try {
      check_chunk<TT, CT>(L, N, k, vocab, ch);
    } catch (...) {
      ch.error = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  for (uint64_t j = 1; j < n_chunks; ++j) {
    try {
      pool.emplace_back(run, std::ref(chunks[j]));
    } catch (const std::system_error&) {  // no thread to be had: this one does it
      run(chunks[j]);
    }
  }
  run(chunks[0]);
  for (std::thread& t : pool) t.join();
  for (const Chunk& ch : chunks)  // the first problem in node order
    if (ch.error) std::rethrow_exception(ch.error);
  check_escapes_used(chunks, true, L, k);
  check_escapes_used(chunks, false, N, k + 1);
}

template <class TT>
void check_level_counts(const LevelView& L, const LevelView& N, int k, uint64_t vocab) {
  switch (N.count_bytes) {
    case 1:
      return check_level<TT, uint8_t>(L, N, k, vocab);
    case 2:
      return check_level<TT, uint16_t>(L, N, k, vocab);
    case 4:
      return check_level<TT, uint32_t>(L, N, k, vocab);
    default:
      return check_level<TT, uint64_t>(L, N, k, vocab);
  }
}

}  // namespace

void TrieView::check_structure() const {
  const int order = static_cast<int>(hdr_.order);
  if (order == 1) {  // no parent pass reads level 1's counts
    CountCursor counts(lv_[1], 1, 0);
    for (uint64_t i = 0; i < lv_[1].n; ++i) counts.next(i);
    Chunk whole;
    whole.p1 = lv_[1].n;
    whole.parent_esc[1] = counts.position();
    check_escapes_used({whole}, true, lv_[1], 1);
  }
  for (int k = 1; k < order; ++k) {
    if (hdr_.token_bytes == 2)
      check_level_counts<uint16_t>(lv_[k], lv_[k + 1], k, hdr_.vocab_size);
    else
      check_level_counts<uint32_t>(lv_[k], lv_[k + 1], k, hdr_.vocab_size);
  }
}

}  // namespace ngb
