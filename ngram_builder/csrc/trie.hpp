// The frozen, queryable trie (a byte image in the compact format, in memory or memory-mapped),
// the streaming builder that produces such images, and the algorithms over them.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "dart/ngram_query.hpp"
#include "format.hpp"

namespace ngb {

// Zeroed anonymous memory starting on a 2 MB boundary and advised as transparent huge pages (a
// hint: plain pages where they are off). Random reads over more memory than the caches miss the
// TLB on nearly every access with 4 KB pages, and mostly do not with 2 MB pages.
class HugeBuffer {
 public:
  HugeBuffer() = default;
  explicit HugeBuffer(uint64_t bytes);  // throws IoError when the memory cannot be had
  ~HugeBuffer();
  HugeBuffer(HugeBuffer&& other) noexcept { *this = std::move(other); }
  HugeBuffer& operator=(HugeBuffer&& other) noexcept;
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  void make_read_only();  // a stray write then faults instead of corrupting the trie

 private:
  void* raw_ = nullptr;  // the whole reservation, released by munmap
  uint64_t raw_len_ = 0;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// Owns the bytes of one compact image: heap memory, a read-only mmap of a file, or a read-only
// copy of a file in huge pages.
class Image {
 public:
  static std::shared_ptr<Image> from_memory(std::vector<uint64_t>&& words, uint64_t size);
  // in_memory: read the file into a HugeBuffer instead of mapping it (faster queries over a large
  // trie, for a copy on load and private instead of page-cache memory).
  static std::shared_ptr<Image> map_file(const std::string& path, bool in_memory = false);
  ~Image();
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  bool mapped() const { return map_ != nullptr; }

 private:
  Image() = default;
  std::vector<uint64_t> words_;
  HugeBuffer copy_;
  void* map_ = nullptr;
  uint64_t map_len_ = 0;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

struct LevelView {
  uint64_t n = 0;
  const uint8_t* tokens = nullptr;
  const uint8_t* counts = nullptr;
  uint32_t count_bytes = 8;
  const uint64_t* esc_idx = nullptr;
  const uint64_t* esc_val = nullptr;
  uint64_t n_esc = 0;
  const uint8_t* child = nullptr;  // n + 1 entries (levels < order)
  uint32_t child_bytes = 4;
};

// Position of the first escape-table entry of a node >= `node` (binary search: the table is sorted
// by node). On a corrupt (unsorted) table any position: the structural check refuses such a table.
inline uint64_t first_escape(const LevelView& L, uint64_t node) {
  uint64_t lo = 0, hi = L.n_esc;
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    uint64_t x;
    std::memcpy(&x, L.esc_idx + mid, 8);
    if (x < node)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// How much of an image a TrieView checks when it is made. Header, section table, child-offset
// ends and level-1 tokens are always checked (O(vocabulary)).
enum class Check {
  kTrusted,    // nothing more: an image this process has just built
  kStructure,  // + one O(nodes) pass over the payload's invariants (check.cpp): every file load
  kFull,       // + the payload checksum and the level-2 hash (verify=True)
};

// Read-only view over an image. Every offset read from the payload is bounds-checked, so a corrupt
// (unchecked) image yields `ok == false`, never an out-of-bounds read.
class TrieView : public dart::NgramQuery {
 public:
  // Throws FormatError for a bad header or layout, CorruptError for a payload that fails `check`.
  TrieView(std::shared_ptr<Image> image, Check check, const std::string& what);

  int order() const override { return static_cast<int>(hdr_.order); }
  void probability(const int32_t* context, size_t context_len, const int32_t* tokens, size_t n,
                   float* probs, int32_t* matched) const override;
  // Same, returning false when corrupt data was met (results then must not be trusted).
  bool probability_checked(const int32_t* context, size_t context_len, const int32_t* tokens, size_t n,
                           float* probs, int32_t* matched) const;
  void probability_batch(const int32_t* contexts, size_t context_stride, const int32_t* context_lens, size_t rows,
                         const int32_t* tokens, size_t token_stride, size_t n, float* probs,
                         int32_t* matched) const override;
  // Same, returning false when corrupt data was met; the rows that met it are appended to
  // `bad_rows` (their results must not be trusted).
  bool probability_batch_checked(const int32_t* contexts, size_t context_stride, const int32_t* context_lens,
                                 size_t rows, const int32_t* tokens, size_t token_stride, size_t n, float* probs,
                                 int32_t* matched, std::vector<size_t>* bad_rows = nullptr) const;

  const Header& header() const { return hdr_; }
  uint64_t vocab_size() const { return hdr_.vocab_size; }
  uint64_t num_nodes() const { return hdr_.num_nodes; }
  uint64_t root_count() const { return hdr_.root_count; }
  std::string fingerprint() const { return std::string(hdr_.fingerprint, hdr_.fingerprint_len); }
  const LevelView& level(int k) const { return lv_[k]; }
  const std::shared_ptr<Image>& image() const { return image_; }
  uint64_t ram_bytes() const;  // image + query indexes
  // Builds the candidate index: for every 1-token context whose children are looked up through
  // the level-2 hash, a table of its own, in huge pages, whose slots hold (token, position in
  // the child run). A candidate then costs one slot line and its count line, instead of a slot
  // line, a token line and a count line of the shared hash (~10% faster queries on ShareGPT);
  // ~15% more memory, O(level-2 nodes) time. A no-op without the fast query path.
  void build_candidate_index();
  uint64_t candidate_index_bytes() const { return cand_slots_.size(); }

  // Accessors used by the tree walkers (merge, prune, export). Throw FormatError on corruption.
  uint32_t token(int k, uint64_t i) const;
  uint64_t count(int k, uint64_t i) const;
  // Children of node i on level k (k = 0: the root, i ignored) as a range of level k+1.
  void children(int k, uint64_t i, uint64_t& begin, uint64_t& end) const;
  // Node index on level len reached by `ctx[0..len)` from the root, or false.
  bool find_path(const int32_t* ctx, size_t len, uint64_t& node, bool& ok) const;
  bool find_child(int k, uint64_t i, int64_t tok, uint64_t& out, bool& ok) const;
  uint64_t count_checked(int k, uint64_t i, bool& ok) const;
  bool has_hash() const { return hash_slots_ > 0; }

 private:
  // O(nodes): tokens in vocabulary and sorted within each child run, child offsets monotone,
  // escape tables matching the escaped counts, no count above its parent's (check.cpp).
  void check_structure() const;
  void full_verify() const;  // payload checksum and level-2 hash
  // probability_checked for any shape (binary searches and find_path per context length).
  bool probability_generic(const int32_t* context, size_t context_len, const int32_t* tokens, size_t n,
                           float* probs, int32_t* matched) const;
  // The hot path (dense level-1 index and level-2 hash present). A query (one row, at most 64
  // candidates) is split into stages, each issuing the prefetches the next one needs; a batch
  // runs several queries' stages interleaved so that their cache misses overlap (trie_query.cpp).
  struct Query;
  struct Batch;
  struct Level1Cache;
  template <class TT>
  bool run_batch(const Batch& batch, std::vector<size_t>* bad_rows) const;
  template <class TT>
  bool run_one(const int32_t* ctx, size_t len, const int32_t* tokens, size_t n, float* probs, int32_t* matched) const;
  template <class TT>
  void stage_issue(Query& q) const;
  template <class TT>
  void stage_context(Query& q) const;
  template <class TT>
  void build_candidate_index_t();
  template <class TT>
  uint64_t cand_lookup(uint64_t table, uint64_t slot, uint32_t key) const;
  // Candidate-index slot `slot`: (token, position in the run), two TT each.
  template <class TT>
  const uint8_t* cand_entry(uint64_t slot) const { return cand_slots_.data() + slot * 2 * sizeof(TT); }
  void prefetch_candidates(uint64_t slot, uint64_t s, uint64_t e, bool with_children) const;
  template <class TT>
  void stage_children(Query& q) const;
  template <class TT>
  void stage_search(Query& q) const;
  void stage_finish(Query& q, Level1Cache& cache) const;
  // Level-2 child with token `tok` of the level-1 node whose token is `parent` and whose child
  // range is [s, e), via the table.
  uint64_t hash_find(uint32_t parent, uint32_t tok, uint64_t s, uint64_t e) const {
    return hash_probe(hash_slot(parent, tok, hash_slots_), tok, s, e);
  }
  // Probe sequence from slot `i` (the slot of (parent, tok)).
  uint64_t hash_probe(uint64_t i, uint32_t tok, uint64_t s, uint64_t e) const;
  // count_checked with the common case read inline (defined in trie_query.hpp, for the query files).
  inline uint64_t count_fast(int k, uint64_t i, bool& ok) const;
  uint64_t child_at(const LevelView& L, uint64_t i) const {
    if (L.child_bytes == 4) {
      uint32_t v;
      std::memcpy(&v, L.child + i * 4, 4);
      return v;
    }
    uint64_t v;
    std::memcpy(&v, L.child + i * 8, 8);
    return v;
  }
  uint32_t token_at(const LevelView& L, uint64_t i) const {
    if (hdr_.token_bytes == 2) {
      uint16_t v;
      std::memcpy(&v, L.tokens + i * 2, 2);
      return v;
    }
    uint32_t v;
    std::memcpy(&v, L.tokens + i * 4, 4);
    return v;
  }

  std::shared_ptr<Image> image_;
  Header hdr_{};
  std::vector<LevelView> lv_;    // index 1..order
  std::vector<uint32_t> dense1_;  // token -> level-1 index + 1 (0: absent)
  // What a query needs of a 1-token context, by token, in one cache line instead of three
  // dependent reads (built at load, O(vocabulary); only with a level-2 hash). Child range [s, e)
  // on level 2; s > e marks a corrupt node; inv = 1 / count as the query computes it.
  struct Unigram {
    uint32_t idx1 = 0;  // level-1 index + 1 (0: absent)
    uint32_t s = 0, e = 0;
    float inv = 0.0f;
  };
  std::vector<Unigram> uni_;
  // Candidate index: per token, the first slot of its table << 8 | log2(its slots) (0: not
  // indexed); the slots, each a pair of token-sized integers (token, position in the run).
  std::vector<uint64_t> cand_table_;
  HugeBuffer cand_slots_;
  const uint8_t* hash_ = nullptr;
  uint64_t hash_slots_ = 0;
  uint64_t hash_max_probe_ = 0;
};

// Append-only column; with a spill directory it keeps only a buffer in RAM and streams to a file.
template <class T>
class Column {
 public:
  Column() = default;
  void set_spill(const std::string& path);
  ~Column();
  Column(const Column&) = delete;
  Column& operator=(const Column&) = delete;
  Column(Column&&) noexcept;
  Column& operator=(Column&&) = delete;
  void push(T v) {
    buf_.push_back(v);
    ++size_;
    if (spill_ && buf_.size() >= kSpillChunk) flush();
  }
  uint64_t size() const { return size_; }
  // Random-access read of values [start, start + n) (after all pushes).
  void read_block(uint64_t start, size_t n, T* out);
  // Streams all values in order to fn(const T* p, size_t n).
  template <class F>
  void for_each_block(F&& fn);

 private:
  static constexpr size_t kSpillChunk = 1 << 16;
  void flush();
  std::vector<T> buf_;
  uint64_t size_ = 0;
  bool spill_ = false;
  std::string path_;
  FILE* f_ = nullptr;
};

// Builds an image from nodes given in pre-order with siblings in increasing token order, either
// as sorted slices (`add_slice`: counts accumulate along the path, as in counting) or as nodes
// with known counts (`add_node`, for merge/prune/conversion).
class CsrBuilder {
 public:
  // spill_dir empty: everything in RAM.
  CsrBuilder(int order, uint64_t vocab_size, const std::string& spill_dir);
  void add_slice(const uint32_t* toks, int m, uint64_t c);
  void add_node(int level, uint32_t tok, uint64_t c);
  void adjust_current(int level, int64_t delta);  // count of the open node on `level`
  void set_root_count(uint64_t c) { path_cnt_[0] = c; }
  void add_root_count(uint64_t c) { path_cnt_[0] += c; }
  uint64_t root_count() const { return path_cnt_[0]; }
  // Finishes and writes the image: to `path` (returns nullptr) or to memory (returns it).
  std::shared_ptr<Image> finish(const std::string& path, const std::string& fingerprint);
  uint64_t nodes() const;

 private:
  void open(int level, uint32_t tok);
  void close_from(int level);
  int order_;
  uint64_t vocab_;
  uint32_t max_tok_plus1_ = 0;
  std::vector<Column<uint32_t>> tok_;
  std::vector<Column<uint64_t>> cnt_;
  std::vector<Column<uint64_t>> child_;
  std::vector<uint64_t> n_;
  std::vector<uint64_t> ge_[3];  // per level: counts >= 0xFF, >= 0xFFFF, >= 0xFFFFFFFF
  // Sums of those counts (saturating is unnecessary: at most the corpus size times order).
  std::vector<uint64_t> mass_ge_[3];
  std::vector<uint64_t> mass_;
  int path_len_ = 0;
  uint32_t path_tok_[kMaxOrder + 1] = {};
  uint64_t path_cnt_[kMaxOrder + 1] = {};
  int64_t prev_sib_[kMaxOrder + 2] = {};
  bool finished_ = false;
};

std::shared_ptr<TrieView> empty_trie(int order, uint64_t vocab_size, const std::string& fingerprint);
std::shared_ptr<TrieView> view_of(std::shared_ptr<Image> img);  // trusted in-memory image
// Node-wise sum of counts over the union of both tries (the original's add_all).
std::shared_ptr<Image> merge_tries(const TrieView& a, const TrieView& b, const std::string& out_path,
                                   const std::string& spill_dir, const std::string& fingerprint);
// The original's reduce(threshold): keep children with count >= min_count; a kept node's count is
// reduced by the counts of the topmost pruned nodes below it.
std::shared_ptr<Image> prune_trie(const TrieView& t, uint64_t min_count, const std::string& out_path,
                                  const std::string& spill_dir);
// Writes the image bytes of `t` with a new fingerprint to `path` (via a temp file + rename).
void save_compact(const TrieView& t, const std::string& path, const std::string& fingerprint);
// The original DART `.trie` format.
std::shared_ptr<Image> load_dart(const std::string& path, uint64_t vocab_size, const std::string& fingerprint);
void save_dart(const TrieView& t, const std::string& path);

}  // namespace ngb
