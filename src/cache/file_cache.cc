// FileCache: the cross-process fetch-and-cache protocol.
//
// Layout of one dataset's cache, ROOT = <cache_dir>/<fingerprint of source+files>:
//   ROOT/lock    an empty file; flock(LOCK_EX) on it is the *index lock*.
//   ROOT/table   the shared index, mmap(MAP_SHARED) by every process:
//                a Header, then one Slot per file id {state, size, pid, nonce}.
//                state is kAbsent, kFetching or kPresent.
//   ROOT/files/KEY                          a complete cached file.
//   ROOT/files/KEY.cairn-tmp-PID-NONCE      a copy in progress.
//
// Every read or write of the table happens under the index lock (plus an
// in-process mutex, because flock does not exclude threads sharing one open
// file description). The kernel drops flocks of a dead process, so a process
// killed while holding any lock never wedges the others.
//
// Invariants, under the index lock:
//   * used = sum of the sizes of kFetching and kPresent slots <= limit, except
//     transiently while one process fixes it. Multi-field updates set
//     header.dirty first and clear it last; whoever takes the lock and finds
//     dirty set recomputes `used` from the slots (the writer died mid-update).
//   * a kPresent slot's file exists under its final name with its full size.
//   * a process reading a cached file holds flock(LOCK_SH) on it (a *pin*);
//     evicting takes flock(LOCK_EX|LOCK_NB) first, so a pinned file is never
//     removed. Pins die with the process.
//   * the fetcher of a kFetching slot holds flock(LOCK_EX) on its temp file
//     from before the slot is published until after it is marked kPresent.
//     A slot is *dead* when that lock can be taken: the temp file is deleted
//     and the slot freed (or, if the rename happened, the file is kept).
//
// Fetching file `id` (Fetch):
//   1. lock; if kPresent: open the final file, check its size, LOCK_SH it,
//      unlock: done (a hit). A missing or short file is dropped (absent).
//   2. if kFetching by a live process: unlock, wait with backoff, go to 1
//      (a prefetch gives up instead). A dead fetch is reclaimed, go to 1.
//   3. if kAbsent: make room (evict unpinned kPresent files, the one needed
//      furthest in the future first: Belady, using the plan's order); create
//      and LOCK_EX the temp file; publish kFetching; used += size; unlock.
//   4. copy source -> temp (no lock held), rename temp -> final name.
//   5. lock; downgrade the temp fd's lock to LOCK_SH (it becomes our pin);
//      mark kPresent; unlock.
//   A copy interrupted by a crash leaves only a temp file, which is never
//   served and is deleted by the next process that opens the cache or looks
//   at the slot. A failed copy deletes its temp file and frees the slot.
//
// Prefetching: the consumer declares its future (SetPlan) and moves a cursor
// (Acquire). Up to prefetch_files / prefetch_bytes entries ahead of the
// cursor are fetched on the pool. A prefetched file is not pinned (only the
// consumer's Acquire pins), so prefetches of many processes can never starve
// a demand fetch; it is needed soon, so Belady evicts it last. A prefetch
// never evicts a file needed sooner than the one it fetches, and skips files
// another process is already fetching.
//
// Not durable across power loss: cached files are not fsync'ed (a cache);
// a file whose size does not match after a crash is refetched.
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "cairn/cache.h"
#include "io/xxh3.h"
#include "storage/posix/posix_storage.h"

namespace cairn {
namespace {

constexpr char kMagic[8] = {'C', 'A', 'I', 'R', 'N', 'F', 'C', '1'};
constexpr uint32_t kVersion = 1;
constexpr std::string_view kTmpMarker = ".cairn-tmp-";
constexpr int64_t kNever = INT64_MAX / 4;

enum SlotState : uint32_t { kAbsent = 0, kFetching = 1, kPresent = 2 };

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t dirty;
  uint64_t n;
  uint64_t used;
  uint64_t fetched_files;
  uint64_t fetched_bytes;
  uint64_t evictions;
  uint64_t nonce;
  uint64_t reserved[8];
};
struct Slot {
  uint64_t size;
  uint32_t state;
  uint32_t pid;
  uint64_t nonce;
};
static_assert(sizeof(Header) == 128, "table header layout");
static_assert(sizeof(Slot) == 24, "table slot layout");

using Clock = std::chrono::steady_clock;

int FlockNoIntr(int fd, int op) {
  int rc;
  do {
    rc = ::flock(fd, op);
  } while (rc != 0 && errno == EINTR);
  return rc;
}

std::string Hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

Status ListInto(Storage* s, const std::string& dir, std::vector<SourceFile>* out) {
  CAIRN_ASSIGN_OR_RETURN(auto entries, s->List(dir));
  for (auto& e : entries) {
    std::string key = JoinKey(dir, e.name);
    if (e.is_dir) {
      CAIRN_RETURN_IF_ERROR(ListInto(s, key, out));
    } else {
      if (key.find(kTmpMarker) != std::string::npos) {
        return InvalidArgumentError("source file name contains the reserved marker '" +
                                    std::string(kTmpMarker) + "': " + key);
      }
      out->push_back(SourceFile{key, e.size});
    }
  }
  return Status::OK();
}

// Walks `dir` calling fn(path, name) for every regular file.
template <typename Fn>
void WalkFiles(const std::string& dir, Fn&& fn) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  std::vector<std::string> subdirs;
  while (struct dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct stat st;
    if (::fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (S_ISDIR(st.st_mode)) {
      subdirs.push_back(dir + "/" + name);
    } else if (S_ISREG(st.st_mode)) {
      fn(dir + "/" + name, name);
    }
  }
  ::closedir(d);
  for (auto& s : subdirs) WalkFiles(s, fn);
}

}  // namespace

Result<std::unique_ptr<Storage>> OpenSourceStorage(std::string_view uri) {
  return OpenStorage(uri, /*create=*/false);
}

Result<std::vector<SourceFile>> ListFiles(Storage* source) {
  std::vector<SourceFile> out;
  CAIRN_RETURN_IF_ERROR(ListInto(source, "", &out).WithContext("listing " + source->Describe()));
  std::sort(out.begin(), out.end(),
            [](const SourceFile& a, const SourceFile& b) { return a.key < b.key; });
  return out;
}

// The shared index: the lock file, the mapped table and the in-process mutex.
struct FileCache::Table {
  int lock_fd = -1;
  int table_fd = -1;
  void* map = nullptr;
  size_t map_len = 0;
  Header* hdr = nullptr;
  Slot* slots = nullptr;
  std::mutex mu;

  ~Table() {
    if (map) ::munmap(map, map_len);
    if (table_fd >= 0) ::close(table_fd);
    if (lock_fd >= 0) ::close(lock_fd);
  }

  void Recount() {
    uint64_t used = 0;
    for (uint64_t i = 0; i < hdr->n; ++i) {
      if (slots[i].state == kPresent || slots[i].state == kFetching) used += slots[i].size;
    }
    hdr->used = used;
    hdr->dirty = 0;
  }
};

namespace {

// Holds the index lock (in-process mutex + flock) for its lifetime.
class IndexLock {
 public:
  explicit IndexLock(FileCache::Table* t) : t_(t), l_(t->mu) {
    FlockNoIntr(t_->lock_fd, LOCK_EX);
    if (t_->hdr && t_->hdr->dirty) t_->Recount();  // a process died mid-update
  }
  ~IndexLock() { FlockNoIntr(t_->lock_fd, LOCK_UN); }

 private:
  FileCache::Table* t_;
  std::unique_lock<std::mutex> l_;
};

// Frees slot `s` (under the index lock).
void FreeSlot(Header* h, Slot* s) {
  h->dirty = 1;
  if (s->state != kAbsent) h->used -= std::min(h->used, s->size);
  s->state = kAbsent;
  h->dirty = 0;
}

}  // namespace

FileCache::FileCache(std::unique_ptr<Storage> source, std::vector<SourceFile> files,
                     ThreadPool* pool, FileCacheOptions opts)
    : source_(std::move(source)),
      files_(std::move(files)),
      pool_(pool),
      opts_(std::move(opts)),
      table_(new Table) {}

Result<std::unique_ptr<FileCache>> FileCache::Open(std::unique_ptr<Storage> source,
                                                   std::vector<SourceFile> files, ThreadPool* pool,
                                                   FileCacheOptions opts) {
  if (!source || !pool) return InvalidArgumentError("FileCache: source and pool are required");
  if (opts.cache_dir.empty()) return InvalidArgumentError("FileCache: cache_dir is empty");
  if (opts.limit_bytes == 0) return InvalidArgumentError("FileCache: cache_limit must be > 0");
  if (opts.chunk_bytes == 0) opts.chunk_bytes = 4u << 20;
  for (const auto& f : files) {
    CAIRN_RETURN_IF_ERROR(ValidateKey(f.key).WithContext("FileCache file list"));
    if (f.key.find(kTmpMarker) != std::string::npos) {
      return InvalidArgumentError("FileCache: file name contains a reserved marker: " + f.key);
    }
  }
  std::unique_ptr<FileCache> c(
      new FileCache(std::move(source), std::move(files), pool, std::move(opts)));
  CAIRN_RETURN_IF_ERROR(c->Init().WithContext("opening file cache in " + c->opts_.cache_dir));
  return c;
}

Status FileCache::Init() {
  // The fingerprint names the dataset: its source and its exact file list.
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  std::string desc = source_->Describe();
  XXH3_64bits_update(st, desc.data(), desc.size() + 1);
  for (const auto& f : files_) {
    XXH3_64bits_update(st, f.key.data(), f.key.size() + 1);
    XXH3_64bits_update(st, &f.size, sizeof(f.size));
  }
  uint64_t fp = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  std::string dir = opts_.cache_dir;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  root_ = dir + "/" + Hex(fp);
  CAIRN_RETURN_IF_ERROR(internal::MkdirAll(root_ + "/files"));

  Table& t = *table_;
  std::string lock_path = root_ + "/lock";
  t.lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (t.lock_fd < 0) return ErrnoToStatus(errno, "open " + lock_path);
  std::string table_path = root_ + "/table";
  IndexLock lk(&t);
  t.table_fd = ::open(table_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (t.table_fd < 0) return ErrnoToStatus(errno, "open " + table_path);
  struct stat sb;
  if (::fstat(t.table_fd, &sb) != 0) return ErrnoToStatus(errno, "stat " + table_path);
  t.map_len = sizeof(Header) + files_.size() * sizeof(Slot);
  bool fresh = static_cast<size_t>(sb.st_size) != t.map_len;
  if (fresh) {
    if (::ftruncate(t.table_fd, 0) != 0 ||
        ::ftruncate(t.table_fd, static_cast<off_t>(t.map_len)) != 0) {
      return ErrnoToStatus(errno, "resize " + table_path);
    }
  }
  t.map = ::mmap(nullptr, t.map_len, PROT_READ | PROT_WRITE, MAP_SHARED, t.table_fd, 0);
  if (t.map == MAP_FAILED) {
    t.map = nullptr;
    return ErrnoToStatus(errno, "map " + table_path);
  }
  t.hdr = static_cast<Header*>(t.map);
  t.slots = reinterpret_cast<Slot*>(static_cast<char*>(t.map) + sizeof(Header));
  if (!fresh && (std::memcmp(t.hdr->magic, kMagic, 8) != 0 || t.hdr->version != kVersion ||
                 t.hdr->n != files_.size())) {
    fresh = true;
  }
  if (fresh) {
    // (Re)build the index from what is on disk: complete files of the right
    // size are kept, anything else is removed by CleanStale below.
    std::memset(t.map, 0, t.map_len);
    std::memcpy(t.hdr->magic, kMagic, 8);
    t.hdr->version = kVersion;
    t.hdr->n = files_.size();
    for (size_t i = 0; i < files_.size(); ++i) {
      struct stat fs;
      std::string p = FinalPath(static_cast<int64_t>(i));
      if (::stat(p.c_str(), &fs) == 0) {
        if (S_ISREG(fs.st_mode) && static_cast<uint64_t>(fs.st_size) == files_[i].size) {
          t.slots[i] = Slot{files_[i].size, kPresent, 0, 0};
        } else {
          ::unlink(p.c_str());
        }
      }
    }
    t.Recount();
  } else {
    // Distrust a damaged table: a slot must name a known state and the
    // file's listed size, or it is dropped (and its file with it).
    for (size_t i = 0; i < files_.size(); ++i) {
      Slot& sl = t.slots[i];
      bool ok = sl.state == kAbsent ||
                ((sl.state == kPresent || sl.state == kFetching) && sl.size == files_[i].size);
      if (!ok) {
        ::unlink(FinalPath(static_cast<int64_t>(i)).c_str());
        sl = Slot{0, kAbsent, 0, 0};
      }
    }
    t.Recount();  // `used` is derived from the slots, never trusted from disk
  }
  return CleanStale();
}

// Under the index lock: deletes temp files nobody holds and frees the slots
// of dead fetches.
Status FileCache::CleanStale() {
  Table& t = *table_;
  WalkFiles(root_ + "/files", [](const std::string& path, const std::string& name) {
    if (name.find(kTmpMarker) == std::string::npos) return;
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    if (FlockNoIntr(fd, LOCK_EX | LOCK_NB) == 0) ::unlink(path.c_str());
    ::close(fd);
  });
  for (size_t i = 0; i < files_.size(); ++i) {
    Slot& s = t.slots[i];
    if (s.state != kFetching) continue;
    std::string fin = FinalPath(static_cast<int64_t>(i));
    std::string tmp =
        fin + std::string(kTmpMarker) + std::to_string(s.pid) + "-" + std::to_string(s.nonce);
    if (::access(tmp.c_str(), F_OK) == 0) continue;  // held (live fetch): unheld ones are gone
    // No temp file (it is created before the slot is published): the fetcher
    // renamed it and then died, or is about to mark the slot present.
    int fd = ::open(fin.c_str(), O_RDONLY | O_CLOEXEC);
    struct stat sb;
    if (fd >= 0 && FlockNoIntr(fd, LOCK_EX | LOCK_NB) != 0) {
      ::close(fd);  // the fetcher is alive
      continue;
    }
    if (fd >= 0 && ::fstat(fd, &sb) == 0 && static_cast<uint64_t>(sb.st_size) == s.size) {
      s.state = kPresent;
    } else {
      if (fd >= 0) ::unlink(fin.c_str());
      FreeSlot(t.hdr, &s);
    }
    if (fd >= 0) ::close(fd);
  }
  return Status::OK();
}

FileCache::~FileCache() {
  std::unique_lock<std::mutex> l(mu_);
  closing_ = true;
  ++generation_;
  cv_.wait(l, [this] { return running_tasks_ == 0; });
  for (auto& [id, pin] : pins_) ::close(pin.fd);
  pins_.clear();
}

std::string FileCache::FinalPath(int64_t id) const {
  return root_ + "/files/" + files_[static_cast<size_t>(id)].key;
}

int64_t FileCache::NextUse(int64_t id) const {
  if (pos_cur_.empty()) return 0;
  int64_t cur = plan_pos_.empty() ? 0 : plan_pos_[std::min(cursor_, plan_pos_.size() - 1)];
  int64_t p = pos_cur_[static_cast<size_t>(id)];
  if (p != kNever && p >= cur) return p;
  int64_t q = pos_next_[static_cast<size_t>(id)];
  return q == kNever ? kNever : order_len_ + q;
}

Status FileCache::SetPlan(std::vector<int64_t> order, std::vector<int64_t> next_order,
                          std::vector<int64_t> positions) {
  const int64_t n = static_cast<int64_t>(files_.size());
  std::vector<int64_t> pos_cur(files_.size(), kNever), pos_next(files_.size(), kNever);
  for (size_t i = 0; i < order.size(); ++i) {
    if (order[i] < 0 || order[i] >= n) return InvalidArgumentError("SetPlan: file id out of range");
    int64_t& p = pos_cur[static_cast<size_t>(order[i])];
    if (p == kNever) p = static_cast<int64_t>(i);
  }
  for (size_t i = 0; i < next_order.size(); ++i) {
    if (next_order[i] < 0 || next_order[i] >= n) {
      return InvalidArgumentError("SetPlan: file id out of range in the next epoch's order");
    }
    int64_t& p = pos_next[static_cast<size_t>(next_order[i])];
    if (p == kNever) p = static_cast<int64_t>(i);
  }
  std::vector<int64_t> plan(positions.size());
  for (size_t i = 0; i < positions.size(); ++i) {
    if (positions[i] < 0 || positions[i] >= static_cast<int64_t>(order.size())) {
      return InvalidArgumentError("SetPlan: position " + std::to_string(positions[i]) +
                                  " outside the epoch's order of " + std::to_string(order.size()));
    }
    plan[i] = order[static_cast<size_t>(positions[i])];
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    ++generation_;
    // Prefetched files of the old plan no longer count against the window.
    for (int64_t id : prefetched_) {
      window_bytes_ -= std::min(window_bytes_, files_[static_cast<size_t>(id)].size);
    }
    prefetched_.clear();
    pos_cur_ = std::move(pos_cur);
    pos_next_ = std::move(pos_next);
    order_len_ = static_cast<int64_t>(order.size());
    plan_ = std::move(plan);
    plan_pos_ = std::move(positions);
    cursor_ = 0;
    next_prefetch_ = 0;
  }
  Pump();
  return Status::OK();
}

size_t FileCache::PlanSize() const {
  std::lock_guard<std::mutex> l(mu_);
  return plan_.size();
}

int64_t FileCache::PlanFile(size_t i) const {
  std::lock_guard<std::mutex> l(mu_);
  return i < plan_.size() ? plan_[i] : -1;
}

void FileCache::AddPin(int64_t id, int fd) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = pins_.find(id);
  if (it != pins_.end()) {
    ++it->second.refs;
    ::close(fd);  // the existing descriptor keeps the shared lock
  } else {
    pins_[id] = Pin{fd, 1};
  }
}

void FileCache::Release(int64_t id) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = pins_.find(id);
  if (it == pins_.end()) return;
  if (--it->second.refs <= 0) {
    ::close(it->second.fd);
    pins_.erase(it);
  }
}

Status FileCache::Copy(int64_t id, int fd, const std::string& tmp_path) {
  const SourceFile& f = files_[static_cast<size_t>(id)];
  CAIRN_ASSIGN_OR_RETURN(auto in, source_->NewReadableFile(f.key));
  if (in->Size() != f.size) {
    return FailedPreconditionError("source file changed since it was listed: " + f.key + " had " +
                                   std::to_string(f.size) + " bytes, now " +
                                   std::to_string(in->Size()));
  }
  std::vector<char> buf(std::min<uint64_t>(opts_.chunk_bytes, std::max<uint64_t>(f.size, 1)));
  for (uint64_t off = 0; off < f.size;) {
    size_t len = static_cast<size_t>(std::min<uint64_t>(buf.size(), f.size - off));
    CAIRN_RETURN_IF_ERROR(in->ReadAt(off, buf.data(), len));
    for (size_t done = 0; done < len;) {
      ssize_t w = ::pwrite(fd, buf.data() + done, len - done, static_cast<off_t>(off + done));
      if (w < 0) {
        if (errno == EINTR) continue;
        return ErrnoToStatus(errno, "write " + tmp_path);
      }
      done += static_cast<size_t>(w);
    }
    off += len;
  }
  return Status::OK();
}

std::vector<int64_t> FileCache::EvictionOrder(int64_t id, uint64_t size, bool demand) {
  Table& t = *table_;
  std::vector<std::pair<int64_t, int64_t>> cands;  // (next use, id)
  int64_t target_use;
  {
    std::lock_guard<std::mutex> l(mu_);
    target_use = NextUse(id);
    if (t.hdr->used + size <= opts_.limit_bytes) return {};  // room already
    for (uint64_t i = 0; i < t.hdr->n; ++i) {
      if (t.slots[i].state == kPresent && static_cast<int64_t>(i) != id) {
        cands.emplace_back(NextUse(static_cast<int64_t>(i)), static_cast<int64_t>(i));
      }
    }
  }
  // Belady: the file needed last goes first.
  std::sort(cands.begin(), cands.end(), std::greater<>());
  std::vector<int64_t> order;
  for (const auto& [use, cid] : cands) {
    if (!demand && use <= target_use) break;  // a prefetch never evicts what is needed sooner
    order.push_back(cid);
  }
  return order;
}

Status FileCache::Fetch(int64_t id, bool demand, bool* admitted) {
  *admitted = false;
  Table& t = *table_;
  const SourceFile& f = files_[static_cast<size_t>(id)];
  const std::string final_path = FinalPath(id);
  if (f.size > opts_.limit_bytes) {
    return ResourceExhaustedError("file " + f.key + " (" + std::to_string(f.size) +
                                  " bytes) is larger than the cache limit of " +
                                  std::to_string(opts_.limit_bytes) + " bytes");
  }
  auto deadline = Clock::now() + std::chrono::duration<double>(opts_.wait_timeout_s);
  auto backoff = std::chrono::microseconds(500);
  bool waiting_for_room = false;
  for (;;) {
    int tmp_fd = -1;
    std::string tmp_path;
    {
      IndexLock lk(&t);
      Slot& s = t.slots[id];
      if (s.state == kPresent) {
        {
          std::lock_guard<std::mutex> l(mu_);
          auto it = pins_.find(id);
          if (it != pins_.end()) {
            ++it->second.refs;
            *admitted = true;
            return Status::OK();
          }
        }
        int fd = ::open(final_path.c_str(), O_RDONLY | O_CLOEXEC);
        struct stat sb;
        if (fd >= 0 && ::fstat(fd, &sb) == 0 && static_cast<uint64_t>(sb.st_size) == s.size &&
            FlockNoIntr(fd, LOCK_SH | LOCK_NB) == 0) {
          AddPin(id, fd);
          *admitted = true;
          return Status::OK();
        }
        if (fd >= 0) ::close(fd);
        ::unlink(final_path.c_str());  // missing or damaged: fetch again
        FreeSlot(t.hdr, &s);
      }
      if (s.state == kFetching) {
        std::string tmp = final_path + std::string(kTmpMarker) + std::to_string(s.pid) + "-" +
                          std::to_string(s.nonce);
        bool tmp_exists = true;
        int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
          tmp_exists = false;
          fd = ::open(final_path.c_str(), O_RDONLY | O_CLOEXEC);
        }
        bool alive = fd >= 0 && FlockNoIntr(fd, LOCK_EX | LOCK_NB) != 0;
        if (!alive) {
          // The fetcher died. A complete renamed file is kept; a temp file is
          // removed.
          struct stat sb;
          if (fd >= 0 && !tmp_exists && ::fstat(fd, &sb) == 0 &&
              static_cast<uint64_t>(sb.st_size) == s.size) {
            s.state = kPresent;
          } else {
            if (tmp_exists) ::unlink(tmp.c_str());
            if (fd >= 0 && !tmp_exists) ::unlink(final_path.c_str());
            FreeSlot(t.hdr, &s);
          }
          if (fd >= 0) ::close(fd);
          continue;
        }
        ::close(fd);
        if (!demand) return Status::OK();  // someone else is on it
        waiting_for_room = false;
      } else {
        // kAbsent: make room, then publish our fetch.
        for (int64_t victim : EvictionOrder(id, f.size, demand)) {
          if (t.hdr->used + f.size <= opts_.limit_bytes) break;
          std::string cp = FinalPath(victim);
          int fd = ::open(cp.c_str(), O_RDONLY | O_CLOEXEC);
          if (fd >= 0 && FlockNoIntr(fd, LOCK_EX | LOCK_NB) != 0) {
            ::close(fd);  // pinned by a reader
            continue;
          }
          ::unlink(cp.c_str());
          if (fd >= 0) ::close(fd);
          FreeSlot(t.hdr, &t.slots[victim]);
          ++t.hdr->evictions;
          std::lock_guard<std::mutex> l(mu_);
          ++stats_.evictions;
        }
        if (t.hdr->used + f.size <= opts_.limit_bytes) {
          uint64_t nonce = ++t.hdr->nonce;
          uint32_t pid = static_cast<uint32_t>(::getpid());
          tmp_path = final_path + std::string(kTmpMarker) + std::to_string(pid) + "-" +
                     std::to_string(nonce);
          size_t slash = final_path.rfind('/');
          CAIRN_RETURN_IF_ERROR(internal::MkdirAll(final_path.substr(0, slash)));
          tmp_fd = ::open(tmp_path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
          if (tmp_fd < 0) return ErrnoToStatus(errno, "create " + tmp_path);
          if (FlockNoIntr(tmp_fd, LOCK_EX | LOCK_NB) != 0) {
            Status err = ErrnoToStatus(errno, "lock " + tmp_path);
            ::close(tmp_fd);
            ::unlink(tmp_path.c_str());
            return err;
          }
          t.hdr->dirty = 1;
          s.size = f.size;
          s.pid = pid;
          s.nonce = nonce;
          s.state = kFetching;
          t.hdr->used += f.size;
          t.hdr->dirty = 0;
        } else {
          if (!demand) return Status::OK();
          waiting_for_room = true;
        }
      }
    }
    if (tmp_fd >= 0) {
      Status st = Copy(id, tmp_fd, tmp_path);
      if (st.ok() && ::rename(tmp_path.c_str(), final_path.c_str()) != 0) {
        st = ErrnoToStatus(errno, "rename " + tmp_path);
      }
      IndexLock lk(&t);
      Slot& s = t.slots[id];
      if (!st.ok()) {
        ::unlink(tmp_path.c_str());
        FreeSlot(t.hdr, &s);
        ::close(tmp_fd);
        return st.WithContext("fetching " + f.key + " from " + source_->Describe());
      }
      FlockNoIntr(tmp_fd, LOCK_SH);  // downgrade: the copy becomes our pin
      s.state = kPresent;
      ++t.hdr->fetched_files;
      t.hdr->fetched_bytes += f.size;
      {
        std::lock_guard<std::mutex> l(mu_);
        ++stats_.fetched_files;
        stats_.fetched_bytes += f.size;
      }
      AddPin(id, tmp_fd);
      *admitted = true;
      return Status::OK();
    }
    if (Clock::now() > deadline) {
      if (waiting_for_room) {
        return ResourceExhaustedError(
            "cache limit of " + std::to_string(opts_.limit_bytes) +
            " bytes is too small: no room for " + f.key + " (" + std::to_string(f.size) +
            " bytes) because every cached file is in use; raise cache_limit or lower the "
            "prefetch window / number of workers");
      }
      return DeadlineExceededError("waited " + std::to_string(opts_.wait_timeout_s) +
                                   "s for another process to fetch " + f.key);
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::microseconds(20000));
  }
}

void FileCache::Pump() {
  std::lock_guard<std::mutex> l(mu_);
  if (closing_) return;
  if (next_prefetch_ < cursor_) next_prefetch_ = cursor_;
  while (active_fetches_ < pool_->size() && next_prefetch_ < plan_.size() &&
         next_prefetch_ < cursor_ + opts_.prefetch_files) {
    int64_t id = plan_[next_prefetch_];
    uint64_t size = files_[static_cast<size_t>(id)].size;
    if (inflight_.count(id) || prefetched_.count(id) || pins_.count(id)) {
      ++next_prefetch_;
      continue;
    }
    if (window_bytes_ > 0 && window_bytes_ + size > opts_.prefetch_bytes) break;
    ++next_prefetch_;
    inflight_[id] = true;
    window_bytes_ += size;
    ++active_fetches_;
    ++running_tasks_;
    uint64_t gen = generation_;
    pool_->Submit([this, id, gen, size] {
      bool admitted = false;
      bool closing;
      {
        std::lock_guard<std::mutex> l2(mu_);
        closing = closing_;
      }
      Status s = closing ? CancelledError("closing") : Fetch(id, /*demand=*/false, &admitted);
      {
        std::lock_guard<std::mutex> l2(mu_);
        inflight_.erase(id);
        // A prefetched file is not kept pinned: under pressure, a demand
        // fetch of another process may evict it (Belady makes that the last
        // resort, as it is needed soon), and pinned prefetches of many
        // processes could otherwise starve each other.
        if (admitted) {
          auto it = pins_.find(id);
          if (it != pins_.end() && --it->second.refs <= 0) {
            ::close(it->second.fd);
            pins_.erase(it);
          }
        }
        if (s.ok() && admitted && gen == generation_ && !closing_) {
          prefetched_.insert(id);
        } else {
          window_bytes_ -= std::min(window_bytes_, size);
        }
        --active_fetches_;  // frees the slot for the Pump() below
        cv_.notify_all();
      }
      Pump();
      std::lock_guard<std::mutex> l2(mu_);
      --running_tasks_;
      cv_.notify_all();
    });
  }
}

Result<std::string> FileCache::WaitFor(int64_t id, bool count_hit) {
  auto t0 = Clock::now();
  bool waited = false;
  uint64_t fetched_before;
  {
    std::unique_lock<std::mutex> l(mu_);
    while (inflight_.count(id)) {  // a prefetch (or another thread) is on it
      waited = true;
      cv_.wait(l);
    }
    if (prefetched_.erase(id)) {
      window_bytes_ -= std::min(window_bytes_, files_[static_cast<size_t>(id)].size);
    }
    inflight_[id] = false;  // a demand fetch by this thread
    fetched_before = stats_.fetched_files;
  }
  // Usually the file is cached by now and this only pins it.
  bool admitted = false;
  Status result = Fetch(id, /*demand=*/true, &admitted);
  {
    std::lock_guard<std::mutex> l(mu_);
    inflight_.erase(id);
    if (count_hit) {
      if (waited || stats_.fetched_files != fetched_before) {
        ++stats_.misses;
      } else {
        ++stats_.hits;
      }
      stats_.wait_s += std::chrono::duration<double>(Clock::now() - t0).count();
    }
    cv_.notify_all();
  }
  Pump();
  CAIRN_RETURN_IF_ERROR(result);
  if (!admitted) return InternalError("demand fetch of " + files_[id].key + " was not admitted");
  return FinalPath(id);
}

Result<std::string> FileCache::Acquire(size_t i) {
  int64_t id;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (i >= plan_.size()) {
      return OutOfRangeError("Acquire: entry " + std::to_string(i) + " outside a plan of " +
                             std::to_string(plan_.size()));
    }
    cursor_ = i;
    if (next_prefetch_ <= i && !prefetched_.count(plan_[i]) && !inflight_.count(plan_[i])) {
      next_prefetch_ = i + 1;  // entry i is fetched on demand below
    }
    id = plan_[i];
  }
  return WaitFor(id, /*count_hit=*/true);
}

Result<std::string> FileCache::AcquireFile(int64_t id) {
  if (id < 0 || id >= static_cast<int64_t>(files_.size())) {
    return OutOfRangeError("AcquireFile: file id " + std::to_string(id) + " out of range");
  }
  return WaitFor(id, /*count_hit=*/true);
}

FileCacheStats FileCache::Stats() const {
  FileCacheStats s;
  {
    std::lock_guard<std::mutex> l(mu_);
    s = stats_;
  }
  IndexLock lk(table_.get());
  s.shared_fetched_files = table_->hdr->fetched_files;
  s.shared_fetched_bytes = table_->hdr->fetched_bytes;
  s.shared_evictions = table_->hdr->evictions;
  s.used_bytes = table_->hdr->used;
  return s;
}

}  // namespace cairn
