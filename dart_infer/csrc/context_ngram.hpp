// A per-request n-gram model of the tokens seen so far (prompt + accepted tokens), for the tree
// search's n-gram term next to the corpus trie (beyond the paper: where the output copies the
// input, as code repeating its prompt, this proposes and rewards the copy).
//
// Same semantics as the corpus trie's queries (dart/ngram_query.hpp): p(tok | ctx) =
// count(ctx + tok) / count(ctx) at the longest context suffix (min(order - 1, len) tokens down to
// 1) that was followed by `tok` at least once; count(ctx) = how often ctx was followed by a token.
// Updated incrementally: adding a token costs order - 1 hash-map updates, never a rebuild.
//
// Layout: contexts (1..order-1 tokens) -> ContextEntry through an open-addressing table; each
// (context, next token) pair is a ChildEntry found through a second table keyed by (context id,
// token). A context's first two continuations are also held in its entry (most contexts have one
// or two: reading them costs no further cache miss), the others in a linked list of ChildEntry. A
// context also tracks its most frequent continuation (ties: the most recent to reach that count),
// which the search proposes as an extra candidate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <shared_mutex>
#include <vector>

#include "dart/ngram_query.hpp"

namespace dart::search {

constexpr int kMaxContextOrder = 5;  // contexts of up to 4 tokens (packed into 128-bit keys)

// Candidate tokens of one search level: token -> its index in the level. Most tokens looked up
// are not candidates; a 4096-bit filter (token mod 4096) rejects nearly all of them with one test.
class CandidateIndex {
 public:
  void assign(const int32_t* tokens, size_t n);
  // Index of `token` among the candidates, or -1.
  int32_t find(int32_t token) const {
    const uint32_t t = static_cast<uint32_t>(token);
    if (!((filter_[(t >> 6) & 63] >> (t & 63)) & 1)) return -1;
    for (size_t i = slot(t);; i = (i + 1) & mask_) {
      if (index_[i] < 0) return -1;
      if (tokens_[i] == token) return index_[i];
    }
  }
  size_t size() const { return size_; }

 private:
  size_t slot(uint32_t token) const { return (token * 0x9E3779B1u) >> shift_ & mask_; }
  uint64_t filter_[64] = {};
  std::vector<int32_t> tokens_, index_;  // open addressing, load <= 1/2; index -1 = empty
  size_t size_ = 0, mask_ = 0;
  int shift_ = 0;
};

class ContextNgram final : public NgramQuery {
 public:
  explicit ContextNgram(int order);

  int order() const override { return order_; }
  void probability(const int32_t* context, size_t context_len, const int32_t* tokens, size_t n, float* probs,
                   int32_t* matched) const override;

  // Appends tokens (ids must be >= 0; nothing is added when one is not).
  void extend(const int32_t* tokens, size_t n);
  // Brings the model up to a history of `history_len` tokens that starts with everything seen so
  // far, given its part from `part_start` on (part_start <= size() - tail_len()): checks that the
  // last tokens seen sit where they should, then appends history[size(), history_len).
  void sync(const int32_t* part, int64_t part_start, int64_t history_len);

  int64_t size() const { return size_; }
  size_t num_contexts() const { return entries_.size(); }
  // The last min(order - 1, size()) tokens seen.
  const int32_t* tail() const { return tail_; }
  int32_t tail_len() const { return tail_len_; }

  // Ids of the context suffixes of `context` (its last 1 .. order - 1 tokens) seen with a
  // continuation, SHORTEST first; returns how many (<= order - 1).
  int32_t find_contexts(const int32_t* context, size_t context_len, int32_t* ids) const;
  // For the candidates `tokens` of one level (indexed by `index`) that followed context `id`:
  // probs[j] = count(ctx + token) / count(ctx). Other entries are left as they are, so calling it
  // for find_contexts' ids shortest first gives probability()'s back-off.
  void overwrite_probabilities(int32_t id, const int32_t* tokens, const CandidateIndex& index, float* probs) const;
  // Most frequent continuation of context `id` and its probability.
  int32_t best_token(int32_t id) const { return entries_[static_cast<size_t>(id)].best_token; }
  float best_probability(int32_t id) const;
  // Most frequent continuation of the longest context suffix seen; false if none is.
  bool top_continuation(const int32_t* context, size_t context_len, int32_t* token, float* prob,
                        int32_t* matched) const;

  // Readers (searches) hold it shared; extend/sync hold it exclusively.
  std::shared_mutex& mutex() const { return mutex_; }

 private:
  struct Key {
    uint64_t lo, hi;
    bool operator==(const Key& other) const { return lo == other.lo && hi == other.hi; }
  };
  struct ContextEntry {
    uint32_t total;         // times the context was followed by a token
    uint32_t best_count;
    int32_t best_token;
    int32_t n_children;
    int32_t first_tokens[2];   // the first two continuations (-1: none yet) and their counts
    uint32_t first_counts[2];
    int32_t third_child;    // the third continuation; ChildEntry::next links the rest (-1 ends)
    int32_t last_child;
  };
  struct ChildEntry {
    int32_t token;
    uint32_t count;
    int32_t next;
  };
  // Open addressing, linear probing, power-of-two capacity, load <= 1/2; values are ids (-1 empty).
  // Key and value share a slot: a lookup costs one cache line.
  template <typename K>
  struct Table {
    struct Slot {
      K key;
      int32_t value;
    };
    std::vector<Slot> slots;
    size_t used = 0;
    int32_t find(const K& key, uint64_t hash) const;
    // Slot of `key`, inserted with value -1 if absent (the caller sets it).
    int32_t& slot(const K& key, uint64_t hash);
    void grow();
    void prefetch(uint64_t hash) const {
      if (!slots.empty()) __builtin_prefetch(&slots[hash & (slots.size() - 1)]);
    }
  };

  static Key pack(const int32_t* tokens, int32_t len);
  static uint64_t hash(const Key& key);
  static uint64_t hash(uint64_t key);
  static uint64_t pair_key(int32_t context_id, int32_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(context_id)) << 32) | static_cast<uint32_t>(token);
  }
  int32_t find_child(int32_t context_id, int32_t token) const;
  void add(int32_t token);

  int order_;
  int64_t size_ = 0;
  int32_t tail_[kMaxContextOrder - 1] = {};
  int32_t tail_len_ = 0;
  Table<Key> context_table_;
  Table<uint64_t> child_table_;
  std::vector<ContextEntry> entries_;
  std::vector<ChildEntry> children_;
  mutable std::shared_mutex mutex_;
};

}  // namespace dart::search
