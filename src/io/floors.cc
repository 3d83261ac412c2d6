// The machine floors of include/cairn/floors.h. Buffers are anonymous
// mappings (page-aligned, as O_DIRECT needs, and returned to the system at
// once when unmapped), pre-faulted before any clock starts, so a floor times
// the copy or the I/O and nothing else. The direct-I/O file gets a name of its
// own and is unlinked by a guard on every path out of MeasureDirectIoFloors.
#include "cairn/floors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <barrier>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "storage/unique_fd.h"

namespace cairn {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// An anonymous private mapping of `size` bytes; empty (data() == nullptr)
// when the mapping failed.
class MappedBuffer {
 public:
  explicit MappedBuffer(size_t size) : map_(Map(size), Unmap{size}) {}
  char* data() const { return map_.get(); }
  size_t size() const { return map_.get_deleter().size; }

 private:
  struct Unmap {
    size_t size;
    void operator()(char* p) const { ::munmap(p, size); }
  };
  static char* Map(size_t size) {
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
  }
  std::unique_ptr<char, Unmap> map_;  // unmapped when it goes; never copied
};

Status MapFailed(size_t size, const char* what) {
  return ResourceExhaustedError("cannot map " + std::to_string(size) + " bytes for " + what);
}

// Fills `buf` with one random MiB repeated, which also pre-faults it (random,
// so a compressing or deduplicating filesystem cannot shortcut the writes).
void FillRandom(MappedBuffer& buf) {
  constexpr size_t kMiB = size_t{1} << 20;
  std::vector<uint64_t> mib(kMiB / sizeof(uint64_t));
  std::mt19937_64 gen(std::random_device{}());
  for (auto& w : mib) w = gen();
  for (size_t off = 0; off < buf.size(); off += kMiB) {
    std::memcpy(buf.data() + off, mib.data(), std::min(kMiB, buf.size() - off));
  }
}

// Closes the fd on every path out of a scope.
using Fd = internal::UniqueFd;

// Unlinks a path when it goes out of scope (the floor's file, whatever happens).
class RemoveOnExit {
 public:
  explicit RemoveOnExit(std::string path) : path_(std::move(path)) {}
  ~RemoveOnExit() { ::unlink(path_.c_str()); }
  RemoveOnExit(const RemoveOnExit&) = delete;
  RemoveOnExit& operator=(const RemoveOnExit&) = delete;

 private:
  std::string path_;
};

std::string UniqueFloorPath(const std::string& dir) {
  static std::atomic<uint64_t> counter{0};
  return dir + "/cairn-direct-io-" + std::to_string(::getpid()) + "-" +
         std::to_string(counter.fetch_add(1)) + ".bin";
}

Status FsyncDir(const std::string& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoToStatus(errno, "opening directory " + dir);
  if (::fsync(fd.get()) != 0) return ErrnoToStatus(errno, "fsync of directory " + dir);
  return Status::OK();
}

// The timed part of the write floor: create, write every block, fsync, close,
// fsync the directory.
Status DirectWrite(const std::string& dir, const std::string& path, uint64_t n,
                   const MappedBuffer& block) {
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0644));
  if (fd.get() < 0) {
    if (errno == EINVAL) {
      return InvalidArgumentError("the filesystem of " + dir + " does not support O_DIRECT");
    }
    return ErrnoToStatus(errno, "creating " + path);
  }
  for (uint64_t off = 0; off < n; off += kFloorBlockBytes) {
    ssize_t w;
    do {
      w = ::pwrite(fd.get(), block.data(), kFloorBlockBytes, static_cast<off_t>(off));
    } while (w < 0 && errno == EINTR);
    if (w < 0) return ErrnoToStatus(errno, "direct write of " + path);
    if (static_cast<uint64_t>(w) != kFloorBlockBytes) {
      return IOError("short direct write of " + path + " at offset " + std::to_string(off));
    }
  }
  if (::fsync(fd.get()) != 0) return ErrnoToStatus(errno, "fsync of " + path);
  if (::close(fd.release()) != 0) return ErrnoToStatus(errno, "closing " + path);
  return FsyncDir(dir);
}

// Stream `i` of the read floor: blocks i, i + streams, ... of the first `n`
// bytes of `fd` into its own buffer.
Status ReadStream(int fd, const std::string& path, uint64_t n, size_t i, size_t streams,
                  char* buf) {
  for (uint64_t off = i * kFloorBlockBytes; off < n; off += streams * kFloorBlockBytes) {
    ssize_t r;
    do {
      r = ::pread(fd, buf, kFloorBlockBytes, static_cast<off_t>(off));
    } while (r < 0 && errno == EINTR);
    if (r < 0) return ErrnoToStatus(errno, "direct read of " + path);
    if (static_cast<uint64_t>(r) != kFloorBlockBytes) {
      return IOError("short direct read of " + path + " at offset " + std::to_string(off));
    }
  }
  return Status::OK();
}

Result<double> ParallelDirectRead(const std::string& path, uint64_t n, size_t streams) {
  std::vector<std::unique_ptr<MappedBuffer>> bufs;
  for (size_t i = 0; i < streams; ++i) {
    bufs.push_back(std::make_unique<MappedBuffer>(kFloorBlockBytes));
    if (bufs.back()->data() == nullptr) return MapFailed(kFloorBlockBytes, "a read stream");
    FillRandom(*bufs.back());
  }
  Fd fd(::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoToStatus(errno, "opening " + path + " for direct reads");
  std::vector<Status> errors(streams);
  std::barrier start(static_cast<std::ptrdiff_t>(streams + 1));
  std::vector<std::thread> threads;
  threads.reserve(streams);
  for (size_t i = 0; i < streams; ++i) {
    threads.emplace_back([&, i] {
      start.arrive_and_wait();
      errors[i] = ReadStream(fd.get(), path, n, i, streams, bufs[i]->data());
    });
  }
  start.arrive_and_wait();
  double t0 = Now();
  for (auto& t : threads) t.join();
  double seconds = Now() - t0;
  for (const Status& s : errors) CAIRN_RETURN_IF_ERROR(s);
  return seconds;
}

}  // namespace

Result<FloorSample> MeasureMemcpyFloor(uint64_t bytes) {
  if (bytes == 0) return InvalidArgumentError("the memcpy floor needs bytes > 0");
  MappedBuffer src(bytes), dst(bytes);
  if (src.data() == nullptr || dst.data() == nullptr) return MapFailed(bytes, "the memcpy floor");
  std::memset(src.data(), 7, bytes);
  std::memset(dst.data(), 0, bytes);
  double t0 = Now();
  std::memcpy(dst.data(), src.data(), bytes);
  double seconds = Now() - t0;
  // Keeps the copy from being optimized away (dst is read after the clock).
  if (dst.data()[bytes - 1] != 7) return InternalError("memcpy floor: the copy did not land");
  return FloorSample{seconds, bytes};
}

Result<DirectIoFloors> MeasureDirectIoFloors(const std::string& dir, uint64_t bytes,
                                             const DirectIoFloorOptions& opts) {
  if (bytes == 0) return InvalidArgumentError("the direct-I/O floors need bytes > 0");
  size_t streams = opts.read_streams == 0 ? 1 : opts.read_streams;
  uint64_t n = (bytes + kFloorBlockBytes - 1) / kFloorBlockBytes * kFloorBlockBytes;
  MappedBuffer block(kFloorBlockBytes);
  if (block.data() == nullptr) return MapFailed(kFloorBlockBytes, "the direct write floor");
  FillRandom(block);
  std::string path = UniqueFloorPath(dir);
  RemoveOnExit remove(path);
  ::sync();  // nothing else's dirty pages are flushed inside the clock
  DirectIoFloors out;
  double t0 = Now();
  CAIRN_RETURN_IF_ERROR(DirectWrite(dir, path, n, block).WithContext("direct write floor"));
  out.write = {Now() - t0, n};
  if (opts.drop_caches) {
    out.cold = DropPageCache();
  } else {
    ::sync();
  }
  CAIRN_ASSIGN_OR_RETURN(double read_s, ParallelDirectRead(path, n, streams));
  out.read = {read_s, n};
  return out;
}

bool DropPageCache() {
  ::sync();
  Fd fd(::open("/proc/sys/vm/drop_caches", O_WRONLY | O_CLOEXEC));
  if (fd.get() < 0) return false;
  return ::write(fd.get(), "3\n", 2) == 2;
}

void TrimHeap() {
#if defined(__GLIBC__)
  ::malloc_trim(0);
#endif
}

}  // namespace cairn
