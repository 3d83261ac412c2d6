// PosixStorage: a Storage over a plain directory tree.
//
// Confinement. Every key is resolved below the root one component at a time
// with openat(O_NOFOLLOW | O_DIRECTORY) from a descriptor of the root, and the
// last component is then used with the *at() calls (O_NOFOLLOW,
// AT_SYMLINK_NOFOLLOW). So no call ever follows a symbolic link found inside
// the tree: a link met on the way is reported as kPermissionDenied, a link as
// the last component is deleted or renamed as itself, never through. The root
// itself may be a symlink (the user chose it). Together with ValidateKey()
// this means no key can read or write outside the root.
//
// Direct I/O. With WriteOptions/ReadOptions::direct_io the file gets a second
// descriptor opened with O_DIRECT where the filesystem accepts it (tmpfs and
// some FUSE mounts do not: the file then silently stays buffered). O_DIRECT
// needs the memory, the offset and the length aligned (kDirectAlign covers
// both 512-byte and 4 KiB logical blocks). A call is split in three: the
// unaligned head and tail, each inside one block, go through the buffered
// descriptor; the aligned middle goes through O_DIRECT, straight from/to the
// caller's memory when that is aligned, otherwise through a per-thread
// aligned bounce buffer. Head and tail never share a block with the middle of
// the same call, and disjoint concurrent calls never share a block either
// (two calls touching one block both reach it buffered), so buffered and
// direct writes never overlap. If the kernel still rejects an O_DIRECT call
// (EINVAL), the file falls back to buffered I/O for good.
//
// Non-regular files. A FIFO, socket or device where a file belongs must never
// block or be read: every file is opened with O_NONBLOCK (an open of a FIFO
// would otherwise wait for a writer, or a reader), then fstat'ed, and anything
// but a regular file is refused with kFailedPrecondition "is a FIFO, not a
// regular file" before a byte moves; O_NONBLOCK is then cleared (it means
// nothing for regular files, but is not left behind). Like symlinks, such
// entries are not entries cairn sees: Exists() says false, List() omits them,
// FileSize() refuses them.
//
// errno is translated by ErrnoToStatus (src/status.cc), the one place.
#include "storage/posix/posix_storage.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "storage/unique_fd.h"

namespace cairn {
namespace internal {
namespace {

constexpr size_t kDirectAlign = 4096;
constexpr size_t kBounceSize = 8 << 20;
// Calls smaller than this stay buffered even on a direct file: the syscall
// split costs more than the page cache does.
constexpr size_t kDirectMinBytes = 64 << 10;

// A page-aligned scratch buffer per thread, reused across calls.
char* BounceBuffer() {
  struct Holder {
    void* p = nullptr;
    ~Holder() { std::free(p); }
  };
  thread_local Holder h;
  if (!h.p && posix_memalign(&h.p, kDirectAlign, kBounceSize) != 0) h.p = nullptr;
  return static_cast<char*>(h.p);
}

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kDirectAlign == 0; }

Status PwriteAll(int fd, const char* p, size_t n, uint64_t off, const std::string& name) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(off));
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, "write " + name);
    }
    if (w == 0) return IOError("write " + name + ": wrote 0 bytes");
    p += w;
    n -= static_cast<size_t>(w);
    off += static_cast<uint64_t>(w);
  }
  return Status::OK();
}

// Reads up to n bytes; stores the count read (short only at end of file).
Status PreadUpTo(int fd, char* p, size_t n, uint64_t off, const std::string& name, size_t* got) {
  *got = 0;
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, "read " + name);
    }
    if (r == 0) break;
    p += r;
    n -= static_cast<size_t>(r);
    off += static_cast<uint64_t>(r);
    *got += static_cast<size_t>(r);
  }
  return Status::OK();
}

// What a non-regular, non-directory file is, for messages.
const char* FileKind(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

Status NotRegularError(const std::string& path, mode_t mode) {
  return FailedPreconditionError(path + ": is " + FileKind(mode) +
                                 ", not a regular file (refusing to open it)");
}

// Checks that `fd` (opened with O_NONBLOCK) is a regular file and clears
// O_NONBLOCK. Stores its stat in *st.
Status CheckRegularAndBlock(int fd, const std::string& path, struct stat* st) {
  if (::fstat(fd, st) != 0) return ErrnoToStatus(errno, "stat " + path);
  if (S_ISDIR(st->st_mode)) return InvalidArgumentError(path + ": is a directory");
  if (!S_ISREG(st->st_mode)) return NotRegularError(path, st->st_mode);
  int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
    return ErrnoToStatus(errno, "fcntl " + path);
  }
  return Status::OK();
}

// Opens the second, O_DIRECT descriptor of a file already open as `first`.
// Never blocks, and gives up (returns -1) unless it is the same inode.
UniqueFd OpenDirect(int parent, const std::string& name, int flags, const struct stat& first) {
  UniqueFd dfd(
      ::openat(parent, name.c_str(), flags | O_DIRECT | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC));
  if (dfd.get() < 0) return dfd;
  struct stat st;
  if (::fstat(dfd.get(), &st) != 0 || st.st_dev != first.st_dev || st.st_ino != first.st_ino) {
    return UniqueFd();
  }
  int fl = ::fcntl(dfd.get(), F_GETFL);
  if (fl < 0 || ::fcntl(dfd.get(), F_SETFL, fl & ~O_NONBLOCK) != 0) return UniqueFd();
  return dfd;
}

// A regular file or a directory: what cairn sees of a tree.
bool Visible(mode_t mode) { return S_ISREG(mode) || S_ISDIR(mode); }

Status EndOfFile(const std::string& name, uint64_t offset, size_t missing) {
  return OutOfRangeError("read " + name + ": unexpected end of file at offset " +
                         std::to_string(offset) + " (" + std::to_string(missing) +
                         " bytes missing)");
}

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(std::string path, UniqueFd fd, UniqueFd direct_fd)
      : path_(std::move(path)), fd_(std::move(fd)), direct_fd_(std::move(direct_fd)) {
    direct_ok_.store(direct_fd_.get() >= 0);
  }
  ~PosixWritableFile() override { Close().IgnoreError(); }

  Status WriteAt(uint64_t offset, const void* data, size_t n) override {
    if (fd_.get() < 0) return FailedPreconditionError(path_ + ": write after close");
    const char* p = static_cast<const char*>(data);
    uint64_t start = (offset + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    uint64_t end = offset + n;
    uint64_t aligned_end = end / kDirectAlign * kDirectAlign;
    if (!direct_ok_.load(std::memory_order_relaxed) || n < kDirectMinBytes ||
        aligned_end <= start) {
      return PwriteAll(fd_.get(), p, n, offset, path_);
    }
    if (start > offset)
      CAIRN_RETURN_IF_ERROR(PwriteAll(fd_.get(), p, start - offset, offset, path_));
    CAIRN_RETURN_IF_ERROR(WriteMiddle(p + (start - offset), aligned_end - start, start));
    if (end > aligned_end) {
      CAIRN_RETURN_IF_ERROR(
          PwriteAll(fd_.get(), p + (aligned_end - offset), end - aligned_end, aligned_end, path_));
    }
    return Status::OK();
  }

  Status Allocate(uint64_t size) override {
    if (fd_.get() < 0) return FailedPreconditionError(path_ + ": allocate after close");
    if (size == 0) return Status::OK();
    int rc = ::posix_fallocate(fd_.get(), 0, static_cast<off_t>(size));
    if (rc == 0) return Status::OK();
    if (rc == EOPNOTSUPP || rc == EINVAL) return Status::OK();  // filesystem cannot; fine
    return ErrnoToStatus(rc, "allocate " + std::to_string(size) + " bytes for " + path_);
  }

  Status Sync() override {
    if (fd_.get() < 0) return FailedPreconditionError(path_ + ": sync after close");
    // One fdatasync covers both descriptors: it flushes the inode's dirty
    // pages (buffered head/tail) and the device cache (direct middle).
    if (::fdatasync(fd_.get()) != 0) return ErrnoToStatus(errno, "fsync " + path_);
    return Status::OK();
  }

  Status Close() override {
    Status s;
    if (direct_fd_.get() >= 0 && ::close(direct_fd_.release()) != 0) {
      s = ErrnoToStatus(errno, "close " + path_);
    }
    if (fd_.get() >= 0 && ::close(fd_.release()) != 0 && s.ok()) {
      s = ErrnoToStatus(errno, "close " + path_);
    }
    return s;
  }

 private:
  // Writes an aligned range [off, off+n) through O_DIRECT.
  Status WriteMiddle(const char* p, size_t n, uint64_t off) {
    if (Aligned(p)) return DirectOrBuffered(p, n, off);
    char* bounce = BounceBuffer();
    if (!bounce) return ResourceExhaustedError(path_ + ": cannot allocate a bounce buffer");
    for (size_t done = 0; done < n; done += kBounceSize) {
      size_t len = std::min(kBounceSize, n - done);
      std::memcpy(bounce, p + done, len);
      CAIRN_RETURN_IF_ERROR(DirectOrBuffered(bounce, len, off + done));
    }
    return Status::OK();
  }

  Status DirectOrBuffered(const char* p, size_t n, uint64_t off) {
    if (direct_ok_.load(std::memory_order_relaxed)) {
      Status s = PwriteAll(direct_fd_.get(), p, n, off, path_);
      if (s.ok() || s.sys_errno() != EINVAL) return s;
      // The filesystem takes O_DIRECT at open but not for this write: stay
      // buffered from now on. A partial direct write is simply rewritten.
      direct_ok_.store(false);
    }
    return PwriteAll(fd_.get(), p, n, off, path_);
  }

  std::string path_;
  UniqueFd fd_;
  UniqueFd direct_fd_;
  std::atomic<bool> direct_ok_{false};
};

class PosixReadableFile final : public ReadableFile {
 public:
  PosixReadableFile(std::string path, UniqueFd fd, UniqueFd direct_fd, uint64_t size)
      : path_(std::move(path)), fd_(std::move(fd)), direct_fd_(std::move(direct_fd)), size_(size) {
    direct_ok_.store(direct_fd_.get() >= 0);
  }

  Status ReadAt(uint64_t offset, void* buf, size_t n) const override {
    char* p = static_cast<char*>(buf);
    uint64_t start = (offset + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    uint64_t end = offset + n;
    uint64_t aligned_end = end / kDirectAlign * kDirectAlign;
    if (!direct_ok_.load(std::memory_order_relaxed) || n < kDirectMinBytes ||
        aligned_end <= start) {
      return ReadBuffered(p, n, offset);
    }
    if (start > offset) CAIRN_RETURN_IF_ERROR(ReadBuffered(p, start - offset, offset));
    size_t got = 0;
    CAIRN_RETURN_IF_ERROR(ReadMiddle(p + (start - offset), aligned_end - start, start, &got));
    if (got < aligned_end - start) {
      // End of file inside the middle: report it the buffered way.
      return ReadBuffered(p + (start - offset) + got, end - (start + got), start + got);
    }
    if (end > aligned_end) {
      CAIRN_RETURN_IF_ERROR(
          ReadBuffered(p + (aligned_end - offset), end - aligned_end, aligned_end));
    }
    return Status::OK();
  }

  uint64_t Size() const override { return size_; }

 private:
  Status ReadBuffered(char* p, size_t n, uint64_t off) const {
    size_t got = 0;
    CAIRN_RETURN_IF_ERROR(PreadUpTo(fd_.get(), p, n, off, path_, &got));
    if (got < n) return EndOfFile(path_, off + got, n - got);
    return Status::OK();
  }

  // Reads the aligned range [off, off+n) through O_DIRECT; *got < n only at
  // end of file.
  Status ReadMiddle(char* p, size_t n, uint64_t off, size_t* got) const {
    if (Aligned(p)) return DirectOrBuffered(p, n, off, got);
    char* bounce = BounceBuffer();
    if (!bounce) return ResourceExhaustedError(path_ + ": cannot allocate a bounce buffer");
    *got = 0;
    for (size_t done = 0; done < n; done += kBounceSize) {
      size_t len = std::min(kBounceSize, n - done), g = 0;
      CAIRN_RETURN_IF_ERROR(DirectOrBuffered(bounce, len, off + done, &g));
      std::memcpy(p + done, bounce, g);
      *got += g;
      if (g < len) break;
    }
    return Status::OK();
  }

  Status DirectOrBuffered(char* p, size_t n, uint64_t off, size_t* got) const {
    if (direct_ok_.load(std::memory_order_relaxed)) {
      Status s = PreadUpTo(direct_fd_.get(), p, n, off, path_, got);
      // A direct read that ends at an unaligned end of file returns the
      // bytes up to it; the caller handles the rest.
      if (s.ok() || s.sys_errno() != EINVAL) return s;
      direct_ok_.store(false);
    }
    return PreadUpTo(fd_.get(), p, n, off, path_, got);
  }

  std::string path_;
  UniqueFd fd_;
  UniqueFd direct_fd_;
  mutable std::atomic<bool> direct_ok_{false};
  uint64_t size_;
};

// An O_PATH descriptor of the root directory `root` (symlinks in it followed:
// the user chose it); kNotFound when it is missing or not a directory.
Result<UniqueFd> OpenRootDir(const std::string& root) {
  UniqueFd fd(::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOTDIR) {
      // A file (or a FIFO, ...) where a directory belongs is not a missing one.
      struct stat st;
      if (::stat(root.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) {
        return Status(StatusCode::kNotFound,
                      root + ": is a " + (S_ISREG(st.st_mode) ? "file" : "special file") +
                          ", not a directory",
                      ENOTDIR);
      }
      return Status(StatusCode::kNotFound, root + ": not a directory", ENOTDIR);
    }
    return ErrnoToStatus(errno, "open directory " + root);
  }
  return fd;
}

// Splits "a/b/c" into ("a/b", "c").
std::pair<std::string_view, std::string_view> SplitKey(std::string_view key) {
  size_t slash = key.rfind('/');
  if (slash == std::string_view::npos) return {std::string_view(), key};
  return {key.substr(0, slash), key.substr(slash + 1)};
}

class PosixStorage final : public Storage {
 public:
  PosixStorage(std::string root, UniqueFd root_fd, PosixStorageOptions opts)
      : root_(std::move(root)), root_fd_(std::move(root_fd)), opts_(std::move(opts)) {
    if (opts_.describe.empty()) opts_.describe = root_;
  }

  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view key,
                                                        const WriteOptions& opts) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key));
    auto [dir, leaf] = SplitKey(key);
    CAIRN_ASSIGN_OR_RETURN(UniqueFd parent, OpenDir(dir, /*create=*/true, /*readable=*/false));
    std::string path = Path(key), name(leaf);
    // O_TRUNC is applied only once the file is known to be regular (a
    // truncating open of a FIFO or device must not even start).
    UniqueFd fd(::openat(parent.get(), name.c_str(),
                         O_WRONLY | O_CREAT | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, 0644));
    if (fd.get() < 0) return LeafError(errno, parent.get(), name, "create", path);
    struct stat st;
    CAIRN_RETURN_IF_ERROR(CheckRegularAndBlock(fd.get(), path, &st));
    if (::ftruncate(fd.get(), 0) != 0) return ErrnoToStatus(errno, "truncate " + path);
    UniqueFd dfd;
    if (opts.direct_io && opts_.allow_direct_io) {
      dfd = OpenDirect(parent.get(), name, O_WRONLY, st);
    }
    return std::unique_ptr<WritableFile>(
        new PosixWritableFile(std::move(path), std::move(fd), std::move(dfd)));
  }

  Result<std::unique_ptr<ReadableFile>> NewReadableFile(std::string_view key,
                                                        const ReadOptions& opts) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key));
    auto [dir, leaf] = SplitKey(key);
    CAIRN_ASSIGN_OR_RETURN(UniqueFd parent, OpenDir(dir, false, false));
    std::string path = Path(key), name(leaf);
    UniqueFd fd(
        ::openat(parent.get(), name.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC));
    if (fd.get() < 0) return LeafError(errno, parent.get(), name, "open", path);
    struct stat st;
    CAIRN_RETURN_IF_ERROR(CheckRegularAndBlock(fd.get(), path, &st));
    UniqueFd dfd;
    if (opts.direct_io && opts_.allow_direct_io) {
      dfd = OpenDirect(parent.get(), name, O_RDONLY, st);
    }
    return std::unique_ptr<ReadableFile>(new PosixReadableFile(
        std::move(path), std::move(fd), std::move(dfd), static_cast<uint64_t>(st.st_size)));
  }

  Status Rename(std::string_view from, std::string_view to) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(from));
    CAIRN_RETURN_IF_ERROR(ValidateKey(to));
    auto [fdir, fleaf] = SplitKey(from);
    auto [tdir, tleaf] = SplitKey(to);
    CAIRN_ASSIGN_OR_RETURN(UniqueFd fparent, OpenDir(fdir, false, false));
    CAIRN_ASSIGN_OR_RETURN(UniqueFd tparent, OpenDir(tdir, true, false));
    std::string a(fleaf), b(tleaf);
    if (::renameat(fparent.get(), a.c_str(), tparent.get(), b.c_str()) != 0) {
      return ErrnoToStatus(errno, "rename " + Path(from) + " to " + Path(to));
    }
    return Status::OK();
  }

  Status SyncDir(std::string_view dir) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    CAIRN_ASSIGN_OR_RETURN(UniqueFd fd, OpenDir(dir, false, /*readable=*/true));
    // Some filesystems (tmpfs, FUSE) reject fsync on directories: there is
    // nothing more durable to ask for, so treat it as success.
    if (::fsync(fd.get()) != 0 && errno != EINVAL && errno != EROFS) {
      return ErrnoToStatus(errno, "fsync " + Path(dir));
    }
    return Status::OK();
  }

  Status CreateDir(std::string_view dir) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    return OpenDir(dir, true, false).status();
  }

  Status DeleteFile(std::string_view key) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key));
    auto [dir, leaf] = SplitKey(key);
    CAIRN_ASSIGN_OR_RETURN(UniqueFd parent, OpenDir(dir, false, false));
    std::string name(leaf);
    if (::unlinkat(parent.get(), name.c_str(), 0) != 0) {
      return ErrnoToStatus(errno, "delete " + Path(key));
    }
    return Status::OK();
  }

  Status DeleteDir(std::string_view dir) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    if (dir.empty()) {
      // The root stays (the storage remains usable); everything in it goes.
      CAIRN_ASSIGN_OR_RETURN(UniqueFd root, OpenDir("", false, true));
      return RemoveChildren(std::move(root), root_);
    }
    auto [parent_key, leaf] = SplitKey(dir);
    Result<UniqueFd> parent = OpenDir(parent_key, false, false);
    if (!parent.ok()) {
      return parent.status().code() == StatusCode::kNotFound ? Status::OK() : parent.status();
    }
    return RemoveTreeAt(parent->get(), std::string(leaf), Path(dir));
  }

  Result<std::vector<DirEntry>> List(std::string_view dir) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    CAIRN_ASSIGN_OR_RETURN(UniqueFd fd, OpenDir(dir, false, true));
    std::string path = Path(dir);
    DIR* d = ::fdopendir(fd.get());
    if (!d) return ErrnoToStatus(errno, "list " + path);
    fd.release();
    std::vector<DirEntry> out;
    errno = 0;
    while (struct dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      struct stat st;
      if (::fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
      // Symlinks are neither followed nor reported: they could point outside
      // the root. FIFOs, sockets and devices are not files cairn can use.
      if (!Visible(st.st_mode)) continue;
      out.push_back(DirEntry{name, S_ISDIR(st.st_mode),
                             S_ISDIR(st.st_mode) ? 0 : static_cast<uint64_t>(st.st_size)});
    }
    ::closedir(d);
    std::sort(out.begin(), out.end());
    return out;
  }

  Result<bool> Exists(std::string_view key) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key, true));
    if (key.empty()) return true;
    auto [dir, leaf] = SplitKey(key);
    Result<UniqueFd> parent = OpenDir(dir, false, false);
    if (!parent.ok()) {
      if (parent.status().code() == StatusCode::kNotFound) return false;
      return parent.status();
    }
    struct stat st;
    std::string name(leaf);
    // A symlink is neither a file nor a directory to cairn (it is never
    // followed, and List does not show it); nor is a FIFO, socket or device.
    if (::fstatat(parent->get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
      return Visible(st.st_mode);
    }
    if (errno == ENOENT || errno == ENOTDIR) return false;
    return ErrnoToStatus(errno, "stat " + Path(key));
  }

  Result<uint64_t> FileSize(std::string_view key) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key));
    auto [dir, leaf] = SplitKey(key);
    CAIRN_ASSIGN_OR_RETURN(UniqueFd parent, OpenDir(dir, false, false));
    struct stat st;
    std::string name(leaf), path = Path(key);
    if (::fstatat(parent.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      return ErrnoToStatus(errno, "stat " + path);
    }
    if (S_ISLNK(st.st_mode)) return SymlinkError(path);
    if (S_ISDIR(st.st_mode)) return InvalidArgumentError(path + ": is a directory");
    if (!S_ISREG(st.st_mode)) return NotRegularError(path, st.st_mode);
    return static_cast<uint64_t>(st.st_size);
  }

  std::string Describe() const override { return opts_.describe; }
  std::string LocalPath() const override { return root_; }

 private:
  std::string Path(std::string_view key) const {
    return key.empty() ? root_ : root_ + "/" + std::string(key);
  }

  static Status SymlinkError(const std::string& path) {
    return PermissionDeniedError(path +
                                 ": is a symbolic link (cairn never follows symbolic links "
                                 "inside a storage root)");
  }

  // Translates the failure of an *at() call on `leaf` in `dirfd`, naming a
  // symlink as such instead of "too many levels of symbolic links".
  static Status LeafError(int err, int dirfd, const std::string& leaf, std::string_view what,
                          const std::string& path) {
    if (err == ELOOP || err == ENOTDIR) {
      struct stat st;
      if (::fstatat(dirfd, leaf.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode)) {
        return SymlinkError(path);
      }
    }
    if (err == ENXIO || err == EOPNOTSUPP || err == ENODEV) {
      // A FIFO without a reader (O_WRONLY | O_NONBLOCK), a socket, a device.
      struct stat st;
      if (::fstatat(dirfd, leaf.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && !Visible(st.st_mode)) {
        return NotRegularError(path, st.st_mode);
      }
    }
    return ErrnoToStatus(err, std::string(what) + " " + path);
  }

  // Opens directory `dir` below the root without following any symlink,
  // creating missing components when `create`. The descriptor is O_PATH
  // unless `readable` (needed for readdir and fsync).
  Result<UniqueFd> OpenDir(std::string_view dir, bool create, bool readable) const {
    const int last_flags = (readable ? O_RDONLY : O_PATH) | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
    UniqueFd cur, root;
    int cur_fd = root_fd_.get();
    if (opts_.follow_root) {
      CAIRN_ASSIGN_OR_RETURN(root, OpenRoot(create));
      cur_fd = root.get();
    }
    size_t pos = 0;
    std::string sofar;
    while (true) {
      size_t slash = dir.find('/', pos);
      bool last = slash == std::string_view::npos;
      std::string comp(dir.substr(pos, last ? std::string_view::npos : slash - pos));
      if (comp.empty()) {  // only for dir == "": the root itself
        UniqueFd fd(::openat(cur_fd, ".", last_flags));
        if (fd.get() < 0) return ErrnoToStatus(errno, "open directory " + root_);
        return fd;
      }
      sofar = sofar.empty() ? comp : sofar + "/" + comp;
      if (create && ::mkdirat(cur_fd, comp.c_str(), 0755) != 0 && errno != EEXIST) {
        return LeafError(errno, cur_fd, comp, "mkdir", Path(sofar));
      }
      int flags = last ? last_flags : (O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      UniqueFd next(::openat(cur_fd, comp.c_str(), flags));
      if (next.get() < 0) return LeafError(errno, cur_fd, comp, "open directory", Path(sofar));
      cur = std::move(next);
      cur_fd = cur.get();
      if (last) return cur;
      pos = slash + 1;
    }
  }

  // follow_root: a descriptor of the root as its path names it now, made
  // first (with its parents) when `create`.
  Result<UniqueFd> OpenRoot(bool create) const {
    Result<UniqueFd> fd = OpenRootDir(root_);
    if (fd.ok() || !create || fd.status().sys_errno() != ENOENT) return fd;
    CAIRN_RETURN_IF_ERROR(MkdirAll(root_));
    return OpenRootDir(root_);
  }

  // Removes every entry of the directory `fd` (owned), never following links.
  static Status RemoveChildren(UniqueFd fd, const std::string& path) {
    DIR* d = ::fdopendir(fd.get());
    if (!d) return ErrnoToStatus(errno, "list " + path);
    int dfd = fd.release();
    std::vector<std::string> names;
    while (struct dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    Status s;
    for (const auto& n : names) {
      s = RemoveTreeAt(dfd, n, path + "/" + n);
      if (!s.ok()) break;
    }
    ::closedir(d);
    return s;
  }

  static Status RemoveTreeAt(int dirfd, const std::string& name, const std::string& path) {
    struct stat st;
    if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) return Status::OK();
      return ErrnoToStatus(errno, "stat " + path);
    }
    if (S_ISDIR(st.st_mode)) {
      UniqueFd fd(::openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      if (fd.get() < 0) {
        if (errno == ENOENT) return Status::OK();
        return ErrnoToStatus(errno, "open directory " + path);
      }
      CAIRN_RETURN_IF_ERROR(RemoveChildren(std::move(fd), path));
      if (::unlinkat(dirfd, name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
        return ErrnoToStatus(errno, "rmdir " + path);
      }
      return Status::OK();
    }
    if (::unlinkat(dirfd, name.c_str(), 0) != 0 && errno != ENOENT) {
      return ErrnoToStatus(errno, "delete " + path);
    }
    return Status::OK();
  }

  std::string root_;
  UniqueFd root_fd_;
  PosixStorageOptions opts_;
};

std::string NormalizeRoot(std::string root) {
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  return root;
}

}  // namespace

Status MkdirAll(const std::string& path) {
  if (path.empty()) return Status::OK();
  std::string cur;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    cur = path.substr(0, pos);
    if (cur.empty()) continue;
    if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoToStatus(errno, "mkdir " + cur);
    }
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return ErrnoToStatus(errno, "stat " + path);
  if (!S_ISDIR(st.st_mode)) return AlreadyExistsError(path + ": exists and is not a directory");
  return Status::OK();
}

Result<std::unique_ptr<Storage>> NewPosixStorage(const std::string& root_dir, bool create,
                                                 const PosixStorageOptions& opts) {
  if (root_dir.empty()) return InvalidArgumentError("empty directory path");
  if (root_dir.find('\0') != std::string::npos) {
    return InvalidArgumentError("directory path contains NUL");
  }
  std::string root = NormalizeRoot(root_dir);
  if (create) CAIRN_RETURN_IF_ERROR(MkdirAll(root));
  if (opts.follow_root) {
    return std::unique_ptr<Storage>(new PosixStorage(root, UniqueFd(), opts));
  }
  CAIRN_ASSIGN_OR_RETURN(UniqueFd fd, OpenRootDir(root));
  return std::unique_ptr<Storage>(new PosixStorage(root, std::move(fd), opts));
}

}  // namespace internal

Result<std::unique_ptr<Storage>> NewPosixStorage(const std::string& root_dir, bool create) {
  return internal::NewPosixStorage(root_dir, create, {});
}

}  // namespace cairn
