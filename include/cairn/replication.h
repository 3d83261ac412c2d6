// Replicas of the memory tier on peer nodes: placement, the replica files,
// their verification and commit, and the assembly of a step for a restore
// from cluster memory. The protocol is described at the top of
// src/tier/replication.cc, which implements it.
//
// The engine owns a node's replica state (ReplicaStore); the bytes travel
// over torch.distributed (gloo isend/irecv on the checkpoint group), which the
// Python layer drives (cairn/_replication.py): the store hands it the address
// and size of each buffer to send or receive, and the opaque messages
// (offers, holdings) it carries between ranks in the checkpoint group's
// all-gathers. Every message from a peer is untrusted: ranks, slots and
// sizes are bounds-checked, and names become path components only through
// SafeNodeName(), so nothing a peer says can make a store write outside its
// directory.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "cairn/manifest.h"
#include "cairn/status.h"

namespace cairn {

// This node's identity: $CAIRN_NODE_ID if set and not empty, else the
// hostname.
std::string NodeId();

// `name` as one safe path component: every byte outside [A-Za-z0-9._-]
// becomes '_'; "", "." and ".." become "_" (never empty, never a parent).
std::string SafeNodeName(std::string_view name);

// Where replicas go: the ranks of the checkpoint group grouped by node, nodes
// ordered by their lowest rank; node i's replicas go to nodes i+1, ..., i+K
// (a ring, as Gemini and NVRx place them); the rank with local index j of a
// node sends to the rank with local index j mod n of each peer node, so all
// ranks of a node share that node's peers. Immutable; thread-safe.
class ReplicaPlacement {
 public:
  struct Pair {
    int64_t source = 0;    // the rank whose slot is replicated
    int64_t receiver = 0;  // the rank that holds the replica
    bool operator==(const Pair&) const = default;
  };

  // `node_of` names the node of every rank; `replicas` is K (<= 0: none).
  ReplicaPlacement(std::vector<std::string> node_of, int64_t replicas);

  int64_t world() const { return static_cast<int64_t>(node_of_.size()); }
  int64_t replicas() const { return k_; }
  // More than one node: replication and restore from peers apply.
  bool multi() const { return nodes_.size() > 1; }
  const std::vector<std::string>& nodes() const { return nodes_; }
  const std::string& node_of(int64_t rank) const { return node_of_.at(rank); }
  // The ranks of `node`, ascending (empty for an unknown node).
  const std::vector<int64_t>& ranks_of(std::string_view node) const;
  // The lowest rank of the node of `rank`: it writes the node's shared files.
  int64_t leader_of(int64_t rank) const { return ranks_of(node_of(rank)).front(); }
  // The nodes that hold `node`'s replicas, in ring order.
  std::vector<std::string> Peers(std::string_view node) const;
  // (source, receiver) of every replica of every rank, by source rank then
  // peer order: the order every rank posts its sends and receives in.
  const std::vector<Pair>& pairs() const { return pairs_; }
  // The source ranks whose replicas `rank` receives.
  std::vector<int64_t> Incoming(int64_t rank) const;

 private:
  std::vector<std::string> node_of_;
  int64_t k_ = 0;
  std::vector<std::string> nodes_;
  std::map<std::string, std::vector<int64_t>, std::less<>> ranks_;
  std::vector<Pair> pairs_;
};

// What a receiving rank tells the others before a replication: the bytes its
// replica files of the slot already hold (reused in place), the node's usable
// shared memory, and what memory_limit leaves (none without a limit).
struct ReplicaOffer {
  std::map<int64_t, uint64_t> have;  // source rank -> size of its replica file
  uint64_t free = 0;
  std::optional<int64_t> left;  // may be negative: the tier is over its limit
};
std::string EncodeReplicaOffer(const ReplicaOffer& o);
// DataLoss on anything malformed; ranks outside [0, world) are dropped.
Result<ReplicaOffer> DecodeReplicaOffer(std::string_view json, int64_t world);

// The receivers without room for what they would receive (by rank, with
// why), decided alike on every rank from everyone's offers (`offers[r]` is
// rank r's; none from a rank that receives nothing) and every rank's slot
// file size (`sizes`).
std::map<int64_t, std::string> RefusedReceivers(
    const ReplicaPlacement& p, const std::vector<std::optional<ReplicaOffer>>& offers,
    const std::vector<uint64_t>& sizes);

// What one node holds of one step of this run: its memory tier's slot (when
// that slot is committed) and its committed replicas. File maps are
// rank -> exact file size.
struct ReplicaHolding {
  std::string source;  // the source node, as SafeNodeName() spells it
  int64_t slot = 0;
  std::map<int64_t, uint64_t> files;
};
struct StepHolding {
  int64_t memory_slot = -1;  // -1: not in this node's memory tier
  std::map<int64_t, uint64_t> memory;
  std::vector<ReplicaHolding> replicas;
};
using NodeHoldings = std::map<int64_t, StepHolding>;  // by step
std::string EncodeHoldings(const NodeHoldings& h);
// DataLoss on malformed JSON; entries naming a rank outside [0, world), a
// slot outside [0, slots), an unsafe source name or an absurd size are
// dropped.
Result<NodeHoldings> DecodeHoldings(std::string_view json, int64_t world, int64_t slots);

// Where rank q's data file of a step comes from in a restore.
struct FileSource {
  int64_t holder = 0;  // the rank whose node holds it
  std::string source;  // "" = the holder's memory tier, else a replica of that node's
  int64_t slot = 0;
  uint64_t size = 0;
  bool operator==(const FileSource&) const = default;
};
// Rank q's file of `step` for every q: from its own node's memory tier first,
// then from the first replica found (ranks in order); nullopt when some
// rank's file is held nowhere. `everyone[r]` is rank r's holdings.
std::optional<std::vector<FileSource>> PlanStep(int64_t step,
                                                const std::vector<NodeHoldings>& everyone,
                                                const ReplicaPlacement& p);

struct ReplicaStoreOptions {
  std::string dir;                   // the replica tier: <shm root>/cairn-<tag>-replicas
  std::string memory_dir;            // this run's memory tier: <shm root>/cairn-<tag>
  std::vector<std::string> node_of;  // the node of every rank of the group
  int64_t rank = 0;
  int64_t replicas = 0;  // K
  int64_t slots = 2;     // memory_slots (replica slots mirror them)
  std::string run_root;
  std::string run_id;
};

// One send or receive the caller posts, in order, with torch.distributed.
struct ReplicaTransfer {
  bool send = false;
  int64_t peer = 0;  // the other rank, in the checkpoint group
  char* data = nullptr;
  uint64_t size = 0;
};

// A node's replica state, for one rank of one CheckpointManager: the lease on
// the replica tier, the replica files it receives into (kept mapped between
// saves: their pages stay allocated and faulted in), and the restore plans.
// Not thread-safe: one manager uses it, from its persist thread or its
// caller's, one call at a time. The mapped buffers it hands out stay valid
// until the call that the method's comment names.
class ReplicaStore {
 public:
  // Takes the replica tier's lease when there is more than one node and K > 0
  // or the tier exists already.
  static Result<std::unique_ptr<ReplicaStore>> Open(ReplicaStoreOptions opts);
  ~ReplicaStore();  // Close(), ignoring errors; not copyable (s_ is its own)

  const ReplicaPlacement& placement() const { return placement_; }
  const std::string& dir() const { return opts_.dir; }
  bool leased() const;

  // ---- Replicating one save (every rank, after the memory-tier commit) ----

  // This rank's offer for receiving replicas of `slot` (EncodeReplicaOffer),
  // or nullopt when it receives nothing. `limit`: memory_limit in bytes.
  Result<std::optional<std::string>> Offer(int64_t slot, std::optional<int64_t> limit);

  // Starts the replication of `slot`: decides who is refused (returned, by
  // rank, for the caller to log) from everyone's offers and slot sizes, and
  // uncommits this rank's receiving replica slots (manifest and sidecar).
  // live_pairs() then holds the pairs that move bytes.
  Result<std::map<int64_t, std::string>> Begin(
      int64_t slot, const std::vector<std::optional<std::string>>& offers,
      const std::vector<uint64_t>& sizes);
  const std::vector<ReplicaPlacement::Pair>& live_pairs() const { return live_; }
  // The mapped replica file receiving source rank q's slot, sized to its slot
  // size: resized in place, allocated with posix_fallocate, pages populated
  // (no page fault, no SIGBUS while it receives), and kept mapped for the
  // next save of the slot. Valid until a later ReceiveBuffer() of the same
  // source and slot remaps it (its size or inode changed) or Close().
  Result<ReplicaTransfer> ReceiveBuffer(int64_t q);
  // Checks rank q's received items (offsets, lengths and per-block XXH3 of
  // each, from its save) against the replica file: "" when all match, else
  // what did not.
  Result<std::string> Verify(int64_t q, const std::vector<uint64_t>& offsets,
                             const std::vector<uint64_t>& lengths,
                             const std::vector<std::vector<uint64_t>>& sums);
  // For each (source node, peer node) whose every source rank arrived and
  // verified (none in `failed`), the peer's lowest receiving rank writes the
  // sidecar and commits `manifest`. True when every replica committed.
  Result<bool> Commit(int64_t step, const Manifest& manifest, const std::set<int64_t>& failed);

  // ---- Restore from cluster memory (collective through the caller) ----

  // This node's holdings of this run (EncodeHoldings), for the all-gather.
  Result<std::string> Holdings();
  // From every rank's Holdings(): the steps in cluster memory and this
  // rank's tier of each ("memory" when its own file is in its node's memory
  // tier, else "peer"). Keeps the plans for PrepareView.
  Result<std::vector<std::pair<int64_t, std::string>>> Candidates(
      const std::vector<std::string>& everyone);
  // The node leader (others: nothing, returns {}) empties view/, hard-links
  // what the node holds of `step` into it and returns the ranks whose file
  // the node lacks (-1: it has no manifest of the step).
  Result<std::vector<int64_t>> PrepareView(int64_t step);
  // From every rank's PrepareView(): the sends and receives this rank posts
  // (in order), over mapped files valid until EndViewTransfers(), and the
  // rank that must share its manifest (-1: every node has one).
  Result<std::vector<ReplicaTransfer>> ViewTransfers(int64_t step,
                                                     const std::vector<std::vector<int64_t>>& lacks,
                                                     int64_t* manifest_from);
  void EndViewTransfers();
  // The bytes of this node's manifest of `step`.
  Result<std::string> ManifestBytes(int64_t step);
  // The leader writes view/'s manifest, last: `raw` (a peer's) or its own.
  Status CommitView(int64_t step, const std::optional<std::string>& raw);
  // The leader removes view/.
  Status DropView();
  // The view's directory name below dir().
  static constexpr std::string_view kViewDir = "view";

  // Unmaps every file; the node leader removes the replica tier; releases the
  // lease (the last owner out removes a tier left empty). Idempotent.
  Status Close();
  // Drops the lease; with remove_if_empty, the last owner out removes a tier
  // left empty. Close() calls it; benchmarks that keep the tier call it alone.
  Status ReleaseLease(bool remove_if_empty = false);

 private:
  class MappedFile;
  explicit ReplicaStore(ReplicaStoreOptions opts);
  std::string SlotDir(std::string_view source, int64_t slot) const;
  std::string SourcePath(const std::string& source, int64_t slot, int64_t q) const;
  Status EnsureLease();
  const StepHolding* Mine(int64_t step) const;

  ReplicaStoreOptions opts_;
  ReplicaPlacement placement_;
  struct State;
  std::unique_ptr<State> s_;
  std::vector<ReplicaPlacement::Pair> live_;
};

}  // namespace cairn
