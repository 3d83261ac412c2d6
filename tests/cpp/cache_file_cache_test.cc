// FileCache and the throttled source, in one process (the cross-process
// behaviour is covered by tests/python/test_data_cache.py).
#include "cairn/cache.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "scratch_dir.h"

namespace cairn {
namespace {

namespace fs = std::filesystem;

class FileCacheTest : public ::testing::Test {
 protected:
  void SetUp() override { fs::create_directories(src_ + "/sub"); }

  void MakeFiles(int n, size_t size) {
    std::mt19937 rng(42);
    for (int i = 0; i < n; ++i) {
      std::string data(size, '\0');
      for (auto& c : data) c = static_cast<char>(rng());
      std::ofstream(src_ + "/sub/f" + std::to_string(i), std::ios::binary) << data;
    }
  }

  std::unique_ptr<FileCache> Open(uint64_t limit, double timeout = 5, size_t prefetch = 32,
                                  ThreadPool* pool = nullptr) {
    auto src = OpenSourceStorage(src_);
    EXPECT_TRUE(src.ok()) << src.status().ToString();
    auto files = ListFiles(src->get());
    EXPECT_TRUE(files.ok());
    FileCacheOptions o;
    o.cache_dir = cache_;
    o.limit_bytes = limit;
    o.wait_timeout_s = timeout;
    o.prefetch_files = prefetch;
    auto c = FileCache::Open(std::move(*src), *files, pool ? pool : &pool_, o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return std::move(*c);
  }

  // Fetches file 0 into a cache that is closed again; returns the cache root
  // (what a later Open of the same cache_dir finds).
  std::string CacheFileZeroAndClose() {
    auto c = Open(1 << 20);
    EXPECT_TRUE(c->AcquireFile(0).ok());
    return c->root();
  }

  static std::string Read(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

  test_util::ScratchDir scratch_{"cache_test"};
  const std::string dir_ = scratch_.path(), src_ = dir_ + "/src", cache_ = dir_ + "/cache";
  ThreadPool pool_{4};
};

TEST_F(FileCacheTest, ListsRecursivelySorted) {
  MakeFiles(3, 10);
  auto src = OpenSourceStorage(src_);
  ASSERT_TRUE(src.ok());
  auto files = ListFiles(src->get());
  ASSERT_TRUE(files.ok());
  ASSERT_EQ(files->size(), 3u);
  EXPECT_EQ((*files)[0].key, "sub/f0");
  EXPECT_EQ((*files)[2].size, 10u);
}

TEST_F(FileCacheTest, FetchesOnceAndServesAnIdenticalLocalCopy) {
  MakeFiles(4, 1000);
  auto c = Open(1 << 20);
  for (int round = 0; round < 2; ++round) {
    for (int64_t id = 0; id < 4; ++id) {
      auto p = c->AcquireFile(id);
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      EXPECT_EQ(Read(*p), Read(src_ + "/sub/f" + std::to_string(id)));
      c->Release(id);
    }
  }
  FileCacheStats s = c->Stats();
  EXPECT_EQ(s.fetched_files, 4u);
  EXPECT_EQ(s.shared_fetched_bytes, 4000u);
  EXPECT_EQ(s.used_bytes, 4000u);
}

TEST_F(FileCacheTest, EvictsTheFileNeededFurthestInTheFuture) {
  MakeFiles(4, 1000);
  auto c = Open(3000, 5, /*prefetch=*/0);  // no prefetch: decisions at known cursors
  // This epoch reads 0,1,2,3; the next one 2,0,1,3. When 3 needs room, file
  // 1 is needed last (position 2 of the next epoch) and must go.
  ASSERT_TRUE(c->SetPlan({0, 1, 2, 3}, {2, 0, 1, 3}, {0, 1, 2, 3}).ok());
  for (size_t i = 0; i < 4; ++i) {
    auto p = c->Acquire(i);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    c->Release(c->PlanFile(i));
  }
  std::string files = c->root() + "/files/sub/";
  EXPECT_TRUE(fs::exists(files + "f0"));
  EXPECT_FALSE(fs::exists(files + "f1"));
  EXPECT_TRUE(fs::exists(files + "f2"));
  EXPECT_TRUE(fs::exists(files + "f3"));
  EXPECT_LE(c->Stats().used_bytes, 3000u);
}

TEST_F(FileCacheTest, PinnedFilesAreNeverEvicted) {
  MakeFiles(3, 1000);
  auto c = Open(2000, /*timeout=*/0.2);
  ASSERT_TRUE(c->AcquireFile(0).ok());
  ASSERT_TRUE(c->AcquireFile(1).ok());
  auto p = c->AcquireFile(2);  // no room: both cached files are in use
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(p.status().message().find("in use"), std::string::npos);
  c->Release(0);
  ASSERT_TRUE(c->AcquireFile(2).ok());
  EXPECT_FALSE(fs::exists(c->root() + "/files/sub/f0"));
  EXPECT_TRUE(fs::exists(c->root() + "/files/sub/f1"));
}

TEST_F(FileCacheTest, FileLargerThanTheLimitIsResourceExhausted) {
  MakeFiles(1, 5000);
  auto c = Open(4000);
  auto p = c->AcquireFile(0);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(p.status().message().find("larger than the cache limit"), std::string::npos);
}

TEST_F(FileCacheTest, DamagedCachedFileIsFetchedAgain) {
  MakeFiles(1, 1000);
  auto c = Open(1 << 20);
  auto p = c->AcquireFile(0);
  ASSERT_TRUE(p.ok());
  c->Release(0);
  ASSERT_EQ(::truncate(p->c_str(), 10), 0);
  auto q = c->AcquireFile(0);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(Read(*q), Read(src_ + "/sub/f0"));
  EXPECT_EQ(c->Stats().fetched_files, 2u);
}

TEST_F(FileCacheTest, ReopenKeepsCompleteFilesAndDropsTempFiles) {
  MakeFiles(2, 1000);
  const std::string root = CacheFileZeroAndClose();
  std::ofstream(root + "/files/sub/f1.cairn-tmp-1-1") << "partial";
  auto c = Open(1 << 20);
  EXPECT_FALSE(fs::exists(root + "/files/sub/f1.cairn-tmp-1-1"));
  ASSERT_TRUE(c->AcquireFile(0).ok());
  EXPECT_EQ(c->Stats().fetched_files, 0u);  // served from the earlier run
  EXPECT_EQ(c->Stats().used_bytes, 1000u);
}

TEST_F(FileCacheTest, DamagedTableIsRepairedAtOpen) {
  MakeFiles(2, 1000);
  const std::string root = CacheFileZeroAndClose();
  {
    // Scribble over both slots (header is 128 bytes, slots 24).
    std::fstream f(root + "/table", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(128);
    std::string junk(48, '\x7f');
    f.write(junk.data(), junk.size());
  }
  auto c = Open(1 << 20);
  EXPECT_EQ(c->Stats().used_bytes, 0u);
  auto p = c->AcquireFile(0);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(Read(*p), Read(src_ + "/sub/f0"));
  EXPECT_EQ(c->Stats().used_bytes, 1000u);
}

TEST_F(FileCacheTest, PrefetchRunsAheadOfTheConsumer) {
  MakeFiles(8, 1000);
  auto c = Open(1 << 20);
  std::vector<int64_t> order = {0, 1, 2, 3, 4, 5, 6, 7};
  ASSERT_TRUE(c->SetPlan(order, order, order).ok());
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (c->Stats().shared_fetched_files < 8 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(c->Stats().shared_fetched_files, 8u);  // without a single Acquire
  for (size_t i = 0; i < 8; ++i) ASSERT_TRUE(c->Acquire(i).ok());
  EXPECT_EQ(c->Stats().hits, 8u);
}

TEST_F(FileCacheTest, PrefetchNeverEvictsAFileNeededSooner) {
  MakeFiles(3, 1000);
  ThreadPool one(1);  // prefetches in plan order, one at a time
  auto c = Open(2000, 5, 32, &one);
  std::vector<int64_t> order = {0, 1, 2};
  ASSERT_TRUE(c->SetPlan(order, order, order).ok());
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (c->Stats().shared_fetched_files < 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // Files 0 and 1 fill the cache; 2 is needed after both, so it waits.
  EXPECT_EQ(c->Stats().shared_fetched_files, 2u);
  EXPECT_EQ(c->Stats().shared_evictions, 0u);
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(c->Acquire(i).ok());
    c->Release(c->PlanFile(i));
  }
  EXPECT_EQ(c->Stats().shared_fetched_files, 3u);
}

TEST_F(FileCacheTest, BadPlansAreRejected) {
  MakeFiles(2, 10);
  auto c = Open(1 << 20);
  EXPECT_EQ(c->SetPlan({0, 5}, {}, {0}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->SetPlan({0, 1}, {}, {2}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->Acquire(0).status().code(), StatusCode::kOutOfRange);
}

TEST(ThrottledStorageTest, ParsesOptionsAndRejectsUnknownOnes) {
  EXPECT_EQ(OpenSourceStorage("slow:///tmp?speed=1").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenSourceStorage("slow:///tmp?latency=abc").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenSourceStorage("slow://?latency=1").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenSourceStorage("/definitely/not/here").status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(OpenSourceStorage("slow:///tmp?latency=0.001").ok());
}

TEST(ThrottledStorageTest, LatencyAppliesToEveryOpen) {
  auto base = NewMemStorage();
  {
    auto w = base->NewWritableFile("a");
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->WriteAt(0, "xyz", 3).ok());
    ASSERT_TRUE((*w)->Close().ok());
  }
  auto s = NewThrottledStorage(std::move(base), 0.05, 0, "");
  ASSERT_TRUE(s.ok());
  auto t0 = std::chrono::steady_clock::now();
  auto f = (*s)->NewReadableFile("a");
  ASSERT_TRUE(f.ok());
  // A lower bound only (sleep_for never returns early): not a timing test.
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(50));
  char buf[3];
  ASSERT_TRUE((*f)->ReadAt(0, buf, 3).ok());
  EXPECT_EQ(std::string(buf, 3), "xyz");
}

}  // namespace
}  // namespace cairn
