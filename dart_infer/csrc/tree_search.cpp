#include "tree_search.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

namespace dart::search {
namespace {

constexpr float kLogEpsilon = 1e-10f;  // added before log, as in the original

// Maps a float to a 32-bit key whose ascending order is the float's DESCENDING order.
inline uint32_t descending_key(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t ascending = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return ~ascending;
}

// Selection key, smaller = better: [63] path ends in EOS, [62:31] score (descending order),
// [30:0] node index. Equal scores -> lower node index first; node indices grow level by level, so
// a parent always comes before an equally scored child.
constexpr uint64_t kEosBit = uint64_t{1} << 63;
constexpr uint64_t kIndexMask = (uint64_t{1} << 31) - 1;

inline uint64_t node_key(float score, int32_t index, bool ends_in_eos) {
  return (ends_in_eos ? kEosBit : 0) | (uint64_t{descending_key(score)} << 31) | static_cast<uint64_t>(index);
}

inline int32_t key_index(uint64_t key) { return static_cast<int32_t>(key & kIndexMask); }

// Moves the `count` smallest of the distinct keys a[0, n) to a[0, count) (in no particular order).
// Quickselect with a branchless Lomuto partition: the comparisons are unpredictable, so
// std::nth_element's branchy partition spends most of its time on mispredictions. Falls back to
// std::nth_element after too many rounds (bad pivots), so the worst case stays O(n log n).
void select_front(uint64_t* a, size_t n, size_t count) {
  if (count == 0 || count >= n) return;
  const size_t target = count - 1;  // a[target] becomes the count-th smallest
  size_t lo = 0, hi = n;
  int rounds_left = 2 * (64 - __builtin_clzll(static_cast<unsigned long long>(n)));
  while (hi - lo > 16) {
    if (rounds_left-- == 0) {
      std::nth_element(a + lo, a + target, a + hi);
      return;
    }
    // Median of three as pivot, parked at the end of the range.
    const size_t mid = lo + (hi - lo) / 2, last = hi - 1;
    size_t pivot_at = mid;
    if ((a[lo] < a[mid]) != (a[lo] < a[last])) pivot_at = lo;
    else if ((a[last] < a[lo]) != (a[last] < a[mid])) pivot_at = last;
    std::swap(a[pivot_at], a[last]);
    const uint64_t pivot = a[last];
    size_t store = lo;
    for (size_t i = lo; i < last; ++i) {
      const uint64_t value = a[i];
      a[i] = a[store];
      a[store] = value;
      store += value < pivot;
    }
    std::swap(a[store], a[last]);  // the pivot lands at its sorted position
    if (target == store) return;
    if (target < store) hi = store;
    else lo = store + 1;
  }
  // Small range: insertion sort settles the boundary.
  for (size_t i = lo + 1; i < hi; ++i) {
    const uint64_t value = a[i];
    size_t j = i;
    for (; j > lo && a[j - 1] > value; --j) a[j] = a[j - 1];
    a[j] = value;
  }
}

// Writes the `count` smallest of (src[i] & ~ignore_bits) to out (unordered); returns how many.
size_t select_smallest(const uint64_t* src, size_t size, size_t count, uint64_t ignore_bits, uint64_t* out) {
  const uint64_t keep_bits = ~ignore_bits;
  for (size_t i = 0; i < size; ++i) out[i] = src[i] & keep_bits;
  select_front(out, size, count);
  return std::min(size, count);
}

void check_token(int64_t token, int64_t vocab_size, const char* what) {
  if (token < 0 || (vocab_size > 0 && token >= vocab_size)) {
    std::string message = std::string(what) + " contains token id " + std::to_string(token) +
                          (vocab_size > 0 ? ", outside [0, " + std::to_string(vocab_size) + ")"
                                          : ", which is negative");
    throw std::invalid_argument(message);
  }
}

// Checks the inputs; returns the most children the search can generate (`extra` more per parent
// than the level's k when the context model proposes candidates).
int64_t validate(const SearchInput& in, const SearchParams& p, int64_t extra, std::vector<int32_t>& scratch) {
  if (in.levels < 1 || in.levels > kMaxLevels) {
    throw std::invalid_argument("topk_tokens must have between 1 and " + std::to_string(kMaxLevels) +
                                " levels (rows), got " + std::to_string(in.levels));
  }
  if (in.k < 1) throw std::invalid_argument("topk_tokens must have at least one candidate per level (k >= 1)");
  if (p.beam_width < 1) {
    throw std::invalid_argument("beam_width must be >= 1, got " + std::to_string(p.beam_width));
  }
  if (p.remain_total < 1) {
    throw std::invalid_argument("remain_total must be >= 1, got " + std::to_string(p.remain_total));
  }
  if (in.prompt_tail_len < 1) throw std::invalid_argument("prompt_tokens is empty: it must end with the root token");
  if (p.eos_token_id < 0) {
    throw std::invalid_argument("eos_token_id must be >= 0, got " + std::to_string(p.eos_token_id));
  }
  if (!(std::isfinite(p.ngram_weight) && p.ngram_weight >= 0.0f)) {
    throw std::invalid_argument("ngram_weight must be finite and >= 0");
  }
  if (!(std::isfinite(p.context_weight) && p.context_weight >= 0.0f && p.context_weight <= 1.0f)) {
    throw std::invalid_argument("context_weight must lie in [0, 1]");
  }
  for (int64_t level = 0; level < in.levels; ++level) {
    const float lw = p.level_weight[level], gw = p.logit_weight[level];
    // Negative weights would let a child outscore its parent and break the tree property.
    if (!(std::isfinite(lw) && lw >= 0.0f && std::isfinite(gw) && gw >= 0.0f)) {
      throw std::invalid_argument("level_weight and logit_weight must be finite and >= 0 (level " +
                                  std::to_string(level) + ")");
    }
  }
  const int64_t n = in.levels * in.k;
  for (int64_t i = 0; i < n; ++i) {
    check_token(in.topk_tokens[i], p.vocab_size, "topk_tokens");
    const float prob = in.topk_probs[i];
    if (!(prob >= 0.0f && prob <= 1.0f)) {  // also rejects NaN
      throw std::invalid_argument("topk_probs must lie in [0, 1] (a softmax over the k candidates); got " +
                                  std::to_string(prob) + " at level " + std::to_string(i / in.k));
    }
  }
  // Duplicate candidates (a non-injective d2t mapping upstream) would give duplicate tree nodes.
  for (int64_t level = 0; level < in.levels; ++level) {
    scratch.assign(in.topk_tokens + level * in.k, in.topk_tokens + (level + 1) * in.k);
    std::sort(scratch.begin(), scratch.end());
    const auto duplicate = std::adjacent_find(scratch.begin(), scratch.end());
    if (duplicate != scratch.end()) {
      throw std::invalid_argument("topk_tokens has token id " + std::to_string(*duplicate) +
                                  " more than once at level " + std::to_string(level) +
                                  " (candidates must be distinct target ids)");
    }
  }
  for (int64_t i = 0; i < in.prompt_tail_len; ++i) {
    check_token(in.prompt_tail[i], p.vocab_size, "prompt_tokens");
  }
  // Exact number of children the search generates (the beam holds min(children, beam_width)).
  int64_t total = 0, parents = 1;
  for (int64_t level = 0; level < in.levels; ++level) {
    const int64_t children = parents * (in.k + extra);
    total += children;
    if (total > kMaxNodes) {
      throw std::invalid_argument("the search would generate more than " + std::to_string(kMaxNodes) +
                                  " nodes; lower beam_width, k or the number of levels");
    }
    parents = std::min(children, p.beam_width);
  }
  return total;
}

// Writes the last `need` tokens of (prompt + path ending at `node`) into `out`; returns the count.
int32_t build_context(const SearchInput& in, const Node* nodes, int32_t node, int32_t need,
                      int32_t* out) {
  int32_t path_len = node < 0 ? 0 : nodes[node].depth;
  const int32_t from_path = std::min(path_len, need);
  const int32_t from_prompt =
      static_cast<int32_t>(std::min<int64_t>(need - from_path, in.prompt_tail_len));
  const int32_t len = from_prompt + from_path;
  for (int32_t i = len - 1; i >= from_prompt; --i) {
    out[i] = nodes[node].token;
    node = nodes[node].parent;
  }
  std::memcpy(out, in.prompt_tail + in.prompt_tail_len - from_prompt, sizeof(int32_t) * from_prompt);
  return len;
}

void check_probability(float prob) {
  if (!(prob >= 0.0f && prob <= 1.0f)) {
    throw std::runtime_error("the n-gram model returned probability " + std::to_string(prob) + ", outside [0, 1]");
  }
}

// The n-gram terms of one level with the context model: for each of the `rows` distinct contexts
// (ws.row_contexts), p = (1 - w) * p_trie + w * p_context per candidate (p_trie from
// ws.ngram_probs, 0 without a trie), written to ws.ngram_term; and, with context_propose, the
// context's most frequent continuation when no candidate is that token (ws.extra_token/extra_term,
// -1 = none). Returns whether any row proposes one.
bool context_propose_terms(const SearchInput& in, const SearchParams& p, const NgramQuery* ngram,
                           const ContextNgram& context, const int32_t* tokens, int32_t rows, size_t stride,
                           float unseen_term, Workspace& ws) {
  const int64_t k = in.k;
  const float weight = p.context_weight, keep = 1.0f - p.context_weight;
  ws.candidates.assign(tokens, static_cast<size_t>(k));
  bool any_extra = false;
  for (int32_t row = 0; row < rows; ++row) {
    const int32_t* ctx = ws.row_contexts.data() + static_cast<size_t>(row) * stride;
    const int32_t len = ws.row_len[static_cast<size_t>(row)];
    int32_t* ids = ws.context_ids.data() + static_cast<size_t>(row) * (kMaxContextOrder - 1);
    const int32_t matched = context.find_contexts(ctx, static_cast<size_t>(len), ids);
    ws.context_matched[static_cast<size_t>(row)] = matched;
    // Back-off, shortest context first. Rows often share their last token (the 1-token context):
    // its probabilities are computed once per level.
    float* shortest = ws.shortest_probs.data() + static_cast<size_t>(row) * k;
    float* context_probs = ws.context_probs.data() + static_cast<size_t>(row) * k;
    const float* shared = nullptr;
    for (int32_t prev = 0; prev < row && shared == nullptr && matched > 0; ++prev) {
      if (ws.context_matched[static_cast<size_t>(prev)] > 0 &&
          ws.context_ids[static_cast<size_t>(prev) * (kMaxContextOrder - 1)] == ids[0]) {
        shared = ws.shortest_probs.data() + static_cast<size_t>(prev) * k;
      }
    }
    if (shared == nullptr) {
      std::fill(shortest, shortest + k, 0.0f);
      if (matched > 0) context.overwrite_probabilities(ids[0], tokens, ws.candidates, shortest);
      shared = shortest;
    } else {
      std::memcpy(shortest, shared, sizeof(float) * static_cast<size_t>(k));
    }
    std::memcpy(context_probs, shared, sizeof(float) * static_cast<size_t>(k));
    for (int32_t c = 1; c < matched; ++c) context.overwrite_probabilities(ids[c], tokens, ws.candidates, context_probs);
    const float* trie_probs = ws.ngram_probs.data() + static_cast<size_t>(row) * k;
    float* term = ws.ngram_term.data() + static_cast<size_t>(row) * k;
    for (int64_t j = 0; j < k; ++j) {
      float prob = weight * context_probs[j];
      if (ngram != nullptr) {
        check_probability(trie_probs[j]);
        prob += keep * trie_probs[j];
      }
      term[j] = prob == 0.0f ? unseen_term : logf(prob + kLogEpsilon) * p.ngram_weight;
    }
    ws.extra_token[static_cast<size_t>(row)] = -1;
    if (!p.context_propose || matched == 0) continue;
    const int32_t token = context.best_token(ids[matched - 1]);
    if (ws.candidates.find(token) >= 0) continue;
    check_token(token, p.vocab_size, "the context model's proposal");
    float prob = weight * context.best_probability(ids[matched - 1]);
    if (ngram != nullptr) {
      float trie_prob = 0.0f;
      int32_t trie_matched = 0;
      ngram->probability(ctx, static_cast<size_t>(len), &token, 1, &trie_prob, &trie_matched);
      check_probability(trie_prob);
      prob += keep * trie_prob;
    }
    ws.extra_token[static_cast<size_t>(row)] = token;
    ws.extra_term[static_cast<size_t>(row)] = logf(prob + kLogEpsilon) * p.ngram_weight;
    any_extra = true;
  }
  return any_extra;
}

void encode_tree(const SearchInput& in, Workspace& ws) {
  const Node* nodes = ws.nodes.data();
  std::vector<int32_t>& kept = ws.kept;
  Tree& tree = ws.tree;
  // Output order: by depth, then best score first (siblings in descending score), then index.
  std::sort(kept.begin(), kept.end(), [&](int32_t a, int32_t b) {
    if (nodes[a].depth != nodes[b].depth) return nodes[a].depth < nodes[b].depth;
    return node_key(nodes[a].score, a, false) < node_key(nodes[b].score, b, false);
  });
  const int64_t n = static_cast<int64_t>(kept.size()) + 1;
  tree.n_nodes = n;
  tree.draft_tokens.resize(n);
  tree.tree_positions.resize(n);
  tree.parents.resize(n);
  if (ws.new_index.size() < ws.nodes.size()) ws.new_index.resize(ws.nodes.size());

  tree.draft_tokens[0] = in.prompt_tail[in.prompt_tail_len - 1];
  tree.tree_positions[0] = 0;
  tree.parents[0] = -1;
  for (int64_t i = 1; i < n; ++i) {
    const int32_t id = kept[i - 1];
    const Node& node = nodes[id];
    ws.new_index[id] = static_cast<int32_t>(i);
    tree.draft_tokens[i] = node.token;
    tree.tree_positions[i] = node.depth;
    // Parents precede children in the output (smaller depth), so their index is already set.
    int32_t parent = 0;
    if (node.parent >= 0) {
      parent = ws.new_index[node.parent];
      // Guaranteed by the selection keys (a parent outranks its children); checked because a
      // stale entry of new_index would otherwise give a silently wrong tree.
      if (parent < 1 || parent >= i || kept[parent - 1] != node.parent) {
        throw std::logic_error("tree search: a kept node's parent was not kept (internal error)");
      }
    }
    tree.parents[i] = parent;
  }
  tree.max_depth = tree.tree_positions[n - 1];

  // Mask row of a node = its parent's row plus itself.
  tree.tree_mask.assign(static_cast<size_t>(n * n), 0);
  uint8_t* mask = tree.tree_mask.data();
  mask[0] = 1;
  for (int64_t i = 1; i < n; ++i) {
    std::memcpy(mask + i * n, mask + tree.parents[i] * n, static_cast<size_t>(i));
    mask[i * n + i] = 1;
  }

  ws.has_child.assign(static_cast<size_t>(n), 0);
  for (int64_t i = 1; i < n; ++i) ws.has_child[tree.parents[i]] = 1;
  int64_t leaves = 0;
  for (int64_t i = 1; i < n; ++i) leaves += ws.has_child[i] ? 0 : 1;
  tree.n_leaves = leaves;
  const int64_t width = tree.max_depth + 1;
  tree.retrieve_indices.assign(static_cast<size_t>(leaves * width), -1);
  int64_t row = 0;
  for (int64_t i = 1; i < n; ++i) {
    if (ws.has_child[i]) continue;
    int64_t* out = tree.retrieve_indices.data() + row * width;
    for (int64_t j = i; j != 0; j = tree.parents[j]) out[tree.tree_positions[j]] = j;
    out[0] = 0;
    ++row;
  }
}

}  // namespace

// Kept out of line: inlined into the bindings, the thread_local workspace's address would be
// recomputed (__tls_get_addr) inside the hot loops.
__attribute__((noinline)) void tree_search(const SearchInput& in, const SearchParams& p, const NgramQuery* ngram,
                                           const ContextNgram* context, Workspace& ws) {
  const bool context_on = context != nullptr && p.context_weight > 0.0f;
  const int64_t extra = context_on && p.context_propose ? 1 : 0;
  const int64_t total_nodes = validate(in, p, extra, ws.sorted_tokens);
  const int64_t k = in.k;
  int32_t context_need = 0;
  if (ngram != nullptr) {
    const int order = ngram->order();
    if (order < 1 || order > 64) {
      throw std::runtime_error("the n-gram model reports an unsupported order " + std::to_string(order));
    }
    context_need = order - 1;
  }
  if (context_on) context_need = std::max(context_need, context->order() - 1);
  const size_t context_stride = static_cast<size_t>(std::max(context_need, 1));
  const size_t max_beam = static_cast<size_t>(std::min<int64_t>(p.beam_width, total_nodes));

  // Sized once; capacity is kept across searches, so steady state allocates nothing.
  ws.nodes.resize(static_cast<size_t>(total_nodes));
  ws.node_keys.resize(static_cast<size_t>(total_nodes));
  ws.keys.resize(static_cast<size_t>(total_nodes));
  ws.beam.resize(max_beam + 1);
  ws.logit_term.resize(static_cast<size_t>(k));
  ws.ngram_probs.resize((max_beam + 1) * static_cast<size_t>(k));
  ws.ngram_matched.resize((max_beam + 1) * static_cast<size_t>(k));
  ws.contexts.resize(max_beam * context_stride + context_stride);
  ws.context_len.resize(max_beam + 1);
  ws.context_row.resize(max_beam + 1);
  ws.row_contexts.resize(max_beam * context_stride + context_stride);
  ws.row_len.resize(max_beam + 1);
  ws.ngram_term.resize((max_beam + 1) * static_cast<size_t>(k));
  if (context_on) {
    ws.context_probs.resize((max_beam + 1) * static_cast<size_t>(k));
    ws.context_ids.resize((max_beam + 1) * (kMaxContextOrder - 1));
    ws.context_matched.resize(max_beam + 1);
    ws.shortest_probs.resize((max_beam + 1) * static_cast<size_t>(k));
    ws.extra_token.resize(max_beam + 1);
    ws.extra_term.resize(max_beam + 1);
  }

  Node* const nodes = ws.nodes.data();
  uint64_t* const node_keys = ws.node_keys.data();
  uint64_t* const keys = ws.keys.data();
  int32_t* const beam = ws.beam.data();
  float* const logit_term = ws.logit_term.data();
  float* const ngram_term_rows = ws.ngram_term.data();
  int32_t* const contexts = ws.contexts.data();
  int32_t* const context_len = ws.context_len.data();
  int32_t* const context_row = ws.context_row.data();

  const float unseen_term = logf(0.0f + kLogEpsilon) * p.ngram_weight;
  size_t beam_size = 1;
  beam[0] = -1;  // the root
  int32_t n_nodes = 0;
  for (int64_t level = 0; level < in.levels; ++level) {
    const int32_t* tokens = in.topk_tokens + level * k;
    const float* probs = in.topk_probs + level * k;
    const float level_weight = p.level_weight[level];
    const float logit_weight = p.logit_weight[level];
    for (int64_t j = 0; j < k; ++j) logit_term[j] = logf(probs[j] + kLogEpsilon) * logit_weight;

    const bool use_ngram =
        (ngram != nullptr || context_on) && p.ngram_weight > 0.0f && (level > 0 || p.ngram_on_first_level);
    bool level_extras = false;
    if (use_ngram) {
      // One query per distinct context (beam paths often share their last order-1 tokens), all
      // of the level's queries in one batch: they share the candidates, and the model overlaps
      // their memory accesses.
      int32_t rows = 0;
      for (size_t b = 0; b < beam_size; ++b) {
        int32_t* ctx = contexts + b * context_stride;
        const int32_t len = build_context(in, nodes, beam[b], context_need, ctx);
        context_len[b] = len;
        int32_t row = -1;
        for (size_t prev = 0; prev < b && row < 0; ++prev) {
          if (context_len[prev] != len) continue;
          const int32_t* other = contexts + prev * context_stride;
          int32_t i = len - 1;  // the last tokens differ most often
          while (i >= 0 && ctx[i] == other[i]) --i;
          if (i < 0) row = context_row[prev];
        }
        if (row < 0) {
          row = rows++;
          std::memcpy(ws.row_contexts.data() + static_cast<size_t>(row) * context_stride, ctx,
                      sizeof(int32_t) * static_cast<size_t>(len));
          ws.row_len[row] = len;
        }
        context_row[b] = row;
      }
      const float* ngram_probs = ws.ngram_probs.data();
      if (ngram != nullptr) {
        ngram->probability_batch(ws.row_contexts.data(), context_stride, ws.row_len.data(),
                                 static_cast<size_t>(rows), tokens, 0, static_cast<size_t>(k), ws.ngram_probs.data(),
                                 ws.ngram_matched.data());
      }
      if (context_on) {
        level_extras = context_propose_terms(in, p, ngram, *context, tokens, rows, context_stride, unseen_term, ws);
      } else {
        for (int64_t i = 0; i < static_cast<int64_t>(rows) * k; ++i) {
          const float prob = ngram_probs[i];
          check_probability(prob);
          // Most candidates are unseen: skip their logf (same value, computed once).
          ngram_term_rows[i] = prob == 0.0f ? unseen_term : logf(prob + kLogEpsilon) * p.ngram_weight;
        }
      }
    }

    // A proposed child's draft term: the level's smallest, i.e. it counts as likely as the k-th
    // candidate (an upper bound: it was not among the draft's top k).
    const float extra_logit_term = level_extras ? *std::min_element(logit_term, logit_term + k) : 0.0f;
    const int32_t level_begin = n_nodes;
    const int32_t depth = static_cast<int32_t>(level) + 1;
    for (size_t b = 0; b < beam_size; ++b) {
      const int32_t parent = beam[b];
      const float parent_score = parent < 0 ? 0.0f : nodes[parent].score;
      const float* ngram_term = use_ngram ? ngram_term_rows + static_cast<size_t>(context_row[b]) * k : nullptr;
      for (int64_t j = 0; j < k; ++j) {
        // Same operation order as the original, for bit-identical scores.
        const float score = use_ngram ? parent_score + level_weight * (logit_term[j] + ngram_term[j])
                                      : parent_score + level_weight * logit_term[j];
        nodes[n_nodes] = Node{score, tokens[j], parent, depth};
        node_keys[n_nodes] = node_key(score, n_nodes, tokens[j] == p.eos_token_id);
        ++n_nodes;
      }
      if (level_extras) {
        const int32_t row = context_row[b];
        const int32_t token = ws.extra_token[static_cast<size_t>(row)];
        if (token >= 0) {
          const float score = parent_score + level_weight * (extra_logit_term + ws.extra_term[static_cast<size_t>(row)]);
          nodes[n_nodes] = Node{score, token, parent, depth};
          node_keys[n_nodes] = node_key(score, n_nodes, token == p.eos_token_id);
          ++n_nodes;
        }
      }
    }
    if (level + 1 == in.levels) break;

    // Next beam: the best beam_width children, paths ending in EOS only after all others.
    beam_size = select_smallest(node_keys + level_begin, static_cast<size_t>(n_nodes - level_begin),
                                static_cast<size_t>(p.beam_width), 0, keys);
    for (size_t i = 0; i < beam_size; ++i) beam[i] = key_index(keys[i]);
  }

  // The kept tree: the best remain_total of all generated children.
  const size_t n_kept =
      select_smallest(node_keys, static_cast<size_t>(n_nodes), static_cast<size_t>(p.remain_total), kEosBit, keys);
  ws.kept.resize(n_kept);
  for (size_t i = 0; i < n_kept; ++i) ws.kept[i] = key_index(keys[i]);
  encode_tree(in, ws);
}

}  // namespace dart::search
