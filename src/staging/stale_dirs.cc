// RemoveStaleStagingDirs (include/cairn/staging.h): the leftovers of staging
// pools whose process died. Two checks guard a removal: the pid in the name
// is gone, and no file below is flocked, so a directory whose pid was reused
// by a live pool (which locks its slot files) is never removed.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <filesystem>
#include <string>
#include <system_error>

#include "cairn/staging.h"

namespace cairn {
namespace {

namespace fs = std::filesystem;

// Whether no process holds a lock on `path` (also when it cannot be opened:
// a symbolic link, a vanished file). O_NONBLOCK: a FIFO must not block.
bool Unlocked(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return true;
  bool free = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
  ::close(fd);
  return free;
}

// Whether every file below `dir` is unlocked. Directory symlinks are not
// followed; an unreadable directory counts as locked (leave it alone).
bool TreeUnlocked(const std::string& dir) {
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, ec), end;
  if (ec) return false;
  for (; it != end; it.increment(ec)) {
    if (ec) return false;
    if (it->is_directory(ec)) continue;
    if (!Unlocked(it->path().string())) return false;
  }
  return !ec;
}

// The pid in `prefix`<pid>[-...], or -1.
pid_t PidOf(std::string_view name, std::string_view prefix) {
  if (!name.starts_with(prefix)) return -1;
  name.remove_prefix(prefix.size());
  name = name.substr(0, name.find('-'));
  pid_t pid = -1;
  auto [end, ec] = std::from_chars(name.data(), name.data() + name.size(), pid);
  if (name.empty() || ec != std::errc() || end != name.data() + name.size() || pid <= 0) return -1;
  return pid;
}

}  // namespace

size_t RemoveStaleStagingDirs(const std::string& parent, std::string_view prefix) {
  std::error_code ec;
  fs::directory_iterator it(parent, ec), end;
  if (ec) return 0;
  std::vector<std::string> stale;
  for (; it != end; it.increment(ec)) {
    if (ec) break;
    std::string name = it->path().filename().string();
    pid_t pid = PidOf(name, prefix);
    if (pid < 0) continue;
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive, or not ours to signal
    struct stat st;
    std::string path = it->path().string();
    if (::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    stale.push_back(std::move(path));
  }
  size_t removed = 0;
  for (const std::string& path : stale) {
    if (!TreeUnlocked(path)) continue;
    fs::remove_all(path, ec);  // never follows symbolic links
    removed += !ec;
  }
  return removed;
}

}  // namespace cairn
