// Checksums of checkpoint data: XXH3-64 with seed 0, per block of a fixed
// size (the algorithm format.h names "xxh3-64"). This header is the one place
// that computes them; the writer, the reader, verify and the staging pool all
// call it, so they cannot disagree.
//
// Thread-safe (pure functions). The pool, when given, is only borrowed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cairn/status.h"
#include "cairn/thread_pool.h"

namespace cairn {

// The default checksum block (equal to format::kDefaultBlockSize).
inline constexpr uint64_t kChecksumBlockSize = uint64_t{16} << 20;

// XXH3-64 (seed 0) of `n` bytes at `data` (data may be null when n == 0).
uint64_t Checksum(const void* data, size_t n);

// The checksums of consecutive blocks of `block_size` bytes covering
// [data, data + n); the last block may be shorter; n == 0 gives no block.
// Blocks are hashed in parallel on `pool` and the calling thread (serially
// when pool is null). kInvalidArgument when block_size is 0.
Result<std::vector<uint64_t>> BlockChecksums(const void* data, size_t n,
                                             uint64_t block_size = kChecksumBlockSize,
                                             ThreadPool* pool = nullptr);

}  // namespace cairn
