#include "staging/mapped_file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>

#include "io/parallel.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace cairn::internal {

Result<std::unique_ptr<MappedShmFile>> MappedShmFile::Open(const std::string& path) {
  // O_NONBLOCK: a FIFO planted at the slot's name must not block the open;
  // it is refused below, and the flag is cleared for the regular file.
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoToStatus(errno, "open " + path);
  {
    struct stat st;
    int fl = -1;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (fl = ::fcntl(fd, F_GETFL)) < 0 ||
        ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
      ::close(fd);
      return FailedPreconditionError(path + ": not a regular file");
    }
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return FailedPreconditionError(path +
                                     ": in use by another process (is a second job using "
                                     "the same staging directory and rank?)");
    }
    return ErrnoToStatus(err, "lock " + path);
  }
  std::unique_ptr<MappedShmFile> f(new MappedShmFile(path, fd));
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoToStatus(errno, "stat " + path);
  if (!S_ISREG(st.st_mode)) return FailedPreconditionError(path + ": not a regular file");
  CAIRN_RETURN_IF_ERROR(f->Map(static_cast<uint64_t>(st.st_size)));
  return f;
}

MappedShmFile::~MappedShmFile() { Close(false).IgnoreError(); }

Status MappedShmFile::Map(uint64_t size) {
  if (data_) {
    ::munmap(data_, size_);
    data_ = nullptr;
    size_ = 0;
  }
  if (size == 0) return Status::OK();
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) return ErrnoToStatus(errno, "mmap " + path_);
  // Transparent huge pages where the tmpfs allows them (shmem_enabled=advise):
  // fewer TLB misses during the copy. Harmless when not.
  ::madvise(p, size, MADV_HUGEPAGE);
  data_ = static_cast<char*>(p);
  size_ = size;
  return Status::OK();
}

Status MappedShmFile::Grow(uint64_t min_bytes) {
  if (fd_ < 0) return FailedPreconditionError(path_ + ": closed");
  if (min_bytes <= size_) return Status::OK();
  uint64_t want = (min_bytes + kGrowAlign - 1) / kGrowAlign * kGrowAlign;
  // fallocate reserves the pages now: ENOSPC here instead of SIGBUS later.
  int rc = ::posix_fallocate(fd_, static_cast<off_t>(size_), static_cast<off_t>(want - size_));
  if (rc == EOPNOTSUPP || rc == EINVAL) {
    if (::ftruncate(fd_, static_cast<off_t>(want)) != 0)
      rc = errno;
    else
      rc = 0;
  }
  if (rc != 0) {
    // Give back what a partial fallocate took; the old size stays valid.
    if (::ftruncate(fd_, static_cast<off_t>(size_)) != 0) {
    }
    return ErrnoToStatus(rc, "growing " + path_ + " to " + std::to_string(want) + " bytes");
  }
  return Map(want);
}

Status MappedShmFile::Populate(ThreadPool* pool) {
  if (!data_) return Status::OK();
  // Page-table setup costs ~1 us per 4 KiB page: spread it over threads.
  constexpr uint64_t kChunk = uint64_t{64} << 20;
  const size_t chunks = static_cast<size_t>((size_ + kChunk - 1) / kChunk);
  const long page = ::sysconf(_SC_PAGESIZE);
  std::mutex mu;
  Status first;
  internal::ParallelFor(chunks, pool, 0, [&](size_t i) {
    char* p = data_ + i * kChunk;
    uint64_t n = std::min(kChunk, size_ - i * kChunk);
    if (::madvise(p, n, MADV_POPULATE_WRITE) == 0) return;
    int err = errno;
    if (err == EINVAL) {
      // Kernels before 5.14: touch one byte per page (rewriting its own
      // value, so staged data is kept). The file is fully allocated, so this
      // cannot fault for lack of space.
      volatile char* v = p;
      for (uint64_t off = 0; off < n; off += static_cast<uint64_t>(page)) v[off] = v[off];
      return;
    }
    std::lock_guard<std::mutex> l(mu);
    if (first.ok()) first = ErrnoToStatus(err, "populating " + path_);
  });
  return first;
}

bool MappedShmFile::IsAt(const std::string& path) const {
  struct stat mine, named;
  return fd_ >= 0 && ::fstat(fd_, &mine) == 0 && ::stat(path.c_str(), &named) == 0 &&
         mine.st_dev == named.st_dev && mine.st_ino == named.st_ino;
}

Status MappedShmFile::Unlink() {
  if (fd_ < 0) return Status::OK();
  struct stat mine, named;
  if (::fstat(fd_, &mine) != 0) return ErrnoToStatus(errno, "stat " + path_);
  if (::stat(path_.c_str(), &named) != 0) {
    return errno == ENOENT ? Status::OK() : ErrnoToStatus(errno, "stat " + path_);
  }
  if (mine.st_dev != named.st_dev || mine.st_ino != named.st_ino) return Status::OK();
  if (::unlink(path_.c_str()) != 0 && errno != ENOENT) {
    return ErrnoToStatus(errno, "delete " + path_);
  }
  return Status::OK();
}

Status MappedShmFile::Close(bool unlink) {
  Status s;
  if (data_) {
    if (::munmap(data_, size_) != 0) s = ErrnoToStatus(errno, "munmap " + path_);
    data_ = nullptr;
    size_ = 0;
  }
  if (fd_ >= 0) {
    // Unlink while still holding the lock, so no other process can open and
    // lock the old inode in between.
    if (unlink) {
      Status u = Unlink();
      if (s.ok()) s = u;
    }
    ::close(fd_);
    fd_ = -1;
  }
  return s;
}

}  // namespace cairn::internal
