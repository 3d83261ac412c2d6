// OpenStorage: the one place where a URI picks a backend.
#include "cairn/s3.h"
#include "cairn/storage.h"

namespace cairn {

Result<std::unique_ptr<Storage>> OpenStorage(std::string_view uri, bool create) {
  constexpr std::string_view kFile = "file://", kShm = "shm://", kMem = "mem://", kS3 = "s3://",
                             kSlow = "slow://";
  auto starts = [&](std::string_view p) { return uri.substr(0, p.size()) == p; };
  if (uri.empty()) return InvalidArgumentError("empty storage URI");
  if (starts(kShm)) {
    std::string_view name = uri.substr(kShm.size());
    while (!name.empty() && name.back() == '/') name.remove_suffix(1);
    return NewShmStorage(std::string(name), create);
  }
  if (uri == kMem) return std::unique_ptr<Storage>(NewMemStorage());
  if (starts(kS3)) return NewS3Storage(uri, S3OptionsFromEnvironment(), create);
  if (starts(kSlow)) return OpenThrottledStorage(uri);
  if (starts(kFile)) uri.remove_prefix(kFile.size());
  if (uri.find("://") != std::string_view::npos) {
    return InvalidArgumentError("unsupported storage URI scheme: " + std::string(uri));
  }
  return NewPosixStorage(std::string(uri), create);
}

std::string LocalDirOfUri(std::string_view uri) {
  constexpr std::string_view kFile = "file://", kShm = "shm://";
  auto starts = [&](std::string_view p) { return uri.substr(0, p.size()) == p; };
  if (uri.empty()) return {};
  if (starts(kShm)) {
    std::string_view name = uri.substr(kShm.size());
    while (!name.empty() && name.back() == '/') name.remove_suffix(1);
    if (!ValidateKey(name).ok()) return {};
    return ShmDirectory(name);
  }
  if (starts(kFile)) uri.remove_prefix(kFile.size());
  if (uri.empty() || uri.find("://") != std::string_view::npos) return {};
  return std::string(uri);
}

Status CheckCheckpointUri(std::string_view uri) {
  if (uri.empty()) return InvalidArgumentError("invalid checkpoint path ''");
  size_t scheme = uri.find("://");
  if (scheme == std::string_view::npos) return Status::OK();
  for (std::string_view ok : {"file", "shm", "s3"}) {
    if (uri.substr(0, scheme) == ok) return Status::OK();
  }
  return InvalidArgumentError("unsupported checkpoint URI scheme: " + std::string(uri));
}

}  // namespace cairn
