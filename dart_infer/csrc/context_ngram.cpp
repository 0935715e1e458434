#include "context_ngram.hpp"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

namespace dart::search {
namespace {

// Per-request histories are far shorter; the bound keeps every id and count within 31 bits.
constexpr int64_t kMaxTokens = int64_t{1} << 28;
constexpr uint32_t kUnusedWord = 0xFFFFFFFFu;  // never a token id (ids are >= 0, int32)

inline uint64_t mix64(uint64_t x) {  // xorshift-multiply-xorshift: every input bit reaches the low bits
  x = (x ^ (x >> 31)) * 0x9E3779B97F4A7C15ull;
  return x ^ (x >> 29);
}

void check_tokens(const int32_t* tokens, size_t n, int64_t seen) {
  for (size_t i = 0; i < n; ++i) {
    if (tokens[i] < 0) {
      throw std::invalid_argument("context n-gram: token id " + std::to_string(tokens[i]) + " at position " +
                                  std::to_string(i) + " is negative");
    }
  }
  if (seen + static_cast<int64_t>(n) > kMaxTokens) {
    throw std::invalid_argument("context n-gram: more than " + std::to_string(kMaxTokens) +
                                " tokens in one request's model");
  }
}

}  // namespace

void CandidateIndex::assign(const int32_t* tokens, size_t n) {
  size_t capacity = 16;
  int bits = 4;
  while (capacity < 2 * n) {
    capacity *= 2;
    ++bits;
  }
  tokens_.assign(capacity, 0);
  index_.assign(capacity, -1);
  mask_ = capacity - 1;
  shift_ = 32 - bits;
  size_ = n;
  std::fill(std::begin(filter_), std::end(filter_), 0);
  for (size_t j = 0; j < n; ++j) {
    const uint32_t t = static_cast<uint32_t>(tokens[j]);
    filter_[(t >> 6) & 63] |= uint64_t{1} << (t & 63);
    size_t i = slot(t);
    while (index_[i] >= 0) i = (i + 1) & mask_;  // candidates are distinct (validated)
    tokens_[i] = tokens[j];
    index_[i] = static_cast<int32_t>(j);
  }
}

template <typename K>
int32_t ContextNgram::Table<K>::find(const K& key, uint64_t h) const {
  if (slots.empty()) return -1;
  const size_t mask = slots.size() - 1;
  for (size_t i = h & mask;; i = (i + 1) & mask) {
    if (slots[i].value < 0) return -1;
    if (slots[i].key == key) return slots[i].value;
  }
}

template <typename K>
int32_t& ContextNgram::Table<K>::slot(const K& key, uint64_t h) {
  if ((used + 1) * 2 > slots.size()) grow();
  const size_t mask = slots.size() - 1;
  size_t i = h & mask;
  for (; slots[i].value >= 0; i = (i + 1) & mask) {
    if (slots[i].key == key) return slots[i].value;
  }
  slots[i].key = key;
  ++used;
  return slots[i].value;
}

template <typename K>
void ContextNgram::Table<K>::grow() {
  std::vector<Slot> old = std::move(slots);
  const size_t capacity = std::max<size_t>(64, old.size() * 2);
  slots.assign(capacity, Slot{K{}, -1});
  const size_t mask = capacity - 1;
  for (const Slot& entry : old) {
    if (entry.value < 0) continue;
    size_t i = ContextNgram::hash(entry.key) & mask;
    while (slots[i].value >= 0) i = (i + 1) & mask;
    slots[i] = entry;
  }
}

ContextNgram::ContextNgram(int order) : order_(order) {
  if (order < 2 || order > kMaxContextOrder) {
    throw std::invalid_argument("context n-gram order must be between 2 and " + std::to_string(kMaxContextOrder) +
                                ", got " + std::to_string(order));
  }
}

ContextNgram::Key ContextNgram::pack(const int32_t* tokens, int32_t len) {
  uint32_t words[4] = {kUnusedWord, kUnusedWord, kUnusedWord, kUnusedWord};
  for (int32_t i = 0; i < len; ++i) words[i] = static_cast<uint32_t>(tokens[i]);
  return Key{(uint64_t{words[0]} << 32) | words[1], (uint64_t{words[2]} << 32) | words[3]};
}

uint64_t ContextNgram::hash(const Key& key) { return mix64(key.lo ^ mix64(key.hi)); }
uint64_t ContextNgram::hash(uint64_t key) { return mix64(key); }

int32_t ContextNgram::find_child(int32_t context_id, int32_t token) const {
  const uint64_t key = pair_key(context_id, token);
  return child_table_.find(key, hash(key));
}

void ContextNgram::add(int32_t token) {
  for (int32_t len = 1; len <= tail_len_; ++len) {
    const Key key = pack(tail_ + tail_len_ - len, len);
    int32_t& context_slot = context_table_.slot(key, hash(key));
    if (context_slot < 0) {
      context_slot = static_cast<int32_t>(entries_.size());
      entries_.push_back(ContextEntry{0, 0, -1, 0, {-1, -1}, {0, 0}, -1, -1});
    }
    const int32_t id = context_slot;
    ContextEntry& entry = entries_[static_cast<size_t>(id)];
    const uint64_t child_key = pair_key(id, token);
    int32_t& child_slot = child_table_.slot(child_key, hash(child_key));
    if (child_slot < 0) {
      const int32_t child_id = static_cast<int32_t>(children_.size());
      child_slot = child_id;
      children_.push_back(ChildEntry{token, 0, -1});
      if (entry.n_children < 2) {
        entry.first_tokens[entry.n_children] = token;
      } else if (entry.third_child < 0) {
        entry.third_child = entry.last_child = child_id;
      } else {
        children_[static_cast<size_t>(entry.last_child)].next = child_id;
        entry.last_child = child_id;
      }
      ++entry.n_children;
    }
    ChildEntry& child = children_[static_cast<size_t>(child_slot)];
    ++child.count;
    ++entry.total;
    if (entry.first_tokens[0] == token) ++entry.first_counts[0];
    else if (entry.first_tokens[1] == token) ++entry.first_counts[1];
    if (child.count >= entry.best_count) {  // ties: the most recent continuation
      entry.best_count = child.count;
      entry.best_token = token;
    }
  }
  if (tail_len_ < order_ - 1) {
    tail_[tail_len_++] = token;
  } else {
    std::memmove(tail_, tail_ + 1, sizeof(int32_t) * static_cast<size_t>(tail_len_ - 1));
    tail_[tail_len_ - 1] = token;
  }
  ++size_;
}

void ContextNgram::extend(const int32_t* tokens, size_t n) {
  std::unique_lock lock(mutex_);
  check_tokens(tokens, n, size_);
  for (size_t i = 0; i < n; ++i) add(tokens[i]);
}

void ContextNgram::sync(const int32_t* part, int64_t part_start, int64_t history_len) {
  std::unique_lock lock(mutex_);
  if (history_len < size_) {
    throw std::invalid_argument("history has " + std::to_string(history_len) + " tokens, fewer than the " +
                                std::to_string(size_) +
                                " this context model has seen (use one context model per request)");
  }
  if (part_start < 0 || part_start > size_ - tail_len_) {
    throw std::invalid_argument("context n-gram sync: the given part of the history starts too late");
  }
  for (int32_t i = 0; i < tail_len_; ++i) {
    const int64_t at = size_ - tail_len_ + i;
    if (part[at - part_start] != tail_[i]) {
      throw std::invalid_argument("history does not continue what this context model has seen: token " +
                                  std::to_string(part[at - part_start]) + " at position " + std::to_string(at) +
                                  ", the model saw " + std::to_string(tail_[i]) +
                                  " (use one context model per request)");
    }
  }
  const int32_t* added = part + (size_ - part_start);
  const size_t n = static_cast<size_t>(history_len - size_);
  check_tokens(added, n, size_);
  for (size_t i = 0; i < n; ++i) add(added[i]);
}

int32_t ContextNgram::find_contexts(const int32_t* context, size_t context_len, int32_t* ids) const {
  const int32_t longest = static_cast<int32_t>(std::min<size_t>(static_cast<size_t>(order_ - 1), context_len));
  if (longest == 0) return 0;
  Key keys[kMaxContextOrder - 1];
  uint64_t hashes[kMaxContextOrder - 1];
  for (int32_t len = 1; len <= longest; ++len) {  // start every probe's memory access at once
    keys[len - 1] = pack(context + context_len - len, len);
    hashes[len - 1] = hash(keys[len - 1]);
    context_table_.prefetch(hashes[len - 1]);
  }
  int32_t count = 0;
  // A context seen with a continuation implies its shorter suffixes were too: stop at the first miss.
  for (int32_t len = 1; len <= longest; ++len) {
    const int32_t id = context_table_.find(keys[len - 1], hashes[len - 1]);
    if (id < 0) break;
    __builtin_prefetch(&entries_[static_cast<size_t>(id)]);
    ids[count++] = id;
  }
  return count;
}

void ContextNgram::overwrite_probabilities(int32_t id, const int32_t* tokens, const CandidateIndex& index,
                                           float* probs) const {
  const ContextEntry& entry = entries_[static_cast<size_t>(id)];
  const float inverse = 1.0f / static_cast<float>(entry.total);
  const size_t k = index.size();
  if (static_cast<size_t>(entry.n_children) <= k) {  // walk the continuations
    for (int s = 0; s < 2 && s < entry.n_children; ++s) {
      const int32_t j = index.find(entry.first_tokens[s]);
      if (j >= 0) probs[j] = static_cast<float>(entry.first_counts[s]) * inverse;
    }
    for (int32_t child = entry.third_child; child >= 0; child = children_[static_cast<size_t>(child)].next) {
      const ChildEntry& node = children_[static_cast<size_t>(child)];
      const int32_t j = index.find(node.token);
      if (j >= 0) probs[j] = static_cast<float>(node.count) * inverse;
    }
  } else {  // look the candidates up, all table accesses started first
    for (size_t j = 0; j < k; ++j) child_table_.prefetch(hash(pair_key(id, tokens[j])));
    for (size_t j = 0; j < k; ++j) {
      const int32_t child = find_child(id, tokens[j]);
      if (child >= 0) probs[j] = static_cast<float>(children_[static_cast<size_t>(child)].count) * inverse;
    }
  }
}

float ContextNgram::best_probability(int32_t id) const {
  const ContextEntry& entry = entries_[static_cast<size_t>(id)];
  return static_cast<float>(entry.best_count) * (1.0f / static_cast<float>(entry.total));
}

void ContextNgram::probability(const int32_t* context, size_t context_len, const int32_t* tokens, size_t n,
                               float* probs, int32_t* matched) const {
  int32_t ids[kMaxContextOrder - 1];
  const int32_t count = find_contexts(context, context_len, ids);
  for (size_t i = 0; i < n; ++i) {
    probs[i] = 0.0f;
    matched[i] = 0;
    for (int32_t c = count - 1; c >= 0; --c) {
      const int32_t child = find_child(ids[c], tokens[i]);
      if (child < 0) continue;
      const ContextEntry& entry = entries_[static_cast<size_t>(ids[c])];
      probs[i] = static_cast<float>(children_[static_cast<size_t>(child)].count) *
                 (1.0f / static_cast<float>(entry.total));
      matched[i] = c + 1;
      break;
    }
  }
}

bool ContextNgram::top_continuation(const int32_t* context, size_t context_len, int32_t* token, float* prob,
                                    int32_t* matched) const {
  int32_t ids[kMaxContextOrder - 1];
  const int32_t count = find_contexts(context, context_len, ids);
  if (count == 0) return false;
  *token = best_token(ids[count - 1]);
  *prob = best_probability(ids[count - 1]);
  *matched = count;
  return true;
}

}  // namespace dart::search
