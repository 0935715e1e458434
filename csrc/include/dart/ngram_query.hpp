// The one thing the tree search needs from an n-gram model: back-off probabilities of candidate
// tokens after a context. ngram_builder implements it; dart_infer's tree search consumes it.
//
// Across the two Python extension modules the object travels as a PyCapsule named
// DART_NGRAM_QUERY_CAPSULE that holds a `const dart::NgramQuery*`; the Python object that made the
// capsule must stay alive for as long as the pointer is used (the search holds a reference to it
// for the duration of the call).
#pragma once

#include <cstddef>
#include <cstdint>

#define DART_NGRAM_QUERY_CAPSULE "dart.NgramQuery"

namespace dart {

class NgramQuery {
 public:
  virtual ~NgramQuery() = default;

  // Maximum n-gram length stored (3 for the default trie): contexts longer than order-1 tokens
  // are cut to their last order-1 tokens.
  virtual int order() const = 0;

  // For each of the n candidate `tokens`: probs[i] = count(ctx + tok) / count(ctx) at the longest
  // context suffix (length min(order-1, context_len) down to 1) whose node exists and has `tok`
  // as a child; matched[i] = that suffix length. Unseen: 0.0f and 0. Empty context: all zeros.
  // Must be thread-safe for concurrent readers and must not touch Python.
  virtual void probability(const int32_t* context, size_t context_len, const int32_t* tokens,
                           size_t n, float* probs, int32_t* matched) const = 0;

  // `rows` queries at once, each answered exactly as probability() would: row r has the context
  // `contexts + r * context_stride` of `context_lens[r]` (>= 0) tokens and the n candidates
  // `tokens + r * token_stride` (token_stride 0: all rows share one candidate list), and writes
  // probs/matched[r * n, (r + 1) * n). Implementations overlap the rows' memory accesses, which a
  // loop of single queries cannot; this default is that loop.
  virtual void probability_batch(const int32_t* contexts, size_t context_stride, const int32_t* context_lens,
                                 size_t rows, const int32_t* tokens, size_t token_stride, size_t n, float* probs,
                                 int32_t* matched) const {
    for (size_t r = 0; r < rows; ++r)
      probability(contexts + r * context_stride, context_lens[r] > 0 ? static_cast<size_t>(context_lens[r]) : 0,
                  tokens + r * token_stride, n, probs + r * n, matched + r * n);
  }
};

}  // namespace dart
