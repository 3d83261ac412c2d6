// The tiers of a CheckpointManager run (see cairn/tiers.h): their URIs, the
// overlap check, discovery over the memory, local and durable tiers, slot
// choice, the run id, retention and the restore planner.
#include "cairn/tiers.h"

#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <tuple>

#include "cairn/chaos.h"
#include "cairn/format.h"
#include "storage/local_path.h"
#include "storage/posix/posix_storage.h"
#include "storage/s3/sigv4.h"
#include "storage/shm/shm_storage.h"

namespace cairn {

using internal::JoinComponents;
using json = nlohmann::json;

namespace {

constexpr std::string_view kTierNames[] = {"memory", "peer", "local", "durable"};

bool StartsWith(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

std::string TrimTrailingSlashes(std::string_view s) {
  while (!s.empty() && s.back() == '/') s.remove_suffix(1);
  return std::string(s);
}

// `path` made absolute (against the working directory) and lexically
// normalized: no ".", "..", empty or trailing components (os.path.abspath).
std::vector<std::string> AbsoluteComponents(std::string_view path) {
  std::string abs(path);
  if (abs.empty() || abs[0] != '/') {
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof(cwd)) != nullptr) abs = std::string(cwd) + "/" + abs;
  }
  return internal::PathComponents(abs, /*resolve_dotdot=*/true);
}

// The real path of `path`, symlinks resolved as far as it exists and the rest
// appended by name (os.path.realpath, not strict).
std::string LooseRealPath(std::string_view path) {
  std::vector<std::string> comps = AbsoluteComponents(path);
  for (size_t n = comps.size() + 1; n-- > 0;) {
    char buf[PATH_MAX];
    if (::realpath(JoinComponents(comps, n).c_str(), buf) == nullptr) continue;
    std::string out = buf;
    for (size_t i = n; i < comps.size(); ++i) out += (out == "/" ? "" : "/") + comps[i];
    return out;
  }
  return JoinComponents(comps, comps.size());
}

// The step a memory-tier manifest records for the manager, if it belongs to
// `run_id` (any run when empty).
std::optional<uint64_t> ManagerStep(const Manifest& m, std::string_view run_id) {
  json extra = json::parse(m.extra, nullptr, false);
  if (!extra.is_object()) return std::nullopt;
  auto mgr = extra.find("manager");
  if (mgr == extra.end() || !mgr->is_object()) return std::nullopt;
  auto step = mgr->find("step");
  if (step == mgr->end() || !step->is_number_integer()) return std::nullopt;
  if (!run_id.empty()) {
    auto id = mgr->find("run_id");
    if (id == mgr->end() || !id->is_string() || id->get<std::string>() != run_id) {
      return std::nullopt;
    }
  }
  return step->get<uint64_t>();
}

// Opens the committed checkpoint at `uri` as restore would (manifest
// validated, data file sizes checked); nullopt when it is not one.
std::optional<MemoryCheckpoint> OpenCommitted(std::string uri) {
  auto storage = OpenStorage(uri, /*create=*/false);
  if (!storage.ok()) return std::nullopt;
  auto has = (*storage)->Exists(format::kManifestName);
  if (!has.ok() || !*has) return std::nullopt;
  auto reader = CheckpointReader::Open(storage->get(), "");
  if (!reader.ok() || !(*reader)->CheckFiles().ok()) return std::nullopt;
  MemoryCheckpoint c;
  c.uri = std::move(uri);
  c.storage = std::move(*storage);
  c.reader = std::move(*reader);
  return c;
}

std::string RandomRunId() {
  std::random_device rd;
  std::string out;
  char buf[9];
  for (int i = 0; i < 4; ++i) {
    std::snprintf(buf, sizeof(buf), "%08x", static_cast<unsigned>(rd()));
    out += buf;
  }
  return out;
}

}  // namespace

std::string_view TierName(TierKind tier) { return kTierNames[static_cast<int>(tier)]; }

Result<TierKind> ParseTierName(std::string_view name) {
  for (int i = 0; i < 4; ++i) {
    if (kTierNames[i] == name) return static_cast<TierKind>(i);
  }
  return InvalidArgumentError("unknown tier '" + std::string(name) + "'");
}

std::string StepDirName(uint64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step_%010llu", static_cast<unsigned long long>(step));
  return buf;
}

std::string JoinUri(std::string_view uri, std::string_view name) {
  return TrimTrailingSlashes(uri) + "/" + std::string(name);
}

std::string MemoryTierName(std::string_view root) {
  std::string local = LocalDirOfUri(root);
  std::string key = local.empty() ? TrimTrailingSlashes(root) : LooseRealPath(local);
  return "cairn-" + s3::Sha256Hex(key.data(), key.size()).substr(0, 16);
}

Result<std::string> NormalizeTierUri(std::string_view path, std::string_view what) {
  const std::string w(what);
  if (path.empty()) return InvalidArgumentError("invalid " + w + " directory ''");
  bool is_uri = path.find("://") != std::string_view::npos;
  bool s3 = what == "root" && StartsWith(path, "s3://");
  if (is_uri && !s3 && !StartsWith(path, "file://")) {
    return InvalidArgumentError("unsupported " + w + " URI: " + std::string(path));
  }
  if (s3) return TrimTrailingSlashes(path);
  if (is_uri) return std::string(path);
  std::vector<std::string> comps = AbsoluteComponents(path);
  return JoinComponents(comps, comps.size());
}

namespace {

// ReadRunId of an open durable tier.
std::string ReadRunIdOf(Storage* storage) {
  auto f = storage->NewReadableFile(kRunIdFile);
  if (!f.ok()) return {};
  std::string buf((*f)->Size(), '\0');
  if (!(*f)->ReadAt(0, buf.data(), buf.size()).ok()) return {};
  size_t b = buf.find_first_not_of(" \t\r\n"), e = buf.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? std::string() : buf.substr(b, e - b + 1);
}

// "root=URI (the durable tier)" / "local=URI (the local tier)": the argument a
// tier came from, for errors about it (an unwritable directory, a missing bucket).
std::string TierArgument(TierKind tier, const std::string& uri) {
  return tier == TierKind::kLocal ? "local=" + uri + " (the local tier)"
                                  : "root=" + uri + " (the durable tier)";
}

// The kept storage of a tier named by a (normalized) URI: a local directory
// follows its root by path; anything else (s3) is opened once.
Result<std::shared_ptr<Storage>> OpenTierStorage(const std::string& uri) {
  std::string dir = LocalDirOfUri(uri);
  if (dir.empty()) {
    CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<Storage> st, OpenStorage(uri, /*create=*/true));
    return std::shared_ptr<Storage>(std::move(st));
  }
  internal::PosixStorageOptions o;
  o.follow_root = true;
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<Storage> st,
                         internal::NewPosixStorage(dir, /*create=*/false, o));
  return std::shared_ptr<Storage>(std::move(st));
}

// The name a tier the caller opened goes by: its local directory, else its
// Describe().
std::string NameOfStorage(const Storage& st) {
  std::string local = st.LocalPath();
  return local.empty() ? st.Describe() : local;
}

}  // namespace

std::string ReadRunId(std::string_view root) {
  auto storage = OpenStorage(root, /*create=*/false);
  if (!storage.ok()) return {};
  return ReadRunIdOf(storage->get());
}

std::vector<MemoryCheckpoint> FindMemoryCheckpoints(std::string_view tier_name,
                                                    std::string_view run_id, uint32_t num_slots) {
  const std::string tier = "shm://" + std::string(tier_name);
  std::vector<std::string> names;
  if (num_slots > 0) {
    for (uint32_t k = 0; k < num_slots; ++k) names.push_back("slot" + std::to_string(k));
  } else if (auto storage = OpenStorage(tier, /*create=*/false); storage.ok()) {
    auto listed = ListCheckpoints(storage->get(), "");
    for (const auto& c : listed.ok() ? *listed : std::vector<CheckpointInfo>()) {
      if (c.committed) names.push_back(c.name);
    }
  }
  std::vector<MemoryCheckpoint> out;
  for (const std::string& name : names) {
    std::optional<MemoryCheckpoint> c = OpenCommitted(JoinUri(tier, name));
    if (!c) continue;
    std::optional<uint64_t> step = ManagerStep(c->reader->manifest(), run_id);
    if (!step) continue;
    c->name = name;
    c->step = *step;
    out.push_back(std::move(*c));
  }
  return out;
}

Result<std::optional<std::string>> LatestValidUri(std::string_view root,
                                                  std::vector<SkippedCheckpoint>* skipped) {
  auto storage = OpenStorage(root, /*create=*/false);
  if (!storage.ok()) {
    if (storage.status().code() == StatusCode::kNotFound) return std::optional<std::string>();
    return storage.status();
  }
  return LatestValidIn(storage->get(), root, skipped);
}

Result<std::optional<std::string>> LatestValidIn(Storage* storage, std::string_view root,
                                                 std::vector<SkippedCheckpoint>* skipped) {
  using Found = std::optional<std::string>;
  auto listed = ListCheckpoints(storage, "");
  if (!listed.ok()) {
    if (listed.status().code() == StatusCode::kNotFound) return Found();
    return listed.status();
  }
  for (auto it = listed->rbegin(); it != listed->rend(); ++it) {
    if (it->committed) return Found(JoinUri(root, it->name));
    if (it->status.code() != StatusCode::kNotFound) {
      skipped->push_back({JoinUri(root, it->name), it->status});
    }
  }
  return Found();
}

Result<DrillPick> PickDrillCheckpoint(std::string_view root, std::string_view tier,
                                      std::string_view local) {
  DrillPick p;
  std::optional<std::string> uri;
  if (tier.empty() || tier == "durable") {
    p.source = "durable";
    auto storage = OpenStorage(root, /*create=*/false);
    auto has = storage.ok() ? (*storage)->Exists(format::kManifestName) : Result<bool>(false);
    if (tier.empty() && has.ok() && *has) {
      uri = std::string(root);
    } else {
      CAIRN_ASSIGN_OR_RETURN(uri, LatestValidUri(root, &p.skipped));
    }
    if (tier.empty() && uri && StartsWith(*uri, "shm://")) p.source = "memory";
  } else if (tier == "local") {
    p.source = "local";
    if (local.empty()) {
      p.why = "--tier local needs --local DIR (the manager's local tier)";
      return p;
    }
    CAIRN_ASSIGN_OR_RETURN(uri, LatestValidUri(local, &p.skipped));
  } else if (tier == "memory") {
    p.source = "memory";
    std::optional<uint64_t> best;
    for (auto& c : FindMemoryCheckpoints(MemoryTierName(root), ReadRunId(root), 0)) {
      if (!best || c.step > *best) best = c.step, uri = c.uri;
    }
  } else {
    p.why = "unknown tier '" + std::string(tier) + "' (one of memory, local, durable)";
    return p;
  }
  if (uri) {
    p.uri = std::move(*uri);
  } else {
    p.why = "no committed checkpoint in the " + p.source + " tier of " +
            std::string(tier == "local" ? local : root);
  }
  return p;
}

// ---- TierSet ----------------------------------------------------------------

Result<std::unique_ptr<TierSet>> TierSet::Open(TierSetOptions opts) {
  if (opts.num_slots < 1) return InvalidArgumentError("memory_slots must be >= 1");
  std::unique_ptr<TierSet> t(new TierSet(std::move(opts)));
  if (t->opts_.root_storage) {
    t->durable_ = t->opts_.root_storage;
    CAIRN_ASSIGN_OR_RETURN(t->root_, NormalizeTierUri(NameOfStorage(*t->durable_), "root"));
  } else {
    CAIRN_ASSIGN_OR_RETURN(t->root_, NormalizeTierUri(t->opts_.root, "root"));
  }
  if (t->opts_.local_storage) {
    t->local_storage_ = t->opts_.local_storage;
    CAIRN_ASSIGN_OR_RETURN(t->local_, NormalizeTierUri(NameOfStorage(*t->local_storage_), "local"));
  } else if (!t->opts_.local.empty()) {
    CAIRN_ASSIGN_OR_RETURN(t->local_, NormalizeTierUri(t->opts_.local, "local"));
  }
  t->shm_name_ = MemoryTierName(t->root_);
  t->shm_dir_ = ShmDirectory(t->shm_name_);
  // Every tier with a local directory, durable first.
  std::vector<std::pair<std::string, std::string>> dirs;
  for (auto [name, uri] :
       {std::pair<const char*, const std::string*>{"durable", &t->root_}, {"local", &t->local_}}) {
    if (uri->empty() || StartsWith(*uri, "s3://")) continue;
    std::string dir = LocalDirOfUri(*uri);
    dirs.emplace_back(name, dir.empty() ? *uri : dir);
  }
  if (t->opts_.memory) dirs.emplace_back("memory", t->shm_dir_);
  for (size_t i = 0; i < dirs.size(); ++i) {
    for (size_t j = i + 1; j < dirs.size(); ++j) {
      CAIRN_ASSIGN_OR_RETURN(DirRelation rel, RelateLocalDirs(dirs[i].second, dirs[j].second));
      if (rel == DirRelation::kDisjoint) continue;
      const char* how = rel == DirRelation::kSame ? "is the same directory as" : "overlaps";
      return InvalidArgumentError("the " + dirs[i].first + " tier " + dirs[i].second + " " + how +
                                  " the " + dirs[j].first + " tier " + dirs[j].second +
                                  ": every tier needs a directory of its own");
    }
  }
  // Opened once, after the checks (nothing is created). Errors name the
  // argument the tier came from.
  if (!t->durable_) {
    auto st = OpenTierStorage(t->root_);
    if (!st.ok()) return st.status().WithContext(TierArgument(TierKind::kDurable, t->root_));
    t->durable_ = std::move(*st);
  }
  if (!t->local_storage_ && !t->local_.empty()) {
    auto st = OpenTierStorage(t->local_);
    if (!st.ok()) return st.status().WithContext(TierArgument(TierKind::kLocal, t->local_));
    t->local_storage_ = std::move(*st);
  }
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<Storage> memory,
                         internal::NewShmStorage(t->shm_name_, /*create=*/false,
                                                 /*follow_root=*/true));
  t->memory_ = std::move(memory);
  return t;
}

TierSet::TierSet(TierSet&& other) noexcept
    : opts_(std::move(other.opts_)),
      root_(std::move(other.root_)),
      local_(std::move(other.local_)),
      shm_name_(std::move(other.shm_name_)),
      shm_dir_(std::move(other.shm_dir_)),
      durable_(std::move(other.durable_)),
      local_storage_(std::move(other.local_storage_)),
      memory_(std::move(other.memory_)),
      run_id_(std::move(other.run_id_)) {}

std::vector<TierKind> TierSet::SlowerTiers() const {
  if (local_.empty()) return {TierKind::kDurable};
  return {TierKind::kLocal, TierKind::kDurable};
}

Result<std::string> TierSet::TierUri(TierKind tier) const {
  if (tier == TierKind::kDurable) return root_;
  if (tier == TierKind::kLocal && !local_.empty()) return local_;
  return InvalidArgumentError("no " + std::string(TierName(tier)) + " tier directory");
}

Result<std::string> TierSet::StepUri(TierKind tier, uint64_t step) const {
  CAIRN_ASSIGN_OR_RETURN(std::string uri, TierUri(tier));
  return JoinUri(uri, StepDirName(step));
}

std::string TierSet::SlotDirName(uint32_t slot) { return "slot" + std::to_string(slot); }

std::string TierSet::SlotUri(uint32_t slot) const {
  return "shm://" + shm_name_ + "/" + SlotDirName(slot);
}

std::string TierSet::SlotDataPath(uint32_t slot, uint64_t rank) const {
  return shm_dir_ + "/" + SlotDirName(slot) + "/" + format::DataFileKey(rank);
}

Result<std::shared_ptr<Storage>> TierSet::TierStorage(TierKind tier) const {
  if (tier == TierKind::kDurable) return durable_;
  if (tier == TierKind::kLocal && local_storage_) return local_storage_;
  if (tier == TierKind::kMemory) return memory_;
  return InvalidArgumentError("no " + std::string(TierName(tier)) + " tier directory");
}

Status TierSet::CreateTiers() {
  for (TierKind tier : SlowerTiers()) {
    CAIRN_ASSIGN_OR_RETURN(auto storage, TierStorage(tier));
    Status s = storage->CreateDir("");
    if (!s.ok()) {
      return s.WithContext(TierArgument(tier, tier == TierKind::kLocal ? local_ : root_));
    }
  }
  return Status::OK();
}

Result<std::string> TierSet::ReadOrCreateRunId() {
  CAIRN_ASSIGN_OR_RETURN(auto storage, TierStorage(TierKind::kDurable));
  std::string id = ReadRunIdOf(storage.get());
  if (!id.empty()) return id;
  id = RandomRunId();
  Status s = [&]() -> Status {
    CAIRN_ASSIGN_OR_RETURN(auto f, storage->NewWritableFile(kRunIdFile));
    CAIRN_RETURN_IF_ERROR(f->WriteAt(0, id.data(), id.size()));
    CAIRN_RETURN_IF_ERROR(f->Sync());
    return f->Close();
  }();
  if (!s.ok()) return s.WithContext(TierArgument(TierKind::kDurable, root_));
  return id;
}

void TierSet::set_run_id(std::string id) {
  std::lock_guard<std::mutex> lock(mu_);
  run_id_ = std::move(id);
}

std::string TierSet::run_id() const {
  std::lock_guard<std::mutex> lock(mu_);
  return run_id_;
}

std::vector<MemoryCheckpoint> TierSet::MemoryCheckpoints() const {
  std::string id = run_id();
  // Without a run id every run's checkpoints would match: none is this run's.
  if (id.empty()) return {};
  return FindMemoryCheckpoints(shm_name_, id, opts_.num_slots);
}

uint32_t TierSet::OldestSlot() const {
  std::map<uint32_t, uint64_t> held;  // slot -> step
  for (const auto& c : MemoryCheckpoints()) {
    held[static_cast<uint32_t>(std::stoul(c.name.substr(4)))] = c.step;
  }
  for (uint32_t k = 0; k < opts_.num_slots; ++k) {
    if (!held.count(k)) return k;
  }
  auto oldest = std::min_element(held.begin(), held.end(),
                                 [](const auto& a, const auto& b) { return a.second < b.second; });
  return oldest->first;
}

Result<std::vector<TierCheckpoint>> TierSet::Candidates(bool with_memory,
                                                        std::vector<MemoryCheckpoint>* memory,
                                                        std::vector<SkippedCheckpoint>* skipped) {
  std::vector<TierCheckpoint> out;
  if (with_memory) {
    for (auto& c : MemoryCheckpoints()) {
      out.push_back({c.step, TierKind::kMemory, c.uri, c.name});
      memory->push_back(std::move(c));
    }
  }
  for (TierKind tier : SlowerTiers()) {
    const std::string& uri = tier == TierKind::kLocal ? local_ : root_;
    auto storage = TierStorage(tier);
    Result<std::vector<CheckpointInfo>> listed =
        storage.ok() ? ListCheckpoints(storage->get(), "") : storage.status();
    if (!listed.ok()) {
      if (listed.status().code() == StatusCode::kNotFound) continue;  // not created yet
      return listed.status();
    }
    for (const CheckpointInfo& c : *listed) {
      if (!c.step) continue;
      if (c.committed) {
        out.push_back({*c.step, tier, JoinUri(uri, c.name), c.name});
      } else if (c.status.code() != StatusCode::kNotFound) {
        // Damaged or unusable (e.g. a FIFO as its manifest): restore moves on.
        skipped->push_back({JoinUri(uri, c.name), c.status});
      }
    }
  }
  return out;
}

Status TierSet::Prune(TierKind tier, std::function<void(const std::string&)> after_uncommit) {
  CAIRN_ASSIGN_OR_RETURN(auto storage, TierStorage(tier));
  PruneOptions opts;
  if (tier == TierKind::kLocal) {
    opts.keep = opts_.keep_local;
  } else {
    opts.keep = opts_.keep.value_or(uint64_t{1} << 63);
  }
  opts.remove_newer_partials = true;
  opts.after_uncommit = [hook = std::move(after_uncommit)](const std::string& name) {
    ChaosPoint("prune");  // uncommitted, its data not removed yet
    if (hook) hook(name);
  };
  std::vector<std::string> removed;
  return cairn::Prune(storage.get(), "", opts, &removed);
}

Result<TierSet::Settled> TierSet::SettleUntracked(const std::vector<std::string>& tracked,
                                                  std::optional<uint64_t> restored) {
  Settled out;
  auto storage = TierStorage(TierKind::kDurable);
  Result<std::vector<CheckpointInfo>> listed =
      storage.ok() ? ListCheckpoints(storage->get(), "") : storage.status();
  if (!listed.ok()) {
    if (listed.status().code() == StatusCode::kNotFound) return out;
    return listed.status();
  }
  for (const CheckpointInfo& c : *listed) {
    if (!c.step || std::find(tracked.begin(), tracked.end(), c.name) != tracked.end()) continue;
    if (restored && *c.step == *restored && c.committed) {
      out.adopt = c.name;
      continue;
    }
    Status s = UncommitCheckpoint(storage->get(), c.name);
    if (s.ok()) s = (*storage)->DeleteDir(c.name);
    if (s.ok()) {
      out.removed.push_back(c.name);
    } else {
      out.failed.push_back({JoinUri(root_, c.name), s});
    }
  }
  return out;
}

// ---- RestorePlanner -----------------------------------------------------------

RestorePlanner::RestorePlanner(
    std::vector<TierCheckpoint> mine,
    const std::vector<std::vector<std::pair<uint64_t, TierKind>>>& everyone)
    : mine_(std::move(mine)) {
  std::sort(mine_.begin(), mine_.end(), [](const TierCheckpoint& a, const TierCheckpoint& b) {
    return std::tie(a.step, a.tier, a.uri) < std::tie(b.step, b.tier, b.uri);
  });
  std::set<uint64_t> common;
  for (size_t r = 0; r < everyone.size(); ++r) {
    std::set<uint64_t> steps;
    for (const auto& [step, tier] : everyone[r]) steps.insert(step);
    if (r == 0) {
      common = std::move(steps);
    } else {
      std::set<uint64_t> both;
      std::set_intersection(common.begin(), common.end(), steps.begin(), steps.end(),
                            std::inserter(both, both.end()));
      common = std::move(both);
    }
  }
  steps_.assign(common.rbegin(), common.rend());
}

const TierCheckpoint* RestorePlanner::Next(uint64_t step) const {
  for (const TierCheckpoint& c : mine_) {
    if (c.step != step) continue;
    if (std::find(failed_.begin(), failed_.end(), std::make_pair(step, c.tier)) != failed_.end()) {
      continue;
    }
    return &c;
  }
  return nullptr;
}

void RestorePlanner::Fail(uint64_t step, TierKind tier, std::string_view why) {
  failed_.emplace_back(step, tier);
  failures_.push_back("step " + std::to_string(step) + " (" + std::string(TierName(tier)) +
                      "): " + std::string(why));
}

std::string RestorePlanner::Failures() const {
  std::string out;
  for (const std::string& f : failures_) out += (out.empty() ? "" : "; ") + f;
  return out;
}

}  // namespace cairn
