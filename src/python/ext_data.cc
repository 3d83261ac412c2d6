// Bindings for cairn.data's engine pieces: the partition arithmetic
// (include/cairn/partition.h; numpy int64 arrays in and out, shard work as
// [shard, offset] lists, the shapes cairn.data used before it moved to C++)
// and the worker lifetime (include/cairn/worker_lifetime.h).
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <array>

#include "cairn/partition.h"
#include "cairn/worker_lifetime.h"
#include "common.h"

namespace nb = nanobind;

namespace cairn::python {
namespace {

using Positions = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using PositionArray = nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>;
using Pair = std::array<int64_t, 2>;

// Hands `v` to numpy without a copy.
PositionArray ToNumpy(std::vector<int64_t> v) {
  auto* owned = new std::vector<int64_t>(std::move(v));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<int64_t>*>(p); });
  size_t shape[1] = {owned->size()};
  return PositionArray(owned->data(), 1, shape, owner);
}

std::vector<ShardWork> ToWork(const std::vector<Pair>& v) {
  std::vector<ShardWork> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = {v[i][0], v[i][1]};
  return out;
}

std::vector<SlotProgress> ToProgress(const std::vector<Pair>& v) {
  std::vector<SlotProgress> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = {v[i][0], v[i][1]};
  return out;
}

std::vector<Pair> FromWork(const std::vector<ShardWork>& v) {
  std::vector<Pair> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = {v[i].shard, v[i].offset};
  return out;
}

// drop_last as Python's truth of any object (numpy bools included), as the
// numpy code took it.
bool Truth(nb::handle h) {
  int r = PyObject_IsTrue(h.ptr());
  if (r < 0) throw nb::python_error();
  return r == 1;
}

void CheckWorldSize(int64_t world_size) {
  if (world_size < 1) ThrowIfError(InvalidArgumentError("world_size must be >= 1"));
}

// per_rank and epoch_end: kFn of an epoch's rest, world_size checked.
template <int64_t (*kFn)(int64_t, int64_t, int64_t, bool)>
int64_t OfEpoch(int64_t n, int64_t start, int64_t world_size, nb::handle drop_last) {
  CheckWorldSize(world_size);
  return kFn(n, start, world_size, Truth(drop_last));
}

}  // namespace

void RegisterData(nb::module_& m) {
  m.def("tie_worker_to_trainer", &TieWorkerToTrainer, nb::arg("trainer_pid"),
        "In a DataLoader worker: dies (SIGKILL) as soon as the trainer process is gone.");
  m.def(
      "arm_forked_children", [](int pid) { ArmForkedChildren(pid); }, nb::arg("pid"),
      "Children this thread of process `pid` forks die with it (0 disarms).");
  m.def("after_fork_in_child", &AfterForkInChild,
        "The fork hook of arm_forked_children (os.register_at_fork(after_in_child=...)).");
  m.def("per_rank", &OfEpoch<PerRank>, nb::arg("n"), nb::arg("start"), nb::arg("world_size"),
        nb::arg("drop_last"),
        "Samples each rank gets in the rest of an epoch that begins at `start`.");
  m.def("epoch_end", &OfEpoch<EpochEnd>, nb::arg("n"), nb::arg("start"), nb::arg("world_size"),
        nb::arg("drop_last"), "The position reached when the epoch is complete.");
  m.def(
      "rank_positions",
      [](int64_t n, int64_t start, int64_t world_size, int64_t rank, nb::handle drop_last) {
        CheckWorldSize(world_size);
        return ToNumpy(RankPositions(n, start, world_size, rank, Truth(drop_last)));
      },
      nb::arg("n"), nb::arg("start"), nb::arg("world_size"), nb::arg("rank"), nb::arg("drop_last"),
      "Global positions of `rank`'s samples, in its consumption order.");
  m.def(
      "worker_positions",
      [](Positions rank_pos, int64_t num_workers, int64_t worker_id, int64_t batch_size) {
        std::span<const int64_t> p(rank_pos.data(), rank_pos.shape(0));
        return ToNumpy(WorkerPositions(p, num_workers, worker_id, batch_size));
      },
      nb::arg("rank_pos"), nb::arg("num_workers"), nb::arg("worker_id"), nb::arg("batch_size"),
      "The part of a rank's positions that worker `worker_id` produces.");
  m.def(
      "padded",
      [](Positions order, int64_t length) {
        return ToNumpy(Padded({order.data(), order.shape(0)}, length));
      },
      nb::arg("order"), nb::arg("length"), "`order` extended to `length` entries by wrapping.");
  m.def(
      "collapse_work",
      [](const std::vector<Pair>& work, const std::vector<Pair>& progress) {
        return FromWork(ValueOrThrow(CollapseWork(ToWork(work), ToProgress(progress))));
      },
      nb::arg("work"), nb::arg("progress"),
      "Re-deals the remaining [shard, offset] work dealt as `progress` ([done, offset] per "
      "slot) as a fresh work list.");
  m.def(
      "resume_work",
      [](const std::vector<Pair>& work, const std::vector<Pair>& progress, size_t num_slots) {
        auto [w, p] = ValueOrThrow(ResumeWork(ToWork(work), ToProgress(progress), num_slots));
        std::vector<Pair> slots(p.size());
        for (size_t i = 0; i < p.size(); ++i) slots[i] = {p[i].done, p[i].offset};
        return std::make_pair(FromWork(w), slots);
      },
      nb::arg("work"), nb::arg("progress"), nb::arg("num_slots"),
      "(work, progress) of an epoch resumed on num_slots slots: unchanged with as many slots "
      "as `progress`, else collapse_work's list with every slot at [0, 0].");
}

}  // namespace cairn::python
