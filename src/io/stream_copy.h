// StreamCopy: a copy whose stores bypass the cache (non-temporal), for
// copying far more bytes than the caches hold into memory nobody reads soon
// (a staging copy, ParallelCopy; a restore out of a mapped slot, ReadBlock).
// Ordinary stores first read each destination line into the cache (a read
// for ownership) and later write it back: three memory transfers per byte;
// streaming stores make it two. Here that took a 2-thread copy of 1.5 GiB from
// 12-14 GB/s to about 20 (torch's Tensor.copy_: 14-15).
#pragma once

#include <cstddef>

namespace cairn::internal {

// Copies n bytes from src to dst (not overlapping); the stores are visible to
// other threads when it returns (it ends with a store fence). Any alignment.
void StreamCopy(char* dst, const char* src, size_t n);

}  // namespace cairn::internal
