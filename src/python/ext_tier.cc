// Bindings for memory-tier bookkeeping (include/cairn/memory_tier.h): the
// listing and the orphan decision live in C++; Python only converts.
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <vector>

#include "cairn/memory_tier.h"
#include "common.h"
#include "staging/mapped_file.h"
#include "struct_fields.h"
#include "without_gil.h"

namespace nb = nanobind;

namespace cairn::python {
namespace {

nb::dict OwnerDict(const MemoryTierOwner& o) {
  using O = MemoryTierOwner;
  return FieldsDict(o, F("pid", &O::pid), F("start_time", &O::start_time),
                    F("boot_id", &O::boot_id), F("hostname", &O::hostname), F("rank", &O::rank),
                    F("heartbeat", &O::heartbeat), F("state", &O::state));
}

nb::dict TierDict(const MemoryTierInfo& t) {
  using I = MemoryTierInfo;
  nb::dict d =
      FieldsDict(t, F("name", &I::name), F("path", &I::path), F("kind", &I::kind),
                 F("bytes", &I::bytes), F("steps", &I::steps), F("run_root", &I::run_root),
                 F("run_id", &I::run_id), F("created", &I::created),
                 F("last_restored", &I::last_restored), F("last_active", &I::last_active),
                 F("in_use", &I::in_use), F("orphaned", &I::orphaned), F("reason", &I::reason));
  if (t.steps.empty()) {
    d["step"] = nb::none();
  } else {
    d["step"] = t.steps.front();
  }
  nb::list owners;
  for (const auto& o : t.owners) owners.append(OwnerDict(o));
  d["owners"] = owners;
  return d;
}

MemoryTierScanOptions ScanOptions(const std::string& shm_root, double grace, double now) {
  MemoryTierScanOptions o;
  o.shm_root = shm_root;
  o.grace_seconds = grace;
  o.now = now;
  return o;
}

// The Python object: the lease until release() (the destructor releases it
// too, at garbage collection).
struct PyLease {
  std::unique_ptr<MemoryTierLease> lease;
};

}  // namespace

void RegisterTier(nb::module_& m) {
  m.attr("DEFAULT_ORPHAN_GRACE_S") = kDefaultOrphanGraceSeconds;
  // Slot files grow in steps of this many bytes (the budget counts whole steps).
  m.attr("SLOT_GROW_ALIGN") = internal::MappedShmFile::kGrowAlign;
  m.def(
      "list_memory_tiers",
      [](const std::string& shm_root, double grace, double now) {
        std::vector<MemoryTierInfo> tiers =
            WithoutGil([&] { return ListMemoryTiers(ScanOptions(shm_root, grace, now)); });
        nb::list out;
        for (const auto& t : tiers) out.append(TierDict(t));
        return out;
      },
      nb::arg("shm_root") = "", nb::arg("grace") = kDefaultOrphanGraceSeconds, nb::arg("now") = 0.0,
      "The node's memory tiers, each a dict, with the orphan decision.");
  m.def(
      "reclaim_memory_tiers",
      [](const std::string& shm_root, double grace, bool dry_run) {
        std::vector<MemoryTierInfo> gone;
        WithoutGil([&] {
          return ReclaimOrphanedMemoryTiers(ScanOptions(shm_root, grace, 0), &gone, dry_run);
        });
        nb::list out;
        for (const auto& t : gone) out.append(TierDict(t));
        return out;
      },
      nb::arg("shm_root") = "", nb::arg("grace") = kDefaultOrphanGraceSeconds,
      nb::arg("dry_run") = false, "Deletes orphaned memory tiers; returns what was deleted.");
  m.def(
      "shared_memory_room",
      [](const std::string& dir) {
        SharedMemoryRoom r = ValueOrThrow(GetSharedMemoryRoom(dir));
        nb::dict d;
        d["total"] = r.total;
        d["free"] = r.free;
        d["mem_available"] = r.mem_available;
        d["usable"] = r.usable();
        return d;
      },
      nb::arg("dir"));
  m.def(
      "slot_growth",
      [](const std::string& path, uint64_t used) {
        return ValueOrThrow(SlotGrowth(path, used, internal::MappedShmFile::kGrowAlign));
      },
      nb::arg("path"), nb::arg("used"),
      "Bytes the slot file at `path` must grow by to hold `used` bytes (0 when it is big "
      "enough).");
  m.def(
      "check_shared_memory_room",
      [](const std::string& shm_root, uint64_t grow) {
        WithoutGil([&] { return CheckSharedMemoryRoom(shm_root, grow); });
      },
      nb::arg("shm_root"), nb::arg("grow"),
      "Raises ResourceExhaustedError when `grow` bytes do not fit in the node's shared memory.");
  m.def(
      "check_memory_budget",
      [](const std::vector<std::tuple<std::string, uint64_t, bool, uint64_t, uint64_t, uint64_t>>&
             reports,
         const std::string& limit_arg) {
        std::vector<MemoryBudgetReport> rs;
        for (const auto& [node, grow, leader, footprint, room, limit] : reports) {
          rs.push_back({node, grow, leader, footprint, room, limit});
        }
        ThrowIfError(CheckMemoryBudget(rs, limit_arg));
      },
      nb::arg("reports"), nb::arg("limit_arg"),
      "The budget verdict on every rank's (node, grow, leader, footprint, room, limit): raises "
      "ResourceExhaustedError naming the node whose memory tier would pass its limit or room.");
  m.def("human_bytes", &HumanBytes, nb::arg("n"), "'512 B', '1.5 MiB', ...");
  m.def(
      "allocated_bytes", [](const std::string& dir) { return ValueOrThrow(AllocatedBytes(dir)); },
      nb::arg("dir"));

  nb::class_<PyLease>(m, "MemoryTierLease")
      .def(
          "__init__",
          [](PyLease* self, const std::string& dir, const std::string& run_root,
             const std::string& run_id, int64_t rank, const std::string& kind, double heartbeat) {
            new (self) PyLease{WithoutGil([&] {
              return MemoryTierLease::Acquire({.dir = dir,
                                               .kind = kind,
                                               .run_root = run_root,
                                               .run_id = run_id,
                                               .rank = rank,
                                               .heartbeat_seconds = heartbeat});
            })};
          },
          nb::arg("dir"), nb::arg("run_root") = "", nb::arg("run_id") = "", nb::arg("rank") = -1,
          nb::arg("kind") = "memory", nb::arg("heartbeat") = 10.0)
      .def("mark_restored",
           [](PyLease& l) {
             if (!l.lease) RaiseStatus(FailedPreconditionError("memory tier lease released"));
             ThrowIfError(l.lease->MarkRestored());
           })
      .def(
          "release",
          [](PyLease& l, bool remove_if_empty) {
            WithoutGil([&] {
              Status s = l.lease ? l.lease->Release(remove_if_empty) : Status();
              l.lease.reset();
              return s;
            });
          },
          nb::arg("remove_if_empty") = false)
      .def_prop_ro("dir", [](const PyLease& l) { return l.lease ? l.lease->dir() : ""; });
}

}  // namespace cairn::python
