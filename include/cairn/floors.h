// Machine floors: how fast this machine can copy memory and move bytes to and
// from a disk, measured the simple way, so that a checkpoint's figures can be
// judged against them (bench/checkpoint.py, `cairn bench`, `cairn floors`).
//
//   memcpy floor      one single-threaded memcpy of N bytes between two
//                     pre-faulted page-aligned buffers; only the memcpy is timed.
//   direct write      O_DIRECT sequential 16 MiB writes from one aligned buffer
//                     of random bytes into a new file, then fsync of the file and
//                     of its directory; timed from the open (which creates the
//                     file) to the directory fsync. N is rounded up to 16 MiB.
//   parallel direct   fio-style parallel O_DIRECT reads of that file, cold when
//   read              the page cache may be dropped: kFloorReadStreams threads,
//                     each with its own aligned 16 MiB buffer, thread i reading
//                     blocks i, i + streams, i + 2 streams ... (what `fio
//                     --rw=read --direct=1 --numjobs=8 --offset_increment` does,
//                     our own reader, so no fio is needed). Timed from the moment
//                     every thread is ready until the last one is done.
//
// Every function blocks the calling thread (the Python bindings release the
// GIL) and is safe to call from several threads at once, though concurrent
// floors measure each other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "cairn/status.h"

namespace cairn {

inline constexpr uint64_t kFloorBlockBytes = uint64_t{16} << 20;
inline constexpr size_t kFloorReadStreams = 8;

// One timing: `bytes` moved in `seconds`.
struct FloorSample {
  double seconds = 0;
  uint64_t bytes = 0;
};

// The memcpy floor of `bytes` bytes (> 0). kResourceExhausted when the two
// buffers cannot be mapped. Both buffers are unmapped before it returns.
Result<FloorSample> MeasureMemcpyFloor(uint64_t bytes);

struct DirectIoFloorOptions {
  // Drop the page cache between the write and the read (needs root; a read
  // that cannot drop it is reported as warm, not as an error).
  bool drop_caches = true;
  size_t read_streams = kFloorReadStreams;
};

struct DirectIoFloors {
  FloorSample write;
  FloorSample read;
  bool cold = false;  // whether the page cache was dropped before the read
};

// The direct write and parallel direct read floors of a file of `bytes`
// (> 0, rounded up to kFloorBlockBytes) created in the existing local
// directory `dir`, under a name of its own (so concurrent callers do not
// collide). The file is removed before this returns, on success and on every
// error. kInvalidArgument when the filesystem refuses O_DIRECT (tmpfs).
Result<DirectIoFloors> MeasureDirectIoFloors(const std::string& dir, uint64_t bytes,
                                             const DirectIoFloorOptions& opts = {});

// sync(2), then drops the page cache (writes 3 to /proc/sys/vm/drop_caches).
// Returns false when that is not permitted (not root, a container).
bool DropPageCache();

// Returns freed heap pages to the system (glibc malloc_trim), so memory
// figures measured next are honest; a no-op elsewhere.
void TrimHeap();

}  // namespace cairn
