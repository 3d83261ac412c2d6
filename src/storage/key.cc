#include <string>

#include "cairn/storage.h"

namespace cairn {

Status ValidateKey(std::string_view key, bool allow_root) {
  if (key.empty()) {
    return allow_root ? Status::OK() : InvalidArgumentError("empty storage key");
  }
  auto bad = [&](std::string_view why) {
    return InvalidArgumentError("invalid storage key '" + std::string(key) +
                                "': " + std::string(why));
  };
  if (key.size() > 4096) return bad("longer than 4096 bytes");
  if (key.front() == '/') return bad("absolute paths are not allowed");
  if (key.find('\0') != std::string_view::npos) return bad("contains NUL");
  if (key.find('\\') != std::string_view::npos) return bad("contains a backslash");
  size_t start = 0;
  while (start <= key.size()) {
    size_t end = key.find('/', start);
    if (end == std::string_view::npos) end = key.size();
    std::string_view part = key.substr(start, end - start);
    if (part.empty()) return bad("empty path component");
    if (part == "." || part == "..") return bad("'.' and '..' components are not allowed");
    if (part.size() > 255) return bad("path component longer than 255 bytes");
    start = end + 1;
  }
  return Status::OK();
}

std::string JoinKey(std::string_view a, std::string_view b) {
  if (a.empty()) return std::string(b);
  if (b.empty()) return std::string(a);
  std::string out(a);
  if (out.back() != '/') out.push_back('/');
  out.append(b);
  return out;
}

Status Storage::PutAtomic(std::string_view key, std::string_view data, bool if_absent) {
  CAIRN_RETURN_IF_ERROR(ValidateKey(key));
  std::string tmp = std::string(key) + ".tmp";
  CAIRN_ASSIGN_OR_RETURN(auto f, NewWritableFile(tmp));
  Status s = f->WriteAt(0, data.data(), data.size());
  if (s.ok()) s = f->Sync();
  Status c = f->Close();
  if (s.ok()) s = c;
  if (s.ok() && if_absent) {
    auto e = Exists(key);
    if (!e.ok()) s = e.status();
    if (s.ok() && *e) s = AlreadyExistsError(std::string(key) + " already exists");
  }
  if (!s.ok()) {
    DeleteFile(tmp).IgnoreError();
    return s;
  }
  CAIRN_RETURN_IF_ERROR(Rename(tmp, key));
  size_t slash = key.rfind('/');
  return SyncDir(slash == std::string_view::npos ? std::string_view() : key.substr(0, slash));
}

}  // namespace cairn
