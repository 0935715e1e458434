// Python bindings of the n-gram trie (ngram_builder._core). The friendly Python API with path
// checks lives in ngram_builder/trie.py; this layer converts arguments, validates ids and releases
// the GIL around heavy work.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <mutex>
#include <thread>
#include <time.h>

#include "counter.hpp"
#include "trie.hpp"

namespace py = pybind11;
using namespace ngb;

namespace {

// Sequence (list/tuple/1-D array) of ints -> int32 vector. Negative ids raise; ids beyond int32
// cannot be in any trie, so they become INT32_MAX (unseen) for queries.
std::vector<int32_t> to_ids(py::handle obj, const char* name) {
  std::vector<int32_t> out;
  if (py::isinstance<py::array>(obj)) {
    py::array arr = py::reinterpret_borrow<py::array>(obj);
    if (arr.ndim() != 1) throw py::value_error(std::string(name) + " must be one-dimensional");
    if (arr.size() == 0) return out;
    const char kind = arr.dtype().kind();
    if (kind != 'i' && kind != 'u') throw py::type_error(std::string(name) + " must hold integer token ids");
    auto a = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(obj);
    if (!a) throw py::type_error(std::string(name) + " must hold integer token ids");
    out.resize(static_cast<size_t>(a.size()));
    const int64_t* p = a.data();
    for (size_t i = 0; i < out.size(); ++i) {
      if (p[i] < 0) throw py::value_error(std::string(name) + " contains a negative token id " + std::to_string(p[i]));
      out[i] = p[i] > INT32_MAX ? INT32_MAX : static_cast<int32_t>(p[i]);
    }
    return out;
  }
  PyObject* seq = PySequence_Fast(obj.ptr(), "token ids must be a sequence of ints");
  if (!seq) throw py::error_already_set();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* it = items[i];
    if (!PyLong_Check(it) || PyBool_Check(it)) {
      Py_DECREF(seq);
      throw py::type_error(std::string(name) + " must hold ints (got " + Py_TYPE(it)->tp_name + ")");
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(it, &overflow);
    if (overflow < 0 || (overflow == 0 && v < 0)) {
      Py_DECREF(seq);
      throw py::value_error(std::string(name) + " contains a negative token id");
    }
    out[static_cast<size_t>(i)] = (overflow > 0 || v > INT32_MAX) ? INT32_MAX : static_cast<int32_t>(v);
  }
  Py_DECREF(seq);
  return out;
}

class PyTrie {
 public:
  PyTrie(int order, uint64_t vocab_size, std::string fingerprint)
      : order_(order), vocab_(vocab_size), fp_(std::move(fingerprint)) {
    if (order < 1 || order > kMaxOrder) throw py::value_error("order must be in 1.." + std::to_string(kMaxOrder));
    if (vocab_size >= (1ull << 31)) throw py::value_error("vocab_size must be < 2**31");
    check_fp(fp_);
    view_ = empty_trie(order, vocab_size, fp_);
  }
  explicit PyTrie(std::shared_ptr<TrieView> v)
      : order_(v->order()), vocab_(v->vocab_size()), fp_(v->fingerprint()), view_(std::move(v)) {}

  static void check_fp(const std::string& fp) {
    if (fp.size() > kFingerprintMax)
      throw py::value_error("tokenizer fingerprint longer than " + std::to_string(kFingerprintMax) + " bytes");
  }

  void add_tokens(py::handle tokens) {
    std::vector<int32_t> ids = to_ids(tokens, "token_ids");
    for (int32_t t : ids)
      if (vocab_ && static_cast<uint64_t>(t) >= vocab_)
        throw py::value_error("token id " + std::to_string(t) + " is out of range for vocab_size " +
                              std::to_string(vocab_));
    if (!pending_) {
      CounterOptions o;
      o.order = order_;
      o.vocab_size = vocab_;
      pending_ = std::make_unique<SliceCounter>(o);
    }
    pending_->add_doc(ids.data(), ids.size());
    dirty_ = true;
  }

  // State (view_, pending_) only changes with the GIL held, so the GIL is its lock; queries take a
  // snapshot of the immutable view and then release the GIL.
  // Folds pending documents into the frozen image.
  void freeze() {
    if (!dirty_) return;
    auto fresh = view_of(pending_->build("", fp_));
    pending_.reset();
    if (view_->num_nodes() == 1 && view_->root_count() == 0) {
      view_ = fresh;
    } else {
      view_ = view_of(merge_tries(*view_, *fresh, "", "", fp_));
    }
    dirty_ = false;
  }
  std::shared_ptr<TrieView> frozen() {
    freeze();
    return view_;
  }

  py::tuple probability(py::handle context, py::handle tokens) {
    std::vector<int32_t> ctx = to_ids(context, "context");
    std::vector<int32_t> tok = to_ids(tokens, "tokens");
    if (dirty_) freeze();
    const size_t n = tok.size();
    // The common call (a drafter's top-k) fits on the stack; the lists are filled through the C API
    // (this path is mostly Python object overhead, the query itself is ~1 µs).
    float p_small[64];
    int32_t m_small[64];
    std::vector<float> p_big;
    std::vector<int32_t> m_big;
    float* probs = p_small;
    int32_t* matched = m_small;
    if (n > 64) {
      p_big.resize(n);
      m_big.resize(n);
      probs = p_big.data();
      matched = m_big.data();
    }
    if (!view_->probability_checked(ctx.data(), ctx.size(), tok.data(), n, probs, matched))
      throw FormatError("corrupt trie data met while answering a query (load with verify=True to check)");
    py::list p(n), m(n);
    for (size_t i = 0; i < n; ++i) {
      PyObject* f = PyFloat_FromDouble(static_cast<double>(probs[i]));
      PyObject* k = PyLong_FromLong(matched[i]);
      if (!f || !k) {
        Py_XDECREF(f);
        Py_XDECREF(k);
        throw py::error_already_set();
      }
      PyList_SET_ITEM(p.ptr(), static_cast<Py_ssize_t>(i), f);  // steals the references
      PyList_SET_ITEM(m.ptr(), static_cast<Py_ssize_t>(i), k);
    }
    return py::make_tuple(std::move(p), std::move(m));
  }

  py::tuple probability_batch(py::handle contexts, py::handle tokens) {
    py::sequence cs = py::reinterpret_borrow<py::sequence>(contexts);
    py::sequence ts = py::reinterpret_borrow<py::sequence>(tokens);
    if (!PySequence_Check(contexts.ptr()) || !PySequence_Check(tokens.ptr()))
      throw py::type_error("contexts and tokens must be sequences of sequences");
    const size_t B = py::len(cs);
    if (py::len(ts) != B) throw py::value_error("contexts and tokens must have the same length");
    std::vector<std::vector<int32_t>> C(B), T(B);
    for (size_t b = 0; b < B; ++b) {
      C[b] = to_ids(cs[b], "contexts[i]");
      T[b] = to_ids(ts[b], "tokens[i]");
    }
    auto v = frozen();
    // Flat buffers for the batched query: only the last order - 1 context tokens are read, and
    // rows are batched in runs with the same number of candidates.
    const size_t W = static_cast<size_t>(v->order()) - 1 > 0 ? static_cast<size_t>(v->order()) - 1 : 1;
    std::vector<int32_t> ctx(B * W), lens(B);
    std::vector<size_t> start(B + 1, 0);
    for (size_t b = 0; b < B; ++b) {
      const size_t len = std::min(W, C[b].size());
      std::copy(C[b].end() - static_cast<std::ptrdiff_t>(len), C[b].end(), ctx.begin() + static_cast<std::ptrdiff_t>(b * W));
      lens[b] = static_cast<int32_t>(len);
      start[b + 1] = start[b] + T[b].size();
    }
    std::vector<int32_t> tok(start[B]);
    for (size_t b = 0; b < B; ++b) std::copy(T[b].begin(), T[b].end(), tok.begin() + static_cast<std::ptrdiff_t>(start[b]));
    std::vector<float> P(start[B]);
    std::vector<int32_t> M(start[B]);
    bool ok = true;
    {
      py::gil_scoped_release nogil;
      for (size_t b = 0; b < B;) {
        size_t e = b + 1;
        while (e < B && T[e].size() == T[b].size()) ++e;
        const size_t K = T[b].size();
        ok &= v->probability_batch_checked(ctx.data() + b * W, W, lens.data() + b, e - b, tok.data() + start[b], K, K,
                                           P.data() + start[b], M.data() + start[b]);
        b = e;
      }
    }
    if (!ok) throw FormatError("corrupt trie data met while answering a query (load with verify=True to check)");
    py::list outp(B), outm(B);
    for (size_t b = 0; b < B; ++b) {
      const size_t K = T[b].size();
      py::list p(K), m(K);
      for (size_t i = 0; i < K; ++i) {
        p[i] = py::float_(static_cast<double>(P[start[b] + i]));
        m[i] = py::int_(M[start[b] + i]);
      }
      outp[b] = p;
      outm[b] = m;
    }
    return py::make_tuple(outp, outm);
  }

  // contexts [B, C] (row b uses its first lengths[b] entries; all C when lengths is None),
  // tokens [B, K] -> (float32 [B, K], int32 [B, K]).
  py::tuple probability_array(py::array_t<int32_t, py::array::c_style | py::array::forcecast> contexts,
                              py::object lengths_obj,
                              py::array_t<int32_t, py::array::c_style | py::array::forcecast> tokens) {
    if (contexts.ndim() != 2 || tokens.ndim() != 2) throw py::value_error("contexts and tokens must be 2-D arrays");
    const size_t B = static_cast<size_t>(contexts.shape(0)), Cw = static_cast<size_t>(contexts.shape(1));
    const size_t K = static_cast<size_t>(tokens.shape(1));
    if (static_cast<size_t>(tokens.shape(0)) != B) throw py::value_error("contexts and tokens need the same rows");
    std::vector<int64_t> lens(B, static_cast<int64_t>(Cw));
    if (!lengths_obj.is_none()) {
      auto l = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(lengths_obj);
      if (!l || l.ndim() != 1 || static_cast<size_t>(l.size()) != B)
        throw py::value_error("context_lengths must be a 1-D array with one entry per row");
      for (size_t b = 0; b < B; ++b) {
        if (l.data()[b] < 0 || static_cast<size_t>(l.data()[b]) > Cw)
          throw py::value_error("context_lengths out of range");
        lens[b] = l.data()[b];
      }
    }
    if (Cw > static_cast<size_t>(INT32_MAX)) throw py::value_error("contexts are too wide (more than 2**31 - 1 columns)");
    std::vector<int32_t> lens32(lens.begin(), lens.end());
    const int32_t* cp = contexts.data();
    const int32_t* tp = tokens.data();
    for (size_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < lens[b]; ++j)
        if (cp[b * Cw + static_cast<size_t>(j)] < 0) throw py::value_error("contexts contain a negative token id");
    for (size_t i = 0; i < B * K; ++i)
      if (tp[i] < 0) throw py::value_error("tokens contain a negative token id");
    auto v = frozen();
    py::array_t<float> probs({B, K});
    py::array_t<int32_t> matched({B, K});
    float* pp = probs.mutable_data();
    int32_t* mp = matched.mutable_data();
    bool ok = true;
    {
      py::gil_scoped_release nogil;
      // Large batches are split over threads (queries are independent and read-only).
      const size_t hw = std::max(1u, std::thread::hardware_concurrency());
      const size_t n_threads = B >= 2048 ? std::min<size_t>(hw, 8) : 1;
      std::vector<char> part_ok(n_threads, 1);
      auto work = [&](size_t t) {
        const size_t lo = B * t / n_threads, hi = B * (t + 1) / n_threads;
        if (!v->probability_batch_checked(cp + lo * Cw, Cw, lens32.data() + lo, hi - lo, tp + lo * K, K, K, pp + lo * K,
                                          mp + lo * K))
          part_ok[t] = 0;
      };
      std::vector<std::thread> pool;
      for (size_t t = 1; t < n_threads; ++t) pool.emplace_back(work, t);
      work(0);
      for (auto& th : pool) th.join();
      for (char c : part_ok) ok = ok && c;
    }
    if (!ok) throw FormatError("corrupt trie data met while answering a query (load with verify=True to check)");
    return py::make_tuple(probs, matched);
  }

  // Nanoseconds per probability() call over `repeats` passes of the given queries, measured in C++
  // with no Python in the loop (what the tree search pays per lookup): (wall, thread CPU time).
  // CPU time is what to compare on a shared, oversubscribed machine.
  // batched=True: the same queries through one probability_batch call per pass (one thread).
  py::tuple bench_queries(py::array_t<int32_t, py::array::c_style | py::array::forcecast> contexts,
                          py::array_t<int32_t, py::array::c_style | py::array::forcecast> tokens, int repeats,
                          bool batched) {
    if (contexts.ndim() != 2 || tokens.ndim() != 2 || contexts.shape(0) != tokens.shape(0))
      throw py::value_error("contexts [B, C] and tokens [B, K] expected");
    auto v = frozen();
    const size_t B = static_cast<size_t>(contexts.shape(0)), Cw = static_cast<size_t>(contexts.shape(1));
    const size_t K = static_cast<size_t>(tokens.shape(1));
    if (Cw > static_cast<size_t>(INT32_MAX)) throw py::value_error("contexts are too wide");
    std::vector<float> p(batched ? B * K : K);
    std::vector<int32_t> m(p.size());
    const std::vector<int32_t> lens(B, static_cast<int32_t>(Cw));
    const int32_t* cp = contexts.data();
    const int32_t* tp = tokens.data();
    auto cpu_now = [] {
      timespec ts{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
      return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
    };
    double wall_ns, cpu_ns;
    {
      py::gil_scoped_release nogil;
      const double c0 = cpu_now();
      auto t0 = std::chrono::steady_clock::now();
      volatile float sink = 0;
      for (int r = 0; r < repeats; ++r) {
        if (batched) {
          v->probability_batch(cp, Cw, lens.data(), B, tp, K, K, p.data(), m.data());
          sink = sink + p[0];
          continue;
        }
        for (size_t b = 0; b < B; ++b) {
          v->probability(cp + b * Cw, Cw, tp + b * K, K, p.data(), m.data());
          sink = sink + p[0];
        }
      }
      auto t1 = std::chrono::steady_clock::now();
      wall_ns = std::chrono::duration<double, std::nano>(t1 - t0).count();
      cpu_ns = cpu_now() - c0;
    }
    const double calls = static_cast<double>(B) * repeats;
    return py::make_tuple(wall_ns / calls, cpu_ns / calls);
  }

  void merge(PyTrie& other) {
    if (&other == this) {
      auto v = frozen();
      view_ = view_of(merge_tries(*v, *v, "", "", fp_));
      return;
    }
    auto b = other.frozen();
    auto a = frozen();
    if (a->order() != b->order())
      throw py::value_error("cannot merge tries of different order (" + std::to_string(a->order()) + " vs " +
                            std::to_string(b->order()) + ")");
    view_ = view_of(merge_tries(*a, *b, "", "", fp_));
    vocab_ = std::max(vocab_, view_->vocab_size());
  }

  std::unique_ptr<PyTrie> prune(uint64_t min_count, const std::string& out_path, const std::string& spill_dir) {
    auto v = frozen();
    std::shared_ptr<Image> img;
    {
      py::gil_scoped_release nogil;
      img = prune_trie(*v, min_count, out_path, spill_dir);
    }
    if (!img) img = Image::map_file(out_path);
    return std::make_unique<PyTrie>(
        std::make_shared<TrieView>(img, Check::kTrusted, out_path.empty() ? "pruned trie" : "'" + out_path + "'"));
  }

  void save(const std::string& path) {
    auto v = frozen();
    py::gil_scoped_release nogil;
    save_compact(*v, path, fp_);
  }
  void save_dart_file(const std::string& path) {
    auto v = frozen();
    py::gil_scoped_release nogil;
    ngb::save_dart(*v, path);
  }
  static std::unique_ptr<PyTrie> load(const std::string& path, bool verify, bool in_memory) {
    std::shared_ptr<TrieView> v;
    {
      py::gil_scoped_release nogil;
      v = std::make_shared<TrieView>(Image::map_file(path, in_memory), verify ? Check::kFull : Check::kStructure,
                                     "'" + path + "'");
      if (in_memory) v->build_candidate_index();
    }
    return std::make_unique<PyTrie>(v);
  }
  static std::unique_ptr<PyTrie> load_dart_file(const std::string& path, uint64_t vocab_size, const std::string& fp) {
    check_fp(fp);
    std::shared_ptr<TrieView> v;
    {
      py::gil_scoped_release nogil;
      // The parser checks the original format's structure but not its counts: the same pass as a
      // compact load then refuses a count above its parent's.
      v = std::make_shared<TrieView>(ngb::load_dart(path, vocab_size, fp), Check::kStructure, "'" + path + "'");
    }
    return std::make_unique<PyTrie>(v);
  }
  void verify() {
    auto v = frozen();
    py::gil_scoped_release nogil;
    TrieView(v->image(), Check::kFull, "trie");
  }

  py::list top_continuations(py::handle context, size_t k) {
    std::vector<int32_t> ctx = to_ids(context, "context");
    auto v = frozen();
    if (ctx.size() >= static_cast<size_t>(v->order()))
      throw py::value_error("context must be shorter than the order (" + std::to_string(v->order()) + ")");
    uint64_t node = 0;
    bool ok = true;
    py::list out;
    if (!v->find_path(ctx.data(), ctx.size(), node, ok)) return out;
    const int lvl = static_cast<int>(ctx.size());
    const uint64_t total = lvl == 0 ? v->root_count() : v->count(lvl, node);
    uint64_t s, e;
    v->children(lvl, node, s, e);
    std::vector<std::pair<uint64_t, uint32_t>> kids;
    for (uint64_t c = s; c < e; ++c) kids.emplace_back(v->count(lvl + 1, c), v->token(lvl + 1, c));
    const size_t take = std::min(k, kids.size());
    std::partial_sort(kids.begin(), kids.begin() + static_cast<std::ptrdiff_t>(take), kids.end(),
                      [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
    for (size_t i = 0; i < take; ++i)
      out.append(py::make_tuple(kids[i].second, kids[i].first,
                                total ? static_cast<double>(kids[i].first) / static_cast<double>(total) : 0.0));
    return out;
  }

  py::object capsule() {
    auto v = frozen();
    auto* holder = new std::shared_ptr<TrieView>(v);
    const dart::NgramQuery* q = holder->get();
    PyObject* cap = PyCapsule_New(const_cast<dart::NgramQuery*>(q), DART_NGRAM_QUERY_CAPSULE, [](PyObject* c) {
      delete static_cast<std::shared_ptr<TrieView>*>(PyCapsule_GetContext(c));
    });
    if (!cap) {
      delete holder;
      throw py::error_already_set();
    }
    if (PyCapsule_SetContext(cap, holder) != 0) {
      Py_DECREF(cap);
      delete holder;
      throw py::error_already_set();
    }
    return py::reinterpret_steal<py::object>(cap);
  }

  py::dict info() {
    auto v = frozen();
    const Header& h = v->header();
    py::dict d;
    d["format_version"] = h.version;
    d["order"] = h.order;
    d["vocab_size"] = h.vocab_size;
    d["token_bytes"] = h.token_bytes;
    d["num_nodes"] = h.num_nodes;
    d["root_count"] = h.root_count;
    d["file_bytes"] = h.file_size;
    d["ram_bytes"] = v->ram_bytes();
    d["tokenizer_fingerprint"] = fp_;
    d["memory_mapped"] = v->image()->mapped();
    d["candidate_index_bytes"] = v->candidate_index_bytes();
    py::list levels;
    for (int k = 1; k <= v->order(); ++k) {
      py::dict L;
      L["nodes"] = v->level(k).n;
      L["count_bytes"] = v->level(k).count_bytes;
      L["escaped_counts"] = v->level(k).n_esc;
      L["child_offset_bytes"] = k < v->order() ? v->level(k).child_bytes : 0;
      levels.append(L);
    }
    d["levels"] = levels;
    return d;
  }

  int order() const { return order_; }
  uint64_t num_nodes() { return frozen()->num_nodes(); }
  uint64_t vocab_size() { return frozen()->vocab_size(); }
  uint64_t image_bytes() { return frozen()->image()->size(); }
  uint64_t ram_bytes() { return frozen()->ram_bytes(); }
  const std::string& fingerprint() const { return fp_; }
  void set_fingerprint(const std::string& fp) {
    check_fp(fp);
    fp_ = fp;
  }

 private:
  int order_;
  uint64_t vocab_;
  std::string fp_;
  std::shared_ptr<TrieView> view_;
  std::unique_ptr<SliceCounter> pending_;
  bool dirty_ = false;
};

class PyCounter {
 public:
  PyCounter(int order, uint64_t vocab_size, uint64_t memory_cap, const std::string& spill_dir, int threads) {
    CounterOptions o;
    o.order = order;
    o.vocab_size = vocab_size;
    o.memory_cap = memory_cap;
    o.spill_dir = spill_dir;
    o.threads = threads;
    c_ = std::make_unique<SliceCounter>(o);
  }
  void add_tokens(py::handle tokens) {
    std::vector<int32_t> ids = to_ids(tokens, "token_ids");
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);  // taken without the GIL: no lock-order inversion
    c_->add_doc(ids.data(), ids.size());
  }
  // Many documents at once: flat int32 ids + int64 offsets (n_docs + 1). GIL released.
  void add_flat(py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids,
                py::array_t<int64_t, py::array::c_style | py::array::forcecast> offsets) {
    if (ids.ndim() != 1 || offsets.ndim() != 1 || offsets.size() < 1)
      throw py::value_error("ids must be 1-D and offsets 1-D with n_docs + 1 entries");
    const int64_t* o = offsets.data();
    const int64_t n = static_cast<int64_t>(ids.size());
    if (o[0] != 0 || o[offsets.size() - 1] != n) throw py::value_error("offsets must start at 0 and end at len(ids)");
    for (py::ssize_t i = 1; i < offsets.size(); ++i)
      if (o[i] < o[i - 1]) throw py::value_error("offsets must be non-decreasing");
    const int32_t* p = ids.data();
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    for (py::ssize_t i = 0; i + 1 < offsets.size(); ++i)
      c_->add_doc(p + o[i], static_cast<size_t>(o[i + 1] - o[i]));
  }
  py::object build(const std::string& out_path, const std::string& fingerprint) {
    PyTrie::check_fp(fingerprint);
    std::shared_ptr<Image> img;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mu_);
      img = c_->build(out_path, fingerprint);
    }
    if (!img) return py::none();
    return py::cast(std::make_unique<PyTrie>(view_of(img)));
  }
  uint64_t tokens() const { return c_->tokens(); }
  uint64_t docs() const { return c_->docs(); }
  uint64_t max_token_id() const { return c_->max_token_limit(); }

 private:
  std::unique_ptr<SliceCounter> c_;
  std::mutex mu_;
};

}  // namespace

// The memory system a query runs on, measured like the benchmark's queries are: random 64-byte
// lines of a buffer of `mb` MiB (larger than the caches, as the tries are). Returns (ns per
// dependent read: a pointer chase, the latency one query step waits for; ns per independent read:
// as many in flight as the core allows, like a query's candidates, the throughput bound). The GIL
// is released.
static py::tuple bench_memory(double mb, uint64_t reads) {
  if (!(mb >= 1 && mb <= 4096)) throw py::value_error("mb must be in [1, 4096]");
  if (reads == 0 || reads > 100000000) throw py::value_error("reads must be in [1, 100000000]");
  const size_t lines = static_cast<size_t>(mb * 1024 * 1024 / 64);
  std::vector<uint64_t> buf(lines * 8);
  double dep_ns, ind_ns;
  uint64_t sink = 0;
  {
    py::gil_scoped_release nogil;
    // One random cycle through all lines (Sattolo's shuffle), so the chase cannot be predicted.
    std::vector<uint32_t> order(lines);
    for (size_t i = 0; i < lines; ++i) order[i] = static_cast<uint32_t>(i);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    auto next = [&x] {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      return x;
    };
    for (size_t i = lines - 1; i > 0; --i) std::swap(order[i], order[next() % i]);
    for (size_t i = 0; i < lines; ++i) buf[static_cast<size_t>(order[i]) * 8] = static_cast<uint64_t>(order[(i + 1) % lines]) * 8;
    uint64_t p = static_cast<uint64_t>(order[0]) * 8;
    auto t0 = std::chrono::steady_clock::now();
    for (uint64_t r = 0; r < reads; ++r) p = buf[p];
    dep_ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / reads;
    sink += p;
    std::vector<uint64_t> at(reads);
    for (auto& a : at) a = (next() % lines) * 8;
    t0 = std::chrono::steady_clock::now();
    for (uint64_t r = 0; r < reads; ++r) sink += buf[at[r]];
    ind_ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / reads;
  }
  volatile uint64_t keep = sink;  // the reads have a use: not optimized away
  (void)keep;
  return py::make_tuple(dep_ns, ind_ns);
}

PYBIND11_MODULE(_core, m) {
  m.doc() = "C++ core of ngram_builder: n-gram trie build, prune, merge, formats and queries";
  static py::exception<FormatError> format_error(m, "NgramFormatError", PyExc_ValueError);
  // A payload failing the load-time checks; the message is what and where, without the file
  // (ngram_builder.trie turns it into CorruptTrieError naming the file).
  static py::exception<CorruptError> corrupt_error(m, "CorruptTrieData", format_error.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CorruptError& e) {
      py::set_error(corrupt_error, e.what());
    } catch (const FormatError& e) {
      py::set_error(format_error, e.what());
    } catch (const IoError& e) {
      py::set_error(PyExc_OSError, e.what());
    }
  });
  m.def("bench_memory", &bench_memory, py::arg("mb") = 256.0, py::arg("reads") = 2000000);
  m.attr("FORMAT_VERSION") = kVersion;
  m.attr("MAX_ORDER") = kMaxOrder;
  m.attr("FINGERPRINT_MAX_BYTES") = kFingerprintMax;
  m.attr("CAPSULE_NAME") = DART_NGRAM_QUERY_CAPSULE;

  py::class_<PyTrie>(m, "Trie")
      .def(py::init<int, uint64_t, std::string>(), py::arg("order") = 3, py::arg("vocab_size") = 0,
           py::arg("fingerprint") = "")
      .def("add_tokens", &PyTrie::add_tokens)
      .def("probability", &PyTrie::probability)
      .def("probability_batch", &PyTrie::probability_batch)
      .def("probability_array", &PyTrie::probability_array)
      .def("bench_queries", &PyTrie::bench_queries, py::arg("contexts"), py::arg("tokens"), py::arg("repeats"),
           py::arg("batched") = false)
      .def("merge", &PyTrie::merge)
      .def("prune", &PyTrie::prune, py::arg("min_count"), py::arg("out_path") = "", py::arg("spill_dir") = "")
      .def("save", &PyTrie::save)
      .def("save_dart", &PyTrie::save_dart_file)
      .def_static("load", &PyTrie::load, py::arg("path"), py::arg("verify") = false,
                  py::arg("in_memory") = false)
      .def_static("load_dart", &PyTrie::load_dart_file, py::arg("path"), py::arg("vocab_size") = 0,
                  py::arg("fingerprint") = "")
      .def("verify", &PyTrie::verify)
      .def("top_continuations", &PyTrie::top_continuations)
      .def("ngram_query_capsule", &PyTrie::capsule)
      .def("info", &PyTrie::info)
      .def_property_readonly("order", &PyTrie::order)
      .def_property_readonly("num_nodes", &PyTrie::num_nodes)
      .def_property_readonly("vocab_size", &PyTrie::vocab_size)
      .def_property_readonly("image_bytes", &PyTrie::image_bytes)
      .def_property_readonly("ram_bytes", &PyTrie::ram_bytes)
      .def_property("fingerprint", &PyTrie::fingerprint, &PyTrie::set_fingerprint);

  // Consumer side of the capsule, as the tree search uses it (for tests of the capsule contract).
  m.def("query_capsule", [](py::capsule cap, py::handle context, py::handle tokens) {
    if (std::string(cap.name() ? cap.name() : "") != DART_NGRAM_QUERY_CAPSULE)
      throw py::value_error("not a " DART_NGRAM_QUERY_CAPSULE " capsule");
    const auto* q = static_cast<const dart::NgramQuery*>(cap.get_pointer());
    std::vector<int32_t> ctx = to_ids(context, "context"), tok = to_ids(tokens, "tokens");
    std::vector<float> p(tok.size());
    std::vector<int32_t> mt(tok.size());
    {
      py::gil_scoped_release nogil;
      q->probability(ctx.data(), ctx.size(), tok.data(), tok.size(), p.data(), mt.data());
    }
    return py::make_tuple(std::vector<double>(p.begin(), p.end()), mt, q->order());
  });

  // The batched consumer call of the tree search: every context with the same candidates.
  m.def("query_capsule_batch", [](py::capsule cap, py::handle contexts, py::handle tokens) {
    if (std::string(cap.name() ? cap.name() : "") != DART_NGRAM_QUERY_CAPSULE)
      throw py::value_error("not a " DART_NGRAM_QUERY_CAPSULE " capsule");
    const auto* q = static_cast<const dart::NgramQuery*>(cap.get_pointer());
    py::sequence cs = py::reinterpret_borrow<py::sequence>(contexts);
    std::vector<std::vector<int32_t>> ctx;
    size_t width = 1;
    for (size_t r = 0; r < py::len(cs); ++r) {
      ctx.push_back(to_ids(cs[r], "contexts[i]"));
      width = std::max(width, ctx.back().size());
    }
    std::vector<int32_t> tok = to_ids(tokens, "tokens"), flat(ctx.size() * width), lens(ctx.size());
    for (size_t r = 0; r < ctx.size(); ++r) {
      std::copy(ctx[r].begin(), ctx[r].end(), flat.begin() + static_cast<std::ptrdiff_t>(r * width));
      lens[r] = static_cast<int32_t>(ctx[r].size());
    }
    std::vector<float> p(ctx.size() * tok.size());
    std::vector<int32_t> mt(p.size());
    {
      py::gil_scoped_release nogil;
      q->probability_batch(flat.data(), width, lens.data(), ctx.size(), tok.data(), 0, tok.size(), p.data(), mt.data());
    }
    return py::make_tuple(std::vector<double>(p.begin(), p.end()), mt);
  });

  py::class_<PyCounter>(m, "SliceCounter")
      .def(py::init<int, uint64_t, uint64_t, const std::string&, int>(), py::arg("order") = 3,
           py::arg("vocab_size") = 0, py::arg("memory_cap") = 0, py::arg("spill_dir") = "", py::arg("threads") = 1)
      .def("add_tokens", &PyCounter::add_tokens)
      .def("add_flat", &PyCounter::add_flat)
      .def("build", &PyCounter::build, py::arg("out_path") = "", py::arg("fingerprint") = "")
      .def_property_readonly("tokens", &PyCounter::tokens)
      .def_property_readonly("docs", &PyCounter::docs)
      .def_property_readonly("max_token_id", &PyCounter::max_token_id);
}
