// Small helpers shared by the checkpoint engine's .cc files (internal).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "cairn/manifest.h"
#include "cairn/status.h"
#include "cairn/storage.h"
#include "io/xxh3.h"

namespace cairn::internal {

// Granularity of one read or write syscall and of the per-thread staging
// buffers: big enough for full disk bandwidth, small enough to stay in cache
// while it is hashed.
inline constexpr uint64_t kIoPiece = uint64_t{2} << 20;

// A page-aligned heap buffer (usable for direct I/O).
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t size) : size_(size) {
    void* p = nullptr;
    if (size && posix_memalign(&p, 4096, size) == 0) data_ = static_cast<char*>(p);
  }
  ~AlignedBuffer() { std::free(data_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  size_t size_;
};

// The calling thread's staging buffer of kIoPiece bytes (nullptr if it could
// not be allocated). Lives until the thread exits; pool threads reuse it.
char* ThreadPieceBuffer();

// Number of checksum blocks of an item of `length` bytes.
inline uint64_t BlockCount(uint64_t length, uint64_t block_size) {
  return length / block_size + (length % block_size != 0);
}

// XXH3 streaming state with RAII.
class Hasher {
 public:
  Hasher() : st_(XXH3_createState()) { XXH3_64bits_reset(st_); }
  ~Hasher() { XXH3_freeState(st_); }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  bool ok() const { return st_ != nullptr; }
  void Update(const void* p, size_t n) { XXH3_64bits_update(st_, p, n); }
  uint64_t Digest() const { return XXH3_64bits_digest(st_); }

 private:
  XXH3_state_t* st_;
};

// "dir/key" (or "key" when dir is the root).
std::string JoinDir(std::string_view dir, std::string_view key);

// "tensor 'fqn'" or "tensor 'fqn' chunk at [0, 128]" when it has several.
std::string ChunkName(const ManifestTensor& t, size_t chunk);

// "<storage description>/dir", for error messages (reader.cc).
std::string Where(Storage* storage, std::string_view dir);

// Opens data file `f` of a checkpoint and checks its size against the
// manifest; a missing, non-regular or wrongly sized file is DataLoss.
// `needed_by` names an item stored in it, for the message (reader.cc).
Result<std::unique_ptr<ReadableFile>> OpenDataFile(Storage* storage, std::string_view dir,
                                                   const ManifestFile& f,
                                                   const std::string& needed_by,
                                                   const ReadOptions& opts = {});

}  // namespace cairn::internal
