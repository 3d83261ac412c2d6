// include/cairn/worker_lifetime.h. The fork hook runs in a child right after
// fork(), where only async-signal-safe calls are safe: prctl, getppid and kill
// are, and the armed state is read from lock-free atomics.
#include "cairn/worker_lifetime.h"

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <thread>

namespace cairn {
namespace {

[[noreturn]] void Die() {
  ::kill(::getpid(), SIGKILL);
  ::_exit(137);  // not reached
}

std::atomic<pid_t> armed_pid{0};
std::atomic<pthread_t> armed_thread{};

int PidfdOpen(pid_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  errno = ENOSYS;
  return -1;
#endif
}

void Watch(pid_t pid) {
  int fd = PidfdOpen(pid);
  if (fd < 0 && errno == ESRCH) Die();
  if (fd >= 0) {
    pollfd p{fd, POLLIN, 0};
    while (::poll(&p, 1, -1) <= 0) {
    }
    Die();
  }
  for (;;) {  // no pidfds: re-parenting means the trainer died
    if (::getppid() != pid && !ProcessAlive(pid)) Die();
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
}

}  // namespace

bool KillSelfOnParentDeath() { return ::prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) == 0; }

bool ProcessAlive(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

void KillSelfWhenGone(pid_t pid) {
  if (!ProcessAlive(pid)) Die();
  std::thread(Watch, pid).detach();
}

void TieWorkerToTrainer(pid_t trainer) {
  if (::getppid() != trainer) KillSelfOnParentDeath();
  KillSelfWhenGone(trainer);
}

void ArmForkedChildren(pid_t pid) {
  armed_thread.store(pthread_self());
  armed_pid.store(pid);
}

void AfterForkInChild() {
  pid_t pid = armed_pid.load();
  if (pid == 0 || !pthread_equal(pthread_self(), armed_thread.load())) return;
  KillSelfOnParentDeath();
  if (::getppid() != pid) Die();  // the trainer died before prctl: too late for it
}

}  // namespace cairn
