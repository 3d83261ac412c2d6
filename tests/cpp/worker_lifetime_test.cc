// Worker lifetime (cairn/worker_lifetime.h): a worker dies with its trainer,
// and the fork hook sets the parent-death signal only while armed.
#include "cairn/worker_lifetime.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

namespace cairn {
namespace {

// Waits up to `seconds` for `pid` to end; its wait status, or -1 on timeout
// (the child is then killed and reaped).
int WaitFor(pid_t pid, double seconds) {
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  int status = 0;
  while (std::chrono::steady_clock::now() < end) {
    if (::waitpid(pid, &status, WNOHANG) == pid) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return -1;
}

TEST(WorkerLifetime, ProcessAliveSeesThisProcessAndNotAReapedOne) {
  EXPECT_TRUE(ProcessAlive(::getpid()));
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  int status;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_FALSE(ProcessAlive(child));
}

TEST(WorkerLifetime, WorkerIsKilledSoonAfterItsTrainer) {
  pid_t trainer = ::fork();
  if (trainer == 0) {
    ::pause();
    ::_exit(0);
  }
  ASSERT_GT(trainer, 0);
  pid_t worker = ::fork();
  if (worker == 0) {
    KillSelfWhenGone(trainer);
    ::sleep(30);
    ::_exit(0);  // only when the watchdog failed
  }
  ASSERT_GT(worker, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(::waitpid(worker, nullptr, WNOHANG), 0) << "the worker died with its trainer alive";
  ::kill(trainer, SIGKILL);
  ASSERT_EQ(::waitpid(trainer, nullptr, 0), trainer);
  int status = WaitFor(worker, 10);
  ASSERT_NE(status, -1) << "the worker outlived its trainer by 10 s";
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
}

TEST(WorkerLifetime, WorkerOfAnAlreadyGoneTrainerDiesAtOnce) {
  pid_t gone = ::fork();
  if (gone == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(gone, nullptr, 0), gone);
  pid_t worker = ::fork();
  if (worker == 0) {
    KillSelfWhenGone(gone);
    ::_exit(0);
  }
  int status = WaitFor(worker, 10);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
}

// A child that runs the fork hook, then exits with the parent-death signal it
// was given (0: none).
pid_t ForkReportingDeathSignal() {
  pid_t pid = ::fork();
  if (pid == 0) {
    AfterForkInChild();
    int sig = 0;
    ::prctl(PR_GET_PDEATHSIG, &sig, 0, 0, 0);
    ::_exit(sig);
  }
  return pid;
}

TEST(WorkerLifetime, ForkHookSetsTheDeathSignalOnlyWhileArmed) {
  ArmForkedChildren(::getpid());
  pid_t armed = ForkReportingDeathSignal();
  ArmForkedChildren(0);
  pid_t disarmed = ForkReportingDeathSignal();
  int a = WaitFor(armed, 10), d = WaitFor(disarmed, 10);
  ASSERT_TRUE(WIFEXITED(a) && WIFEXITED(d)) << a << " " << d;
  EXPECT_EQ(WEXITSTATUS(a), SIGKILL);
  EXPECT_EQ(WEXITSTATUS(d), 0);
}

TEST(WorkerLifetime, ForkHookIgnoresChildrenOfOtherThreads) {
  ArmForkedChildren(::getpid());
  pid_t other = -1;
  std::thread([&] { other = ForkReportingDeathSignal(); }).join();
  ArmForkedChildren(0);
  int s = WaitFor(other, 10);
  ASSERT_TRUE(WIFEXITED(s)) << s;
  EXPECT_EQ(WEXITSTATUS(s), 0);
}

}  // namespace
}  // namespace cairn
