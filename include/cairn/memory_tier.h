// Memory tiers on this node: who owns them, which are orphaned, reclaiming
// them, and how much shared memory is left.
//
// A memory tier is a directory in node shared memory, normally
// /dev/shm/cairn-<tag>/ (see include/cairn/staging.h for its slot layout).
// Besides the slots, a tier carries its own bookkeeping:
//
//   <tier>/cairn.tier                  JSON: version, kind ("memory" or
//                                      "replica"), run_root, run_id,
//                                      created, last_restored (unix seconds)
//   <tier>/cairn.lock                  empty; every live owner holds a shared
//                                      flock on it (the kernel drops it when
//                                      the process dies, however it dies)
//   <tier>/owners/<host>-<pid>.json    one per owning process: pid, its start
//                                      time, boot id, hostname, rank; the
//                                      file's mtime is the owner's heartbeat
//
// Orphans. A tier is orphaned when no live process holds its lock and
//   * its run root is gone (the directory no longer exists, or its
//     "cairn.run" file no longer names the tier's run), or
//   * its last sign of life (creation, last restore, last owner heartbeat,
//     last committed slot) is older than the grace period: the owner died and
//     no restarted process took the tier over in time.
// A tier held by a live process is never reclaimed, whatever its run root.
// Reclaiming takes the lock exclusively first, so a process taking a tier
// over and a reclaimer never both win: the loser of the race either sees the
// tier in use or finds its lock file unlinked and starts a fresh tier.
//
// Two older layouts are recognised too: a "cairn-<16 hex>" tier without
// bookkeeping (written before it existed; alive while a process holds a
// flock on one of its slot files, otherwise judged by the grace period) and
// the staging directories of SharedMemoryStager, "cairn-stager-<pid>-<id>"
// (orphaned once that pid is gone and no file in it is locked; they are
// never restored, so no grace period applies).
//
// Thread-safety: the free functions may be called from any thread. A
// MemoryTierLease may be used from one thread at a time; its heartbeat runs
// on a thread of its own, joined by Release() and the destructor.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cairn/status.h"

namespace cairn {

// Seconds a dead owner's tier is kept for a restarted process to restore.
inline constexpr double kDefaultOrphanGraceSeconds = 600.0;

// One process that owns (or owned) a tier.
struct MemoryTierOwner {
  int64_t pid = 0;
  uint64_t start_time = 0;  // the process's start, in clock ticks since boot
  std::string boot_id;
  std::string hostname;
  int64_t rank = -1;
  double heartbeat = 0;  // unix seconds of the last heartbeat
  // "alive" or "dead" when it ran on this host and boot; "unknown" otherwise.
  std::string state;
};

// What a scan found about one tier.
struct MemoryTierInfo {
  std::string name;  // directory name below the shared-memory root
  std::string path;
  // "memory", "replica", "staging" (SharedMemoryStager) or "legacy" (a
  // cairn-<hex> tier without bookkeeping).
  std::string kind;
  uint64_t bytes = 0;          // shared memory held: allocated bytes of every file
  std::vector<int64_t> steps;  // committed steps held, newest first
  std::string run_root;        // empty when unknown
  std::string run_id;
  double created = 0;  // unix seconds; 0 when unknown
  double last_restored = 0;
  double last_active = 0;  // newest sign of life (see the top of the file)
  std::vector<MemoryTierOwner> owners;
  bool in_use = false;  // a live process holds the tier
  bool orphaned = false;
  std::string reason;  // why orphaned, or why kept
};

struct MemoryTierScanOptions {
  // Where node shared memory is mounted (kShmRoot); tests use a directory.
  std::string shm_root;  // empty = kShmRoot
  double grace_seconds = kDefaultOrphanGraceSeconds;
  double now = 0;  // unix seconds; 0 = the current time
};

// Lists the tiers below the shared-memory root (other directories are not
// cairn's and are skipped), with the orphan decision of each. Never blocks
// on a lock; never modifies anything.
Result<std::vector<MemoryTierInfo>> ListMemoryTiers(const MemoryTierScanOptions& opts);

// Deletes every orphaned tier (see the top of the file); `reclaimed` (if not
// null) receives what was deleted. With dry_run, only reports. A tier that a
// live process takes over during the scan is left alone. Errors deleting one
// tier do not stop the others; the first is returned.
Status ReclaimOrphanedMemoryTiers(const MemoryTierScanOptions& opts,
                                  std::vector<MemoryTierInfo>* reclaimed, bool dry_run = false);

struct MemoryTierLeaseOptions {
  std::string dir;  // the tier's directory, absolute; created if missing
  std::string kind = "memory";
  std::string run_root;  // the run's durable root (path or URI)
  std::string run_id;
  int64_t rank = -1;
  double heartbeat_seconds = 10;  // how often the owner record is touched
};

// Registers this process as an owner of a tier for as long as the object
// lives: holds the tier's shared lock, writes the owner record and the
// tier's metadata, and keeps a heartbeat. Owner records of dead processes of
// this host are removed on acquisition.
class MemoryTierLease {
 public:
  // Blocks (up to 30 s) while a reclaimer holds the tier; kUnavailable after.
  static Result<std::unique_ptr<MemoryTierLease>> Acquire(MemoryTierLeaseOptions opts);
  ~MemoryTierLease();  // Release(), ignoring errors
  MemoryTierLease(const MemoryTierLease&) = delete;
  MemoryTierLease& operator=(const MemoryTierLease&) = delete;

  // Records that the tier was just restored from (last_restored = now).
  Status MarkRestored();
  // Stops the heartbeat, deletes this process's owner record and drops the
  // lock. With remove_if_empty, the last owner out also deletes the tier if
  // it holds nothing but bookkeeping (no slot file left). Idempotent.
  Status Release(bool remove_if_empty = false);

  const std::string& dir() const { return opts_.dir; }

 private:
  struct Heartbeat;
  MemoryTierLease(MemoryTierLeaseOptions opts, int lock_fd, std::string owner_path);
  MemoryTierLeaseOptions opts_;
  int lock_fd_ = -1;
  int64_t owner_pid_ = 0;  // the process that acquired it (not a forked child)
  std::string owner_path_;
  std::unique_ptr<Heartbeat> heartbeat_;
};

// Shared memory left at `dir` (a directory on the tmpfs): the filesystem's
// size and free bytes, and the node's available memory (MemAvailable, which
// tmpfs pages also come from).
struct SharedMemoryRoom {
  uint64_t total = 0;
  uint64_t free = 0;
  uint64_t mem_available = 0;  // UINT64_MAX when unknown
  // What a new allocation may take without ENOSPC or memory pressure.
  uint64_t usable() const { return free < mem_available ? free : mem_available; }
};
Result<SharedMemoryRoom> GetSharedMemoryRoom(const std::string& dir);

// Allocated bytes of every regular file below `dir` (0 when it is missing).
Result<uint64_t> AllocatedBytes(const std::string& dir);

// This process's identity as a tier owner would record it.
MemoryTierOwner CurrentProcessOwner();

// ---- The memory budget (CheckpointManager's memory_limit) -----------------
//
// Before a save changes a byte of a staging slot, each rank works out how much
// its slot file must grow (SlotGrowth: nothing in the steady state, slots are
// reused). Without a limit it checks that the node has that much shared
// memory free (CheckSharedMemoryRoom). With one, the ranks all-gather a
// MemoryBudgetReport each and every rank reaches the same verdict for every
// node (CheckMemoryBudget), so a save that would take any node's tier past
// its limit fails on every rank alike, before anything is written.

// One rank's part in a budget check.
struct MemoryBudgetReport {
  std::string node;        // the rank's node name
  uint64_t grow = 0;       // bytes its slot file must grow by
  bool leader = false;     // the node's leader: the fields below are set
  uint64_t footprint = 0;  // the tier's allocated bytes now
  uint64_t room = 0;       // SharedMemoryRoom::usable() of the node
  uint64_t limit = 0;      // the memory_limit in bytes
};

// How many bytes the slot file `path` must grow by to hold `used` bytes:
// `used` rounded up to `align`, less the file's size (0 when it is missing).
Result<uint64_t> SlotGrowth(const std::string& path, uint64_t used, uint64_t align);

// kResourceExhausted when `grow` bytes exceed the usable shared memory at
// `shm_root` (the node's tmpfs); OK when grow is 0.
Status CheckSharedMemoryRoom(const std::string& shm_root, uint64_t grow);

// The verdict on the reports of every rank of a save, the same on every rank:
// for each node in name order, kResourceExhausted when its tier would grow
// past its leader's `limit` (`limit_arg` is the limit as the user gave it, for
// the message) or past the node's free room. kInvalidArgument when a node has
// no leader report.
Status CheckMemoryBudget(const std::vector<MemoryBudgetReport>& reports,
                         std::string_view limit_arg);

// "512 B", "1.5 KiB", "3.0 MiB", "2.2 GiB", "1.1 TiB" (messages, the CLI).
std::string HumanBytes(uint64_t n);

}  // namespace cairn
