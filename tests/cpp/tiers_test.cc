// Tests of a manager's tiers (cairn/tiers.h): URIs, overlap detection,
// candidate ordering and damaged entries, memory slot choice, the run id,
// retention and the restore planner.
#include "cairn/tiers.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "cairn/fault_injection.h"
#include "scratch_dir.h"

namespace cairn {
namespace {

using test_util::ScratchDir;

// Saves a small committed checkpoint into `dir` of the storage at `uri`; with
// `run_id`, its manifest's extra records the manager's step and run.
void SaveAt(const std::string& uri, const std::string& dir, uint64_t step,
            const std::string& run_id = "") {
  auto storage = OpenStorage(uri, /*create=*/true);
  ASSERT_TRUE(storage.ok()) << storage.status().ToString();
  ThreadPool pool(2);
  std::vector<float> x(100, 1.5f);
  DataFileOptions opts;
  opts.sync = false;
  ASSERT_TRUE(
      SaveBuffers(storage->get(), dir, {{"x", "float32", {100}, x.data()}}, &pool, opts).ok());
  if (run_id.empty()) return;
  auto m = ReadManifest(storage->get(), dir);
  ASSERT_TRUE(m.ok());
  m->extra =
      R"({"manager": {"step": )" + std::to_string(step) + R"(, "run_id": ")" + run_id + R"("}})";
  ASSERT_TRUE(UncommitCheckpoint(storage->get(), dir).ok());
  Status s = CommitManifest(storage->get(), dir, *m);
  ASSERT_TRUE(s.ok()) << s.ToString();
}

// A memory tier in /dev/shm for one test, removed afterwards.
struct ShmTier {
  explicit ShmTier(const std::string& root) : name(MemoryTierName(root)) {}
  ~ShmTier() {
    std::error_code ec;
    std::filesystem::remove_all(ShmDirectory(name), ec);
  }
  std::string name;
};

// A durable tier <scratch>/run and a local one <scratch>/fast.
TierSetOptions RunAndFast(const ScratchDir& scratch, bool memory) {
  TierSetOptions o;
  o.root = scratch.path() + "/run";
  o.local = scratch.path() + "/fast";
  o.memory = memory;
  return o;
}

TEST(TierUriTest, NormalizesPathsAndRefusesOtherSchemes) {
  EXPECT_EQ(*NormalizeTierUri("/a/./b//c/../d/", "root"), "/a/b/d");
  EXPECT_EQ(*NormalizeTierUri("s3://bucket/run//", "root"), "s3://bucket/run");
  EXPECT_EQ(*NormalizeTierUri("file:///x/", "local"), "file:///x/");
  char cwd[4096];
  ASSERT_NE(::getcwd(cwd, sizeof(cwd)), nullptr);
  EXPECT_EQ(*NormalizeTierUri("rel/dir", "root"), std::string(cwd) + "/rel/dir");
  auto empty = NormalizeTierUri("", "root");
  EXPECT_EQ(empty.status().message(), "invalid root directory ''");
  auto s3_local = NormalizeTierUri("s3://bucket/x", "local");
  EXPECT_EQ(s3_local.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s3_local.status().message(), "unsupported local URI: s3://bucket/x");
  EXPECT_EQ(NormalizeTierUri("mem://x", "root").status().message(),
            "unsupported root URI: mem://x");
  EXPECT_EQ(StepDirName(42), "step_0000000042");
  EXPECT_EQ(JoinUri("s3://b/p//", "step_1"), "s3://b/p/step_1");
}

TEST(TierUriTest, MemoryTierNameFollowsTheRootsRealPath) {
  ScratchDir scratch("tiers");
  std::string run = scratch.path() + "/run";
  std::filesystem::create_directory(run);
  std::filesystem::create_directory_symlink(run, scratch.path() + "/link");
  std::string name = MemoryTierName(run);
  EXPECT_EQ(name.size(), 6u + 16u);
  EXPECT_EQ(name.rfind("cairn-", 0), 0u);
  EXPECT_EQ(MemoryTierName(run + "/"), name);
  EXPECT_EQ(MemoryTierName("file://" + run), name);
  EXPECT_EQ(MemoryTierName(scratch.path() + "/link"), name);
  EXPECT_NE(MemoryTierName(scratch.path() + "/other"), name);
  // A root without a local directory: the URI itself, trailing slashes aside.
  EXPECT_EQ(MemoryTierName("s3://b/p/"), MemoryTierName("s3://b/p"));
}

TEST(TierSetTest, RefusesTiersThatOverlap) {
  ScratchDir scratch("tiers");
  TierSetOptions o;
  o.root = scratch.path() + "/run";
  o.local = scratch.path() + "/run/fast";
  o.memory = false;
  auto inside = TierSet::Open(o);
  ASSERT_EQ(inside.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(inside.status().message(), "the durable tier " + o.root + " overlaps the local tier " +
                                           o.local + ": every tier needs a directory of its own");

  std::filesystem::create_directory(o.root);
  std::filesystem::create_directory_symlink(o.root, scratch.path() + "/alias");
  o.local = scratch.path() + "/alias";
  auto same = TierSet::Open(o);
  ASSERT_FALSE(same.ok());
  EXPECT_NE(same.status().message().find("is the same directory as the local tier"),
            std::string::npos);

  o.local = scratch.path() + "/fast";
  EXPECT_TRUE(TierSet::Open(o).ok());
  o.local = "";
  o.root = "/dev/shm";  // holds the memory tier
  o.memory = true;
  auto shm = TierSet::Open(o);
  ASSERT_FALSE(shm.ok());
  EXPECT_NE(shm.status().message().find("overlaps the memory tier"), std::string::npos);
}

TEST(TierSetTest, CandidatesAreFastestFirstAndDamagedOnesAreSkipped) {
  ScratchDir scratch("tiers");
  TierSetOptions o = RunAndFast(scratch, /*memory=*/true);
  o.num_slots = 2;
  ShmTier shm(o.root);
  auto tiers = TierSet::Open(o);
  ASSERT_TRUE(tiers.ok()) << tiers.status().ToString();
  TierSet& t = **tiers;
  ASSERT_TRUE(t.CreateTiers().ok());
  auto id = t.ReadOrCreateRunId();
  ASSERT_TRUE(id.ok());
  t.set_run_id(*id);
  SaveAt(t.root(), StepDirName(1), 1);
  SaveAt(t.root(), StepDirName(2), 2);
  SaveAt(t.local(), StepDirName(2), 2);
  SaveAt("shm://" + t.shm_name(), "slot1", 3, *id);
  SaveAt("shm://" + t.shm_name(), "slot0", 9, "another-run");  // never this run's
  // A damaged manifest (skipped, reported) and a partial save (silently).
  std::filesystem::create_directories(t.root() + "/" + StepDirName(4));
  std::ofstream(t.root() + "/" + StepDirName(4) + "/cairn.manifest") << "garbage";
  std::filesystem::create_directories(t.root() + "/" + StepDirName(5) + "/data");

  std::vector<MemoryCheckpoint> memory;
  std::vector<SkippedCheckpoint> skipped;
  auto found = t.Candidates(true, &memory, &skipped);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  std::vector<std::pair<uint64_t, TierKind>> got;
  for (const auto& c : *found) got.emplace_back(c.step, c.tier);
  std::vector<std::pair<uint64_t, TierKind>> want = {{3, TierKind::kMemory},
                                                     {2, TierKind::kLocal},
                                                     {1, TierKind::kDurable},
                                                     {2, TierKind::kDurable}};
  EXPECT_EQ(got, want);
  EXPECT_EQ((*found)[0].uri, t.SlotUri(1));
  EXPECT_EQ((*found)[1].uri, t.local() + "/step_0000000002");
  ASSERT_EQ(memory.size(), 1u);
  EXPECT_EQ(memory[0].reader->manifest().world_size, 1u);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0].uri, t.root() + "/step_0000000004");
  EXPECT_EQ(skipped[0].status.code(), StatusCode::kDataLoss);

  // The same run id comes back; a fresh root gets a fresh one.
  EXPECT_EQ(*t.ReadOrCreateRunId(), *id);
  EXPECT_EQ(ReadRunId(t.root()), *id);
  EXPECT_EQ(ReadRunId(scratch.path() + "/nowhere"), "");
}

// The candidates of `t` (what was skipped and opened dropped).
Result<std::vector<TierCheckpoint>> CandidatesOf(TierSet& t, bool with_memory) {
  std::vector<MemoryCheckpoint> memory;
  std::vector<SkippedCheckpoint> skipped;
  return t.Candidates(with_memory, &memory, &skipped);
}

// A tier set of only a durable tier, at `root`.
std::unique_ptr<TierSet> DurableOnly(const std::string& root) {
  TierSetOptions o;
  o.root = root;
  o.memory = false;
  auto tiers = TierSet::Open(o);
  EXPECT_TRUE(tiers.ok()) << tiers.status().ToString();
  return tiers.ok() ? std::move(*tiers) : nullptr;
}

TEST(TierSetTest, TiersNotCreatedYetHoldNothing) {
  ScratchDir scratch("tiers");
  const std::string root = scratch.path() + "/not/yet";
  std::unique_ptr<TierSet> tiers = DurableOnly(root);
  ASSERT_NE(tiers, nullptr);
  auto found = CandidatesOf(*tiers, true);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  EXPECT_TRUE(found->empty());
  EXPECT_FALSE(std::filesystem::exists(root));  // nothing created
}

TEST(TierSetTest, KeepsOneStorageThatFollowsARootMadeAgain) {
  ScratchDir scratch("tiers");
  const std::string root = scratch.path() + "/run";
  std::unique_ptr<TierSet> tiers = DurableOnly(root);
  ASSERT_NE(tiers, nullptr);
  TierSet& t = *tiers;
  auto durable = t.TierStorage(TierKind::kDurable);
  ASSERT_TRUE(durable.ok());
  EXPECT_EQ(durable->get(), t.TierStorage(TierKind::kDurable)->get());  // opened once
  ASSERT_TRUE(t.CreateTiers().ok());
  SaveAt(t.root(), StepDirName(1), 1);
  std::filesystem::remove_all(root);  // removed under the live set, then made again
  std::filesystem::create_directories(root);
  SaveAt(t.root(), StepDirName(2), 2);
  auto found = CandidatesOf(t, false);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  ASSERT_EQ(found->size(), 1u);
  EXPECT_EQ((*found)[0].step, 2u);
  EXPECT_EQ((*found)[0].name, StepDirName(2));
  // Removed for good: nothing to list, and the next write makes it again.
  std::filesystem::remove_all(root);
  found = CandidatesOf(t, false);
  ASSERT_TRUE(found.ok());
  EXPECT_TRUE(found->empty());
  EXPECT_TRUE((*durable)->PutAtomic("x", "y").ok());
  EXPECT_TRUE(std::filesystem::exists(root + "/x"));
  EXPECT_EQ(t.TierStorage(TierKind::kLocal).status().code(), StatusCode::kInvalidArgument);
}

TEST(TierSetTest, UsesTheStorageItIsGiven) {
  ScratchDir scratch("tiers");
  auto base = NewPosixStorage(scratch.path() + "/run");
  ASSERT_TRUE(base.ok());
  auto inj = std::make_shared<FaultInjector>();
  TierSetOptions o;
  o.root_storage = std::make_shared<FaultInjectionStorage>(std::move(*base), inj);
  o.memory = false;
  auto tiers = TierSet::Open(o);
  ASSERT_TRUE(tiers.ok()) << tiers.status().ToString();
  TierSet& t = **tiers;
  EXPECT_EQ(t.root(), scratch.path() + "/run");  // named by its local path
  EXPECT_EQ(t.shm_name(), MemoryTierName(scratch.path() + "/run"));
  EXPECT_EQ(t.TierStorage(TierKind::kDurable)->get(), o.root_storage.get());
  inj->AddRule({.op = FaultOp::kList, .count = 0, .error = EIO});
  EXPECT_EQ(CandidatesOf(t, false).status().code(), StatusCode::kIOError);
  EXPECT_GE(inj->Calls(FaultOp::kList), 1u);
}

TEST(TierSetTest, OldestSlotIsAFreeOneElseTheOldestStep) {
  ScratchDir scratch("tiers");
  TierSetOptions o;
  o.root = scratch.path() + "/run";
  o.num_slots = 3;
  ShmTier shm(o.root);
  auto tiers = TierSet::Open(o);
  ASSERT_TRUE(tiers.ok());
  TierSet& t = **tiers;
  t.set_run_id("run-a");
  EXPECT_EQ(t.OldestSlot(), 0u);
  const std::string tier = "shm://" + t.shm_name();
  SaveAt(tier, "slot0", 5, "run-a");
  SaveAt(tier, "slot1", 3, "run-a");
  SaveAt(tier, "slot2", 1, "run-b");  // another run's: free for this one
  EXPECT_EQ(t.OldestSlot(), 2u);
  SaveAt(tier, "slot2", 7, "run-a");
  EXPECT_EQ(t.OldestSlot(), 1u);
  auto held = t.MemoryCheckpoints();
  ASSERT_EQ(held.size(), 3u);
  EXPECT_EQ(held[2].step, 7u);
  // The drill's scan: every committed slot of the run, whatever the slot count.
  EXPECT_EQ(FindMemoryCheckpoints(t.shm_name(), "run-b", 0).size(), 0u);
  EXPECT_EQ(FindMemoryCheckpoints(t.shm_name(), "", 0).size(), 3u);
}

TEST(TierSetTest, PruneKeepsEachTiersNewest) {
  ScratchDir scratch("tiers");
  TierSetOptions o = RunAndFast(scratch, /*memory=*/false);
  o.keep = 2;
  o.keep_local = 1;
  auto tiers = TierSet::Open(o);
  ASSERT_TRUE(tiers.ok());
  TierSet& t = **tiers;
  for (uint64_t s = 1; s <= 3; ++s) {
    SaveAt(t.root(), StepDirName(s), s);
    SaveAt(t.local(), StepDirName(s), s);
  }
  ASSERT_TRUE(t.Prune(TierKind::kDurable).ok());
  ASSERT_TRUE(t.Prune(TierKind::kLocal).ok());
  EXPECT_FALSE(std::filesystem::exists(t.root() + "/step_0000000001"));
  EXPECT_TRUE(std::filesystem::exists(t.root() + "/step_0000000002"));
  EXPECT_FALSE(std::filesystem::exists(t.local() + "/step_0000000002"));
  EXPECT_TRUE(std::filesystem::exists(t.local() + "/step_0000000003"));
}

TEST(RestorePlannerTest, NewestCommonStepFastestSourceThenFallback) {
  std::vector<TierCheckpoint> mine = {{5, TierKind::kDurable, "/r/step_5"},
                                      {5, TierKind::kMemory, "shm://t/slot0"},
                                      {4, TierKind::kDurable, "/r/step_4"},
                                      {6, TierKind::kMemory, "shm://t/slot1"}};
  // Rank 1 lacks step 6: the newest common step is 5.
  RestorePlanner plan(mine, {{{4, TierKind::kDurable},
                              {5, TierKind::kMemory},
                              {5, TierKind::kDurable},
                              {6, TierKind::kMemory}},
                             {{4, TierKind::kDurable}, {5, TierKind::kLocal}}});
  EXPECT_EQ(plan.steps(), (std::vector<uint64_t>{5, 4}));
  ASSERT_NE(plan.Next(5), nullptr);
  EXPECT_EQ(plan.Next(5)->tier, TierKind::kMemory);
  plan.Fail(5, TierKind::kMemory, "checksum mismatch");
  EXPECT_EQ(plan.Next(5)->uri, "/r/step_5");
  plan.Fail(5, TierKind::kDurable, "failed on another rank");
  EXPECT_EQ(plan.Next(5), nullptr);
  EXPECT_EQ(plan.Next(4)->tier, TierKind::kDurable);
  EXPECT_EQ(plan.Failures(),
            "step 5 (memory): checksum mismatch; step 5 (durable): failed on another rank");
  EXPECT_TRUE(RestorePlanner({}, {{}}).steps().empty());
}

TEST(DrillPickTest, PicksByTierAndSaysWhyNot) {
  ScratchDir scratch("tiers");
  std::string root = scratch.path() + "/run";
  auto none = PickDrillCheckpoint(root, "", "");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->uri.empty());
  EXPECT_EQ(none->why, "no committed checkpoint in the durable tier of " + root);
  SaveAt(root, StepDirName(1), 1);
  SaveAt(root, StepDirName(2), 2);
  EXPECT_EQ(PickDrillCheckpoint(root, "", "")->uri, root + "/step_0000000002");
  EXPECT_EQ(PickDrillCheckpoint(root + "/step_0000000001", "", "")->uri, root + "/step_0000000001");
  EXPECT_EQ(PickDrillCheckpoint(root, "durable", "")->source, "durable");
  EXPECT_EQ(PickDrillCheckpoint(root, "local", "")->why,
            "--tier local needs --local DIR (the manager's local tier)");
  EXPECT_EQ(PickDrillCheckpoint(root, "bogus", "")->why,
            "unknown tier 'bogus' (one of memory, local, durable)");
  ShmTier shm(root);
  std::ofstream(root + "/cairn.run") << "run-a\n";
  SaveAt("shm://" + shm.name, "slot0", 4, "run-a");
  SaveAt("shm://" + shm.name, "slot1", 8, "run-b");
  auto mem = PickDrillCheckpoint(root, "memory", "");
  ASSERT_TRUE(mem.ok());
  EXPECT_EQ(mem->uri, "shm://" + shm.name + "/slot0");
  EXPECT_EQ(mem->source, "memory");
}

}  // namespace
}  // namespace cairn
