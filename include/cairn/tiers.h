// The tiers of a CheckpointManager run and the policy over them: where each
// tier lives and that no two overlap, which committed checkpoints each holds
// (fastest tier first), which memory slot the next save reuses, the run's
// identity, retention, and which source a restore tries next.
//
//   memory   this node's shared memory: shm://cairn-<tag>/slot<k>/, one
//            directory per slot (MemoryTierName: <tag> is derived from the
//            durable root, so a restarted process finds it)
//   local    an optional fast local directory: <local>/step_<N>/
//   durable  <root>/step_<N>/: a directory, file:// or s3://, or a Storage
//            the caller opened (a fault-injecting wrapper, say)
//
// A memory-tier checkpoint belongs to the run whose id its manifest's
// extra.manager.run_id holds; the id is kept in <root>/cairn.run, so a
// checkpoint another run left in the same shared memory is never restored.
//
// No collective is here: the manager gathers every rank's answers and hands
// them to RestorePlanner, which decides for the whole group.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cairn/checkpoint.h"
#include "cairn/status.h"
#include "cairn/storage.h"

namespace cairn {

// Tiers fastest first ("peer": a replica of this node's memory tier in a
// peer node's shared memory, see the manager's replication).
enum class TierKind : uint8_t { kMemory = 0, kPeer = 1, kLocal = 2, kDurable = 3 };

// "memory", "peer", "local", "durable".
std::string_view TierName(TierKind tier);
// The inverse of TierName; InvalidArgument for any other name.
Result<TierKind> ParseTierName(std::string_view name);

// The file of the run's identity in the durable root.
inline constexpr std::string_view kRunIdFile = "cairn.run";

// "step_0000000042": the directory of `step` in the local and durable tiers.
std::string StepDirName(uint64_t step);

// `uri` without trailing slashes, then "/" and `name`.
std::string JoinUri(std::string_view uri, std::string_view name);

// The shm:// name of the memory tier of the run checkpointing to `root` on
// this node, "cairn-<16 hex>": the SHA-256 of the root's real path (symlinks
// resolved as far as the path exists), or of the URI without trailing slashes
// for a root without a local directory (s3://).
std::string MemoryTierName(std::string_view root);

// The tier URI the manager keeps for `path`, a `what` ("root" or "local")
// tier: a path becomes absolute (lexically normalized); "file://" stays as
// given, "s3://" (root only) loses its trailing slashes.
// InvalidArgument "invalid <what> directory ''" for an empty path and
// "unsupported <what> URI: <uri>" for another scheme.
Result<std::string> NormalizeTierUri(std::string_view path, std::string_view what);

// The run id in <root>/cairn.run, or "" when the file is absent, empty or
// unreadable (no I/O error is reported: an unknown run matches none).
std::string ReadRunId(std::string_view root);

// One committed checkpoint a tier holds.
struct TierCheckpoint {
  uint64_t step = 0;
  TierKind tier = TierKind::kDurable;
  std::string uri;   // for messages
  std::string name;  // its directory in the tier's storage (TierSet::TierStorage)
};

// A damaged or unusable step_<N> directory (its manifest is there but does
// not decode, or is a FIFO...), skipped by discovery; the caller logs it.
struct SkippedCheckpoint {
  std::string uri;
  Status status;
};

// A committed memory-tier checkpoint, opened: its manifest validated and its
// data files' sizes checked (CheckpointReader::CheckFiles). `reader` reads
// through `storage`; the two move together.
struct MemoryCheckpoint {
  std::string name;  // the directory below the tier: "slot<k>"
  uint64_t step = 0;
  std::string uri;  // shm://<tier>/<name>
  std::unique_ptr<Storage> storage;
  std::unique_ptr<CheckpointReader> reader;
};

// The committed checkpoints of memory tier `tier_name` (a shm:// name) whose
// manifest's extra.manager holds an integer step and, unless `run_id` is
// empty, that run id. With num_slots > 0 the directories slot0 ..
// slot<num_slots-1> are looked at, in that order; with 0, every committed
// directory of the tier, in ListCheckpoints' order. A directory that is
// missing, partial or damaged is left out; none is an error.
std::vector<MemoryCheckpoint> FindMemoryCheckpoints(std::string_view tier_name,
                                                    std::string_view run_id, uint32_t num_slots);

// The newest committed checkpoint below `root` (any URI) as a URI, or nullopt
// (also when `root` does not exist). Damaged or unusable directories newer
// than it are appended to `skipped` (partial ones, without a manifest, are
// not: they are saves in flight or crashed). Other I/O errors are returned.
Result<std::optional<std::string>> LatestValidUri(std::string_view root,
                                                  std::vector<SkippedCheckpoint>* skipped);
// LatestValidUri over an open storage whose root `root` names (for the URIs).
Result<std::optional<std::string>> LatestValidIn(Storage* storage, std::string_view root,
                                                 std::vector<SkippedCheckpoint>* skipped);

// The checkpoint a restore drill of `root` loads (see cairn/drill.py): with
// `tier` empty, `root` itself when it holds a manifest, else LatestValidUri;
// "durable": LatestValidUri(root); "local": LatestValidUri(local); "memory":
// the newest step of this node's memory tier of the run at `root`. `source`
// is the tier it comes from. When there is none, `uri` is empty and `why`
// says what was missing.
struct DrillPick {
  std::string uri;
  std::string source;
  std::string why;
  std::vector<SkippedCheckpoint> skipped;
};
Result<DrillPick> PickDrillCheckpoint(std::string_view root, std::string_view tier,
                                      std::string_view local);

struct TierSetOptions {
  std::string root;   // the durable tier, as the user gave it
  std::string local;  // the local tier; empty: none
  // A tier the caller opened itself: used as given (its LocalPath, or its
  // Describe() without one, names it); `root` / `local` are then ignored.
  std::shared_ptr<Storage> root_storage;
  std::shared_ptr<Storage> local_storage;
  bool memory = true;
  uint32_t num_slots = 1;  // memory-tier slots (>= 1)
  // Committed checkpoints each slower tier keeps (Prune); nullopt: the
  // durable tier keeps every one (someone else applies retention).
  std::optional<uint64_t> keep = 3;
  uint64_t keep_local = 3;
};

// The tiers of one manager on one rank, opened once: each tier's Storage,
// the normalized URIs, the memory tier's name and directory, retention, and
// the run id once it is known. A tier given as a path is a posix storage that
// follows its root by path (PosixStorageOptions::follow_root), so a tier
// directory removed and created again under a live manager is followed, and
// one not created yet holds nothing.
//
// Thread-safe: every method may be called from any thread (the manager's
// background thread prunes while its main thread lists).
class TierSet {
 public:
  // Normalizes the URIs (NormalizeTierUri) and checks that no two tiers share
  // a directory: a tier that is another one (through a symlink, say) or lies
  // inside it would have its checkpoints rewritten or pruned by the other's
  // saves. InvalidArgument "the <a> tier <dir> overlaps the <b> tier <dir>:
  // every tier needs a directory of its own" (or "is the same directory as").
  // Nothing is created.
  static Result<std::unique_ptr<TierSet>> Open(TierSetOptions opts);
  // Not while another thread uses `other`.
  TierSet(TierSet&& other) noexcept;

  const std::string& root() const { return root_; }
  const std::string& local() const { return local_; }  // "" when none
  bool memory() const { return opts_.memory; }
  uint32_t num_slots() const { return opts_.num_slots; }
  const std::string& shm_name() const { return shm_name_; }
  const std::string& shm_dir() const { return shm_dir_; }

  // The slower tiers a durable save goes to, in order: local (if any), then
  // durable.
  std::vector<TierKind> SlowerTiers() const;
  // The open storage of the memory (shm://<shm_name>: slot<k>/ below it),
  // local or durable tier (step_<N>/ below it). InvalidArgument for a tier
  // this set does not have.
  Result<std::shared_ptr<Storage>> TierStorage(TierKind tier) const;
  // "slot<slot>": the directory of a memory slot in the memory tier's storage.
  static std::string SlotDirName(uint32_t slot);
  // The URI of a slower tier, and of `step`'s directory in it.
  Result<std::string> TierUri(TierKind tier) const;
  Result<std::string> StepUri(TierKind tier, uint64_t step) const;
  // shm://<shm_name>/slot<slot>.
  std::string SlotUri(uint32_t slot) const;
  // The slot file of `rank`'s data in `slot` (a local path).
  std::string SlotDataPath(uint32_t slot, uint64_t rank) const;

  // Creates the local and durable tiers' directories (the coordinator does,
  // once).
  Status CreateTiers();
  // The run id in the durable root's cairn.run; a fresh random one, written
  // there durably, when it has none. The coordinator calls it, every rank
  // then set_run_id()s what it broadcast.
  Result<std::string> ReadOrCreateRunId();
  void set_run_id(std::string id);
  std::string run_id() const;

  // This node's memory-tier checkpoints of this run (FindMemoryCheckpoints
  // over the slots).
  std::vector<MemoryCheckpoint> MemoryCheckpoints() const;
  // The slot the next save goes to: the first slot without a checkpoint of
  // this run, else the one holding the oldest step.
  uint32_t OldestSlot() const;

  // This rank's committed checkpoints, fastest tier first: the memory tier's
  // (with_memory; moved, opened, into *memory), then the local tier's and the
  // durable tier's step_<N> directories, oldest first within a tier. A tier
  // that does not exist yet holds none. Damaged step_<N> directories are
  // appended to *skipped.
  Result<std::vector<TierCheckpoint>> Candidates(bool with_memory,
                                                 std::vector<MemoryCheckpoint>* memory,
                                                 std::vector<SkippedCheckpoint>* skipped);

  // Ray Train's retention of the durable tier (cairn.ray): of its step_<N>
  // directories not named in `tracked`, the committed one of step `restored`
  // is to be adopted (its name in `adopt`); every other one is removed,
  // manifest first (its name appended to `removed`). A removal that fails is
  // appended to `failed` and does not stop the others.
  struct Settled {
    std::optional<std::string> adopt;
    std::vector<std::string> removed;
    std::vector<SkippedCheckpoint> failed;
  };
  Result<Settled> SettleUntracked(const std::vector<std::string>& tracked,
                                  std::optional<uint64_t> restored);

  // Retention of a slower tier: Prune with its keep (TierSetOptions) and
  // remove_newer_partials (the only save in flight is the one just
  // committed). After each uncommit, ChaosPoint("prune") and `after_uncommit`
  // (as in PruneOptions) run.
  Status Prune(TierKind tier, std::function<void(const std::string&)> after_uncommit = {});

 private:
  explicit TierSet(TierSetOptions opts) : opts_(std::move(opts)) {}

  TierSetOptions opts_;
  std::string root_, local_, shm_name_, shm_dir_;
  std::shared_ptr<Storage> durable_, local_storage_, memory_;
  mutable std::mutex mu_;
  std::string run_id_;  // guarded by mu_
};

// The restore decision of a group of ranks, the same on every rank: the steps
// every rank holds in some tier, newest first; for each, this rank's fastest
// source not yet failed; and what failed, for the final error.
//
// Not thread-safe; one per restore.
class RestorePlanner {
 public:
  // `mine`: this rank's candidates; `everyone`: every rank's (step, tier)
  // pairs (gathered), this rank's among them.
  RestorePlanner(std::vector<TierCheckpoint> mine,
                 const std::vector<std::vector<std::pair<uint64_t, TierKind>>>& everyone);

  // The steps that every rank holds in some tier, newest first.
  const std::vector<uint64_t>& steps() const { return steps_; }
  // This rank's fastest source of `step` not failed yet, or null.
  const TierCheckpoint* Next(uint64_t step) const;
  // Records that `tier` failed for `step` (on some rank): Next moves on.
  void Fail(uint64_t step, TierKind tier, std::string_view why);
  // "step 5 (memory): ...; step 5 (durable): ..." in the order they failed.
  std::string Failures() const;

 private:
  std::vector<TierCheckpoint> mine_;  // sorted: step, then tier, then uri
  std::vector<uint64_t> steps_;
  std::vector<std::pair<uint64_t, TierKind>> failed_;
  std::vector<std::string> failures_;
};

}  // namespace cairn
