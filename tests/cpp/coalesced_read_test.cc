// Tests of coalesced checkpoint reads (ReadableFile::ReadV on storages that
// prefer few large requests, as s3 does), of shared (page-cache) reads and of
// CopyFile.
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

// A mem storage that counts the bytes read through data files opened with
// and without ReadOptions::direct_io, and the data files it opened of each
// kind (the manifest is not counted).
class DirectCountingStorage final : public StorageWrapper {
 public:
  DirectCountingStorage() : StorageWrapper(NewMemStorage()) {}

  class File final : public ReadableFile {
   public:
    File(std::unique_ptr<ReadableFile> base, std::atomic<uint64_t>* bytes)
        : base_(std::move(base)), bytes_(bytes) {}
    Status ReadAt(uint64_t off, void* buf, size_t n) const override {
      *bytes_ += n;
      return base_->ReadAt(off, buf, n);
    }
    uint64_t Size() const override { return base_->Size(); }

   private:
    std::unique_ptr<ReadableFile> base_;
    std::atomic<uint64_t>* bytes_;
  };

  Result<std::unique_ptr<ReadableFile>> NewReadableFile(std::string_view key,
                                                        const ReadOptions& o) override {
    CAIRN_ASSIGN_OR_RETURN(auto f, target()->NewReadableFile(key, o));
    if (key.size() >= format::kManifestName.size() &&
        key.substr(key.size() - format::kManifestName.size()) == format::kManifestName) {
      return f;
    }
    (o.direct_io ? opened_direct : opened_buffered)++;
    return std::unique_ptr<ReadableFile>(
        new File(std::move(f), o.direct_io ? &direct_bytes : &buffered_bytes));
  }
  std::string Describe() const override { return "counting://"; }

  Storage* base() { return target(); }
  std::atomic<uint64_t> direct_bytes{0}, buffered_bytes{0};
  std::atomic<int> opened_direct{0}, opened_buffered{0};
};

// Three tensors of 1, 2 and 3 MiB in one data file; the index of each by name.
struct ThreeTensors {
  std::vector<std::vector<float>> data{Random(1 << 18, 1), Random(2 << 18, 2), Random(3 << 18, 3)};
  std::vector<NamedBuffer> buffers;
  ThreeTensors() {
    for (size_t i = 0; i < data.size(); ++i) {
      buffers.push_back({"t" + std::to_string(i), "float32", {data[i].size()}, data[i].data()});
    }
  }
  static uint32_t Index(const Manifest& m, const std::string& fqn) {
    for (uint32_t i = 0; i < m.tensors.size(); ++i) {
      if (m.tensors[i].fqn == fqn) return i;
    }
    ADD_FAILURE() << fqn << " not in the manifest";
    return 0;
  }
};

TEST(SharedReadTest, SharedRequestsGoThroughThePageCacheTheRestDirect) {
  DirectCountingStorage fs;
  ThreadPool pool(4);
  ThreeTensors st;
  ASSERT_TRUE(SaveBuffers(&fs, "ck", st.buffers, &pool).ok());
  auto reader = CheckpointReader::Open(&fs, "ck");  // direct by default
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  const Manifest& m = (*reader)->manifest();
  std::vector<std::vector<float>> back(3);
  std::vector<ReadRequest> reqs;
  for (int i = 0; i < 3; ++i) {
    back[i].assign(st.data[i].size(), 0.f);
    ReadRequest r{{ItemRef::Kind::kTensorChunk, ThreeTensors::Index(m, "t" + std::to_string(i)), 0},
                  back[i].data(),
                  back[i].size() * 4};
    r.shared = i != 1;  // t0 and t2: other processes read them too
    reqs.push_back(r);
  }
  Status s = (*reader)->Read(reqs, &pool);
  ASSERT_TRUE(s.ok()) << s.ToString();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(back[i], st.data[i]) << "t" << i;
  EXPECT_EQ(fs.direct_bytes.load(), uint64_t{2} << 20);    // t1
  EXPECT_EQ(fs.buffered_bytes.load(), uint64_t{4} << 20);  // t0 and t2
  EXPECT_EQ(fs.opened_buffered.load(), 1);                 // the data file, a second time, once
  // Read again: the files stay open.
  ASSERT_TRUE((*reader)->Read(reqs, &pool).ok());
  EXPECT_EQ(fs.opened_buffered.load(), 1);
}

TEST(SharedReadTest, ASharedReadIsVerifiedToo) {
  DirectCountingStorage fs;
  ThreadPool pool(2);
  ThreeTensors st;
  ASSERT_TRUE(SaveBuffers(&fs, "ck", st.buffers, &pool).ok());
  auto m = ReadManifest(&fs, "ck");
  ASSERT_TRUE(m.ok());
  const uint32_t t2 = ThreeTensors::Index(*m, "t2");
  const ItemLocation& loc = m->tensors[t2].chunks[0].location;
  const std::string key = "ck/" + m->files[loc.file].key;
  auto in = fs.base()->NewReadableFile(key);
  ASSERT_TRUE(in.ok());
  std::string bytes((*in)->Size(), '\0');
  ASSERT_TRUE((*in)->ReadAt(0, bytes.data(), bytes.size()).ok());
  bytes[loc.offset + loc.length - 3] ^= 0x01;
  auto out = fs.base()->NewWritableFile(key);
  ASSERT_TRUE(out.ok());
  ASSERT_TRUE((*out)->WriteAt(0, bytes.data(), bytes.size()).ok());
  ASSERT_TRUE((*out)->Close().ok());

  auto reader = CheckpointReader::Open(&fs, "ck");
  ASSERT_TRUE(reader.ok());
  std::vector<float> back(st.data[2].size());
  ReadRequest r{{ItemRef::Kind::kTensorChunk, t2, 0}, back.data(), back.size() * 4};
  r.shared = true;
  Status s = (*reader)->Read({r}, &pool);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("checksum mismatch"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("tensor 't2'"), std::string::npos) << s.ToString();
  EXPECT_GT(fs.buffered_bytes.load(), 0u);
}

TEST(SharedReadTest, AFileUseFileGaveServesSharedRequestsAsItIs) {
  DirectCountingStorage fs;
  ThreadPool pool(2);
  ThreeTensors st;
  ASSERT_TRUE(SaveBuffers(&fs, "ck", st.buffers, &pool).ok());
  auto reader = CheckpointReader::Open(&fs, "ck");
  ASSERT_TRUE(reader.ok());
  const Manifest& m = (*reader)->manifest();
  ASSERT_EQ(m.files.size(), 1u);
  // The stand-in for a staging slot's mapping: opened outside the reader.
  auto given = fs.base()->NewReadableFile("ck/" + m.files[0].key);
  ASSERT_TRUE(given.ok());
  ASSERT_TRUE((*reader)->UseFile(m.files[0].key, std::move(*given)).ok());
  std::vector<float> back(st.data[0].size());
  ReadRequest r{
      {ItemRef::Kind::kTensorChunk, ThreeTensors::Index(m, "t0"), 0}, back.data(), back.size() * 4};
  r.shared = true;
  ASSERT_TRUE((*reader)->Read({r}, &pool).ok());
  EXPECT_EQ(back, st.data[0]);
  EXPECT_EQ(fs.opened_buffered.load(), 0);
  EXPECT_EQ(fs.buffered_bytes.load(), 0u);
  EXPECT_EQ(fs.direct_bytes.load(), 0u);
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
