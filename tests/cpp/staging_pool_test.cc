#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "cairn/checkpoint.h"
#include "cairn/checksum.h"
#include "cairn/format.h"
#include "cairn/staging.h"
#include "cairn/storage.h"
#include "random_bytes.h"

namespace cairn {
namespace {

namespace fs = std::filesystem;

std::vector<char> Pattern(size_t n, uint32_t seed) { return test_util::RandomBytes<char>(n, seed); }

class StagingPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    dir_ = ShmDirectory("cairn-staging-test-" + std::to_string(::getpid()) + "-" +
                        std::to_string(counter++));
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::unique_ptr<StagingPool> OpenPool(uint32_t rank = 0, size_t slots = 2) {
    StagingPoolOptions o;
    o.root_dir = dir_;
    o.rank = rank;
    o.num_slots = slots;
    auto p = StagingPool::Open(o);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return p.ok() ? std::move(p).value() : nullptr;
  }
  std::string dir_;
};

TEST_F(StagingPoolTest, AcquireMapsASharedFileOfAtLeastTheSize) {
  auto pool = OpenPool();
  auto slot = pool->Acquire(5'000'000);
  ASSERT_TRUE(slot.ok()) << slot.status().ToString();
  EXPECT_GE(slot->capacity, 5'000'000u);
  EXPECT_EQ(slot->capacity % (2 << 20), 0u);
  EXPECT_EQ(slot->key, "slot" + std::to_string(slot->index) + "/data/r0.bin");
  EXPECT_EQ(slot->path, dir_ + "/" + slot->key);
  EXPECT_EQ(fs::file_size(slot->path), slot->capacity);
  // MAP_SHARED: bytes stored through the mapping are the file's bytes.
  std::memcpy(slot->data + 1000, "staged!", 7);
  std::ifstream in(slot->path, std::ios::binary);
  in.seekg(1000);
  char buf[8] = {};
  in.read(buf, 7);
  EXPECT_STREQ(buf, "staged!");
  EXPECT_TRUE(pool->in_use(slot->index));
  EXPECT_EQ(pool->footprint(), slot->capacity);
}

TEST_F(StagingPoolTest, CopyInPlacesEverySpan) {
  auto pool = OpenPool();
  std::vector<std::vector<char>> srcs;
  std::vector<CopySpan> spans;
  uint64_t off = 0;
  for (int i = 0; i < 40; ++i) {
    srcs.push_back(Pattern(1 + i * 123457, i));
    spans.push_back({srcs.back().data(), off, srcs.back().size()});
    off += (srcs.back().size() + 4095) / 4096 * 4096;
  }
  auto slot = pool->Acquire(off);
  ASSERT_TRUE(slot.ok());
  ThreadPool threads(3);
  ASSERT_TRUE(pool->CopyIn(slot->index, spans, &threads, /*piece_bytes=*/1 << 20).ok());
  for (size_t i = 0; i < spans.size(); ++i) {
    EXPECT_EQ(std::memcmp(slot->data + spans[i].dst_offset, srcs[i].data(), srcs[i].size()), 0)
        << "span " << i;
  }
}

TEST_F(StagingPoolTest, CopyInRejectsSpansOutsideTheSlotAndCopiesNothing) {
  auto pool = OpenPool();
  auto slot = pool->Acquire(1 << 20);
  ASSERT_TRUE(slot.ok());
  std::memset(slot->data, 0, slot->capacity);
  std::vector<char> src(100, 'x');
  std::vector<CopySpan> spans = {{src.data(), 0, 100}, {src.data(), slot->capacity - 50, 100}};
  EXPECT_EQ(pool->CopyIn(slot->index, spans, nullptr).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(slot->data[0], 0);
  spans = {{src.data(), UINT64_MAX - 10, 100}};  // overflow
  EXPECT_EQ(pool->CopyIn(slot->index, spans, nullptr).code(), StatusCode::kOutOfRange);
  spans = {{nullptr, 0, 100}};
  EXPECT_EQ(pool->CopyIn(slot->index, spans, nullptr).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(pool->Release(slot->index).ok());
  spans = {{src.data(), 0, 100}};
  EXPECT_EQ(pool->CopyIn(slot->index, spans, nullptr).code(), StatusCode::kFailedPrecondition);
}

TEST_F(StagingPoolTest, CopyOutReadsTheStagedBytesBack) {
  auto pool = OpenPool();
  std::vector<char> a = Pattern(3 << 20, 1), b = Pattern(12345, 2);
  auto slot = pool->Acquire(8 << 20);
  ASSERT_TRUE(slot.ok());
  std::vector<CopySpan> in = {{a.data(), 0, a.size()}, {b.data(), 4 << 20, b.size()}};
  ThreadPool threads(2);
  ASSERT_TRUE(pool->CopyIn(slot->index, in, &threads, 1 << 20).ok());
  std::vector<char> a2(a.size()), b2(b.size());
  std::vector<CopyOutSpan> out = {{a2.data(), 0, a2.size()}, {b2.data(), 4 << 20, b2.size()}};
  ASSERT_TRUE(pool->CopyOut(slot->index, out, &threads, 1 << 20).ok());
  EXPECT_EQ(a, a2);
  EXPECT_EQ(b, b2);
  out = {{b2.data(), slot->capacity - 10, b2.size()}};
  EXPECT_EQ(pool->CopyOut(slot->index, out, nullptr).code(), StatusCode::kOutOfRange);
}

TEST_F(StagingPoolTest, RepeatedSavesReuseTheSameMemory) {
  auto pool = OpenPool(0, 1);
  char* first = nullptr;
  uint64_t footprint = 0;
  std::vector<char> src = Pattern(3 << 20, 7);
  for (int save = 0; save < 5; ++save) {
    auto slot = pool->Acquire(src.size());
    ASSERT_TRUE(slot.ok());
    if (save == 0) {
      first = slot->data;
      footprint = pool->footprint();
    }
    EXPECT_EQ(slot->data, first);
    EXPECT_EQ(pool->footprint(), footprint);
    CopySpan span{src.data(), 0, src.size()};
    ASSERT_TRUE(pool->CopyIn(slot->index, {&span, 1}, nullptr).ok());
    ASSERT_TRUE(pool->Release(slot->index).ok());
  }
}

TEST_F(StagingPoolTest, SlotsInUseAreNotHandedOutAndTheOldestFreeGoesFirst) {
  auto pool = OpenPool(0, 3);
  auto a = pool->Acquire(1);
  auto b = pool->Acquire(1);
  auto c = pool->Acquire(1);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_NE(a->index, b->index);
  EXPECT_NE(b->index, c->index);
  EXPECT_EQ(pool->Acquire(1).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(pool->AcquireSlot(b->index, 1).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(pool->Release(c->index).ok());
  ASSERT_TRUE(pool->Release(a->index).ok());
  auto d = pool->Acquire(1);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->index, c->index);  // released longest ago
  EXPECT_EQ(pool->Release(b->index).code(), StatusCode::kOk);
  EXPECT_EQ(pool->Release(b->index).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->AcquireSlot(7, 1).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(StagingPoolTest, GrowingKeepsTheStagedBytes) {
  auto pool = OpenPool(0, 1);
  auto slot = pool->Acquire(1 << 20);
  ASSERT_TRUE(slot.ok());
  std::memcpy(slot->data, "keep me", 8);
  ASSERT_TRUE(pool->Release(slot->index).ok());
  ThreadPool threads(3);  // pre-faulting 150 MiB in parallel chunks
  slot = pool->Acquire(150 << 20, &threads);
  ASSERT_TRUE(slot.ok());
  EXPECT_GE(slot->capacity, 150u << 20);
  slot->data[slot->capacity - 1] = 'z';  // the far end is mapped
  EXPECT_STREQ(slot->data, "keep me");
  EXPECT_EQ(fs::file_size(slot->path), slot->capacity);
}

TEST_F(StagingPoolTest, StagedBytesSurviveACrashOfTheProcess) {
  std::vector<char> data = Pattern(3 << 20, 11);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    StagingPoolOptions o;
    o.root_dir = dir_;
    o.num_slots = 2;
    auto pool = StagingPool::Open(o);
    if (!pool.ok()) ::_exit(2);
    auto slot = (*pool)->AcquireSlot(1, data.size());
    if (!slot.ok()) ::_exit(3);
    std::memcpy(slot->data, data.data(), data.size());
    ::kill(::getpid(), SIGKILL);  // no Close, no destructors
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status)) << "child exited with " << WEXITSTATUS(status);
  auto pool = OpenPool(0, 2);
  auto slot = pool->AcquireSlot(1, 0);  // map what is there
  ASSERT_TRUE(slot.ok()) << slot.status().ToString();
  ASSERT_GE(slot->capacity, data.size());
  EXPECT_EQ(std::memcmp(slot->data, data.data(), data.size()), 0);
  ASSERT_TRUE(pool->Close().ok());
  EXPECT_FALSE(fs::exists(dir_));  // nothing left in shared memory
}

TEST_F(StagingPoolTest, ASecondOwnerOfTheSameRankIsRefused) {
  auto p1 = OpenPool(0, 1);
  auto p2 = OpenPool(0, 1);
  ASSERT_TRUE(p1->Acquire(1).ok());
  EXPECT_EQ(p2->Acquire(1).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(p1->Close().ok());
  EXPECT_TRUE(p2->Acquire(1).ok());
}

TEST_F(StagingPoolTest, CloseOfEveryRankLeavesNothingBehind) {
  auto r0 = OpenPool(0, 2);
  auto r1 = OpenPool(1, 2);
  ASSERT_TRUE(r0->Acquire(1 << 20).ok());
  ASSERT_TRUE(r0->Acquire(1 << 20).ok());
  ASSERT_TRUE(r1->Acquire(1 << 20).ok());
  ASSERT_TRUE(r0->Close().ok());
  EXPECT_TRUE(fs::exists(dir_ + "/slot0/data/r1.bin"));
  EXPECT_FALSE(fs::exists(dir_ + "/slot0/data/r0.bin"));
  EXPECT_EQ(r0->Acquire(1).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(r0->Close().ok());  // idempotent
  ASSERT_TRUE(r1->Close().ok());
  EXPECT_FALSE(fs::exists(dir_));
}

TEST_F(StagingPoolTest, RemoveFilesKeepsTheMappingValid) {
  auto pool = OpenPool();
  auto slot = pool->Acquire(1 << 20);
  ASSERT_TRUE(slot.ok());
  std::memcpy(slot->data, "still here", 11);
  ASSERT_TRUE(pool->RemoveFiles().ok());
  EXPECT_FALSE(fs::exists(slot->path));
  EXPECT_FALSE(fs::exists(dir_));
  EXPECT_STREQ(slot->data, "still here");
  EXPECT_TRUE(pool->Close().ok());
}

TEST_F(StagingPoolTest, RemoveFilesSparesAFileALiveProcessHolds) {
  auto holder = OpenPool(0, 1);
  auto slot = holder->Acquire(1 << 20);
  ASSERT_TRUE(slot.ok());
  auto other = OpenPool(0, 1);  // same rank, never acquired anything
  ASSERT_TRUE(other->Close().ok());
  EXPECT_TRUE(fs::exists(slot->path));
  ASSERT_TRUE(holder->Close().ok());
  EXPECT_FALSE(fs::exists(dir_));
}

TEST_F(StagingPoolTest, CloseAfterRemoveFilesSparesANewerFileAtTheSamePath) {
  auto old_pool = OpenPool(0, 1);
  auto slot = old_pool->Acquire(1 << 20);
  ASSERT_TRUE(slot.ok());
  ASSERT_TRUE(old_pool->RemoveFiles().ok());  // mapping kept (live buffers)
  auto new_pool = OpenPool(0, 1);
  ASSERT_TRUE(new_pool->Acquire(1 << 20).ok());
  ASSERT_TRUE(old_pool->Close().ok());
  EXPECT_TRUE(fs::exists(slot->path));  // the new pool's file
  ASSERT_TRUE(new_pool->Close().ok());
  EXPECT_FALSE(fs::exists(dir_));
}

TEST_F(StagingPoolTest, CloseRemovesLeftoversOfALargerEarlierPool) {
  auto big = OpenPool(0, 4);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(big->Acquire(4096).ok());
  big.reset();
  // Files as a crashed 4-slot run of rank 0 would have left them.
  for (int i = 0; i < 4; ++i) {
    std::string d = dir_ + "/slot" + std::to_string(i) + "/data";
    fs::create_directories(d);
    std::ofstream(d + "/r0.bin") << "left";
  }
  ASSERT_TRUE(fs::exists(dir_ + "/slot3/data/r0.bin"));
  auto small = OpenPool(0, 2);
  ASSERT_TRUE(small->Close().ok());
  EXPECT_FALSE(fs::exists(dir_));
}

TEST_F(StagingPoolTest, KeepFilesOnCloseWhenAsked) {
  StagingPoolOptions o;
  o.root_dir = dir_;
  o.num_slots = 1;
  o.remove_on_close = false;
  auto pool = StagingPool::Open(o);
  ASSERT_TRUE(pool.ok());
  auto slot = (*pool)->Acquire(100);
  ASSERT_TRUE(slot.ok());
  std::string path = slot->path;
  ASSERT_TRUE((*pool)->Close().ok());
  EXPECT_TRUE(fs::exists(path));
}

TEST_F(StagingPoolTest, BadOptionsAreRejected) {
  StagingPoolOptions o;
  o.root_dir = "relative/dir";
  EXPECT_EQ(StagingPool::Open(o).status().code(), StatusCode::kInvalidArgument);
  o.root_dir = dir_;
  o.num_slots = 0;
  EXPECT_EQ(StagingPool::Open(o).status().code(), StatusCode::kInvalidArgument);
  o.num_slots = 1;
  o.file_key = "../escape";
  EXPECT_EQ(StagingPool::Open(o).status().code(), StatusCode::kInvalidArgument);
}

TEST(ParallelCopyTest, MatchesASerialCopyWithAndWithoutAPool) {
  std::vector<char> src = Pattern((5 << 20) + 333, 3);
  ThreadPool threads(4);
  for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &threads}) {
    std::vector<char> dst(src.size() + 100, 0);
    std::vector<CopySpan> spans = {{src.data(), 7, 1000},
                                   {src.data() + 1000, 1007, src.size() - 1000}};
    ASSERT_TRUE(ParallelCopy(dst.data(), dst.size(), spans, p, 64 << 10).ok());
    EXPECT_EQ(std::memcmp(dst.data() + 7, src.data(), src.size()), 0);
    EXPECT_EQ(dst[6], 0);
  }
  EXPECT_EQ(ParallelCopy(nullptr, 0, {}, nullptr, 0).code(), StatusCode::kInvalidArgument);
}

TEST(ParallelCopyTest, LargePiecesAreExactAtAnyAlignment) {
  // Pieces past the streaming threshold take the non-temporal path: every
  // misalignment of source and destination, and lengths that are no multiple
  // of 16 or 64, must copy exactly and leave the neighbouring bytes alone.
  std::vector<char> src = Pattern((3 << 20) + 4096, 5);
  ThreadPool threads(3);
  for (uint64_t src_skew : {0, 1, 15, 33}) {
    for (uint64_t dst_off : {0, 1, 7, 16, 63, 4096}) {
      for (uint64_t n : {uint64_t{256} << 10, (uint64_t{1} << 20) + 17, uint64_t{3} << 20}) {
        std::vector<char> dst(n + dst_off + 64, 0x5a);
        CopySpan span{src.data() + src_skew, dst_off, n};
        ASSERT_TRUE(ParallelCopy(dst.data(), dst.size(), {&span, 1}, &threads, 1 << 20).ok());
        ASSERT_EQ(std::memcmp(dst.data() + dst_off, src.data() + src_skew, n), 0)
            << src_skew << " " << dst_off << " " << n;
        for (uint64_t i = 0; i < dst_off; ++i) ASSERT_EQ(dst[i], 0x5a);
        for (uint64_t i = dst_off + n; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0x5a);
      }
    }
  }
}

TEST(ParallelCopyTest, FinishesOnTheCallerWhenThePoolIsBusy) {
  ThreadPool threads(1);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  threads.Submit([&] {  // occupies the only worker until the copy is done
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return release; });
  });
  std::vector<char> src = Pattern(8 << 20, 9), dst(src.size());
  CopySpan span{src.data(), 0, src.size()};
  ASSERT_TRUE(ParallelCopy(dst.data(), dst.size(), {&span, 1}, &threads, 1 << 20).ok());
  EXPECT_EQ(src, dst);
  {
    std::lock_guard<std::mutex> l(mu);
    release = true;
  }
  cv.notify_all();
}

TEST(ChecksumTest, IsXxh3WithSeedZero) {
  // Reference values of XXH3_64bits (seed 0).
  EXPECT_EQ(Checksum(nullptr, 0), 0x2D06800538D394C2ull);
  EXPECT_NE(Checksum("a", 1), Checksum("b", 1));
}

TEST(ChecksumTest, BlockChecksumsCoverEachBlock) {
  std::vector<char> data = Pattern((3 << 20) + 17, 5);
  ThreadPool threads(3);
  auto serial = BlockChecksums(data.data(), data.size(), 1 << 20, nullptr);
  auto parallel = BlockChecksums(data.data(), data.size(), 1 << 20, &threads);
  ASSERT_TRUE(serial.ok() && parallel.ok());
  ASSERT_EQ(serial->size(), 4u);
  EXPECT_EQ(*serial, *parallel);
  for (size_t i = 0; i < 4; ++i) {
    size_t off = i << 20, n = std::min<size_t>(1 << 20, data.size() - off);
    EXPECT_EQ((*serial)[i], Checksum(data.data() + off, n));
  }
  EXPECT_TRUE(BlockChecksums(nullptr, 0, 1 << 20, nullptr)->empty());
  EXPECT_EQ(BlockChecksums(data.data(), 1, 0, nullptr).status().code(),
            StatusCode::kInvalidArgument);
}

// ---- The staging engine: one save into one slot ------------------------------

TEST(DataFileLayoutTest, ItemsArePageAlignedInOrderAndEmptyOnesTakeNoSpace) {
  std::vector<uint64_t> lengths = {10, 0, 4096, 1, 5000};
  format::DataFileLayout l = format::LayOutDataFile(lengths);
  EXPECT_EQ(l.offsets, (std::vector<uint64_t>{0, 0, 4096, 8192, 12288}));
  EXPECT_EQ(l.end, 12288u + 5000u);
  EXPECT_EQ(format::LayOutDataFile(std::vector<uint64_t>{}).end, 0u);
  EXPECT_EQ(format::LayOutDataFile(std::vector<uint64_t>{0, 7}).offsets[1], 0u);
}

// A save of `srcs` into slot 0 through the whole engine.
Result<StagedSave> StageAll(StagingPool* pool, const std::vector<std::vector<char>>& srcs,
                            ThreadPool* threads) {
  std::vector<uint64_t> lengths;
  std::vector<StageSource> sources;
  for (const auto& v : srcs) lengths.push_back(v.size());
  CAIRN_ASSIGN_OR_RETURN(StagedSave save, pool->BeginSave(0, lengths, threads));
  for (size_t i = 0; i < srcs.size(); ++i) sources.push_back({i, srcs[i].data()});
  CAIRN_RETURN_IF_ERROR(pool->CopyItems(save, sources, threads, 1 << 20));
  CAIRN_RETURN_IF_ERROR(pool->ZeroPadding(save, threads));
  return save;
}

TEST_F(StagingPoolTest, AStagedSlotHoldsTheItemsAtTheirOffsetsAndZerosElsewhere) {
  auto pool = OpenPool(0, 1);
  ThreadPool threads(2);
  // An older, bigger save leaves bytes everywhere.
  ASSERT_TRUE(StageAll(pool.get(), {Pattern(3 << 20, 9)}, &threads).ok());
  ASSERT_TRUE(pool->Release(0).ok());
  std::vector<std::vector<char>> srcs = {Pattern(100, 1), {}, Pattern(70000, 2), Pattern(1, 3)};
  auto save = StageAll(pool.get(), srcs, &threads);
  ASSERT_TRUE(save.ok()) << save.status().ToString();
  EXPECT_EQ(save->offsets, (std::vector<uint64_t>{0, 0, 4096, 77824}));
  EXPECT_EQ(save->end, 77825u);
  EXPECT_EQ(save->bytes, 81920u);
  EXPECT_GE(save->capacity, 3u << 20);  // kept its size: the tail must be zero too
  std::vector<char> expect(save->capacity, 0);
  for (size_t i = 0; i < srcs.size(); ++i) {
    std::copy(srcs[i].begin(), srcs[i].end(), expect.begin() + save->offsets[i]);
  }
  EXPECT_EQ(std::memcmp(save->data, expect.data(), expect.size()), 0);
}

// The bytes a slot must hold after a save of `srcs` at `save`'s offsets.
std::vector<char> Expected(const StagedSave& save, const std::vector<std::vector<char>>& srcs) {
  std::vector<char> expect(save.capacity, 0);
  for (size_t i = 0; i < srcs.size(); ++i) {
    std::copy(srcs[i].begin(), srcs[i].end(), expect.begin() + save.offsets[i]);
  }
  return expect;
}

TEST_F(StagingPoolTest, PaddingIsZeroAfterEverySaveWhenItsZeroingIsSkipped) {
  // ZeroPadding skips a padding the previous save of the same layout zeroed. A save
  // of another layout in between, whose items cover that padding and which fails
  // before zeroing, must make the next save zero it again; so must CopyIn.
  auto pool = OpenPool(0, 1);
  ThreadPool threads(2);
  std::vector<std::vector<char>> a = {Pattern(100, 1), Pattern(5000, 2)};
  auto first = StageAll(pool.get(), a, &threads);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(pool->Release(0).ok());
  auto again = StageAll(pool.get(), a, &threads);  // same layout: zeroing skipped
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(std::memcmp(again->data, Expected(*again, a).data(), again->capacity), 0);
  ASSERT_TRUE(pool->Release(0).ok());

  // Another layout: one item over the whole of a's padding; it fails before ZeroPadding.
  std::vector<char> big = Pattern(12000, 3);
  auto other = pool->BeginSave(0, std::vector<uint64_t>{big.size()}, &threads);
  ASSERT_TRUE(other.ok());
  std::vector<StageSource> src = {{0, big.data()}};
  ASSERT_TRUE(pool->CopyItems(*other, src, &threads).ok());
  ASSERT_TRUE(pool->Release(0).ok());
  auto after = StageAll(pool.get(), a, &threads);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(std::memcmp(after->data, Expected(*after, a).data(), after->capacity), 0);

  // CopyIn may write into the padding: the next save zeroes it again.
  std::vector<char> junk = Pattern(64, 4);
  std::vector<CopySpan> spans = {{junk.data(), 200, junk.size()}};
  ASSERT_TRUE(pool->CopyIn(0, spans, &threads).ok());
  ASSERT_TRUE(pool->Release(0).ok());
  auto last = StageAll(pool.get(), a, &threads);
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(std::memcmp(last->data, Expected(*last, a).data(), last->capacity), 0);
}

TEST_F(StagingPoolTest, ItemChecksumsAreEachItemsBlockChecksums) {
  auto pool = OpenPool(0, 1);
  ThreadPool threads(3);
  std::vector<std::vector<char>> srcs = {Pattern(3 << 20, 1), Pattern(5, 2), {}, Pattern(9999, 3)};
  auto save = StageAll(pool.get(), srcs, &threads);
  ASSERT_TRUE(save.ok());
  auto locs = pool->ItemChecksums(*save, 1 << 20, &threads);
  ASSERT_TRUE(locs.ok()) << locs.status().ToString();
  ASSERT_EQ(locs->size(), srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    auto want = BlockChecksums(srcs[i].data(), srcs[i].size(), 1 << 20, nullptr);
    EXPECT_EQ((*locs)[i].checksums, *want) << "item " << i;
    EXPECT_EQ((*locs)[i].offset, save->offsets[i]);
    EXPECT_EQ((*locs)[i].length, srcs[i].size());
  }
  EXPECT_EQ(pool->ItemChecksums(*save, 0, nullptr).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(StagingPoolTest, AWrittenSlotIsTheDataFileWriteDataFileMakesOfTheItems) {
  auto pool = OpenPool(0, 1);
  ThreadPool threads(2);
  std::vector<std::vector<char>> srcs = {Pattern(12345, 1), {}, Pattern(2 << 20, 2), Pattern(3, 3)};
  auto save = StageAll(pool.get(), srcs, &threads);
  ASSERT_TRUE(save.ok());
  char tmpl[] = "/tmp/cairn_staging_test_XXXXXX";
  std::string dir = mkdtemp(tmpl);
  auto storage = OpenStorage(dir);
  ASSERT_TRUE(storage.ok());
  DataFileOptions opts;
  opts.sync = false;
  auto size = pool->WriteDataFile(*save, storage->get(), "slot.bin", opts, &threads);
  ASSERT_TRUE(size.ok()) << size.status().ToString();
  EXPECT_EQ(*size, save->bytes);
  std::vector<BufferRef> refs;
  for (const auto& v : srcs) refs.push_back({v.data(), v.size()});
  auto direct = WriteDataFile(storage->get(), "items.bin", refs, &threads, opts);
  ASSERT_TRUE(direct.ok());
  auto locs = pool->ItemChecksums(*save, opts.block_size, &threads);
  ASSERT_TRUE(locs.ok());
  for (size_t i = 0; i < srcs.size(); ++i) {
    EXPECT_EQ(direct->items[i].offset, (*locs)[i].offset) << "item " << i;
    EXPECT_EQ(direct->items[i].checksums, (*locs)[i].checksums) << "item " << i;
  }
  auto read = [&](const std::string& name) {
    std::ifstream in(dir + "/" + name, std::ios::binary);
    return std::vector<char>(std::istreambuf_iterator<char>(in), {});
  };
  std::vector<char> slot_file = read("slot.bin"), items_file = read("items.bin");
  ASSERT_EQ(slot_file.size(), save->bytes);
  ASSERT_EQ(items_file.size(), direct->file_size);
  // The same bytes; the slot's file only adds zeros up to a whole page.
  EXPECT_TRUE(std::equal(items_file.begin(), items_file.end(), slot_file.begin()));
  EXPECT_TRUE(std::all_of(slot_file.begin() + items_file.size(), slot_file.end(),
                          [](char c) { return c == 0; }));
  fs::remove_all(dir);
}

TEST_F(StagingPoolTest, CopyItemsRejectsBadSourcesAndCopiesNothing) {
  auto pool = OpenPool(0, 1);
  std::vector<uint64_t> lengths = {100, 100};
  auto save = pool->BeginSave(0, lengths);
  ASSERT_TRUE(save.ok());
  std::memset(save->data, 0, save->capacity);
  std::vector<char> src(100, 'x');
  std::vector<StageSource> bad = {{0, src.data()}, {2, src.data()}};
  EXPECT_EQ(pool->CopyItems(*save, bad, nullptr).code(), StatusCode::kInvalidArgument);
  bad = {{0, src.data()}, {1, nullptr}};
  EXPECT_EQ(pool->CopyItems(*save, bad, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(save->data[0], 0);
  ASSERT_TRUE(pool->Release(0).ok());
  std::vector<StageSource> good = {{0, src.data()}};
  EXPECT_EQ(pool->CopyItems(*save, good, nullptr).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->ZeroPadding(*save, nullptr).code(), StatusCode::kFailedPrecondition);
}

TEST_F(StagingPoolTest, AnEmptySaveStillUsesOnePage) {
  auto pool = OpenPool(0, 1);
  auto save = pool->BeginSave(0, std::vector<uint64_t>{0, 0});
  ASSERT_TRUE(save.ok());
  EXPECT_EQ(save->end, 0u);
  EXPECT_EQ(save->bytes, format::kItemAlignment);
  EXPECT_TRUE(pool->ZeroPadding(*save, nullptr).ok());
}

TEST(ThreadPoolSizingTest, IoPoolsAreWiderThanCopyPools) {
  size_t io = DefaultThreadCount(PoolKind::kIo), copy = DefaultThreadCount(PoolKind::kCopy);
  EXPECT_GE(io, 16u);
  EXPECT_LE(io, 32u);
  EXPECT_GE(copy, 2u);
  EXPECT_LE(copy, 8u);
}

// ---- OpenMapped: a restore reading the slot this process staged ------------

// Stages `srcs` into slot 0 of `pool` and commits it as a checkpoint of
// uint8 tensors "t<i>" in `storage` ("slot0", the memory tier's layout).
void CommitStaged(StagingPool* pool, Storage* storage, const std::vector<std::vector<char>>& srcs,
                  ThreadPool* threads) {
  auto save = StageAll(pool, srcs, threads);
  ASSERT_TRUE(save.ok()) << save.status().ToString();
  auto locs = pool->ItemChecksums(*save, 1 << 20, threads);
  ASSERT_TRUE(locs.ok()) << locs.status().ToString();
  Manifest m;
  m.world_size = 1;
  m.block_size = 1 << 20;
  m.files.push_back({pool->options().file_key, save->capacity});
  for (size_t i = 0; i < srcs.size(); ++i) {
    ManifestTensor t{"t" + std::to_string(i),
                     "uint8",
                     {srcs[i].size()},
                     false,
                     "strided",
                     "contiguous_format",
                     false,
                     {}};
    t.chunks.push_back({{0}, {srcs[i].size()}, (*locs)[i]});
    m.tensors.push_back(t);
  }
  ASSERT_TRUE(CommitManifest(storage, StagingPool::SlotDirName(0), m).ok());
  ASSERT_TRUE(pool->Release(0).ok());
}

TEST_F(StagingPoolTest, OpenMappedServesTheSlotAndKeepsSavesOutWhileOpen) {
  auto pool = OpenPool(0, 1);
  ThreadPool threads(2);
  auto storage = OpenStorage(dir_);
  ASSERT_TRUE(storage.ok());
  std::vector<std::vector<char>> srcs = {Pattern((3 << 20) + 5, 1), Pattern(70000, 2)};
  CommitStaged(pool.get(), storage->get(), srcs, &threads);
  const std::string path = dir_ + "/slot0/" + pool->options().file_key;
  auto file = pool->OpenMapped(0, path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ((*file)->MappedData(), pool->Peek(0)->data);
  EXPECT_EQ((*file)->Size(), fs::file_size(path));
  std::vector<char> got(100);
  ASSERT_TRUE((*file)->ReadAt(1000, got.data(), got.size()).ok());
  EXPECT_TRUE(std::equal(got.begin(), got.end(), srcs[0].begin() + 1000));
  EXPECT_EQ((*file)->ReadAt((*file)->Size() - 10, got.data(), 11).code(), StatusCode::kOutOfRange);
  // No save may grow or overwrite the slot while a restore reads it.
  EXPECT_EQ(pool->AcquireSlot(0, 0).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->Acquire(1).status().code(), StatusCode::kResourceExhausted);
  // A checkpoint reader served from the mapping reads and verifies the items.
  auto reader = CheckpointReader::Open(storage->get(), "slot0");
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  ASSERT_TRUE((*reader)->UseFile(pool->options().file_key, std::move(file).value()).ok());
  std::vector<std::vector<char>> out = {std::vector<char>(srcs[0].size()),
                                        std::vector<char>(srcs[1].size())};
  std::vector<ReadRequest> reqs;
  for (uint32_t i = 0; i < 2; ++i) {
    reqs.push_back({{ItemRef::Kind::kTensorChunk, i, 0}, out[i].data(), out[i].size()});
  }
  ASSERT_TRUE((*reader)->Read(reqs, &threads).ok());
  EXPECT_EQ(out, srcs);
  // Still verified: a byte changed in the slot is a checksum mismatch.
  auto slot = pool->Peek(0);
  ASSERT_TRUE(slot.ok());
  slot->data[(2 << 20) + 7] ^= 1;
  Status s = (*reader)->Read(reqs, &threads);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("checksum mismatch in block 2 of tensor 't0'"), std::string::npos)
      << s.ToString();
  slot->data[(2 << 20) + 7] ^= 1;
  // Closing the reader's files gives the slot back to the saves.
  (*reader)->CloseFiles();
  auto again = pool->AcquireSlot(0, 0);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->capacity, fs::file_size(path));
}

TEST_F(StagingPoolTest, OpenMappedRefusesWhatItCannotServe) {
  auto pool = OpenPool(0, 2);
  const std::string path0 = dir_ + "/slot0/" + pool->options().file_key;
  // Not mapped in this process (a fresh process reads the files).
  EXPECT_EQ(pool->OpenMapped(0, path0).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->OpenMapped(2, path0).status().code(), StatusCode::kInvalidArgument);
  auto slot = pool->AcquireSlot(0, 1 << 20);
  ASSERT_TRUE(slot.ok());
  // In use: a save is staging into it.
  EXPECT_EQ(pool->OpenMapped(0, path0).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(pool->Release(0).ok());
  ASSERT_TRUE(pool->OpenMapped(0, path0).ok());
  // A path that names another file, or nothing.
  std::ofstream(dir_ + "/other.bin") << "x";
  EXPECT_EQ(pool->OpenMapped(0, dir_ + "/other.bin").status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->OpenMapped(0, dir_ + "/missing.bin").status().code(),
            StatusCode::kFailedPrecondition);
  // The slot's name given to a new file since (its old inode still mapped).
  fs::remove(path0);
  std::ofstream(path0) << "new";
  EXPECT_EQ(pool->OpenMapped(0, path0).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(pool->Close().ok());
  EXPECT_EQ(pool->OpenMapped(0, path0).status().code(), StatusCode::kFailedPrecondition);
}

TEST_F(StagingPoolTest, AMappedFileOutlivesThePool) {
  auto pool = OpenPool(0, 1);
  std::vector<char> bytes = Pattern(1 << 20, 4);
  auto slot = pool->AcquireSlot(0, bytes.size());
  ASSERT_TRUE(slot.ok());
  std::memcpy(slot->data, bytes.data(), bytes.size());
  ASSERT_TRUE(pool->Release(0).ok());
  auto file = pool->OpenMapped(0, slot->path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  ASSERT_TRUE(pool->Close().ok());  // deletes the file; the mapping stays with `file`
  pool.reset();
  EXPECT_FALSE(fs::exists(slot->path));
  std::vector<char> got(bytes.size());
  ASSERT_TRUE((*file)->ReadAt(0, got.data(), got.size()).ok());
  EXPECT_EQ(got, bytes);
}

}  // namespace
}  // namespace cairn
