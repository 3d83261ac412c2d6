// The partition arithmetic of cairn.data (cairn/partition.h) against values
// worked out by hand, edge cases included (n = 0, world > n, drop_last).
#include "cairn/partition.h"

#include <gtest/gtest.h>

#include <numeric>

namespace cairn {
namespace {

using V = std::vector<int64_t>;

TEST(Partition, PerRankPadsOrDropsTheRemainder) {
  EXPECT_EQ(PerRank(10, 0, 3, false), 4);
  EXPECT_EQ(PerRank(10, 0, 3, true), 3);
  EXPECT_EQ(EpochEnd(10, 0, 3, false), 12);
  EXPECT_EQ(EpochEnd(10, 0, 3, true), 9);
  EXPECT_EQ(PerRank(10, 4, 3, false), 2);  // 6 remaining
  EXPECT_EQ(EpochEnd(10, 4, 3, false), 10);
}

TEST(Partition, EmptyOrFinishedEpochGivesNothing) {
  EXPECT_EQ(PerRank(0, 0, 2, false), 0);
  EXPECT_EQ(EpochEnd(0, 0, 2, false), 0);
  EXPECT_EQ(PerRank(5, 5, 2, false), 0);
  EXPECT_EQ(PerRank(5, 7, 2, false), 0);
  EXPECT_EQ(EpochEnd(5, 7, 2, false), 7);
  EXPECT_TRUE(RankPositions(0, 0, 4, 1, false).empty());
}

TEST(Partition, MoreRanksThanItems) {
  EXPECT_EQ(PerRank(3, 0, 5, false), 1);
  EXPECT_EQ(EpochEnd(3, 0, 5, false), 5);  // ranks 3 and 4 wrap around
  EXPECT_EQ(PerRank(3, 0, 5, true), 0);
  EXPECT_EQ(RankPositions(3, 0, 5, 4, false), V({4}));
  EXPECT_TRUE(RankPositions(3, 0, 5, 4, true).empty());
  EXPECT_EQ(Padded(V{7, 8, 9}, 5), V({7, 8, 9, 7, 8}));
}

TEST(Partition, RankPositionsStrideOverRanksFromStart) {
  EXPECT_EQ(RankPositions(10, 2, 3, 1, false), V({3, 6, 9}));
  EXPECT_EQ(RankPositions(10, 2, 3, 0, true), V({2, 5}));
  EXPECT_EQ(RankPositions(10, 0, 1, 0, false), V({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

TEST(Partition, WorkerPositionsTakeEveryNumWorkersthBatch) {
  V rank(10);
  std::iota(rank.begin(), rank.end(), 100);
  EXPECT_EQ(WorkerPositions(rank, 2, 0, 2), V({100, 101, 104, 105, 108, 109}));
  EXPECT_EQ(WorkerPositions(rank, 2, 1, 2), V({102, 103, 106, 107}));
  EXPECT_EQ(WorkerPositions(rank, 3, 2, 3), V({106, 107, 108}));
  // num_workers and batch_size below 1 count as 1.
  EXPECT_EQ(WorkerPositions(rank, 0, 0, 0), rank);
  EXPECT_TRUE(WorkerPositions(rank, 2, 5, 1).empty());
}

TEST(Partition, PaddedWrapsAroundOnlyWhenShort) {
  EXPECT_EQ(Padded(V{1, 2, 3}, 2), V({1, 2, 3}));
  EXPECT_EQ(Padded(V{1, 2, 3}, 3), V({1, 2, 3}));
  EXPECT_EQ(Padded(V{1, 2}, 5), V({1, 2, 1, 2, 1}));
  EXPECT_TRUE(Padded(V{}, 4).empty());
}

std::vector<ShardWork> Items(std::initializer_list<std::pair<int64_t, int64_t>> l) {
  std::vector<ShardWork> out;
  for (auto [s, o] : l) out.push_back({s, o});
  return out;
}

void ExpectWork(const std::vector<ShardWork>& got,
                std::initializer_list<std::pair<int64_t, int64_t>> want) {
  ASSERT_EQ(got.size(), want.size());
  size_t i = 0;
  for (auto [s, o] : want) {
    EXPECT_EQ(got[i].shard, s) << "item " << i;
    EXPECT_EQ(got[i].offset, o) << "item " << i;
    ++i;
  }
}

TEST(ShardWork, CollapseKeepsProgressThenUntouchedInOriginalOrder) {
  auto work = Items({{0, 0}, {1, 0}, {2, 0}, {3, 0}, {4, 0}});
  // 2 slots: slot 0 has items 0, 2, 4 (one done, 2 samples into item 2); slot
  // 1 has items 1, 3 (both done).
  std::vector<SlotProgress> progress = {{1, 2}, {2, 0}};
  auto out = CollapseWork(work, progress);
  ASSERT_TRUE(out.ok());
  ExpectWork(*out, {{2, 2}, {4, 0}});
}

TEST(ShardWork, CollapseOfUnstartedSlotsAddsOffsetsToTheirBase) {
  auto work = Items({{7, 5}, {8, 0}, {9, 0}, {6, 1}, {5, 0}});
  std::vector<SlotProgress> progress = {{0, 3}, {0, 0}};
  auto out = CollapseWork(work, progress);
  ASSERT_TRUE(out.ok());
  ExpectWork(*out, {{7, 8}, {8, 0}, {9, 0}, {6, 1}, {5, 0}});
}

TEST(ShardWork, CollapseRejectsNegativeProgress) {
  auto work = Items({{0, 0}});
  std::vector<SlotProgress> progress = {{-1, 0}};
  EXPECT_EQ(CollapseWork(work, progress).status().code(), StatusCode::kInvalidArgument);
}

TEST(ShardWork, ResumeOnAsManySlotsKeepsEverything) {
  auto r = ResumeWork(Items({{3, 0}, {1, 4}}), {{0, 2}, {1, 0}}, 2);
  ASSERT_TRUE(r.ok());
  ExpectWork(r->first, {{3, 0}, {1, 4}});
  ASSERT_EQ(r->second.size(), 2u);
  EXPECT_EQ(r->second[0].offset, 2);
  EXPECT_EQ(r->second[1].done, 1);
}

TEST(ShardWork, ResumeOnOtherSlotsCollapsesAndStartsEverySlotAfresh) {
  auto r = ResumeWork(Items({{0, 0}, {1, 0}, {2, 0}, {3, 0}, {4, 0}}), {{1, 2}, {2, 0}}, 3);
  ASSERT_TRUE(r.ok());
  ExpectWork(r->first, {{2, 2}, {4, 0}});
  ASSERT_EQ(r->second.size(), 3u);
  for (const SlotProgress& p : r->second) EXPECT_EQ(p.done + p.offset, 0);
}

}  // namespace
}  // namespace cairn
