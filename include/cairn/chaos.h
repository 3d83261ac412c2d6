// Fault points for the kill -9 chaos harness (tests/chaos/).
//
// CAIRN_CHAOS="PHASE:N:RANKS" arms one point: the N-th time this process
// reaches ChaosPoint(PHASE) it prints "[chaos] rank R: SIGKILL at PHASE #N" to
// stderr and SIGKILLs itself, if its rank ($RANK, default 0) is in RANKS ("0",
// "1", "0,1" or "all"). PHASE "timer" instead kills N milliseconds after
// ChaosArm(): a random instant of whatever the run is doing. Points fire only
// in the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT 0), so
// the restarted run can finish. Unset, every call is a cheap no-op.
//
// The phases the manager passes: "stage" (half a slot written), "replicate",
// "persist" (data files written, manifest not yet), "commit" (every data file
// durable, no manifest yet) and "prune" (a checkpoint uncommitted, its data
// not yet removed; TierSet::Prune).
//
// Thread-safe.
#pragma once

#include <string_view>

namespace cairn {

// A place where the harness may kill this process.
void ChaosPoint(std::string_view phase);

// Starts the timer of a "timer" spec (once per process).
void ChaosArm();

}  // namespace cairn
