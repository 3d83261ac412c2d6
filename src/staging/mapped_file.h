// Internal: a file on tmpfs (node shared memory) mapped MAP_SHARED read-write,
// the memory behind one StagingPool slot.
//
// The file is never truncated to a smaller size (O_TRUNC would free its pages
// and lose a staged checkpoint), only grown, with fallocate so that a full
// /dev/shm fails here rather than as SIGBUS on a later store. The process
// holds an exclusive flock on it while open, so two live processes cannot use
// the same slot file; the lock dies with the process. Not thread-safe: the
// owner (StagingPool) serializes calls.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "cairn/status.h"
#include "cairn/thread_pool.h"

namespace cairn::internal {

class MappedShmFile {
 public:
  // Opens (creating when missing) the file at `path` and maps its current
  // contents. kFailedPrecondition if another process holds it.
  static Result<std::unique_ptr<MappedShmFile>> Open(const std::string& path);
  ~MappedShmFile();
  MappedShmFile(const MappedShmFile&) = delete;
  MappedShmFile& operator=(const MappedShmFile&) = delete;

  // Makes the file at least `min_bytes` long (rounded up to kGrowAlign) and
  // remaps it; the address may change. Existing bytes are kept.
  Status Grow(uint64_t min_bytes);
  // Maps every page into this process's page tables now (first write faults
  // would otherwise land in the training thread's stall), in parallel on
  // `pool` and the caller when given.
  Status Populate(ThreadPool* pool = nullptr);

  char* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Whether `path` names this file (the same inode), not another file made at
  // that path since it was opened.
  bool IsAt(const std::string& path) const;

  // Deletes the file's name if it still names this file (not a newer file
  // created at the same path since); the mapping stays valid.
  Status Unlink();

  // Unmaps and closes; also unlinks the file when `unlink`.
  Status Close(bool unlink);

  static constexpr uint64_t kGrowAlign = uint64_t{2} << 20;

 private:
  MappedShmFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  Status Map(uint64_t size);

  std::string path_;
  int fd_ = -1;
  char* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace cairn::internal
