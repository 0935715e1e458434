// Internals shared by the trie's query files (trie_view.cpp, trie_probability.cpp, trie_query.cpp): the
// searches of a sorted token run and of the level-2 hash, the count read inline, and the batched
// pipeline's Batch. Included by those files only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "trie.hpp"

namespace ngb {

// Level-2 node with token `tok` among [s, e) from hash slot `i` (UINT64_MAX: none), for level-2
// tokens of type TT. Range first: entries of other parents are rejected without touching the
// token array.
template <class TT>
inline uint64_t probe_slots(const uint8_t* hash, uint64_t slots, uint64_t max_probe, uint64_t i, uint32_t tok,
                            uint64_t s, uint64_t e, const uint8_t* tokens) {
  for (uint64_t probe = 0; probe < max_probe; ++probe) {
    uint32_t j;
    std::memcpy(&j, hash + i * 4, 4);
    if (j == kHashEmpty) return UINT64_MAX;
    if (j >= s && j < e) {
      TT v;
      std::memcpy(&v, tokens + static_cast<uint64_t>(j) * sizeof(TT), sizeof(TT));
      if (v == tok) return j;
    }
    if (++i == slots) i = 0;
  }
  return UINT64_MAX;
}

template <class TT>
inline bool search_tokens(const uint8_t* base, uint64_t s, uint64_t e, uint32_t tok, uint64_t& out) {
  const TT* a = reinterpret_cast<const TT*>(base);
  // Branch-light lower bound over [s, e).
  uint64_t lo = s, len = e - s;
  while (len > 0) {
    uint64_t half = len / 2;
    TT v;
    std::memcpy(&v, a + lo + half, sizeof(TT));
    if (v < tok) {
      lo += half + 1;
      len -= half + 1;
    } else {
      len = half;
    }
  }
  if (lo < e) {
    TT v;
    std::memcpy(&v, a + lo, sizeof(TT));
    if (v == tok) {
      out = lo;
      return true;
    }
  }
  return false;
}

// Child ranges below this size are searched directly (a few cache lines), larger ones hashed.
constexpr uint64_t kHashMinRange = 48;
#if defined(__SSE2__)
constexpr bool kSse2 = true;
#else
constexpr bool kSse2 = false;
#endif

constexpr uint64_t kNone = UINT64_MAX;
constexpr size_t kBlock = 64;

// Lower bounds of many keys in one sorted range, advanced in lockstep: every candidate of a query
// searches the same child range, so the loads of one step are independent and their cache misses
// overlap instead of being paid one after another.
template <class TT>
void search_lockstep(const uint8_t* base, uint64_t s, uint64_t e, const uint32_t* keys, size_t n, uint64_t* out) {
  if (s >= e) {
    for (size_t i = 0; i < n; ++i) out[i] = kNone;
    return;
  }
  const TT* a = reinterpret_cast<const TT*>(base);
  uint64_t pos[kBlock];
  for (size_t i = 0; i < n; ++i) pos[i] = s;
  uint64_t len = e - s;
  while (len > 1) {
    const uint64_t half = len / 2;
    for (size_t i = 0; i < n; ++i) {
      TT v;
      std::memcpy(&v, a + pos[i] + half, sizeof(TT));
      // Multiply, not a conditional: a data-dependent branch here mispredicts half the time.
      pos[i] += half * static_cast<uint64_t>(static_cast<uint32_t>(v) < keys[i]);
    }
    len -= half;
  }
  for (size_t i = 0; i < n; ++i) {
    TT v;
    std::memcpy(&v, a + pos[i], sizeof(TT));
    uint64_t r = pos[i] + (static_cast<uint32_t>(v) < keys[i] ? 1 : 0);
    if (r < e) std::memcpy(&v, a + r, sizeof(TT));
    out[i] = (r < e && static_cast<uint32_t>(v) == keys[i]) ? r : kNone;
  }
}

constexpr uint32_t kNoKey = UINT32_MAX;  // a candidate outside the vocabulary: matches nothing

// Prefetches the elements [s, e) of an array of `width`-byte values when they span at most
// `max_lines` cache lines (a query is bound by how many lines it touches, so larger runs are read
// on demand). Returns whether the whole range was requested.
inline bool prefetch_small(const uint8_t* base, uint64_t s, uint64_t e, uint32_t width, uint64_t max_lines) {
  if (s >= e) return true;
  const uintptr_t lo = reinterpret_cast<uintptr_t>(base + s * width) & ~uintptr_t{63};
  const uintptr_t hi = reinterpret_cast<uintptr_t>(base + e * width);
  if (hi - lo > max_lines * 64) return false;
  for (uintptr_t q = lo; q < hi; q += 64) __builtin_prefetch(reinterpret_cast<const void*>(q));
  return true;
}

// Prefetches what a search of elements [s, e) (each `width` bytes) will read: all of it when it
// spans at most 16 cache lines, else the probes of the first four binary-search steps.
inline void prefetch_search(const uint8_t* base, uint64_t s, uint64_t e, uint32_t width) {
  if (s >= e) return;
  const uintptr_t lo = reinterpret_cast<uintptr_t>(base + s * width) & ~uintptr_t{63};
  const uintptr_t hi = reinterpret_cast<uintptr_t>(base + e * width);
  if (hi - lo <= 16 * 64) {
    for (uintptr_t q = lo; q < hi; q += 64) __builtin_prefetch(reinterpret_cast<const void*>(q));
    return;
  }
  const uint64_t len = e - s;
  for (uint64_t k = 1; k < 16; ++k) __builtin_prefetch(base + (s + len * k / 16) * width);
}

// Runs of 2-byte tokens up to this length (16 cache lines) are searched by segments
// (search_segments16) instead of a binary search, and the candidates under a 1-token context with
// at most this many children are searched in its run instead of through the level-2 hash: a
// query is bound by the cache lines it touches, and the hash costs a slot line per candidate
// plus a token line and a count line per match (~47 lines on ShareGPT; the run: <= 16 + matches).
constexpr uint64_t kSegmentMaxRange = 512;
// Candidates under a 1-token context with at least this many children go through the hash (or the
// candidate index); below it they are searched in the run.
template <class TT>
constexpr uint64_t kHashedRunMin = sizeof(TT) == 2 && kSse2 ? kSegmentMaxRange + 1 : kHashMinRange;
// Candidate index (build_candidate_index): the position half of an empty slot.
template <class TT>
constexpr TT kCandEmpty = static_cast<TT>(~TT{0});
// Slot of `token` in a candidate-index table of 2^bits slots (Fibonacci hashing).
inline uint64_t cand_slot(uint32_t token, uint64_t bits) {
  return (static_cast<uint64_t>(token) * 0x9E3779B97F4A7C15ull) >> (64 - bits);
}
// A context's cand_table_ entry is its first slot << 8 | log2(its slots): the home slot of `key`.
inline uint64_t cand_home(uint64_t table, uint32_t key) { return (table >> 8) + cand_slot(key, table & 255); }
// Hash probes looked at when prefetching a lookup's possible matches (longer sequences are rare).
constexpr uint64_t kPrefetchProbes = 4;

#if defined(__SSE2__)
// Positions of `keys` in the sorted, duplicate-free 2-byte tokens [s, e), 32 <= e - s <= 512:
// the run as up to 16 segments of 32 tokens; the segments' first tokens (two SSE2 registers)
// give a key's segment in one compare, 4 compares search it: no branches and no chain of dependent
// loads (a binary search has ~9 steps). Same answers as search_lockstep.
inline void search_segments16(const uint8_t* base, uint64_t s, uint64_t e, const uint32_t* keys, size_t n,
                              uint64_t* out) {
  const uint16_t* a = reinterpret_cast<const uint16_t*>(base) + s;
  const uint64_t len = e - s;
  const uint32_t nseg = static_cast<uint32_t>((len + 31) / 32);
  alignas(16) uint16_t first[16];
  for (uint32_t j = 0; j < 16; ++j) first[j] = j < nseg ? a[32 * j] : 0xFFFF;
  const __m128i f0 = _mm_load_si128(reinterpret_cast<const __m128i*>(first));
  const __m128i f1 = _mm_load_si128(reinterpret_cast<const __m128i*>(first + 8));
  const __m128i zero = _mm_setzero_si128();
  const uint64_t valid = (1ull << (2 * nseg)) - 1;  // 2 mask bits per segment
  for (size_t i = 0; i < n; ++i) {
    const __m128i k = _mm_set1_epi16(static_cast<short>(keys[i]));
    // Segments whose first token is <= key (a prefix): the saturating difference is zero there.
    const uint64_t le = (static_cast<uint64_t>(_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_subs_epu16(f0, k), zero))) |
                         static_cast<uint64_t>(_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_subs_epu16(f1, k), zero))) << 16) &
                        valid;
    // Below the first token: no segment (searched as segment 0, whose compares then fail).
    const uint64_t seg = le ? (static_cast<uint64_t>(__builtin_ctzll(~le)) >> 1) - 1 : 0;
    const uint64_t w = std::min<uint64_t>(32 * seg, len - 32);  // the last window ends at the run's end
    const __m128i* p = reinterpret_cast<const __m128i*>(a + w);
    const uint64_t eq = static_cast<uint64_t>(_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_loadu_si128(p), k))) |
                        static_cast<uint64_t>(_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_loadu_si128(p + 1), k))) << 16 |
                        static_cast<uint64_t>(_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_loadu_si128(p + 2), k))) << 32 |
                        static_cast<uint64_t>(_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_loadu_si128(p + 3), k))) << 48;
    // Keys beyond 2 bytes were truncated by the broadcast: they match nothing.
    const bool hit = eq != 0 && keys[i] <= 0xFFFF;
    out[i] = hit ? s + w + (static_cast<uint64_t>(__builtin_ctzll(eq | (1ull << 63))) >> 1) : kNone;
  }
}
#endif

// Positions of `keys` in the sorted, duplicate-free tokens [s, e): equality compares instead of a
// binary search when the run is short (the median 2-token context has ~20 children), 8 tokens per
// SSE2 compare; segments for longer runs. Same answers as search_lockstep.
template <class TT>
inline void search_keys(const uint8_t* base, uint64_t s, uint64_t e, const uint32_t* keys, size_t n, uint64_t* out) {
#if defined(__SSE2__)
  if (sizeof(TT) == 2 && e - s > 64 && e - s <= kSegmentMaxRange) {
    search_segments16(base, s, e, keys, n, out);
    return;
  }
  if (sizeof(TT) == 2 && e - s >= 8 && e - s <= 64) {
    const uint16_t* a = reinterpret_cast<const uint16_t*>(base) + s;
    const uint64_t len = e - s;
    __m128i blk[8];
    uint32_t off[8];
    int nb = 0;
    for (uint64_t o = 0; o + 8 <= len; o += 8) {
      blk[nb] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + o));
      off[nb++] = static_cast<uint32_t>(o);
    }
    if (len % 8) {  // the tail as one more block overlapping the previous one
      blk[nb] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + len - 8));
      off[nb++] = static_cast<uint32_t>(len - 8);
    }
    for (size_t i = 0; i < n; ++i) {
      // Every block compared, the hit selected without branches (tokens are distinct, so only
      // the overlapping tail block can hit a second time, at the same position).
      const __m128i k = _mm_set1_epi16(static_cast<short>(keys[i]));
      uint64_t pos = kNone;
      for (int b = 0; b < nb; ++b) {
        const unsigned m = static_cast<unsigned>(_mm_movemask_epi8(_mm_cmpeq_epi16(blk[b], k)));
        pos = m ? s + off[b] + (static_cast<uint32_t>(__builtin_ctz(m | 0x10000u)) >> 1) : pos;
      }
      out[i] = keys[i] <= 0xFFFF ? pos : kNone;
    }
    return;
  }
#endif
  search_lockstep<TT>(base, s, e, keys, n, out);
}

// count_checked with the common case, a narrow count below its escape value, read inline.
inline uint64_t TrieView::count_fast(int k, uint64_t i, bool& ok) const {
  const LevelView& L = lv_[k];
  const uint64_t c = read_uint(L.counts, L.count_bytes, i);
  return L.count_bytes < 8 && c == sentinel(L.count_bytes) ? count_checked(k, i, ok) : c;
}

struct TrieView::Batch {
  const int32_t* contexts;
  size_t context_stride;
  const int32_t* context_lens;
  size_t rows;
  const int32_t* tokens;
  size_t token_stride;
  size_t n;
  float* probs;
  int32_t* matched;
  const uint32_t* order;  // processing order of the rows (null: as given)
};

}  // namespace ngb
