// The bytes of a trie image: huge-page buffers, and an image in memory, memory-mapped or copied from a file.
#include "trie.hpp"

#include <cerrno>
#include <cstdio>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>

namespace ngb {

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

}  // namespace ngb
