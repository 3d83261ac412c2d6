// Tests of coalesced checkpoint reads (ReadableFile::ReadV on storages that
// prefer few large requests, as s3 does) and of CopyFile.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <random>

#include "cairn/checkpoint.h"

namespace cairn {
namespace {

// A mem storage whose readable files ask for reads of `preferred` bytes and
// count the ReadV calls they serve (with the default, per-segment ReadV).
class LargeReadStorage final : public StorageWrapper {
 public:
  explicit LargeReadStorage(uint64_t preferred)
      : StorageWrapper(NewMemStorage()), preferred_(preferred) {}

  class File final : public ReadableFile {
   public:
    File(std::unique_ptr<ReadableFile> base, const LargeReadStorage* owner)
        : base_(std::move(base)), owner_(owner) {}
    Status ReadAt(uint64_t off, void* buf, size_t n) const override {
      owner_->reads_at++;
      return base_->ReadAt(off, buf, n);
    }
    Status ReadV(uint64_t off, const std::vector<Segment>& segs) const override {
      owner_->reads_v++;
      return ReadableFile::ReadV(off, segs);
    }
    uint64_t Size() const override { return base_->Size(); }
    uint64_t PreferredReadSize() const override { return owner_->preferred_; }

   private:
    std::unique_ptr<ReadableFile> base_;
    const LargeReadStorage* owner_;
  };

  Result<std::unique_ptr<ReadableFile>> NewReadableFile(std::string_view key,
                                                        const ReadOptions& o) override {
    CAIRN_ASSIGN_OR_RETURN(auto f, target()->NewReadableFile(key, o));
    return std::unique_ptr<ReadableFile>(new File(std::move(f), this));
  }
  std::string Describe() const override { return "large-reads://"; }

  Storage* base() { return target(); }
  mutable std::atomic<int> reads_v{0}, reads_at{0};

 private:
  uint64_t preferred_;
};

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// 40 small tensors (and one of several blocks) saved, then loaded through a
// storage preferring 256 KiB reads.
struct SmallTensors {
  std::vector<std::vector<float>> data;
  std::vector<NamedBuffer> buffers;
  explicit SmallTensors(size_t count) {
    for (size_t i = 0; i < count; ++i) data.push_back(Random(1000 + 17 * i, i));
    data.push_back(Random(3 * 4096 + 5, 99));  // 4 blocks of 4 KiB * 4
    for (size_t i = 0; i < data.size(); ++i) {
      buffers.push_back({"t" + std::to_string(i), "float32", {data[i].size()}, data[i].data()});
    }
  }
};

TEST(CoalescedReadTest, NeighbouringItemsAreReadWithFewRequestsAndVerified) {
  LargeReadStorage fs(256 << 10);
  ThreadPool pool(4);
  SmallTensors st(40);
  DataFileOptions opts;
  opts.block_size = 16 << 10;
  ASSERT_TRUE(SaveBuffers(&fs, "ck", st.buffers, &pool, opts).ok());
  auto loaded = LoadBuffers(&fs, "ck", &pool);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ASSERT_EQ(loaded->size(), st.data.size());
  for (const auto& b : *loaded) {
    size_t i = std::stoul(b.name.substr(1));
    ASSERT_EQ(b.data.size(), st.data[i].size() * 4) << b.name;
    EXPECT_EQ(std::memcmp(b.data.data(), st.data[i].data(), b.data.size()), 0) << b.name;
  }
  // 41 items of ~4-20 KiB: a handful of coalesced reads of <= 512 KiB, not
  // one request per item.
  EXPECT_GT(fs.reads_v.load(), 0);
  EXPECT_LT(fs.reads_v.load(), 10);
}

TEST(CoalescedReadTest, CorruptionInACoalescedReadNamesTheTensor) {
  LargeReadStorage fs(256 << 10);
  ThreadPool pool(4);
  SmallTensors st(10);
  ASSERT_TRUE(SaveBuffers(&fs, "ck", st.buffers, &pool).ok());
  auto m = ReadManifest(&fs, "ck");
  ASSERT_TRUE(m.ok());
  const ManifestTensor* victim = nullptr;
  for (const auto& t : m->tensors) {
    if (t.fqn == "t5") victim = &t;
  }
  ASSERT_NE(victim, nullptr);
  const std::string key = "ck/" + m->files[victim->chunks[0].location.file].key;
  auto in = fs.base()->NewReadableFile(key);
  ASSERT_TRUE(in.ok());
  std::string bytes((*in)->Size(), '\0');
  ASSERT_TRUE((*in)->ReadAt(0, bytes.data(), bytes.size()).ok());
  bytes[victim->chunks[0].location.offset + 100] ^= 0x20;
  auto out = fs.base()->NewWritableFile(key);
  ASSERT_TRUE(out.ok());
  ASSERT_TRUE((*out)->WriteAt(0, bytes.data(), bytes.size()).ok());
  ASSERT_TRUE((*out)->Close().ok());

  auto loaded = LoadBuffers(&fs, "ck", &pool);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(loaded.status().message().find("checksum mismatch"), std::string::npos);
  EXPECT_NE(loaded.status().message().find("tensor 't5'"), std::string::npos)
      << loaded.status().ToString();
}

TEST(CopyFileTest, CopiesEveryByteInParallelRanges) {
  auto src = NewMemStorage();
  auto dst = NewMemStorage();
  ThreadPool pool(4);
  std::vector<float> v = Random((5 << 20) / 4 + 3, 7);
  auto f = src->NewWritableFile("data/r0.bin");
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->WriteAt(0, v.data(), v.size() * 4).ok());
  ASSERT_TRUE((*f)->Close().ok());
  CopyFileOptions opts;
  opts.chunk_bytes = 1 << 20;
  auto n = CopyFile(src.get(), "data/r0.bin", dst.get(), "x/data/r0.bin", &pool, opts);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, v.size() * 4);
  auto in = dst->NewReadableFile("x/data/r0.bin");
  ASSERT_TRUE(in.ok());
  std::vector<float> back(v.size());
  ASSERT_EQ((*in)->Size(), v.size() * 4);
  ASSERT_TRUE((*in)->ReadAt(0, back.data(), back.size() * 4).ok());
  EXPECT_EQ(back, v);
}

TEST(CopyFileTest, MissingSourceIsNotFoundAndCreatesNothing) {
  auto src = NewMemStorage();
  auto dst = NewMemStorage();
  ThreadPool pool(2);
  auto n = CopyFile(src.get(), "nope.bin", dst.get(), "out.bin", &pool);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), StatusCode::kNotFound);
  auto e = dst->Exists("out.bin");
  ASSERT_TRUE(e.ok());
  EXPECT_FALSE(*e);
}

}  // namespace
}  // namespace cairn
