// Python bindings of the n-gram-enforced tree search (dart_infer._search).
//
// One call per decoding step: numpy views of the top-k arrays go in, four numpy arrays come out.
// The search itself runs with the GIL released on a per-thread reusable workspace.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <shared_mutex>
#include <string>

#include "context_ngram.hpp"
#include "dart/ngram_query.hpp"
#include "tree_search.hpp"

namespace py = pybind11;
using dart::search::ContextNgram;
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
void copy_prompt_tail(const py::array& array, size_t need, std::vector<int32_t>& out, const char* name) {
  auto view = array.unchecked<T, 1>();
  const size_t len = static_cast<size_t>(view.shape(0));
  const size_t take = std::min(len, need);
  out.resize(take);
  for (size_t i = 0; i < take; ++i) {
    out[i] = checked_token(static_cast<long long>(view(static_cast<py::ssize_t>(len - take + i))), name);
  }
}

// Number of tokens in a 1-D integer numpy array or a list/tuple of ints (checked as below).
size_t token_count(const py::object& tokens, const char* name) {
  if (py::isinstance<py::array>(tokens)) {
    py::array array = py::reinterpret_borrow<py::array>(tokens);
    if (array.ndim() != 1) {
      throw std::invalid_argument(std::string(name) + " must be 1-D, got " + std::to_string(array.ndim()) + " dims");
    }
    return static_cast<size_t>(array.shape(0));
  }
  if (!py::isinstance<py::list>(tokens) && !py::isinstance<py::tuple>(tokens)) {
    throw std::invalid_argument(std::string(name) + " must be a 1-D integer tensor/array or a list of ints, got " +
                                py::str(py::type::of(tokens)).cast<std::string>());
  }
  return py::len(tokens);
}

// Reads the last `need` tokens from a 1-D integer numpy array or a list/tuple of ints (only the
// tail is touched: prompts can be long); returns the total number of tokens.
size_t read_prompt_tail(const py::object& prompt, size_t need, std::vector<int32_t>& out,
                        const char* name = "prompt_tokens") {
  const size_t len = token_count(prompt, name);
  if (py::isinstance<py::array>(prompt)) {
    py::array array = py::reinterpret_borrow<py::array>(prompt);
    if (array.dtype().is(py::dtype::of<int64_t>())) copy_prompt_tail<int64_t>(array, need, out, name);
    else if (array.dtype().is(py::dtype::of<int32_t>())) copy_prompt_tail<int32_t>(array, need, out, name);
    else {
      throw std::invalid_argument(std::string(name) + " must hold int32 or int64 token ids, got dtype " +
                                  dtype_name(array));
    }
    return len;
  }
  py::sequence seq = py::reinterpret_borrow<py::sequence>(prompt);
  const size_t take = std::min(len, need);
  out.resize(take);
  for (size_t i = 0; i < take; ++i) {
    py::object item = seq[len - take + i];
    if (!py::isinstance<py::int_>(item) || py::isinstance<py::bool_>(item)) {
      throw std::invalid_argument(std::string(name) + " must contain ints, got " +
                                  py::str(py::type::of(item)).cast<std::string>());
    }
    const long long value = PyLong_AsLongLong(item.ptr());
    if (value == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      throw std::invalid_argument(std::string(name) + " contains a token id that does not fit in 64 bits");
    }
    out[i] = checked_token(value, name);
  }
  return len;
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

// The context model, or null for None.
const ContextNgram* context_of(const py::object& context) {
  if (context.is_none()) return nullptr;
  if (!py::isinstance<ContextNgram>(context)) {
    throw std::invalid_argument("context must be a dart_infer.search.ContextNgram (or None), got " +
                                py::str(py::type::of(context)).cast<std::string>());
  }
  return context.cast<const ContextNgram*>();
}

// The context model must have seen exactly the prompt: as many tokens, ending the same way.
void check_context_matches_prompt(const ContextNgram& context, size_t prompt_len, const std::vector<int32_t>& tail) {
  bool same = context.size() == static_cast<int64_t>(prompt_len);
  const size_t compare = std::min(tail.size(), static_cast<size_t>(context.tail_len()));
  for (size_t i = 0; same && i < compare; ++i) {
    same = context.tail()[context.tail_len() - compare + i] == tail[tail.size() - compare + i];
  }
  if (!same) {
    throw std::invalid_argument("the context model is out of step with prompt_tokens: it has seen " +
                                std::to_string(context.size()) + " tokens, prompt_tokens has " +
                                std::to_string(prompt_len) +
                                (context.size() == static_cast<int64_t>(prompt_len) ? " but ends differently" : "") +
                                " (sync it with the history before each search)");
  }
}

py::tuple search(const py::array& topk_tokens, const py::array& topk_probs, const py::object& trie,
                 const py::object& prompt_tokens, long long eos_token_id, long long beam_width,
                 long long remain_total, double ngram_weight, const py::object& level_weight,
                 const py::object& logit_weight, bool ngram_on_first_level, long long vocab_size,
                 const py::object& context_model, double context_weight, bool context_propose) {
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
  if (!std::isfinite(context_weight) || context_weight < 0 || context_weight > 1) {
    throw std::invalid_argument("context_weight must lie in [0, 1], got " + std::to_string(context_weight));
  }
  params.context_weight = static_cast<float>(context_weight);
  params.context_propose = context_propose;
  if (vocab_size < 0) throw std::invalid_argument("vocab_size must be positive (or None)");
  params.vocab_size = vocab_size;
  read_weights(level_weight, levels, true, "level_weight", buffers.level_weight);
  read_weights(logit_weight, levels, false, "logit_weight", buffers.logit_weight);
  params.level_weight = buffers.level_weight.data();
  params.logit_weight = buffers.logit_weight.data();

  py::object capsule;
  const dart::NgramQuery* query = ngram_query_of(trie, capsule);
  const ContextNgram* context = context_weight > 0 ? context_of(context_model) : nullptr;
  int order = query != nullptr ? query->order() : 1;
  if (context != nullptr) order = std::max(order, context->order());
  const size_t prompt_len =
      read_prompt_tail(prompt_tokens, static_cast<size_t>(std::max(order - 1, 1)), buffers.prompt_tail);

  SearchInput input;
  input.levels = levels;
  input.k = topk_tokens.shape(1);
  input.topk_tokens = buffers.tokens.data();
  input.topk_probs = buffers.probs.data();
  input.prompt_tail = buffers.prompt_tail.data();
  input.prompt_tail_len = static_cast<int64_t>(buffers.prompt_tail.size());
  {
    // `trie`, `capsule` and `context_model` stay referenced by this frame while the search uses the
    // pointers. The context model is read under its shared lock (released before the GIL is retaken).
    py::gil_scoped_release release;
    std::shared_lock<std::shared_mutex> lock;
    if (context != nullptr) {
      lock = std::shared_lock<std::shared_mutex>(context->mutex());
      check_context_matches_prompt(*context, prompt_len, buffers.prompt_tail);
    }
    dart::search::tree_search(input, params, query, context, workspace);
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

// Token ids of a 1-D integer array or list as int32 (only the last `need` of them).
std::vector<int32_t> tokens_tail(const py::object& tokens, size_t need, const char* name) {
  std::vector<int32_t> out;
  read_prompt_tail(tokens, need, out, name);
  return out;
}

}  // namespace

PYBIND11_MODULE(_search, m) {
  py::class_<ContextNgram>(m, "ContextNgram",
                           "Per-request n-gram model of the tokens seen so far (prompt + accepted tokens), "
                           "updated incrementally; queried like the corpus trie.")
      .def(py::init<int>(), py::arg("order") = 3)
      .def_property_readonly("order", &ContextNgram::order)
      .def_property_readonly("num_contexts", &ContextNgram::num_contexts)
      .def("__len__", [](const ContextNgram& self) { return self.size(); })
      .def(
          "extend",
          [](ContextNgram& self, const py::object& tokens) {
            const std::vector<int32_t> ids = tokens_tail(tokens, std::numeric_limits<size_t>::max(), "tokens");
            self.extend(ids.data(), ids.size());
          },
          py::arg("tokens"), "Appends tokens (1-D int array or list).")
      .def(
          "sync",
          [](ContextNgram& self, const py::object& history) {
            // Only the part from the last tokens already seen onwards is read: O(new tokens).
            const size_t len = token_count(history, "history");
            const size_t seen = static_cast<size_t>(self.size()) - static_cast<size_t>(self.tail_len());
            if (len < static_cast<size_t>(self.size())) {
              throw std::invalid_argument("history has " + std::to_string(len) + " tokens, fewer than the " +
                                          std::to_string(self.size()) +
                                          " this context model has seen (use one context model per request)");
            }
            const std::vector<int32_t> part = tokens_tail(history, len - seen, "history");
            self.sync(part.data(), static_cast<int64_t>(seen), static_cast<int64_t>(len));
          },
          py::arg("history"),
          "Brings the model up to `history` (everything seen so far, then new tokens): adds only the new "
          "tokens, after checking that the last ones seen are where they should be.")
      .def(
          "probability",
          [](const ContextNgram& self, const py::object& context, const py::object& tokens) {
            const std::vector<int32_t> ctx = tokens_tail(context, std::numeric_limits<size_t>::max(), "context");
            const std::vector<int32_t> ids = tokens_tail(tokens, std::numeric_limits<size_t>::max(), "tokens");
            py::array_t<float> probs(static_cast<py::ssize_t>(ids.size()));
            py::array_t<int32_t> matched(static_cast<py::ssize_t>(ids.size()));
            std::shared_lock lock(self.mutex());
            self.probability(ctx.data(), ctx.size(), ids.data(), ids.size(), probs.mutable_data(),
                             matched.mutable_data());
            return py::make_tuple(probs, matched);
          },
          py::arg("context"), py::arg("tokens"),
          "Back-off probabilities of `tokens` after `context` and the matched context lengths, as the trie's.")
      .def(
          "top_continuation",
          [](const ContextNgram& self, const py::object& context) -> py::object {
            const std::vector<int32_t> ctx = tokens_tail(context, std::numeric_limits<size_t>::max(), "context");
            int32_t token = -1, matched = 0;
            float prob = 0.0f;
            std::shared_lock lock(self.mutex());
            if (!self.top_continuation(ctx.data(), ctx.size(), &token, &prob, &matched)) return py::none();
            return py::make_tuple(token, prob, matched);
          },
          py::arg("context"),
          "(token, probability, matched length) of the most frequent continuation of the longest seen "
          "suffix of `context` (ties: the most recent), or None.");

  m.doc() = "C++ tree search of DART: top-k draft logits + n-gram trie -> draft tree";
  m.def("search", &search, py::arg("topk_tokens"), py::arg("topk_probs"), py::arg("trie"),
        py::arg("prompt_tokens"), py::arg("eos_token_id"), py::arg("beam_width"),
        py::arg("remain_total"), py::arg("ngram_weight"), py::arg("level_weight"), py::arg("logit_weight"),
        py::arg("ngram_on_first_level"), py::arg("vocab_size"), py::arg("context") = py::none(),
        py::arg("context_weight") = 0.0, py::arg("context_propose") = false,
        "Runs one tree search. Arrays in: topk_tokens int32/int64 [d, k], topk_probs float32/float64 "
        "[d, k]; prompt_tokens a 1-D int array or list (last = root). Returns numpy arrays "
        "(draft_tokens int64 [n], retrieve_indices int64 [leaves, max_depth + 1], tree_mask bool [n, n], "
        "tree_positions int64 [n], parents int64 [n] (root -1)). vocab_size 0 = unchecked.");
}
