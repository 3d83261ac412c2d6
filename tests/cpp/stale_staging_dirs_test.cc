// Tests of RemoveStaleStagingDirs (staging.h): only a dead process's
// directory whose files nobody locks is removed.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "cairn/staging.h"
#include "scratch_dir.h"

namespace cairn {
namespace {

namespace fs = std::filesystem;

// The pid of a child that has exited and been reaped: no such process now.
pid_t DeadPid() {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  ::waitpid(pid, nullptr, 0);
  return pid;
}

void MakeSlot(const std::string& dir) {
  fs::create_directories(dir + "/slot0/data");
  std::ofstream(dir + "/slot0/data/r0.bin") << "x";
}

TEST(RemoveStaleStagingDirs, RemovesOnlyUnlockedDirectoriesOfDeadProcesses) {
  test_util::ScratchDir tmp("stale");
  const std::string root = tmp.path();
  const std::string dead = "cairn-stager-" + std::to_string(DeadPid());
  MakeSlot(root + "/" + dead + "-aaaa");
  MakeSlot(root + "/" + dead + "-locked");
  MakeSlot(root + "/cairn-stager-" + std::to_string(::getpid()) + "-alive");
  MakeSlot(root + "/cairn-stager-x1-notapid");
  MakeSlot(root + "/other-" + dead.substr(13));
  fs::create_directories(root + "/target");
  fs::create_symlink(root + "/target", root + "/" + dead + "-link");
  // A live pool flocks its slot files: a lock held on another descriptor (as
  // by another process) keeps the directory.
  int fd = ::open((root + "/" + dead + "-locked/slot0/data/r0.bin").c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);

  EXPECT_EQ(RemoveStaleStagingDirs(root, "cairn-stager-"), 1u);
  EXPECT_FALSE(fs::exists(root + "/" + dead + "-aaaa"));
  EXPECT_TRUE(fs::exists(root + "/" + dead + "-locked/slot0/data/r0.bin"));
  EXPECT_TRUE(fs::exists(root + "/cairn-stager-" + std::to_string(::getpid()) + "-alive"));
  EXPECT_TRUE(fs::exists(root + "/cairn-stager-x1-notapid"));
  EXPECT_TRUE(fs::exists(root + "/other-" + dead.substr(13)));
  EXPECT_TRUE(fs::is_symlink(root + "/" + dead + "-link"));
  EXPECT_TRUE(fs::exists(root + "/target"));
  ::close(fd);  // the lock goes with it: now it is a leftover too
  EXPECT_EQ(RemoveStaleStagingDirs(root, "cairn-stager-"), 1u);
  EXPECT_FALSE(fs::exists(root + "/" + dead + "-locked"));
  EXPECT_EQ(RemoveStaleStagingDirs(root + "/missing", "cairn-stager-"), 0u);
}

}  // namespace
}  // namespace cairn
