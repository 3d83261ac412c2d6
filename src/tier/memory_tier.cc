// Memory-tier bookkeeping, the orphan decision and reclaiming (the layout and
// the rules are described in include/cairn/memory_tier.h).
//
// Reclaim protocol, per tier with a lock file:
//   1. open <tier>/cairn.lock and try flock(LOCK_EX | LOCK_NB): failure means
//      a live owner holds its shared lock: the tier is in use, stop;
//   2. holding the exclusive lock, read the metadata and decide;
//   3. if orphaned: delete everything but the lock file, then unlink the lock
//      file, then rmdir the tier, and only then drop the lock.
// An owner acquiring a lease (MemoryTierLease::Acquire) opens the lock file,
// takes the shared lock (waiting while a reclaimer holds it) and then checks
// that the file it locked is still the one named <tier>/cairn.lock; if the
// reclaimer unlinked it meanwhile, it starts over with a fresh directory.
#include "cairn/memory_tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "cairn/checkpoint.h"
#include "cairn/storage.h"
#include "storage/posix/posix_storage.h"

namespace cairn {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr std::string_view kTierFile = "cairn.tier";
constexpr std::string_view kLockFile = "cairn.lock";
constexpr std::string_view kOwnersDir = "owners";
constexpr std::string_view kRunIdFile = "cairn.run";  // in the run root (manager.py)
constexpr std::string_view kStagerPrefix = "cairn-stager-";

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double MtimeSeconds(const struct stat& st) {
  return static_cast<double>(st.st_mtim.tv_sec) + 1e-9 * static_cast<double>(st.st_mtim.tv_nsec);
}

std::string ReadSmallFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

std::string BootId() { return Trim(ReadSmallFile("/proc/sys/kernel/random/boot_id")); }

std::string HostName() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

// Field 22 of /proc/<pid>/stat (start time in clock ticks since boot); 0 when
// the process does not exist.
uint64_t ProcessStartTime(int64_t pid) {
  std::string stat = ReadSmallFile("/proc/" + std::to_string(pid) + "/stat");
  size_t paren = stat.rfind(')');  // the command name may contain spaces
  if (paren == std::string::npos) return 0;
  std::istringstream in(stat.substr(paren + 2));
  std::string field;
  // Fields after the name start at 3 (state); start time is 22.
  for (int i = 3; i <= 22 && (in >> field); ++i) {
    if (i == 22) return std::strtoull(field.c_str(), nullptr, 10);
  }
  return 0;
}

// Writes `body` to `path` atomically (temp file in the same directory, rename).
Status WriteFileAtomic(const std::string& path, const std::string& body) {
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return ErrnoToStatus(errno, "create " + tmp);
  const char* p = body.data();
  size_t left = body.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return ErrnoToStatus(err, "write " + tmp);
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoToStatus(err, "rename " + tmp);
  }
  return Status::OK();
}

json ReadJson(const std::string& path) {
  std::string body = ReadSmallFile(path);
  if (body.empty()) return json::object();
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  return j.is_object() ? j : json::object();
}

template <typename T>
T Get(const json& j, const char* key, T fallback) {
  auto it = j.find(key);
  if (it == j.end()) return fallback;
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    return fallback;
  }
}

// True if some process holds a flock on `path`, probed with a non-blocking
// exclusive lock (owners hold shared locks on a tier's lock file and
// exclusive ones on slot files). The probe holds the lock for an instant: an
// owner taking a lease retries; only a legacy tier's slot file, opened by its
// pool at that very instant, could see "in use".
bool FileLocked(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return false;
  bool locked = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);
  return locked;
}

bool AnyFileLocked(const std::string& dir) {
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_regular_file(ec) && FileLocked(it->path().string())) return true;
  }
  return false;
}

// Newest mtime of anything below `dir` (the directory included).
double NewestMtime(const std::string& dir) {
  double newest = 0;
  struct stat st;
  if (::lstat(dir.c_str(), &st) == 0) newest = MtimeSeconds(st);
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (::lstat(it->path().c_str(), &st) == 0) newest = std::max(newest, MtimeSeconds(st));
  }
  return newest;
}

uint64_t BytesOrZero(const std::string& dir) {
  auto r = AllocatedBytes(dir);
  return r.ok() ? *r : 0;
}

bool IsHex(std::string_view s) {
  return !s.empty() && s.find_first_not_of("0123456789abcdef") == std::string_view::npos;
}

// Is the run root gone? Only local roots (a path or file://) can be judged;
// for any other URI the answer is "no" (kept until the grace period ends).
bool RunRootGone(const std::string& root, const std::string& run_id, std::string* why) {
  std::string path = root;
  if (path.rfind("file://", 0) == 0) path = path.substr(7);
  if (path.empty() || path.front() != '/') return false;
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno != ENOENT && errno != ENOTDIR) return false;  // unreachable is not gone
    *why = "run root " + root + " is gone";
    return true;
  }
  if (run_id.empty()) return false;
  std::string id_path = path + "/" + std::string(kRunIdFile);
  if (::stat(id_path.c_str(), &st) != 0) {
    if (errno != ENOENT) return false;
    *why = "run root " + root + " no longer holds run " + run_id;
    return true;
  }
  std::string current = Trim(ReadSmallFile(id_path));
  if (current != run_id) {
    *why = "run root " + root + " now belongs to another run";
    return true;
  }
  return false;
}

// Committed steps of the slots of a tier, newest first, and the newest
// manifest's mtime.
void ReadSteps(const std::string& dir, MemoryTierInfo* info) {
  auto storage = internal::NewPosixStorage(dir, /*create=*/false, {});
  if (!storage.ok()) return;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (!it->is_directory(ec)) continue;
    std::string manifest = it->path().string() + "/" + std::string(format::kManifestName);
    struct stat st;
    if (::stat(manifest.c_str(), &st) != 0) continue;
    info->last_active = std::max(info->last_active, MtimeSeconds(st));
    auto m = ReadManifest(storage->get(), name);
    if (!m.ok()) continue;
    json extra = json::parse(m->extra, nullptr, false);
    if (!extra.is_object()) continue;
    auto mgr = extra.find("manager");
    if (mgr == extra.end() || !mgr->is_object()) continue;
    auto step = mgr->find("step");
    if (step != mgr->end() && step->is_number_integer()) {
      info->steps.push_back(step->get<int64_t>());
    }
  }
  std::sort(info->steps.rbegin(), info->steps.rend());
}

void ReadOwners(const std::string& dir, MemoryTierInfo* info) {
  const std::string host = HostName();
  const std::string boot = BootId();
  std::error_code ec;
  std::string owners = dir + "/" + std::string(kOwnersDir);
  for (fs::directory_iterator it(owners, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().extension() != ".json") continue;
    struct stat st;
    if (::lstat(it->path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    json j = ReadJson(it->path().string());
    MemoryTierOwner o;
    o.pid = Get<int64_t>(j, "pid", 0);
    o.start_time = Get<uint64_t>(j, "start_time", 0);
    o.boot_id = Get<std::string>(j, "boot_id", "");
    o.hostname = Get<std::string>(j, "hostname", "");
    o.rank = Get<int64_t>(j, "rank", -1);
    o.heartbeat = MtimeSeconds(st);
    if (o.hostname == host && o.boot_id == boot && o.pid > 0) {
      o.state = ProcessStartTime(o.pid) == o.start_time ? "alive" : "dead";
    } else if (!o.boot_id.empty() && o.hostname == host && o.boot_id != boot) {
      o.state = "dead";  // from an earlier boot of this host
    } else {
      o.state = "unknown";
    }
    info->last_active = std::max(info->last_active, o.heartbeat);
    info->owners.push_back(std::move(o));
  }
  std::sort(info->owners.begin(), info->owners.end(),
            [](const MemoryTierOwner& a, const MemoryTierOwner& b) { return a.rank < b.rank; });
}

// Fills `info` for the tier directory `name`; false if it is not cairn's.
// `lock_fd` >= 0: the caller holds the tier's lock exclusively (no owner).
bool Inspect(const std::string& root, const std::string& name, const MemoryTierScanOptions& opts,
             double now, int held_lock_fd, MemoryTierInfo* info) {
  info->name = name;
  info->path = root + "/" + name;
  struct stat st;
  if (::lstat(info->path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return false;
  const std::string tier_file = info->path + "/" + std::string(kTierFile);
  const std::string lock_file = info->path + "/" + std::string(kLockFile);
  const bool has_lock = ::lstat(lock_file.c_str(), &st) == 0;
  const bool has_meta = ::lstat(tier_file.c_str(), &st) == 0;

  if (name.rfind(kStagerPrefix, 0) == 0) {
    info->kind = "staging";
    std::string rest = name.substr(kStagerPrefix.size());
    std::string pid = rest.substr(0, rest.find('-'));
    if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos) return false;
    MemoryTierOwner o = CurrentProcessOwner();
    o.pid = std::stoll(pid);
    o.start_time = 0;
    o.rank = -1;
    o.heartbeat = 0;
    o.state = (::kill(static_cast<pid_t>(o.pid), 0) == 0 || errno == EPERM) ? "alive" : "dead";
    info->owners.push_back(o);
    info->bytes = BytesOrZero(info->path);
    info->last_active = NewestMtime(info->path);
    info->in_use = o.state == "alive" || AnyFileLocked(info->path);
    info->orphaned = !info->in_use;
    info->reason = info->in_use ? "its process " + pid + " is alive"
                                : "its process " + pid + " is gone (staging is never restored)";
    return true;
  }
  if (!has_meta && !has_lock) {
    // A tier written before the bookkeeping existed: cairn-<16 hex>.
    if (name.size() != 6 + 16 || name.rfind("cairn-", 0) != 0 || !IsHex(name.substr(6))) {
      return false;
    }
    info->kind = "legacy";
  } else {
    json meta = ReadJson(tier_file);
    info->kind = Get<std::string>(meta, "kind", "memory");
    info->run_root = Get<std::string>(meta, "run_root", "");
    info->run_id = Get<std::string>(meta, "run_id", "");
    info->created = Get<double>(meta, "created", 0.0);
    info->last_restored = Get<double>(meta, "last_restored", 0.0);
  }
  info->bytes = BytesOrZero(info->path);
  info->last_active = std::max({info->created, info->last_restored});
  ReadOwners(info->path, info);
  ReadSteps(info->path, info);
  if (info->last_active == 0) info->last_active = NewestMtime(info->path);

  if (held_lock_fd >= 0) {
    info->in_use = false;
  } else if (has_lock) {
    info->in_use = FileLocked(lock_file);
  } else {
    info->in_use = AnyFileLocked(info->path);
  }
  if (info->in_use) {
    info->reason = "held by a live process";
    return true;
  }
  std::string why;
  if (!info->run_root.empty() && RunRootGone(info->run_root, info->run_id, &why)) {
    info->orphaned = true;
    info->reason = why;
    return true;
  }
  double idle = now - info->last_active;
  char buf[160];
  if (idle > opts.grace_seconds) {
    info->orphaned = true;
    std::snprintf(buf, sizeof(buf), "no live owner, not restored for %.0f s (grace period %.0f s)",
                  idle, opts.grace_seconds);
  } else {
    std::snprintf(buf, sizeof(buf), "no live owner for %.0f s, within the grace period of %.0f s",
                  std::max(0.0, idle), opts.grace_seconds);
  }
  info->reason = buf;
  return true;
}

std::string ShmRoot(const MemoryTierScanOptions& opts) {
  return opts.shm_root.empty() ? std::string(kShmRoot) : opts.shm_root;
}

Result<std::vector<std::string>> CandidateNames(const std::string& root) {
  std::vector<std::string> names;
  DIR* d = ::opendir(root.c_str());
  if (!d) return ErrnoToStatus(errno, "listing " + root);
  while (struct dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name.rfind("cairn-", 0) == 0) names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

// Deletes a tier directory whose lock (if any) the caller holds exclusively:
// everything but the lock file first, the lock file, then the directory.
Status RemoveTier(const std::string& path) {
  std::error_code ec;
  Status first;
  for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().filename() == kLockFile) continue;
    std::error_code rm;
    fs::remove_all(it->path(), rm);
    if (rm && first.ok()) first = ErrnoToStatus(rm.value(), "delete " + it->path().string());
  }
  if (ec && first.ok()) first = ErrnoToStatus(ec.value(), "listing " + path);
  std::string lock = path + "/" + std::string(kLockFile);
  if (::unlink(lock.c_str()) != 0 && errno != ENOENT && first.ok()) {
    first = ErrnoToStatus(errno, "delete " + lock);
  }
  // ENOTEMPTY: a new owner started a fresh tier here meanwhile; it keeps it.
  if (::rmdir(path.c_str()) != 0 && errno != ENOENT && errno != ENOTEMPTY && first.ok()) {
    first = ErrnoToStatus(errno, "delete " + path);
  }
  return first;
}

// True if `dir` holds no file but cairn.tier, cairn.lock and owner records.
bool OnlyBookkeeping(const std::string& dir) {
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_directory(ec)) continue;
    fs::path rel = it->path().lexically_relative(dir);
    std::string first = rel.begin()->string();
    if (first == kTierFile || first == kLockFile || first == kOwnersDir) continue;
    return false;
  }
  return !ec;
}

}  // namespace

MemoryTierOwner CurrentProcessOwner() {
  MemoryTierOwner o;
  o.pid = ::getpid();
  o.start_time = ProcessStartTime(o.pid);
  o.boot_id = BootId();
  o.hostname = HostName();
  o.heartbeat = NowSeconds();
  o.state = "alive";
  return o;
}

Result<uint64_t> AllocatedBytes(const std::string& dir) {
  uint64_t total = 0;
  std::error_code ec;
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT) return uint64_t{0};
    return ErrnoToStatus(errno, "stat " + dir);
  }
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (::lstat(it->path().c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      total += static_cast<uint64_t>(st.st_blocks) * 512;
    }
  }
  return total;
}

Result<SharedMemoryRoom> GetSharedMemoryRoom(const std::string& dir) {
  struct statvfs vfs;
  if (::statvfs(dir.c_str(), &vfs) != 0) return ErrnoToStatus(errno, "statvfs " + dir);
  SharedMemoryRoom room;
  room.total = static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize;
  room.free = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  room.mem_available = std::numeric_limits<uint64_t>::max();
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kib;
  std::string unit;
  while (meminfo >> key >> kib) {
    std::getline(meminfo, unit);
    if (key == "MemAvailable:") {
      room.mem_available = kib * 1024;
      break;
    }
  }
  return room;
}

Result<std::vector<MemoryTierInfo>> ListMemoryTiers(const MemoryTierScanOptions& opts) {
  const std::string root = ShmRoot(opts);
  const double now = opts.now > 0 ? opts.now : NowSeconds();
  auto names = CandidateNames(root);
  if (!names.ok()) return names.status();
  std::vector<MemoryTierInfo> out;
  for (const std::string& name : *names) {
    MemoryTierInfo info;
    if (Inspect(root, name, opts, now, -1, &info)) out.push_back(std::move(info));
  }
  return out;
}

Status ReclaimOrphanedMemoryTiers(const MemoryTierScanOptions& opts,
                                  std::vector<MemoryTierInfo>* reclaimed, bool dry_run) {
  const std::string root = ShmRoot(opts);
  const double now = opts.now > 0 ? opts.now : NowSeconds();
  auto names = CandidateNames(root);
  if (!names.ok()) return names.status();
  Status first;
  for (const std::string& name : *names) {
    const std::string path = root + "/" + name;
    const std::string lock = path + "/" + std::string(kLockFile);
    int fd = ::open(lock.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      ::close(fd);  // a live owner holds it
      continue;
    }
    MemoryTierInfo info;
    bool ours = Inspect(root, name, opts, now, fd, &info);
    if (ours && info.orphaned) {
      Status s = dry_run ? Status::OK() : RemoveTier(path);
      if (!s.ok() && first.ok()) first = s.WithContext("reclaiming memory tier " + name);
      if (reclaimed && s.ok()) reclaimed->push_back(std::move(info));
    }
    if (fd >= 0) ::close(fd);
  }
  return first;
}

// ---- MemoryTierLease ---------------------------------------------------------

struct MemoryTierLease::Heartbeat {
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::thread thread;
};

namespace {

json TierMetadata(const MemoryTierLeaseOptions& o, const json& old) {
  json j = old.is_object() ? old : json::object();
  double now = NowSeconds();
  bool same_run = Get<std::string>(j, "run_id", "") == o.run_id;
  j["version"] = 1;
  j["kind"] = o.kind;
  j["run_root"] = o.run_root;
  j["run_id"] = o.run_id;
  if (!same_run || !j.contains("created")) {
    j["created"] = now;
    j["last_restored"] = 0.0;
  }
  return j;
}

// Deletes owner records of this host and boot whose process is gone.
void RemoveDeadOwnerRecords(const std::string& dir) {
  MemoryTierInfo info;
  ReadOwners(dir, &info);
  for (const MemoryTierOwner& o : info.owners) {
    if (o.state != "dead") continue;
    std::string path = dir + "/" + std::string(kOwnersDir) + "/" + o.hostname + "-" +
                       std::to_string(o.pid) + ".json";
    ::unlink(path.c_str());
  }
}

}  // namespace

MemoryTierLease::MemoryTierLease(MemoryTierLeaseOptions opts, int lock_fd, std::string owner_path)
    : opts_(std::move(opts)),
      lock_fd_(lock_fd),
      owner_pid_(::getpid()),
      owner_path_(std::move(owner_path)) {}

MemoryTierLease::~MemoryTierLease() { Release().IgnoreError(); }

Result<std::unique_ptr<MemoryTierLease>> MemoryTierLease::Acquire(MemoryTierLeaseOptions opts) {
  if (opts.dir.empty() || opts.dir.front() != '/') {
    return InvalidArgumentError("memory tier directory must be an absolute path, got '" + opts.dir +
                                "'");
  }
  while (opts.dir.size() > 1 && opts.dir.back() == '/') opts.dir.pop_back();
  const std::string lock = opts.dir + "/" + std::string(kLockFile);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  int fd = -1;
  while (true) {
    CAIRN_RETURN_IF_ERROR(internal::MkdirAll(opts.dir).WithContext("memory tier"));
    fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno != ENOENT) return ErrnoToStatus(errno, "open " + lock);
    if (fd >= 0) {
      if (::flock(fd, LOCK_SH | LOCK_NB) == 0) {
        struct stat mine, named;
        if (::fstat(fd, &mine) == 0 && ::stat(lock.c_str(), &named) == 0 &&
            mine.st_dev == named.st_dev && mine.st_ino == named.st_ino) {
          break;  // locked the live lock file
        }
      } else if (errno != EWOULDBLOCK) {
        int err = errno;
        ::close(fd);
        return ErrnoToStatus(err, "lock " + lock);
      }
      ::close(fd);
      fd = -1;
    }
    // A reclaimer holds (or just removed) the tier.
    if (std::chrono::steady_clock::now() > deadline) {
      return UnavailableError("memory tier " + opts.dir +
                              " stayed locked by a reclaimer (cairn gc) for 30 s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto fail = [&](Status s) {
    ::close(fd);
    return s.WithContext("registering as owner of memory tier " + opts.dir);
  };
  RemoveDeadOwnerRecords(opts.dir);
  const std::string tier_file = opts.dir + "/" + std::string(kTierFile);
  Status s = WriteFileAtomic(tier_file, TierMetadata(opts, ReadJson(tier_file)).dump());
  if (!s.ok()) return fail(s);
  const std::string owners = opts.dir + "/" + std::string(kOwnersDir);
  s = internal::MkdirAll(owners);
  if (!s.ok()) return fail(s);
  MemoryTierOwner me = CurrentProcessOwner();
  json rec = {{"pid", me.pid},
              {"start_time", me.start_time},
              {"boot_id", me.boot_id},
              {"hostname", me.hostname},
              {"rank", opts.rank}};
  std::string owner_path = owners + "/" + me.hostname + "-" + std::to_string(me.pid) + ".json";
  s = WriteFileAtomic(owner_path, rec.dump());
  if (!s.ok()) return fail(s);

  std::unique_ptr<MemoryTierLease> lease(new MemoryTierLease(std::move(opts), fd, owner_path));
  if (lease->opts_.heartbeat_seconds > 0) {
    auto hb = std::make_unique<Heartbeat>();
    Heartbeat* h = hb.get();
    const auto period = std::chrono::duration<double>(lease->opts_.heartbeat_seconds);
    std::string path = lease->owner_path_;
    h->thread = std::thread([h, period, path] {
      std::unique_lock<std::mutex> l(h->mu);
      while (!h->cv.wait_for(l, period, [h] { return h->stop; })) {
        // utimensat on a name that may be gone (the tier was closed): no-op.
        ::utimensat(AT_FDCWD, path.c_str(), nullptr, 0);
      }
    });
    lease->heartbeat_ = std::move(hb);
  }
  return lease;
}

Status MemoryTierLease::MarkRestored() {
  if (lock_fd_ < 0) return FailedPreconditionError("memory tier lease released");
  const std::string tier_file = opts_.dir + "/" + std::string(kTierFile);
  json j = TierMetadata(opts_, ReadJson(tier_file));
  j["last_restored"] = NowSeconds();
  return WriteFileAtomic(tier_file, j.dump()).WithContext("memory tier " + opts_.dir);
}

Status MemoryTierLease::Release(bool remove_if_empty) {
  if (owner_pid_ != ::getpid()) {
    // A forked child: the heartbeat thread and the owner record are the
    // parent's. Leave both (joining a thread of another process would hang).
    (void)heartbeat_.release();
    if (lock_fd_ >= 0) ::close(lock_fd_);
    lock_fd_ = -1;
    return Status::OK();
  }
  if (heartbeat_) {
    {
      std::lock_guard<std::mutex> l(heartbeat_->mu);
      heartbeat_->stop = true;
    }
    heartbeat_->cv.notify_all();
    if (heartbeat_->thread.joinable()) heartbeat_->thread.join();
    heartbeat_.reset();
  }
  Status s;
  if (lock_fd_ >= 0) {
    if (::unlink(owner_path_.c_str()) != 0 && errno != ENOENT) {
      s = ErrnoToStatus(errno, "delete " + owner_path_);
    }
    // The last owner (the shared lock upgrades only when no one else holds
    // it) turns off the lights if nothing but bookkeeping is left.
    if (remove_if_empty && ::flock(lock_fd_, LOCK_EX | LOCK_NB) == 0 &&
        OnlyBookkeeping(opts_.dir)) {
      Status r = RemoveTier(opts_.dir);
      if (s.ok()) s = r;
    }
    ::close(lock_fd_);
    lock_fd_ = -1;
  }
  return s;
}

}  // namespace cairn
