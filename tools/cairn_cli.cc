// The `cairn` command line tool: inspect, verify, copy and prune checkpoints.
//
//   cairn ls ROOT           checkpoints below ROOT: step, size, complete/partial
//   cairn inspect PATH      tensors, dtypes, shapes, bytes, files of one checkpoint
//   cairn verify PATH       checks every byte; exit 1 naming the culprit if corrupt
//   cairn cp SRC DST        copies a committed checkpoint (dirs or shm:// URIs)
//   cairn prune ROOT -k K   keeps the newest K committed step_<N> checkpoints
//                           (and aborts stale unfinished S3 uploads)
//   cairn rm PATH...        removes checkpoints (e.g. shm://NAME ones), manifest first
//   cairn ls --memory       this node's memory tiers: size, step, run root, owner
//   cairn gc                deletes orphaned memory tiers (memory_commands.cc)
//   cairn floors DIR        this machine's memcpy, O_DIRECT write and parallel
//                           O_DIRECT read floors on DIR (floors_command.cc)
//   cairn drill ROOT        restore drill: loads the newest checkpoint in fresh torch
//                           processes and verifies it (python -m cairn.drill)
//   cairn bench PATH        quick checkpoint benchmark of PATH's storage
//                           (python -m cairn.bench)
//   cairn export CKPT --safetensors DIR   the model's tensors as safetensors files
//                           for serving (python -m cairn.export)
//
// drill, bench and export need torch, so they are Python modules: the CLI execs a Python
// interpreter that can import cairn, the first of (FindPython below):
//   1. $CAIRN_PYTHON when set (an explicit choice: used alone, never passed over);
//   2. the `python3`/`python` next to the path the CLI was run by (a venv's
//      bin/cairn symlink, or `cairn` found on PATH: that venv's interpreter);
//   3. the `python3`/`python` next to this executable itself (pip installs it
//      into the venv's bin/);
//   4. the interpreter it was built for (CMake's Python_EXECUTABLE, baked in as
//      CAIRN_BUILD_PYTHON), so build/cairn works with the venv inactive;
//   5. `python3` on PATH.
// Each candidate is asked (a quick `-c`, importing nothing) whether it finds the
// `cairn` and `torch` packages; the error lists every candidate and why it was
// passed over. Their arguments are passed through unchanged.
//
// PATH/ROOT are directories, file://DIR, shm://NAME or s3://BUCKET/PREFIX. Exit codes: 0 ok,
// 1 corruption or failure, 2 usage or not found.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "cairn/checkpoint.h"
#include "cairn/memory_tier.h"
#include "floors_command.h"
#include "memory_commands.h"

namespace {

using cairn::Result;
using cairn::Status;

using cairn::cli::HumanBytes;

int Fail(const Status& s) {
  std::fprintf(stderr, "cairn: %s\n", s.ToString().c_str());
  return s.code() == cairn::StatusCode::kNotFound ? 2 : 1;
}

// Prints "label 42% (1.2 GiB / 3.0 GiB)" on stderr at most every 200 ms, when
// stderr is a terminal or the operation is long.
class Progress {
 public:
  explicit Progress(std::string label) : label_(std::move(label)) {}
  ~Progress() { Finish(); }
  // Ends the progress line (call before printing anything else).
  void Finish() {
    std::lock_guard<std::mutex> l(mu_);
    if (printed_) std::fprintf(stderr, "\n");
    printed_ = false;
  }
  void operator()(uint64_t done, uint64_t total) {
    auto now = std::chrono::steady_clock::now();
    // The final update always prints; others skip when a thread is printing.
    std::unique_lock<std::mutex> l(mu_, std::defer_lock);
    if (done >= total) {
      l.lock();
    } else if (!l.try_lock()) {
      return;
    }
    if (done < total && now - last_ < std::chrono::milliseconds(200)) return;
    last_ = now;
    printed_ = true;
    double pct = total ? 100.0 * static_cast<double>(done) / static_cast<double>(total) : 100.0;
    std::fprintf(stderr, "\r%s %5.1f%% (%s / %s)", label_.c_str(), pct, HumanBytes(done).c_str(),
                 HumanBytes(total).c_str());
    std::fflush(stderr);
  }

 private:
  std::string label_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point last_{};
  bool printed_ = false;
};

int CmdLs(const std::string& root) {
  auto storage = cairn::OpenStorage(root, /*create=*/false);
  if (!storage.ok()) return Fail(storage.status());
  auto list = cairn::ListCheckpoints(storage->get(), "");
  if (!list.ok()) return Fail(list.status());
  std::printf("%-24s %10s %12s %6s  %s\n", "NAME", "STEP", "SIZE", "RANKS", "STATE");
  for (const auto& c : *list) {
    std::string step = c.step ? std::to_string(*c.step) : "-";
    std::string state = c.committed ? "complete" : "partial";
    if (!c.committed && c.status.code() != cairn::StatusCode::kNotFound) {
      state += " (" + c.status.ToString() + ")";
    }
    std::printf("%-24s %10s %12s %6s  %s\n", c.name.c_str(), step.c_str(),
                HumanBytes(c.bytes).c_str(),
                c.committed ? std::to_string(c.world_size).c_str() : "-", state.c_str());
  }
  return 0;
}

int CmdInspect(const std::string& path, bool as_json) {
  auto storage = cairn::OpenStorage(path, /*create=*/false);
  if (!storage.ok()) return Fail(storage.status());
  auto m = cairn::ReadManifest(storage->get(), "");
  if (!m.ok()) return Fail(m.status());
  if (as_json) {
    auto j = cairn::ManifestToJson(*m);
    if (!j.ok()) return Fail(j.status());
    std::printf("%s\n", nlohmann::json::parse(*j).dump(2).c_str());
    return 0;
  }
  std::printf("checkpoint  %s\n", storage->get()->Describe().c_str());
  std::printf("format      v%u, %s per %s block\n", m->version,
              std::string(cairn::format::kChecksumAlgorithm).c_str(),
              HumanBytes(m->block_size).c_str());
  std::printf("ranks       %llu\n", static_cast<unsigned long long>(m->world_size));
  std::printf("size        %s in %zu files, %zu tensors, %zu other items\n",
              HumanBytes(m->TotalBytes()).c_str(), m->files.size(), m->tensors.size(),
              m->bytes.size());
  std::printf("\nFILES\n");
  for (const auto& f : m->files) {
    std::printf("  %-28s %12s\n", f.key.c_str(), HumanBytes(f.size).c_str());
  }
  std::printf("\nTENSORS\n  %-48s %-10s %-20s %10s %s\n", "NAME", "DTYPE", "SHAPE", "BYTES",
              "CHUNKS (file)");
  for (const auto& t : m->tensors) {
    std::string shape = "[";
    for (size_t i = 0; i < t.shape.size(); ++i) {
      shape += (i ? ", " : "") + std::to_string(t.shape[i]);
    }
    shape += "]";
    uint64_t bytes = 0;
    std::string where;
    for (const auto& c : t.chunks) {
      bytes += c.location.length;
      std::string key = m->files.empty() ? "-" : m->files[c.location.file].key;
      if (where.find(key) == std::string::npos) where += (where.empty() ? "" : ",") + key;
    }
    std::printf("  %-48s %-10s %-20s %10s %zu (%s)\n", t.fqn.c_str(), t.dtype.c_str(),
                shape.c_str(), HumanBytes(bytes).c_str(), t.chunks.size(), where.c_str());
  }
  if (!m->bytes.empty()) {
    std::printf("\nOTHER ITEMS\n");
    for (const auto& b : m->bytes) {
      std::printf("  %-48s %10s (%s)\n", b.fqn.c_str(), HumanBytes(b.location.length).c_str(),
                  m->files[b.location.file].key.c_str());
    }
  }
  return 0;
}

int CmdVerify(const std::string& path, size_t threads) {
  auto storage = cairn::OpenStorage(path, /*create=*/false);
  if (!storage.ok()) return Fail(storage.status());
  cairn::ThreadPool pool(threads);
  Progress progress("verifying");
  Status s =
      cairn::Verify(storage->get(), "", &pool, [&](uint64_t d, uint64_t t) { progress(d, t); });
  progress.Finish();  // the error starts a line of its own
  if (!s.ok()) {
    // Not a cairn checkpoint (a root of them, a stock one): a usage error.
    int rc = Fail(s);
    return s.code() == cairn::StatusCode::kInvalidArgument ? 2 : rc;
  }
  std::printf("OK: %s\n", storage->get()->Describe().c_str());
  return 0;
}

int CmdCp(const std::string& src, const std::string& dst, size_t threads, bool verify) {
  cairn::ThreadPool pool(threads);
  cairn::CopyOptions opts;
  opts.verify_destination = verify;
  if (dst.rfind("shm://", 0) == 0) opts.sync = false;
  Progress progress("copying");
  auto start = std::chrono::steady_clock::now();
  // CopyCheckpointUri refuses a destination that is, holds or lies in the
  // source before anything is created or changed.
  Status s = cairn::CopyCheckpointUri(
      src, dst, &pool, [&](uint64_t d, uint64_t t) { progress(d, t); }, opts);
  progress.Finish();
  if (!s.ok()) return Fail(s);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("copied %s to %s in %.2f s\n", src.c_str(), dst.c_str(), secs);
  return 0;
}

int CmdPrune(const std::string& root, uint64_t keep, bool partials, bool dry_run,
             double stale_uploads_s) {
  auto storage = cairn::OpenStorage(root, /*create=*/false);
  if (!storage.ok()) return Fail(storage.status());
  cairn::PruneOptions opts;
  opts.keep = keep;
  opts.remove_newer_partials = partials;
  opts.dry_run = dry_run;
  opts.stale_upload_age_s = stale_uploads_s;
  std::vector<std::string> removed;
  Status s = cairn::Prune(storage->get(), "", opts, &removed);
  for (const auto& name : removed) {
    std::printf("%s %s\n", dry_run ? "would remove" : "removed", name.c_str());
  }
  if (!s.ok()) return Fail(s);
  if (removed.empty()) std::printf("nothing to remove\n");
  return 0;
}

int CmdRm(const std::vector<std::string>& paths) {
  for (const auto& p : paths) {
    Status s = cairn::RemoveCheckpointUri(p);
    if (!s.ok()) return Fail(s);
    std::printf("removed %s\n", p.c_str());
  }
  return 0;
}

// Whether `python` runs and finds the cairn and torch packages (importing
// neither, so it is quick): "" when it does, else why not.
std::string ProbePython(const std::string& python) {
  if (python.find('/') != std::string::npos && access(python.c_str(), X_OK) != 0) {
    return std::strerror(errno);
  }
  std::vector<std::string> args = {
      python, "-c",
      "import importlib.util as u, sys\n"
      "sys.exit(3 if u.find_spec('cairn') is None else 4 if u.find_spec('torch') is None else 0)"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  pid_t pid = -1;
  int err = posix_spawnp(&pid, python.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (err != 0) return std::strerror(err);
  int st = 0;
  while (waitpid(pid, &st, 0) < 0) {
    if (errno != EINTR) return std::strerror(errno);
  }
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return "";
  if (WIFEXITED(st) && WEXITSTATUS(st) == 3) return "no module named 'cairn'";
  if (WIFEXITED(st) && WEXITSTATUS(st) == 4) return "finds cairn but not torch";
  if (WIFEXITED(st) && WEXITSTATUS(st) == 127) return "not found";
  return "does not run (exit status " + std::to_string(WIFEXITED(st) ? WEXITSTATUS(st) : -1) + ")";
}

std::string DirName(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// The path `name` (argv[0] without a slash) was found at on PATH, or "".
std::string WhichOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return "";
  std::string p = path;
  for (size_t start = 0; start <= p.size();) {
    size_t colon = p.find(':', start);
    if (colon == std::string::npos) colon = p.size();
    std::string dir = p.substr(start, colon - start);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
    start = colon + 1;
  }
  return "";
}

// The interpreter to run cairn's Python modules with (see the header comment),
// or an error naming every candidate tried and why it was passed over.
Result<std::string> FindPython(const char* argv0) {
  std::vector<std::string> tried;
  auto attempt = [&](const std::string& python, const std::string& from) -> bool {
    std::string why = ProbePython(python);
    if (why.empty()) return true;
    tried.push_back(python + " (" + from + "): " + why);
    return false;
  };
  if (const char* env = std::getenv("CAIRN_PYTHON"); env != nullptr && *env != '\0') {
    if (attempt(env, "$CAIRN_PYTHON")) return std::string(env);
    return cairn::NotFoundError("$CAIRN_PYTHON=" + std::string(env) +
                                " cannot run cairn: " + tried.back() +
                                "; point it at the python of the environment cairn is "
                                "installed in, or unset it");
  }
  std::vector<std::pair<std::string, std::string>> candidates;
  auto add_dir = [&](const std::string& dir, const std::string& from) {
    for (const char* name : {"python3", "python"}) {
      std::string p = dir + "/" + name;
      if (access(p.c_str(), F_OK) == 0) {
        candidates.emplace_back(p, from);
        return;
      }
    }
    tried.push_back(dir + "/python3 (" + from + "): not there");
  };
  std::string invoked = argv0 != nullptr ? argv0 : "";
  if (invoked.find('/') == std::string::npos && !invoked.empty()) invoked = WhichOnPath(invoked);
  if (!invoked.empty()) add_dir(DirName(invoked), "next to " + invoked);
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    std::string exe(self, static_cast<size_t>(n));
    if (DirName(exe) != DirName(invoked)) add_dir(DirName(exe), "next to " + exe);
  }
#ifdef CAIRN_BUILD_PYTHON
  candidates.emplace_back(CAIRN_BUILD_PYTHON, "the Python this CLI was built for");
#endif
  candidates.emplace_back("python3", "on PATH");
  for (const auto& [python, from] : candidates) {
    if (attempt(python, from)) return python;
  }
  std::string msg = "no Python that can import cairn; tried $CAIRN_PYTHON (unset)";
  for (const auto& t : tried) msg += ", " + t;
  return cairn::NotFoundError(msg +
                              ". Set CAIRN_PYTHON to the python of the environment cairn is "
                              "installed in (or run `python -m cairn.<command>` there)");
}

// Replaces this process with `PYTHON -m MODULE ARGS...` (see the header comment).
int ExecPythonModule(const char* argv0, const std::string& module,
                     const std::vector<std::string>& args) {
  auto python = FindPython(argv0);
  if (!python.ok()) {
    std::fprintf(stderr, "cairn %s: %s\n", module.substr(module.find('.') + 1).c_str(),
                 python.status().message().c_str());
    return 2;
  }
  std::vector<std::string> all = {*python, "-m", module};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (auto& a : all) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  execvp(python->c_str(), cargv.data());
  std::fprintf(stderr, "cairn: cannot run %s -m %s: %s (set CAIRN_PYTHON)\n", python->c_str(),
               module.c_str(), std::strerror(errno));
  return 2;
}

}  // namespace

static int Main(int argc, char** argv) {
  // drill, bench and export are Python modules: everything after the subcommand is theirs.
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "drill" || a == "bench" || a == "export") {
      return ExecPythonModule(argv[0], "cairn." + a,
                              std::vector<std::string>(argv + i + 1, argv + argc));
    }
    if (a.empty() || a[0] != '-') break;  // another subcommand
    if (a == "-j" || a == "--threads") ++i;
  }
  CLI::App app{
      "cairn: inspect, verify, copy and prune cairn checkpoints; drill and bench (Python)"};
  app.require_subcommand(1);
  // Listed for --help only: main() hands them to Python before parsing.
  app.add_subcommand("drill", "restore drill in fresh processes (cairn drill --help)")
      ->allow_extras();
  app.add_subcommand("bench", "quick checkpoint benchmark of a storage (cairn bench --help)")
      ->allow_extras();
  app.add_subcommand("export", "a checkpoint's model as safetensors (cairn export --help)")
      ->allow_extras();
  size_t threads = cairn::DefaultThreadCount(cairn::PoolKind::kIo);
  app.add_option("-j,--threads", threads, "I/O threads")->check(CLI::Range(1, 256));

  std::string root, path, src, dst;
  bool as_json = false, verify_dst = false;
  auto* ls = app.add_subcommand("ls", "list checkpoints below ROOT (step, size, state)");
  auto* ls_root =
      ls->add_option("ROOT", root, "directory, file://DIR, shm://NAME or s3://BUCKET/PREFIX");
  cairn::cli::MemoryCommandOptions mem;
  mem.grace_seconds = cairn::kDefaultOrphanGraceSeconds;
  bool ls_memory = false;
  ls->add_flag("--memory", ls_memory, "list this node's memory tiers and replicas instead")
      ->excludes(ls_root);
  auto* gc = app.add_subcommand("gc", "delete this node's orphaned memory tiers");
  gc->add_option("--grace", mem.grace_seconds,
                 "seconds a tier whose owner died is kept for a restart to restore it")
      ->check(CLI::NonNegativeNumber);
  gc->add_flag("-n,--dry-run", mem.dry_run, "only list what would be removed");
  for (auto* cmd : {ls, gc}) {
    cmd->add_option("--shm-root", mem.shm_root, "where node shared memory is (default /dev/shm)");
  }
  ls->add_flag("--json", mem.as_json, "with --memory: print the tiers as JSON");
  auto* inspect = app.add_subcommand("inspect", "show the tensors and files of a checkpoint");
  inspect->add_option("PATH", path, "checkpoint directory or URI")->required();
  inspect->add_flag("--json", as_json, "print the manifest body as JSON");
  auto* verify = app.add_subcommand("verify", "check every byte of a checkpoint");
  verify->add_option("PATH", path, "checkpoint directory or URI")->required();
  auto* cp = app.add_subcommand("cp", "copy a committed checkpoint (manifest written last)");
  cp->add_option("SRC", src, "source checkpoint")->required();
  cp->add_option("DST", dst, "destination directory or URI")->required();
  cp->add_flag("--verify", verify_dst, "re-read and verify the destination before committing");
  uint64_t keep = 1;
  bool partials = false, dry_run = false;
  auto* prune = app.add_subcommand("prune", "keep the newest K committed step_<N> checkpoints");
  prune->add_option("ROOT", root, "directory, file://DIR, shm://NAME or s3://BUCKET/PREFIX")
      ->required();
  prune->add_option("-k,--keep", keep, "committed checkpoints to keep")
      ->required()
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 40));
  prune->add_flag("--partial", partials,
                  "also remove partial checkpoints newer than the newest committed one");
  prune->add_flag("-n,--dry-run", dry_run, "only list what would be removed");
  double stale_uploads_s = 3600;
  prune->add_option("--stale-uploads", stale_uploads_s,
                    "abort unfinished uploads (s3) older than this many seconds; -1: never");

  std::vector<std::string> rm_paths;
  auto* rm = app.add_subcommand(
      "rm", "remove checkpoints (committed or partial), e.g. shm://NAME ones: manifest first");
  rm->add_option("PATH", rm_paths, "checkpoint directories or URIs (not a root: see prune)")
      ->required();

  cairn::cli::FloorsCommandOptions fl;
  uint64_t floor_mb = fl.bytes >> 20;
  bool no_drop = false;
  auto* floors = app.add_subcommand(
      "floors", "memcpy, O_DIRECT write and parallel O_DIRECT read floors on a local directory");
  floors->add_option("DIR", fl.path, "local directory (or file://DIR) on the disk to measure")
      ->required();
  floors->add_option("--size-mb", floor_mb, "MiB per floor (default 1024)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 24));
  floors->add_option("--reps", fl.reps, "repetitions, medians (default 3)")
      ->check(CLI::Range(1, 1000));
  floors->add_flag("--json", fl.as_json, "print the figures as JSON");
  floors->add_flag("--no-drop-caches", no_drop, "do not drop the page cache before reads");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (*ls && ls_memory) return cairn::cli::CmdLsMemory(mem);
  if (*ls && root.empty()) {
    std::fprintf(stderr, "cairn ls: ROOT or --memory is required\n");
    return 2;
  }
  if (*ls) return CmdLs(root);
  if (*gc) return cairn::cli::CmdGc(mem);
  if (*inspect) return CmdInspect(path, as_json);
  if (*verify) return CmdVerify(path, threads);
  if (*cp) return CmdCp(src, dst, threads, verify_dst);
  if (*floors) {
    fl.bytes = floor_mb << 20;
    fl.drop_caches = !no_drop;
    return cairn::cli::CmdFloors(fl);
  }
  if (*rm) return CmdRm(rm_paths);
  if (*prune) return CmdPrune(root, keep, partials, dry_run, stale_uploads_s);
  return 2;
}

// An exception that escapes a command (a thread the system refuses to start, an
// allocation that fails) becomes an error message and exit 1, never an abort.
int main(int argc, char** argv) {
  try {
    return Main(argc, argv);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "cairn: error: %s\n", e.what());
  } catch (...) {
    std::fflush(stdout);
    std::fprintf(stderr, "cairn: error: an unknown exception\n");
  }
  return 1;
}
