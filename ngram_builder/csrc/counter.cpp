// Slice counting: packed keys, sorted runs (in RAM or spilled), k-way merge into the builder.
#include "counter.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <future>
#include <deque>
#include <mutex>
#include <queue>
#include <unistd.h>

namespace ngb {

namespace {
using u128 = unsigned __int128;

int bits_for(uint64_t values) {  // bits needed to hold 0..values-1
  int b = 1;
  while (b < 64 && (1ull << b) < values) ++b;
  return b;
}

std::string temp_dir_default() {
  const char* t = std::getenv("TMPDIR");
  return t && *t ? t : "/tmp";
}

// Sorts a key vector in place: LSD radix sort on 16-bit digits over the used bits.
template <class K>
void radix_sort(std::vector<K>& a, int key_bits) {
  if (a.size() < 4096) {
    std::sort(a.begin(), a.end());
    return;
  }
  std::vector<K> tmp(a.size());
  const int passes = (key_bits + 15) / 16;
  std::vector<uint64_t> hist(65536);
  K* src = a.data();
  K* dst = tmp.data();
  const size_t n = a.size();
  for (int p = 0; p < passes; ++p) {
    const int shift = 16 * p;
    std::fill(hist.begin(), hist.end(), 0);
    for (size_t i = 0; i < n; ++i) ++hist[static_cast<uint64_t>(src[i] >> shift) & 0xFFFF];
    if (hist[static_cast<uint64_t>(src[0] >> shift) & 0xFFFF] == n) continue;  // digit constant
    uint64_t sum = 0;
    for (auto& h : hist) {
      uint64_t c = h;
      h = sum;
      sum += c;
    }
    for (size_t i = 0; i < n; ++i) dst[hist[static_cast<uint64_t>(src[i] >> shift) & 0xFFFF]++] = src[i];
    std::swap(src, dst);
  }
  if (src != a.data()) std::copy(src, src + n, a.data());
}
}  // namespace

struct SliceCounter::Impl {
  virtual ~Impl() = default;
  virtual void add_doc(const int32_t* tokens, size_t n) = 0;
  virtual std::shared_ptr<Image> build(const std::string& out_path, const std::string& fingerprint) = 0;
  uint64_t n_tokens = 0, n_docs = 0, max_tok = 0;
};

namespace {

template <class K>
struct Run {
  std::vector<K> keys;
  std::vector<uint64_t> counts;
  FILE* f = nullptr;  // spilled: (key, count) pairs
  uint64_t n = 0;
  Run() = default;
  Run(const Run&) = delete;
  Run(Run&& o) noexcept : keys(std::move(o.keys)), counts(std::move(o.counts)), f(o.f), n(o.n) { o.f = nullptr; }
  Run& operator=(Run&& o) noexcept {
    if (this != &o) {
      if (f) std::fclose(f);
      keys = std::move(o.keys);
      counts = std::move(o.counts);
      f = o.f;
      n = o.n;
      o.f = nullptr;
    }
    return *this;
  }
  ~Run() {
    if (f) std::fclose(f);
  }
};

template <class K>
struct RunCursor {
  Run<K>* run = nullptr;
  uint64_t pos = 0;  // next record to deliver
  std::vector<K> bk;
  std::vector<uint64_t> bc;
  size_t bpos = 0, blen = 0;
  size_t buf_records = 4096;
  K key{};
  uint64_t count = 0;
  bool next() {
    if (pos >= run->n) return false;
    if (!run->f) {
      key = run->keys[pos];
      count = run->counts[pos];
    } else {
      if (bpos == blen) {
        size_t want = static_cast<size_t>(std::min<uint64_t>(buf_records, run->n - pos));
        bk.resize(want);
        bc.resize(want);
        for (size_t i = 0; i < want; ++i) {
          if (std::fread(&bk[i], sizeof(K), 1, run->f) != 1 || std::fread(&bc[i], 8, 1, run->f) != 1)
            throw IoError("reading a spilled run failed");
        }
        bpos = 0;
        blen = want;
      }
      key = bk[bpos];
      count = bc[bpos];
      ++bpos;
    }
    ++pos;
    return true;
  }
};

template <class K>
class CounterImpl : public SliceCounter::Impl {
 public:
  CounterImpl(const CounterOptions& opt, int bits) : opt_(opt), bits_(bits) {
    const int total = opt.order * bits;
    mask_ = total >= static_cast<int>(sizeof(K) * 8) ? ~K(0) : ((K(1) << total) - 1);
    key_bits_ = total;
    tok_mask_ = (uint64_t(1) << bits) - 1;
    max_tok = opt.vocab_size ? opt.vocab_size - 1 : tok_mask_ - 1;
    threads_ = std::max(1, opt.threads);
    spill_ = opt.memory_cap > 0;
    if (spill_) {
      if (opt_.spill_dir.empty()) opt_.spill_dir = temp_dir_default();
      // cur chunk + in-flight chunks, each needing 2x for the radix buffer.
      chunk_cap_ = std::max<uint64_t>(1 << 12, opt.memory_cap / (sizeof(K) * 2 * (threads_ + 1)));
    } else {
      chunk_cap_ = 1ull << 23;
    }
    cur_.reserve(static_cast<size_t>(std::min<uint64_t>(chunk_cap_, 1 << 20)));
  }
  ~CounterImpl() override {
    for (auto& f : inflight_) f.wait();
  }

  void add_doc(const int32_t* t, size_t n) override {
    for (size_t i = 0; i < n; ++i)
      if (t[i] < 0 || static_cast<uint64_t>(t[i]) > max_tok)
        throw std::invalid_argument("token id " + std::to_string(t[i]) + " at position " + std::to_string(i) +
                                    " is out of range [0, " + std::to_string(max_tok) + "]");
    const int order = opt_.order;
    K key = 0;
    for (int j = 0; j < order; ++j) key = (key << bits_) | (static_cast<size_t>(j) < n ? K(t[j]) + 1 : K(0));
    for (size_t s = 0; s < n; ++s) {
      cur_.push_back(key);
      if (cur_.size() >= chunk_cap_) submit();
      const size_t nxt = s + order;
      key = ((key << bits_) | (nxt < n ? K(t[nxt]) + 1 : K(0))) & mask_;
    }
    n_tokens += n;
    ++n_docs;
  }

  std::shared_ptr<Image> build(const std::string& out_path, const std::string& fingerprint) override {
    if (!cur_.empty()) submit();
    for (auto& f : inflight_) f.get();
    inflight_.clear();
    CsrBuilder b(opt_.order, opt_.vocab_size, spill_ ? opt_.spill_dir : std::string());
    uint32_t toks[kMaxOrder];
    std::deque<Run<K>> runs;
    runs.swap(runs_);
    merge_runs(runs, [&](K key, uint64_t c) {
      int m = 0;
      for (int l = 0; l < opt_.order; ++l) {
        uint64_t v = static_cast<uint64_t>(key >> (bits_ * (opt_.order - 1 - l))) & tok_mask_;
        if (!v) break;
        toks[m++] = static_cast<uint32_t>(v - 1);
      }
      b.add_slice(toks, m, c);
    });
    n_tokens = n_docs = 0;
    return b.finish(out_path, fingerprint);
  }

 private:
  // Spilled runs are open (unlinked) files; past this many they are merged into one, which keeps
  // file handles and merge fan-in bounded however small the memory cap.
  static constexpr size_t kMaxSpilledRuns = 64;

  // k-way merge of sorted runs, summing counts of equal keys; consumes the runs.
  template <class F>
  void merge_runs(std::deque<Run<K>>& runs, F&& emit) {
    std::vector<RunCursor<K>> cur(runs.size());
    const size_t buf_records =
        spill_ ? std::max<size_t>(256, opt_.memory_cap / (4 * (sizeof(K) + 8) * std::max<size_t>(1, runs.size())))
               : 4096;
    using Item = std::pair<K, size_t>;
    auto cmp = [](const Item& x, const Item& y) { return x.first > y.first; };
    std::priority_queue<Item, std::vector<Item>, decltype(cmp)> heap(cmp);
    for (size_t r = 0; r < runs.size(); ++r) {
      cur[r].run = &runs[r];
      cur[r].buf_records = buf_records;
      if (runs[r].f) std::rewind(runs[r].f);
      if (cur[r].next()) heap.push({cur[r].key, r});
    }
    while (!heap.empty()) {
      const K key = heap.top().first;
      uint64_t c = 0;
      while (!heap.empty() && heap.top().first == key) {
        size_t r = heap.top().second;
        heap.pop();
        c += cur[r].count;
        if (cur[r].next()) heap.push({cur[r].key, r});
      }
      emit(key, c);
    }
    runs.clear();
  }

  struct RunWriter {
    Run<K> run;
    std::vector<uint8_t> buf;
    explicit RunWriter(const std::string& dir) {
      std::string tmpl = dir + "/ngram-run-XXXXXX";
      std::vector<char> name(tmpl.begin(), tmpl.end());
      name.push_back('\0');
      int fd = mkstemp(name.data());
      if (fd < 0) throw IoError("cannot create a run file in '" + dir + "': " + std::strerror(errno));
      run.f = fdopen(fd, "w+b");
      unlink(name.data());  // vanishes when closed, even after a crash
      if (!run.f) {
        ::close(fd);
        throw IoError("cannot open a run file in '" + dir + "'");
      }
      buf.reserve((sizeof(K) + 8) * 4096);
    }
    void push(K key, uint64_t count) {
      const uint8_t* kp = reinterpret_cast<const uint8_t*>(&key);
      const uint8_t* cp = reinterpret_cast<const uint8_t*>(&count);
      buf.insert(buf.end(), kp, kp + sizeof(K));
      buf.insert(buf.end(), cp, cp + 8);
      ++run.n;
      if (buf.size() >= (sizeof(K) + 8) * 4096) flush();
    }
    void flush() {
      if (!buf.empty() && std::fwrite(buf.data(), 1, buf.size(), run.f) != buf.size())
        throw IoError("writing a run file failed: " + std::string(std::strerror(errno)));
      buf.clear();
    }
    Run<K> finish() {
      flush();
      std::fflush(run.f);
      return std::move(run);
    }
  };

  void submit() {
    // Bound memory: wait for the oldest chunk when all workers are busy.
    while (inflight_.size() >= static_cast<size_t>(threads_)) {
      inflight_.front().get();
      inflight_.pop_front();
    }
    auto chunk = std::make_shared<std::vector<K>>(std::move(cur_));
    cur_ = std::vector<K>();
    cur_.reserve(static_cast<size_t>(std::min<uint64_t>(chunk_cap_, 1 << 20)));
    inflight_.push_back(std::async(std::launch::async, [this, chunk]() { sort_into_run(*chunk); }));
  }

  void sort_into_run(std::vector<K>& keys) {
    radix_sort(keys, key_bits_);
    Run<K> run;
    size_t w = 0;
    std::vector<uint64_t> counts;
    counts.reserve(keys.size() / 2);
    for (size_t i = 0; i < keys.size();) {
      size_t j = i + 1;
      while (j < keys.size() && keys[j] == keys[i]) ++j;
      keys[w++] = keys[i];
      counts.push_back(j - i);
      i = j;
    }
    keys.resize(w);
    if (spill_) {
      RunWriter wr(opt_.spill_dir);
      for (size_t i = 0; i < w; ++i) wr.push(keys[i], counts[i]);
      run = wr.finish();
    } else {
      keys.shrink_to_fit();
      counts.shrink_to_fit();
      run.keys = std::move(keys);
      run.counts = std::move(counts);
      run.n = w;
    }
    std::deque<Run<K>> to_merge;
    {
      std::lock_guard<std::mutex> g(runs_mu_);
      runs_.push_back(std::move(run));
      if (spill_ && runs_.size() >= kMaxSpilledRuns) to_merge.swap(runs_);
    }
    if (!to_merge.empty()) {
      RunWriter wr(opt_.spill_dir);
      merge_runs(to_merge, [&](K key, uint64_t c) { wr.push(key, c); });
      Run<K> merged = wr.finish();
      std::lock_guard<std::mutex> g(runs_mu_);
      runs_.push_back(std::move(merged));
    }
  }

  CounterOptions opt_;
  int bits_;
  int key_bits_;
  K mask_;
  uint64_t tok_mask_;
  int threads_;
  bool spill_;
  uint64_t chunk_cap_;
  std::vector<K> cur_;
  std::deque<std::future<void>> inflight_;
  std::mutex runs_mu_;
  std::deque<Run<K>> runs_;
};

}  // namespace

SliceCounter::SliceCounter(const CounterOptions& opt) {
  if (opt.order < 1 || opt.order > kMaxOrder)
    throw std::invalid_argument("order must be in 1.." + std::to_string(kMaxOrder));
  if (opt.vocab_size > (1ull << 31)) throw std::invalid_argument("vocab_size must be <= 2**31");
  // Token t is stored as t+1 (0 = "slice ended"), so `bits` must hold vocab_size + 1 values.
  int bits;
  if (opt.vocab_size) {
    bits = bits_for(opt.vocab_size + 1);
  } else {
    bits = opt.order * 21 <= 64 ? 21 : std::min(31, 128 / opt.order);  // unknown vocabulary
  }
  if (opt.order * bits <= 64) {
    impl_ = std::make_unique<CounterImpl<uint64_t>>(opt, bits);
  } else if (opt.order * bits <= 128) {
    impl_ = std::make_unique<CounterImpl<u128>>(opt, bits);
  } else {
    throw std::invalid_argument("order " + std::to_string(opt.order) + " with vocab_size " +
                                std::to_string(opt.vocab_size) + " does not fit the 128-bit slice key");
  }
}

SliceCounter::~SliceCounter() = default;

void SliceCounter::add_doc(const int32_t* tokens, size_t n) { impl_->add_doc(tokens, n); }
uint64_t SliceCounter::tokens() const { return impl_->n_tokens; }
uint64_t SliceCounter::docs() const { return impl_->n_docs; }
uint64_t SliceCounter::max_token_limit() const { return impl_->max_tok; }
std::shared_ptr<Image> SliceCounter::build(const std::string& out_path, const std::string& fingerprint) {
  return impl_->build(out_path, fingerprint);
}

}  // namespace ngb
