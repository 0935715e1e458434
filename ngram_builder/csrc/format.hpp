// On-disk layout of the compact trie (".ngt") and the small I/O helpers shared by every writer.
//
// File = 256-byte header, section table, sections (each 64-byte aligned, zero padded; the file
// length is a multiple of 64). The trie is stored level by level (level k holds the k-grams),
// nodes of a level sorted by (parent, token), so a node's children are one contiguous run of the
// next level ("level-ordered CSR"). Per level k = 1..order, in this fixed order:
//   TOKENS   token id per node, 2 bytes when vocab_size <= 65536 else 4
//   COUNTS   count per node, 1/2/4/8 bytes (chosen per level to minimise size); the all-ones
//            value of a narrow width is an escape: the real count is in the ESC tables
//   ESC_IDX  u64 node indices of escaped counts, strictly increasing
//   ESC_VAL  u64 the escaped counts
//   CHILD    (levels < order only) n_k + 1 child-start offsets into level k+1, 4 or 8 bytes
// then, when order >= 2, one more section:
//   HASH     open-addressing table (u32 slots, 0xFFFFFFFF = empty, linear probing) mapping
//            (level-1 parent token, token) -> level-2 index; its `reserved` field holds the longest
//            probe sequence. Level-1 nodes have thousands of children, so back-off lookups and
//            context lookups through them are one probe instead of a long binary search.
// The root's count lives in the header; the root's children are all of level 1.
// All integers little-endian.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace ngb {

// Malformed or inconsistent data (maps to ngram_builder.NgramFormatError).
struct FormatError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A payload that breaks the format's invariants (header intact): the message is only what is wrong
// and where ("count 9 above its parent's 4, at level-3 node 17"); the Python layer prefixes the
// file and says how to rebuild it (maps to ngram_builder.CorruptTrieError).
struct CorruptError : FormatError {
  using FormatError::FormatError;
};
// Operating-system level I/O failure (maps to OSError).
struct IoError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr char kMagic[8] = {'D', 'A', 'R', 'T', 'N', 'G', 'R', 'M'};
constexpr uint32_t kVersion = 1;
constexpr uint32_t kHeaderBytes = 256;
constexpr int kMaxOrder = 8;
constexpr size_t kFingerprintMax = 64;
constexpr uint64_t kAlign = 64;

enum SectionKind : uint32_t { kTokens = 1, kCounts = 2, kEscIdx = 3, kEscVal = 4, kChild = 5, kHash = 6 };
constexpr uint32_t kHashEmpty = 0xFFFFFFFFu;

#pragma pack(push, 1)
struct Header {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  uint32_t order;
  uint32_t token_bytes;
  uint64_t vocab_size;
  uint64_t num_nodes;
  uint64_t file_size;
  uint64_t root_count;
  uint32_t fingerprint_len;
  uint32_t num_sections;
  char fingerprint[kFingerprintMax];
  uint64_t payload_checksum;
  uint64_t header_checksum;
  uint8_t reserved[kHeaderBytes - 144];
};
struct Section {
  uint32_t level;
  uint32_t kind;
  uint32_t elem_bytes;
  uint32_t reserved;
  uint64_t offset;
  uint64_t count;
};
#pragma pack(pop)
static_assert(sizeof(Header) == kHeaderBytes, "header size");
static_assert(sizeof(Section) == 32, "section size");

// Element i of a little-endian unsigned array of `width` (1/2/4/8) bytes per element.
inline uint64_t read_uint(const uint8_t* p, uint32_t width, uint64_t i) {
  switch (width) {
    case 1:
      return p[i];
    case 2: {
      uint16_t v;
      std::memcpy(&v, p + i * 2, 2);
      return v;
    }
    case 4: {
      uint32_t v;
      std::memcpy(&v, p + i * 4, 4);
      return v;
    }
    default: {
      uint64_t v;
      std::memcpy(&v, p + i * 8, 8);
      return v;
    }
  }
}
// The escape value of a count width (all ones); 8-byte counts have none.
inline uint64_t sentinel(uint32_t width) { return width >= 8 ? UINT64_MAX : ((1ull << (8 * width)) - 1); }

inline uint64_t align_up(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Per-level shape that fully determines the layout.
struct LevelShape {
  uint64_t n = 0;         // nodes on this level
  uint32_t count_bytes = 8;
  uint64_t n_esc = 0;
  uint32_t child_bytes = 4;  // only for levels < order
  uint64_t hash_slots = 0;   // only level 2: slots of the HASH section (0: no table)
};

inline uint32_t expected_sections(int order) {
  return static_cast<uint32_t>(order * 4 + (order - 1) + (order >= 2 ? 1 : 0));
}

// Slot of (parent, token) in a table of `slots` entries: two multiplies and a multiply-shift range
// reduction (it runs for every candidate of every query, so it must be cheap).
inline uint64_t hash_slot(uint32_t parent, uint32_t token, uint64_t slots) {
  uint64_t h = (static_cast<uint64_t>(parent) * 0x9E3779B97F4A7C15ull) ^ (static_cast<uint64_t>(token) * 0xC2B2AE3D27D4EB4Full);
  h ^= h >> 29;
  return static_cast<uint64_t>((static_cast<unsigned __int128>(h) * slots) >> 64);
}

// Section table for a given shape; returns the file size. Throws FormatError on overflow.
uint64_t compute_layout(int order, uint32_t token_bytes, const std::vector<LevelShape>& shape,
                        std::vector<Section>& out);

// 64-bit streaming checksum over bytes (word-at-a-time multiply/rotate mix). Not cryptographic:
// it catches truncation, bit rot and accidental edits.
class Hasher {
 public:
  void update(const void* data, size_t n);
  uint64_t digest() const;

 private:
  void mix(uint64_t w) {
    h_ ^= w * 0x87C37B91114253D5ull;
    h_ = (h_ << 31) | (h_ >> 33);
    h_ = h_ * 0x4CF5AD432745937Full + 0x52DCE729ull;
  }
  uint64_t h_ = 0x9E3779B97F4A7C15ull;
  uint64_t len_ = 0;
  uint8_t buf_[8] = {};
  size_t nbuf_ = 0;
};

uint64_t header_checksum(const Header& h, const Section* table, size_t n_sections);

// Buffered sequential file writer; hashes everything written after `start_hash()`.
class FileWriter {
 public:
  explicit FileWriter(const std::string& path);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  void write(const void* p, size_t n);
  void zeros(size_t n);
  void start_hash() { hashing_ = true; }
  uint64_t digest() const { return hash_.digest(); }
  uint64_t position() const { return pos_; }
  void pwrite_at(uint64_t offset, const void* p, size_t n);  // flushes first
  void close();

 private:
  void flush();
  std::string path_;
  FILE* f_ = nullptr;
  std::vector<uint8_t> buf_;
  uint64_t pos_ = 0;
  bool hashing_ = false;
  Hasher hash_;
};

// A file written under a temporary name ("<path>.partial-<pid>") and renamed over `path` by commit(): a
// reader never sees a half-written file, and one that was never committed is removed. An empty path
// (an image written to memory) does nothing.
struct TempPath {
  std::string tmp, final;
  bool committed = false;
  explicit TempPath(const std::string& path);
  TempPath(const TempPath&) = delete;
  TempPath& operator=(const TempPath&) = delete;
  void commit();  // throws IoError when the rename fails
  ~TempPath();
};

// Buffered sequential file reader with bounds checks (errors name the file).
class FileReader {
 public:
  explicit FileReader(const std::string& path);
  ~FileReader();
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;
  uint64_t size() const { return size_; }
  uint64_t position() const { return pos_; }
  // Reads exactly n bytes or throws FormatError("truncated ...").
  void read(void* p, size_t n);
  template <class T>
  T get() {
    T v;
    read(&v, sizeof(T));
    return v;
  }

 private:
  std::string path_;
  FILE* f_ = nullptr;
  uint64_t size_ = 0;
  uint64_t pos_ = 0;
  std::vector<uint8_t> buf_;
  size_t bpos_ = 0, blen_ = 0;
};

}  // namespace ngb
