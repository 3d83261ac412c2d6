#include "cairn/fault_injection.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace cairn {
namespace {

namespace fs = std::filesystem;
using std::chrono::steady_clock;

class FaultInjectionTest : public ::testing::Test {
 protected:
  FaultInjectionStorage store_{NewMemStorage()};
  FaultInjector& inj() { return store_.injector(); }

  Status Write(const std::string& key, const std::string& data, uint64_t offset = 0) {
    auto f = store_.NewWritableFile(key);
    if (!f.ok()) return f.status();
    Status s = (*f)->WriteAt(offset, data.data(), data.size());
    (*f)->Close().IgnoreError();
    return s;
  }
};

TEST_F(FaultInjectionTest, FailsTheNthMatchingCallWithTheChosenErrno) {
  inj().AddRule({.op = FaultOp::kWrite, .nth = 2, .error = ENOSPC});
  auto f = store_.NewWritableFile("f");
  ASSERT_TRUE(f.ok());
  EXPECT_TRUE((*f)->WriteAt(0, "a", 1).ok());
  Status s = (*f)->WriteAt(1, "b", 1);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.sys_errno(), ENOSPC);
  EXPECT_NE(s.message().find("injected fault: write f"), std::string::npos) << s.message();
  EXPECT_TRUE((*f)->WriteAt(1, "c", 1).ok());  // count = 1: only the 2nd call
  EXPECT_EQ(inj().Injected(), 1u);
}

TEST_F(FaultInjectionTest, CountZeroFailsEveryCallFromTheNth) {
  inj().AddRule({.op = FaultOp::kSync, .nth = 2, .count = 0, .error = EIO});
  auto f = store_.NewWritableFile("f");
  ASSERT_TRUE(f.ok());
  EXPECT_TRUE((*f)->Sync().ok());
  for (int i = 0; i < 5; ++i) EXPECT_EQ((*f)->Sync().code(), StatusCode::kIOError);
}

TEST_F(FaultInjectionTest, KeyFilterSelectsFiles) {
  inj().AddRule({.op = FaultOp::kCreate, .key_contains = "r1.bin", .count = 0, .error = EACCES});
  EXPECT_TRUE(Write("data/r0.bin", "x").ok());
  EXPECT_EQ(Write("data/r1.bin", "x").code(), StatusCode::kPermissionDenied);
  EXPECT_TRUE(Write("data/r2.bin", "x").ok());
}

TEST_F(FaultInjectionTest, ShortWriteLeavesAPartialFile) {
  std::string data(1000, 'z');
  inj().AddRule({.op = FaultOp::kWrite, .error = ENOSPC, .partial_bytes = 100});
  EXPECT_EQ(Write("part", data).code(), StatusCode::kResourceExhausted);
  auto size = store_.FileSize("part");
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, 100u);
}

TEST_F(FaultInjectionTest, RenameMatchesEitherKeyAndNothingMoves) {
  ASSERT_TRUE(Write("m.tmp", "manifest").ok());
  inj().AddRule({.op = FaultOp::kRename, .key_contains = "cairn.manifest", .error = EIO});
  EXPECT_EQ(store_.Rename("m.tmp", "cairn.manifest").code(), StatusCode::kIOError);
  EXPECT_FALSE(*store_.Exists("cairn.manifest"));
  EXPECT_TRUE(store_.Rename("m.tmp", "cairn.manifest").ok());
}

TEST_F(FaultInjectionTest, EveryOperationCanFailAndIsCounted) {
  ASSERT_TRUE(Write("d/f", "abc").ok());
  for (int i = 0; i < kNumFaultOps; ++i) {
    inj().AddRule({.op = static_cast<FaultOp>(i), .error = EIO});
  }
  inj().ResetCounters();
  EXPECT_FALSE(store_.NewWritableFile("d/g").ok());
  EXPECT_FALSE(store_.NewReadableFile("d/f").ok());
  EXPECT_FALSE(store_.Rename("d/f", "d/h").ok());
  EXPECT_FALSE(store_.SyncDir("d").ok());
  EXPECT_FALSE(store_.CreateDir("e").ok());
  EXPECT_FALSE(store_.DeleteFile("d/f").ok());
  EXPECT_FALSE(store_.DeleteDir("d").ok());
  EXPECT_FALSE(store_.List("d").ok());
  EXPECT_FALSE(store_.Exists("d/f").ok());
  EXPECT_FALSE(store_.FileSize("d/f").ok());
  // The file-level rules fire on the second round, once files exist.
  auto w = store_.NewWritableFile("d/g");
  ASSERT_TRUE(w.ok());
  EXPECT_FALSE((*w)->WriteAt(0, "x", 1).ok());
  EXPECT_FALSE((*w)->Allocate(10).ok());
  EXPECT_FALSE((*w)->Sync().ok());
  EXPECT_FALSE((*w)->Close().ok());
  auto r = store_.NewReadableFile("d/f");
  ASSERT_TRUE(r.ok());
  char c;
  EXPECT_FALSE((*r)->ReadAt(0, &c, 1).ok());
  for (int i = 0; i < kNumFaultOps; ++i) {
    FaultOp op = static_cast<FaultOp>(i);
    EXPECT_GE(inj().Calls(op), 1u) << FaultOpName(op);
  }
  EXPECT_EQ(inj().Injected(), static_cast<uint64_t>(kNumFaultOps));
  inj().ClearRules();
  EXPECT_TRUE(store_.Exists("d/f").ok());
}

TEST_F(FaultInjectionTest, EveryMatchingRuleCountsEveryCall) {
  inj().AddRule({.op = FaultOp::kDelete, .nth = 1, .error = EIO});
  inj().AddRule({.op = FaultOp::kDelete, .nth = 2, .error = EACCES});
  ASSERT_TRUE(Write("a", "1").ok());
  EXPECT_EQ(store_.DeleteFile("a").code(), StatusCode::kIOError);
  EXPECT_EQ(store_.DeleteFile("a").code(), StatusCode::kPermissionDenied);
  EXPECT_TRUE(store_.DeleteFile("a").ok());
}

TEST_F(FaultInjectionTest, RemovedRuleNoLongerFires) {
  int id = inj().AddRule({.op = FaultOp::kList, .count = 0});
  EXPECT_FALSE(store_.List("").ok());
  EXPECT_TRUE(inj().RemoveRule(id));
  EXPECT_FALSE(inj().RemoveRule(id));
  EXPECT_TRUE(store_.List("").ok());
}

TEST_F(FaultInjectionTest, InvalidKeysAreRejectedBeforeRules) {
  inj().AddRule({.op = FaultOp::kCreate, .count = 0, .error = ENOSPC});
  EXPECT_EQ(store_.NewWritableFile("../x").status().code(), StatusCode::kInvalidArgument);
}

TEST_F(FaultInjectionTest, LatencyDelaysTheOperation) {
  inj().SetLatency(FaultOp::kExists, std::chrono::milliseconds(30));
  auto t0 = steady_clock::now();
  ASSERT_TRUE(store_.Exists("x").ok());
  EXPECT_GE(steady_clock::now() - t0, std::chrono::milliseconds(30));
}

TEST_F(FaultInjectionTest, BandwidthCapSlowsWrites) {
  inj().SetBandwidth(10 << 20);  // 10 MiB/s
  std::string data(1 << 20, 'b');
  auto t0 = steady_clock::now();
  ASSERT_TRUE(Write("slow", data).ok());
  ASSERT_TRUE(Write("slow2", data).ok());
  // 2 MiB at 10 MiB/s cannot take less than 200 ms.
  EXPECT_GE(steady_clock::now() - t0, std::chrono::milliseconds(195));
}

TEST_F(FaultInjectionTest, OpNamesRoundTrip) {
  for (int i = 0; i < kNumFaultOps; ++i) {
    auto op = ParseFaultOp(FaultOpName(static_cast<FaultOp>(i)));
    ASSERT_TRUE(op.ok());
    EXPECT_EQ(static_cast<int>(*op), i);
  }
  EXPECT_EQ(ParseFaultOp("scribble").status().code(), StatusCode::kInvalidArgument);
}

TEST(FaultInjectionBorrowedTest, WrapsABorrowedBase) {
  auto base = NewMemStorage();
  {
    FaultInjectionStorage wrapped(base.get());
    auto f = wrapped.NewWritableFile("k");
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE((*f)->WriteAt(0, "v", 1).ok());
    ASSERT_TRUE((*f)->Close().ok());
  }
  EXPECT_EQ(*base->FileSize("k"), 1u);  // the base outlives the wrapper
}

TEST(FaultInjectionCrashTest, CrashRuleKillsTheProcessAtThatCall) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        FaultInjectionStorage s(NewMemStorage());
        s.injector().AddRule({.op = FaultOp::kSync, .crash = true});
        auto f = s.NewWritableFile("f");
        if (f.ok()) (*f)->Sync().IgnoreError();
        std::exit(0);  // not reached
      },
      ::testing::KilledBySignal(SIGKILL), "");
}

TEST(FaultWrapTest, WrappersShareTheirBaseAndOneInjector) {
  char tmpl[] = "/tmp/cairn_fault_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  std::string dir = tmpl;
  auto base_r = OpenStorage(dir);
  ASSERT_TRUE(base_r.ok()) << base_r.status().ToString();
  std::shared_ptr<Storage> base = std::move(*base_r);
  auto inj = std::make_shared<FaultInjector>();
  auto a = std::make_shared<FaultInjectionStorage>(base, inj);
  auto b = std::make_shared<FaultInjectionStorage>(base, inj);
  base.reset();  // the wrappers keep it alive
  EXPECT_EQ(a->LocalPath(), dir);
  inj->AddRule({.op = FaultOp::kWrite, .key_contains = "r1", .error = ENOSPC});
  auto f0 = a->NewWritableFile("step_5/data/r0.bin");
  ASSERT_TRUE(f0.ok());
  EXPECT_TRUE((*f0)->WriteAt(0, "ok", 2).ok());
  EXPECT_TRUE((*f0)->Close().ok());
  auto f1 = b->NewWritableFile("step_5/data/r1.bin");
  ASSERT_TRUE(f1.ok());
  EXPECT_EQ((*f1)->WriteAt(0, "no", 2).code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(fs::exists(dir + "/step_5/data/r0.bin"));
  EXPECT_EQ(inj->Calls(FaultOp::kWrite), 2u);  // one count for both wrappers
  EXPECT_EQ(a->NewWritableFile("../etc/x").status().code(), StatusCode::kInvalidArgument);
  // There is no fault:// scheme: a wrapper is made from an open storage.
  EXPECT_EQ(OpenStorage("fault://x/y").status().code(), StatusCode::kInvalidArgument);
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
}  // namespace cairn
