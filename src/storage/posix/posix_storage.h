// Internal: the posix backend's constructor with the knobs other backends
// built on it need (shm is a posix tree on tmpfs without direct I/O).
#pragma once

#include <memory>
#include <string>

#include "cairn/storage.h"

namespace cairn::internal {

struct PosixStorageOptions {
  // Honour WriteOptions/ReadOptions::direct_io. When false, every file is
  // opened buffered (tmpfs rejects O_DIRECT anyway; this saves the attempt).
  bool allow_direct_io = true;
  // What Describe() returns; the root directory when empty.
  std::string describe;
  // Resolve the root by its path on every call instead of holding a
  // descriptor of it: a root removed and made again is followed (as a path
  // is), a missing root reads as kNotFound, and a call that creates a file
  // or directory creates the root first. A kept storage of a manager's tier
  // uses it: the user may remove the run directory under a live manager.
  bool follow_root = false;
};

// A posix Storage rooted at the directory `root_dir` (created with its
// parents when `create`; otherwise kNotFound when missing, unless
// opts.follow_root).
Result<std::unique_ptr<Storage>> NewPosixStorage(const std::string& root_dir, bool create,
                                                 const PosixStorageOptions& opts);

// mkdir -p for an absolute or relative local path (no root confinement; for
// roots only, never for keys).
Status MkdirAll(const std::string& path);

}  // namespace cairn::internal
