// The restore drill's orchestration (see cairn/drill.h): worker processes
// started with posix_spawn, waited for with a pidfd (a poll with a timeout),
// killed together when the drill runs out of time.
#include "cairn/drill.h"

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cairn/checkpoint.h"

extern char** environ;

namespace cairn {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// A fresh private directory, removed with what it holds.
struct TempDir {
  std::string path;
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    path = std::string(tmp && *tmp ? tmp : "/tmp") + "/cairn-drill-XXXXXX";
    if (::mkdtemp(path.data()) == nullptr) path.clear();
  }
  ~TempDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
};

// Waits up to `seconds` for `pid` to exit: its exit code as Popen reports it
// (negative: killed by that signal), or nullopt on timeout.
std::optional<int> WaitFor(pid_t pid, double seconds) {
  int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  const auto until = Clock::now() + std::chrono::duration<double>(seconds);
  std::optional<int> code;
  while (true) {
    int st = 0;
    pid_t r = ::waitpid(pid, &st, WNOHANG);
    if (r == pid) {
      code = WIFSIGNALED(st) ? -WTERMSIG(st) : WEXITSTATUS(st);
      break;
    }
    if (r < 0 && errno != EINTR) {
      code = -1;
      break;
    }
    double left = std::chrono::duration<double>(until - Clock::now()).count();
    if (left <= 0) break;
    if (fd >= 0) {
      pollfd p{fd, POLLIN, 0};
      ::poll(&p, 1, static_cast<int>(std::min(left * 1000 + 1, double{INT_MAX})));
    } else {  // no pidfd (an old kernel): look again shortly
      ::usleep(static_cast<useconds_t>(std::min(left, 0.05) * 1e6));
    }
  }
  if (fd >= 0) ::close(fd);
  return code;
}

// The environment of a worker: ours, with OMP_NUM_THREADS 1 unless set.
std::vector<std::string> WorkerEnv() {
  std::vector<std::string> env;
  bool omp = false;
  for (char** e = environ; *e != nullptr; ++e) {
    env.emplace_back(*e);
    omp = omp || env.back().rfind("OMP_NUM_THREADS=", 0) == 0;
  }
  if (!omp) env.emplace_back("OMP_NUM_THREADS=1");
  return env;
}

Result<pid_t> Spawn(const std::vector<std::string>& args, const std::vector<std::string>& env) {
  std::vector<char*> argv, envp;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  argv.push_back(nullptr);
  envp.push_back(nullptr);
  pid_t pid = 0;
  int err = ::posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), envp.data());
  if (err != 0) return ErrnoToStatus(err, "starting a drill worker (" + args[0] + ")");
  return pid;
}

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.0f", s);
  return buf;
}

}  // namespace

Result<DrillReport> RunDrill(std::string_view root, std::string_view tier, std::string_view local,
                             const DrillOptions& opts) {
  const auto t0 = Clock::now();
  DrillReport rep;
  CAIRN_ASSIGN_OR_RETURN(DrillPick pick, PickDrillCheckpoint(root, tier, local));
  rep.skipped = std::move(pick.skipped);
  if (pick.uri.empty()) {
    rep.failure = pick.why;
    return rep;
  }
  const std::string uri = rep.checkpoint = pick.uri;
  rep.tier = pick.source;
  rep.world_size = opts.world_size;
  {
    auto storage = OpenStorage(uri, /*create=*/false);
    if (!storage.ok()) {
      if (storage.status().code() == StatusCode::kNotFound) {
        return NotFoundError("no such checkpoint: " + uri);
      }
      return storage.status();
    }
    CAIRN_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(storage->get(), ""));
    CAIRN_RETURN_IF_ERROR(reader->CheckFiles());
    rep.saved_world_size = reader->manifest().world_size;
  }

  TempDir tmp;
  if (tmp.path.empty()) return ErrnoToStatus(errno, "creating the drill's temporary directory");
  const std::string store = tmp.path + "/store";
  const std::vector<std::string> env = WorkerEnv();
  std::vector<pid_t> pids;
  std::vector<std::string> outs;
  auto kill_all = [&] {
    for (pid_t p : pids) ::kill(p, SIGKILL);
    for (pid_t p : pids) WaitFor(p, 1e9);
  };
  for (uint32_t rank = 0; rank < opts.world_size; ++rank) {
    outs.push_back(tmp.path + "/rank" + std::to_string(rank) + ".json");
    auto pid = Spawn({opts.python, "-m", "cairn.drill", "--_worker", uri, std::to_string(rank),
                      std::to_string(opts.world_size), store, outs.back()},
                     env);
    if (!pid.ok()) {
      kill_all();
      return pid.status();
    }
    pids.push_back(*pid);
  }
  const auto deadline = Clock::now() + std::chrono::duration<double>(opts.timeout_s);
  std::vector<int> codes;
  for (pid_t p : pids) {
    double left = std::chrono::duration<double>(deadline - Clock::now()).count();
    std::optional<int> code = WaitFor(p, std::max(1.0, left));
    if (!code) {
      kill_all();
      rep.failure = uri + ": the drill did not finish within " + Seconds(opts.timeout_s) + "s";
      return rep;
    }
    codes.push_back(*code);
  }
  std::vector<json> results;
  for (uint32_t rank = 0; rank < opts.world_size; ++rank) {
    std::ifstream in(outs[rank]);
    json r = in ? json::parse(in, nullptr, false) : json();
    if (!r.is_object()) {
      rep.failure = uri + ": drill rank " + std::to_string(rank) + " died (exit code " +
                    std::to_string(codes[rank]) + ")";
      return rep;
    }
    results.push_back(std::move(r));
  }
  for (const json& r : results) {
    if (!r.value("ok", false)) {
      rep.failure = "cannot restore " + uri + ": rank " + std::to_string(r.value("rank", 0)) +
                    ": " + r.value("error", std::string("unknown error"));
      return rep;
    }
  }
  rep.processes_s = Since(t0);
  rep.tensors = results[0].value("tensors", uint64_t{0});
  rep.bytes = results[0].value("bytes", uint64_t{0});
  for (const json& r : results) rep.load_s = std::max(rep.load_s, r.value("load_s", 0.0));
  if (opts.verify) {
    const auto v0 = Clock::now();
    auto storage = OpenStorage(uri, /*create=*/false);
    Status s = storage.ok() ? Verify(storage->get(), "", opts.pool) : storage.status();
    if (!s.ok()) {
      rep.failure = "cannot restore " + uri + ": " + s.message();
      return rep;
    }
    rep.verify_s = Since(v0);
  }
  rep.total_s = Since(t0);
  return rep;
}

}  // namespace cairn
