// The memory budget's verdicts (cairn/memory_tier.h: SlotGrowth,
// CheckMemoryBudget, HumanBytes).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "cairn/memory_tier.h"

namespace cairn {
namespace {

MemoryBudgetReport Leader(const std::string& node, uint64_t grow, uint64_t footprint, uint64_t room,
                          uint64_t limit) {
  return {node, grow, true, footprint, room, limit};
}
MemoryBudgetReport Follower(const std::string& node, uint64_t grow) { return {node, grow}; }

TEST(MemoryBudgetTest, GrowthWithinTheLimitPasses) {
  EXPECT_TRUE(
      CheckMemoryBudget({Leader("a", 1 << 20, 2 << 20, 1 << 30, 4 << 20), Follower("a", 1 << 20)},
                        "4194304")
          .ok());
}

TEST(MemoryBudgetTest, EveryLocalRankCountsTowardsItsNode) {
  // Each rank alone fits; together they pass the node's limit.
  Status s = CheckMemoryBudget(
      {Leader("a", 2 << 20, 1 << 20, 1 << 30, 4 << 20), Follower("a", 2 << 20)}, "4194304");
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "memory_limit: this save needs the memory tier on node a to grow by 4.0 MiB to "
            "5.0 MiB, over its memory_limit of 4.0 MiB (4194304); the save was not started and "
            "the memory tier is unchanged");
}

TEST(MemoryBudgetTest, SteadyStateNeedsNothingEvenOverTheLimit) {
  // A tier already above its limit (the limit was lowered) but not growing.
  EXPECT_TRUE(CheckMemoryBudget({Leader("a", 0, 8 << 20, 0, 4 << 20)}, "x").ok());
}

TEST(MemoryBudgetTest, NoRoomOnTheNodeIsRefused) {
  Status s = CheckMemoryBudget({Leader("a", 1 << 20, 0, 4096, 1 << 30)}, "1.0");
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("more shared memory on node a, but only 4.0 KiB is free"),
            std::string::npos)
      << s.message();
}

TEST(MemoryBudgetTest, NodesAreJudgedInNameOrderSoEveryRankAgrees) {
  std::vector<MemoryBudgetReport> r = {Leader("b", 9 << 20, 0, 1 << 30, 1 << 20),
                                       Leader("a", 9 << 20, 0, 1 << 30, 1 << 20)};
  Status s1 = CheckMemoryBudget(r, "1048576");
  std::swap(r[0], r[1]);
  Status s2 = CheckMemoryBudget(r, "1048576");
  EXPECT_EQ(s1.message(), s2.message());
  EXPECT_NE(s1.message().find("node a"), std::string::npos);
}

TEST(MemoryBudgetTest, NodeWithoutALeaderReportIsAnError) {
  EXPECT_EQ(CheckMemoryBudget({Follower("a", 1)}, "1").code(), StatusCode::kInvalidArgument);
}

TEST(MemoryBudgetTest, SlotGrowthRoundsUpAndSubtractsTheFileSize) {
  char dir[] = "/tmp/cairn-budget-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/r0.bin";
  EXPECT_EQ(*SlotGrowth(path, 1, 4096), 4096u);  // missing file
  EXPECT_EQ(*SlotGrowth(path, 0, 4096), 0u);
  FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(ftruncate(fileno(f), 8192), 0);
  std::fclose(f);
  EXPECT_EQ(*SlotGrowth(path, 8192, 4096), 0u);
  EXPECT_EQ(*SlotGrowth(path, 8193, 4096), 4096u);
  EXPECT_EQ(SlotGrowth(path, 1, 0).status().code(), StatusCode::kInvalidArgument);
  std::remove(path.c_str());
  rmdir(dir);
}

TEST(MemoryBudgetTest, HumanBytes) {
  EXPECT_EQ(HumanBytes(512), "512 B");
  EXPECT_EQ(HumanBytes(1536), "1.5 KiB");
  EXPECT_EQ(HumanBytes(uint64_t{3} << 30), "3.0 GiB");
  EXPECT_EQ(HumanBytes(uint64_t{2} << 40), "2.0 TiB");
}

}  // namespace
}  // namespace cairn
