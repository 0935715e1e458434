// The streaming builder: nodes in pre-order into per-level columns (in RAM or spilled to files), then one
// compact image, in memory or written through a temporary file.
#include "trie.hpp"

#include <cerrno>
#include <cstdio>
#include <unistd.h>
#include <utility>

namespace ngb {

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

}  // namespace ngb
