// PosixStorage: a Storage over a plain directory tree.
//
// Direct I/O: when WriteOptions::direct_io is set, the file is opened with
// O_DIRECT where the filesystem accepts it (tmpfs and some FUSE mounts do
// not; then the file silently falls back to buffered I/O). O_DIRECT needs the
// buffer, offset and length aligned to the logical block size; a write that
// is not aligned (typically the unaligned tail of a file, or a caller buffer
// from malloc) goes through a page-aligned bounce buffer, and a final partial
// block is written through a second, buffered descriptor, so callers never see
// the alignment rules.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "cairn/storage.h"

namespace cairn {
namespace {

constexpr size_t kDirectAlign = 4096;
constexpr size_t kBounceSize = 8 << 20;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

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

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(std::string path, int fd, int direct_fd)
      : path_(std::move(path)), fd_(fd), direct_fd_(direct_fd) {}
  ~PosixWritableFile() override { Close().IgnoreError(); }

  Status WriteAt(uint64_t offset, const void* data, size_t n) override {
    if (fd_ < 0) return FailedPreconditionError(path_ + ": write after close");
    const char* p = static_cast<const char*>(data);
    if (direct_fd_ < 0) return PwriteAll(fd_, p, n, offset, path_);
    // Direct path: unaligned head and tail go buffered; the aligned middle
    // goes through O_DIRECT, straight from the caller's memory when it is
    // aligned, otherwise through a bounce buffer.
    uint64_t aligned_start = (offset + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    uint64_t end = offset + n;
    uint64_t aligned_end = end / kDirectAlign * kDirectAlign;
    if (aligned_end <= aligned_start) return PwriteAll(fd_, p, n, offset, path_);
    if (aligned_start > offset) {
      CAIRN_RETURN_IF_ERROR(PwriteAll(fd_, p, aligned_start - offset, offset, path_));
    }
    const char* mid = p + (aligned_start - offset);
    size_t mid_len = aligned_end - aligned_start;
    if (reinterpret_cast<uintptr_t>(mid) % kDirectAlign == 0) {
      CAIRN_RETURN_IF_ERROR(PwriteAll(direct_fd_, mid, mid_len, aligned_start, path_));
    } else {
      void* raw = nullptr;
      size_t bsz = std::min(kBounceSize, mid_len);
      if (posix_memalign(&raw, kDirectAlign, bsz) != 0) {
        return ResourceExhaustedError(path_ + ": cannot allocate bounce buffer");
      }
      std::unique_ptr<void, FreeDeleter> bounce(raw);
      for (size_t done = 0; done < mid_len; done += bsz) {
        size_t len = std::min(bsz, mid_len - done);
        std::memcpy(raw, mid + done, len);
        CAIRN_RETURN_IF_ERROR(
            PwriteAll(direct_fd_, static_cast<char*>(raw), len, aligned_start + done, path_));
      }
    }
    if (end > aligned_end) {
      CAIRN_RETURN_IF_ERROR(
          PwriteAll(fd_, p + (aligned_end - offset), end - aligned_end, aligned_end, path_));
    }
    return Status::OK();
  }

  Status Allocate(uint64_t size) override {
    if (fd_ < 0) return FailedPreconditionError(path_ + ": allocate after close");
    if (size == 0) return Status::OK();
    int rc = ::posix_fallocate(fd_, 0, static_cast<off_t>(size));
    if (rc == 0) return Status::OK();
    if (rc == EOPNOTSUPP || rc == EINVAL) return Status::OK();  // filesystem cannot; fine
    return ErrnoToStatus(rc, "allocate " + std::to_string(size) + " bytes for " + path_);
  }

  Status Sync() override {
    if (fd_ < 0) return FailedPreconditionError(path_ + ": sync after close");
    if (::fdatasync(fd_) != 0) return ErrnoToStatus(errno, "fsync " + path_);
    return Status::OK();
  }

  Status Close() override {
    Status s;
    if (direct_fd_ >= 0) {
      if (::close(direct_fd_) != 0) s = ErrnoToStatus(errno, "close " + path_);
      direct_fd_ = -1;
    }
    if (fd_ >= 0) {
      if (::close(fd_) != 0 && s.ok()) s = ErrnoToStatus(errno, "close " + path_);
      fd_ = -1;
    }
    return s;
  }

 private:
  std::string path_;
  int fd_;
  int direct_fd_;
};

class PosixReadableFile final : public ReadableFile {
 public:
  PosixReadableFile(std::string path, int fd, uint64_t size)
      : path_(std::move(path)), fd_(fd), size_(size) {}
  ~PosixReadableFile() override { ::close(fd_); }

  Status ReadAt(uint64_t offset, void* buf, size_t n) const override {
    char* p = static_cast<char*>(buf);
    while (n > 0) {
      ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (r < 0) {
        if (errno == EINTR) continue;
        return ErrnoToStatus(errno, "read " + path_);
      }
      if (r == 0) {
        return OutOfRangeError("read " + path_ + ": unexpected end of file at offset " +
                               std::to_string(offset) + " (" + std::to_string(n) +
                               " bytes missing)");
      }
      p += r;
      n -= static_cast<size_t>(r);
      offset += static_cast<uint64_t>(r);
    }
    return Status::OK();
  }
  uint64_t Size() const override { return size_; }

 private:
  std::string path_;
  int fd_;
  uint64_t size_;
};

class PosixStorage final : public Storage {
 public:
  PosixStorage(std::string root, std::string describe)
      : root_(std::move(root)), describe_(std::move(describe)) {}

  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view key,
                                                        const WriteOptions& opts) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key));
    std::string path = Path(key);
    CAIRN_RETURN_IF_ERROR(MkdirAll(path.substr(0, path.rfind('/'))));
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return ErrnoToStatus(errno, "create " + path);
    int dfd = -1;
    if (opts.direct_io) dfd = ::open(path.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
    return std::unique_ptr<WritableFile>(new PosixWritableFile(path, fd, dfd));
  }

  Result<std::unique_ptr<ReadableFile>> NewReadableFile(std::string_view key,
                                                        const ReadOptions&) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key));
    std::string path = Path(key);
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoToStatus(errno, "open " + path);
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      Status s = ErrnoToStatus(errno, "stat " + path);
      ::close(fd);
      return s;
    }
    if (S_ISDIR(st.st_mode)) {
      ::close(fd);
      return InvalidArgumentError(path + ": is a directory");
    }
    return std::unique_ptr<ReadableFile>(
        new PosixReadableFile(path, fd, static_cast<uint64_t>(st.st_size)));
  }

  Status Rename(std::string_view from, std::string_view to) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(from));
    CAIRN_RETURN_IF_ERROR(ValidateKey(to));
    std::string dst = Path(to);
    CAIRN_RETURN_IF_ERROR(MkdirAll(dst.substr(0, dst.rfind('/'))));
    if (::rename(Path(from).c_str(), dst.c_str()) != 0) {
      return ErrnoToStatus(errno, "rename " + Path(from) + " to " + dst);
    }
    return Status::OK();
  }

  Status SyncDir(std::string_view dir) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    std::string path = Path(dir);
    int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ErrnoToStatus(errno, "open directory " + path);
    int rc = ::fsync(fd);
    int err = errno;
    ::close(fd);
    // Some filesystems (tmpfs, FUSE) reject fsync on directories: there is
    // nothing more durable to ask for, so treat it as success.
    if (rc != 0 && err != EINVAL && err != EROFS) return ErrnoToStatus(err, "fsync " + path);
    return Status::OK();
  }

  Status CreateDir(std::string_view dir) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    return MkdirAll(Path(dir));
  }

  Status DeleteFile(std::string_view key) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key));
    std::string path = Path(key);
    if (::unlink(path.c_str()) != 0) return ErrnoToStatus(errno, "delete " + path);
    return Status::OK();
  }

  Status DeleteDir(std::string_view dir) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    return RemoveTree(Path(dir));
  }

  Result<std::vector<DirEntry>> List(std::string_view dir) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    std::string path = Path(dir);
    DIR* d = ::opendir(path.c_str());
    if (!d) return ErrnoToStatus(errno, "list " + path);
    std::vector<DirEntry> out;
    while (struct dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      struct stat st;
      if (::fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
      // Symlinks are neither followed nor reported: they could point outside
      // the root.
      if (S_ISLNK(st.st_mode)) continue;
      out.push_back(DirEntry{name, S_ISDIR(st.st_mode), static_cast<uint64_t>(st.st_size)});
    }
    ::closedir(d);
    std::sort(out.begin(), out.end(),
              [](const DirEntry& a, const DirEntry& b) { return a.name < b.name; });
    return out;
  }

  Result<bool> Exists(std::string_view key) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key, true));
    struct stat st;
    if (::stat(Path(key).c_str(), &st) == 0) return true;
    if (errno == ENOENT || errno == ENOTDIR) return false;
    return ErrnoToStatus(errno, "stat " + Path(key));
  }

  Result<uint64_t> FileSize(std::string_view key) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key));
    struct stat st;
    if (::stat(Path(key).c_str(), &st) != 0) return ErrnoToStatus(errno, "stat " + Path(key));
    if (S_ISDIR(st.st_mode)) return InvalidArgumentError(Path(key) + ": is a directory");
    return static_cast<uint64_t>(st.st_size);
  }

  std::string Describe() const override { return describe_; }
  std::string LocalPath() const override { return root_; }

 private:
  std::string Path(std::string_view key) const {
    return key.empty() ? root_ : root_ + "/" + std::string(key);
  }

  static Status RemoveTree(const std::string& path) {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) {
      if (errno == ENOENT) return Status::OK();
      return ErrnoToStatus(errno, "stat " + path);
    }
    if (S_ISDIR(st.st_mode)) {
      DIR* d = ::opendir(path.c_str());
      if (!d) return ErrnoToStatus(errno, "list " + path);
      std::vector<std::string> names;
      while (struct dirent* e = ::readdir(d)) {
        std::string n = e->d_name;
        if (n != "." && n != "..") names.push_back(n);
      }
      ::closedir(d);
      for (const auto& n : names) CAIRN_RETURN_IF_ERROR(RemoveTree(path + "/" + n));
      if (::rmdir(path.c_str()) != 0 && errno != ENOENT) {
        return ErrnoToStatus(errno, "rmdir " + path);
      }
      return Status::OK();
    }
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return ErrnoToStatus(errno, "delete " + path);
    }
    return Status::OK();
  }

  std::string root_;
  std::string describe_;
};

std::string NormalizeRoot(std::string root) {
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  return root;
}

}  // namespace

Result<std::unique_ptr<Storage>> NewPosixStorage(const std::string& root_dir, bool create) {
  if (root_dir.empty()) return InvalidArgumentError("empty directory path");
  std::string root = NormalizeRoot(root_dir);
  if (create) {
    CAIRN_RETURN_IF_ERROR(MkdirAll(root));
  } else {
    struct stat st;
    if (::stat(root.c_str(), &st) != 0) return ErrnoToStatus(errno, root);
    if (!S_ISDIR(st.st_mode)) return NotFoundError(root + ": not a directory");
  }
  return std::unique_ptr<Storage>(new PosixStorage(root, root));
}

Result<std::unique_ptr<Storage>> NewShmStorage(const std::string& name, bool create) {
  CAIRN_RETURN_IF_ERROR(ValidateKey(name).WithContext("shm:// name"));
  std::string root = "/dev/shm/" + name;
  if (create) {
    CAIRN_RETURN_IF_ERROR(MkdirAll(root));
  } else {
    struct stat st;
    if (::stat(root.c_str(), &st) != 0) return ErrnoToStatus(errno, "shm://" + name);
  }
  return std::unique_ptr<Storage>(new PosixStorage(root, "shm://" + name));
}

Result<std::unique_ptr<Storage>> OpenStorage(std::string_view uri, bool create) {
  constexpr std::string_view kFile = "file://", kShm = "shm://", kMem = "mem://";
  if (uri.substr(0, kShm.size()) == kShm) {
    return NewShmStorage(std::string(uri.substr(kShm.size())), create);
  }
  if (uri == kMem) return std::unique_ptr<Storage>(NewMemStorage());
  if (uri.substr(0, kFile.size()) == kFile) uri.remove_prefix(kFile.size());
  if (uri.find("://") != std::string_view::npos) {
    return InvalidArgumentError("unsupported storage URI scheme: " + std::string(uri));
  }
  return NewPosixStorage(std::string(uri), create);
}

}  // namespace cairn
