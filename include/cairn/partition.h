// Partitioning of an epoch over ranks and DataLoader workers, and the dealing
// of shard work over slots: the index arithmetic behind cairn.data (its
// Python package keeps only the epoch's order, a numpy PCG64 permutation, and
// the iteration itself). All functions are pure and thread-safe.
//
// A *position* in an epoch is the number of samples of the epoch's global
// order already consumed by all ranks together. From position `start`:
//
//   * global position p = start + rank + world_size * j belongs to `rank` as
//     its rank-local sample j (a stride over ranks);
//   * rank-local samples are cut into chunks of `batch_size`; chunk k goes to
//     worker k % num_workers (a stride over workers), so torch's round-robin
//     over workers hands every rank its samples in order;
//   * every rank gets ceil(remaining / world_size) samples, padded by wrapping
//     around the order (drop_last = false), or floor(remaining / world_size)
//     (drop_last = true).
//
// Shard work (cairn.data.ShardDataset) is a list of (shard, start offset)
// items dealt over S slots: slot s takes items s, s + S, s + 2S, ...; a slot's
// progress is (items done, samples yielded from the current item).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cairn/status.h"

namespace cairn {

// Samples each rank gets in the rest of an epoch of `n` items that begins at
// position `start`. world_size must be >= 1.
int64_t PerRank(int64_t n, int64_t start, int64_t world_size, bool drop_last);

// The position reached when that epoch is complete.
int64_t EpochEnd(int64_t n, int64_t start, int64_t world_size, bool drop_last);

// Global positions of `rank`'s samples, in its consumption order.
std::vector<int64_t> RankPositions(int64_t n, int64_t start, int64_t world_size, int64_t rank,
                                   bool drop_last);

// The part of a rank's positions that worker `worker_id` produces
// (num_workers and batch_size below 1 count as 1).
std::vector<int64_t> WorkerPositions(std::span<const int64_t> rank_positions, int64_t num_workers,
                                     int64_t worker_id, int64_t batch_size);

// `order` extended to `length` entries by wrapping around (unchanged when it
// is at least that long, or empty).
std::vector<int64_t> Padded(std::span<const int64_t> order, int64_t length);

// One work item of a shard dataset, and one slot's progress through its items.
struct ShardWork {
  int64_t shard = 0;
  int64_t offset = 0;  // first sample of the shard to yield
};
struct SlotProgress {
  int64_t done = 0;    // items completed
  int64_t offset = 0;  // samples yielded from the current item
};

// Re-deals the remaining work of `work`, dealt over progress.size() slots, as
// a fresh work list: the items in progress first (each from where it stopped,
// in slot order), then the untouched ones in their original order.
// kInvalidArgument for a negative progress entry.
Result<std::vector<ShardWork>> CollapseWork(std::span<const ShardWork> work,
                                            std::span<const SlotProgress> progress);

// The work and per-slot progress of an epoch resumed on `num_slots` slots from
// `work` dealt as `progress`: unchanged with the same number of slots, else
// CollapseWork's list with every slot at its start.
Result<std::pair<std::vector<ShardWork>, std::vector<SlotProgress>>> ResumeWork(
    std::vector<ShardWork> work, std::vector<SlotProgress> progress, size_t num_slots);

}  // namespace cairn
