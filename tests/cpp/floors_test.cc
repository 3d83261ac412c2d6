// The machine floors (cairn/floors.h): sane figures on a scratch directory,
// and nothing left behind, whatever happens.
#include "cairn/floors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "scratch_dir.h"

namespace cairn {
namespace {

using test_util::ScratchDir;

bool IsEmpty(const std::string& dir) { return std::filesystem::is_empty(dir); }

TEST(MemcpyFloor, TimesOneCopyOfTheRequestedBytes) {
  Result<FloorSample> s = MeasureMemcpyFloor(32u << 20);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->bytes, 32u << 20);
  EXPECT_GT(s->seconds, 0);
  EXPECT_LT(s->seconds, 10);  // 32 MiB at >= 3.4 MB/s, on any loaded machine
}

TEST(MemcpyFloor, RejectsZeroBytes) {
  EXPECT_EQ(MeasureMemcpyFloor(0).status().code(), StatusCode::kInvalidArgument);
}

TEST(DirectIoFloors, RoundUpToWholeBlocksAndRemoveTheirFile) {
  ScratchDir dir("floors");
  DirectIoFloorOptions o;
  o.drop_caches = false;  // a test does not drop the machine's page cache
  Result<DirectIoFloors> f = MeasureDirectIoFloors(dir.path(), 20u << 20, o);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->write.bytes, 2 * kFloorBlockBytes);
  EXPECT_EQ(f->read.bytes, 2 * kFloorBlockBytes);
  EXPECT_GT(f->write.seconds, 0);
  EXPECT_GT(f->read.seconds, 0);
  EXPECT_LT(f->write.seconds, 60);
  EXPECT_LT(f->read.seconds, 60);
  EXPECT_FALSE(f->cold);
  EXPECT_TRUE(IsEmpty(dir.path()));
}

TEST(DirectIoFloors, MoreStreamsThanBlocksStillReadEveryBlockOnce) {
  ScratchDir dir("floors");
  DirectIoFloorOptions o;
  o.drop_caches = false;
  o.read_streams = 5;  // 3 blocks: streams 3 and 4 have nothing to read
  Result<DirectIoFloors> f = MeasureDirectIoFloors(dir.path(), 3 * kFloorBlockBytes, o);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->read.bytes, 3 * kFloorBlockBytes);
  EXPECT_TRUE(IsEmpty(dir.path()));
}

TEST(DirectIoFloors, MissingDirectoryIsNotFound) {
  ScratchDir dir("floors");
  Result<DirectIoFloors> f = MeasureDirectIoFloors(dir.path() + "/absent", 1u << 20);
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound) << f.status().ToString();
  EXPECT_TRUE(IsEmpty(dir.path()));
}

TEST(DirectIoFloors, LeaveNothingOnTmpfsWhetherOrNotItTakesODirect) {
  // tmpfs creates the file before refusing O_DIRECT (older kernels) or accepts
  // it (newer ones): either way the file must be gone afterwards.
  std::error_code ec;
  if (!std::filesystem::is_directory("/dev/shm", ec)) GTEST_SKIP() << "no /dev/shm";
  std::string dir = "/dev/shm/cairn_floors_test_" + std::to_string(::getpid());
  std::filesystem::create_directory(dir);
  DirectIoFloorOptions o;
  o.drop_caches = false;
  Result<DirectIoFloors> f = MeasureDirectIoFloors(dir, 1u << 20, o);
  if (!f.ok()) {
    EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument) << f.status().ToString();
  }
  bool empty = IsEmpty(dir);
  std::filesystem::remove_all(dir, ec);
  EXPECT_TRUE(empty);
}

}  // namespace
}  // namespace cairn
