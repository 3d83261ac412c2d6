// PlaceWrittenItems (include/cairn/manifest.h): a save's write results
// become the manifest's file table and item locations.
#include <algorithm>
#include <map>
#include <utility>

#include "cairn/manifest.h"

namespace cairn {

Status PlaceWrittenItems(Manifest* m, const std::vector<WrittenItem>& written) {
  using Name = std::pair<std::string, std::vector<uint64_t>>;  // offsets empty for bytes
  std::map<std::pair<bool, Name>, const WrittenItem*> where;
  std::map<std::string, uint64_t> file_sizes;
  for (const WrittenItem& w : written) {
    where[{w.chunk, {w.fqn, w.chunk ? w.offsets : std::vector<uint64_t>{}}}] = &w;
    file_sizes[w.file] = w.file_size;
  }
  std::vector<std::string> keys;
  for (const auto& [key, size] : file_sizes) keys.push_back(key);
  std::stable_sort(keys.begin(), keys.end(), [](const std::string& a, const std::string& b) {
    return a.size() < b.size();  // already by name within one length
  });
  std::map<std::string, uint32_t> file_index;
  m->files.clear();
  for (const std::string& key : keys) {
    file_index[key] = static_cast<uint32_t>(m->files.size());
    m->files.push_back({key, file_sizes[key]});
  }
  auto place = [&](bool chunk, const std::string& fqn, const std::vector<uint64_t>& offsets,
                   ItemLocation* loc) -> Status {
    auto it = where.find({chunk, {fqn, offsets}});
    if (it == where.end()) {
      std::string at;
      for (uint64_t o : offsets) at += (at.empty() ? "" : ", ") + std::to_string(o);
      return InvalidArgumentError("no data was written for '" + fqn + "'" +
                                  (chunk ? " [" + at + "]" : ""));
    }
    *loc = it->second->location;
    loc->file = file_index[it->second->file];
    return Status::OK();
  };
  for (ManifestTensor& t : m->tensors) {
    for (TensorChunk& c : t.chunks) {
      CAIRN_RETURN_IF_ERROR(place(true, t.fqn, c.offsets, &c.location));
    }
  }
  for (ManifestBytes& b : m->bytes) {
    CAIRN_RETURN_IF_ERROR(place(false, b.fqn, {}, &b.location));
  }
  return Status::OK();
}

}  // namespace cairn
