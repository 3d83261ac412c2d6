// ThrottledStorage: a Storage that behaves like a slow network mount, for
// tests and benchmarks of the file cache (NewThrottledStorage and the
// slow:// scheme of OpenStorage, include/cairn/storage.h), a StorageWrapper.
//
// Latency is per operation and overlaps across threads and processes (a
// network mount serves many requests at once). Bandwidth is one shared pipe:
// a reservation clock `next_free_ns` (CLOCK_MONOTONIC, which every process of
// the node shares) lives in a page of /dev/shm; a read of n bytes atomically
// advances it by n / rate and sleeps until its reserved slot ends. So N
// readers in M processes together never exceed the cap.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "cairn/storage.h"

namespace cairn {
namespace {

static_assert(std::atomic<int64_t>::is_always_lock_free,
              "the shared bandwidth clock needs a lock-free 64-bit atomic");

int64_t NowNs() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

void SleepSeconds(double s) {
  if (s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(s));
}

// The node-wide bandwidth clock. Owns its mapping.
class SharedRate {
 public:
  static Result<std::shared_ptr<SharedRate>> Open(const std::string& name, double bytes_per_s) {
    std::string path = "/dev/shm/cairn-throttle-" + name;
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return ErrnoToStatus(errno, "open " + path);
    if (::ftruncate(fd, 4096) != 0) {
      Status s = ErrnoToStatus(errno, "resize " + path);
      ::close(fd);
      return s;
    }
    void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) return ErrnoToStatus(errno, "map " + path);
    return std::make_shared<SharedRate>(p, bytes_per_s);
  }
  SharedRate(void* map, double rate) : map_(map), rate_(rate) {}
  ~SharedRate() { ::munmap(map_, 4096); }

  // Blocks until `n` bytes may have passed through the pipe.
  void Take(uint64_t n) {
    auto* next = reinterpret_cast<std::atomic<int64_t>*>(map_);
    int64_t dur = static_cast<int64_t>(static_cast<double>(n) * 1e9 / rate_);
    int64_t now = NowNs();
    int64_t cur = next->load();
    int64_t end;
    do {
      end = std::max(cur, now) + dur;
    } while (!next->compare_exchange_weak(cur, end));
    int64_t wait = end - NowNs();
    if (wait > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(wait));
  }

 private:
  void* map_;
  double rate_;
};

class ThrottledReadableFile final : public ReadableFile {
 public:
  ThrottledReadableFile(std::unique_ptr<ReadableFile> base, std::shared_ptr<SharedRate> rate)
      : base_(std::move(base)), rate_(std::move(rate)) {}
  Status ReadAt(uint64_t offset, void* buf, size_t n) const override {
    // Pace in 1 MiB slices so that concurrent readers interleave smoothly.
    constexpr size_t kSlice = 1 << 20;
    char* p = static_cast<char*>(buf);
    for (size_t done = 0; done < n;) {
      size_t len = std::min(kSlice, n - done);
      if (rate_) rate_->Take(len);
      CAIRN_RETURN_IF_ERROR(base_->ReadAt(offset + done, p + done, len));
      done += len;
    }
    return Status::OK();
  }
  uint64_t Size() const override { return base_->Size(); }

 private:
  std::unique_ptr<ReadableFile> base_;
  std::shared_ptr<SharedRate> rate_;
};

// Latency on every call that costs a round trip on a network mount (opens,
// renames, listings, stats) and the shared bandwidth cap on reads; every
// other call is StorageWrapper's forwarding. Describe() and LocalPath() are
// the base's: the cache of a throttled source is the cache of its base.
class ThrottledStorage final : public StorageWrapper {
 public:
  ThrottledStorage(std::unique_ptr<Storage> base, double latency_s,
                   std::shared_ptr<SharedRate> rate)
      : StorageWrapper(std::move(base)), latency_s_(latency_s), rate_(std::move(rate)) {}

  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view key,
                                                        const WriteOptions& opts) override {
    SleepSeconds(latency_s_);
    return target()->NewWritableFile(key, opts);
  }
  Result<std::unique_ptr<ReadableFile>> NewReadableFile(std::string_view key,
                                                        const ReadOptions& opts) override {
    SleepSeconds(latency_s_);
    CAIRN_ASSIGN_OR_RETURN(auto f, target()->NewReadableFile(key, opts));
    return std::unique_ptr<ReadableFile>(new ThrottledReadableFile(std::move(f), rate_));
  }
  Status Rename(std::string_view from, std::string_view to) override {
    SleepSeconds(latency_s_);
    return target()->Rename(from, to);
  }
  Result<std::vector<DirEntry>> List(std::string_view dir) override {
    SleepSeconds(latency_s_);
    return target()->List(dir);
  }
  Result<bool> Exists(std::string_view key) override {
    SleepSeconds(latency_s_);
    return target()->Exists(key);
  }
  Result<uint64_t> FileSize(std::string_view key) override {
    SleepSeconds(latency_s_);
    return target()->FileSize(key);
  }

 private:
  double latency_s_;
  std::shared_ptr<SharedRate> rate_;
};

Result<double> ParseNumber(std::string_view name, std::string_view text) {
  std::string s(text);
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !(v >= 0) || v > 1e18) {
    return InvalidArgumentError("slow:// source: '" + std::string(name) +
                                "' must be a non-negative number, got '" + s + "'");
  }
  return v;
}

}  // namespace

Result<std::unique_ptr<Storage>> NewThrottledStorage(std::unique_ptr<Storage> base,
                                                     double latency_s, double bytes_per_s,
                                                     const std::string& share_name) {
  if (!(latency_s >= 0) || !(bytes_per_s >= 0)) {
    return InvalidArgumentError("throttle: latency and bandwidth must be >= 0");
  }
  std::shared_ptr<SharedRate> rate;
  if (bytes_per_s > 0) {
    CAIRN_RETURN_IF_ERROR(ValidateKey(share_name).WithContext("throttle share name"));
    if (share_name.find('/') != std::string::npos) {
      return InvalidArgumentError("throttle share name must not contain '/'");
    }
    CAIRN_ASSIGN_OR_RETURN(rate, SharedRate::Open(share_name, bytes_per_s));
  }
  return std::unique_ptr<Storage>(new ThrottledStorage(std::move(base), latency_s, rate));
}

Result<std::unique_ptr<Storage>> OpenThrottledStorage(std::string_view uri) {
  constexpr std::string_view kSlow = "slow://";
  if (uri.substr(0, kSlow.size()) != kSlow) {
    return InvalidArgumentError("not a slow:// URI: " + std::string(uri));
  }
  std::string_view rest = uri.substr(kSlow.size());
  std::string_view path = rest.substr(0, rest.find('?'));
  std::string_view query =
      rest.find('?') == std::string_view::npos ? "" : rest.substr(rest.find('?') + 1);
  double latency = 0, bandwidth = 0;
  std::string share;
  while (!query.empty()) {
    std::string_view item = query.substr(0, query.find('&'));
    query = query.find('&') == std::string_view::npos ? "" : query.substr(query.find('&') + 1);
    size_t eq = item.find('=');
    if (eq == std::string_view::npos) {
      return InvalidArgumentError("slow:// source: malformed option '" + std::string(item) + "'");
    }
    std::string_view k = item.substr(0, eq), v = item.substr(eq + 1);
    if (k == "latency") {
      CAIRN_ASSIGN_OR_RETURN(latency, ParseNumber(k, v));
    } else if (k == "bandwidth") {
      CAIRN_ASSIGN_OR_RETURN(bandwidth, ParseNumber(k, v));
    } else if (k == "share") {
      share = std::string(v);
    } else {
      return InvalidArgumentError("slow:// source: unknown option '" + std::string(k) +
                                  "' (known: latency, bandwidth, share)");
    }
  }
  if (path.empty()) return InvalidArgumentError("slow:// source: missing path");
  CAIRN_ASSIGN_OR_RETURN(auto base, OpenStorage(path, /*create=*/false));
  if (share.empty()) {
    // Default: one pipe per (user, path, rate), so every process reading the
    // same slow source shares its cap.
    std::hash<std::string> h;
    share = std::to_string(::getuid()) + "-" +
            std::to_string(h(std::string(path) + "|" + std::to_string(bandwidth)));
  }
  return NewThrottledStorage(std::move(base), latency, bandwidth, share);
}

}  // namespace cairn
