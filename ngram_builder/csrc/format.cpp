// Layout computation, checksum and buffered file I/O for the compact trie format.
#include "format.hpp"

#include <cerrno>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace ngb {

namespace {
uint64_t checked_mul(uint64_t a, uint64_t b) {
  if (a != 0 && b > UINT64_MAX / a) throw FormatError("section size overflows 64 bits");
  return a * b;
}
uint64_t checked_add(uint64_t a, uint64_t b) {
  if (b > UINT64_MAX - a) throw FormatError("file size overflows 64 bits");
  return a + b;
}
}  // namespace

uint64_t compute_layout(int order, uint32_t token_bytes, const std::vector<LevelShape>& shape,
                        std::vector<Section>& out) {
  out.clear();
  const uint64_t n_sections = expected_sections(order);
  uint64_t pos = align_up(kHeaderBytes + n_sections * sizeof(Section));
  auto add = [&](uint32_t level, uint32_t kind, uint32_t elem, uint64_t count) {
    Section s{};
    s.level = level;
    s.kind = kind;
    s.elem_bytes = elem;
    s.offset = pos;
    s.count = count;
    out.push_back(s);
    pos = checked_add(pos, checked_mul(elem, count));
    pos = align_up(pos);
    if (pos == 0) throw FormatError("file size overflows 64 bits");
  };
  for (int k = 1; k <= order; ++k) {
    const LevelShape& L = shape[k];
    add(k, kTokens, token_bytes, L.n);
    add(k, kCounts, L.count_bytes, L.n);
    add(k, kEscIdx, 8, L.n_esc);
    add(k, kEscVal, 8, L.n_esc);
    if (k < order) add(k, kChild, L.child_bytes, checked_add(L.n, 1));
  }
  if (order >= 2) add(2, kHash, 4, shape[2].hash_slots);
  return pos;
}

void Hasher::update(const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  len_ += n;
  if (nbuf_) {
    while (n && nbuf_ < 8) {
      buf_[nbuf_++] = *p++;
      --n;
    }
    if (nbuf_ < 8) return;
    uint64_t w;
    std::memcpy(&w, buf_, 8);
    mix(w);
    nbuf_ = 0;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    mix(w);
    p += 8;
    n -= 8;
  }
  while (n) {
    buf_[nbuf_++] = *p++;
    --n;
  }
}

uint64_t Hasher::digest() const {
  Hasher c = *this;
  if (c.nbuf_) {
    uint8_t tail[8] = {};
    std::memcpy(tail, c.buf_, c.nbuf_);
    uint64_t w;
    std::memcpy(&w, tail, 8);
    c.mix(w);
  }
  uint64_t h = c.h_ ^ len_;
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ull;
  h ^= h >> 33;
  return h;
}

uint64_t header_checksum(const Header& h, const Section* table, size_t n_sections) {
  Header copy = h;
  copy.header_checksum = 0;
  Hasher hs;
  hs.update(&copy, sizeof(copy));
  hs.update(table, n_sections * sizeof(Section));
  return hs.digest();
}

FileWriter::FileWriter(const std::string& path) : path_(path) {
  f_ = std::fopen(path.c_str(), "wb");
  if (!f_) throw IoError("cannot open '" + path + "' for writing: " + std::strerror(errno));
  buf_.reserve(1 << 20);
}

FileWriter::~FileWriter() {
  if (f_) std::fclose(f_);
}

void FileWriter::flush() {
  if (buf_.empty()) return;
  if (std::fwrite(buf_.data(), 1, buf_.size(), f_) != buf_.size())
    throw IoError("write to '" + path_ + "' failed: " + std::strerror(errno));
  buf_.clear();
}

void FileWriter::write(const void* p, size_t n) {
  if (hashing_) hash_.update(p, n);
  pos_ += n;
  const uint8_t* b = static_cast<const uint8_t*>(p);
  if (buf_.size() + n > buf_.capacity()) flush();
  if (n >= buf_.capacity()) {
    if (std::fwrite(b, 1, n, f_) != n) throw IoError("write to '" + path_ + "' failed: " + std::strerror(errno));
    return;
  }
  buf_.insert(buf_.end(), b, b + n);
}

void FileWriter::zeros(size_t n) {
  static const uint8_t z[256] = {};
  while (n) {
    size_t k = n < sizeof(z) ? n : sizeof(z);
    write(z, k);
    n -= k;
  }
}

void FileWriter::pwrite_at(uint64_t offset, const void* p, size_t n) {
  flush();
  if (std::fseek(f_, static_cast<long>(offset), SEEK_SET) != 0 || std::fwrite(p, 1, n, f_) != n)
    throw IoError("write to '" + path_ + "' failed: " + std::strerror(errno));
  std::fseek(f_, 0, SEEK_END);
}

void FileWriter::close() {
  flush();
  if (f_) {
    int rc = std::fclose(f_);
    f_ = nullptr;
    if (rc != 0) throw IoError("closing '" + path_ + "' failed: " + std::strerror(errno));
  }
}

FileReader::FileReader(const std::string& path) : path_(path) {
  f_ = std::fopen(path.c_str(), "rb");
  if (!f_) throw IoError("cannot open '" + path + "': " + std::strerror(errno));
  struct stat st {};
  if (fstat(fileno(f_), &st) != 0 || !S_ISREG(st.st_mode)) {
    std::fclose(f_);
    f_ = nullptr;
    throw IoError("'" + path + "' is not a regular file");
  }
  size_ = static_cast<uint64_t>(st.st_size);
  buf_.resize(1 << 20);
}

FileReader::~FileReader() {
  if (f_) std::fclose(f_);
}

void FileReader::read(void* p, size_t n) {
  uint8_t* out = static_cast<uint8_t*>(p);
  if (n > size_ - pos_)
    throw FormatError("'" + path_ + "' is truncated: needed " + std::to_string(n) + " bytes at offset " +
                      std::to_string(pos_) + " of " + std::to_string(size_));
  while (n) {
    if (bpos_ == blen_) {
      blen_ = std::fread(buf_.data(), 1, buf_.size(), f_);
      bpos_ = 0;
      if (blen_ == 0) throw IoError("read from '" + path_ + "' failed");
    }
    size_t k = blen_ - bpos_ < n ? blen_ - bpos_ : n;
    std::memcpy(out, buf_.data() + bpos_, k);
    bpos_ += k;
    out += k;
    n -= k;
    pos_ += k;
  }
}

TempPath::TempPath(const std::string& path) : final(path) {
  if (!path.empty()) tmp = path + ".partial-" + std::to_string(::getpid());
}

void TempPath::commit() {
  if (tmp.empty()) return;
  if (std::rename(tmp.c_str(), final.c_str()) != 0)
    throw IoError("cannot move '" + tmp + "' to '" + final + "': " + std::strerror(errno));
  committed = true;
}

TempPath::~TempPath() {
  if (!tmp.empty() && !committed) std::remove(tmp.c_str());
}

}  // namespace ngb
