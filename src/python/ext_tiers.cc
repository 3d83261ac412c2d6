// Bindings for a manager's tiers (include/cairn/tiers.h): the policy is C++;
// Python logs what was skipped and runs the collectives.
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <climits>
#include <memory>
#include <string>
#include <vector>

#include "cairn/chaos.h"
#include "cairn/drill.h"
#include "cairn/memory_tier.h"
#include "cairn/tiers.h"
#include "common.h"
#include "staging/mapped_file.h"
#include "without_gil.h"

namespace nb = nanobind;

namespace cairn::python {
namespace {

TierKind Kind(const std::string& name) { return ValueOrThrow(ParseTierName(name)); }

// [(uri, status)] of skipped checkpoints, for Python to log or warn about.
nb::list SkippedList(const std::vector<SkippedCheckpoint>& skipped) {
  nb::list out;
  for (const auto& s : skipped) out.append(nb::make_tuple(s.uri, s.status.ToString()));
  return out;
}

nb::object Reader(MemoryCheckpoint& c) {
  return nb::cast(new PyCheckpointReader(c.uri, std::move(c.storage), std::move(c.reader)),
                  nb::rv_policy::take_ownership);
}

// The manager's memory_limit in bytes (None: no limit): an int, or a float
// fraction of the shared memory at `shm_root`. Raises InvalidArgumentError.
nb::object MemoryLimitBytes(nb::handle limit, const std::string& shm_root) {
  if (limit.is_none()) return nb::none();
  auto invalid = [](const std::string& msg) { RaiseStatus(InvalidArgumentError(msg)); };
  // A slot file grows in steps of kGrowAlign, next to the tier's bookkeeping
  // files (a few pages: owner records, lock, slot manifests): a limit below one
  // step and that would refuse every save, so it is refused here, at construction.
  constexpr uint64_t kGrow = ::cairn::internal::MappedShmFile::kGrowAlign + (uint64_t{256} << 10);
  auto too_small = [&](const std::string& what) {
    return "memory_limit " + what + " is below one step of the memory tier's growth (" +
           HumanBytes(::cairn::internal::MappedShmFile::kGrowAlign) +
           " per rank's slot, plus 256 KiB for its bookkeeping): every save would fail; raise " +
           "it, or pass memory=False";
  };
  if (PyBool_Check(limit.ptr()) || !(PyLong_Check(limit.ptr()) || PyFloat_Check(limit.ptr()))) {
    invalid("memory_limit must be bytes (int) or a fraction of /dev/shm (float), got " +
            std::string(nb::repr(limit).c_str()));
  }
  const std::string str(nb::str(limit).c_str());
  if (PyLong_Check(limit.ptr())) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(limit.ptr(), &overflow);
    if (overflow < 0 || (overflow == 0 && v <= 0))
      invalid("memory_limit must be > 0 bytes, got " + str);
    if (overflow == 0 && static_cast<uint64_t>(v) < kGrow) invalid(too_small(str));
    return nb::int_(overflow > 0 ? LLONG_MAX : v);
  }
  double f = PyFloat_AsDouble(limit.ptr());
  if (!(f > 0.0 && f <= 1.0)) {
    invalid("memory_limit as a fraction of /dev/shm must be in (0, 1], got " + str);
  }
  SharedMemoryRoom room = ValueOrThrow(GetSharedMemoryRoom(shm_root));
  auto bytes = static_cast<long long>(f * static_cast<double>(room.total));
  if (static_cast<uint64_t>(bytes) < kGrow) {
    invalid(too_small(str + " of " + shm_root + " (" + HumanBytes(room.total) +
                      ") = " + std::to_string(bytes) + " bytes"));
  }
  return nb::int_(bytes);
}

bool IsInt(nb::handle v) { return PyLong_Check(v.ptr()) && !PyBool_Check(v.ptr()); }

long long AsLongLong(nb::handle v) {
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  return overflow > 0 ? LLONG_MAX : overflow < 0 ? LLONG_MIN : x;
}

std::string Repr(nb::handle v) { return nb::repr(v).c_str(); }

// CheckpointManager's counts and timeout, checked as its docstring says (the
// messages are part of its API). Returns memory_slots, its default resolved.
long long CheckManagerOptions(nb::handle replicas, bool memory, nb::handle keep,
                              nb::handle memory_slots, nb::handle durable_every,
                              nb::handle keep_local, nb::handle timeout) {
  auto invalid = [](const std::string& msg) { RaiseStatus(InvalidArgumentError(msg)); };
  if (!IsInt(replicas) || AsLongLong(replicas) < 0) {
    invalid("replicas must be an int >= 0, got " + Repr(replicas));
  }
  const long long k = AsLongLong(replicas);
  nb::object slots = memory_slots.is_none() ? nb::int_(memory ? 2 : 1) : nb::borrow(memory_slots);
  nb::object one = nb::int_(1);
  for (auto [name, v] : {std::pair<const char*, nb::handle>{"keep", keep.is_none() ? one : keep},
                         {"memory_slots", slots},
                         {"durable_every", durable_every}}) {
    if (!IsInt(v) || AsLongLong(v) < 1)
      invalid(std::string(name) + " must be an int >= 1, got " + Repr(v));
  }
  const long long n = AsLongLong(slots);
  if (k && memory && n < 2) {
    // With one slot the save of step s overwrites step s-1 in every node's
    // memory tier before s is replicated: a node lost in that window leaves no
    // step whole in cluster memory, whatever the peers keep.
    invalid("replicas=" + std::to_string(k) + " needs memory_slots >= 2, got " + std::to_string(n) +
            ": with one slot a node lost while a save replicates leaves no step in cluster "
            "memory (the previous one is overwritten on every node)");
  }
  if (!keep_local.is_none() && (!PyLong_Check(keep_local.ptr()) || AsLongLong(keep_local) < 1)) {
    invalid("keep_local must be an int >= 1, got " + Repr(keep_local));
  }
  int falsy = PyObject_Not(timeout.ptr());
  int non_positive = falsy ? 0 : PyObject_RichCompareBool(timeout.ptr(), nb::int_(0).ptr(), Py_LE);
  if (falsy < 0 || non_positive < 0) throw nb::python_error();
  if (falsy || non_positive) invalid("timeout must be > 0 seconds, got " + Repr(timeout));
  return n;
}

}  // namespace

void RegisterTiers(nb::module_& m) {
  m.def(
      "chaos_point", [](const std::string& phase) { ChaosPoint(phase); }, nb::arg("phase"),
      "A place where the chaos harness may kill this process (cairn/chaos.h).");
  m.def("chaos_arm", &ChaosArm, "Starts the chaos harness's timer, if one is armed.");
  m.def("check_manager_options", &CheckManagerOptions, nb::arg("replicas").none(),
        nb::arg("memory"), nb::arg("keep").none(), nb::arg("memory_slots").none(),
        nb::arg("durable_every").none(), nb::arg("keep_local").none(), nb::arg("timeout").none(),
        "Raises InvalidArgumentError for a bad CheckpointManager count or timeout; returns "
        "memory_slots (default: 2 with memory, else 1).");
  m.attr("RUN_ID_FILE") = std::string(kRunIdFile);
  m.def("memory_tier_name", &MemoryTierName, nb::arg("root"),
        "The shm:// name of the memory tier of the run checkpointing to `root` on this node.");
  m.def(
      "memory_limit_bytes",
      [](nb::handle limit, const std::string& shm_root) {
        return MemoryLimitBytes(limit, shm_root);
      },
      nb::arg("limit").none(), nb::arg("shm_root") = std::string(kShmRoot),
      "memory_limit (None, bytes, or a fraction of /dev/shm) in bytes, validated.");
  m.def(
      "latest_valid_uri",
      [](PyStorage& root) {
        std::vector<SkippedCheckpoint> skipped;
        auto uri = WithoutGil([&] { return LatestValidIn(root.s.get(), root.uri, &skipped); });
        return nb::make_tuple(uri, SkippedList(skipped));
      },
      nb::arg("root"),
      "(URI of the newest committed checkpoint in the storage `root` or None, [(uri, status) "
      "of damaged newer ones]).");
  m.def(
      "pick_drill_checkpoint",
      [](const std::string& root, const std::string& tier, const std::string& local) {
        DrillPick p = WithoutGil([&] { return PickDrillCheckpoint(root, tier, local); });
        return nb::make_tuple(p.uri.empty() ? nb::none() : nb::cast(p.uri), p.source, p.why,
                              SkippedList(p.skipped));
      },
      nb::arg("root"), nb::arg("tier") = "", nb::arg("local") = "",
      "(uri or None, source tier, why there is none, skipped) of the checkpoint a drill loads.");

  m.def(
      "run_drill",
      [](const std::string& root, const std::string& tier, const std::string& local,
         const std::string& python, uint32_t world_size, double timeout, bool verify,
         ThreadPool& pool) {
        DrillOptions o{python, world_size, timeout, verify, &pool};
        DrillReport r = WithoutGil([&] { return RunDrill(root, tier, local, o); });
        nb::dict d;
        d["failure"] = r.failure;
        d["skipped"] = SkippedList(r.skipped);
        d["checkpoint"] = r.checkpoint;
        d["tier"] = r.tier;
        d["world_size"] = r.world_size;
        d["saved_world_size"] = r.saved_world_size;
        d["tensors"] = r.tensors;
        d["bytes"] = r.bytes;
        d["load_s"] = r.load_s;
        d["verify_s"] = r.verify_s;
        d["total_s"] = r.total_s;
        d["processes_s"] = r.processes_s;
        return d;
      },
      nb::arg("root"), nb::arg("tier"), nb::arg("local"), nb::arg("python"), nb::arg("world_size"),
      nb::arg("timeout"), nb::arg("verify"), nb::arg("pool"),
      "Runs a restore drill (cairn/drill.h); its report as a dict ('failure' non-empty when it "
      "failed).");

  nb::class_<TierSet>(m, "TierSet", "The tiers of one CheckpointManager (cairn/tiers.h).")
      .def(
          "__init__",
          [](TierSet* self, nb::handle root, nb::handle local, bool memory, uint32_t num_slots,
             std::optional<uint64_t> keep, uint64_t keep_local) {
            TierSetOptions o;
            // A tier is a path or URI (opened there, once) or a Storage the
            // caller opened (a fault-injecting wrapper, say).
            auto tier = [](nb::handle arg, std::string* path, std::shared_ptr<Storage>* storage) {
              if (nb::isinstance<PyStorage>(arg)) {
                *storage = nb::cast<PyStorage&>(arg).s;
              } else {
                *path = nb::cast<std::string>(arg);
              }
            };
            tier(root, &o.root, &o.root_storage);
            if (!local.is_none()) {
              tier(local, &o.local, &o.local_storage);
              if (!o.local_storage && o.local.empty()) {  // given, but empty (None: none)
                RaiseStatus(InvalidArgumentError("invalid local directory ''"));
              }
            }
            o.memory = memory;
            o.num_slots = num_slots;
            o.keep = keep;
            o.keep_local = keep_local;
            std::unique_ptr<TierSet> t = WithoutGil([&] { return TierSet::Open(std::move(o)); });
            new (self) TierSet(std::move(*t));
          },
          nb::arg("root"), nb::arg("local").none() = nb::none(), nb::arg("memory") = true,
          nb::arg("num_slots") = 1, nb::arg("keep") = 3, nb::arg("keep_local") = 3,
          "root, local: a path or URI, or an open Storage.")
      .def_prop_ro("root", &TierSet::root)
      .def_prop_ro(
          "local",
          [](const TierSet& t) { return t.local().empty() ? nb::none() : nb::cast(t.local()); })
      .def_prop_ro("shm_name", &TierSet::shm_name)
      .def_prop_ro("shm_dir", &TierSet::shm_dir)
      .def_prop_rw("run_id", &TierSet::run_id, &TierSet::set_run_id)
      .def("slower_tiers",
           [](const TierSet& t) {
             std::vector<std::string> out;
             for (TierKind k : t.SlowerTiers()) out.emplace_back(TierName(k));
             return out;
           })
      .def(
          "step_uri",
          [](const TierSet& t, const std::string& tier, uint64_t step) {
            return ValueOrThrow(t.StepUri(Kind(tier), step));
          },
          nb::arg("tier"), nb::arg("step"))
      .def(
          "tier_uri",
          [](const TierSet& t, const std::string& tier) {
            return ValueOrThrow(t.TierUri(Kind(tier)));
          },
          nb::arg("tier"))
      .def("slot_uri", &TierSet::SlotUri, nb::arg("slot"))
      .def(
          "storage",
          [](const TierSet& t, const std::string& tier) {
            std::shared_ptr<Storage> st = ValueOrThrow(t.TierStorage(Kind(tier)));
            return new PyStorage{st, st->Describe()};
          },
          nb::arg("tier"), nb::rv_policy::take_ownership,
          "The open storage of the 'memory' (slot<k>/ below it), 'local' or 'durable' tier "
          "(step_<N>/ below it), kept for the manager's life.")
      .def_static("step_dir", &StepDirName, nb::arg("step"), "'step_<N>', zero-padded.")
      .def_static("slot_dir", &TierSet::SlotDirName, nb::arg("slot"), "'slot<k>'.")
      .def("slot_data_path", &TierSet::SlotDataPath, nb::arg("slot"), nb::arg("rank"))
      .def("create_tiers", [](TierSet& t) { WithoutGil([&] { return t.CreateTiers(); }); })
      .def("read_or_create_run_id",
           [](TierSet& t) { return WithoutGil([&] { return t.ReadOrCreateRunId(); }); })
      .def("oldest_slot",
           [](const TierSet& t) {
             nb::gil_scoped_release release;
             return t.OldestSlot();
           })
      .def(
          "memory_checkpoints",
          [](const TierSet& t) {
            std::vector<MemoryCheckpoint> found;
            {
              nb::gil_scoped_release release;
              found = t.MemoryCheckpoints();
            }
            nb::dict out;  // {slot: (step, uri)}
            for (const auto& c : found) {
              out[nb::int_(std::stoul(c.name.substr(4)))] = nb::make_tuple(c.step, c.uri);
            }
            return out;
          },
          "{slot: (step, uri)} of this node's committed memory-tier checkpoints of this run.")
      .def(
          "candidates",
          [](TierSet& t, bool with_memory) {
            std::vector<MemoryCheckpoint> memory;
            std::vector<SkippedCheckpoint> skipped;
            auto found = WithoutGil([&] { return t.Candidates(with_memory, &memory, &skipped); });
            nb::list out;
            for (const auto& c : found) {
              out.append(nb::make_tuple(c.step, TierName(c.tier), c.uri, c.name));
            }
            nb::dict readers;  // {uri: CheckpointReader}, opened on the way
            for (auto& c : memory) readers[nb::cast(c.uri)] = Reader(c);
            return nb::make_tuple(out, SkippedList(skipped), readers);
          },
          nb::arg("with_memory"),
          "([(step, tier, uri, name)] fastest tier first (name: the directory in the tier's "
          "storage), [(uri, status)] skipped, {uri: reader} of the memory tier).")
      .def(
          "settle_untracked",
          [](TierSet& t, const std::vector<std::string>& tracked,
             std::optional<uint64_t> restored) {
            auto r = WithoutGil([&] { return t.SettleUntracked(tracked, restored); });
            nb::list failed;
            for (const auto& f : r.failed) failed.append(nb::make_tuple(f.uri, f.status.message()));
            return nb::make_tuple(r.adopt, r.removed, failed);
          },
          nb::arg("tracked"), nb::arg("restored").none(),
          "(name to adopt or None, names removed, [(uri, error)]) of the durable step_<N> "
          "directories not in `tracked` (cairn.ray).")
      .def(
          "prune",
          [](TierSet& t, const std::string& tier) -> std::optional<std::string> {
            TierKind kind = Kind(tier);
            Status s;
            {
              nb::gil_scoped_release release;
              s = t.Prune(kind);
            }
            if (s.ok()) return std::nullopt;
            return s.message();
          },
          nb::arg("tier"),
          "Retention of a slower tier; returns None, or the error to log (nothing is lost).");

  nb::class_<RestorePlanner>(m, "RestorePlanner",
                             "The restore decision of a group of ranks (cairn/tiers.h).")
      .def(
          "__init__",
          [](RestorePlanner* self,
             const std::vector<std::tuple<uint64_t, std::string, std::string, std::string>>& mine,
             const std::vector<std::vector<std::pair<uint64_t, std::string>>>& everyone) {
            std::vector<TierCheckpoint> m;
            for (const auto& [step, tier, uri, name] : mine) {
              m.push_back({step, Kind(tier), uri, name});
            }
            std::vector<std::vector<std::pair<uint64_t, TierKind>>> e(everyone.size());
            for (size_t r = 0; r < everyone.size(); ++r) {
              for (const auto& [step, tier] : everyone[r]) e[r].emplace_back(step, Kind(tier));
            }
            new (self) RestorePlanner(std::move(m), e);
          },
          nb::arg("mine"), nb::arg("everyone"))
      .def_prop_ro("steps", &RestorePlanner::steps)
      .def(
          "next",
          [](const RestorePlanner& p, uint64_t step) -> nb::object {
            const TierCheckpoint* c = p.Next(step);
            if (c == nullptr) return nb::none();
            return nb::make_tuple(TierName(c->tier), c->uri, c->name);
          },
          nb::arg("step"),
          "(tier, uri, name) of this rank's fastest source of `step` left, or None.")
      .def(
          "fail",
          [](RestorePlanner& p, uint64_t step, const std::string& tier, const std::string& why) {
            p.Fail(step, Kind(tier), why);
          },
          nb::arg("step"), nb::arg("tier"), nb::arg("why"))
      .def("failures", &RestorePlanner::Failures);
}

}  // namespace cairn::python
