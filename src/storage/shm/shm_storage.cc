// ShmStorage: node shared memory as a Storage ("shm://NAME" = /dev/shm/NAME).
//
// /dev/shm is a tmpfs, so the posix backend already does the right thing:
// files live in RAM, survive the process that wrote them (not a reboot), and
// Sync/SyncDir are nearly free. What differs is set here: no O_DIRECT (tmpfs
// rejects it; asking would only cost an extra open per file) and names are
// confined to one directory per NAME. Memory mapping of staging buffers is in
// src/staging/mapped_file.cc (used by the StagingPool).
#include "storage/shm/shm_storage.h"

#include <string>

#include "cairn/storage.h"
#include "storage/posix/posix_storage.h"

namespace cairn {

std::string ShmDirectory(std::string_view name) {
  return std::string(kShmRoot) + (name.empty() ? "" : "/" + std::string(name));
}

Result<std::unique_ptr<Storage>> NewShmStorage(const std::string& name, bool create) {
  return internal::NewShmStorage(name, create, /*follow_root=*/false);
}

Result<std::unique_ptr<Storage>> internal::NewShmStorage(const std::string& name, bool create,
                                                         bool follow_root) {
  CAIRN_RETURN_IF_ERROR(ValidateKey(name).WithContext("shm:// name"));
  internal::PosixStorageOptions opts;
  opts.allow_direct_io = false;
  opts.describe = "shm://" + name;
  opts.follow_root = follow_root;
  Result<std::unique_ptr<Storage>> r = internal::NewPosixStorage(ShmDirectory(name), create, opts);
  if (!r.ok()) return r.status().WithContext("shm://" + name);
  return r;
}

}  // namespace cairn
