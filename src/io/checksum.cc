#include "cairn/checksum.h"

#include "io/parallel.h"
#include "io/xxh3.h"

namespace cairn {

uint64_t Checksum(const void* data, size_t n) { return XXH3_64bits(n ? data : "", n); }

Result<std::vector<uint64_t>> BlockChecksums(const void* data, size_t n, uint64_t block_size,
                                             ThreadPool* pool) {
  if (block_size == 0) return InvalidArgumentError("checksum block size must be positive");
  size_t blocks = static_cast<size_t>((n + block_size - 1) / block_size);
  std::vector<uint64_t> out(blocks);
  const char* p = static_cast<const char*>(data);
  internal::ParallelFor(blocks, pool, 0, [&](size_t i) {
    uint64_t off = i * block_size;
    out[i] = XXH3_64bits(p + off, static_cast<size_t>(std::min<uint64_t>(block_size, n - off)));
  });
  return out;
}

}  // namespace cairn
