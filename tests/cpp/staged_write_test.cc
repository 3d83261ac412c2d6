// Tests of WriteDataFileStaged: a data file written to a local staging
// directory and copied to the target while it is being written.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <random>

#include "cairn/checkpoint.h"
#include "random_bytes.h"

namespace cairn {
namespace {

class TempPosix {
 public:
  TempPosix() {
    char tmpl[] = "/tmp/cairn_staged_test_XXXXXX";
    dir_ = mkdtemp(tmpl);
    storage_ = std::move(NewPosixStorage(dir_)).value();
  }
  ~TempPosix() {
    storage_->DeleteDir("").IgnoreError();
    ::rmdir(dir_.c_str());
  }
  Storage* get() { return storage_.get(); }

 private:
  std::string dir_;
  std::unique_ptr<Storage> storage_;
};

std::vector<char> RandomBytes(size_t n, uint32_t seed) {
  return test_util::RandomBytes<char>(n, seed);
}

std::string ReadAll(Storage* s, const std::string& key) {
  auto f = s->NewReadableFile(key);
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  if (!f.ok()) return {};
  std::string out((*f)->Size(), '\0');
  EXPECT_TRUE((*f)->ReadAt(0, out.data(), out.size()).ok());
  return out;
}

// Writes into the target of a staged write: a test's hook runs on each WriteAt.
class HookedStorage final : public StorageWrapper {
 public:
  using Hook = std::function<Status(uint64_t offset, size_t n)>;
  HookedStorage(Storage* base, Hook hook) : StorageWrapper(base), hook_(std::move(hook)) {}

  class File final : public WritableFile {
   public:
    File(std::unique_ptr<WritableFile> base, const Hook* hook)
        : base_(std::move(base)), hook_(hook) {}
    Status WriteAt(uint64_t off, const void* data, size_t n) override {
      CAIRN_RETURN_IF_ERROR((*hook_)(off, n));
      return base_->WriteAt(off, data, n);
    }
    Status Allocate(uint64_t size) override { return base_->Allocate(size); }
    Status Hole(uint64_t off, uint64_t n) override { return base_->Hole(off, n); }
    Status Sync() override { return base_->Sync(); }
    Status Close() override { return base_->Close(); }
    Status Abort() override {
      aborted = true;
      return base_->Abort();
    }
    static inline std::atomic<bool> aborted{false};

   private:
    std::unique_ptr<WritableFile> base_;
    const Hook* hook_;
  };

  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view key,
                                                        const WriteOptions& o) override {
    CAIRN_ASSIGN_OR_RETURN(auto f, StorageWrapper::NewWritableFile(key, o));
    return std::unique_ptr<WritableFile>(new File(std::move(f), &hook_));
  }

 private:
  Hook hook_;
};

TEST(WriteDataFileStagedTest, TargetGetsTheBytesAndChecksumsOfAPlainWrite) {
  // Items of awkward sizes (padding between them, an empty one, a tail).
  std::vector<std::vector<char>> data = {RandomBytes(5 << 20, 1), RandomBytes(4097, 2),
                                         RandomBytes(0, 3), RandomBytes((9 << 20) + 13, 4)};
  std::vector<BufferRef> bufs;
  for (const auto& d : data) bufs.push_back({d.data(), d.size()});
  ThreadPool pool(4), copy_pool(3);
  DataFileOptions opts;
  opts.block_size = 1 << 20;
  opts.sync = false;
  auto plain_target = NewMemStorage();
  auto plain = WriteDataFile(plain_target.get(), "data/r0.bin", bufs, &pool, opts);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();

  TempPosix stage;
  auto target = NewMemStorage();
  CopyFileOptions copy;
  copy.chunk_bytes = 1 << 20;
  auto staged = WriteDataFileStaged(stage.get(), target.get(), "data/r0.bin", bufs, &pool,
                                    &copy_pool, opts, copy);
  ASSERT_TRUE(staged.ok()) << staged.status().ToString();
  EXPECT_EQ(staged->file_size, plain->file_size);
  ASSERT_EQ(staged->items.size(), plain->items.size());
  for (size_t i = 0; i < bufs.size(); ++i) {
    EXPECT_EQ(staged->items[i].offset, plain->items[i].offset) << i;
    EXPECT_EQ(staged->items[i].length, plain->items[i].length) << i;
    EXPECT_EQ(staged->items[i].checksums, plain->items[i].checksums) << i;
  }
  std::string want = ReadAll(plain_target.get(), "data/r0.bin");
  want.resize(plain->file_size, '\0');  // mem storage has no Allocate: pad its tail
  EXPECT_EQ(ReadAll(target.get(), "data/r0.bin"), want);
  EXPECT_EQ(ReadAll(stage.get(), "data/r0.bin"), want);
}

TEST(WriteDataFileStagedTest, UploadStartsBeforeTheLocalWriteEnds) {
  // The staged file's last piece is written only once the target has received
  // its first bytes: a write that staged everything first and then copied
  // would wait here until the deadline and fail.
  std::mutex mu;
  std::condition_variable cv;
  bool target_started = false;
  auto target_base = NewMemStorage();
  HookedStorage target(target_base.get(), [&](uint64_t, size_t) {
    std::lock_guard<std::mutex> l(mu);
    target_started = true;
    cv.notify_all();
    return Status::OK();
  });
  const uint64_t total = 12 << 20;
  TempPosix stage_base;
  HookedStorage stage(stage_base.get(), [&](uint64_t off, size_t n) {
    if (off + n < total) return Status::OK();
    std::unique_lock<std::mutex> l(mu);
    if (!cv.wait_for(l, std::chrono::seconds(20), [&] { return target_started; })) {
      return DeadlineExceededError("the target got nothing while the file was being staged");
    }
    return Status::OK();
  });
  std::vector<char> d = RandomBytes(total, 5);
  ThreadPool pool(1), copy_pool(2);  // one writer: pieces are staged in order
  DataFileOptions opts;
  opts.block_size = 1 << 20;
  CopyFileOptions copy;
  copy.chunk_bytes = 1 << 20;
  auto r = WriteDataFileStaged(&stage, &target, "data/r0.bin", {{d.data(), d.size()}}, &pool,
                               &copy_pool, opts, copy);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(ReadAll(target_base.get(), "data/r0.bin"), std::string(d.begin(), d.end()));
}

TEST(WriteDataFileStagedTest, AFailingTargetFailsTheWriteAndAbortsTheTargetFile) {
  auto target_base = NewMemStorage();
  HookedStorage target(target_base.get(), [](uint64_t off, size_t) {
    return off >= (2 << 20) ? UnavailableError("target went away") : Status::OK();
  });
  TempPosix stage;
  std::vector<char> d = RandomBytes(8 << 20, 6);
  ThreadPool pool(2), copy_pool(2);
  CopyFileOptions copy;
  copy.chunk_bytes = 1 << 20;
  HookedStorage::File::aborted = false;
  auto r = WriteDataFileStaged(stage.get(), &target, "data/r0.bin", {{d.data(), d.size()}}, &pool,
                               &copy_pool, DataFileOptions{}, copy);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  EXPECT_NE(r.status().message().find("target went away"), std::string::npos);
  EXPECT_TRUE(HookedStorage::File::aborted);
}

TEST(WriteDataFileStagedTest, TheCopyPoolMustNotBeTheWritePool) {
  TempPosix stage;
  auto target = NewMemStorage();
  ThreadPool pool(2);
  std::vector<char> d = RandomBytes(1000, 7);
  auto r = WriteDataFileStaged(stage.get(), target.get(), "data/r0.bin", {{d.data(), d.size()}},
                               &pool, &pool);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cairn
