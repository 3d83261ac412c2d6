#include "memory_commands.h"

#include <cstdio>
#include <ctime>
#include <nlohmann/json.hpp>
#include <vector>

#include "cairn/memory_tier.h"

namespace cairn {

// The JSON of `cairn ls-memory --json`: one object per tier, keys named as the
// fields (an owner's start_time and boot_id stay out: they only identify it).
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(MemoryTierOwner, pid, hostname, rank, state, heartbeat)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(MemoryTierInfo, name, path, kind, bytes, steps, run_root, run_id,
                                   created, last_restored, last_active, owners, in_use, orphaned,
                                   reason)

namespace cli {

namespace {

std::string Owners(const MemoryTierInfo& t) {
  std::string out;
  for (const auto& o : t.owners) {
    if (!out.empty()) out += ",";
    out += o.hostname + ":" + std::to_string(o.pid);
    if (o.rank >= 0) out += "/r" + std::to_string(o.rank);
    out += "(" + o.state + ")";
  }
  return out.empty() ? "-" : out;
}

std::string State(const MemoryTierInfo& t) {
  if (t.in_use) return "in use";
  return (t.orphaned ? "orphaned: " : "idle: ") + t.reason;
}

MemoryTierScanOptions Scan(const MemoryCommandOptions& opts) {
  MemoryTierScanOptions s;
  s.shm_root = opts.shm_root;
  s.grace_seconds = opts.grace_seconds;
  return s;
}

}  // namespace

int CmdLsMemory(const MemoryCommandOptions& opts) {
  auto tiers = ListMemoryTiers(Scan(opts));
  if (!tiers.ok()) {
    std::fprintf(stderr, "cairn: %s\n", tiers.status().ToString().c_str());
    return 1;
  }
  if (opts.as_json) {
    nlohmann::json all = nlohmann::json::array();
    for (const auto& t : *tiers) all.push_back(t);
    std::printf("%s\n", all.dump(2).c_str());
    return 0;
  }
  std::printf("%-24s %-8s %10s %8s  %-32s %-28s %s\n", "NAME", "KIND", "SIZE", "STEP", "RUN ROOT",
              "OWNER", "STATE");
  uint64_t total = 0;
  for (const auto& t : *tiers) {
    total += t.bytes;
    std::string step = t.steps.empty() ? "-" : std::to_string(t.steps.front());
    std::printf("%-24s %-8s %10s %8s  %-32s %-28s %s\n", t.name.c_str(), t.kind.c_str(),
                HumanBytes(t.bytes).c_str(), step.c_str(),
                t.run_root.empty() ? "-" : t.run_root.c_str(), Owners(t).c_str(), State(t).c_str());
  }
  std::printf("%zu memory tier(s), %s of shared memory\n", tiers->size(),
              HumanBytes(total).c_str());
  return 0;
}

int CmdGc(const MemoryCommandOptions& opts) {
  std::vector<MemoryTierInfo> gone;
  Status s = ReclaimOrphanedMemoryTiers(Scan(opts), &gone, opts.dry_run);
  uint64_t freed = 0;
  for (const auto& t : gone) {
    freed += t.bytes;
    std::printf("%s %s (%s, %s): %s\n", opts.dry_run ? "would remove" : "removed", t.name.c_str(),
                t.kind.c_str(), HumanBytes(t.bytes).c_str(), t.reason.c_str());
  }
  if (!s.ok()) {
    std::fprintf(stderr, "cairn: %s\n", s.ToString().c_str());
    return 1;
  }
  if (gone.empty()) {
    std::printf("no orphaned memory tier\n");
  } else {
    std::printf("%s %s in %zu memory tier(s)\n", opts.dry_run ? "would free" : "freed",
                HumanBytes(freed).c_str(), gone.size());
  }
  return 0;
}

}  // namespace cli
}  // namespace cairn
