// Tests of read planning (read_plan.h): byte ranges of boxes, box reads
// through a real checkpoint, the in-place plan and each mismatch that
// refuses it; and of PlaceWrittenItems (manifest.h).
#include "cairn/read_plan.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "cairn/checkpoint.h"
#include "cairn/storage.h"

namespace cairn {
namespace {

using Range = std::optional<ByteRange>;

Range ByteRangeOf(std::vector<int64_t> o, std::vector<int64_t> l, std::vector<int64_t> s,
                  uint64_t e) {
  Result<Range> r = ChunkByteRange(o, l, s, e);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : Range();
}

TEST(ChunkByteRange, ContiguousBoxesAndOthers) {
  auto is = [](Range r, uint64_t off, uint64_t n) {
    return r.has_value() && r->offset == off && r->size == n;
  };
  EXPECT_TRUE(is(ByteRangeOf({0, 0}, {4, 5}, {4, 5}, 4), 0, 80));    // the whole chunk
  EXPECT_TRUE(is(ByteRangeOf({1, 0}, {2, 5}, {4, 5}, 4), 20, 40));   // whole rows
  EXPECT_TRUE(is(ByteRangeOf({2, 1}, {1, 3}, {4, 5}, 2), 22, 6));    // a row fragment
  EXPECT_FALSE(ByteRangeOf({0, 1}, {4, 2}, {4, 5}, 4).has_value());  // a column block
  EXPECT_TRUE(is(ByteRangeOf({1, 0, 0}, {1, 1, 3}, {2, 2, 3}, 1), 6, 3));
  EXPECT_TRUE(is(ByteRangeOf({0, 0}, {0, 5}, {4, 5}, 4), 0, 0));  // empty
  EXPECT_TRUE(is(ByteRangeOf({}, {}, {}, 8), 0, 8));              // a scalar
}

TEST(ChunkByteRange, RefusesBoxesOutsideTheChunk) {
  std::vector<int64_t> s = {4, 5};
  for (auto [o, l] : std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>>{
           {{3, 0}, {2, 5}}, {{-1, 0}, {1, 5}}, {{0, 0}, {1, -5}}, {{0}, {1}}}) {
    EXPECT_EQ(ChunkByteRange(o, l, s, 4).status().code(), StatusCode::kInvalidArgument);
  }
}

class ReadPlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    storage_ = NewMemStorage();
    w_.resize(4 * 5);
    std::iota(w_.begin(), w_.end(), 0.0f);
    ASSERT_TRUE(SaveBuffers(storage_.get(), "ck",
                            {{"w", "float32", {4, 5}, w_.data()}, {"b", "uint8", {3}, "abc"}},
                            &pool_)
                    .ok());
    auto r = CheckpointReader::Open(storage_.get(), "ck");
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    reader_ = std::move(*r);
    index_ = std::make_unique<ItemIndex>(reader_->manifest());
  }
  BoxRead Box(std::vector<int64_t> o, std::vector<int64_t> l, float* dest) {
    std::optional<ItemRef> item = index_->Chunk("w", {0, 0});
    EXPECT_TRUE(item.has_value());
    uint64_t n = 4 * static_cast<uint64_t>(l[0] * l[1]);
    return {item->index, item->chunk, std::move(o), std::move(l), dest, n};
  }

  ThreadPool pool_{4};
  std::unique_ptr<Storage> storage_;
  std::vector<float> w_;
  std::unique_ptr<CheckpointReader> reader_;
  std::unique_ptr<ItemIndex> index_;
};

TEST_F(ReadPlanTest, BoxesLandInTheirMemoryWhateverTheirShape) {
  std::vector<float> rows(10), cols(8), block(6);
  std::vector<BoxRead> boxes = {Box({1, 0}, {2, 5}, rows.data()), Box({0, 1}, {4, 2}, cols.data()),
                                Box({1, 2}, {2, 3}, block.data())};
  ASSERT_TRUE(ReadBoxes(reader_.get(), boxes, {}, &pool_).ok());
  EXPECT_EQ(rows, std::vector<float>({5, 6, 7, 8, 9, 10, 11, 12, 13, 14}));
  EXPECT_EQ(cols, std::vector<float>({1, 2, 6, 7, 11, 12, 16, 17}));
  EXPECT_EQ(block, std::vector<float>({7, 8, 9, 12, 13, 14}));
}

TEST_F(ReadPlanTest, BadBoxesAreRefusedBeforeAnyRead) {
  std::vector<float> out(20, -1);
  BoxRead outside = Box({3, 0}, {2, 5}, out.data());
  EXPECT_EQ(ReadBoxes(reader_.get(), std::vector<BoxRead>{outside}, {}, &pool_).code(),
            StatusCode::kInvalidArgument);
  BoxRead wrong_size = Box({0, 0}, {1, 5}, out.data());
  wrong_size.nbytes += 4;
  EXPECT_EQ(ReadBoxes(reader_.get(), std::vector<BoxRead>{wrong_size}, {}, &pool_).code(),
            StatusCode::kInvalidArgument);
  BoxRead no_chunk = Box({0, 0}, {1, 5}, out.data());
  no_chunk.chunk = 7;
  EXPECT_EQ(ReadBoxes(reader_.get(), std::vector<BoxRead>{no_chunk}, {}, &pool_).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(out, std::vector<float>(20, -1));
}

TEST_F(ReadPlanTest, InPlacePlanReadsEveryTargetStraightIn) {
  std::vector<float> w(20);
  std::vector<InPlaceTarget> targets = {{"w", true, "float32", {4, 5}, w.data(), 80},
                                        {"b", true, "uint8", {3}, nullptr, 3}};
  std::vector<char> b(3);
  targets[1].data = b.data();
  auto reqs = PlanInPlaceRead(reader_->manifest(), *index_, targets);
  ASSERT_TRUE(reqs.has_value());
  ASSERT_EQ(reqs->size(), 2u);
  ASSERT_TRUE(reader_->Read(*reqs, &pool_).ok());
  EXPECT_EQ(w, w_);
  EXPECT_EQ(std::string(b.data(), 3), "abc");
}

TEST_F(ReadPlanTest, InPlacePlanRefusesEveryMismatch) {
  const Manifest& m = reader_->manifest();
  float w[20];
  InPlaceTarget good{"w", true, "float32", {4, 5}, w, 80};
  ASSERT_TRUE(PlanInPlaceRead(m, *index_, std::vector<InPlaceTarget>{good}).has_value());
  std::vector<InPlaceTarget> bad(6, good);
  bad[0].fqn = "missing";
  bad[1].dtype = "float64";
  bad[2].shape = {5, 4};
  bad[3].nbytes = 40;
  bad[4].tensor = false;  // a value, but "w" is a tensor
  bad[5].fqn = "b";       // stored with another shape and dtype
  for (size_t i = 0; i < bad.size(); ++i) {
    EXPECT_FALSE(PlanInPlaceRead(m, *index_, std::vector<InPlaceTarget>{good, bad[i]}))
        << "mismatch " << i;
  }
  // A tensor stored in two chunks, or as one chunk not at the origin.
  Manifest two = m;
  two.tensors[0].shape = {8, 5};
  two.tensors[0].chunks.push_back(two.tensors[0].chunks[0]);
  two.tensors[0].chunks[1].offsets = {4, 0};
  ItemIndex two_index(two);
  InPlaceTarget big = good;
  big.shape = {8, 5};
  EXPECT_FALSE(PlanInPlaceRead(two, two_index, std::vector<InPlaceTarget>{big}));
  Manifest moved = m;
  moved.tensors[0].chunks[0].offsets = {1, 0};
  ItemIndex moved_index(moved);
  EXPECT_FALSE(PlanInPlaceRead(moved, moved_index, std::vector<InPlaceTarget>{good}));
}

TEST(PlaceWrittenItems, FilesInRankOrderAndEveryItemPlaced) {
  Manifest m;
  ManifestTensor t;
  t.fqn = "w";
  t.chunks.resize(2);
  t.chunks[0].offsets = {0};
  t.chunks[1].offsets = {2};
  m.tensors.push_back(t);
  m.bytes.push_back({"v", {}});
  std::vector<WrittenItem> written = {
      {"w", true, {2}, "data/r10.bin", 9000, {0, 4096, 8, {7}}},
      {"w", true, {0}, "data/r2.bin", 4100, {0, 0, 8, {5}}},
      {"v", false, {}, "data/r2.bin", 4100, {0, 4096, 4, {6}}},
  };
  ASSERT_TRUE(PlaceWrittenItems(&m, written).ok());
  ASSERT_EQ(m.files.size(), 2u);
  EXPECT_EQ(m.files[0].key, "data/r2.bin");
  EXPECT_EQ(m.files[1].key, "data/r10.bin");
  EXPECT_EQ(m.files[1].size, 9000u);
  EXPECT_EQ(m.tensors[0].chunks[1].location.file, 1u);
  EXPECT_EQ(m.tensors[0].chunks[1].location.offset, 4096u);
  EXPECT_EQ(m.tensors[0].chunks[0].location.checksums, std::vector<uint64_t>{5});
  EXPECT_EQ(m.bytes[0].location.file, 0u);
  written.pop_back();
  Status s = PlaceWrittenItems(&m, written);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'v'"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace cairn
