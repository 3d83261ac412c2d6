// Behaviour of the s3 backend beyond the shared conformance suite (which
// also runs against it: storage_conformance_test.cc). These tests need a
// local S3 server: ctest's s3_conformance entry runs them under
// tests/s3/moto_server.py --auth (signature checking on), which sets
// CAIRN_TEST_S3_URI and the AWS_* variables. The default ctest discovery
// leaves them out (TEST_FILTER in CMakeLists.txt).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "cairn/checkpoint.h"
#include "cairn/s3.h"
#include "cairn/storage.h"
#include "cairn/thread_pool.h"

namespace cairn {
namespace {

// Sets an environment variable for the scope (tests run sequentially).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      ::setenv(name_.c_str(), old_.c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

class S3StorageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* uri = std::getenv("CAIRN_TEST_S3_URI");
    ASSERT_NE(uri, nullptr) << "run under tests/s3/moto_server.py (ctest -R s3)";
    static int counter = 0;
    uri_ = std::string(uri) + "/s3test-" + std::to_string(::getpid()) + "-" +
           std::to_string(counter++);
    auto s = OpenStorage(uri_);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(s).value();
  }
  void TearDown() override {
    if (store_) {
      EXPECT_TRUE(store_->DeleteDir("").ok());
      EXPECT_TRUE(store_->AbortStaleUploads("", -10).ok());
    }
  }
  std::string Get(const std::string& key) {
    auto f = store_->NewReadableFile(key);
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    if (!f.ok()) return "<error>";
    std::string out((*f)->Size(), '\0');
    EXPECT_TRUE((*f)->ReadAt(0, out.data(), out.size()).ok());
    return out;
  }
  size_t PendingUploads() {
    size_t n = 0;
    // "Older than -10 s" is every upload: this aborts and counts them all.
    EXPECT_TRUE(store_->AbortStaleUploads("", -10, &n).ok());
    return n;
  }

  std::string uri_;
  std::unique_ptr<Storage> store_;
};

TEST_F(S3StorageTest, WrongSecretIsPermissionDeniedAndNeverPrinted) {
  const std::string wrong = "Wrong+Secret/0123456789abcdefghijklmnopqrstu";
  const std::string real = std::getenv("AWS_SECRET_ACCESS_KEY");
  ScopedEnv env("AWS_SECRET_ACCESS_KEY", wrong.c_str());
  auto s = OpenStorage(uri_);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kPermissionDenied) << s.status().ToString();
  EXPECT_EQ(s.status().message().find(wrong), std::string::npos);
  EXPECT_EQ(s.status().message().find(real), std::string::npos);
  EXPECT_NE(s.status().message().find("SignatureDoesNotMatch"), std::string::npos)
      << s.status().ToString();
}

TEST_F(S3StorageTest, DescribeShowsNoCredentials) {
  std::string d = store_->Describe();
  EXPECT_EQ(d, uri_);
  EXPECT_EQ(d.find(std::getenv("AWS_ACCESS_KEY_ID")), std::string::npos);
  EXPECT_EQ(d.find(std::getenv("AWS_SECRET_ACCESS_KEY")), std::string::npos);
}

TEST_F(S3StorageTest, CredentialsComeFromTheProfileFile) {
  std::string key = std::getenv("AWS_ACCESS_KEY_ID"), secret = std::getenv("AWS_SECRET_ACCESS_KEY");
  std::string path = "/tmp/cairn_s3_credentials_" + std::to_string(::getpid());
  {
    std::ofstream f(path);
    f << "[default]\naws_access_key_id = nope\naws_secret_access_key = nope\n\n"
      << "[ckpt]\naws_access_key_id = " << key << "\naws_secret_access_key=" << secret << "\n";
  }
  ScopedEnv a("AWS_ACCESS_KEY_ID", nullptr), b("AWS_SECRET_ACCESS_KEY", nullptr),
      c("AWS_SHARED_CREDENTIALS_FILE", path.c_str()), d("AWS_PROFILE", "ckpt");
  auto s = OpenStorage(uri_);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  {
    ScopedEnv e("AWS_PROFILE", nullptr);  // "default" holds a wrong key
    EXPECT_EQ(OpenStorage(uri_).status().code(), StatusCode::kPermissionDenied);
  }
  std::remove(path.c_str());
}

TEST_F(S3StorageTest, PutAtomicIfAbsentLetsOnlyTheFirstWriterCommit) {
  ASSERT_TRUE(store_->PutAtomic("step_1/cairn.manifest", "first", true).ok());
  Status s = store_->PutAtomic("step_1/cairn.manifest", "second", true);
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists) << s.ToString();
  EXPECT_EQ(Get("step_1/cairn.manifest"), "first");
  ASSERT_TRUE(store_->PutAtomic("step_1/cairn.manifest", "third", false).ok());
  EXPECT_EQ(Get("step_1/cairn.manifest"), "third");
}

TEST_F(S3StorageTest, AbortedFileLeavesNoObjectAndNoUpload) {
  std::string part(8 << 20, 'p');
  auto f = store_->NewWritableFile("big.bin");
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->Allocate(3 * part.size()).ok());
  ASSERT_TRUE((*f)->WriteAt(0, part.data(), part.size()).ok());  // a full part: sent now
  ASSERT_TRUE((*f)->Abort().ok());
  auto e = store_->Exists("big.bin");
  ASSERT_TRUE(e.ok());
  EXPECT_FALSE(*e);
  EXPECT_EQ(PendingUploads(), 0u);
  EXPECT_EQ((*f)->WriteAt(part.size(), part.data(), 1).code(), StatusCode::kFailedPrecondition);
}

TEST_F(S3StorageTest, PruneAbortsUploadsOfKilledSaves) {
  std::string part(8 << 20, 'k');
  // A killed process never closes or aborts its file: leak one that has
  // sent a part.
  auto leak_upload = [&] {
    auto f = store_->NewWritableFile("step_1/data/r0.bin");
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE((*f)->WriteAt(0, part.data(), part.size()).ok());
    (void)f->release();
  };
  PruneOptions opts;
  opts.keep = 1;
  std::vector<std::string> removed;
  leak_upload();
  opts.stale_upload_age_s = -1;  // never
  ASSERT_TRUE(Prune(store_.get(), "", opts, &removed).ok());
  EXPECT_EQ(PendingUploads(), 1u);
  // (moto reports every upload as initiated in 2010, so the age cut-off
  // itself cannot be checked here: any age >= 0 aborts them.)
  leak_upload();
  opts.stale_upload_age_s = 0;
  ASSERT_TRUE(Prune(store_.get(), "", opts, &removed).ok());
  EXPECT_EQ(PendingUploads(), 0u);
}

TEST_F(S3StorageTest, CheckpointOfManyPartsRoundTripsAndCorruptionIsDetected) {
  ThreadPool pool(4);
  std::vector<float> big((20 << 20) / 4 + 123), small(1000);
  std::mt19937 rng(7);
  for (auto& v : big) v = static_cast<float>(rng());
  for (auto& v : small) v = static_cast<float>(rng());
  std::vector<NamedBuffer> bufs = {{"big", "float32", {big.size()}, big.data()},
                                   {"small", "float32", {small.size()}, small.data()}};
  ASSERT_TRUE(SaveBuffers(store_.get(), "step_5", bufs, &pool).ok());
  EXPECT_EQ(PendingUploads(), 0u);
  auto loaded = LoadBuffers(store_.get(), "step_5", &pool);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ASSERT_EQ(loaded->size(), 2u);
  EXPECT_EQ(std::memcmp((*loaded)[0].data.data(), big.data(), big.size() * 4), 0);
  EXPECT_EQ(std::memcmp((*loaded)[1].data.data(), small.data(), small.size() * 4), 0);
  ASSERT_TRUE(Verify(store_.get(), "step_5", &pool).ok());
  auto latest = LatestValid(store_.get(), "");
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(latest->value_or(""), "step_5");

  // Flip one byte in the middle of the data object.
  std::string data = Get("step_5/data/r0.bin");
  data[data.size() / 2] ^= 1;
  auto f = store_->NewWritableFile("step_5/data/r0.bin");
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->WriteAt(0, data.data(), data.size()).ok());
  ASSERT_TRUE((*f)->Close().ok());
  EXPECT_EQ(Verify(store_.get(), "step_5", &pool).code(), StatusCode::kDataLoss);
}

TEST_F(S3StorageTest, ReaderOfAReplacedObjectFailsInsteadOfMixingVersions) {
  std::string a(3 << 20, 'a'), b(3 << 20, 'b');
  auto put = [&](const std::string& data) {
    auto f = store_->NewWritableFile("obj");
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE((*f)->WriteAt(0, data.data(), data.size()).ok());
    ASSERT_TRUE((*f)->Close().ok());
  };
  put(a);
  auto r = store_->NewReadableFile("obj");
  ASSERT_TRUE(r.ok());
  put(b);
  std::string got(a.size(), '\0');
  Status s = (*r)->ReadAt(0, got.data(), got.size());  // past the prefetched head
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
}

TEST(S3OpenTest, BadUrisAreInvalidArguments) {
  EXPECT_EQ(OpenStorage("s3://").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenStorage("s3://bucket/../x").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenStorage("s3://bu cket/x").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cairn
