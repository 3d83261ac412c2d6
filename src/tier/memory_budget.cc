// The memory budget's verdicts (the protocol is described in
// include/cairn/memory_tier.h, above MemoryBudgetReport).
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "cairn/memory_tier.h"

namespace cairn {

std::string HumanBytes(uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof(buf), u ? "%.1f %s" : "%.0f %s", v, units[u]);
  return buf;
}

Result<uint64_t> SlotGrowth(const std::string& path, uint64_t used, uint64_t align) {
  if (align == 0) return InvalidArgumentError("SlotGrowth: align must be > 0");
  struct stat st;
  uint64_t size = 0;
  if (::stat(path.c_str(), &st) == 0) {
    size = static_cast<uint64_t>(st.st_size);
  } else if (errno != ENOENT) {
    return ErrnoToStatus(errno, "stat " + path);
  }
  const uint64_t want = (used + align - 1) / align * align;
  return want > size ? want - size : 0;
}

Status CheckSharedMemoryRoom(const std::string& shm_root, uint64_t grow) {
  if (grow == 0) return Status::OK();
  CAIRN_ASSIGN_OR_RETURN(SharedMemoryRoom room, GetSharedMemoryRoom(shm_root));
  if (grow > room.usable()) {
    return ResourceExhaustedError("staging needs " + HumanBytes(grow) +
                                  " more shared memory on this node, but only " +
                                  HumanBytes(room.usable()) + " is free in " + shm_root +
                                  " (and the node's memory); the save was not started and the "
                                  "memory tier is unchanged");
  }
  return Status::OK();
}

Status CheckMemoryBudget(const std::vector<MemoryBudgetReport>& reports,
                         std::string_view limit_arg) {
  std::map<std::string, std::vector<const MemoryBudgetReport*>> nodes;  // sorted by name
  for (const MemoryBudgetReport& r : reports) nodes[r.node].push_back(&r);
  for (const auto& [node, ranks] : nodes) {
    uint64_t need = 0;
    const MemoryBudgetReport* leader = nullptr;
    for (const MemoryBudgetReport* r : ranks) {
      need += r->grow;
      if (r->leader && leader == nullptr) leader = r;
    }
    if (leader == nullptr) {
      return InvalidArgumentError("memory budget: no report from the leader of node " + node);
    }
    const uint64_t after = leader->footprint + need;
    if (need > 0 && after > leader->limit) {
      return ResourceExhaustedError("memory_limit: this save needs the memory tier on node " +
                                    node + " to grow by " + HumanBytes(need) + " to " +
                                    HumanBytes(after) + ", over its memory_limit of " +
                                    HumanBytes(leader->limit) + " (" + std::string(limit_arg) +
                                    "); the save was not started and the memory tier is unchanged");
    }
    if (need > leader->room) {
      return ResourceExhaustedError("staging needs " + HumanBytes(need) +
                                    " more shared memory on node " + node + ", but only " +
                                    HumanBytes(leader->room) +
                                    " is free; the save was not started and the memory tier "
                                    "is unchanged");
    }
  }
  return Status::OK();
}

}  // namespace cairn
