// Internal: the shm backend's constructor with the posix knob a manager's
// memory tier needs.
#pragma once

#include <memory>
#include <string>

#include "cairn/storage.h"

namespace cairn::internal {

// NewShmStorage(name, create), with PosixStorageOptions::follow_root: the
// directory /dev/shm/<name> is resolved by its path on every call (a tier
// kept for a manager's life, whose directory may not exist yet).
Result<std::unique_ptr<Storage>> NewShmStorage(const std::string& name, bool create,
                                               bool follow_root);

}  // namespace cairn::internal
