// The index arithmetic of include/cairn/partition.h. Each function mirrors,
// bit for bit, what cairn.data computed in numpy before it moved here (the
// Python tests of cairn.data check the same values).
#include "cairn/partition.h"

#include <algorithm>
#include <string>
#include <utility>

namespace cairn {

int64_t PerRank(int64_t n, int64_t start, int64_t world_size, bool drop_last) {
  int64_t remaining = n - start;
  if (remaining <= 0 || n == 0 || world_size < 1) return 0;
  return drop_last ? remaining / world_size : (remaining + world_size - 1) / world_size;
}

int64_t EpochEnd(int64_t n, int64_t start, int64_t world_size, bool drop_last) {
  return start + PerRank(n, start, world_size, drop_last) * world_size;
}

std::vector<int64_t> RankPositions(int64_t n, int64_t start, int64_t world_size, int64_t rank,
                                   bool drop_last) {
  int64_t k = PerRank(n, start, world_size, drop_last);
  std::vector<int64_t> out(static_cast<size_t>(k));
  for (int64_t j = 0; j < k; ++j) out[j] = start + rank + world_size * j;
  return out;
}

std::vector<int64_t> WorkerPositions(std::span<const int64_t> rank_positions, int64_t num_workers,
                                     int64_t worker_id, int64_t batch_size) {
  int64_t nw = std::max<int64_t>(1, num_workers), bs = std::max<int64_t>(1, batch_size);
  std::vector<int64_t> out;
  out.reserve(rank_positions.size() / nw + bs);
  for (size_t j = 0; j < rank_positions.size(); ++j) {
    if ((static_cast<int64_t>(j) / bs) % nw == worker_id) out.push_back(rank_positions[j]);
  }
  return out;
}

std::vector<int64_t> Padded(std::span<const int64_t> order, int64_t length) {
  int64_t len = static_cast<int64_t>(order.size());
  if (length <= len || len == 0) return {order.begin(), order.end()};
  std::vector<int64_t> out(static_cast<size_t>(length));
  for (int64_t i = 0; i < length; ++i) out[i] = order[i % len];
  return out;
}

Result<std::vector<ShardWork>> CollapseWork(std::span<const ShardWork> work,
                                            std::span<const SlotProgress> progress) {
  const size_t old = progress.size();
  std::vector<ShardWork> in_progress;
  std::vector<size_t> untouched;  // indexes into `work`, sorted below
  for (size_t s = 0; s < old; ++s) {
    const SlotProgress& p = progress[s];
    if (p.done < 0 || p.offset < 0) {
      return InvalidArgumentError("slot " + std::to_string(s) + " has a negative progress (" +
                                  std::to_string(p.done) + ", " + std::to_string(p.offset) + ")");
    }
    // Slot s holds work[s], work[s + old], ...; item `done` is the current one.
    size_t current = s + old * static_cast<size_t>(p.done);
    if (current >= work.size()) continue;
    in_progress.push_back({work[current].shard, work[current].offset + p.offset});
    for (size_t i = current + old; i < work.size(); i += old) untouched.push_back(i);
  }
  std::sort(untouched.begin(), untouched.end());
  for (size_t i : untouched) in_progress.push_back(work[i]);
  return in_progress;
}

Result<std::pair<std::vector<ShardWork>, std::vector<SlotProgress>>> ResumeWork(
    std::vector<ShardWork> work, std::vector<SlotProgress> progress, size_t num_slots) {
  if (progress.size() == num_slots) return std::make_pair(std::move(work), std::move(progress));
  CAIRN_ASSIGN_OR_RETURN(std::vector<ShardWork> collapsed, CollapseWork(work, progress));
  return std::make_pair(std::move(collapsed), std::vector<SlotProgress>(num_slots));
}

}  // namespace cairn
