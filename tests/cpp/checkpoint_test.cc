// Tests of the checkpoint engine (writer, reader, verify, latest_valid, copy)
// on the mem and posix backends.
#include "cairn/checkpoint.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>

namespace cairn {
namespace {

// Owns a storage of the kind under test (posix storages live in a fresh
// temp directory that is removed afterwards).
class StorageFixture {
 public:
  explicit StorageFixture(const std::string& kind) {
    if (kind == "mem") {
      storage_ = NewMemStorage();
    } else {
      char tmpl[] = "/tmp/cairn_ckpt_test_XXXXXX";
      dir_ = mkdtemp(tmpl);
      storage_ = std::move(NewPosixStorage(dir_)).value();
    }
  }
  ~StorageFixture() {
    if (!dir_.empty()) storage_->DeleteDir("").IgnoreError();
    if (!dir_.empty()) ::rmdir(dir_.c_str());
  }
  Storage* get() { return storage_.get(); }

 private:
  std::string dir_;
  std::unique_ptr<Storage> storage_;
};

std::string ReadAll(Storage* s, const std::string& key) {
  auto f = s->NewReadableFile(key);
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  std::string out((*f)->Size(), '\0');
  EXPECT_TRUE((*f)->ReadAt(0, out.data(), out.size()).ok());
  return out;
}

void WriteAll(Storage* s, const std::string& key, const std::string& data) {
  auto f = s->NewWritableFile(key);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->WriteAt(0, data.data(), data.size()).ok());
  ASSERT_TRUE((*f)->Close().ok());
}

class CheckpointTest : public ::testing::TestWithParam<std::string> {
 protected:
  CheckpointTest() : fs_(GetParam()), pool_(4) {
    a_.resize(3 * 4096 / 4 + 7);  // spans 4 blocks of 4 KiB with a short tail
    std::iota(a_.begin(), a_.end(), 1.0f);
    b_ = {1, -2, 3, -4, 5};
  }

  // Saves a_ ("w", float32), b_ ("b", int64), a scalar and an empty tensor
  // with 4 KiB checksum blocks into `dir`.
  Status Save(const std::string& dir) {
    DataFileOptions opts;
    opts.block_size = 4096;
    std::vector<NamedBuffer> bufs = {
        {"w", "float32", {a_.size()}, a_.data()},
        {"b", "int64", {5}, b_.data()},
        {"scalar", "float64", {}, &scalar_},
        {"empty", "float32", {0, 3}, nullptr},
    };
    return SaveBuffers(fs_.get(), dir, bufs, &pool_, opts);
  }

  StorageFixture fs_;
  ThreadPool pool_;
  std::vector<float> a_;
  std::vector<int64_t> b_;
  double scalar_ = 2.5;
};

TEST_P(CheckpointTest, SaveLoadRoundTrip) {
  ASSERT_TRUE(Save("ck").ok());
  auto loaded = LoadBuffers(fs_.get(), "ck", &pool_);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ASSERT_EQ(loaded->size(), 4u);
  const auto& w = (*loaded)[0];
  EXPECT_EQ(w.name, "w");
  EXPECT_EQ(w.dtype, "float32");
  ASSERT_EQ(w.data.size(), a_.size() * 4);
  EXPECT_EQ(std::memcmp(w.data.data(), a_.data(), w.data.size()), 0);
  EXPECT_EQ(std::memcmp((*loaded)[1].data.data(), b_.data(), 40), 0);
  EXPECT_EQ(std::memcmp((*loaded)[2].data.data(), &scalar_, 8), 0);
  EXPECT_EQ((*loaded)[3].data.size(), 0u);
  EXPECT_EQ((*loaded)[3].shape, (std::vector<uint64_t>{0, 3}));
  EXPECT_TRUE(Verify(fs_.get(), "ck", &pool_).ok());
}

TEST_P(CheckpointTest, ItemsAreAlignedAndChecksummedPerBlock) {
  ASSERT_TRUE(Save("ck").ok());
  auto m = ReadManifest(fs_.get(), "ck");
  ASSERT_TRUE(m.ok());
  for (const auto& t : m->tensors) {
    EXPECT_EQ(t.chunks[0].location.offset % format::kItemAlignment, 0u) << t.fqn;
  }
  EXPECT_EQ(m->tensors[0].chunks[0].location.checksums.size(), 4u);
  EXPECT_EQ(m->tensors[3].chunks[0].location.checksums.size(), 0u);
  EXPECT_EQ(m->files[0].size, *fs_.get()->FileSize("ck/data/r0.bin"));
}

TEST_P(CheckpointTest, NoManifestIsNotFound) {
  auto r = CheckpointReader::Open(fs_.get(), "nothing");
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(fs_.get()->CreateDir("partial/data").ok());
  r = CheckpointReader::Open(fs_.get(), "partial");
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("partial"), std::string::npos);
  // Verify is stricter: an existing directory without a manifest is not intact.
  EXPECT_EQ(Verify(fs_.get(), "partial", &pool_).code(), StatusCode::kDataLoss);
  EXPECT_EQ(Verify(fs_.get(), "nothing", &pool_).code(), StatusCode::kNotFound);
}

TEST_P(CheckpointTest, FlippedDataByteIsDataLossNamingFileAndTensor) {
  ASSERT_TRUE(Save("ck").ok());
  auto m = ReadManifest(fs_.get(), "ck");
  std::string data = ReadAll(fs_.get(), "ck/data/r0.bin");
  uint64_t off = m->tensors[1].chunks[0].location.offset + 3;  // inside "b"
  data[off] ^= 1;
  WriteAll(fs_.get(), "ck/data/r0.bin", data);

  auto loaded = LoadBuffers(fs_.get(), "ck", &pool_);
  ASSERT_EQ(loaded.status().code(), StatusCode::kDataLoss);
  const std::string& msg = loaded.status().message();
  EXPECT_NE(msg.find("data/r0.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tensor 'b'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("checksum mismatch in block 0"), std::string::npos) << msg;

  Status v = Verify(fs_.get(), "ck", &pool_);
  EXPECT_EQ(v.code(), StatusCode::kDataLoss);
  EXPECT_NE(v.message().find("tensor 'b'"), std::string::npos) << v.ToString();
}

TEST_P(CheckpointTest, FlippedByteInALaterBlockNamesTheBlock) {
  ASSERT_TRUE(Save("ck").ok());
  std::string data = ReadAll(fs_.get(), "ck/data/r0.bin");
  data[2 * 4096 + 10] ^= 0x80;  // block 2 of "w", which starts at 0
  WriteAll(fs_.get(), "ck/data/r0.bin", data);
  Status v = Verify(fs_.get(), "ck", &pool_);
  EXPECT_NE(v.message().find("block 2 of tensor 'w'"), std::string::npos) << v.ToString();
}

TEST_P(CheckpointTest, FlippedPaddingByteIsDetectedByVerify) {
  ASSERT_TRUE(Save("ck").ok());
  auto m = ReadManifest(fs_.get(), "ck");
  const auto& loc = m->tensors[0].chunks[0].location;
  std::string data = ReadAll(fs_.get(), "ck/data/r0.bin");
  data[loc.offset + loc.length + 1] = 1;  // padding after "w"
  WriteAll(fs_.get(), "ck/data/r0.bin", data);
  Status v = Verify(fs_.get(), "ck", &pool_);
  EXPECT_EQ(v.code(), StatusCode::kDataLoss);
  EXPECT_NE(v.message().find("padding"), std::string::npos) << v.ToString();
  // Loading only reads items, so it still succeeds with the right values.
  EXPECT_TRUE(LoadBuffers(fs_.get(), "ck", &pool_).ok());
}

TEST_P(CheckpointTest, TruncatedDataFileIsDataLossNamingFileAndTensor) {
  ASSERT_TRUE(Save("ck").ok());
  std::string data = ReadAll(fs_.get(), "ck/data/r0.bin");
  WriteAll(fs_.get(), "ck/data/r0.bin", data.substr(0, data.size() - 10));
  auto loaded = LoadBuffers(fs_.get(), "ck", &pool_);
  ASSERT_EQ(loaded.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(loaded.status().message().find("data/r0.bin: truncated"), std::string::npos)
      << loaded.status().ToString();
  EXPECT_NE(loaded.status().message().find("tensor '"), std::string::npos);
  EXPECT_EQ(Verify(fs_.get(), "ck", &pool_).code(), StatusCode::kDataLoss);
}

TEST_P(CheckpointTest, DeletedDataFileIsDataLossNamingFileAndTensor) {
  ASSERT_TRUE(Save("ck").ok());
  ASSERT_TRUE(fs_.get()->DeleteFile("ck/data/r0.bin").ok());
  auto loaded = LoadBuffers(fs_.get(), "ck", &pool_);
  ASSERT_EQ(loaded.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(loaded.status().message().find("data/r0.bin: data file missing"), std::string::npos)
      << loaded.status().ToString();
  EXPECT_NE(loaded.status().message().find("tensor 'w'"), std::string::npos);
  Status v = Verify(fs_.get(), "ck", &pool_);
  EXPECT_EQ(v.code(), StatusCode::kDataLoss);
  EXPECT_NE(v.message().find("data/r0.bin"), std::string::npos);
}

TEST_P(CheckpointTest, DamagedManifestIsDataLoss) {
  ASSERT_TRUE(Save("ck").ok());
  std::string man = ReadAll(fs_.get(), "ck/cairn.manifest");
  man[man.size() / 2] ^= 4;
  WriteAll(fs_.get(), "ck/cairn.manifest", man);
  EXPECT_EQ(CheckpointReader::Open(fs_.get(), "ck").status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(Verify(fs_.get(), "ck", &pool_).code(), StatusCode::kDataLoss);
}

TEST_P(CheckpointTest, ReadRejectsRangesOutsideTheItem) {
  ASSERT_TRUE(Save("ck").ok());
  auto reader = CheckpointReader::Open(fs_.get(), "ck");
  ASSERT_TRUE(reader.ok());
  std::vector<char> buf(48);  // "b" has 40 bytes
  ReadRequest r{{ItemRef::Kind::kTensorChunk, 1, 0}, buf.data(), buf.size()};
  EXPECT_EQ((*reader)->Read({r}, &pool_).code(), StatusCode::kInvalidArgument);
  r.size = 0;
  r.offset = 41;
  EXPECT_EQ((*reader)->Read({r}, &pool_).code(), StatusCode::kInvalidArgument);
  r.size = 8;
  r.offset = 0;
  r.item.index = 99;
  EXPECT_EQ((*reader)->Read({r}, &pool_).code(), StatusCode::kInvalidArgument);
}

TEST_P(CheckpointTest, ReadsByteRangesOfAnItem) {
  ASSERT_TRUE(Save("ck").ok());
  auto reader = CheckpointReader::Open(fs_.get(), "ck");
  ASSERT_TRUE(reader.ok());
  const char* src = reinterpret_cast<const char*>(a_.data());
  const uint64_t len = a_.size() * 4;
  // Inside one block, across blocks, exactly one block, the unaligned tail.
  for (auto [off, n] : std::vector<std::pair<uint64_t, uint64_t>>{
           {100, 10}, {100, 5000}, {4096, 4096}, {3 * 4096, len - 3 * 4096}, {0, len}}) {
    std::vector<char> buf(n);
    ReadRequest r{{ItemRef::Kind::kTensorChunk, 0, 0}, buf.data(), n, off};
    Status s = (*reader)->Read({r}, &pool_);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(std::memcmp(buf.data(), src + off, n), 0) << off << "+" << n;
  }
  std::vector<char> buf(8);
  ReadRequest past{{ItemRef::Kind::kTensorChunk, 0, 0}, buf.data(), 8, len - 4};
  EXPECT_EQ((*reader)->Read({past}, &pool_).code(), StatusCode::kInvalidArgument);
}

TEST_P(CheckpointTest, RangeReadsVerifyEveryBlockTheyTouch) {
  ASSERT_TRUE(Save("ck").ok());
  std::string data = ReadAll(fs_.get(), "ck/data/r0.bin");
  data[4096 + 7] ^= 1;  // block 1 of "w"
  WriteAll(fs_.get(), "ck/data/r0.bin", data);
  auto reader = CheckpointReader::Open(fs_.get(), "ck");
  ASSERT_TRUE(reader.ok());
  std::vector<char> buf(8);
  // A range that touches only the damaged block's tail still fails...
  ReadRequest r{{ItemRef::Kind::kTensorChunk, 0, 0}, buf.data(), 8, 2 * 4096 - 8};
  Status s = (*reader)->Read({r}, &pool_);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("block 1 of tensor 'w'"), std::string::npos) << s.ToString();
  // ...and one that avoids it succeeds.
  r.offset = 2 * 4096;
  EXPECT_TRUE((*reader)->Read({r}, &pool_).ok());
}

TEST_P(CheckpointTest, RewritingADirectoryUncommitsItFirst) {
  ASSERT_TRUE(Save("ck").ok());
  ASSERT_TRUE(UncommitCheckpoint(fs_.get(), "ck").ok());
  EXPECT_EQ(ReadManifest(fs_.get(), "ck").status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(UncommitCheckpoint(fs_.get(), "ck").ok());  // idempotent
  ASSERT_TRUE(Save("ck").ok());
  EXPECT_TRUE(Verify(fs_.get(), "ck", &pool_).ok());
}

TEST_P(CheckpointTest, MultiChunkTensorsFromSeveralFilesAreAssembled) {
  // A 4x3 int32 tensor sharded by rows over two "ranks" and a 2x4 tensor
  // sharded by columns, as DCP would store them.
  std::vector<int32_t> full(12);
  std::iota(full.begin(), full.end(), 0);
  std::vector<int32_t> cols_full = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<int32_t> left = {0, 1, 4, 5}, right = {2, 3, 6, 7};
  Manifest m;
  m.world_size = 2;
  m.block_size = 4096;
  ManifestTensor t{"rows", "int32", {4, 3}, false, "strided", "contiguous_format", false, {}};
  ManifestTensor c{"cols", "int32", {2, 4}, false, "strided", "contiguous_format", false, {}};
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<BufferRef> bufs = {{full.data() + rank * 6, 24},
                                   {(rank ? right : left).data(), 16}};
    auto r = WriteDataFile(fs_.get(), "mc/" + format::DataFileKey(rank), bufs, &pool_,
                           {false, 4096, true});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    m.files.push_back({format::DataFileKey(rank), r->file_size});
    r->items[0].file = r->items[1].file = rank;
    t.chunks.push_back({{uint64_t(rank) * 2, 0}, {2, 3}, r->items[0]});
    c.chunks.push_back({{0, uint64_t(rank) * 2}, {2, 2}, r->items[1]});
  }
  m.tensors = {t, c};
  ASSERT_TRUE(CommitManifest(fs_.get(), "mc", m).ok());
  auto loaded = LoadBuffers(fs_.get(), "mc", &pool_);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(std::memcmp((*loaded)[0].data.data(), full.data(), 48), 0);
  EXPECT_EQ(std::memcmp((*loaded)[1].data.data(), cols_full.data(), 32), 0);
  EXPECT_TRUE(Verify(fs_.get(), "mc", &pool_).ok());
}

TEST_P(CheckpointTest, LatestValidSkipsPartialCheckpoints) {
  ASSERT_TRUE(Save("run/step_10").ok());
  ASSERT_TRUE(Save("run/step_200").ok());
  ASSERT_TRUE(Save("run/step_30").ok());
  // step_300: data but no manifest (crashed before commit).
  ASSERT_TRUE(Save("run/step_300").ok());
  ASSERT_TRUE(fs_.get()->DeleteFile("run/step_300/cairn.manifest").ok());
  // step_400: damaged manifest.
  ASSERT_TRUE(Save("run/step_400").ok());
  WriteAll(fs_.get(), "run/step_400/cairn.manifest", "garbage");
  // A leftover temp manifest only.
  WriteAll(fs_.get(), "run/step_500/cairn.manifest.tmp", "x");
  auto latest = LatestValid(fs_.get(), "run");
  ASSERT_TRUE(latest.ok()) << latest.status().ToString();
  ASSERT_TRUE(latest->has_value());
  EXPECT_EQ(**latest, "step_200");

  auto list = ListCheckpoints(fs_.get(), "run");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 6u);
  EXPECT_EQ(list->front().name, "step_10");
  EXPECT_EQ(list->back().name, "step_500");
  EXPECT_FALSE(list->back().committed);
  EXPECT_EQ((*list)[4].status.code(), StatusCode::kDataLoss);  // step_400
}

TEST_P(CheckpointTest, LatestValidOrdersOtherNamesByCreationTime) {
  // Without step numbers, the manifest's creation time decides, not the name.
  for (auto [name, ms] :
       std::vector<std::pair<std::string, int64_t>>{{"r/b", 3000}, {"r/a", 5000}, {"r/c", 1000}}) {
    Manifest m;
    m.created_unix_ms = ms;
    ASSERT_TRUE(CommitManifest(fs_.get(), name, m).ok());
  }
  auto latest = LatestValid(fs_.get(), "r");
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(latest->value_or(""), "a");
  // Any step_<N> directory is newer than those.
  Manifest m;
  m.created_unix_ms = 1;
  ASSERT_TRUE(CommitManifest(fs_.get(), "r/step_0", m).ok());
  EXPECT_EQ(LatestValid(fs_.get(), "r")->value_or(""), "step_0");
}

TEST_P(CheckpointTest, VerifyReportsProgressUpToTheTotal) {
  ASSERT_TRUE(Save("ck").ok());
  std::atomic<uint64_t> max_done{0}, total{0};
  Status s = Verify(fs_.get(), "ck", &pool_, [&](uint64_t d, uint64_t t) {
    uint64_t prev = max_done.load();
    while (d > prev && !max_done.compare_exchange_weak(prev, d)) {
    }
    total = t;
  });
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(total.load(), *fs_.get()->FileSize("ck/data/r0.bin"));
  EXPECT_EQ(max_done.load(), total.load());
}

TEST_P(CheckpointTest, LatestValidOfAnEmptyOrMissingRoot) {
  ASSERT_TRUE(fs_.get()->CreateDir("empty").ok());
  auto latest = LatestValid(fs_.get(), "empty");
  ASSERT_TRUE(latest.ok());
  EXPECT_FALSE(latest->has_value());
  EXPECT_EQ(LatestValid(fs_.get(), "missing").status().code(), StatusCode::kNotFound);
}

TEST_P(CheckpointTest, CopyCheckpointThenVerify) {
  ASSERT_TRUE(Save("src").ok());
  StorageFixture other("mem");
  std::atomic<uint64_t> last{0};
  CopyOptions opts;
  opts.verify_destination = true;
  Status s = CopyCheckpoint(
      fs_.get(), "src", other.get(), "dst", &pool_, [&](uint64_t d, uint64_t) { last = d; }, opts);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(Verify(other.get(), "dst", &pool_).ok());
  EXPECT_EQ(ReadAll(other.get(), "dst/data/r0.bin"), ReadAll(fs_.get(), "src/data/r0.bin"));
  auto m = ReadManifest(fs_.get(), "src");
  EXPECT_GT(last.load(), 0u);
  auto loaded = LoadBuffers(other.get(), "dst", &pool_);
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(std::memcmp((*loaded)[0].data.data(), a_.data(), a_.size() * 4), 0);
}

TEST_P(CheckpointTest, CopyOfACorruptSourceFailsAndLeavesNoCommit) {
  ASSERT_TRUE(Save("src").ok());
  std::string data = ReadAll(fs_.get(), "src/data/r0.bin");
  data[5] ^= 1;
  WriteAll(fs_.get(), "src/data/r0.bin", data);
  StorageFixture other("mem");
  Status s = CopyCheckpoint(fs_.get(), "src", other.get(), "dst", &pool_);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("tensor 'w'"), std::string::npos) << s.ToString();
  EXPECT_EQ(ReadManifest(other.get(), "dst").status().code(), StatusCode::kNotFound);
}

// Copies that would write into their own source are refused before anything
// changes, on every backend (keys of one storage).
TEST_P(CheckpointTest, CopyOntoItselfOrIntoOrAroundItselfIsRefused) {
  ASSERT_TRUE(Save("ck").ok());
  const std::string data = ReadAll(fs_.get(), "ck/data/r0.bin");
  const std::string manifest = ReadAll(fs_.get(), "ck/cairn.manifest");
  struct Case {
    const char* dst;
    const char* what;
  } cases[] = {{"ck", "onto itself"},
               {"ck/sub", "lies inside the source"},
               {"ck/data", "lies inside the source"},
               {"", "lies inside the destination"}};
  for (const auto& c : cases) {
    Status s = CopyCheckpoint(fs_.get(), "ck", fs_.get(), c.dst, &pool_);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.dst << ": " << s.ToString();
    EXPECT_NE(s.message().find(c.what), std::string::npos) << s.ToString();
    EXPECT_EQ(ReadAll(fs_.get(), "ck/data/r0.bin"), data) << c.dst;
    EXPECT_EQ(ReadAll(fs_.get(), "ck/cairn.manifest"), manifest) << c.dst;
    EXPECT_TRUE(Verify(fs_.get(), "ck", &pool_).ok()) << c.dst;
  }
  // A sibling whose name merely starts with the source's is another place.
  Status s = CopyCheckpoint(fs_.get(), "ck", fs_.get(), "ck2", &pool_);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(Verify(fs_.get(), "ck2", &pool_).ok());
}

TEST_P(CheckpointTest, LargeBuffersRoundTripWithDefaultBlocks) {
  // 40 MiB: three 16 MiB blocks written and read in parallel, direct I/O
  // requested from an unaligned source pointer.
  std::vector<uint8_t> big((40 << 20) + 1);
  std::mt19937 rng(7);
  for (auto& x : big) x = static_cast<uint8_t>(rng());
  DataFileOptions opts;
  opts.direct_io = true;
  ASSERT_TRUE(SaveBuffers(fs_.get(), "big", {{"x", "uint8", {big.size() - 1}, big.data() + 1}},
                          &pool_, opts)
                  .ok());
  auto loaded = LoadBuffers(fs_.get(), "big", &pool_);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ASSERT_EQ((*loaded)[0].data.size(), big.size() - 1);
  EXPECT_EQ(std::memcmp((*loaded)[0].data.data(), big.data() + 1, big.size() - 1), 0);
  EXPECT_EQ(ReadManifest(fs_.get(), "big")->tensors[0].chunks[0].location.checksums.size(), 3u);
}

INSTANTIATE_TEST_SUITE_P(Backends, CheckpointTest, ::testing::Values("mem", "posix"),
                         [](const auto& info) { return info.param; });

// A mem storage whose files below `full_prefix` hit "disk full" when space
// is allocated or written (test-local: the shared fault-injection wrapper
// covers the general case).
class FullDiskStorage final : public StorageWrapper {
 public:
  explicit FullDiskStorage(std::string full_prefix)
      : StorageWrapper(NewMemStorage()), prefix_(std::move(full_prefix)) {}

  class FullFile final : public WritableFile {
   public:
    Status WriteAt(uint64_t, const void*, size_t) override { return Full(); }
    Status Allocate(uint64_t) override { return Full(); }
    Status Sync() override { return Status::OK(); }
    Status Close() override { return Status::OK(); }
    static Status Full() { return ErrnoToStatus(ENOSPC, "write"); }
  };

  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view key,
                                                        const WriteOptions& o) override {
    if (key.substr(0, prefix_.size()) == prefix_) {
      CAIRN_RETURN_IF_ERROR(ValidateKey(key));
      return std::unique_ptr<WritableFile>(new FullFile());
    }
    return target()->NewWritableFile(key, o);
  }
  std::string Describe() const override { return "full://"; }

 private:
  std::string prefix_;
};

// A storage where another process deletes `victim_` right after Exists() saw it:
// the race of several local ranks uncommitting their node's shared slot.
class RacingDeleteStorage final : public StorageWrapper {
 public:
  RacingDeleteStorage(Storage* target, std::string victim)
      : StorageWrapper(target), victim_(std::move(victim)) {}
  Result<bool> Exists(std::string_view key) override {
    Result<bool> r = target()->Exists(key);
    if (r.ok() && *r && key == victim_) {
      Status s = target()->DeleteFile(key);  // the other rank wins the race
      if (!s.ok()) return s;
    }
    return r;
  }

 private:
  std::string victim_;
};

TEST_P(CheckpointTest, UncommitOfAManifestAnotherProcessJustRemovedSucceeds) {
  ASSERT_TRUE(Save("ck").ok());
  RacingDeleteStorage racing(fs_.get(), "ck/cairn.manifest");
  Status s = UncommitCheckpoint(&racing, "ck");
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(ReadManifest(fs_.get(), "ck").status().code(), StatusCode::kNotFound);
}

TEST(CheckpointWriterTest, DiskFullFailsCleanlyAndKeepsEarlierCheckpoints) {
  FullDiskStorage fs("run/step_2/");
  ThreadPool pool(2);
  std::vector<float> x(1000, 1.0f);
  ASSERT_TRUE(SaveBuffers(&fs, "run/step_1", {{"x", "float32", {1000}, x.data()}}, &pool).ok());
  Status s = SaveBuffers(&fs, "run/step_2", {{"x", "float32", {1000}, x.data()}}, &pool);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("writing full://: run/step_2/data/r0.bin"), std::string::npos)
      << s.ToString();
  EXPECT_EQ(ReadManifest(&fs, "run/step_2").status().code(), StatusCode::kNotFound);
  auto latest = LatestValid(&fs, "run");
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(latest->value_or(""), "step_1");
  EXPECT_TRUE(Verify(&fs, "run/step_1", &pool).ok());
}

TEST(CheckpointDiscoveryTest, ParseStep) {
  EXPECT_EQ(ParseStep("step_0"), 0u);
  EXPECT_EQ(ParseStep("step_1234"), 1234u);
  EXPECT_FALSE(ParseStep("step_").has_value());
  EXPECT_FALSE(ParseStep("step_-1").has_value());
  EXPECT_FALSE(ParseStep("step_12a").has_value());
  EXPECT_FALSE(ParseStep("ckpt_12").has_value());
  EXPECT_FALSE(ParseStep("step_99999999999999999999").has_value());
}

TEST(CheckpointWriterTest, NullBufferIsInvalidArgument) {
  auto s = NewMemStorage();
  ThreadPool pool(2);
  auto r = WriteDataFile(s.get(), "f", {{nullptr, 10}}, &pool);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SaveBuffers(s.get(), "x", {{"a", "object", {1}, "a"}}, &pool).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cairn

namespace cairn {
namespace {

// Writes a tiny committed checkpoint (or a partial one) named `name` below root.
void MakeCheckpoint(Storage* st, const std::string& name, bool commit) {
  std::vector<float> v(16, 1.0f);
  NamedBuffer b{"w", "float32", {16}, v.data()};
  ThreadPool pool(2);
  ASSERT_TRUE(SaveBuffers(st, name, {b}, &pool, DataFileOptions{}).ok());
  if (!commit) ASSERT_TRUE(UncommitCheckpoint(st, name).ok());
}

std::vector<std::string> Names(Storage* st) {
  std::vector<std::string> out;
  auto listed = st->List("");
  EXPECT_TRUE(listed.ok());
  for (const auto& e : *listed) out.push_back(e.name);
  return out;
}

TEST(PruneTest, KeepsNewestCommittedAndRemovesOlderPartials) {
  auto st = NewMemStorage();
  MakeCheckpoint(st.get(), "step_1", true);
  MakeCheckpoint(st.get(), "step_2", false);  // crashed save, older than the newest
  MakeCheckpoint(st.get(), "step_3", true);
  MakeCheckpoint(st.get(), "step_4", true);
  MakeCheckpoint(st.get(), "step_5", false);  // maybe in flight: kept by default
  ASSERT_TRUE(st->CreateDir("other").ok());
  std::vector<std::string> removed;
  PruneOptions opts;
  opts.keep = 2;
  ASSERT_TRUE(Prune(st.get(), "", opts, &removed).ok());
  EXPECT_EQ(removed, (std::vector<std::string>{"step_1", "step_2"}));
  EXPECT_EQ(Names(st.get()), (std::vector<std::string>{"other", "step_3", "step_4", "step_5"}));
  opts.remove_newer_partials = true;
  removed.clear();
  ASSERT_TRUE(Prune(st.get(), "", opts, &removed).ok());
  EXPECT_EQ(removed, (std::vector<std::string>{"step_5"}));
}

TEST(PruneTest, DryRunRemovesNothingAndKeepMustBePositive) {
  auto st = NewMemStorage();
  MakeCheckpoint(st.get(), "step_1", true);
  MakeCheckpoint(st.get(), "step_2", true);
  std::vector<std::string> removed;
  PruneOptions opts;
  opts.keep = 1;
  opts.dry_run = true;
  ASSERT_TRUE(Prune(st.get(), "", opts, &removed).ok());
  EXPECT_EQ(removed, (std::vector<std::string>{"step_1"}));
  EXPECT_EQ(Names(st.get()).size(), 2u);
  opts.keep = 0;
  EXPECT_EQ(Prune(st.get(), "", opts, &removed).code(), StatusCode::kInvalidArgument);
}

TEST(PruneTest, UncommitsBeforeDeletingData) {
  auto st = NewMemStorage();
  MakeCheckpoint(st.get(), "step_1", true);
  MakeCheckpoint(st.get(), "step_2", true);
  PruneOptions opts;
  opts.keep = 1;
  bool checked = false;
  opts.after_uncommit = [&](const std::string& name) {
    EXPECT_EQ(name, "step_1");
    EXPECT_FALSE(*st->Exists("step_1/cairn.manifest"));  // no longer valid...
    EXPECT_TRUE(*st->Exists("step_1/data"));             // ...data not yet deleted
    checked = true;
  };
  ASSERT_TRUE(Prune(st.get(), "", opts, nullptr).ok());
  EXPECT_TRUE(checked);
  EXPECT_EQ(Names(st.get()), (std::vector<std::string>{"step_2"}));
}

// ---- hostile and unlucky local trees (posix only) ----------------------------

// A posix storage in a fresh temp directory, with helpers to plant FIFOs and
// symlinks. Every test arms alarm(): a call that blocks (the bug these tests
// guard against) kills the test binary instead of hanging CI.
class LocalTreeTest : public ::testing::Test {
 protected:
  LocalTreeTest() : pool_(4) {
    char tmpl[] = "/tmp/cairn_tree_test_XXXXXX";
    dir_ = mkdtemp(tmpl);
    storage_ = std::move(NewPosixStorage(dir_)).value();
    ::alarm(60);
  }
  ~LocalTreeTest() override {
    ::alarm(0);
    storage_->DeleteDir("").IgnoreError();
    ::rmdir(dir_.c_str());
  }
  Status Save(const std::string& ck) {
    std::vector<float> v(3000);
    std::iota(v.begin(), v.end(), 0.0f);
    DataFileOptions opts;
    opts.block_size = 4096;
    return SaveBuffers(storage_.get(), ck, {{"w", "float32", {3000}, v.data()}}, &pool_, opts);
  }
  void Fifo(const std::string& key) {
    std::string p = dir_ + "/" + key;
    ::unlink(p.c_str());
    ASSERT_EQ(::mkfifo(p.c_str(), 0600), 0) << p;
  }
  std::string dir_;
  std::unique_ptr<Storage> storage_;
  ThreadPool pool_;
};

TEST_F(LocalTreeTest, FifoManifestIsDataLossAndDiscoveryMovesOnToTheOlderCheckpoint) {
  ASSERT_TRUE(Save("step_1").ok());
  ASSERT_TRUE(Save("step_2").ok());
  Fifo("step_2/cairn.manifest");
  auto m = ReadManifest(storage_.get(), "step_2");
  EXPECT_EQ(m.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(m.status().message().find("FIFO"), std::string::npos) << m.status().ToString();
  Status v = Verify(storage_.get(), "step_2", &pool_);
  EXPECT_EQ(v.code(), StatusCode::kDataLoss) << v.ToString();
  EXPECT_FALSE(CheckpointReader::Open(storage_.get(), "step_2").ok());
  auto latest = LatestValid(storage_.get(), "");
  ASSERT_TRUE(latest.ok()) << latest.status().ToString();
  EXPECT_EQ(latest->value_or("none"), "step_1");
  auto list = ListCheckpoints(storage_.get(), "");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 2u);
  EXPECT_FALSE((*list)[1].committed);
  EXPECT_EQ((*list)[1].status.code(), StatusCode::kDataLoss);
  // Copying it is refused the same way, and prune treats it as partial.
  StorageFixture other("mem");
  EXPECT_EQ(CopyCheckpoint(storage_.get(), "step_2", other.get(), "x", &pool_).code(),
            StatusCode::kDataLoss);
}

TEST_F(LocalTreeTest, FifoDataFileIsDataLossNamingTheFile) {
  ASSERT_TRUE(Save("ck").ok());
  Fifo("ck/data/r0.bin");
  Status v = Verify(storage_.get(), "ck", &pool_);
  EXPECT_EQ(v.code(), StatusCode::kDataLoss) << v.ToString();
  EXPECT_NE(v.message().find("data/r0.bin"), std::string::npos) << v.ToString();
  EXPECT_NE(v.message().find("FIFO"), std::string::npos) << v.ToString();
  auto r = CheckpointReader::Open(storage_.get(), "ck");
  ASSERT_TRUE(r.ok());  // the manifest is fine
  EXPECT_EQ((*r)->CheckFiles().code(), StatusCode::kDataLoss);
  std::vector<float> dest(3000);
  Status s = (*r)->Read({{{ItemRef::Kind::kTensorChunk, 0, 0}, dest.data(), 3000 * 4}}, &pool_);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_EQ(LoadBuffers(storage_.get(), "ck", &pool_).status().code(), StatusCode::kDataLoss);
}

TEST_F(LocalTreeTest, NonRegularFilesAreNeitherOpenedNorListed) {
  ASSERT_TRUE(storage_->CreateDir("d").ok());
  Fifo("d/fifo");
  auto e = storage_->Exists("d/fifo");
  ASSERT_TRUE(e.ok());
  EXPECT_FALSE(*e);
  auto l = storage_->List("d");
  ASSERT_TRUE(l.ok());
  EXPECT_TRUE(l->empty());
  EXPECT_EQ(storage_->FileSize("d/fifo").status().code(), StatusCode::kFailedPrecondition);
  for (bool direct : {false, true}) {
    auto rf = storage_->NewReadableFile("d/fifo", ReadOptions{direct});
    EXPECT_EQ(rf.status().code(), StatusCode::kFailedPrecondition) << rf.status().ToString();
    WriteOptions wo;
    wo.direct_io = direct;
    auto wf = storage_->NewWritableFile("d/fifo", wo);
    EXPECT_EQ(wf.status().code(), StatusCode::kFailedPrecondition) << wf.status().ToString();
  }
  // Still a FIFO: a writable open never truncated or replaced it.
  struct stat st;
  ASSERT_EQ(::lstat((dir_ + "/d/fifo").c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  EXPECT_TRUE(storage_->DeleteDir("d").ok());
}

TEST_F(LocalTreeTest, CopyThroughASymlinkOntoTheSourceIsRefused) {
  ASSERT_TRUE(Save("ck").ok());
  const std::string data = ReadAll(storage_.get(), "ck/data/r0.bin");
  ASSERT_EQ(::symlink((dir_ + "/ck").c_str(), (dir_ + "/l").c_str()), 0);
  ASSERT_EQ(::symlink(dir_.c_str(), (dir_ + "/up").c_str()), 0);
  struct Case {
    std::string dst_root, dst_dir, what;
  } cases[] = {
      {dir_ + "/l", "", "onto itself"},
      {dir_ + "/l", "inner", "inside the source"},
      {dir_ + "/up", "", "inside the destination"},
      {dir_ + "/up/ck", "", "onto itself"},
      {dir_ + "/ck/../ck", "", "onto itself"},
  };
  for (const auto& c : cases) {
    auto dst = NewPosixStorage(c.dst_root, /*create=*/false);
    ASSERT_TRUE(dst.ok()) << c.dst_root;
    Status s = CopyCheckpoint(storage_.get(), "ck", dst->get(), c.dst_dir, &pool_);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.dst_root << ": " << s.ToString();
    EXPECT_NE(s.message().find(c.what), std::string::npos) << s.ToString();
    EXPECT_EQ(ReadAll(storage_.get(), "ck/data/r0.bin"), data);
    EXPECT_TRUE(Verify(storage_.get(), "ck", &pool_).ok());
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/ck/inner"));
  // The URI form refuses before it creates the destination.
  Status s = CopyCheckpointUri(dir_ + "/ck", dir_ + "/l/new/deeper", &pool_);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/ck/new"));
  s = CopyCheckpointUri("file://" + dir_ + "/l", dir_ + "/ck", &pool_);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  // And a real copy next to it works.
  s = CopyCheckpointUri(dir_ + "/l", dir_ + "/copy", &pool_);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(Verify(storage_.get(), "copy", &pool_).ok());
  ::unlink((dir_ + "/l").c_str());
  ::unlink((dir_ + "/up").c_str());
}

TEST_F(LocalTreeTest, RelateLocalDirsResolvesLinksAndMissingTails) {
  ASSERT_TRUE(storage_->CreateDir("a/b").ok());
  ASSERT_TRUE(storage_->CreateDir("c").ok());
  ASSERT_EQ(::symlink((dir_ + "/a").c_str(), (dir_ + "/c/link").c_str()), 0);
  auto rel = [&](const std::string& x, const std::string& y) {
    return RelateLocalDirs(dir_ + "/" + x, dir_ + "/" + y).value();
  };
  EXPECT_EQ(rel("a", "c/link"), DirRelation::kSame);
  EXPECT_EQ(rel("c/link/b", "a"), DirRelation::kFirstInside);
  EXPECT_EQ(rel("a", "c/link/b/not/yet"), DirRelation::kSecondInside);
  EXPECT_EQ(rel("c/link/new", "a/new"), DirRelation::kSame);
  EXPECT_EQ(rel("a/b", "c"), DirRelation::kDisjoint);
  EXPECT_EQ(rel("ab", "a"), DirRelation::kDisjoint);
  EXPECT_EQ(rel("a/./b/", "a/b/x/.."), DirRelation::kSame);
  ::unlink((dir_ + "/c/link").c_str());
}

}  // namespace
}  // namespace cairn
