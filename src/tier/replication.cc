// Replication of the memory tier to peer nodes, and restore from peers.
//
// Nodes. A node is identified by $CAIRN_NODE_ID or, without it, its
// hostname. The ranks of the checkpoint group are grouped by node; nodes are
// ordered by their lowest rank (ReplicaPlacement in cairn/replication.h).
//
// Layout. A node's replicas live in its shared memory, in a tier of their
// own, kind "replica" in the memory-tier bookkeeping (`cairn ls --memory`
// lists it):
//
//   /dev/shm/cairn-<tag>-replicas/
//     <source node>/slot<k>/data/r<rank>.bin   the source ranks' slot k, as staged
//     <source node>/slot<k>/cairn.replica.json step, run id, source node, files
//     <source node>/slot<k>/cairn.manifest     the memory-tier manifest of the step
//     view/                                     a restore's assembled checkpoint
//
// (<source node> is SafeNodeName() of the node's id.)
//
// Replication of one save (every rank, in the background persist thread,
// right after the memory-tier commit; only the checkpoint group's gloo
// traffic, no collective of its own before the bytes move):
//   1. the save's own all-gather (manager.py, step b) already carries each
//      rank's item layout (offsets, lengths, block checksums) and, from each
//      receiving rank, its Offer(): the bytes its replica files hold, its free
//      shared memory and what memory_limit leaves. Begin() decides, alike on
//      every rank, who is refused for lack of room;
//   2. a receiver uncommits its replica slot k of the source node (manifest
//      and sidecar first, in Begin()); then every pair moves the slot file
//      with one isend/irecv: the sender straight from its staging slot (no
//      copy, no new mapping), the receiver straight into its replica file
//      (ReceiveBuffer()), which stays mapped between saves (resized in place,
//      allocated with posix_fallocate, pages populated: no page faults, no
//      SIGBUS, no re-zeroing per save);
//   3. the receiver checks every item's block checksums (Verify()) against
//      the source's as soon as that file arrived; the caller all-gathers the
//      verdicts;
//   4. for each (source node, peer node) whose files all verified, the
//      peer's lowest receiving rank writes the sidecar and commits the
//      manifest (Commit()): only now does the step count as replicated
//      there. Replica slots mirror memory_slots, which the manager requires
//      to be >= 2 with replicas: the slot uncommitted in 2. never holds the
//      previous step, so a node lost while a step replicates still has the
//      previous step in every memory tier and replica.
//
// Restore (Candidates(), then the view calls; collective through the
// caller): every rank reports what its node holds (Holdings(): its
// memory-tier slots and its replicas, with file sizes); a step is in
// "cluster memory" when every rank's data file of it is held by some node
// (PlanStep). A rank whose own file is in its node's memory tier restores it
// as "memory", one whose file is only in a replica as "peer". To load, every
// node assembles the step in view/: files it holds are hard links
// (PrepareView), missing ones are pulled with send/recv from the node that
// holds them (ViewTransfers), the manifest last (CommitView). Loading then
// verifies every checksum (a corrupt or missing replica fails there and
// restore falls back to a slower tier or an older step, agreed by all
// ranks); nothing is trusted unverified. Every node's view holds every
// rank's file (the reader opens a complete checkpoint), so a multi-node
// restore from cluster memory moves each missing file to every node that
// lacks it: with N nodes, up to N-1 copies of a lost node's files cross the
// network.
#include "cairn/replication.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <tuple>
#include <utility>

#include "cairn/checkpoint.h"
#include "cairn/checksum.h"
#include "cairn/format.h"
#include "cairn/memory_tier.h"
#include "storage/posix/posix_storage.h"

namespace cairn {
namespace {

using json = nlohmann::json;

constexpr std::string_view kSidecarName = "cairn.replica.json";

// JSON numbers from a peer, checked: a non-negative integer no larger than
// `max`, or a signed 64-bit integer.
std::optional<uint64_t> U64(const json& j, uint64_t max = format::kMaxFileSize) {
  if (!j.is_number_unsigned()) return std::nullopt;
  uint64_t v = j.get<uint64_t>();
  return v <= max ? std::optional<uint64_t>(v) : std::nullopt;
}
std::optional<int64_t> I64(const json& j) {
  if (j.is_number_unsigned()) {
    uint64_t v = j.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(v);
  }
  if (j.is_number_integer()) return j.get<int64_t>();
  return std::nullopt;
}
// An index in [0, n), or nullopt.
std::optional<int64_t> Index(const json& j, int64_t n) {
  std::optional<int64_t> v = I64(j);
  return v && *v >= 0 && *v < n ? v : std::nullopt;
}

json SizesJson(const std::map<int64_t, uint64_t>& m) {
  json a = json::array();
  for (const auto& [q, n] : m) a.push_back({q, n});
  return a;
}
// [[rank, size], ...] with every entry checked; bad entries are dropped.
std::map<int64_t, uint64_t> SizesFromJson(const json& a, int64_t world) {
  std::map<int64_t, uint64_t> out;
  if (!a.is_array()) return out;
  for (const json& e : a) {
    if (!e.is_array() || e.size() != 2) continue;
    auto q = Index(e[0], world);
    auto n = U64(e[1]);
    if (q && n) out[*q] = *n;
  }
  return out;
}

Result<json> ParseObject(std::string_view text, std::string_view what) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return DataLossError(std::string(what) + ": not a JSON object");
  }
  return j;
}

// The rank of a data file's name, "r<rank>.bin" exactly (no sign, no leading
// zero), below `world`.
std::optional<int64_t> DataFileRank(std::string_view name, int64_t world) {
  if (name.size() < 6 || name.front() != 'r' || !name.ends_with(".bin")) return std::nullopt;
  std::string_view digits = name.substr(1, name.size() - 5);
  if (digits.empty() || digits.size() > 18 || (digits.size() > 1 && digits[0] == '0')) {
    return std::nullopt;
  }
  int64_t v = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  return v < world ? std::optional<int64_t>(v) : std::nullopt;
}

// {rank: size} of the data files of checkpoint directory `dir` of `st`.
std::map<int64_t, uint64_t> DataFiles(Storage* st, const std::string& dir, int64_t world) {
  std::map<int64_t, uint64_t> out;
  auto entries = st->List(dir + "/" + std::string(format::kDataDir));
  if (!entries.ok()) return out;
  for (const DirEntry& e : *entries) {
    if (e.is_dir) continue;
    if (auto q = DataFileRank(e.name, world)) out[*q] = e.size;
  }
  return out;
}

// (step, run id) from the manager's extra of the manifest of `dir`, after the
// manifest verified; nullopt if it is missing or damaged.
std::optional<std::pair<int64_t, std::string>> ManifestStep(Storage* st, const std::string& dir) {
  auto m = ReadManifest(st, dir);
  if (!m.ok()) return std::nullopt;
  json extra = json::parse(m->extra, nullptr, false);
  if (!extra.is_object()) return std::nullopt;
  auto mgr = extra.find("manager");
  if (mgr == extra.end() || !mgr->is_object()) return std::nullopt;
  auto step = mgr->find("step");
  auto run = mgr->find("run_id");
  if (step == mgr->end() || !step->is_number_integer()) return std::nullopt;
  std::string run_id = run != mgr->end() && run->is_string() ? run->get<std::string>() : "";
  return std::make_pair(step->get<int64_t>(), run_id);
}

Result<std::string> ReadAll(Storage* st, const std::string& key) {
  CAIRN_ASSIGN_OR_RETURN(auto f, st->NewReadableFile(key));
  if (f->Size() > format::kMaxManifestBodySize) return DataLossError(key + ": too large");
  std::string buf(f->Size(), '\0');
  CAIRN_RETURN_IF_ERROR(f->ReadAt(0, buf.data(), buf.size()));
  return buf;
}

std::string SlotName(int64_t slot) { return "slot" + std::to_string(slot); }

Status IgnoreNotFound(Status s) { return s.code() == StatusCode::kNotFound ? Status::OK() : s; }

}  // namespace

std::string NodeId() {
  const char* env = std::getenv("CAIRN_NODE_ID");
  if (env != nullptr && *env != '\0') return env;
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

std::string SafeNodeName(std::string_view name) {
  std::string out(name);
  for (char& c : out) {
    bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-';
    if (!ok) c = '_';
  }
  if (out.empty() || out == "." || out == "..") return "_";
  // Names the replica tier uses for itself.
  if (out == ReplicaStore::kViewDir || out == "owners") out += "_";
  return out;
}

// ---- Placement --------------------------------------------------------------

ReplicaPlacement::ReplicaPlacement(std::vector<std::string> node_of, int64_t replicas)
    : node_of_(std::move(node_of)), k_(std::max<int64_t>(replicas, 0)) {
  for (int64_t r = 0; r < world(); ++r) {
    auto [it, fresh] = ranks_.try_emplace(node_of_[r]);
    if (fresh) nodes_.push_back(node_of_[r]);
    it->second.push_back(r);
  }
  for (int64_t q = 0; q < world(); ++q) {
    const std::vector<int64_t>& mine = ranks_of(node_of_[q]);
    const size_t j = std::find(mine.begin(), mine.end(), q) - mine.begin();
    for (const std::string& peer : Peers(node_of_[q])) {
      const std::vector<int64_t>& theirs = ranks_of(peer);
      pairs_.push_back({q, theirs[j % theirs.size()]});
    }
  }
}

const std::vector<int64_t>& ReplicaPlacement::ranks_of(std::string_view node) const {
  static const std::vector<int64_t> kNone;
  auto it = ranks_.find(node);
  return it == ranks_.end() ? kNone : it->second;
}

std::vector<std::string> ReplicaPlacement::Peers(std::string_view node) const {
  std::vector<std::string> out;
  auto it = std::find(nodes_.begin(), nodes_.end(), node);
  if (it == nodes_.end()) return out;
  const int64_t n = static_cast<int64_t>(nodes_.size());
  const int64_t i = it - nodes_.begin();
  for (int64_t d = 1; d <= std::min(k_, n - 1); ++d) out.push_back(nodes_[(i + d) % n]);
  return out;
}

std::vector<int64_t> ReplicaPlacement::Incoming(int64_t rank) const {
  std::vector<int64_t> out;
  for (const Pair& p : pairs_) {
    if (p.receiver == rank) out.push_back(p.source);
  }
  return out;
}

// ---- Offers and refusals ----------------------------------------------------

std::string EncodeReplicaOffer(const ReplicaOffer& o) {
  json j = {{"have", SizesJson(o.have)}, {"free", o.free}, {"left", nullptr}};
  if (o.left) j["left"] = *o.left;
  return j.dump();
}

Result<ReplicaOffer> DecodeReplicaOffer(std::string_view text, int64_t world) {
  CAIRN_ASSIGN_OR_RETURN(json j, ParseObject(text, "replica offer"));
  ReplicaOffer o;
  auto free = j.find("free");
  auto left = j.find("left");
  if (free == j.end() || !free->is_number_unsigned() || left == j.end() ||
      !(left->is_null() || I64(*left))) {
    return DataLossError("replica offer: bad 'free' or 'left'");
  }
  o.free = free->get<uint64_t>();
  if (!left->is_null()) o.left = I64(*left);
  if (auto have = j.find("have"); have != j.end()) o.have = SizesFromJson(*have, world);
  return o;
}

std::map<int64_t, std::string> RefusedReceivers(
    const ReplicaPlacement& p, const std::vector<std::optional<ReplicaOffer>>& offers,
    const std::vector<uint64_t>& sizes) {
  std::map<int64_t, std::string> refused;
  std::set<int64_t> receivers;
  for (const auto& pair : p.pairs()) receivers.insert(pair.receiver);
  for (int64_t d : receivers) {
    if (d >= static_cast<int64_t>(offers.size()) || !offers[d]) continue;
    const ReplicaOffer& o = *offers[d];
    int64_t grow = 0;  // sizes and holdings are at most kMaxFileSize each
    for (const auto& pair : p.pairs()) {
      if (pair.receiver != d) continue;
      auto have = o.have.find(pair.source);
      uint64_t size = pair.source < static_cast<int64_t>(sizes.size()) ? sizes[pair.source] : 0;
      grow += static_cast<int64_t>(std::min(size, format::kMaxFileSize)) -
              static_cast<int64_t>(have == o.have.end() ? 0 : have->second);
    }
    grow = std::max<int64_t>(grow, 0);
    if (static_cast<uint64_t>(grow) > o.free) {
      refused[d] = std::to_string(grow) + " bytes needed, " + std::to_string(o.free) +
                   " free in shared memory";
    } else if (o.left && grow > *o.left) {
      refused[d] = "memory_limit: the node's memory tier and replicas would grow by " +
                   std::to_string(grow) + " bytes, " + std::to_string(*o.left) + " left";
    }
  }
  return refused;
}

// ---- Holdings and plans -----------------------------------------------------

std::string EncodeHoldings(const NodeHoldings& h) {
  json a = json::array();
  for (const auto& [step, e] : h) {
    json reps = json::array();
    for (const ReplicaHolding& r : e.replicas) {
      reps.push_back({{"source", r.source}, {"slot", r.slot}, {"files", SizesJson(r.files)}});
    }
    a.push_back({{"step", step},
                 {"memory_slot", e.memory_slot},
                 {"memory", SizesJson(e.memory)},
                 {"replicas", reps}});
  }
  return a.dump();
}

Result<NodeHoldings> DecodeHoldings(std::string_view text, int64_t world, int64_t slots) {
  json a = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (a.is_discarded() || !a.is_array()) return DataLossError("replica holdings: not a JSON array");
  NodeHoldings out;
  for (const json& e : a) {
    if (!e.is_object()) continue;
    auto step = e.contains("step") ? I64(e["step"]) : std::nullopt;
    if (!step) continue;
    StepHolding h;
    if (auto slot = e.contains("memory_slot") ? Index(e["memory_slot"], slots) : std::nullopt) {
      h.memory_slot = *slot;
      if (e.contains("memory")) h.memory = SizesFromJson(e["memory"], world);
    }
    if (e.contains("replicas") && e["replicas"].is_array()) {
      for (const json& r : e["replicas"]) {
        if (!r.is_object() || !r.contains("source") || !r["source"].is_string()) continue;
        ReplicaHolding rep;
        rep.source = r["source"].get<std::string>();
        auto slot = r.contains("slot") ? Index(r["slot"], slots) : std::nullopt;
        if (!slot || SafeNodeName(rep.source) != rep.source) continue;
        rep.slot = *slot;
        if (r.contains("files")) rep.files = SizesFromJson(r["files"], world);
        h.replicas.push_back(std::move(rep));
      }
    }
    out[*step] = std::move(h);
  }
  return out;
}

std::optional<std::vector<FileSource>> PlanStep(int64_t step,
                                                const std::vector<NodeHoldings>& everyone,
                                                const ReplicaPlacement& p) {
  std::vector<FileSource> plan;
  const int64_t n = std::min<int64_t>(p.world(), static_cast<int64_t>(everyone.size()));
  for (int64_t q = 0; q < p.world(); ++q) {
    std::optional<FileSource> best;
    for (int64_t r = 0; r < n; ++r) {
      auto it = everyone[r].find(step);
      if (it == everyone[r].end()) continue;
      const StepHolding& e = it->second;
      auto m = e.memory.find(q);
      if (e.memory_slot >= 0 && m != e.memory.end() && p.node_of(r) == p.node_of(q)) {
        best = FileSource{r, "", e.memory_slot, m->second};
        break;
      }
      if (best) continue;
      for (const ReplicaHolding& rep : e.replicas) {
        auto f = rep.files.find(q);
        if (f != rep.files.end()) {
          best = FileSource{r, rep.source, rep.slot, f->second};
          break;
        }
      }
    }
    if (!best) return std::nullopt;
    plan.push_back(std::move(*best));
  }
  return plan;
}

// ---- ReplicaStore ---------------------------------------------------------

// A file mapped in memory for one transfer. Written: resized in place to
// exactly `size` (pages it keeps are reused), allocated up front and mapped
// with its pages populated, so the transfer never page-faults nor SIGBUSes.
// Read: mapped private and read-only, refused when shorter than `size`.
class ReplicaStore::MappedFile {
 public:
  static Result<std::unique_ptr<MappedFile>> Open(const std::string& path, uint64_t size,
                                                  bool write) {
    int flags = (write ? O_RDWR | O_CREAT : O_RDONLY) | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;
    int fd = ::open(path.c_str(), flags, 0600);
    if (fd < 0) return ErrnoToStatus(errno, "open " + path);
    std::unique_ptr<MappedFile> f(new MappedFile(fd, size));
    struct stat st;
    if (::fstat(fd, &st) != 0) return ErrnoToStatus(errno, "stat " + path);
    if (!S_ISREG(st.st_mode)) return FailedPreconditionError(path + ": not a regular file");
    f->ino_ = st.st_ino;
    if (write) {
      if (static_cast<uint64_t>(st.st_size) != size &&
          ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
        return ErrnoToStatus(errno, "resizing " + path);
      }
      // ENOSPC here, never SIGBUS later.
      int rc = size ? ::posix_fallocate(fd, 0, static_cast<off_t>(size)) : 0;
      if (rc != 0) {
        return ErrnoToStatus(rc, "allocating " + std::to_string(size) + " bytes for " + path);
      }
    } else if (static_cast<uint64_t>(st.st_size) < size) {
      return DataLossError(path + " holds " + std::to_string(st.st_size) + " bytes, not " +
                           std::to_string(size));
    }
    if (size) {
      void* p = ::mmap(nullptr, size, write ? PROT_READ | PROT_WRITE : PROT_READ,
                       write ? MAP_SHARED | MAP_POPULATE : MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) return ErrnoToStatus(errno, "mmap " + path);
      f->data_ = static_cast<char*>(p);
    }
    return f;
  }
  ~MappedFile() {
    if (data_) ::munmap(data_, size_);
    ::close(fd_);
  }
  char* data() const { return data_; }
  uint64_t size() const { return size_; }
  ino_t ino() const { return ino_; }

 private:
  MappedFile(int fd, uint64_t size) : fd_(fd), size_(size) {}
  int fd_;
  uint64_t size_;
  char* data_ = nullptr;
  ino_t ino_ = 0;
};

struct ReplicaStore::State {
  std::unique_ptr<MemoryTierLease> lease;
  std::unique_ptr<Storage> replicas;  // rooted at opts_.dir, once it exists
  std::unique_ptr<Storage> memory;    // rooted at opts_.memory_dir
  // The receiving replica files, by (source node, slot, source rank).
  std::map<std::tuple<std::string, int64_t, int64_t>, std::unique_ptr<MappedFile>> receiving;
  int64_t slot = -1;            // the slot being replicated (Begin)
  std::vector<uint64_t> sizes;  // every rank's slot size in it
  NodeHoldings mine;            // this node's holdings, as Candidates() saw them
  std::map<int64_t, std::vector<FileSource>> plans;
  std::vector<std::unique_ptr<MappedFile>> view_maps;
  bool closed = false;
};

namespace {

// The storage rooted at `dir`, opened once (created when `create`); null
// without error when it does not exist and !create.
Result<Storage*> OpenOnce(std::unique_ptr<Storage>& slot, const std::string& dir, bool create) {
  if (slot) return slot.get();
  if (!create) {
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      return static_cast<Storage*>(nullptr);
  }
  internal::PosixStorageOptions o;
  o.allow_direct_io = false;
  CAIRN_ASSIGN_OR_RETURN(slot, internal::NewPosixStorage(dir, create, o));
  return slot.get();
}

}  // namespace

ReplicaStore::ReplicaStore(ReplicaStoreOptions opts)
    : opts_(std::move(opts)),
      placement_(opts_.node_of, opts_.replicas),
      s_(std::make_unique<State>()) {}

ReplicaStore::~ReplicaStore() {
  // Releases, never removes: a manager dropped without close() keeps its tier
  // for the next process (as a crashed one does).
  s_->receiving.clear();
  s_->view_maps.clear();
}

Result<std::unique_ptr<ReplicaStore>> ReplicaStore::Open(ReplicaStoreOptions opts) {
  const int64_t world = static_cast<int64_t>(opts.node_of.size());
  if (opts.rank < 0 || opts.rank >= world) {
    return InvalidArgumentError("replica store: rank " + std::to_string(opts.rank) +
                                " outside a group of " + std::to_string(world));
  }
  if (opts.slots < 1) return InvalidArgumentError("replica store: slots must be >= 1");
  if (opts.dir.empty() || opts.dir.front() != '/' || opts.memory_dir.empty()) {
    return InvalidArgumentError("replica store: dir and memory_dir must be absolute paths");
  }
  std::unique_ptr<ReplicaStore> st(new ReplicaStore(std::move(opts)));
  struct stat sb;
  bool exists = ::stat(st->opts_.dir.c_str(), &sb) == 0 && S_ISDIR(sb.st_mode);
  if (st->placement_.multi() && (st->placement_.replicas() > 0 || exists)) {
    CAIRN_RETURN_IF_ERROR(st->EnsureLease());
  }
  return st;
}

bool ReplicaStore::leased() const { return s_->lease != nullptr; }

Status ReplicaStore::EnsureLease() {
  if (s_->lease) return Status::OK();
  MemoryTierLeaseOptions o;
  o.dir = opts_.dir;
  o.kind = "replica";
  o.run_root = opts_.run_root;
  o.run_id = opts_.run_id;
  o.rank = opts_.rank;
  CAIRN_ASSIGN_OR_RETURN(s_->lease, MemoryTierLease::Acquire(std::move(o)));
  return Status::OK();
}

std::string ReplicaStore::SlotDir(std::string_view source, int64_t slot) const {
  return SafeNodeName(source) + "/" + SlotName(slot);
}

std::string ReplicaStore::SourcePath(const std::string& source, int64_t slot, int64_t q) const {
  const std::string file = SlotName(slot) + "/" + format::DataFileKey(q);
  return source.empty() ? opts_.memory_dir + "/" + file
                        : opts_.dir + "/" + SafeNodeName(source) + "/" + file;
}

Result<std::optional<std::string>> ReplicaStore::Offer(int64_t slot, std::optional<int64_t> limit) {
  const std::vector<int64_t> incoming = placement_.Incoming(opts_.rank);
  if (!placement_.multi() || placement_.replicas() <= 0 || incoming.empty()) {
    return std::optional<std::string>();
  }
  if (slot < 0 || slot >= opts_.slots) return InvalidArgumentError("replica offer: bad slot");
  ReplicaOffer o;
  for (int64_t q : incoming) {
    const std::string path =
        opts_.dir + "/" + SlotDir(placement_.node_of(q), slot) + "/" + format::DataFileKey(q);
    struct stat st;
    if (::stat(path.c_str(), &st) == 0) {
      o.have[q] = static_cast<uint64_t>(st.st_size);
    } else if (errno == ENOENT || errno == ENOTDIR) {
      o.have[q] = 0;
    } else {
      return ErrnoToStatus(errno, "stat " + path);
    }
  }
  CAIRN_ASSIGN_OR_RETURN(SharedMemoryRoom room,
                         GetSharedMemoryRoom(std::filesystem::path(opts_.dir).parent_path()));
  o.free = room.usable();
  if (limit) {
    CAIRN_ASSIGN_OR_RETURN(uint64_t tier, AllocatedBytes(opts_.memory_dir));
    CAIRN_ASSIGN_OR_RETURN(uint64_t reps, AllocatedBytes(opts_.dir));
    o.left = *limit - static_cast<int64_t>(tier + reps);
  }
  return std::optional<std::string>(EncodeReplicaOffer(o));
}

Result<std::map<int64_t, std::string>> ReplicaStore::Begin(
    int64_t slot, const std::vector<std::optional<std::string>>& offers,
    const std::vector<uint64_t>& sizes) {
  const int64_t world = placement_.world();
  if (slot < 0 || slot >= opts_.slots || static_cast<int64_t>(offers.size()) != world ||
      static_cast<int64_t>(sizes.size()) != world) {
    return InvalidArgumentError("replication: one offer and one size per rank, and a valid slot");
  }
  s_->slot = slot;
  s_->sizes = sizes;
  std::vector<std::optional<ReplicaOffer>> decoded(world);
  std::map<int64_t, std::string> malformed;
  for (int64_t r = 0; r < world; ++r) {
    if (!offers[r]) continue;
    auto o = DecodeReplicaOffer(*offers[r], world);
    if (o.ok()) {
      decoded[r] = std::move(*o);
    } else {
      malformed[r] = o.status().message();
    }
  }
  std::map<int64_t, std::string> refused = RefusedReceivers(placement_, decoded, sizes);
  refused.merge(malformed);
  live_.clear();
  for (const auto& p : placement_.pairs()) {
    if (!refused.count(p.receiver)) live_.push_back(p);
  }
  if (!refused.count(opts_.rank)) {
    for (int64_t q : placement_.Incoming(opts_.rank)) {
      CAIRN_ASSIGN_OR_RETURN(Storage * st, OpenOnce(s_->replicas, opts_.dir, /*create=*/true));
      const std::string sd = SlotDir(placement_.node_of(q), slot);
      CAIRN_RETURN_IF_ERROR(
          IgnoreNotFound(st->DeleteFile(sd + "/" + std::string(format::kManifestName))));
      CAIRN_RETURN_IF_ERROR(IgnoreNotFound(st->DeleteFile(sd + "/" + std::string(kSidecarName))));
      CAIRN_RETURN_IF_ERROR(st->CreateDir(sd + "/" + std::string(format::kDataDir)));
    }
  }
  return refused;
}

Result<ReplicaTransfer> ReplicaStore::ReceiveBuffer(int64_t q) {
  const bool mine = std::any_of(live_.begin(), live_.end(), [&](const auto& p) {
    return p.source == q && p.receiver == opts_.rank;
  });
  if (s_->slot < 0 || !mine) {
    return FailedPreconditionError("replication: rank " + std::to_string(opts_.rank) +
                                   " receives nothing from rank " + std::to_string(q));
  }
  const std::string& node = placement_.node_of(q);
  const uint64_t size = std::min(s_->sizes[q], format::kMaxFileSize);
  const std::string path = SourcePath(node, s_->slot, q);
  auto key = std::make_tuple(node, s_->slot, q);
  auto it = s_->receiving.find(key);
  if (it != s_->receiving.end()) {
    struct stat st;
    if (::stat(path.c_str(), &st) == 0 && st.st_ino == it->second->ino() &&
        it->second->size() == size) {
      return ReplicaTransfer{false, q, it->second->data(), size};
    }
    s_->receiving.erase(it);
  }
  CAIRN_ASSIGN_OR_RETURN(auto m, MappedFile::Open(path, size, /*write=*/true));
  ReplicaTransfer t{false, q, m->data(), size};
  s_->receiving[key] = std::move(m);
  return t;
}

Result<std::string> ReplicaStore::Verify(int64_t q, const std::vector<uint64_t>& offsets,
                                         const std::vector<uint64_t>& lengths,
                                         const std::vector<std::vector<uint64_t>>& sums) {
  if (q < 0 || q >= placement_.world()) return InvalidArgumentError("verify: bad rank");
  auto it = s_->receiving.find(std::make_tuple(placement_.node_of(q), s_->slot, q));
  if (it == s_->receiving.end()) {
    return FailedPreconditionError("verify: nothing received from rank " + std::to_string(q));
  }
  const std::string who = "rank " + std::to_string(q) + "'s ";
  if (offsets.size() != lengths.size() || offsets.size() != sums.size()) {
    return who + "item layout is malformed";
  }
  const MappedFile& m = *it->second;
  for (size_t i = 0; i < offsets.size(); ++i) {
    const uint64_t off = offsets[i], len = lengths[i];
    if (off > m.size() || len > m.size() - off) {
      return who + "item at offset " + std::to_string(off) + " lies outside its " +
             std::to_string(m.size()) + "-byte slot";
    }
    CAIRN_ASSIGN_OR_RETURN(std::vector<uint64_t> got,
                           BlockChecksums(m.data() + off, len, format::kDefaultBlockSize));
    if (got != sums[i]) {
      return who + "item at offset " + std::to_string(off) + " arrived with a wrong checksum";
    }
  }
  return std::string();
}

Result<bool> ReplicaStore::Commit(int64_t step, const Manifest& manifest,
                                  const std::set<int64_t>& failed) {
  if (s_->slot < 0) return FailedPreconditionError("replication: Commit before Begin");
  bool done = true;
  for (const std::string& src : placement_.nodes()) {
    for (const std::string& peer : placement_.Peers(src)) {
      std::vector<int64_t> qs;
      int64_t committer = -1;
      bool bad = false;
      for (const auto& p : live_) {
        if (placement_.node_of(p.source) != src || placement_.node_of(p.receiver) != peer) continue;
        qs.push_back(p.source);
        bad = bad || failed.count(p.source);
        committer = committer < 0 ? p.receiver : std::min(committer, p.receiver);
      }
      if (qs.size() != placement_.ranks_of(src).size() || bad) {
        done = false;
        continue;
      }
      if (committer != opts_.rank) continue;
      CAIRN_ASSIGN_OR_RETURN(Storage * st, OpenOnce(s_->replicas, opts_.dir, /*create=*/true));
      const std::string sd = SlotDir(src, s_->slot);
      json files = json::object();
      for (int64_t q : qs) files[std::to_string(q)] = std::min(s_->sizes[q], format::kMaxFileSize);
      json side = {{"step", step}, {"run_id", opts_.run_id}, {"source", src}, {"files", files}};
      CAIRN_RETURN_IF_ERROR(st->PutAtomic(sd + "/" + std::string(kSidecarName), side.dump()));
      CAIRN_RETURN_IF_ERROR(CommitManifest(st, sd, manifest));
    }
  }
  return done;
}

Result<std::string> ReplicaStore::Holdings() {
  const int64_t world = placement_.world();
  NodeHoldings out;
  CAIRN_ASSIGN_OR_RETURN(Storage * mem, OpenOnce(s_->memory, opts_.memory_dir, false));
  for (int64_t slot = 0; mem != nullptr && slot < opts_.slots; ++slot) {
    auto got = ManifestStep(mem, SlotName(slot));
    if (!got || got->second != opts_.run_id) continue;
    StepHolding& e = out[got->first];
    e.memory = DataFiles(mem, SlotName(slot), world);
    e.memory_slot = slot;
  }
  CAIRN_ASSIGN_OR_RETURN(Storage * reps, OpenOnce(s_->replicas, opts_.dir, false));
  auto sources = reps ? reps->List("") : Result<std::vector<DirEntry>>(std::vector<DirEntry>{});
  for (const DirEntry& src : sources.ok() ? *sources : std::vector<DirEntry>{}) {
    if (!src.is_dir || src.name == kViewDir || SafeNodeName(src.name) != src.name) continue;
    for (int64_t slot = 0; slot < opts_.slots; ++slot) {
      const std::string sd = src.name + "/" + SlotName(slot);
      auto got = ManifestStep(reps, sd);
      if (!got || got->second != opts_.run_id) continue;
      auto raw = ReadAll(reps, sd + "/" + std::string(kSidecarName));
      if (!raw.ok()) continue;
      json side = json::parse(*raw, nullptr, false);
      if (!side.is_object() || !side.contains("step") || I64(side["step"]) != got->first) continue;
      ReplicaHolding rep{src.name, slot, {}};
      const json& listed = side.contains("files") ? side["files"] : json();
      for (const auto& [q, size] : DataFiles(reps, sd, world)) {
        auto it = listed.is_object() ? listed.find(std::to_string(q)) : listed.end();
        if (listed.is_object() && it != listed.end() && U64(*it) == size) rep.files[q] = size;
      }
      out[got->first].replicas.push_back(std::move(rep));
    }
  }
  return EncodeHoldings(out);
}

Result<std::vector<std::pair<int64_t, std::string>>> ReplicaStore::Candidates(
    const std::vector<std::string>& everyone) {
  const int64_t world = placement_.world();
  if (static_cast<int64_t>(everyone.size()) != world) {
    return InvalidArgumentError("replica candidates: one holdings message per rank");
  }
  std::vector<NodeHoldings> all(world);
  std::set<int64_t> steps;
  for (int64_t r = 0; r < world; ++r) {
    auto h = DecodeHoldings(everyone[r], world, opts_.slots);
    if (h.ok()) all[r] = std::move(*h);  // a malformed message holds nothing
    for (const auto& [step, e] : all[r]) steps.insert(step);
  }
  s_->mine = all[opts_.rank];
  s_->plans.clear();
  std::vector<std::pair<int64_t, std::string>> out;
  for (int64_t step : steps) {
    auto plan = PlanStep(step, all, placement_);
    if (!plan) continue;
    out.emplace_back(step, (*plan)[opts_.rank].source.empty() ? "memory" : "peer");
    s_->plans[step] = std::move(*plan);
  }
  return out;
}

const StepHolding* ReplicaStore::Mine(int64_t step) const {
  auto it = s_->mine.find(step);
  return it == s_->mine.end() ? nullptr : &it->second;
}

Result<std::vector<int64_t>> ReplicaStore::PrepareView(int64_t step) {
  if (opts_.rank != placement_.leader_of(opts_.rank)) return std::vector<int64_t>{};
  if (!s_->plans.count(step)) return FailedPreconditionError("view: step not a candidate");
  CAIRN_RETURN_IF_ERROR(EnsureLease());
  CAIRN_ASSIGN_OR_RETURN(Storage * st, OpenOnce(s_->replicas, opts_.dir, /*create=*/true));
  const std::string view(kViewDir);
  CAIRN_RETURN_IF_ERROR(st->DeleteDir(view));
  CAIRN_RETURN_IF_ERROR(st->CreateDir(view + "/" + std::string(format::kDataDir)));
  const StepHolding* e = Mine(step);
  std::vector<int64_t> lacks;
  for (int64_t q = 0; q < placement_.world(); ++q) {
    std::optional<std::string> src;
    if (e != nullptr && e->memory_slot >= 0 && e->memory.count(q)) {
      src = SourcePath("", e->memory_slot, q);
    } else if (e != nullptr) {
      for (const ReplicaHolding& rep : e->replicas) {
        if (rep.files.count(q)) {
          src = SourcePath(rep.source, rep.slot, q);
          break;
        }
      }
    }
    if (!src) {
      lacks.push_back(q);
      continue;
    }
    const std::string dst = opts_.dir + "/" + view + "/" + format::DataFileKey(q);
    if (::linkat(AT_FDCWD, src->c_str(), AT_FDCWD, dst.c_str(), 0) != 0) {
      return ErrnoToStatus(errno, "link " + *src + " into " + dst);
    }
  }
  if (e == nullptr || (e->memory_slot < 0 && e->replicas.empty())) lacks.push_back(-1);
  return lacks;
}

Result<std::vector<ReplicaTransfer>> ReplicaStore::ViewTransfers(
    int64_t step, const std::vector<std::vector<int64_t>>& lacks, int64_t* manifest_from) {
  const int64_t world = placement_.world();
  auto plan_it = s_->plans.find(step);
  if (plan_it == s_->plans.end() || static_cast<int64_t>(lacks.size()) != world) {
    return InvalidArgumentError("view: a planned step and one report per rank");
  }
  const std::vector<FileSource>& plan = plan_it->second;
  std::vector<ReplicaTransfer> out;
  bool need_manifest = false;
  for (int64_t r = 0; r < world; ++r) {
    if (placement_.leader_of(r) != r) continue;  // only node leaders report
    const std::vector<int64_t>& ranks = placement_.ranks_of(placement_.node_of(r));
    for (int64_t q : lacks[r]) {
      if (q == -1) need_manifest = true;
      if (q < 0 || q >= world) continue;
      const FileSource& f = plan[q];
      const int64_t dst = ranks[q % ranks.size()];
      if (f.holder == opts_.rank && dst != opts_.rank) {
        CAIRN_ASSIGN_OR_RETURN(auto m, MappedFile::Open(SourcePath(f.source, f.slot, q), f.size,
                                                        /*write=*/false));
        out.push_back({true, dst, m->data(), f.size});
        s_->view_maps.push_back(std::move(m));
      }
      if (dst == opts_.rank && f.holder != opts_.rank) {
        const std::string path =
            opts_.dir + "/" + std::string(kViewDir) + "/" + format::DataFileKey(q);
        CAIRN_ASSIGN_OR_RETURN(auto m, MappedFile::Open(path, f.size, /*write=*/true));
        out.push_back({false, f.holder, m->data(), f.size});
        s_->view_maps.push_back(std::move(m));
      }
    }
  }
  *manifest_from = -1;
  if (need_manifest) {
    for (const FileSource& f : plan) {
      if (*manifest_from < 0 || f.holder < *manifest_from) *manifest_from = f.holder;
    }
  }
  return out;
}

void ReplicaStore::EndViewTransfers() { s_->view_maps.clear(); }

Result<std::string> ReplicaStore::ManifestBytes(int64_t step) {
  const StepHolding* e = Mine(step);
  const std::string manifest(format::kManifestName);
  if (e != nullptr && e->memory_slot >= 0) {
    CAIRN_ASSIGN_OR_RETURN(Storage * mem, OpenOnce(s_->memory, opts_.memory_dir, false));
    if (mem != nullptr) return ReadAll(mem, SlotName(e->memory_slot) + "/" + manifest);
  } else if (e != nullptr && !e->replicas.empty()) {
    CAIRN_ASSIGN_OR_RETURN(Storage * reps, OpenOnce(s_->replicas, opts_.dir, false));
    const ReplicaHolding& rep = e->replicas.front();
    if (reps != nullptr) return ReadAll(reps, SlotDir(rep.source, rep.slot) + "/" + manifest);
  }
  return NotFoundError("no manifest of step " + std::to_string(step) + " on this node");
}

Status ReplicaStore::CommitView(int64_t step, const std::optional<std::string>& raw) {
  if (opts_.rank != placement_.leader_of(opts_.rank)) return Status::OK();
  std::string bytes;
  if (raw) {
    bytes = *raw;
  } else {
    CAIRN_ASSIGN_OR_RETURN(bytes, ManifestBytes(step));
  }
  CAIRN_ASSIGN_OR_RETURN(Storage * st, OpenOnce(s_->replicas, opts_.dir, /*create=*/true));
  return st->PutAtomic(std::string(kViewDir) + "/" + std::string(format::kManifestName), bytes);
}

Status ReplicaStore::DropView() {
  if (opts_.rank != placement_.leader_of(opts_.rank)) return Status::OK();
  CAIRN_ASSIGN_OR_RETURN(Storage * st, OpenOnce(s_->replicas, opts_.dir, false));
  if (st != nullptr) st->DeleteDir(std::string(kViewDir)).IgnoreError();
  return Status::OK();
}

Status ReplicaStore::Close() {
  if (s_->closed) return Status::OK();
  s_->closed = true;
  s_->receiving.clear();
  s_->view_maps.clear();
  s_->replicas.reset();
  s_->memory.reset();
  if (opts_.rank == placement_.leader_of(opts_.rank)) {
    std::error_code ec;
    std::filesystem::remove_all(opts_.dir, ec);  // best effort, as at a crash
  }
  return ReleaseLease(/*remove_if_empty=*/true);
}

Status ReplicaStore::ReleaseLease(bool remove_if_empty) {
  if (!s_->lease) return Status::OK();
  Status s = s_->lease->Release(remove_if_empty);
  s_->lease.reset();
  return s.WithContext("releasing the replica tier " + opts_.dir);
}

}  // namespace cairn
