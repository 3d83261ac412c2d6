// Finding checkpoints under a root: `step_<N>` ordering, committed vs partial
// (ParseStep, ListCheckpoints, LatestValid).
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "cairn/checkpoint.h"
#include "checkpoint/io_util.h"

namespace cairn {

using internal::Where;

std::optional<uint64_t> ParseStep(std::string_view name) {
  constexpr std::string_view kPrefix = "step_";
  if (name.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  std::string_view digits = name.substr(kPrefix.size());
  if (digits.empty() || digits.size() > 19) return std::nullopt;
  uint64_t v = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

Result<std::vector<CheckpointInfo>> ListCheckpoints(Storage* storage, std::string_view root) {
  CAIRN_ASSIGN_OR_RETURN(bool exists, storage->Exists(root));
  if (!exists) return NotFoundError("no such directory: " + Where(storage, root));
  CAIRN_ASSIGN_OR_RETURN(auto entries, storage->List(root));
  std::vector<CheckpointInfo> out;
  for (const auto& e : entries) {
    if (!e.is_dir) continue;
    CheckpointInfo info;
    info.name = e.name;
    info.step = ParseStep(e.name);
    std::string dir = internal::JoinDir(root, e.name);
    auto m = ReadManifest(storage, dir);
    if (m.ok()) {
      info.committed = true;
      info.bytes = m->TotalBytes();
      info.created_unix_ms = m->created_unix_ms;
      info.world_size = m->world_size;
    } else {
      info.status = m.status();
      // A partial checkpoint's size: whatever files it already has.
      for (std::string_view sub : {std::string_view(), format::kDataDir}) {
        auto list = storage->List(internal::JoinDir(dir, sub));
        if (!list.ok()) continue;
        for (const auto& f : *list) info.bytes += f.is_dir ? 0 : f.size;
      }
    }
    out.push_back(std::move(info));
  }
  std::sort(out.begin(), out.end(), [](const CheckpointInfo& a, const CheckpointInfo& b) {
    if (a.step.has_value() != b.step.has_value()) return !a.step.has_value();
    if (a.step != b.step) return *a.step < *b.step;
    if (a.created_unix_ms != b.created_unix_ms) return a.created_unix_ms < b.created_unix_ms;
    return a.name < b.name;
  });
  return out;
}

Result<std::optional<std::string>> LatestValid(Storage* storage, std::string_view root) {
  CAIRN_ASSIGN_OR_RETURN(auto list, ListCheckpoints(storage, root));
  for (auto it = list.rbegin(); it != list.rend(); ++it) {
    if (it->committed) return std::optional<std::string>(it->name);
  }
  return std::optional<std::string>();
}

}  // namespace cairn
