// Python bindings of the n-gram-enforced tree search (dart_infer._search).
//
// One call per decoding step: numpy views of the top-k arrays go in, four numpy arrays come out.
// The search itself runs with the GIL released on a per-thread reusable workspace.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "dart/ngram_query.hpp"
#include "tree_search.hpp"

namespace py = pybind11;
using dart::search::SearchInput;
using dart::search::SearchParams;
using dart::search::Workspace;

namespace {

// Inputs converted to the search's types, reused across calls of one thread.
struct InputBuffers {
  std::vector<int32_t> tokens;
  std::vector<float> probs;
  std::vector<int32_t> prompt_tail;
  std::vector<float> level_weight, logit_weight;
};

int32_t checked_token(long long value, const char* what) {
  if (value < 0 || value > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument(std::string(what) + " contains token id " + std::to_string(value) +
                                ", outside the int32 range of token ids");
  }
  return static_cast<int32_t>(value);
}

std::string dtype_name(const py::array& array) { return py::str(array.dtype()).cast<std::string>(); }

template <typename T>
void copy_tokens_2d(const py::array& array, std::vector<int32_t>& out) {
  auto view = array.unchecked<T, 2>();
  out.resize(static_cast<size_t>(view.shape(0) * view.shape(1)));
  size_t i = 0;
  for (py::ssize_t r = 0; r < view.shape(0); ++r) {
    for (py::ssize_t c = 0; c < view.shape(1); ++c) {
      out[i++] = checked_token(static_cast<long long>(view(r, c)), "topk_tokens");
    }
  }
}

template <typename T>
void copy_probs_2d(const py::array& array, std::vector<float>& out) {
  auto view = array.unchecked<T, 2>();
  out.resize(static_cast<size_t>(view.shape(0) * view.shape(1)));
  size_t i = 0;
  for (py::ssize_t r = 0; r < view.shape(0); ++r) {
    for (py::ssize_t c = 0; c < view.shape(1); ++c) out[i++] = static_cast<float>(view(r, c));
  }
}

template <typename T>
void copy_prompt_tail(const py::array& array, size_t need, std::vector<int32_t>& out) {
  auto view = array.unchecked<T, 1>();
  const size_t len = static_cast<size_t>(view.shape(0));
  const size_t take = std::min(len, need);
  out.resize(take);
  for (size_t i = 0; i < take; ++i) {
    out[i] = checked_token(static_cast<long long>(view(static_cast<py::ssize_t>(len - take + i))),
                           "prompt_tokens");
  }
}

// Reads the last `need` prompt tokens from a 1-D integer numpy array or a list/tuple of ints
// (only the tail is touched: prompts can be long).
void read_prompt_tail(const py::object& prompt, size_t need, std::vector<int32_t>& out) {
  if (py::isinstance<py::array>(prompt)) {
    py::array array = py::reinterpret_borrow<py::array>(prompt);
    if (array.ndim() != 1) {
      throw std::invalid_argument("prompt_tokens must be 1-D, got " + std::to_string(array.ndim()) + " dims");
    }
    if (array.dtype().is(py::dtype::of<int64_t>())) return copy_prompt_tail<int64_t>(array, need, out);
    if (array.dtype().is(py::dtype::of<int32_t>())) return copy_prompt_tail<int32_t>(array, need, out);
    throw std::invalid_argument("prompt_tokens must hold int32 or int64 token ids, got dtype " +
                                dtype_name(array));
  }
  if (!py::isinstance<py::list>(prompt) && !py::isinstance<py::tuple>(prompt)) {
    throw std::invalid_argument("prompt_tokens must be a 1-D integer tensor/array or a list of ints, got " +
                                py::str(py::type::of(prompt)).cast<std::string>());
  }
  py::sequence seq = py::reinterpret_borrow<py::sequence>(prompt);
  const size_t len = seq.size();
  const size_t take = std::min(len, need);
  out.resize(take);
  for (size_t i = 0; i < take; ++i) {
    py::object item = seq[len - take + i];
    if (!py::isinstance<py::int_>(item) || py::isinstance<py::bool_>(item)) {
      throw std::invalid_argument("prompt_tokens must contain ints, got " +
                                  py::str(py::type::of(item)).cast<std::string>());
    }
    const long long value = PyLong_AsLongLong(item.ptr());
    if (value == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      throw std::invalid_argument("prompt_tokens contains a token id that does not fit in 64 bits");
    }
    out[i] = checked_token(value, "prompt_tokens");
  }
}

// Per-level weights: None -> the original's defaults, else one finite value per level.
void read_weights(const py::object& given, int64_t levels, bool is_level_weight, const char* name,
                  std::vector<float>& out) {
  out.resize(static_cast<size_t>(levels));
  if (given.is_none()) {
    // Computed in double and rounded to float, like the original's Python lambdas -> prob_t.
    for (int64_t l = 0; l < levels; ++l) {
      out[l] = static_cast<float>(is_level_weight ? std::pow(static_cast<double>(l + 1), -0.7)
                                                  : std::pow(0.9, static_cast<double>(l)));
    }
    return;
  }
  // ensure() converts any float sequence/array and yields a null array (error cleared) otherwise.
  auto array = py::array_t<double, py::array::forcecast>::ensure(given);
  if (!array || array.ndim() != 1 || array.shape(0) != levels) {
    throw std::invalid_argument(std::string(name) + " must be a 1-D sequence of " + std::to_string(levels) +
                                " floats (one per level)");
  }
  auto view = array.unchecked<1>();
  for (int64_t l = 0; l < levels; ++l) out[l] = static_cast<float>(view(l));
}

// The trie's query interface, or null for None.
const dart::NgramQuery* ngram_query_of(const py::object& trie, py::object& capsule_holder) {
  if (trie.is_none()) return nullptr;
  if (!py::hasattr(trie, "_ngram_query_capsule")) {
    throw std::invalid_argument("trie must be an ngram_builder.NgramTrie (or None), got " +
                                py::str(py::type::of(trie)).cast<std::string>());
  }
  capsule_holder = trie.attr("_ngram_query_capsule")();
  if (!PyCapsule_IsValid(capsule_holder.ptr(), DART_NGRAM_QUERY_CAPSULE)) {
    throw std::invalid_argument("trie._ngram_query_capsule() did not return a '" DART_NGRAM_QUERY_CAPSULE
                                "' capsule");
  }
  return static_cast<const dart::NgramQuery*>(PyCapsule_GetPointer(capsule_holder.ptr(), DART_NGRAM_QUERY_CAPSULE));
}

template <typename T>
py::array_t<T> to_numpy(const T* data, std::initializer_list<py::ssize_t> shape) {
  py::array_t<T> array(shape);
  if (array.size() > 0) std::memcpy(array.mutable_data(), data, sizeof(T) * static_cast<size_t>(array.size()));
  return array;
}

py::tuple search(const py::array& topk_tokens, const py::array& topk_probs, const py::object& trie,
                 const py::object& prompt_tokens, long long eos_token_id, long long beam_width,
                 long long remain_total, double ngram_weight, const py::object& level_weight,
                 const py::object& logit_weight, bool ngram_on_first_level, long long vocab_size) {
  thread_local InputBuffers buffers;
  thread_local Workspace workspace;

  if (topk_tokens.ndim() != 2 || topk_probs.ndim() != 2) {
    throw std::invalid_argument("topk_tokens and topk_probs must be 2-D [levels, k]; got " +
                                std::to_string(topk_tokens.ndim()) + "-D and " +
                                std::to_string(topk_probs.ndim()) + "-D");
  }
  if (topk_tokens.shape(0) != topk_probs.shape(0) || topk_tokens.shape(1) != topk_probs.shape(1)) {
    throw std::invalid_argument("topk_tokens and topk_probs must have the same shape; got [" +
                                std::to_string(topk_tokens.shape(0)) + ", " + std::to_string(topk_tokens.shape(1)) +
                                "] and [" + std::to_string(topk_probs.shape(0)) + ", " +
                                std::to_string(topk_probs.shape(1)) + "]");
  }
  if (topk_tokens.dtype().is(py::dtype::of<int64_t>())) {
    copy_tokens_2d<int64_t>(topk_tokens, buffers.tokens);
  } else if (topk_tokens.dtype().is(py::dtype::of<int32_t>())) {
    copy_tokens_2d<int32_t>(topk_tokens, buffers.tokens);
  } else {
    throw std::invalid_argument("topk_tokens must be int32 or int64, got dtype " + dtype_name(topk_tokens));
  }
  if (topk_probs.dtype().is(py::dtype::of<float>())) {
    copy_probs_2d<float>(topk_probs, buffers.probs);
  } else if (topk_probs.dtype().is(py::dtype::of<double>())) {
    copy_probs_2d<double>(topk_probs, buffers.probs);
  } else {
    throw std::invalid_argument("topk_probs must be float32 or float64, got dtype " + dtype_name(topk_probs));
  }
  const int64_t levels = topk_tokens.shape(0);
  if (levels < 1) throw std::invalid_argument("topk_tokens must have at least one level (row)");

  auto in_int32 = [](long long value, const char* name) {
    if (value < std::numeric_limits<int32_t>::min() || value > std::numeric_limits<int32_t>::max()) {
      throw std::invalid_argument(std::string(name) + " is out of range: " + std::to_string(value));
    }
    return static_cast<int32_t>(value);
  };
  SearchParams params;
  params.eos_token_id = in_int32(eos_token_id, "eos_token_id");
  params.beam_width = beam_width;
  params.remain_total = remain_total;
  if (!std::isfinite(ngram_weight) || ngram_weight < 0) {
    throw std::invalid_argument("ngram_weight must be finite and >= 0, got " + std::to_string(ngram_weight));
  }
  params.ngram_weight = static_cast<float>(ngram_weight);
  params.ngram_on_first_level = ngram_on_first_level;
  if (vocab_size < 0) throw std::invalid_argument("vocab_size must be positive (or None)");
  params.vocab_size = vocab_size;
  read_weights(level_weight, levels, true, "level_weight", buffers.level_weight);
  read_weights(logit_weight, levels, false, "logit_weight", buffers.logit_weight);
  params.level_weight = buffers.level_weight.data();
  params.logit_weight = buffers.logit_weight.data();

  py::object capsule;
  const dart::NgramQuery* query = ngram_query_of(trie, capsule);
  const int order = query != nullptr ? query->order() : 1;
  read_prompt_tail(prompt_tokens, static_cast<size_t>(std::max(order - 1, 1)), buffers.prompt_tail);

  SearchInput input;
  input.levels = levels;
  input.k = topk_tokens.shape(1);
  input.topk_tokens = buffers.tokens.data();
  input.topk_probs = buffers.probs.data();
  input.prompt_tail = buffers.prompt_tail.data();
  input.prompt_tail_len = static_cast<int64_t>(buffers.prompt_tail.size());
  {
    // `trie` and `capsule` stay referenced by this frame while the search uses the pointer.
    py::gil_scoped_release release;
    dart::search::tree_search(input, params, query, workspace);
  }

  const dart::search::Tree& tree = workspace.tree;
  const py::ssize_t n = tree.n_nodes;
  py::array_t<bool> mask({n, n});
  static_assert(sizeof(bool) == sizeof(uint8_t));
  std::memcpy(mask.mutable_data(), tree.tree_mask.data(), static_cast<size_t>(n * n));
  return py::make_tuple(to_numpy(tree.draft_tokens.data(), {n}),
                        to_numpy(tree.retrieve_indices.data(), {tree.n_leaves, tree.max_depth + 1}),
                        std::move(mask), to_numpy(tree.tree_positions.data(), {n}),
                        to_numpy(tree.parents.data(), {n}));
}

}  // namespace

PYBIND11_MODULE(_search, m) {
  m.doc() = "C++ tree search of DART: top-k draft logits + n-gram trie -> draft tree";
  m.def("search", &search, py::arg("topk_tokens"), py::arg("topk_probs"), py::arg("trie"),
        py::arg("prompt_tokens"), py::arg("eos_token_id"), py::arg("beam_width"),
        py::arg("remain_total"), py::arg("ngram_weight"), py::arg("level_weight"), py::arg("logit_weight"),
        py::arg("ngram_on_first_level"), py::arg("vocab_size"),
        "Runs one tree search. Arrays in: topk_tokens int32/int64 [d, k], topk_probs float32/float64 "
        "[d, k]; prompt_tokens a 1-D int array or list (last = root). Returns numpy arrays "
        "(draft_tokens int64 [n], retrieve_indices int64 [leaves, max_depth + 1], tree_mask bool [n, n], "
        "tree_positions int64 [n], parents int64 [n] (root -1)). vocab_size 0 = unchecked.");
}
