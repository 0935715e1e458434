// The hot query path: a query (one row, at most kBlock candidates) in five stages, each issuing the prefetches
// the next one needs; run_batch interleaves several queries' stages so that their cache misses overlap.
#include "trie_query.hpp"

namespace ngb {

// One query of a batch: one row's context and at most kBlock of its candidates, with what each
// stage leaves for the next.
struct TrieView::Query {
  const int32_t* ctx = nullptr;  // the last `len` (<= order - 1) context tokens
  size_t len = 0;
  const int32_t* tokens = nullptr;
  size_t n = 0;
  float* probs = nullptr;
  int32_t* matched = nullptr;
  size_t row = 0;
  bool active = false;  // false: nothing can match, the outputs stay zero
  bool reuse1 = false;  // same last token and candidates as the previous query: its level-1 answers
  bool cache1 = false;  // store this query's level-1 answers for the queries that reuse them
  bool ok = true;
  bool zeroed = false;  // outputs zeroed early (contexts longer than 2 tokens write them first)
  bool two = false, hash1 = false, hashb = false;
  bool indexed = false;  // the candidates go through the candidate index (hash1 implied)
  bool ctx_indexed = false;  // the 2-token context's node is found through the candidate index
  uint64_t node_ctx = 0;     // that node (kNone: absent)
  // The counts of the whole child run were requested with its tokens: no per-match requests.
  bool counts1_requested = false, counts2_requested = false;
  uint32_t a = 0, b = 0;  // last and second-to-last context token
  uint64_t slot_ctx = 0;
  uint64_t s1 = 0, e1 = 0, sb = 0, eb = 0, s2 = 0, e2 = 0;
  float inv1 = 0.0f, inv2 = 0.0f;
  uint32_t key[kBlock];
  uint64_t slot[kBlock];
  uint64_t found1[kBlock], found2[kBlock];
};

// Level-1 answers (candidates under the last context token) of the last query that computed them.
struct TrieView::Level1Cache {
  float prob[kBlock];
  uint8_t state[kBlock];  // 0: no child, 1: child, 2: child whose count is corrupt
};

// Stage 1: request everything keyed by tokens alone. The trie is far larger
// than the caches, so nearly every step is a cache miss (~170 ns here); the hash keys are tokens
// only, so the slots of the 2-token context and of every candidate under the 1-token context are
// known before anything is read.
template <class TT>
void TrieView::stage_issue(Query& q) const {
  // The outputs are written once, by the last stage (a batch's outputs are new cache lines,
  // each store a miss): request their lines now.
  for (size_t i = 0; i < q.n; i += 16) {
    __builtin_prefetch(q.probs + i, 1);
    __builtin_prefetch(q.matched + i, 1);
  }
  q.zeroed = false;
  q.ok = true;
  q.active = false;
  q.counts1_requested = false;
  if (q.len == 0 || q.n == 0) return;
  const uint64_t V = hdr_.vocab_size;
  // Every context is a path ending in the last token: if that is not a unigram, nothing matches.
  const int32_t last = q.ctx[q.len - 1];
  if (last < 0 || static_cast<uint64_t>(last) >= V) return;
  q.active = true;
  q.a = static_cast<uint32_t>(last);
  q.two = q.len >= 2 && q.ctx[q.len - 2] >= 0 && static_cast<uint64_t>(q.ctx[q.len - 2]) < V;
  q.b = q.two ? static_cast<uint32_t>(q.ctx[q.len - 2]) : 0;
  // The 2-token context's slot starts the longest chain of misses (slot, node, children, counts):
  // requested before anything is read. The unigram entries may miss too (786 KB for SmolLM2);
  // the keys are computed while they arrive.
  q.ctx_indexed = q.two && !cand_table_.empty() && cand_table_[q.b] != 0;
  if (q.ctx_indexed) {
    q.slot_ctx = cand_home(cand_table_[q.b], q.a);
    __builtin_prefetch(cand_entry<TT>(q.slot_ctx));
  } else if (q.two) {
    q.slot_ctx = hash_slot(q.b, q.a, hash_slots_);
    __builtin_prefetch(hash_ + q.slot_ctx * 4);
  }
  if (q.two) __builtin_prefetch(&uni_[q.b]);
  __builtin_prefetch(&uni_[q.a]);
  // A negative id becomes >= 2^31 >= V as unsigned: one compare rejects both kinds.
  const uint32_t v32 = static_cast<uint32_t>(V);
  for (size_t i = 0; i < q.n; ++i) {
    const uint32_t t = static_cast<uint32_t>(q.tokens[i]);
    q.key[i] = t < v32 ? t : kNoKey;
  }
  // Short child runs are then requested whole, long ones through the hash.
  const Unigram ua = uni_[q.a];
  const Unigram ub = q.two ? uni_[q.b] : Unigram{};
  if (ua.s > ua.e || ub.s > ub.e) q.ok = false;
  q.s1 = ua.s <= ua.e ? ua.s : 0;
  q.e1 = ua.s <= ua.e ? ua.e : 0;
  q.sb = ub.s <= ub.e ? ub.s : 0;
  q.eb = ub.s <= ub.e ? ub.e : 0;
  q.inv1 = ua.inv;
  q.hash1 = q.e1 - q.s1 >= kHashedRunMin<TT>;
  q.indexed = q.hash1 && !cand_table_.empty() && cand_table_[q.a] != 0;
  q.hashb = q.eb - q.sb >= kHashMinRange;
  const LevelView& L2 = lv_[2];
  constexpr uint32_t tb = sizeof(TT);
  if (!q.hashb) prefetch_search(L2.tokens, q.sb, q.eb, tb);
  if (q.reuse1) return;
  if (q.indexed) {
    const uint64_t table = cand_table_[q.a];
    for (size_t i = 0; i < q.n; ++i) {
      q.slot[i] = cand_home(table, q.key[i]);
      __builtin_prefetch(cand_entry<TT>(q.slot[i]));
    }
  } else if (q.hash1) {
    for (size_t i = 0; i < q.n; ++i) {
      q.slot[i] = hash_slot(q.a, q.key[i], hash_slots_);
      __builtin_prefetch(hash_ + q.slot[i] * 4);
    }
  } else {
    // The counts of the matches are requested once they are known (stage_search), unless the
    // whole run's counts are only a few lines.
    prefetch_search(L2.tokens, q.s1, q.e1, tb);
    q.counts1_requested = prefetch_small(L2.counts, q.s1, q.e1, L2.count_bytes, 2);
  }
}

// Stage 2: the hash slots have arrived: request the level-2 nodes they point at (the 2-token
// context's node, and each candidate's under the 1-token context). Candidates in the candidate
// index are found here (a slot names its token and position) and their counts requested.
template <class TT>
void TrieView::stage_context(Query& q) const {
  if (!q.active) return;
  if (q.ctx_indexed) {
    const uint64_t at = cand_lookup<TT>(cand_table_[q.b], q.slot_ctx, q.a);
    q.node_ctx = at == kNone ? kNone : q.sb + at;
    if (at != kNone) {
      __builtin_prefetch(lv_[2].child + q.node_ctx * lv_[2].child_bytes);
      __builtin_prefetch(lv_[2].counts + q.node_ctx * lv_[2].count_bytes);
    }
  } else if (q.hashb) {
    prefetch_candidates(q.slot_ctx, q.sb, q.eb, true);
  }
  if (q.reuse1 || !q.hash1) return;
  if (!q.indexed) {
    for (size_t c = 0; c < q.n; ++c) prefetch_candidates(q.slot[c], q.s1, q.e1, false);
    return;
  }
  const LevelView& L2 = lv_[2];
  const uint64_t table = cand_table_[q.a];
  for (size_t c = 0; c < q.n; ++c) {
    const uint64_t at = cand_lookup<TT>(table, q.slot[c], q.key[c]);
    q.found1[c] = at == kNone ? kNone : q.s1 + at;
    if (at != kNone) __builtin_prefetch(L2.counts + q.found1[c] * L2.count_bytes);
  }
}

// Position of `key` in the child run of the context whose index table is `table` (its
// cand_table_ entry), probing from `slot` (kNone: absent).
template <class TT>
uint64_t TrieView::cand_lookup(uint64_t table, uint64_t slot, uint32_t key) const {
  const uint64_t first = table >> 8, mask = (1ull << (table & 255)) - 1;
  // At most half the slots are full (build_candidate_index_t): the probe ends at an empty one.
  for (uint64_t i = slot - first;; i = (i + 1) & mask) {
    TT entry[2];  // token, position in the run
    std::memcpy(entry, cand_entry<TT>(first + i), sizeof(entry));
    if (entry[1] == kCandEmpty<TT>) return kNone;
    if (entry[0] == key) return entry[1];
  }
}

// Every entry of the probe sequence from slot `i` that is a child of the right parent ([s, e)) is
// a possible match (half the slots are full, so the match is often not the first; the first empty
// slot ends it): request its token and count, and its child offsets when `with_children`.
void TrieView::prefetch_candidates(uint64_t i, uint64_t s, uint64_t e, bool with_children) const {
  const LevelView& L2 = lv_[2];
  const uint32_t tb = hdr_.token_bytes;
  const uint64_t max_probe = std::min(hash_max_probe_, kPrefetchProbes);
  for (uint64_t probe = 0; probe < max_probe; ++probe) {
    uint32_t v;
    std::memcpy(&v, hash_ + i * 4, 4);
    if (v == kHashEmpty) break;
    if (v >= s && v < e) {
      __builtin_prefetch(L2.tokens + static_cast<uint64_t>(v) * tb);
      __builtin_prefetch(L2.counts + static_cast<uint64_t>(v) * L2.count_bytes);
      if (with_children) __builtin_prefetch(L2.child + static_cast<uint64_t>(v) * L2.child_bytes);
    }
    if (++i == hash_slots_) i = 0;
  }
}

// Stage 3: the 2-token context's node, requesting its children on level 3; contexts longer than
// 2 tokens.
template <class TT>
void TrieView::stage_children(Query& q) const {
  if (!q.active) return;
  constexpr uint32_t tb = sizeof(TT);
  const LevelView& L2 = lv_[2];
  q.s2 = q.e2 = 0;
  q.inv2 = 0.0f;
  q.counts2_requested = false;
  if (q.eb > q.sb) {
    uint64_t node = kNone;
    if (q.ctx_indexed)
      node = q.node_ctx;
    else if (q.hashb)
      node = probe_slots<TT>(hash_, hash_slots_, hash_max_probe_, q.slot_ctx, q.a, q.sb, q.eb, L2.tokens);
    else if (!search_tokens<TT>(L2.tokens, q.sb, q.eb, q.a, node))
      node = kNone;
    if (node != kNone) {
      const LevelView& L3 = lv_[3];
      q.s2 = child_at(L2, node);
      q.e2 = child_at(L2, node + 1);
      if (q.s2 > q.e2 || q.e2 > L3.n) q.ok = false, q.s2 = q.e2 = 0;
      prefetch_search(L3.tokens, q.s2, q.e2, tb);
      q.counts2_requested = prefetch_small(L3.counts, q.s2, q.e2, L3.count_bytes, 4);
      const uint64_t c = count_checked(2, node, q.ok);
      // Same float arithmetic as the original (count * (1/ctx_count)), bit for bit. A zero
      // context count (possible only after pruning) gives 0 instead of the original's NaN.
      q.inv2 = c ? 1.0f / static_cast<float>(c) : 0.0f;
    }
  }
  // Contexts longer than 2 tokens (order > 3), longest first; not the common case.
  if (q.len >= 3) {
    for (size_t i = 0; i < q.n; ++i) {
      q.probs[i] = 0.0f;
      q.matched[i] = 0;
    }
    q.zeroed = true;
  }
  for (size_t l = q.len; l >= 3; --l) {
    uint64_t node;
    if (!find_path(q.ctx + q.len - l, l, node, q.ok)) continue;
    const int k = static_cast<int>(l);
    const uint64_t s = child_at(lv_[k], node), e = child_at(lv_[k], node + 1);
    if (s > e || e > lv_[k + 1].n) {
      q.ok = false;
      continue;
    }
    if (s == e) continue;
    const uint64_t c = count_checked(k, node, q.ok);
    const float inv = c ? 1.0f / static_cast<float>(c) : 0.0f;
    uint64_t found[kBlock];
    search_lockstep<TT>(lv_[k + 1].tokens, s, e, q.key, q.n, found);
    for (size_t i = 0; i < q.n; ++i) {
      if (q.matched[i] || found[i] == kNone) continue;
      q.probs[i] = static_cast<float>(count_checked(k + 1, found[i], q.ok)) * inv;
      q.matched[i] = static_cast<int32_t>(l);
    }
  }
}

// Stage 4: the candidates among the 1-token context's children, then among the 2-token context's
// (requesting the counts of the matches).
template <class TT>
void TrieView::stage_search(Query& q) const {
  if (!q.active) return;
  // The candidates' level-2 data was requested a stage earlier than the level-3 run: searching
  // it first overlaps that work with the run's arrival.
  if (!q.reuse1 && !q.indexed) {
    if (q.hash1) {
      for (size_t i = 0; i < q.n; ++i)
        q.found1[i] = probe_slots<TT>(hash_, hash_slots_, hash_max_probe_, q.slot[i], q.key[i], q.s1, q.e1,
                                      lv_[2].tokens);
    } else {
      search_keys<TT>(lv_[2].tokens, q.s1, q.e1, q.key, q.n, q.found1);
      if (!q.counts1_requested)
        for (size_t i = 0; i < q.n; ++i)
          if (q.found1[i] != kNone) __builtin_prefetch(lv_[2].counts + q.found1[i] * lv_[2].count_bytes);
    }
  }
  const LevelView& L3 = lv_[3];
  search_keys<TT>(L3.tokens, q.s2, q.e2, q.key, q.n, q.found2);
  if (!q.counts2_requested)
    for (size_t i = 0; i < q.n; ++i)
      if (q.found2[i] != kNone) __builtin_prefetch(L3.counts + q.found2[i] * L3.count_bytes);
}

// Stage 5: the answers, longest context first.
void TrieView::stage_finish(Query& q, Level1Cache& cache) const {
  if (!q.active) {
    for (size_t i = 0; i < q.n; ++i) {
      q.probs[i] = 0.0f;
      q.matched[i] = 0;
    }
    return;
  }
  if (q.cache1) {
    for (size_t i = 0; i < q.n; ++i) {
      cache.state[i] = 0;
      if (q.found1[i] == kNone) continue;
      bool count_ok = true;
      const uint64_t c = count_fast(2, q.found1[i], count_ok);
      cache.prob[i] = static_cast<float>(c) * q.inv1;
      cache.state[i] = count_ok ? 1 : 2;
    }
  }
  for (size_t i = 0; i < q.n; ++i) {
    if (q.zeroed && q.matched[i]) continue;  // matched by a context longer than 2 tokens
    q.probs[i] = 0.0f;
    q.matched[i] = 0;
    if (q.found2[i] != kNone) {
      // Same float arithmetic as the original (count * (1/ctx_count)), bit for bit.
      q.probs[i] = static_cast<float>(count_fast(3, q.found2[i], q.ok)) * q.inv2;
      q.matched[i] = 2;
    } else if (q.reuse1 || q.cache1) {
      // Only a count this query uses may flag corruption, as in a query of its own.
      if (!cache.state[i]) continue;
      if (cache.state[i] == 2) q.ok = false;
      q.probs[i] = cache.prob[i];
      q.matched[i] = 1;
    } else if (q.found1[i] != kNone) {
      q.probs[i] = static_cast<float>(count_fast(2, q.found1[i], q.ok)) * q.inv1;
      q.matched[i] = 1;
    }
  }
}

// Runs the queries of a batch through the five stages as a software pipeline: each step advances
// five consecutive queries by one stage each, so every stage's requests have a whole step to
// arrive and the misses of different queries overlap. One query runs the stages back to back.
template <class TT>
bool TrieView::run_batch(const Batch& B, std::vector<size_t>* bad_rows) const {
  if (B.n == 0) return true;
  const size_t blocks = (B.n + kBlock - 1) / kBlock;
  const size_t total = B.rows * blocks;
  // Rows sharing the candidates and (adjacent in B.order) the last context token share the
  // level-1 answers: those are computed once.
  const bool shared = B.token_stride == 0 && blocks == 1 && B.rows > 1;
  const size_t max_len = static_cast<size_t>(hdr_.order) - 1;
  constexpr size_t kDepth = 5;
  Query ring[kDepth];
  Level1Cache cache;
  bool prev_active = false;
  uint32_t prev_a = 0;
  bool ok = true;
  // Query t: row, first candidate, and its context's last `len` tokens.
  auto locate = [&](size_t t, size_t& r, size_t& b0, size_t& len) -> const int32_t* {
    r = B.order ? B.order[t / blocks] : t / blocks;
    b0 = (t % blocks) * kBlock;
    const size_t clen = B.context_lens[r] > 0 ? static_cast<size_t>(B.context_lens[r]) : 0;
    len = std::min(max_len, clen);
    return B.contexts + r * B.context_stride + (clen - len);
  };
  for (size_t t = 0; t < total + kDepth - 1; ++t) {
    if (t >= 4 && t - 4 < total) {
      Query& q = ring[(t - 4) % kDepth];
      stage_finish(q, cache);
      if (!q.ok) {
        ok = false;
        if (bad_rows) bad_rows->push_back(q.row);
      }
    }
    if (t >= 3 && t - 3 < total) stage_search<TT>(ring[(t - 3) % kDepth]);
    if (t >= 2 && t - 2 < total) stage_children<TT>(ring[(t - 2) % kDepth]);
    if (t >= 1 && t - 1 < total) stage_context<TT>(ring[(t - 1) % kDepth]);
    if (t < total) {
      Query& q = ring[t % kDepth];
      size_t r, b0;
      q.ctx = locate(t, r, b0, q.len);
      q.tokens = B.tokens + r * B.token_stride + b0;
      q.n = std::min(kBlock, B.n - b0);
      q.probs = B.probs + r * B.n + b0;
      q.matched = B.matched + r * B.n + b0;
      q.row = r;
      q.reuse1 = shared && prev_active && q.len > 0 && q.ctx[q.len - 1] == static_cast<int32_t>(prev_a);
      q.cache1 = false;
      stage_issue<TT>(q);
      // The first query of a group stores its level-1 answers (its last stage runs later).
      if (q.reuse1) {
        Query& prev = ring[(t + kDepth - 1) % kDepth];
        if (!prev.reuse1) prev.cache1 = true;
      }
      prev_active = q.active;
      prev_a = q.a;
      // The next query reads its context tokens' unigram entries first thing: request them now.
      if (t + 1 < total) {
        size_t nr, nb0, nlen;
        const int32_t* nctx = locate(t + 1, nr, nb0, nlen);
        for (size_t j = nlen > 2 ? nlen - 2 : 0; j < nlen; ++j)
          if (nctx[j] >= 0 && static_cast<uint64_t>(nctx[j]) < hdr_.vocab_size) __builtin_prefetch(&uni_[nctx[j]]);
      }
    }
  }
  return ok;
}

// One query (at most kBlock candidates): the stages back to back, without run_batch's pipeline
// bookkeeping (~300 instructions; single queries ~4% faster).
template <class TT>
bool TrieView::run_one(const int32_t* ctx, size_t len, const int32_t* tokens, size_t n, float* probs,
                       int32_t* matched) const {
  Query q;
  q.ctx = ctx;
  q.len = len;
  q.tokens = tokens;
  q.n = n;
  q.probs = probs;
  q.matched = matched;
  stage_issue<TT>(q);
  stage_context<TT>(q);
  stage_children<TT>(q);
  stage_search<TT>(q);
  Level1Cache unused;  // only queries that share level-1 answers touch it
  stage_finish(q, unused);
  return q.ok;
}

// The entry points in trie_probability.cpp call these.
template bool TrieView::run_batch<uint16_t>(const Batch&, std::vector<size_t>*) const;
template bool TrieView::run_batch<uint32_t>(const Batch&, std::vector<size_t>*) const;
template bool TrieView::run_one<uint16_t>(const int32_t*, size_t, const int32_t*, size_t, float*, int32_t*) const;
template bool TrieView::run_one<uint32_t>(const int32_t*, size_t, const int32_t*, size_t, float*, int32_t*) const;

}  // namespace ngb
