// The public probability queries: each row goes through the batched pipeline (trie_query.cpp) where the
// level-2 hash and unigram table exist, else through the generic path here (binary searches per context).
#include "trie_query.hpp"

namespace ngb {

bool TrieView::probability_generic(const int32_t* context, size_t context_len, const int32_t* tokens, size_t n,
                                   float* probs, int32_t* matched) const {
  for (size_t i = 0; i < n; ++i) {
    probs[i] = 0.0f;
    matched[i] = 0;
  }
  bool ok = true;
  const size_t max_len = std::min(static_cast<size_t>(hdr_.order) - 1, context_len);
  if (max_len == 0 || n == 0) return true;
  // The trie is far larger than the caches: every step below is a likely cache miss, so the
  // independent ones are prefetched together and paid once instead of one after another.
  const int32_t* ctx = context + context_len - max_len;
  if (!dense1_.empty())
    for (size_t j = 0; j < max_len; ++j)
      if (ctx[j] >= 0 && static_cast<uint64_t>(ctx[j]) < hdr_.vocab_size) __builtin_prefetch(&dense1_[ctx[j]]);
  // The hash table is keyed by tokens (parent token, token), so every slot a query may need (the
  // 2-token context's node, each candidate under the 1-token context) is known up front and
  // fetched together with the context nodes instead of after them.
  const uint32_t last = static_cast<uint32_t>(ctx[max_len - 1]);
  uint64_t slot1[kBlock];
  if (hash_slots_ && ctx[max_len - 1] >= 0) {
    for (size_t i = 0; i < std::min(n, kBlock); ++i) {
      slot1[i] = hash_slot(last, static_cast<uint32_t>(tokens[i]), hash_slots_);
      __builtin_prefetch(hash_ + slot1[i] * 4);
    }
    if (max_len >= 2 && ctx[max_len - 2] >= 0)
      __builtin_prefetch(hash_ + hash_slot(static_cast<uint32_t>(ctx[max_len - 2]), last, hash_slots_) * 4);
  }
  // Context nodes for every usable suffix length and their child ranges.
  uint64_t begin[kMaxOrder], end[kMaxOrder];
  float inv[kMaxOrder];
  bool use_hash1 = false;
  bool any = false;
  for (size_t len = 1; len <= max_len; ++len) {
    uint64_t node;
    begin[len] = end[len] = 0;
    if (!find_path(context + context_len - len, len, node, ok)) continue;
    const int k = static_cast<int>(len);
    const LevelView& L = lv_[k];
    begin[len] = child_at(L, node);
    end[len] = child_at(L, node + 1);
    if (begin[len] > end[len] || end[len] > lv_[k + 1].n) {
      ok = false;
      begin[len] = end[len] = 0;
      continue;
    }
    if (len == 1 && hash_slots_ && end[1] - begin[1] >= kHashMinRange) use_hash1 = true;
    const uint64_t ctx_count = count_checked(k, node, ok);
    // Same float arithmetic as the original (count * (1/ctx_count)), bit for bit. A zero context
    // count (possible only after pruning) gives 0 instead of the original's NaN.
    inv[len] = ctx_count ? 1.0f / static_cast<float>(ctx_count) : 0.0f;
    any = any || begin[len] < end[len];
  }
  if (!any) return ok;
  uint32_t keys[kBlock];
  size_t idx[kBlock];
  uint64_t found[kBlock];
  uint64_t slot[kBlock];
  for (size_t b0 = 0; b0 < n; b0 += kBlock) {
    const size_t bn = std::min(kBlock, n - b0);
    for (size_t len = max_len; len > 0; --len) {
      if (begin[len] >= end[len]) continue;
      size_t m = 0;  // the still unmatched candidates of this block
      for (size_t i = b0; i < b0 + bn; ++i) {
        if (matched[i] || tokens[i] < 0) continue;
        keys[m] = static_cast<uint32_t>(tokens[i]);
        idx[m++] = i;
      }
      if (m == 0) break;
      const int k = static_cast<int>(len);
      const LevelView& C = lv_[k + 1];
      if (k == 1 && use_hash1) {
        for (size_t j = 0; j < m; ++j)
          slot[j] = b0 == 0 ? slot1[idx[j]] : hash_slot(last, keys[j], hash_slots_);
        for (size_t j = 0; j < m; ++j) {  // first slots: prefetch the likely matches' tokens
          uint32_t v;
          std::memcpy(&v, hash_ + slot[j] * 4, 4);
          if (v != kHashEmpty && v >= begin[len] && v < end[len])
            __builtin_prefetch(C.tokens + static_cast<uint64_t>(v) * hdr_.token_bytes);
        }
        for (size_t j = 0; j < m; ++j) found[j] = hash_probe(slot[j], keys[j], begin[len], end[len]);
      } else if (hdr_.token_bytes == 2) {
        search_lockstep<uint16_t>(C.tokens, begin[len], end[len], keys, m, found);
      } else {
        search_lockstep<uint32_t>(C.tokens, begin[len], end[len], keys, m, found);
      }
      for (size_t j = 0; j < m; ++j)
        if (found[j] != kNone) __builtin_prefetch(C.counts + found[j] * C.count_bytes);
      for (size_t j = 0; j < m; ++j) {
        if (found[j] == kNone) continue;
        probs[idx[j]] = static_cast<float>(count_checked(k + 1, found[j], ok)) * inv[len];
        matched[idx[j]] = static_cast<int32_t>(len);
      }
    }
  }
  return ok;
}

bool TrieView::probability_batch_checked(const int32_t* contexts, size_t context_stride, const int32_t* context_lens,
                                         size_t rows, const int32_t* tokens, size_t token_stride, size_t n,
                                         float* probs, int32_t* matched, std::vector<size_t>* bad_rows) const {
  if (uni_.empty()) {
    bool ok = true;
    for (size_t r = 0; r < rows; ++r) {
      const size_t len = context_lens[r] > 0 ? static_cast<size_t>(context_lens[r]) : 0;
      if (!probability_generic(contexts + r * context_stride, len, tokens + r * token_stride, n, probs + r * n,
                               matched + r * n)) {
        ok = false;
        if (bad_rows) bad_rows->push_back(r);
      }
    }
    return ok;
  }
  // Shared candidates: rows grouped by last context token, so that each group's level-1 answers
  // are computed once (the tree search's beam paths often end in the same token).
  uint32_t order_small[64];
  std::vector<uint32_t> order_big;
  const uint32_t* order = nullptr;
  if (token_stride == 0 && rows > 1 && n <= kBlock && rows < (1ull << 31)) {
    const size_t max_len = static_cast<size_t>(hdr_.order) - 1;
    // (last token + 1) << 32 | row, sorted; rows without a context token first.
    std::vector<uint64_t> keyed_big;
    uint64_t keyed_small[64];
    uint64_t* keyed = keyed_small;
    if (rows > 64) {
      keyed_big.resize(rows);
      keyed = keyed_big.data();
      order_big.resize(rows);
    }
    for (size_t r = 0; r < rows; ++r) {
      const size_t clen = context_lens[r] > 0 ? static_cast<size_t>(context_lens[r]) : 0;
      const int64_t last = std::min(max_len, clen) ? contexts[r * context_stride + clen - 1] : -1;
      keyed[r] = static_cast<uint64_t>(last + 1) << 32 | r;
    }
    std::sort(keyed, keyed + rows);
    uint32_t* out = rows > 64 ? order_big.data() : order_small;
    for (size_t r = 0; r < rows; ++r) out[r] = static_cast<uint32_t>(keyed[r]);
    order = out;
  }
  const Batch b{contexts, context_stride, context_lens, rows, tokens, token_stride, n, probs, matched, order};
  return hdr_.token_bytes == 2 ? run_batch<uint16_t>(b, bad_rows) : run_batch<uint32_t>(b, bad_rows);
}

void TrieView::probability_batch(const int32_t* contexts, size_t context_stride, const int32_t* context_lens,
                                 size_t rows, const int32_t* tokens, size_t token_stride, size_t n, float* probs,
                                 int32_t* matched) const {
  std::vector<size_t> bad;
  if (probability_batch_checked(contexts, context_stride, context_lens, rows, tokens, token_stride, n, probs, matched,
                                &bad))
    return;
  // Corrupt data: those rows report "unseen" rather than garbage (the Python API raises instead).
  for (size_t r : bad)
    for (size_t i = 0; i < n; ++i) {
      probs[r * n + i] = 0.0f;
      matched[r * n + i] = 0;
    }
}

bool TrieView::probability_checked(const int32_t* context, size_t context_len, const int32_t* tokens, size_t n,
                                   float* probs, int32_t* matched) const {
  if (uni_.empty()) return probability_generic(context, context_len, tokens, n, probs, matched);
  // Only the last order - 1 tokens are read.
  const size_t len = std::min(static_cast<size_t>(hdr_.order) - 1, context_len);
  const int32_t* last = context + context_len - len;
  if (n <= kBlock)
    return hdr_.token_bytes == 2 ? run_one<uint16_t>(last, len, tokens, n, probs, matched)
                                 : run_one<uint32_t>(last, len, tokens, n, probs, matched);
  const int32_t len32 = static_cast<int32_t>(len);
  const Batch b{last, 0, &len32, 1, tokens, 0, n, probs, matched, nullptr};
  return hdr_.token_bytes == 2 ? run_batch<uint16_t>(b, nullptr) : run_batch<uint32_t>(b, nullptr);
}

void TrieView::probability(const int32_t* context, size_t context_len, const int32_t* tokens, size_t n, float* probs,
                           int32_t* matched) const {
  if (!probability_checked(context, context_len, tokens, n, probs, matched)) {
    // Corrupt data: report "unseen" rather than garbage (the Python API raises instead).
    for (size_t i = 0; i < n; ++i) {
      probs[i] = 0.0f;
      matched[i] = 0;
    }
  }
}

}  // namespace ngb
