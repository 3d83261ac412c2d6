// The storage conformance suite: every backend must pass every test here.
// It is the precise contract of include/cairn/storage.h.
//
// Backends: posix (buffered), posix with direct I/O (on the temp
// directory's filesystem, ext4/xfs in CI, so O_DIRECT really runs), shm,
// mem, and the fault-injection wrapper around mem with no rules; and s3 when
// CAIRN_TEST_S3_URI names a bucket (ctest's s3_conformance entry runs this
// binary under tests/s3/moto_server.py --auth, i.e. against a local moto
// server that checks every SigV4 signature).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cairn/fault_injection.h"
#include "cairn/storage.h"
#include "storage/posix/posix_storage.h"

namespace cairn {
namespace {

namespace fs = std::filesystem;

struct Backend {
  std::string name;
  bool direct = false;      // ask for direct I/O on every file
  bool local_tree = false;  // LocalPath() is a real directory (symlink tests)
  // Makes a storage; `scratch` is a fresh directory the backend may use.
  std::function<std::unique_ptr<Storage>(const std::string& scratch, const std::string& id)> make;
  std::function<void(const std::string& id)> cleanup = [](const std::string&) {};
};

void PrintTo(const Backend& b, std::ostream* os) { *os << b.name; }

std::string ShmName(const std::string& id) { return "cairn-conformance-" + id; }

// s3://BUCKET of a test server, or "".
std::string TestS3Uri() {
  const char* v = std::getenv("CAIRN_TEST_S3_URI");
  return v ? v : "";
}

std::vector<Backend> AllBackends() {
  auto posix = [](const std::string& scratch, const std::string&) {
    auto r = NewPosixStorage(scratch + "/root");
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return std::move(r).value();
  };
  std::vector<Backend> out = {
      {"posix", false, true, posix},
      {"posix_direct", true, true, posix},
      // A manager's tier: the root resolved by its path on every call.
      {"posix_follow_root", false, true,
       [](const std::string& scratch, const std::string&) {
         internal::PosixStorageOptions o;
         o.follow_root = true;
         auto r = internal::NewPosixStorage(scratch + "/root", /*create=*/true, o);
         EXPECT_TRUE(r.ok()) << r.status().ToString();
         return std::move(r).value();
       }},
      {"shm", false, true,
       [](const std::string&, const std::string& id) {
         auto r = NewShmStorage(ShmName(id));
         EXPECT_TRUE(r.ok()) << r.status().ToString();
         return std::move(r).value();
       },
       [](const std::string& id) {
         std::error_code ec;
         fs::remove_all(ShmDirectory(ShmName(id)), ec);
       }},
      {"mem", false, false, [](const std::string&, const std::string&) { return NewMemStorage(); }},
      {"fault_mem", false, false,
       [](const std::string&, const std::string&) -> std::unique_ptr<Storage> {
         return std::make_unique<FaultInjectionStorage>(NewMemStorage());
       }},
  };
  if (!TestS3Uri().empty()) {
    // Each test gets its own prefix in the test bucket.
    out.push_back({"s3", false, false,
                   [](const std::string&, const std::string& id) -> std::unique_ptr<Storage> {
                     auto r = OpenStorage(TestS3Uri() + "/conformance-" + id);
                     EXPECT_TRUE(r.ok()) << r.status().ToString();
                     return r.ok() ? std::move(r).value() : nullptr;
                   },
                   [](const std::string& id) {
                     auto r = OpenStorage(TestS3Uri() + "/conformance-" + id);
                     if (r.ok()) (*r)->DeleteDir("").IgnoreError();
                   }});
  }
  return out;
}

class StorageConformanceTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    id_ = std::to_string(::getpid()) + "-" + std::to_string(counter++);
    char tmpl[] = "/tmp/cairn_conformance_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    scratch_ = tmpl;
    store_ = GetParam().make(scratch_, id_);
    ASSERT_NE(store_, nullptr);
  }
  void TearDown() override {
    store_.reset();
    GetParam().cleanup(id_);
    std::error_code ec;
    fs::remove_all(scratch_, ec);
  }

  WriteOptions W() const { return WriteOptions{GetParam().direct}; }
  ReadOptions R() const { return ReadOptions{GetParam().direct}; }

  void Put(const std::string& key, const std::string& data) {
    auto f = store_->NewWritableFile(key, W());
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    ASSERT_TRUE((*f)->WriteAt(0, data.data(), data.size()).ok());
    ASSERT_TRUE((*f)->Sync().ok());
    ASSERT_TRUE((*f)->Close().ok());
  }
  std::string Get(const std::string& key) {
    auto f = store_->NewReadableFile(key, R());
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    if (!f.ok()) return "<error>";
    std::string out((*f)->Size(), '\0');
    Status s = (*f)->ReadAt(0, out.data(), out.size());
    EXPECT_TRUE(s.ok()) << s.ToString();
    return out;
  }
  static std::string Pattern(size_t n, uint32_t seed) {
    std::string s(n, '\0');
    std::mt19937 rng(seed);
    for (auto& c : s) c = static_cast<char>(rng());
    return s;
  }

  std::string id_, scratch_;
  std::unique_ptr<Storage> store_;
};

TEST_P(StorageConformanceTest, WriteThenReadRoundTrips) {
  std::string a = Pattern(1000, 1), b = Pattern(70000, 2);
  auto f = store_->NewWritableFile("dir/sub/file.bin", W());
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_TRUE((*f)->Allocate(a.size() + b.size()).ok());
  ASSERT_TRUE((*f)->WriteAt(a.size(), b.data(), b.size()).ok());  // out of order
  ASSERT_TRUE((*f)->WriteAt(0, a.data(), a.size()).ok());
  ASSERT_TRUE((*f)->Sync().ok());
  ASSERT_TRUE((*f)->Close().ok());
  EXPECT_EQ(Get("dir/sub/file.bin"), a + b);
  auto size = store_->FileSize("dir/sub/file.bin");
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, a.size() + b.size());
  auto r = store_->NewReadableFile("dir/sub/file.bin", R());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)->Size(), a.size() + b.size());
  std::string mid(10, '\0');
  ASSERT_TRUE((*r)->ReadAt(995, mid.data(), 10).ok());
  EXPECT_EQ(mid, (a + b).substr(995, 10));
}

TEST_P(StorageConformanceTest, EmptyFileHasSizeZero) {
  Put("empty", "");
  auto size = store_->FileSize("empty");
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, 0u);
  auto r = store_->NewReadableFile("empty", R());
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE((*r)->ReadAt(0, nullptr, 0).ok());
}

TEST_P(StorageConformanceTest, CreateTruncatesAnExistingFile) {
  Put("f", Pattern(5000, 3));
  Put("f", "short");
  EXPECT_EQ(Get("f"), "short");
}

TEST_P(StorageConformanceTest, ConcurrentDisjointWritesLandInPlace) {
  constexpr int kThreads = 8;
  // Region boundaries deliberately not block aligned.
  constexpr size_t kRegion = (1 << 20) + 4097;
  std::string expect = Pattern(kThreads * kRegion, 4);
  auto f = store_->NewWritableFile("concurrent.bin", W());
  ASSERT_TRUE(f.ok());
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Each thread writes its region in three uneven calls.
      size_t base = t * kRegion, cuts[] = {0, 12345, 700000, kRegion};
      for (int c = 0; c < 3; ++c) {
        if (!(*f)->WriteAt(base + cuts[c], expect.data() + base + cuts[c], cuts[c + 1] - cuts[c])
                 .ok()) {
          ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  ASSERT_TRUE((*f)->Sync().ok());
  ASSERT_TRUE((*f)->Close().ok());
  EXPECT_TRUE(Get("concurrent.bin") == expect);
}

TEST_P(StorageConformanceTest, LargeUnalignedOffsetsLengthsAndBuffers) {
  // Covers the direct-I/O paths: unaligned head and tail, an aligned middle
  // from aligned memory (zero copy) and from unaligned memory (bounce buffer,
  // more than one bounce round), reads the same ways.
  constexpr size_t kLen = (9 << 20) + 12345;
  constexpr uint64_t kOff = 4095;
  std::string data = Pattern(kLen, 5);
  void* raw = nullptr;
  ASSERT_EQ(posix_memalign(&raw, 4096, kLen + 4096), 0);
  std::unique_ptr<char, decltype(&std::free)> mem(static_cast<char*>(raw), &std::free);
  auto f = store_->NewWritableFile("big.bin", W());
  ASSERT_TRUE(f.ok());
  // Unaligned memory at an unaligned offset.
  std::memcpy(mem.get() + 1, data.data(), kLen);
  ASSERT_TRUE((*f)->WriteAt(kOff, mem.get() + 1, kLen).ok());
  // Aligned memory at an aligned offset right after it.
  uint64_t off2 = (kOff + kLen + 4095) / 4096 * 4096;
  std::memcpy(mem.get(), data.data(), kLen);
  ASSERT_TRUE((*f)->WriteAt(off2, mem.get(), kLen).ok());
  ASSERT_TRUE((*f)->Sync().ok());
  ASSERT_TRUE((*f)->Close().ok());
  auto size = store_->FileSize("big.bin");
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, off2 + kLen);

  auto r = store_->NewReadableFile("big.bin", R());
  ASSERT_TRUE(r.ok());
  std::memset(mem.get(), 0, kLen + 4096);
  ASSERT_TRUE((*r)->ReadAt(kOff, mem.get() + 3, kLen).ok());  // unaligned memory
  EXPECT_EQ(std::memcmp(mem.get() + 3, data.data(), kLen), 0);
  std::memset(mem.get(), 0, kLen + 4096);
  ASSERT_TRUE((*r)->ReadAt(off2, mem.get(), kLen).ok());  // aligned, to the end of file
  EXPECT_EQ(std::memcmp(mem.get(), data.data(), kLen), 0);
  // The gap between the two writes reads as zeros.
  std::string gap(off2 - (kOff + kLen), 'x');
  ASSERT_TRUE((*r)->ReadAt(kOff + kLen, gap.data(), gap.size()).ok());
  EXPECT_EQ(gap, std::string(gap.size(), '\0'));
}

TEST_P(StorageConformanceTest, ReadPastEndIsOutOfRange) {
  Put("small", Pattern(100, 6));
  auto r = store_->NewReadableFile("small", R());
  ASSERT_TRUE(r.ok());
  char buf[64];
  EXPECT_EQ((*r)->ReadAt(90, buf, 20).code(), StatusCode::kOutOfRange);
  EXPECT_EQ((*r)->ReadAt(200, buf, 1).code(), StatusCode::kOutOfRange);
  EXPECT_TRUE((*r)->ReadAt(100, buf, 0).ok());
  // A large read (direct path) running past an unaligned end of file.
  std::string big = Pattern((200 << 10) + 5, 7);
  Put("big", big);
  auto rb = store_->NewReadableFile("big", R());
  ASSERT_TRUE(rb.ok());
  std::vector<char> out(300 << 10);
  EXPECT_EQ((*rb)->ReadAt(0, out.data(), out.size()).code(), StatusCode::kOutOfRange);
  EXPECT_EQ((*rb)->ReadAt(4096, out.data(), big.size()).code(), StatusCode::kOutOfRange);
  EXPECT_TRUE((*rb)->ReadAt(4096, out.data(), big.size() - 4096).ok());
  EXPECT_EQ(std::memcmp(out.data(), big.data() + 4096, big.size() - 4096), 0);
}

TEST_P(StorageConformanceTest, MissingThingsAreNotFound) {
  EXPECT_EQ(store_->NewReadableFile("nope", R()).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->NewReadableFile("no/such/dir/f", R()).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->FileSize("nope").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->DeleteFile("nope").code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->Rename("nope", "other").code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->List("nodir").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->SyncDir("nodir").code(), StatusCode::kNotFound);
  auto e = store_->Exists("nope");
  ASSERT_TRUE(e.ok());
  EXPECT_FALSE(*e);
  e = store_->Exists("no/such/dir/f");
  ASSERT_TRUE(e.ok());
  EXPECT_FALSE(*e);
}

TEST_P(StorageConformanceTest, RenameReplacesTargetAtomically) {
  std::string old_data = Pattern(3000, 8), new_data = Pattern(5000, 9);
  Put("target", old_data);
  Put("tmp/target.new", new_data);
  // A reader that opened the old file keeps reading the old bytes.
  auto old_reader = store_->NewReadableFile("target", R());
  ASSERT_TRUE(old_reader.ok());
  ASSERT_TRUE(store_->Rename("tmp/target.new", "target").ok());
  EXPECT_EQ(Get("target"), new_data);
  auto e = store_->Exists("tmp/target.new");
  ASSERT_TRUE(e.ok());
  EXPECT_FALSE(*e);
  std::string seen(old_data.size(), '\0');
  ASSERT_TRUE((*old_reader)->ReadAt(0, seen.data(), seen.size()).ok());
  EXPECT_EQ(seen, old_data);
  ASSERT_TRUE(store_->SyncDir("").ok());
}

TEST_P(StorageConformanceTest, ConcurrentReadersNeverSeeAHalfReplacedFile) {
  constexpr size_t kSize = 64 << 10;
  Put("v", std::string(kSize, 'a'));
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0}, reads{0};
  std::thread reader([&] {
    while (!stop.load()) {
      auto r = store_->NewReadableFile("v", R());
      if (!r.ok()) {
        ++bad;
        continue;
      }
      std::string got((*r)->Size(), '\0');
      if ((*r)->Size() != kSize || !(*r)->ReadAt(0, got.data(), kSize).ok() ||
          got != std::string(kSize, got[0])) {
        ++bad;
      }
      ++reads;
    }
  });
  for (int i = 0; i < 30; ++i) {
    Put("v.tmp", std::string(kSize, static_cast<char>('b' + i % 20)));
    ASSERT_TRUE(store_->Rename("v.tmp", "v").ok());
  }
  while (reads.load() < 5) std::this_thread::yield();
  stop = true;
  reader.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST_P(StorageConformanceTest, RenameMovesADirectory) {
  Put("staging/a", "1");
  Put("staging/sub/b", "22");
  ASSERT_TRUE(store_->Rename("staging", "final").ok());
  EXPECT_EQ(Get("final/a"), "1");
  EXPECT_EQ(Get("final/sub/b"), "22");
  auto e = store_->Exists("staging");
  ASSERT_TRUE(e.ok());
  EXPECT_FALSE(*e);
}

TEST_P(StorageConformanceTest, ListIsSortedWithDirectoriesFlagged) {
  Put("d/b", "bb");
  Put("d/a", "a");
  Put("d/c/x", "xxx");
  ASSERT_TRUE(store_->CreateDir("d/e").ok());
  ASSERT_TRUE(store_->CreateDir("d/e").ok());  // idempotent
  auto l = store_->List("d");
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  ASSERT_EQ(l->size(), 4u);
  EXPECT_EQ((*l)[0].name, "a");
  EXPECT_FALSE((*l)[0].is_dir);
  EXPECT_EQ((*l)[0].size, 1u);
  EXPECT_EQ((*l)[1].name, "b");
  EXPECT_EQ((*l)[1].size, 2u);
  EXPECT_EQ((*l)[2].name, "c");
  EXPECT_TRUE((*l)[2].is_dir);
  EXPECT_EQ((*l)[3].name, "e");
  EXPECT_TRUE((*l)[3].is_dir);
  auto root = store_->List("");
  ASSERT_TRUE(root.ok());
  ASSERT_EQ(root->size(), 1u);
  EXPECT_EQ((*root)[0].name, "d");
  EXPECT_TRUE((*root)[0].is_dir);
  auto empty = store_->List("d/e");
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
  EXPECT_EQ(store_->List("d/a").status().code(), StatusCode::kNotFound);  // a file
}

TEST_P(StorageConformanceTest, DeleteDirIsRecursive) {
  Put("top/x", "1");
  Put("top/y/z/w", "2");
  ASSERT_TRUE(store_->CreateDir("top/empty").ok());
  Put("keep", "3");
  Put("topper", "4");  // shares a prefix with "top"
  ASSERT_TRUE(store_->DeleteDir("top").ok());
  for (const char* k : {"top", "top/x", "top/y/z/w", "top/empty"}) {
    auto e = store_->Exists(k);
    ASSERT_TRUE(e.ok());
    EXPECT_FALSE(*e) << k;
  }
  EXPECT_EQ(Get("keep"), "3");
  EXPECT_EQ(Get("topper"), "4");
  EXPECT_TRUE(store_->DeleteDir("top").ok());  // absent: fine
  ASSERT_TRUE(store_->DeleteDir("").ok());     // empties the root, which stays usable
  auto l = store_->List("");
  ASSERT_TRUE(l.ok());
  EXPECT_TRUE(l->empty());
  Put("again", "5");
  EXPECT_EQ(Get("again"), "5");
}

TEST_P(StorageConformanceTest, DeleteFileRemovesOnlyThatFile) {
  Put("a/1", "1");
  Put("a/2", "2");
  ASSERT_TRUE(store_->DeleteFile("a/1").ok());
  EXPECT_EQ(store_->FileSize("a/1").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(Get("a/2"), "2");
}

TEST_P(StorageConformanceTest, ExistsAndFileSize) {
  Put("dir/file", Pattern(1234, 10));
  for (const char* k : {"", "dir", "dir/file"}) {
    auto e = store_->Exists(k);
    ASSERT_TRUE(e.ok()) << k;
    EXPECT_TRUE(*e) << k;
  }
  auto size = store_->FileSize("dir/file");
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, 1234u);
  EXPECT_FALSE(store_->FileSize("dir").ok());
  EXPECT_FALSE(store_->NewReadableFile("dir", R()).ok());
  EXPECT_FALSE(store_->NewWritableFile("dir", W()).ok());
  EXPECT_FALSE(store_->NewWritableFile("dir/file/below", W()).ok());  // parent is a file
}

TEST_P(StorageConformanceTest, UseAfterCloseFails) {
  auto f = store_->NewWritableFile("closed", W());
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->Close().ok());
  EXPECT_EQ((*f)->WriteAt(0, "x", 1).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*f)->Sync().code(), StatusCode::kFailedPrecondition);
}

TEST_P(StorageConformanceTest, InvalidKeysAreRejectedByEveryMethod) {
  const std::vector<std::string> bad = {
      "..",
      "../x",
      "a/../b",
      "a/..",
      "/abs",
      "/",
      "a//b",
      "a/",
      "./a",
      "a/./b",
      ".",
      "a\\b",
      std::string("a\0b", 3),
      std::string(300, 'x'),
  };
  Put("ok", "1");
  for (const std::string& k : bad) {
    SCOPED_TRACE("key '" + k + "'");
    auto inval = [](const Status& s) { return s.code() == StatusCode::kInvalidArgument; };
    EXPECT_TRUE(inval(store_->NewWritableFile(k, W()).status()));
    EXPECT_TRUE(inval(store_->NewReadableFile(k, R()).status()));
    EXPECT_TRUE(inval(store_->Rename(k, "x")));
    EXPECT_TRUE(inval(store_->Rename("ok", k)));
    EXPECT_TRUE(inval(store_->SyncDir(k)));
    EXPECT_TRUE(inval(store_->CreateDir(k)));
    EXPECT_TRUE(inval(store_->DeleteFile(k)));
    EXPECT_TRUE(inval(store_->DeleteDir(k)));
    EXPECT_TRUE(inval(store_->List(k).status()));
    EXPECT_TRUE(inval(store_->Exists(k).status()));
    EXPECT_TRUE(inval(store_->FileSize(k).status()));
  }
  // The empty key names the root: only directory methods accept it.
  auto inval = [](const Status& s) { return s.code() == StatusCode::kInvalidArgument; };
  EXPECT_TRUE(inval(store_->NewWritableFile("", W()).status()));
  EXPECT_TRUE(inval(store_->NewReadableFile("", R()).status()));
  EXPECT_TRUE(inval(store_->DeleteFile("")));
  EXPECT_TRUE(inval(store_->FileSize("").status()));
  EXPECT_TRUE(inval(store_->Rename("", "x")));
  EXPECT_EQ(Get("ok"), "1");  // nothing was damaged on the way
  if (GetParam().local_tree) {
    // Nothing appeared next to the root either.
    fs::path root(store_->LocalPath());
    EXPECT_FALSE(fs::exists(root.parent_path() / "x"));
  }
}

// Backends with a local directory tree, where symbolic links can be planted.
class LocalTreeConformanceTest : public StorageConformanceTest {};

TEST_P(LocalTreeConformanceTest, SymlinksAreNeverFollowedOutOfTheRoot) {
  fs::path root(store_->LocalPath());
  fs::path outside = fs::path(scratch_) / "outside";
  fs::create_directories(outside / "sub");
  {
    FILE* f = std::fopen((outside / "secret").c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("secret", f);
    std::fclose(f);
  }
  fs::create_directory_symlink(outside, root / "dlink");
  fs::create_symlink(outside / "secret", root / "flink");
  auto secret_intact = [&] {
    std::error_code ec;
    return fs::exists(outside / "secret", ec) && fs::file_size(outside / "secret", ec) == 6;
  };

  EXPECT_FALSE(store_->NewReadableFile("flink", R()).ok());
  EXPECT_FALSE(store_->NewReadableFile("dlink/secret", R()).ok());
  EXPECT_FALSE(store_->NewWritableFile("flink", W()).ok());
  EXPECT_FALSE(store_->NewWritableFile("dlink/new", W()).ok());
  EXPECT_FALSE(store_->NewWritableFile("dlink/sub/new", W()).ok());
  EXPECT_FALSE(store_->FileSize("flink").ok());
  EXPECT_FALSE(store_->FileSize("dlink/secret").ok());
  EXPECT_FALSE(store_->List("dlink").ok());
  EXPECT_FALSE(store_->CreateDir("dlink/made").ok());
  EXPECT_FALSE(store_->SyncDir("dlink").ok());
  EXPECT_FALSE(store_->DeleteFile("dlink/secret").ok());
  Put("mine", "m");
  EXPECT_FALSE(store_->Rename("mine", "dlink/stolen").ok());
  auto e = store_->Exists("dlink/secret");
  EXPECT_TRUE(!e.ok() || !*e);
  for (const char* link : {"dlink", "flink"}) {
    e = store_->Exists(link);  // links are not entries cairn sees
    ASSERT_TRUE(e.ok());
    EXPECT_FALSE(*e) << link;
  }
  // Links are not listed.
  auto l = store_->List("");
  ASSERT_TRUE(l.ok());
  ASSERT_EQ(l->size(), 1u);
  EXPECT_EQ((*l)[0].name, "mine");
  EXPECT_FALSE(fs::exists(outside / "new"));
  EXPECT_FALSE(fs::exists(outside / "made"));
  EXPECT_FALSE(fs::exists(outside / "stolen"));
  EXPECT_TRUE(secret_intact());
  // Deleting removes the links themselves, never what they point to.
  EXPECT_TRUE(store_->DeleteDir("dlink").ok());
  EXPECT_TRUE(store_->DeleteFile("flink").ok());
  EXPECT_FALSE(fs::is_symlink(root / "dlink"));
  EXPECT_FALSE(fs::is_symlink(root / "flink"));
  EXPECT_TRUE(secret_intact());
  EXPECT_TRUE(fs::exists(outside / "sub"));
  // And a recursive delete of the root does not descend through a link.
  fs::create_directory_symlink(outside, root / "dlink2");
  ASSERT_TRUE(store_->DeleteDir("").ok());
  EXPECT_TRUE(secret_intact());
  EXPECT_TRUE(fs::exists(outside / "sub"));
}

INSTANTIATE_TEST_SUITE_P(AllBackends, StorageConformanceTest, ::testing::ValuesIn(AllBackends()),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return info.param.name;
                         });

std::vector<Backend> LocalTreeBackends() {
  std::vector<Backend> out;
  for (auto& b : AllBackends()) {
    if (b.local_tree) out.push_back(b);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(LocalTreeBackends, LocalTreeConformanceTest,
                         ::testing::ValuesIn(LocalTreeBackends()),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return info.param.name;
                         });

// ---- backend-specific behaviour, outside the shared contract ---------------

TEST(OpenStorageTest, PicksTheBackendFromTheUri) {
  auto mem = OpenStorage("mem://");
  ASSERT_TRUE(mem.ok());
  EXPECT_EQ((*mem)->Describe(), "mem://");
  std::string name = "cairn-open-test-" + std::to_string(::getpid());
  auto shm = OpenStorage("shm://" + name);
  ASSERT_TRUE(shm.ok()) << shm.status().ToString();
  EXPECT_EQ((*shm)->Describe(), "shm://" + name);
  EXPECT_EQ((*shm)->LocalPath(), ShmDirectory(name));
  std::error_code ec;
  fs::remove_all(ShmDirectory(name), ec);
  EXPECT_EQ(OpenStorage("s4://bucket").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenStorage("").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenStorage("shm://../etc").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenStorage("/definitely/not/here", /*create=*/false).status().code(),
            StatusCode::kNotFound);
}

}  // namespace
}  // namespace cairn
