// The restore drill (cairn drill, python -m cairn.drill): load the checkpoint
// a restart would load in fresh processes, then verify every byte of it.
//
// RunDrill picks the checkpoint (PickDrillCheckpoint, cairn/tiers.h), starts
// `world_size` worker processes, `<python> -m cairn.drill --_worker URI RANK
// WORLD STORE OUT` (each builds an empty state from the manifest, loads it
// with dcp.load and cairn.Reader, and writes a JSON result to OUT: rank, ok,
// error, tensors, bytes, open_s, load_s), waits for them within the timeout,
// and verifies the checkpoint (Verify). The workers need torch, so they are
// Python; this is only the orchestration.
//
// Thread-compatible: one drill per call; it blocks until its workers are done.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cairn/status.h"
#include "cairn/thread_pool.h"
#include "cairn/tiers.h"

namespace cairn {

struct DrillOptions {
  std::string python;  // the interpreter that runs the workers
  uint32_t world_size = 1;
  double timeout_s = 1800;
  bool verify = true;
  ThreadPool* pool = nullptr;  // Verify's; required when verify
};

struct DrillReport {
  // Non-empty when the drill failed: nothing to restore ("no committed
  // checkpoint in ..."), a worker that failed, died or timed out, or damage
  // found by Verify. The figures below are then unset.
  std::string failure;
  std::vector<SkippedCheckpoint> skipped;  // damaged checkpoints the pick passed over
  std::string checkpoint;                  // the URI loaded
  std::string tier;                        // its source tier
  uint32_t world_size = 1;
  uint64_t saved_world_size = 0;
  uint64_t tensors = 0;
  uint64_t bytes = 0;
  double load_s = 0;  // the slowest rank's
  std::optional<double> verify_s;
  double processes_s = 0;  // from the start to every worker's result
  double total_s = 0;
};

// Runs a drill of `root` (`tier` and `local` as in PickDrillCheckpoint). A
// checkpoint whose manifest cannot be read, and a failure to start a worker,
// are errors; everything the drill is there to find is a `failure`.
Result<DrillReport> RunDrill(std::string_view root, std::string_view tier, std::string_view local,
                             const DrillOptions& opts);

}  // namespace cairn
