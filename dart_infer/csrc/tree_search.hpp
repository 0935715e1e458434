// DART's n-gram-enforced tree search (dart-method.md §4), free of Python.
//
// A beam search over the d draft levels: every beam path is extended by the level's k candidate
// tokens, scored with the draft probability and (optionally) the n-gram back-off probability of
// the token after the path's context; the best `beam_width` children (paths ending in EOS last)
// form the next beam. Every child ever generated is a tree-node candidate; the best
// `remain_total` by score are kept. Child scores never exceed their parent's, and ties are broken
// towards shallower nodes, so the kept set is always closed under ancestors (a tree).
//
// Paths are stored as parent pointers into one node array (no per-path vectors), all buffers live
// in a reusable Workspace, and the result is encoded into flat arrays that the bindings copy into
// numpy arrays.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "context_ngram.hpp"
#include "dart/ngram_query.hpp"

namespace dart::search {

// Largest supported searches (the default one generates 3,525 nodes).
constexpr int64_t kMaxLevels = 4096;
constexpr int64_t kMaxNodes = int64_t{1} << 22;  // ~128 MiB of buffers; indices fit 31 bits

struct SearchParams {
  int32_t eos_token_id = 2;
  int64_t vocab_size = 0;  // > 0: every token id must be below it; 0: unchecked
  int64_t beam_width = 20;
  int64_t remain_total = 60;
  float ngram_weight = 0.5f;
  bool ngram_on_first_level = false;
  // Context model (beyond the paper; used only when one is passed and context_weight > 0): the
  // n-gram term's probability becomes (1 - context_weight) * p_trie + context_weight * p_context
  // (p_trie = 0 without a trie). With context_propose, the context's most frequent continuation
  // of each beam path is added as an extra child when the level's candidates lack it.
  float context_weight = 0.0f;
  bool context_propose = false;
  // One weight per level (length = number of levels), already rounded to float like the
  // original's `prob_t` weight functions.
  const float* level_weight = nullptr;
  const float* logit_weight = nullptr;
};

struct SearchInput {
  int64_t levels = 0;  // d
  int64_t k = 0;       // candidates per level
  const int32_t* topk_tokens = nullptr;  // [d * k], row-major
  const float* topk_probs = nullptr;     // [d * k], row-major, each in [0, 1]
  // The last tokens of the prompt (at least min(order - 1, prompt length) of them, and at least
  // one); the last element is the tree's root token.
  const int32_t* prompt_tail = nullptr;
  int64_t prompt_tail_len = 0;
};

// One generated child: a path is the chain of parents up to the root (parent = -1).
struct Node {
  float score;
  int32_t token;
  int32_t parent;
  int32_t depth;  // 1 for children of the root
};

// The encoded tree (valid until the next search with the same workspace).
struct Tree {
  int64_t n_nodes = 0;     // including the root
  int64_t n_leaves = 0;
  int64_t max_depth = 0;
  std::vector<int64_t> draft_tokens;      // [n_nodes]
  std::vector<int64_t> tree_positions;    // [n_nodes]
  std::vector<int64_t> parents;           // [n_nodes], root = -1
  std::vector<uint8_t> tree_mask;         // [n_nodes * n_nodes]
  std::vector<int64_t> retrieve_indices;  // [n_leaves * (max_depth + 1)], padded with -1
};

// Buffers reused across searches (one per thread).
struct Workspace {
  std::vector<Node> nodes;
  std::vector<uint64_t> node_keys;     // per node: selection key (EOS, score, node index)
  std::vector<uint64_t> keys;          // scratch for selections
  std::vector<int32_t> beam;
  std::vector<float> logit_term;       // [k]: logit_weight * log(p + 1e-10) of the current level
  std::vector<float> ngram_term;       // [beam * k]: ngram_weight * log(p_ngram + 1e-10)
  std::vector<float> ngram_probs;      // [beam * k]: one row per distinct context
  std::vector<int32_t> ngram_matched;  // [beam * k]
  std::vector<int32_t> contexts;       // [beam * (order - 1)]
  std::vector<int32_t> context_len;    // [beam]
  std::vector<int32_t> context_row;    // [beam]: row of ngram_term used by each beam entry
  std::vector<int32_t> row_contexts;   // [beam * (order - 1)]: the distinct contexts, queried at once
  std::vector<int32_t> row_len;        // [beam]
  // Context model: per distinct context row, its probabilities and proposal.
  CandidateIndex candidates;           // the level's candidate tokens
  std::vector<float> context_probs;    // [beam * k]
  std::vector<int32_t> context_ids;    // [beam * (kMaxContextOrder - 1)]
  std::vector<int32_t> context_matched;  // [beam]: how many of them were seen
  std::vector<float> shortest_probs;   // [beam * k]: probabilities after the 1-token context alone
  std::vector<int32_t> extra_token;    // [beam]: proposed extra child, -1 none
  std::vector<float> extra_term;       // [beam]: its n-gram term
  std::vector<int32_t> kept;           // node indices of the kept tree, in output order
  std::vector<int32_t> new_index;      // node index -> output index (only kept entries valid)
  std::vector<uint8_t> has_child;
  std::vector<int32_t> sorted_tokens;  // validation scratch
  Tree tree;
};

// Runs the search and encodes the tree into ws.tree. `ngram` may be null (no trie term), and so
// may `context` (no context model; the caller holds its mutex shared while the search runs).
// Throws std::invalid_argument for bad inputs (including duplicate candidates within a level) and
// std::runtime_error when the n-gram model
// misbehaves (probabilities outside [0, 1]). Never touches Python.
void tree_search(const SearchInput& input, const SearchParams& params, const NgramQuery* ngram,
                 const ContextNgram* context, Workspace& ws);

}  // namespace dart::search
