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
};

}  // namespace dart
