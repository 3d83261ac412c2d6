// Memory-tier bookkeeping: leases, the orphan decision, reclaiming. Every test
// scans a private directory standing in for /dev/shm.
#include "cairn/memory_tier.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "scratch_dir.h"

namespace cairn {
namespace {

namespace fs = std::filesystem;

double Now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

class MemoryTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directories(shm_);
    fs::create_directories(root_);
    std::ofstream(root_ + "/cairn.run") << "run-1\n";
  }

  MemoryTierLeaseOptions Opts(const std::string& name = "cairn-00112233aabbccdd") {
    MemoryTierLeaseOptions o;
    o.dir = shm_ + "/" + name;
    o.run_root = root_;
    o.run_id = "run-1";
    o.rank = 0;
    o.heartbeat_seconds = 0;
    return o;
  }
  MemoryTierScanOptions Scan(double grace = 600, double now = 0) {
    MemoryTierScanOptions s;
    s.shm_root = shm_;
    s.grace_seconds = grace;
    s.now = now;
    return s;
  }
  std::vector<MemoryTierInfo> List(double grace = 600, double now = 0) {
    auto r = ListMemoryTiers(Scan(grace, now));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : std::vector<MemoryTierInfo>{};
  }

  test_util::ScratchDir scratch_{"tier_test"};
  const std::string base_ = scratch_.path(), shm_ = base_ + "/shm", root_ = base_ + "/run";
};

TEST_F(MemoryTierTest, LeaseMakesTheTierInUseWithItsOwnerAndRunRoot) {
  auto lease = MemoryTierLease::Acquire(Opts());
  ASSERT_TRUE(lease.ok()) << lease.status().ToString();
  std::ofstream(shm_ + "/cairn-00112233aabbccdd/slot0.bin") << std::string(10000, 'x');
  auto tiers = List(/*grace=*/0, Now() + 3600);
  ASSERT_EQ(tiers.size(), 1u);
  const MemoryTierInfo& t = tiers[0];
  EXPECT_EQ(t.kind, "memory");
  EXPECT_EQ(t.run_root, root_);
  EXPECT_TRUE(t.in_use);
  EXPECT_FALSE(t.orphaned);  // a live owner wins over any grace period
  EXPECT_GE(t.bytes, 10000u);
  ASSERT_EQ(t.owners.size(), 1u);
  EXPECT_EQ(t.owners[0].pid, ::getpid());
  EXPECT_EQ(t.owners[0].state, "alive");
  EXPECT_GT(t.created, 0);
}

TEST_F(MemoryTierTest, LiveOwnerIsNeverReclaimedEvenWithItsRunRootGone) {
  auto lease = MemoryTierLease::Acquire(Opts());
  ASSERT_TRUE(lease.ok());
  fs::remove_all(root_);
  std::vector<MemoryTierInfo> gone;
  ASSERT_TRUE(ReclaimOrphanedMemoryTiers(Scan(0), &gone).ok());
  EXPECT_TRUE(gone.empty());
  EXPECT_TRUE(fs::exists(shm_ + "/cairn-00112233aabbccdd"));
}

TEST_F(MemoryTierTest, ReleasedTierIsKeptWithinTheGracePeriodAndReclaimedAfter) {
  {
    auto lease = MemoryTierLease::Acquire(Opts());
    ASSERT_TRUE(lease.ok());
  }
  auto tiers = List(600);
  ASSERT_EQ(tiers.size(), 1u);
  EXPECT_FALSE(tiers[0].in_use);
  EXPECT_FALSE(tiers[0].orphaned) << tiers[0].reason;
  std::vector<MemoryTierInfo> gone;
  ASSERT_TRUE(ReclaimOrphanedMemoryTiers(Scan(600), &gone).ok());
  EXPECT_TRUE(gone.empty());
  ASSERT_TRUE(ReclaimOrphanedMemoryTiers(Scan(600, Now() + 601), &gone).ok());
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_NE(gone[0].reason.find("grace"), std::string::npos) << gone[0].reason;
  EXPECT_FALSE(fs::exists(shm_ + "/cairn-00112233aabbccdd"));
}

TEST_F(MemoryTierTest, RestoreRestartsTheGracePeriod) {
  auto lease = MemoryTierLease::Acquire(Opts());
  ASSERT_TRUE(lease.ok());
  double before = List()[0].created;
  ASSERT_TRUE((*lease)->MarkRestored().ok());
  ASSERT_TRUE((*lease)->Release().ok());
  auto tiers = List();
  ASSERT_EQ(tiers.size(), 1u);
  EXPECT_GE(tiers[0].last_restored, before);
  EXPECT_GE(tiers[0].last_active, tiers[0].last_restored);
}

TEST_F(MemoryTierTest, GoneRunRootOrAnotherRunInItIsReclaimedWithoutGrace) {
  ASSERT_TRUE(MemoryTierLease::Acquire(Opts("cairn-aaaaaaaaaaaaaaaa")).ok());
  ASSERT_TRUE(MemoryTierLease::Acquire(Opts("cairn-bbbbbbbbbbbbbbbb")).ok());
  std::ofstream(root_ + "/cairn.run") << "run-2\n";  // root re-created by another run
  std::vector<MemoryTierInfo> gone;
  ASSERT_TRUE(ReclaimOrphanedMemoryTiers(Scan(600), &gone).ok());
  ASSERT_EQ(gone.size(), 2u);
  EXPECT_NE(gone[0].reason.find("another run"), std::string::npos) << gone[0].reason;
  fs::remove_all(root_);
  ASSERT_TRUE(MemoryTierLease::Acquire(Opts()).ok());
  gone.clear();
  ASSERT_TRUE(ReclaimOrphanedMemoryTiers(Scan(600), &gone).ok());
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_NE(gone[0].reason.find("is gone"), std::string::npos) << gone[0].reason;
  EXPECT_TRUE(List().empty());
}

TEST_F(MemoryTierTest, SigkilledOwnerShowsDeadAndItsTierIsNoLongerInUse) {
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto lease = MemoryTierLease::Acquire(Opts());
    char c = lease.ok() ? 'y' : 'n';
    (void)!::write(ready[1], &c, 1);
    ::pause();
    ::_exit(0);
  }
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ASSERT_EQ(c, 'y');
  auto tiers = List();
  ASSERT_EQ(tiers.size(), 1u);
  EXPECT_TRUE(tiers[0].in_use);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  ::close(ready[0]);
  ::close(ready[1]);
  tiers = List(600, Now() + 601);
  ASSERT_EQ(tiers.size(), 1u);
  EXPECT_FALSE(tiers[0].in_use);
  EXPECT_TRUE(tiers[0].orphaned);
  ASSERT_EQ(tiers[0].owners.size(), 1u);
  EXPECT_EQ(tiers[0].owners[0].pid, child);
  EXPECT_EQ(tiers[0].owners[0].state, "dead");
  // The next owner takes the tier over and drops the dead owner's record.
  auto lease = MemoryTierLease::Acquire(Opts());
  ASSERT_TRUE(lease.ok());
  tiers = List();
  ASSERT_EQ(tiers[0].owners.size(), 1u);
  EXPECT_EQ(tiers[0].owners[0].pid, ::getpid());
}

TEST_F(MemoryTierTest, DeadStagerDirectoryIsOrphanedAndOtherDirectoriesAreIgnored) {
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);  // a pid that is gone
  fs::create_directories(shm_ + "/cairn-stager-" + std::to_string(child) + "-abc/slot0");
  fs::create_directories(shm_ + "/cairn-stager-" + std::to_string(::getpid()) + "-def");
  fs::create_directories(shm_ + "/cairn-notes");  // not a tier name
  fs::create_directories(shm_ + "/something-else");
  auto tiers = List();
  ASSERT_EQ(tiers.size(), 2u);
  std::vector<MemoryTierInfo> gone;
  ASSERT_TRUE(ReclaimOrphanedMemoryTiers(Scan(), &gone).ok());
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].kind, "staging");
  EXPECT_EQ(gone[0].owners[0].pid, child);
  EXPECT_TRUE(fs::exists(shm_ + "/cairn-notes"));
  EXPECT_TRUE(fs::exists(shm_ + "/cairn-stager-" + std::to_string(::getpid()) + "-def"));
}

TEST_F(MemoryTierTest, LegacyTierWithALockedSlotFileIsInUse) {
  std::string dir = shm_ + "/cairn-0123456789abcdef";
  fs::create_directories(dir + "/slot0/data");
  std::string file = dir + "/slot0/data/r0.bin";
  std::ofstream(file) << "x";
  int fd = ::open(file.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  auto tiers = List(0, Now() + 10);
  ASSERT_EQ(tiers.size(), 1u);
  EXPECT_EQ(tiers[0].kind, "legacy");
  EXPECT_TRUE(tiers[0].in_use);
  ::close(fd);
  tiers = List(0, Now() + 10);
  EXPECT_TRUE(tiers[0].orphaned) << tiers[0].reason;
}

TEST_F(MemoryTierTest, LastOwnerOutRemovesATierLeftEmptyAndOnlyThen) {
  const std::string dir = shm_ + "/cairn-00112233aabbccdd";
  auto a = MemoryTierLease::Acquire(Opts());
  auto b = MemoryTierLease::Acquire(Opts());
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->Release(/*remove_if_empty=*/true).ok());
  EXPECT_TRUE(fs::exists(dir));  // b still holds it
  fs::create_directories(dir + "/slot0/data");
  std::ofstream(dir + "/slot0/data/r0.bin") << "x";
  ASSERT_TRUE((*b)->Release(true).ok());
  EXPECT_TRUE(fs::exists(dir));  // a slot file is left: kept
  fs::remove_all(dir + "/slot0");
  auto c = MemoryTierLease::Acquire(Opts());
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->Release(true).ok());
  EXPECT_FALSE(fs::exists(dir));
}

TEST_F(MemoryTierTest, SharedMemoryRoomReportsTheFilesystem) {
  auto room = GetSharedMemoryRoom(shm_);
  ASSERT_TRUE(room.ok());
  EXPECT_GT(room->total, 0u);
  EXPECT_LE(room->free, room->total);
  EXPECT_LE(room->usable(), room->free);
  EXPECT_FALSE(GetSharedMemoryRoom(shm_ + "/missing").ok());
}

}  // namespace
}  // namespace cairn
