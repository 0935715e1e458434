// Compact trie image: mapping, validation, queries, the streaming builder, merge and prune.
#include "trie.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ngb {

// ---------------------------------------------------------------------------------------------
// HugeBuffer, Image

HugeBuffer::HugeBuffer(uint64_t bytes) {
  constexpr uint64_t kHuge = 2ull << 20;
  size_ = bytes;
  if (bytes == 0) return;
  // One extra huge page of address space, so that the buffer can start on a 2 MB boundary.
  const uint64_t len = (bytes + kHuge - 1) / kHuge * kHuge;
  raw_len_ = len + kHuge;
  raw_ = mmap(nullptr, raw_len_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw_ == MAP_FAILED) {
    raw_ = nullptr;
    throw IoError("cannot allocate " + std::to_string(len >> 20) + " MB: " + std::strerror(errno));
  }
  data_ = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw_) + kHuge - 1) & ~(kHuge - 1));
#if defined(MADV_HUGEPAGE)
  madvise(data_, len, MADV_HUGEPAGE);
#endif
}

HugeBuffer::~HugeBuffer() {
  if (raw_) munmap(raw_, raw_len_);
}

HugeBuffer& HugeBuffer::operator=(HugeBuffer&& other) noexcept {
  if (this != &other) {
    if (raw_) munmap(raw_, raw_len_);
    raw_ = std::exchange(other.raw_, nullptr);
    raw_len_ = std::exchange(other.raw_len_, 0);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void HugeBuffer::make_read_only() {
  if (raw_) mprotect(data_, raw_len_ - (data_ - static_cast<uint8_t*>(raw_)), PROT_READ);
}

std::shared_ptr<Image> Image::from_memory(std::vector<uint64_t>&& words, uint64_t size) {
  std::shared_ptr<Image> img(new Image());
  img->words_ = std::move(words);
  img->data_ = reinterpret_cast<const uint8_t*>(img->words_.data());
  img->size_ = size;
  return img;
}

std::shared_ptr<Image> Image::map_file(const std::string& path, bool in_memory) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError("cannot open '" + path + "': " + std::strerror(errno));
  struct CloseOnExit {
    int fd;
    ~CloseOnExit() { ::close(fd); }  // a mapping outlives its descriptor
  } closer{fd};
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) throw IoError("'" + path + "' is not a regular file");
  uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < kHeaderBytes)
    throw FormatError("'" + path + "' is too small to be a compact n-gram trie (" + std::to_string(size) +
                      " bytes)");
  std::shared_ptr<Image> img(new Image());
  img->size_ = size;
  if (!in_memory) {
    void* p = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) throw IoError("cannot map '" + path + "': " + std::strerror(errno));
    img->map_ = p;
    img->map_len_ = size;
    img->data_ = static_cast<const uint8_t*>(p);
    return img;
  }
  try {
    img->copy_ = HugeBuffer(size);
  } catch (const IoError& e) {
    throw IoError("cannot read '" + path + "' into memory: " + e.what());
  }
  uint8_t* dst = img->copy_.data();
  for (uint64_t done = 0; done < size;) {
    const ssize_t got = ::pread(fd, dst + done, std::min<uint64_t>(size - done, 1ull << 30), static_cast<off_t>(done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      throw IoError("cannot read '" + path + "': " +
                    (got < 0 ? std::strerror(errno) : "the file became shorter while being read"));
    done += static_cast<uint64_t>(got);
  }
  img->copy_.make_read_only();
  img->data_ = dst;
  return img;
}

Image::~Image() {
  if (map_) munmap(map_, map_len_);
}

// ---------------------------------------------------------------------------------------------
// TrieView

namespace {
// Level-2 node with token `tok` among [s, e) from hash slot `i` (UINT64_MAX: none), for level-2
// tokens of type TT. Range first: entries of other parents are rejected without touching the
// token array.
template <class TT>
inline uint64_t probe_slots(const uint8_t* hash, uint64_t slots, uint64_t max_probe, uint64_t i, uint32_t tok,
                            uint64_t s, uint64_t e, const uint8_t* tokens) {
  for (uint64_t probe = 0; probe < max_probe; ++probe) {
    uint32_t j;
    std::memcpy(&j, hash + i * 4, 4);
    if (j == kHashEmpty) return UINT64_MAX;
    if (j >= s && j < e) {
      TT v;
      std::memcpy(&v, tokens + static_cast<uint64_t>(j) * sizeof(TT), sizeof(TT));
      if (v == tok) return j;
    }
    if (++i == slots) i = 0;
  }
  return UINT64_MAX;
}

template <class TT>
inline bool search_tokens(const uint8_t* base, uint64_t s, uint64_t e, uint32_t tok, uint64_t& out) {
  const TT* a = reinterpret_cast<const TT*>(base);
  // Branch-light lower bound over [s, e).
  uint64_t lo = s, len = e - s;
  while (len > 0) {
    uint64_t half = len / 2;
    TT v;
    std::memcpy(&v, a + lo + half, sizeof(TT));
    if (v < tok) {
      lo += half + 1;
      len -= half + 1;
    } else {
      len = half;
    }
  }
  if (lo < e) {
    TT v;
    std::memcpy(&v, a + lo, sizeof(TT));
    if (v == tok) {
      out = lo;
      return true;
    }
  }
  return false;
}
}  // namespace

TrieView::TrieView(std::shared_ptr<Image> image, Check check, const std::string& what)
    : image_(std::move(image)) {
  const uint8_t* d = image_->data();
  const uint64_t size = image_->size();
  if (size < kHeaderBytes)
    throw FormatError(what + ": too small to be a compact n-gram trie (" + std::to_string(size) + " bytes)");
  std::memcpy(&hdr_, d, sizeof(Header));
  if (std::memcmp(hdr_.magic, kMagic, 8) != 0) {
    uint64_t first;
    std::memcpy(&first, d, 8);
    std::string hint = (first >= 1 && first <= 64) ? " (it looks like an original DART .trie: use load_dart)" : "";
    throw FormatError(what + ": not a compact n-gram trie (bad magic)" + hint);
  }
  if (hdr_.version != kVersion)
    throw FormatError(what + ": unsupported format version " + std::to_string(hdr_.version) + " (this build reads " +
                      std::to_string(kVersion) + ")");
  if (hdr_.header_bytes != kHeaderBytes) throw FormatError(what + ": bad header size");
  if (hdr_.order < 1 || hdr_.order > static_cast<uint32_t>(kMaxOrder))
    throw FormatError(what + ": bad order " + std::to_string(hdr_.order));
  if (hdr_.vocab_size > (1ull << 31)) throw FormatError(what + ": bad vocabulary size");
  const uint32_t want_tb = hdr_.vocab_size <= 65536 ? 2 : 4;
  if (hdr_.token_bytes != want_tb) throw FormatError(what + ": bad token width");
  if (hdr_.fingerprint_len > kFingerprintMax) throw FormatError(what + ": bad fingerprint length");
  const int order = static_cast<int>(hdr_.order);
  if (hdr_.num_sections != expected_sections(order)) throw FormatError(what + ": bad section count");
  if (hdr_.file_size != size)
    throw FormatError(what + ": size mismatch (header says " + std::to_string(hdr_.file_size) + " bytes, file has " +
                      std::to_string(size) + "; truncated or extended)");
  const uint64_t table_end = kHeaderBytes + static_cast<uint64_t>(hdr_.num_sections) * sizeof(Section);
  if (table_end > size) throw FormatError(what + ": truncated section table");
  std::vector<Section> table(hdr_.num_sections);
  std::memcpy(table.data(), d + kHeaderBytes, table.size() * sizeof(Section));
  if (header_checksum(hdr_, table.data(), table.size()) != hdr_.header_checksum)
    throw CorruptError("header checksum mismatch, at offset 0");

  // Re-derive the layout from the per-level shape and require the table to match it exactly.
  std::vector<LevelShape> shape(order + 1);
  size_t si = 0;
  for (int k = 1; k <= order; ++k) {
    const Section& t = table[si];
    const Section& c = table[si + 1];
    const Section& e = table[si + 2];
    shape[k].n = t.count;
    shape[k].count_bytes = c.elem_bytes;
    shape[k].n_esc = e.count;
    if (c.elem_bytes != 1 && c.elem_bytes != 2 && c.elem_bytes != 4 && c.elem_bytes != 8)
      throw FormatError(what + ": bad count width");
    si += 4;
    if (k < order) {
      shape[k].child_bytes = table[si].elem_bytes;
      if (shape[k].child_bytes != 4 && shape[k].child_bytes != 8) throw FormatError(what + ": bad offset width");
      ++si;
    }
  }
  if (order >= 2) shape[2].hash_slots = table[si].count;
  std::vector<Section> expect;
  uint64_t expect_size = compute_layout(order, hdr_.token_bytes, shape, expect);
  if (expect_size != size || expect.size() != table.size())
    throw FormatError(what + ": section table inconsistent with file size");
  for (size_t i = 0; i < table.size(); ++i) {
    const Section& a = table[i];
    const Section& b = expect[i];
    const bool reserved_ok = a.kind == kHash ? a.reserved <= a.count : a.reserved == 0;
    if (a.level != b.level || a.kind != b.kind || a.elem_bytes != b.elem_bytes || a.offset != b.offset ||
        a.count != b.count || !reserved_ok)
      throw FormatError(what + ": section table entry " + std::to_string(i) + " is inconsistent");
  }
  uint64_t nodes = 1;
  for (int k = 1; k <= order; ++k) {
    if (shape[k].n > size) throw FormatError(what + ": bad level size");
    nodes += shape[k].n;
  }
  if (nodes != hdr_.num_nodes) throw FormatError(what + ": node count mismatch");

  lv_.assign(order + 2, LevelView{});
  si = 0;
  for (int k = 1; k <= order; ++k) {
    LevelView& L = lv_[k];
    L.n = shape[k].n;
    L.tokens = d + table[si].offset;
    L.counts = d + table[si + 1].offset;
    L.count_bytes = shape[k].count_bytes;
    L.esc_idx = reinterpret_cast<const uint64_t*>(d + table[si + 2].offset);
    L.esc_val = reinterpret_cast<const uint64_t*>(d + table[si + 3].offset);
    L.n_esc = shape[k].n_esc;
    si += 4;
    if (k < order) {
      L.child = d + table[si].offset;
      L.child_bytes = shape[k].child_bytes;
      ++si;
    }
  }
  if (order >= 2) {
    const Section& h = table[si];
    hash_slots_ = h.count;
    hash_max_probe_ = h.reserved;
    hash_ = d + h.offset;
    if (hash_slots_ && (hash_slots_ < lv_[2].n || lv_[2].n >= kHashEmpty))
      throw FormatError(what + ": hash table too small for level 2");
  }
  // Cheap structural checks: child arrays span exactly the next level; level 1 sorted, in vocab.
  for (int k = 1; k < order; ++k) {
    if (child_at(lv_[k], 0) != 0 || child_at(lv_[k], lv_[k].n) != lv_[k + 1].n)
      throw CorruptError("child offsets of level " + std::to_string(k) + " do not span level " +
                         std::to_string(k + 1) + ", at level-" + std::to_string(k) + " node 0");
  }
  if (lv_[1].n > hdr_.vocab_size) throw FormatError(what + ": more unigrams than vocabulary entries");
  const bool dense = hdr_.vocab_size <= (1ull << 27);
  if (dense) dense1_.assign(hdr_.vocab_size, 0);
  int64_t prev = -1;
  for (uint64_t i = 0; i < lv_[1].n; ++i) {
    uint32_t t = token_at(lv_[1], i);
    if (static_cast<int64_t>(t) <= prev || t >= hdr_.vocab_size)
      throw CorruptError(std::string(t >= hdr_.vocab_size ? "token id " + std::to_string(t) + " outside the vocabulary of " +
                                                                std::to_string(hdr_.vocab_size)
                                                          : "level-1 tokens out of order") +
                         ", at level-1 node " + std::to_string(i));
    prev = t;
    if (dense) dense1_[t] = static_cast<uint32_t>(i + 1);
  }
  if (check != Check::kTrusted) check_structure();
  if (dense && order >= 2 && hash_slots_) {
    uni_.assign(hdr_.vocab_size, Unigram{});
    for (uint64_t i = 0; i < lv_[1].n; ++i) {
      Unigram& u = uni_[token_at(lv_[1], i)];
      u.idx1 = static_cast<uint32_t>(i + 1);
      const uint64_t s = child_at(lv_[1], i), e = child_at(lv_[1], i + 1);
      bool ok = true;
      const uint64_t c = count_checked(1, i, ok);
      if (!ok || s > e || e > lv_[2].n) {
        u.s = 1;  // corrupt: a query touching it reports it
        continue;
      }
      u.s = static_cast<uint32_t>(s);  // < 2^32: the hash's node indices are u32
      u.e = static_cast<uint32_t>(e);
      u.inv = c ? 1.0f / static_cast<float>(c) : 0.0f;
    }
    dense1_.clear();
    dense1_.shrink_to_fit();
  }
  if (check == Check::kFull) full_verify();
}

void TrieView::full_verify() const {
  const uint8_t* d = image_->data();
  const uint64_t start = align_up(kHeaderBytes + static_cast<uint64_t>(hdr_.num_sections) * sizeof(Section));
  Hasher h;
  h.update(d + start, image_->size() - start);
  if (h.digest() != hdr_.payload_checksum)
    throw CorruptError("payload checksum mismatch, somewhere in bytes " + std::to_string(start) + ".." +
                       std::to_string(image_->size()));
  if (!hash_slots_) return;
  // Tokens, counts, escapes and child offsets were checked by check_structure; here the hash.
  uint64_t used = 0;
  for (uint64_t i = 0; i < hash_slots_; ++i) {
    uint32_t j;
    std::memcpy(&j, hash_ + i * 4, 4);
    if (j == kHashEmpty) continue;
    if (j >= lv_[2].n) throw CorruptError("level-2 hash slot out of range, at hash slot " + std::to_string(i));
    ++used;
  }
  if (used != lv_[2].n)
    throw CorruptError("level-2 hash indexes " + std::to_string(used) + " of " + std::to_string(lv_[2].n) +
                       " nodes, at the level-2 hash");
  for (uint64_t p = 0; p < lv_[1].n; ++p) {
    const uint64_t s = child_at(lv_[1], p), e = child_at(lv_[1], p + 1);
    for (uint64_t j = s; j < e; ++j)
      if (hash_find(token_at(lv_[1], p), token_at(lv_[2], j), s, e) != j)
        throw CorruptError("level-2 hash misses a node, at level-2 node " + std::to_string(j));
  }
}

uint64_t TrieView::ram_bytes() const {
  return image_->size() + dense1_.size() * sizeof(uint32_t) + uni_.size() * sizeof(Unigram) +
         cand_table_.size() * sizeof(uint64_t) + cand_slots_.size();
}

uint64_t TrieView::count_checked(int k, uint64_t i, bool& ok) const {
  const LevelView& L = lv_[k];
  uint64_t v = read_uint(L.counts, L.count_bytes, i);
  if (L.count_bytes == 8 || v != sentinel(L.count_bytes)) return v;
  const uint64_t lo = first_escape(L, i);
  uint64_t x = 0;
  if (lo < L.n_esc) std::memcpy(&x, L.esc_idx + lo, 8);
  if (lo >= L.n_esc || x != i) {
    ok = false;
    return 0;
  }
  std::memcpy(&x, L.esc_val + lo, 8);
  return x;
}

uint64_t TrieView::hash_probe(uint64_t i, uint32_t tok, uint64_t s, uint64_t e) const {
  return hdr_.token_bytes == 2
             ? probe_slots<uint16_t>(hash_, hash_slots_, hash_max_probe_, i, tok, s, e, lv_[2].tokens)
             : probe_slots<uint32_t>(hash_, hash_slots_, hash_max_probe_, i, tok, s, e, lv_[2].tokens);
}

// count_checked with the common case, a narrow count below its escape value, read inline.
inline uint64_t TrieView::count_fast(int k, uint64_t i, bool& ok) const {
  const LevelView& L = lv_[k];
  const uint64_t c = read_uint(L.counts, L.count_bytes, i);
  return L.count_bytes < 8 && c == sentinel(L.count_bytes) ? count_checked(k, i, ok) : c;
}

// Child ranges below this size are searched directly (a few cache lines), larger ones hashed.
constexpr uint64_t kHashMinRange = 48;
#if defined(__SSE2__)
constexpr bool kSse2 = true;
#else
constexpr bool kSse2 = false;
#endif

bool TrieView::find_child(int k, uint64_t i, int64_t tok, uint64_t& out, bool& ok) const {
  if (tok < 0 || static_cast<uint64_t>(tok) >= hdr_.vocab_size || k >= static_cast<int>(hdr_.order)) return false;
  const uint32_t t = static_cast<uint32_t>(tok);
  uint64_t s, e;
  if (k == 0) {
    if (!uni_.empty() || !dense1_.empty()) {
      uint32_t idx = uni_.empty() ? dense1_[t] : uni_[t].idx1;
      if (!idx) return false;
      out = idx - 1;
      return true;
    }
    s = 0;
    e = lv_[1].n;
  } else {
    const LevelView& L = lv_[k];
    s = child_at(L, i);
    e = child_at(L, i + 1);
    if (s > e || e > lv_[k + 1].n) {
      ok = false;
      return false;
    }
    if (k == 1 && hash_slots_ && e - s >= kHashMinRange) {
      const uint64_t j = hash_find(token_at(lv_[1], i), static_cast<uint32_t>(tok), s, e);
      if (j == UINT64_MAX) return false;
      out = j;
      return true;
    }
  }
  if (hdr_.token_bytes == 2) {
    if (t > 0xFFFF) return false;
    return search_tokens<uint16_t>(lv_[k + 1].tokens, s, e, t, out);
  }
  return search_tokens<uint32_t>(lv_[k + 1].tokens, s, e, t, out);
}

bool TrieView::find_path(const int32_t* ctx, size_t len, uint64_t& node, bool& ok) const {
  uint64_t cur = 0;
  for (size_t j = 0; j < len; ++j) {
    uint64_t nxt;
    if (!find_child(static_cast<int>(j), cur, ctx[j], nxt, ok)) return false;
    cur = nxt;
  }
  node = cur;
  return true;
}

namespace {
constexpr uint64_t kNone = UINT64_MAX;
constexpr size_t kBlock = 64;

// Lower bounds of many keys in one sorted range, advanced in lockstep: every candidate of a query
// searches the same child range, so the loads of one step are independent and their cache misses
// overlap instead of being paid one after another.
template <class TT>
void search_lockstep(const uint8_t* base, uint64_t s, uint64_t e, const uint32_t* keys, size_t n, uint64_t* out) {
  if (s >= e) {
    for (size_t i = 0; i < n; ++i) out[i] = kNone;
    return;
  }
  const TT* a = reinterpret_cast<const TT*>(base);
  uint64_t pos[kBlock];
  for (size_t i = 0; i < n; ++i) pos[i] = s;
  uint64_t len = e - s;
  while (len > 1) {
    const uint64_t half = len / 2;
    for (size_t i = 0; i < n; ++i) {
      TT v;
      std::memcpy(&v, a + pos[i] + half, sizeof(TT));
      // Multiply, not a conditional: a data-dependent branch here mispredicts half the time.
      pos[i] += half * static_cast<uint64_t>(static_cast<uint32_t>(v) < keys[i]);
    }
    len -= half;
  }
  for (size_t i = 0; i < n; ++i) {
    TT v;
    std::memcpy(&v, a + pos[i], sizeof(TT));
    uint64_t r = pos[i] + (static_cast<uint32_t>(v) < keys[i] ? 1 : 0);
    if (r < e) std::memcpy(&v, a + r, sizeof(TT));
    out[i] = (r < e && static_cast<uint32_t>(v) == keys[i]) ? r : kNone;
  }
}
}  // namespace

bool TrieView::probability_generic(const int32_t* context, size_t context_len, const int32_t* tokens, size_t n,
                                   float* probs, int32_t* matched) const {
  for (size_t i = 0; i < n; ++i) {
    probs[i] = 0.0f;
    matched[i] = 0;
  }
  bool ok = true;
  const size_t max_len = std::min(static_cast<size_t>(hdr_.order) - 1, context_len);
  if (max_len == 0 || n == 0) return true;
  // The trie is far larger than the caches: every step below is a likely cache miss, so the
  // independent ones are prefetched together and paid once instead of one after another.
  const int32_t* ctx = context + context_len - max_len;
  if (!dense1_.empty())
    for (size_t j = 0; j < max_len; ++j)
      if (ctx[j] >= 0 && static_cast<uint64_t>(ctx[j]) < hdr_.vocab_size) __builtin_prefetch(&dense1_[ctx[j]]);
  // The hash table is keyed by tokens (parent token, token), so every slot a query may need (the
  // 2-token context's node, each candidate under the 1-token context) is known up front and
  // fetched together with the context nodes instead of after them.
  const uint32_t last = static_cast<uint32_t>(ctx[max_len - 1]);
  uint64_t slot1[kBlock];
  if (hash_slots_ && ctx[max_len - 1] >= 0) {
    for (size_t i = 0; i < std::min(n, kBlock); ++i) {
      slot1[i] = hash_slot(last, static_cast<uint32_t>(tokens[i]), hash_slots_);
      __builtin_prefetch(hash_ + slot1[i] * 4);
    }
    if (max_len >= 2 && ctx[max_len - 2] >= 0)
      __builtin_prefetch(hash_ + hash_slot(static_cast<uint32_t>(ctx[max_len - 2]), last, hash_slots_) * 4);
  }
  // Context nodes for every usable suffix length and their child ranges.
  uint64_t begin[kMaxOrder], end[kMaxOrder];
  float inv[kMaxOrder];
  bool use_hash1 = false;
  bool any = false;
  for (size_t len = 1; len <= max_len; ++len) {
    uint64_t node;
    begin[len] = end[len] = 0;
    if (!find_path(context + context_len - len, len, node, ok)) continue;
    const int k = static_cast<int>(len);
    const LevelView& L = lv_[k];
    begin[len] = child_at(L, node);
    end[len] = child_at(L, node + 1);
    if (begin[len] > end[len] || end[len] > lv_[k + 1].n) {
      ok = false;
      begin[len] = end[len] = 0;
      continue;
    }
    if (len == 1 && hash_slots_ && end[1] - begin[1] >= kHashMinRange) use_hash1 = true;
    const uint64_t ctx_count = count_checked(k, node, ok);
    // Same float arithmetic as the original (count * (1/ctx_count)), bit for bit. A zero context
    // count (possible only after pruning) gives 0 instead of the original's NaN.
    inv[len] = ctx_count ? 1.0f / static_cast<float>(ctx_count) : 0.0f;
    any = any || begin[len] < end[len];
  }
  if (!any) return ok;
  uint32_t keys[kBlock];
  size_t idx[kBlock];
  uint64_t found[kBlock];
  uint64_t slot[kBlock];
  for (size_t b0 = 0; b0 < n; b0 += kBlock) {
    const size_t bn = std::min(kBlock, n - b0);
    for (size_t len = max_len; len > 0; --len) {
      if (begin[len] >= end[len]) continue;
      size_t m = 0;  // the still unmatched candidates of this block
      for (size_t i = b0; i < b0 + bn; ++i) {
        if (matched[i] || tokens[i] < 0) continue;
        keys[m] = static_cast<uint32_t>(tokens[i]);
        idx[m++] = i;
      }
      if (m == 0) break;
      const int k = static_cast<int>(len);
      const LevelView& C = lv_[k + 1];
      if (k == 1 && use_hash1) {
        for (size_t j = 0; j < m; ++j)
          slot[j] = b0 == 0 ? slot1[idx[j]] : hash_slot(last, keys[j], hash_slots_);
        for (size_t j = 0; j < m; ++j) {  // first slots: prefetch the likely matches' tokens
          uint32_t v;
          std::memcpy(&v, hash_ + slot[j] * 4, 4);
          if (v != kHashEmpty && v >= begin[len] && v < end[len])
            __builtin_prefetch(C.tokens + static_cast<uint64_t>(v) * hdr_.token_bytes);
        }
        for (size_t j = 0; j < m; ++j) found[j] = hash_probe(slot[j], keys[j], begin[len], end[len]);
      } else if (hdr_.token_bytes == 2) {
        search_lockstep<uint16_t>(C.tokens, begin[len], end[len], keys, m, found);
      } else {
        search_lockstep<uint32_t>(C.tokens, begin[len], end[len], keys, m, found);
      }
      for (size_t j = 0; j < m; ++j)
        if (found[j] != kNone) __builtin_prefetch(C.counts + found[j] * C.count_bytes);
      for (size_t j = 0; j < m; ++j) {
        if (found[j] == kNone) continue;
        probs[idx[j]] = static_cast<float>(count_checked(k + 1, found[j], ok)) * inv[len];
        matched[idx[j]] = static_cast<int32_t>(len);
      }
    }
  }
  return ok;
}

namespace {
constexpr uint32_t kNoKey = UINT32_MAX;  // a candidate outside the vocabulary: matches nothing

// Prefetches the elements [s, e) of an array of `width`-byte values when they span at most
// `max_lines` cache lines (a query is bound by how many lines it touches, so larger runs are read
// on demand). Returns whether the whole range was requested.
inline bool prefetch_small(const uint8_t* base, uint64_t s, uint64_t e, uint32_t width, uint64_t max_lines) {
  if (s >= e) return true;
  const uintptr_t lo = reinterpret_cast<uintptr_t>(base + s * width) & ~uintptr_t{63};
  const uintptr_t hi = reinterpret_cast<uintptr_t>(base + e * width);
  if (hi - lo > max_lines * 64) return false;
  for (uintptr_t q = lo; q < hi; q += 64) __builtin_prefetch(reinterpret_cast<const void*>(q));
  return true;
}

// Prefetches what a search of elements [s, e) (each `width` bytes) will read: all of it when it
// spans at most 16 cache lines, else the probes of the first four binary-search steps.
inline void prefetch_search(const uint8_t* base, uint64_t s, uint64_t e, uint32_t width) {
  if (s >= e) return;
  const uintptr_t lo = reinterpret_cast<uintptr_t>(base + s * width) & ~uintptr_t{63};
  const uintptr_t hi = reinterpret_cast<uintptr_t>(base + e * width);
  if (hi - lo <= 16 * 64) {
    for (uintptr_t q = lo; q < hi; q += 64) __builtin_prefetch(reinterpret_cast<const void*>(q));
    return;
  }
  const uint64_t len = e - s;
  for (uint64_t k = 1; k < 16; ++k) __builtin_prefetch(base + (s + len * k / 16) * width);
}

// Runs of 2-byte tokens up to this length (16 cache lines) are searched by segments
// (search_segments16) instead of a binary search, and the candidates under a 1-token context with
// at most this many children are searched in its run instead of through the level-2 hash: a
// query is bound by the cache lines it touches, and the hash costs a slot line per candidate
// plus a token line and a count line per match (~47 lines on ShareGPT; the run: <= 16 + matches).
constexpr uint64_t kSegmentMaxRange = 512;
// Candidates under a 1-token context with at least this many children go through the hash (or the
// candidate index); below it they are searched in the run.
template <class TT>
constexpr uint64_t kHashedRunMin = sizeof(TT) == 2 && kSse2 ? kSegmentMaxRange + 1 : kHashMinRange;
// Candidate index (build_candidate_index): the position half of an empty slot.
template <class TT>
constexpr TT kCandEmpty = static_cast<TT>(~TT{0});
// Slot of `token` in a candidate-index table of 2^bits slots (Fibonacci hashing).
inline uint64_t cand_slot(uint32_t token, uint64_t bits) {
  return (static_cast<uint64_t>(token) * 0x9E3779B97F4A7C15ull) >> (64 - bits);
}
// A context's cand_table_ entry is its first slot << 8 | log2(its slots): the home slot of `key`.
inline uint64_t cand_home(uint64_t table, uint32_t key) { return (table >> 8) + cand_slot(key, table & 255); }
// Hash probes looked at when prefetching a lookup's possible matches (longer sequences are rare).
constexpr uint64_t kPrefetchProbes = 4;

#if defined(__SSE2__)
// Positions of `keys` in the sorted, duplicate-free 2-byte tokens [s, e), 32 <= e - s <= 512:
// the run as up to 16 segments of 32 tokens; the segments' first tokens (two SSE2 registers)
// give a key's segment in one compare, 4 compares search it: no branches and no chain of dependent
// loads (a binary search has ~9 steps). Same answers as search_lockstep.
inline void search_segments16(const uint8_t* base, uint64_t s, uint64_t e, const uint32_t* keys, size_t n,
                              uint64_t* out) {
  const uint16_t* a = reinterpret_cast<const uint16_t*>(base) + s;
  const uint64_t len = e - s;
  const uint32_t nseg = static_cast<uint32_t>((len + 31) / 32);
  alignas(16) uint16_t first[16];
  for (uint32_t j = 0; j < 16; ++j) first[j] = j < nseg ? a[32 * j] : 0xFFFF;
  const __m128i f0 = _mm_load_si128(reinterpret_cast<const __m128i*>(first));
  const __m128i f1 = _mm_load_si128(reinterpret_cast<const __m128i*>(first + 8));
  const __m128i zero = _mm_setzero_si128();
  const uint64_t valid = (1ull << (2 * nseg)) - 1;  // 2 mask bits per segment
  for (size_t i = 0; i < n; ++i) {
    const __m128i k = _mm_set1_epi16(static_cast<short>(keys[i]));
    // Segments whose first token is <= key (a prefix): the saturating difference is zero there.
    const uint64_t le = (static_cast<uint64_t>(_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_subs_epu16(f0, k), zero))) |
                         static_cast<uint64_t>(_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_subs_epu16(f1, k), zero))) << 16) &
                        valid;
    // Below the first token: no segment (searched as segment 0, whose compares then fail).
    const uint64_t seg = le ? (static_cast<uint64_t>(__builtin_ctzll(~le)) >> 1) - 1 : 0;
    const uint64_t w = std::min<uint64_t>(32 * seg, len - 32);  // the last window ends at the run's end
    const __m128i* p = reinterpret_cast<const __m128i*>(a + w);
    const uint64_t eq = static_cast<uint64_t>(_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_loadu_si128(p), k))) |
                        static_cast<uint64_t>(_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_loadu_si128(p + 1), k))) << 16 |
                        static_cast<uint64_t>(_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_loadu_si128(p + 2), k))) << 32 |
                        static_cast<uint64_t>(_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_loadu_si128(p + 3), k))) << 48;
    // Keys beyond 2 bytes were truncated by the broadcast: they match nothing.
    const bool hit = eq != 0 && keys[i] <= 0xFFFF;
    out[i] = hit ? s + w + (static_cast<uint64_t>(__builtin_ctzll(eq | (1ull << 63))) >> 1) : kNone;
  }
}
#endif

// Positions of `keys` in the sorted, duplicate-free tokens [s, e): equality compares instead of a
// binary search when the run is short (the median 2-token context has ~20 children), 8 tokens per
// SSE2 compare; segments for longer runs. Same answers as search_lockstep.
template <class TT>
inline void search_keys(const uint8_t* base, uint64_t s, uint64_t e, const uint32_t* keys, size_t n, uint64_t* out) {
#if defined(__SSE2__)
  if (sizeof(TT) == 2 && e - s > 64 && e - s <= kSegmentMaxRange) {
    search_segments16(base, s, e, keys, n, out);
    return;
  }
  if (sizeof(TT) == 2 && e - s >= 8 && e - s <= 64) {
    const uint16_t* a = reinterpret_cast<const uint16_t*>(base) + s;
    const uint64_t len = e - s;
    __m128i blk[8];
    uint32_t off[8];
    int nb = 0;
    for (uint64_t o = 0; o + 8 <= len; o += 8) {
      blk[nb] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + o));
      off[nb++] = static_cast<uint32_t>(o);
    }
    if (len % 8) {  // the tail as one more block overlapping the previous one
      blk[nb] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + len - 8));
      off[nb++] = static_cast<uint32_t>(len - 8);
    }
    for (size_t i = 0; i < n; ++i) {
      // Every block compared, the hit selected without branches (tokens are distinct, so only
      // the overlapping tail block can hit a second time, at the same position).
      const __m128i k = _mm_set1_epi16(static_cast<short>(keys[i]));
      uint64_t pos = kNone;
      for (int b = 0; b < nb; ++b) {
        const unsigned m = static_cast<unsigned>(_mm_movemask_epi8(_mm_cmpeq_epi16(blk[b], k)));
        pos = m ? s + off[b] + (static_cast<uint32_t>(__builtin_ctz(m | 0x10000u)) >> 1) : pos;
      }
      out[i] = keys[i] <= 0xFFFF ? pos : kNone;
    }
    return;
  }
#endif
  search_lockstep<TT>(base, s, e, keys, n, out);
}

}  // namespace

// One query of a batch: one row's context and at most kBlock of its candidates, with what each
// stage leaves for the next.
struct TrieView::Query {
  const int32_t* ctx = nullptr;  // the last `len` (<= order - 1) context tokens
  size_t len = 0;
  const int32_t* tokens = nullptr;
  size_t n = 0;
  float* probs = nullptr;
  int32_t* matched = nullptr;
  size_t row = 0;
  bool active = false;  // false: nothing can match, the outputs stay zero
  bool reuse1 = false;  // same last token and candidates as the previous query: its level-1 answers
  bool cache1 = false;  // store this query's level-1 answers for the queries that reuse them
  bool ok = true;
  bool zeroed = false;  // outputs zeroed early (contexts longer than 2 tokens write them first)
  bool two = false, hash1 = false, hashb = false;
  bool indexed = false;  // the candidates go through the candidate index (hash1 implied)
  bool ctx_indexed = false;  // the 2-token context's node is found through the candidate index
  uint64_t node_ctx = 0;     // that node (kNone: absent)
  // The counts of the whole child run were requested with its tokens: no per-match requests.
  bool counts1_requested = false, counts2_requested = false;
  uint32_t a = 0, b = 0;  // last and second-to-last context token
  uint64_t slot_ctx = 0;
  uint64_t s1 = 0, e1 = 0, sb = 0, eb = 0, s2 = 0, e2 = 0;
  float inv1 = 0.0f, inv2 = 0.0f;
  uint32_t key[kBlock];
  uint64_t slot[kBlock];
  uint64_t found1[kBlock], found2[kBlock];
};

// Level-1 answers (candidates under the last context token) of the last query that computed them.
struct TrieView::Level1Cache {
  float prob[kBlock];
  uint8_t state[kBlock];  // 0: no child, 1: child, 2: child whose count is corrupt
};

struct TrieView::Batch {
  const int32_t* contexts;
  size_t context_stride;
  const int32_t* context_lens;
  size_t rows;
  const int32_t* tokens;
  size_t token_stride;
  size_t n;
  float* probs;
  int32_t* matched;
  const uint32_t* order;  // processing order of the rows (null: as given)
};

// Stage 1: request everything keyed by tokens alone. The trie is far larger
// than the caches, so nearly every step is a cache miss (~170 ns here); the hash keys are tokens
// only, so the slots of the 2-token context and of every candidate under the 1-token context are
// known before anything is read.
template <class TT>
void TrieView::stage_issue(Query& q) const {
  // The outputs are written once, by the last stage (a batch's outputs are new cache lines,
  // each store a miss): request their lines now.
  for (size_t i = 0; i < q.n; i += 16) {
    __builtin_prefetch(q.probs + i, 1);
    __builtin_prefetch(q.matched + i, 1);
  }
  q.zeroed = false;
  q.ok = true;
  q.active = false;
  q.counts1_requested = false;
  if (q.len == 0 || q.n == 0) return;
  const uint64_t V = hdr_.vocab_size;
  // Every context is a path ending in the last token: if that is not a unigram, nothing matches.
  const int32_t last = q.ctx[q.len - 1];
  if (last < 0 || static_cast<uint64_t>(last) >= V) return;
  q.active = true;
  q.a = static_cast<uint32_t>(last);
  q.two = q.len >= 2 && q.ctx[q.len - 2] >= 0 && static_cast<uint64_t>(q.ctx[q.len - 2]) < V;
  q.b = q.two ? static_cast<uint32_t>(q.ctx[q.len - 2]) : 0;
  // The 2-token context's slot starts the longest chain of misses (slot, node, children, counts):
  // requested before anything is read. The unigram entries may miss too (786 KB for SmolLM2);
  // the keys are computed while they arrive.
  q.ctx_indexed = q.two && !cand_table_.empty() && cand_table_[q.b] != 0;
  if (q.ctx_indexed) {
    q.slot_ctx = cand_home(cand_table_[q.b], q.a);
    __builtin_prefetch(cand_entry<TT>(q.slot_ctx));
  } else if (q.two) {
    q.slot_ctx = hash_slot(q.b, q.a, hash_slots_);
    __builtin_prefetch(hash_ + q.slot_ctx * 4);
  }
  if (q.two) __builtin_prefetch(&uni_[q.b]);
  __builtin_prefetch(&uni_[q.a]);
  // A negative id becomes >= 2^31 >= V as unsigned: one compare rejects both kinds.
  const uint32_t v32 = static_cast<uint32_t>(V);
  for (size_t i = 0; i < q.n; ++i) {
    const uint32_t t = static_cast<uint32_t>(q.tokens[i]);
    q.key[i] = t < v32 ? t : kNoKey;
  }
  // Short child runs are then requested whole, long ones through the hash.
  const Unigram ua = uni_[q.a];
  const Unigram ub = q.two ? uni_[q.b] : Unigram{};
  if (ua.s > ua.e || ub.s > ub.e) q.ok = false;
  q.s1 = ua.s <= ua.e ? ua.s : 0;
  q.e1 = ua.s <= ua.e ? ua.e : 0;
  q.sb = ub.s <= ub.e ? ub.s : 0;
  q.eb = ub.s <= ub.e ? ub.e : 0;
  q.inv1 = ua.inv;
  q.hash1 = q.e1 - q.s1 >= kHashedRunMin<TT>;
  q.indexed = q.hash1 && !cand_table_.empty() && cand_table_[q.a] != 0;
  q.hashb = q.eb - q.sb >= kHashMinRange;
  const LevelView& L2 = lv_[2];
  constexpr uint32_t tb = sizeof(TT);
  if (!q.hashb) prefetch_search(L2.tokens, q.sb, q.eb, tb);
  if (q.reuse1) return;
  if (q.indexed) {
    const uint64_t table = cand_table_[q.a];
    for (size_t i = 0; i < q.n; ++i) {
      q.slot[i] = cand_home(table, q.key[i]);
      __builtin_prefetch(cand_entry<TT>(q.slot[i]));
    }
  } else if (q.hash1) {
    for (size_t i = 0; i < q.n; ++i) {
      q.slot[i] = hash_slot(q.a, q.key[i], hash_slots_);
      __builtin_prefetch(hash_ + q.slot[i] * 4);
    }
  } else {
    // The counts of the matches are requested once they are known (stage_search), unless the
    // whole run's counts are only a few lines.
    prefetch_search(L2.tokens, q.s1, q.e1, tb);
    q.counts1_requested = prefetch_small(L2.counts, q.s1, q.e1, L2.count_bytes, 2);
  }
}

// Stage 2: the hash slots have arrived: request the level-2 nodes they point at (the 2-token
// context's node, and each candidate's under the 1-token context). Candidates in the candidate
// index are found here (a slot names its token and position) and their counts requested.
template <class TT>
void TrieView::stage_context(Query& q) const {
  if (!q.active) return;
  if (q.ctx_indexed) {
    const uint64_t at = cand_lookup<TT>(cand_table_[q.b], q.slot_ctx, q.a);
    q.node_ctx = at == kNone ? kNone : q.sb + at;
    if (at != kNone) {
      __builtin_prefetch(lv_[2].child + q.node_ctx * lv_[2].child_bytes);
      __builtin_prefetch(lv_[2].counts + q.node_ctx * lv_[2].count_bytes);
    }
  } else if (q.hashb) {
    prefetch_candidates(q.slot_ctx, q.sb, q.eb, true);
  }
  if (q.reuse1 || !q.hash1) return;
  if (!q.indexed) {
    for (size_t c = 0; c < q.n; ++c) prefetch_candidates(q.slot[c], q.s1, q.e1, false);
    return;
  }
  const LevelView& L2 = lv_[2];
  const uint64_t table = cand_table_[q.a];
  for (size_t c = 0; c < q.n; ++c) {
    const uint64_t at = cand_lookup<TT>(table, q.slot[c], q.key[c]);
    q.found1[c] = at == kNone ? kNone : q.s1 + at;
    if (at != kNone) __builtin_prefetch(L2.counts + q.found1[c] * L2.count_bytes);
  }
}

// Position of `key` in the child run of the context whose index table is `table` (its
// cand_table_ entry), probing from `slot` (kNone: absent).
template <class TT>
uint64_t TrieView::cand_lookup(uint64_t table, uint64_t slot, uint32_t key) const {
  const uint64_t first = table >> 8, mask = (1ull << (table & 255)) - 1;
  // At most half the slots are full (build_candidate_index_t): the probe ends at an empty one.
  for (uint64_t i = slot - first;; i = (i + 1) & mask) {
    TT entry[2];  // token, position in the run
    std::memcpy(entry, cand_entry<TT>(first + i), sizeof(entry));
    if (entry[1] == kCandEmpty<TT>) return kNone;
    if (entry[0] == key) return entry[1];
  }
}

template <class TT>
void TrieView::build_candidate_index_t() {
  // Tables of 2^bits >= 2 * children slots (at most half full: short probes) for the contexts
  // whose candidates would go through the hash; runs of 2^(8 * sizeof(TT)) - 1 or more children
  // (all of a 2-byte vocabulary) cannot be described by a TT position and stay with the hash.
  std::vector<uint64_t> table(uni_.size(), 0);
  uint64_t total = 0;
  for (size_t tok = 0; tok < uni_.size(); ++tok) {
    const Unigram& u = uni_[tok];
    if (u.s > u.e || u.e - u.s < kHashedRunMin<TT> || u.e - u.s >= kCandEmpty<TT>) continue;
    uint64_t bits = 1;
    while ((1ull << bits) < 2 * (u.e - u.s)) ++bits;
    table[tok] = total << 8 | bits;
    total += 1ull << bits;
  }
  if (total == 0) return;
  HugeBuffer slots(total * 2 * sizeof(TT));
  uint8_t* base = slots.data();
  const TT empty[2] = {0, kCandEmpty<TT>};
  for (uint64_t i = 0; i < total; ++i) std::memcpy(base + i * sizeof(empty), empty, sizeof(empty));
  for (size_t tok = 0; tok < uni_.size(); ++tok) {
    if (!table[tok]) continue;
    const Unigram& u = uni_[tok];
    const uint64_t first = table[tok] >> 8, bits = table[tok] & 255, mask = (1ull << bits) - 1;
    for (uint64_t j = u.s; j < u.e; ++j) {
      const TT entry[2] = {static_cast<TT>(token_at(lv_[2], j)), static_cast<TT>(j - u.s)};
      uint64_t i = cand_slot(entry[0], bits);
      TT seen[2];
      for (;; i = (i + 1) & mask) {
        std::memcpy(seen, base + (first + i) * sizeof(seen), sizeof(seen));
        if (seen[1] == kCandEmpty<TT>) break;
      }
      std::memcpy(base + (first + i) * sizeof(entry), entry, sizeof(entry));
    }
  }
  slots.make_read_only();
  cand_table_ = std::move(table);
  cand_slots_ = std::move(slots);
}

void TrieView::build_candidate_index() {
  if (uni_.empty() || !cand_table_.empty()) return;
  if (hdr_.token_bytes == 2)
    build_candidate_index_t<uint16_t>();
  else
    build_candidate_index_t<uint32_t>();
}

// Every entry of the probe sequence from slot `i` that is a child of the right parent ([s, e)) is
// a possible match (half the slots are full, so the match is often not the first; the first empty
// slot ends it): request its token and count, and its child offsets when `with_children`.
void TrieView::prefetch_candidates(uint64_t i, uint64_t s, uint64_t e, bool with_children) const {
  const LevelView& L2 = lv_[2];
  const uint32_t tb = hdr_.token_bytes;
  const uint64_t max_probe = std::min(hash_max_probe_, kPrefetchProbes);
  for (uint64_t probe = 0; probe < max_probe; ++probe) {
    uint32_t v;
    std::memcpy(&v, hash_ + i * 4, 4);
    if (v == kHashEmpty) break;
    if (v >= s && v < e) {
      __builtin_prefetch(L2.tokens + static_cast<uint64_t>(v) * tb);
      __builtin_prefetch(L2.counts + static_cast<uint64_t>(v) * L2.count_bytes);
      if (with_children) __builtin_prefetch(L2.child + static_cast<uint64_t>(v) * L2.child_bytes);
    }
    if (++i == hash_slots_) i = 0;
  }
}

// Stage 3: the 2-token context's node, requesting its children on level 3; contexts longer than
// 2 tokens.
template <class TT>
void TrieView::stage_children(Query& q) const {
  if (!q.active) return;
  constexpr uint32_t tb = sizeof(TT);
  const LevelView& L2 = lv_[2];
  q.s2 = q.e2 = 0;
  q.inv2 = 0.0f;
  q.counts2_requested = false;
  if (q.eb > q.sb) {
    uint64_t node = kNone;
    if (q.ctx_indexed)
      node = q.node_ctx;
    else if (q.hashb)
      node = probe_slots<TT>(hash_, hash_slots_, hash_max_probe_, q.slot_ctx, q.a, q.sb, q.eb, L2.tokens);
    else if (!search_tokens<TT>(L2.tokens, q.sb, q.eb, q.a, node))
      node = kNone;
    if (node != kNone) {
      const LevelView& L3 = lv_[3];
      q.s2 = child_at(L2, node);
      q.e2 = child_at(L2, node + 1);
      if (q.s2 > q.e2 || q.e2 > L3.n) q.ok = false, q.s2 = q.e2 = 0;
      prefetch_search(L3.tokens, q.s2, q.e2, tb);
      q.counts2_requested = prefetch_small(L3.counts, q.s2, q.e2, L3.count_bytes, 4);
      const uint64_t c = count_checked(2, node, q.ok);
      // Same float arithmetic as the original (count * (1/ctx_count)), bit for bit. A zero
      // context count (possible only after pruning) gives 0 instead of the original's NaN.
      q.inv2 = c ? 1.0f / static_cast<float>(c) : 0.0f;
    }
  }
  // Contexts longer than 2 tokens (order > 3), longest first; not the common case.
  if (q.len >= 3) {
    for (size_t i = 0; i < q.n; ++i) {
      q.probs[i] = 0.0f;
      q.matched[i] = 0;
    }
    q.zeroed = true;
  }
  for (size_t l = q.len; l >= 3; --l) {
    uint64_t node;
    if (!find_path(q.ctx + q.len - l, l, node, q.ok)) continue;
    const int k = static_cast<int>(l);
    const uint64_t s = child_at(lv_[k], node), e = child_at(lv_[k], node + 1);
    if (s > e || e > lv_[k + 1].n) {
      q.ok = false;
      continue;
    }
    if (s == e) continue;
    const uint64_t c = count_checked(k, node, q.ok);
    const float inv = c ? 1.0f / static_cast<float>(c) : 0.0f;
    uint64_t found[kBlock];
    search_lockstep<TT>(lv_[k + 1].tokens, s, e, q.key, q.n, found);
    for (size_t i = 0; i < q.n; ++i) {
      if (q.matched[i] || found[i] == kNone) continue;
      q.probs[i] = static_cast<float>(count_checked(k + 1, found[i], q.ok)) * inv;
      q.matched[i] = static_cast<int32_t>(l);
    }
  }
}

// Stage 4: the candidates among the 1-token context's children, then among the 2-token context's
// (requesting the counts of the matches).
template <class TT>
void TrieView::stage_search(Query& q) const {
  if (!q.active) return;
  // The candidates' level-2 data was requested a stage earlier than the level-3 run: searching
  // it first overlaps that work with the run's arrival.
  if (!q.reuse1 && !q.indexed) {
    if (q.hash1) {
      for (size_t i = 0; i < q.n; ++i)
        q.found1[i] = probe_slots<TT>(hash_, hash_slots_, hash_max_probe_, q.slot[i], q.key[i], q.s1, q.e1,
                                      lv_[2].tokens);
    } else {
      search_keys<TT>(lv_[2].tokens, q.s1, q.e1, q.key, q.n, q.found1);
      if (!q.counts1_requested)
        for (size_t i = 0; i < q.n; ++i)
          if (q.found1[i] != kNone) __builtin_prefetch(lv_[2].counts + q.found1[i] * lv_[2].count_bytes);
    }
  }
  const LevelView& L3 = lv_[3];
  search_keys<TT>(L3.tokens, q.s2, q.e2, q.key, q.n, q.found2);
  if (!q.counts2_requested)
    for (size_t i = 0; i < q.n; ++i)
      if (q.found2[i] != kNone) __builtin_prefetch(L3.counts + q.found2[i] * L3.count_bytes);
}

// Stage 5: the answers, longest context first.
void TrieView::stage_finish(Query& q, Level1Cache& cache) const {
  if (!q.active) {
    for (size_t i = 0; i < q.n; ++i) {
      q.probs[i] = 0.0f;
      q.matched[i] = 0;
    }
    return;
  }
  if (q.cache1) {
    for (size_t i = 0; i < q.n; ++i) {
      cache.state[i] = 0;
      if (q.found1[i] == kNone) continue;
      bool count_ok = true;
      const uint64_t c = count_fast(2, q.found1[i], count_ok);
      cache.prob[i] = static_cast<float>(c) * q.inv1;
      cache.state[i] = count_ok ? 1 : 2;
    }
  }
  for (size_t i = 0; i < q.n; ++i) {
    if (q.zeroed && q.matched[i]) continue;  // matched by a context longer than 2 tokens
    q.probs[i] = 0.0f;
    q.matched[i] = 0;
    if (q.found2[i] != kNone) {
      // Same float arithmetic as the original (count * (1/ctx_count)), bit for bit.
      q.probs[i] = static_cast<float>(count_fast(3, q.found2[i], q.ok)) * q.inv2;
      q.matched[i] = 2;
    } else if (q.reuse1 || q.cache1) {
      // Only a count this query uses may flag corruption, as in a query of its own.
      if (!cache.state[i]) continue;
      if (cache.state[i] == 2) q.ok = false;
      q.probs[i] = cache.prob[i];
      q.matched[i] = 1;
    } else if (q.found1[i] != kNone) {
      q.probs[i] = static_cast<float>(count_fast(2, q.found1[i], q.ok)) * q.inv1;
      q.matched[i] = 1;
    }
  }
}

// Runs the queries of a batch through the five stages as a software pipeline: each step advances
// five consecutive queries by one stage each, so every stage's requests have a whole step to
// arrive and the misses of different queries overlap. One query runs the stages back to back.
template <class TT>
bool TrieView::run_batch(const Batch& B, std::vector<size_t>* bad_rows) const {
  if (B.n == 0) return true;
  const size_t blocks = (B.n + kBlock - 1) / kBlock;
  const size_t total = B.rows * blocks;
  // Rows sharing the candidates and (adjacent in B.order) the last context token share the
  // level-1 answers: those are computed once.
  const bool shared = B.token_stride == 0 && blocks == 1 && B.rows > 1;
  const size_t max_len = static_cast<size_t>(hdr_.order) - 1;
  constexpr size_t kDepth = 5;
  Query ring[kDepth];
  Level1Cache cache;
  bool prev_active = false;
  uint32_t prev_a = 0;
  bool ok = true;
  // Query t: row, first candidate, and its context's last `len` tokens.
  auto locate = [&](size_t t, size_t& r, size_t& b0, size_t& len) -> const int32_t* {
    r = B.order ? B.order[t / blocks] : t / blocks;
    b0 = (t % blocks) * kBlock;
    const size_t clen = B.context_lens[r] > 0 ? static_cast<size_t>(B.context_lens[r]) : 0;
    len = std::min(max_len, clen);
    return B.contexts + r * B.context_stride + (clen - len);
  };
  for (size_t t = 0; t < total + kDepth - 1; ++t) {
    if (t >= 4 && t - 4 < total) {
      Query& q = ring[(t - 4) % kDepth];
      stage_finish(q, cache);
      if (!q.ok) {
        ok = false;
        if (bad_rows) bad_rows->push_back(q.row);
      }
    }
    if (t >= 3 && t - 3 < total) stage_search<TT>(ring[(t - 3) % kDepth]);
    if (t >= 2 && t - 2 < total) stage_children<TT>(ring[(t - 2) % kDepth]);
    if (t >= 1 && t - 1 < total) stage_context<TT>(ring[(t - 1) % kDepth]);
    if (t < total) {
      Query& q = ring[t % kDepth];
      size_t r, b0;
      q.ctx = locate(t, r, b0, q.len);
      q.tokens = B.tokens + r * B.token_stride + b0;
      q.n = std::min(kBlock, B.n - b0);
      q.probs = B.probs + r * B.n + b0;
      q.matched = B.matched + r * B.n + b0;
      q.row = r;
      q.reuse1 = shared && prev_active && q.len > 0 && q.ctx[q.len - 1] == static_cast<int32_t>(prev_a);
      q.cache1 = false;
      stage_issue<TT>(q);
      // The first query of a group stores its level-1 answers (its last stage runs later).
      if (q.reuse1) {
        Query& prev = ring[(t + kDepth - 1) % kDepth];
        if (!prev.reuse1) prev.cache1 = true;
      }
      prev_active = q.active;
      prev_a = q.a;
      // The next query reads its context tokens' unigram entries first thing: request them now.
      if (t + 1 < total) {
        size_t nr, nb0, nlen;
        const int32_t* nctx = locate(t + 1, nr, nb0, nlen);
        for (size_t j = nlen > 2 ? nlen - 2 : 0; j < nlen; ++j)
          if (nctx[j] >= 0 && static_cast<uint64_t>(nctx[j]) < hdr_.vocab_size) __builtin_prefetch(&uni_[nctx[j]]);
      }
    }
  }
  return ok;
}

bool TrieView::probability_batch_checked(const int32_t* contexts, size_t context_stride, const int32_t* context_lens,
                                         size_t rows, const int32_t* tokens, size_t token_stride, size_t n,
                                         float* probs, int32_t* matched, std::vector<size_t>* bad_rows) const {
  if (uni_.empty()) {
    bool ok = true;
    for (size_t r = 0; r < rows; ++r) {
      const size_t len = context_lens[r] > 0 ? static_cast<size_t>(context_lens[r]) : 0;
      if (!probability_generic(contexts + r * context_stride, len, tokens + r * token_stride, n, probs + r * n,
                               matched + r * n)) {
        ok = false;
        if (bad_rows) bad_rows->push_back(r);
      }
    }
    return ok;
  }
  // Shared candidates: rows grouped by last context token, so that each group's level-1 answers
  // are computed once (the tree search's beam paths often end in the same token).
  uint32_t order_small[64];
  std::vector<uint32_t> order_big;
  const uint32_t* order = nullptr;
  if (token_stride == 0 && rows > 1 && n <= kBlock && rows < (1ull << 31)) {
    const size_t max_len = static_cast<size_t>(hdr_.order) - 1;
    // (last token + 1) << 32 | row, sorted; rows without a context token first.
    std::vector<uint64_t> keyed_big;
    uint64_t keyed_small[64];
    uint64_t* keyed = keyed_small;
    if (rows > 64) {
      keyed_big.resize(rows);
      keyed = keyed_big.data();
      order_big.resize(rows);
    }
    for (size_t r = 0; r < rows; ++r) {
      const size_t clen = context_lens[r] > 0 ? static_cast<size_t>(context_lens[r]) : 0;
      const int64_t last = std::min(max_len, clen) ? contexts[r * context_stride + clen - 1] : -1;
      keyed[r] = static_cast<uint64_t>(last + 1) << 32 | r;
    }
    std::sort(keyed, keyed + rows);
    uint32_t* out = rows > 64 ? order_big.data() : order_small;
    for (size_t r = 0; r < rows; ++r) out[r] = static_cast<uint32_t>(keyed[r]);
    order = out;
  }
  const Batch b{contexts, context_stride, context_lens, rows, tokens, token_stride, n, probs, matched, order};
  return hdr_.token_bytes == 2 ? run_batch<uint16_t>(b, bad_rows) : run_batch<uint32_t>(b, bad_rows);
}

void TrieView::probability_batch(const int32_t* contexts, size_t context_stride, const int32_t* context_lens,
                                 size_t rows, const int32_t* tokens, size_t token_stride, size_t n, float* probs,
                                 int32_t* matched) const {
  std::vector<size_t> bad;
  if (probability_batch_checked(contexts, context_stride, context_lens, rows, tokens, token_stride, n, probs, matched,
                                &bad))
    return;
  // Corrupt data: those rows report "unseen" rather than garbage (the Python API raises instead).
  for (size_t r : bad)
    for (size_t i = 0; i < n; ++i) {
      probs[r * n + i] = 0.0f;
      matched[r * n + i] = 0;
    }
}

bool TrieView::probability_checked(const int32_t* context, size_t context_len, const int32_t* tokens, size_t n,
                                   float* probs, int32_t* matched) const {
  if (uni_.empty()) return probability_generic(context, context_len, tokens, n, probs, matched);
  // Only the last order - 1 tokens are read.
  const size_t len = std::min(static_cast<size_t>(hdr_.order) - 1, context_len);
  const int32_t* last = context + context_len - len;
  if (n <= kBlock)
    return hdr_.token_bytes == 2 ? run_one<uint16_t>(last, len, tokens, n, probs, matched)
                                 : run_one<uint32_t>(last, len, tokens, n, probs, matched);
  const int32_t len32 = static_cast<int32_t>(len);
  const Batch b{last, 0, &len32, 1, tokens, 0, n, probs, matched, nullptr};
  return hdr_.token_bytes == 2 ? run_batch<uint16_t>(b, nullptr) : run_batch<uint32_t>(b, nullptr);
}

// One query (at most kBlock candidates): the stages back to back, without run_batch's pipeline
// bookkeeping (~300 instructions; single queries ~4% faster).
template <class TT>
bool TrieView::run_one(const int32_t* ctx, size_t len, const int32_t* tokens, size_t n, float* probs,
                       int32_t* matched) const {
  Query q;
  q.ctx = ctx;
  q.len = len;
  q.tokens = tokens;
  q.n = n;
  q.probs = probs;
  q.matched = matched;
  stage_issue<TT>(q);
  stage_context<TT>(q);
  stage_children<TT>(q);
  stage_search<TT>(q);
  Level1Cache unused;  // only queries that share level-1 answers touch it
  stage_finish(q, unused);
  return q.ok;
}

void TrieView::probability(const int32_t* context, size_t context_len, const int32_t* tokens, size_t n, float* probs,
                           int32_t* matched) const {
  if (!probability_checked(context, context_len, tokens, n, probs, matched)) {
    // Corrupt data: report "unseen" rather than garbage (the Python API raises instead).
    for (size_t i = 0; i < n; ++i) {
      probs[i] = 0.0f;
      matched[i] = 0;
    }
  }
}

uint32_t TrieView::token(int k, uint64_t i) const { return token_at(lv_[k], i); }

uint64_t TrieView::count(int k, uint64_t i) const {
  bool ok = true;
  uint64_t v = count_checked(k, i, ok);
  if (!ok) throw FormatError("corrupt trie: missing escape entry for a count on level " + std::to_string(k));
  return v;
}

void TrieView::children(int k, uint64_t i, uint64_t& begin, uint64_t& end) const {
  if (k == 0) {
    begin = 0;
    end = lv_[1].n;
    return;
  }
  if (k >= static_cast<int>(hdr_.order)) {
    begin = end = 0;
    return;
  }
  begin = child_at(lv_[k], i);
  end = child_at(lv_[k], i + 1);
  if (begin > end || end > lv_[k + 1].n)
    throw FormatError("corrupt trie: child offsets out of range on level " + std::to_string(k));
}

// ---------------------------------------------------------------------------------------------
// Column

template <class T>
void Column<T>::set_spill(const std::string& dir) {
  std::string tmpl = dir + "/ngram-col-XXXXXX";
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  int fd = mkstemp(name.data());
  if (fd < 0) throw IoError("cannot create a temporary file in '" + dir + "': " + std::strerror(errno));
  f_ = fdopen(fd, "w+b");
  if (!f_) {
    ::close(fd);
    throw IoError("cannot open a temporary file in '" + dir + "'");
  }
  unlink(name.data());  // vanishes when closed, even after a crash
  path_ = name.data();
  spill_ = true;
}

template <class T>
Column<T>::~Column() {
  if (f_) std::fclose(f_);
}

template <class T>
Column<T>::Column(Column&& o) noexcept
    : buf_(std::move(o.buf_)), size_(o.size_), spill_(o.spill_), path_(std::move(o.path_)), f_(o.f_) {
  o.f_ = nullptr;
}

template <class T>
void Column<T>::flush() {
  if (buf_.empty()) return;
  if (std::fwrite(buf_.data(), sizeof(T), buf_.size(), f_) != buf_.size())
    throw IoError("write to temporary file '" + path_ + "' failed: " + std::strerror(errno));
  buf_.clear();
}

template <class T>
template <class F>
void Column<T>::for_each_block(F&& fn) {
  if (!spill_) {
    if (!buf_.empty()) fn(buf_.data(), buf_.size());
    return;
  }
  flush();
  std::fflush(f_);
  std::rewind(f_);
  std::vector<T> tmp(kSpillChunk);
  uint64_t left = size_;
  while (left) {
    size_t want = left < kSpillChunk ? static_cast<size_t>(left) : kSpillChunk;
    if (std::fread(tmp.data(), sizeof(T), want, f_) != want) throw IoError("read of temporary file failed");
    fn(tmp.data(), want);
    left -= want;
  }
}

template <class T>
void Column<T>::read_block(uint64_t start, size_t n, T* out) {
  if (start + n > size_) throw std::logic_error("column read out of range");
  if (!spill_) {
    std::memcpy(out, buf_.data() + start, n * sizeof(T));
    return;
  }
  flush();
  std::fflush(f_);
  const ssize_t want = static_cast<ssize_t>(n * sizeof(T));
  if (pread(fileno(f_), out, static_cast<size_t>(want), static_cast<off_t>(start * sizeof(T))) != want)
    throw IoError("read of temporary file failed");
}

namespace {
template <class T>
class ColumnCursor {
 public:
  explicit ColumnCursor(Column<T>& c) : c_(c) {}
  T next() {
    if (bpos_ == blen_) {
      blen_ = static_cast<size_t>(std::min<uint64_t>(buf_.size(), c_.size() - pos_));
      c_.read_block(pos_, blen_, buf_.data());
      pos_ += blen_;
      bpos_ = 0;
    }
    return buf_[bpos_++];
  }

 private:
  Column<T>& c_;
  std::vector<T> buf_ = std::vector<T>(1 << 15);
  uint64_t pos_ = 0;
  size_t bpos_ = 0, blen_ = 0;
};
}  // namespace

template class Column<uint32_t>;
template class Column<uint64_t>;

// ---------------------------------------------------------------------------------------------
// CsrBuilder

CsrBuilder::CsrBuilder(int order, uint64_t vocab_size, const std::string& spill_dir)
    : order_(order), vocab_(vocab_size) {
  if (order < 1 || order > kMaxOrder) throw std::invalid_argument("order must be in 1.." + std::to_string(kMaxOrder));
  tok_.resize(order + 1);
  cnt_.resize(order + 1);
  child_.resize(order + 1);
  if (!spill_dir.empty()) {
    for (int k = 1; k <= order; ++k) {
      tok_[k].set_spill(spill_dir);
      cnt_[k].set_spill(spill_dir);
      if (k < order) child_[k].set_spill(spill_dir);
    }
  }
  n_.assign(order + 2, 0);
  n_[0] = 1;
  for (auto& g : ge_) g.assign(order + 1, 0);
  for (auto& g : mass_ge_) g.assign(order + 1, 0);
  mass_.assign(order + 1, 0);
  for (auto& p : prev_sib_) p = -1;
}

uint64_t CsrBuilder::nodes() const {
  uint64_t s = 0;
  for (int k = 0; k <= order_; ++k) s += n_[k];
  return s;
}

void CsrBuilder::close_from(int level) {
  for (int l = path_len_; l >= level; --l) {
    const uint64_t c = path_cnt_[l];
    cnt_[l].push(c);
    ge_[0][l] += c >= 0xFFull;
    ge_[1][l] += c >= 0xFFFFull;
    ge_[2][l] += c >= 0xFFFFFFFFull;
    mass_[l] += c;
    if (c >= 0xFFull) mass_ge_[0][l] += c;
    if (c >= 0xFFFFull) mass_ge_[1][l] += c;
    if (c >= 0xFFFFFFFFull) mass_ge_[2][l] += c;
  }
  if (path_len_ >= level) path_len_ = level - 1;
}

void CsrBuilder::open(int level, uint32_t tok) {
  if (finished_) throw std::logic_error("builder already finished");
  if (level < 1 || level > order_ || level > path_len_ + 1)
    throw FormatError("node on level " + std::to_string(level) + " has no parent (input not in pre-order)");
  if (level <= path_len_) close_from(level);
  if (static_cast<int64_t>(tok) <= prev_sib_[level])
    throw FormatError("sibling tokens not strictly increasing (duplicate or unsorted children)");
  prev_sib_[level] = tok;
  for (int l = level + 1; l <= order_; ++l) prev_sib_[l] = -1;
  tok_[level].push(tok);
  if (level < order_) child_[level].push(n_[level + 1]);
  ++n_[level];
  path_len_ = level;
  path_tok_[level] = tok;
  path_cnt_[level] = 0;
  if (tok + 1 > max_tok_plus1_) max_tok_plus1_ = tok + 1;
}

void CsrBuilder::add_slice(const uint32_t* toks, int m, uint64_t c) {
  int d = 0;
  while (d < m && d < path_len_ && path_tok_[d + 1] == toks[d]) ++d;
  if (d == m && m < path_len_) throw FormatError("slices not in sorted order");
  for (int j = d + 1; j <= m; ++j) open(j, toks[j - 1]);
  for (int l = 0; l <= m; ++l) path_cnt_[l] += c;
}

void CsrBuilder::add_node(int level, uint32_t tok, uint64_t c) {
  open(level, tok);
  path_cnt_[level] = c;
}

void CsrBuilder::adjust_current(int level, int64_t delta) {
  if (level < 0 || level > path_len_) throw std::logic_error("adjust_current: no open node on that level");
  if (delta < 0 && static_cast<uint64_t>(-delta) > path_cnt_[level])
    throw FormatError("inconsistent counts: pruned descendants exceed their ancestor's count");
  path_cnt_[level] += static_cast<uint64_t>(delta);
}

namespace {
// Sequential output into memory or a file; hashes the payload.
class Sink {
 public:
  Sink(const std::string& path, uint64_t size) : size_(size) {
    if (path.empty()) {
      words_.assign(size / 8, 0);
      mem_ = reinterpret_cast<uint8_t*>(words_.data());
    } else {
      file_ = std::make_unique<FileWriter>(path);
    }
  }
  void write(const void* p, size_t n) {
    if (pos_ + n > size_) throw std::logic_error("image writer overflow");
    if (mem_) {
      std::memcpy(mem_ + pos_, p, n);
    } else {
      file_->write(p, n);
    }
    pos_ += n;
  }
  void pad_to(uint64_t off) {
    if (off < pos_) throw std::logic_error("image writer went backwards");
    if (mem_) {
      pos_ = off;  // already zero
    } else {
      file_->zeros(off - pos_);
      pos_ = off;
    }
  }
  void start_hash() {
    hash_start_ = pos_;
    if (file_) file_->start_hash();
  }
  uint64_t payload_digest() {
    if (mem_) {
      Hasher h;
      h.update(mem_ + hash_start_, size_ - hash_start_);
      return h.digest();
    }
    return file_->digest();
  }
  void write_header(const void* p, size_t n) {
    if (mem_) {
      std::memcpy(mem_, p, n);
    } else {
      file_->pwrite_at(0, p, n);
    }
  }
  void close() {
    if (file_) file_->close();
  }
  std::vector<uint64_t> words_;

 private:
  uint64_t size_;
  uint64_t pos_ = 0;
  uint64_t hash_start_ = 0;
  uint8_t* mem_ = nullptr;
  std::unique_ptr<FileWriter> file_;
};

template <class Src, class Dst>
void write_narrow(Sink& s, const Src* p, size_t n) {
  Dst tmp[4096];
  while (n) {
    size_t k = n < 4096 ? n : 4096;
    for (size_t i = 0; i < k; ++i) tmp[i] = static_cast<Dst>(p[i]);
    s.write(tmp, k * sizeof(Dst));
    p += k;
    n -= k;
  }
}

struct TempPath {
  std::string tmp, final;
  bool committed = false;
  explicit TempPath(const std::string& path) : final(path) {
    if (!path.empty()) tmp = path + ".partial-" + std::to_string(::getpid());
  }
  void commit() {
    if (tmp.empty()) return;
    if (std::rename(tmp.c_str(), final.c_str()) != 0)
      throw IoError("cannot move '" + tmp + "' to '" + final + "': " + std::strerror(errno));
    committed = true;
  }
  ~TempPath() {
    if (!tmp.empty() && !committed) std::remove(tmp.c_str());
  }
};
}  // namespace

std::shared_ptr<Image> CsrBuilder::finish(const std::string& path, const std::string& fingerprint) {
  if (finished_) throw std::logic_error("builder already finished");
  if (fingerprint.size() > kFingerprintMax)
    throw std::invalid_argument("tokenizer fingerprint longer than " + std::to_string(kFingerprintMax) + " bytes");
  close_from(1);
  finished_ = true;
  for (int k = 1; k < order_; ++k) child_[k].push(n_[k + 1]);
  const uint64_t vocab = std::max<uint64_t>(vocab_, max_tok_plus1_);
  if (vocab > (1ull << 31)) throw std::invalid_argument("vocabulary too large");
  const uint32_t token_bytes = vocab <= 65536 ? 2 : 4;

  std::vector<LevelShape> shape(order_ + 1);
  for (int k = 1; k <= order_; ++k) {
    const uint64_t n = n_[k];
    // Narrowest count width whose escaped nodes carry at most 1/4 of the level's count mass:
    // queries hit nodes in proportion to their counts and an escaped count costs a search of the
    // escape table, so escapes must be uncommon in lookups, not just in nodes (measured on ShareGPT:
    // 1/20 costs +1 byte/node for ~8% faster queries; 1/4 is the middle).
    uint32_t cb = 8;
    uint64_t esc = 0;
    const uint32_t widths[3] = {1, 2, 4};
    for (int w = 0; w < 3; ++w) {
      if (mass_ge_[w][k] <= mass_[k] / 4) {
        cb = widths[w];
        esc = ge_[w][k];
        break;
      }
    }
    shape[k].n = n;
    shape[k].count_bytes = cb;
    shape[k].n_esc = esc;
    shape[k].child_bytes = (k < order_ && n_[k + 1] > 0xFFFFFFFFull) ? 8 : 4;
  }
  // Level-2 hash index: (level-1 parent, token) -> level-2 index, load <= 1/2 (misses, the
  // common case, then end after ~2.5 probes on average).
  std::vector<uint32_t> htable;
  uint64_t max_probe = 0;
  if (order_ >= 2 && n_[2] > 0 && n_[2] < kHashEmpty) {
    const uint64_t slots = 2 * n_[2] + 8;
    htable.assign(slots, kHashEmpty);
    ColumnCursor<uint64_t> starts(child_[1]);
    ColumnCursor<uint32_t> parents(tok_[1]);
    ColumnCursor<uint32_t> toks(tok_[2]);
    uint64_t begin = starts.next();
    for (uint64_t p = 0; p < n_[1]; ++p) {
      const uint64_t end = starts.next();
      const uint32_t ptok = parents.next();
      for (uint64_t j = begin; j < end; ++j) {
        uint64_t i = hash_slot(ptok, toks.next(), slots);
        uint64_t probes = 1;
        while (htable[i] != kHashEmpty) {
          if (++i == slots) i = 0;
          ++probes;
        }
        htable[i] = static_cast<uint32_t>(j);
        max_probe = std::max(max_probe, probes);
      }
      begin = end;
    }
    shape[2].hash_slots = slots;
  }
  std::vector<Section> table;
  const uint64_t file_size = compute_layout(order_, token_bytes, shape, table);
  if (order_ >= 2) table.back().reserved = static_cast<uint32_t>(std::min<uint64_t>(max_probe, UINT32_MAX));

  Header h{};
  std::memcpy(h.magic, kMagic, 8);
  h.version = kVersion;
  h.header_bytes = kHeaderBytes;
  h.order = static_cast<uint32_t>(order_);
  h.token_bytes = token_bytes;
  h.vocab_size = vocab;
  h.num_nodes = nodes();
  h.file_size = file_size;
  h.root_count = path_cnt_[0];
  h.fingerprint_len = static_cast<uint32_t>(fingerprint.size());
  h.num_sections = static_cast<uint32_t>(table.size());
  std::memcpy(h.fingerprint, fingerprint.data(), fingerprint.size());

  TempPath out(path);
  Sink sink(out.tmp, file_size);
  sink.write(&h, sizeof(h));
  sink.write(table.data(), table.size() * sizeof(Section));
  sink.pad_to(table[0].offset);
  sink.start_hash();
  size_t si = 0;
  for (int k = 1; k <= order_; ++k) {
    // tokens
    sink.pad_to(table[si].offset);
    tok_[k].for_each_block([&](const uint32_t* p, size_t n) {
      if (token_bytes == 2)
        write_narrow<uint32_t, uint16_t>(sink, p, n);
      else
        sink.write(p, n * 4);
    });
    // counts (+ escapes collected on the way)
    sink.pad_to(table[si + 1].offset);
    const uint32_t cb = shape[k].count_bytes;
    const uint64_t sent = sentinel(cb);
    std::vector<uint64_t> esc_idx, esc_val;
    uint64_t idx = 0;
    cnt_[k].for_each_block([&](const uint64_t* p, size_t n) {
      if (cb == 8) {
        sink.write(p, n * 8);
        return;
      }
      std::vector<uint64_t> narrowed(p, p + n);
      for (size_t i = 0; i < n; ++i) {
        if (p[i] >= sent) {
          esc_idx.push_back(idx + i);
          esc_val.push_back(p[i]);
          narrowed[i] = sent;
        }
      }
      if (cb == 1) write_narrow<uint64_t, uint8_t>(sink, narrowed.data(), n);
      if (cb == 2) write_narrow<uint64_t, uint16_t>(sink, narrowed.data(), n);
      if (cb == 4) write_narrow<uint64_t, uint32_t>(sink, narrowed.data(), n);
      idx += n;
    });
    if (esc_idx.size() != shape[k].n_esc) throw std::logic_error("escape count mismatch");
    sink.pad_to(table[si + 2].offset);
    if (!esc_idx.empty()) sink.write(esc_idx.data(), esc_idx.size() * 8);
    sink.pad_to(table[si + 3].offset);
    if (!esc_val.empty()) sink.write(esc_val.data(), esc_val.size() * 8);
    si += 4;
    if (k < order_) {
      sink.pad_to(table[si].offset);
      child_[k].for_each_block([&](const uint64_t* p, size_t n) {
        if (shape[k].child_bytes == 4)
          write_narrow<uint64_t, uint32_t>(sink, p, n);
        else
          sink.write(p, n * 8);
      });
      ++si;
    }
  }
  if (order_ >= 2) {
    sink.pad_to(table.back().offset);
    if (!htable.empty()) sink.write(htable.data(), htable.size() * 4);
  }
  sink.pad_to(file_size);
  h.payload_checksum = sink.payload_digest();
  h.header_checksum = header_checksum(h, table.data(), table.size());
  sink.write_header(&h, sizeof(h));
  sink.close();
  if (!path.empty()) {
    out.commit();
    return nullptr;
  }
  return Image::from_memory(std::move(sink.words_), file_size);
}

// ---------------------------------------------------------------------------------------------
// Algorithms

std::shared_ptr<TrieView> view_of(std::shared_ptr<Image> img) {
  return std::make_shared<TrieView>(std::move(img), Check::kTrusted, "in-memory trie");
}

std::shared_ptr<TrieView> empty_trie(int order, uint64_t vocab_size, const std::string& fingerprint) {
  CsrBuilder b(order, vocab_size, "");
  return view_of(b.finish("", fingerprint));
}

namespace {
void merge_rec(const TrieView& a, const TrieView& b, CsrBuilder& out, int k, uint64_t as, uint64_t ae, uint64_t bs,
               uint64_t be) {
  const int order = a.order();
  const int lvl = k + 1;
  while (as < ae || bs < be) {
    const int64_t ta = as < ae ? static_cast<int64_t>(a.token(lvl, as)) : INT64_MAX;
    const int64_t tb = bs < be ? static_cast<int64_t>(b.token(lvl, bs)) : INT64_MAX;
    uint64_t cas = 0, cae = 0, cbs = 0, cbe = 0;
    if (ta <= tb) {
      const uint64_t c = a.count(lvl, as);
      uint64_t cb = 0;
      if (ta == tb) cb = b.count(lvl, bs);
      if (cb > UINT64_MAX - c) throw FormatError("count overflow while merging");
      out.add_node(lvl, static_cast<uint32_t>(ta), c + cb);
      if (lvl < order) {
        a.children(lvl, as, cas, cae);
        if (ta == tb) b.children(lvl, bs, cbs, cbe);
      }
      ++as;
      if (ta == tb) ++bs;
    } else {
      out.add_node(lvl, static_cast<uint32_t>(tb), b.count(lvl, bs));
      if (lvl < order) b.children(lvl, bs, cbs, cbe);
      ++bs;
    }
    if (lvl < order) merge_rec(a, b, out, lvl, cas, cae, cbs, cbe);
  }
}

uint64_t prune_rec(const TrieView& t, CsrBuilder& out, int k, uint64_t i, uint64_t min_count) {
  uint64_t s, e;
  t.children(k, i, s, e);
  uint64_t reduced = 0;
  const int lvl = k + 1;
  for (uint64_t c = s; c < e; ++c) {
    const uint64_t cnt = t.count(lvl, c);
    if (cnt >= min_count) {
      out.add_node(lvl, t.token(lvl, c), cnt);
      if (lvl < t.order()) {
        const uint64_t r = prune_rec(t, out, lvl, c, min_count);
        out.adjust_current(lvl, -static_cast<int64_t>(r));
        reduced += r;
      }
    } else {
      reduced += cnt;
    }
  }
  return reduced;
}
}  // namespace

std::shared_ptr<Image> merge_tries(const TrieView& a, const TrieView& b, const std::string& out_path,
                                   const std::string& spill_dir, const std::string& fingerprint) {
  if (a.order() != b.order())
    throw std::invalid_argument("cannot merge tries of different order (" + std::to_string(a.order()) + " vs " +
                                std::to_string(b.order()) + ")");
  CsrBuilder out(a.order(), std::max(a.vocab_size(), b.vocab_size()), spill_dir);
  out.set_root_count(a.root_count() + b.root_count());
  merge_rec(a, b, out, 0, 0, a.level(1).n, 0, b.level(1).n);
  return out.finish(out_path, fingerprint);
}

std::shared_ptr<Image> prune_trie(const TrieView& t, uint64_t min_count, const std::string& out_path,
                                  const std::string& spill_dir) {
  CsrBuilder out(t.order(), t.vocab_size(), spill_dir);
  const uint64_t r = prune_rec(t, out, 0, 0, min_count);
  // The original leaves the pruned root at -r (its root starts from 0); we keep the consistent
  // value, which no query reads.
  out.set_root_count(t.root_count() >= r ? t.root_count() - r : 0);
  return out.finish(out_path, t.fingerprint());
}

void save_compact(const TrieView& t, const std::string& path, const std::string& fingerprint) {
  if (fingerprint.size() > kFingerprintMax)
    throw std::invalid_argument("tokenizer fingerprint longer than " + std::to_string(kFingerprintMax) + " bytes");
  const uint8_t* d = t.image()->data();
  const uint64_t size = t.image()->size();
  Header h;
  std::memcpy(&h, d, sizeof(h));
  std::memset(h.fingerprint, 0, sizeof(h.fingerprint));
  std::memcpy(h.fingerprint, fingerprint.data(), fingerprint.size());
  h.fingerprint_len = static_cast<uint32_t>(fingerprint.size());
  const Section* table = reinterpret_cast<const Section*>(d + kHeaderBytes);
  h.header_checksum = header_checksum(h, table, h.num_sections);
  TempPath out(path);
  FileWriter w(out.tmp);
  w.write(&h, sizeof(h));
  w.write(d + sizeof(h), size - sizeof(h));
  w.close();
  out.commit();
}

}  // namespace ngb
