// Counting documents into a trie: every start position of a document contributes the slice of up
// to `order` tokens that starts there (the original's add_conversation). Slices are packed into
// integer keys, counted in sorted chunks ("runs", sorted on worker threads, optionally spilled to
// disk under a memory cap) and k-way merged into the streaming CsrBuilder. The result depends only
// on the multiset of slices, so a capped, spilled build is byte-identical to an in-memory one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "trie.hpp"

namespace ngb {

struct CounterOptions {
  int order = 3;
  uint64_t vocab_size = 0;    // 0: unknown (token ids up to the packing limit are accepted)
  uint64_t memory_cap = 0;    // bytes for chunk buffers; 0: default chunk size, runs kept in RAM
  std::string spill_dir;      // where runs and builder columns go when memory_cap > 0
  int threads = 1;            // sorting workers
};

class SliceCounter {
 public:
  explicit SliceCounter(const CounterOptions& opt);
  ~SliceCounter();
  SliceCounter(const SliceCounter&) = delete;
  SliceCounter& operator=(const SliceCounter&) = delete;
  // One document (the caller appends EOS if wanted). Throws std::invalid_argument on bad ids.
  void add_doc(const int32_t* tokens, size_t n);
  uint64_t tokens() const;
  uint64_t docs() const;
  uint64_t max_token_limit() const;  // largest id accepted
  // Merges everything counted into a trie; to `out_path` (returns nullptr) or to memory.
  // The counter is empty afterwards.
  std::shared_ptr<Image> build(const std::string& out_path, const std::string& fingerprint);
  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace ngb
