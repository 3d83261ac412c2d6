// Tying a DataLoader worker's life to its trainer's, so that no worker
// outlives a trainer killed by SIGKILL (cairn.data's workers call these; why
// they would linger otherwise is told in python/cairn/data/_workers.py).
//
// Thread-safe. KillSelfWhenGone starts a detached thread of its own (it must
// outlive every caller: its one job is to end the process).
#pragma once

#include <sys/types.h>

namespace cairn {

// Asks the kernel to SIGKILL the calling process when the thread that created
// it exits (prctl PR_SET_PDEATHSIG). Returns false where that is unavailable.
bool KillSelfOnParentDeath();

// Whether process `pid` exists (a process we may not signal counts as alive).
bool ProcessAlive(pid_t pid);

// Kills the calling process (SIGKILL) now if `pid` is gone, else as soon as it
// is: a watchdog thread blocks on a pidfd of `pid` (pidfds refer to the whole
// process, whichever of its threads forked us), or, where pidfds are missing,
// checks every 0.5 s whether this process was re-parented and `pid` is gone.
void KillSelfWhenGone(pid_t pid);

// What a worker does first: KillSelfOnParentDeath() when its parent is not
// `trainer` (a forkserver, single-threaded, so its forking thread is its only
// one), then KillSelfWhenGone(trainer).
void TieWorkerToTrainer(pid_t trainer);

// Arms (pid > 0) or disarms (pid == 0) the fork hook for children that the
// calling thread of process `pid` forks.
void ArmForkedChildren(pid_t pid);

// The fork hook, to be called in a child right after fork() (cairn.data
// registers it with os.register_at_fork, so it runs for os.fork() only, not
// for subprocesses): when armed and forked by the armed thread, sets
// KillSelfOnParentDeath() and dies at once if the parent is no longer the
// armed process. Children forked by other threads are left alone (the
// parent-death signal follows the forking *thread*). Async-signal-safe.
void AfterForkInChild();

}  // namespace cairn
