// StagingPool: the life cycle of slots (described in include/cairn/staging.h).
// The staging engine's save steps are in staging_engine.cc, ParallelCopy in
// parallel_copy.cc.
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cstring>
#include <limits>

#include "cairn/staging.h"
#include "staging/mapped_file.h"
#include "storage/posix/posix_storage.h"

namespace cairn {

struct StagingPool::Slot {
  // Null until first acquired; shared with the files OpenMapped returned.
  std::shared_ptr<internal::MappedShmFile> file;
  bool in_use = false;
  bool populated = false;     // pre-faulted in this process since the last map
  uint64_t last_release = 0;  // release_seq_ at the last Release (0 = never)
  // PaddingKnownZero / SetPaddingZeroed: the padding last zeroed, and where.
  std::vector<uint64_t> zeroed;
  const char* zeroed_data = nullptr;
};

std::string StagingPool::SlotDirName(size_t index) { return "slot" + std::to_string(index); }

StagingPool::StagingPool(StagingPoolOptions opts) : opts_(std::move(opts)) {
  for (size_t i = 0; i < opts_.num_slots; ++i) slots_.push_back(std::make_unique<Slot>());
}

StagingPool::~StagingPool() { Close().IgnoreError(); }

Result<std::unique_ptr<StagingPool>> StagingPool::Open(StagingPoolOptions opts) {
  if (opts.root_dir.empty() || opts.root_dir.front() != '/') {
    return InvalidArgumentError("staging pool directory must be an absolute path, got '" +
                                opts.root_dir + "'");
  }
  if (opts.num_slots == 0 || opts.num_slots > 1024) {
    return InvalidArgumentError("staging pool needs 1 to 1024 slots, got " +
                                std::to_string(opts.num_slots));
  }
  while (opts.root_dir.size() > 1 && opts.root_dir.back() == '/') opts.root_dir.pop_back();
  if (opts.file_key.empty()) opts.file_key = "data/r" + std::to_string(opts.rank) + ".bin";
  CAIRN_RETURN_IF_ERROR(ValidateKey(opts.file_key).WithContext("staging pool file name"));
  CAIRN_RETURN_IF_ERROR(internal::MkdirAll(opts.root_dir).WithContext("staging pool"));
  return std::unique_ptr<StagingPool>(new StagingPool(std::move(opts)));
}

Result<StagingSlot> StagingPool::SlotView(size_t index) const {
  const Slot& s = *slots_[index];
  StagingSlot v;
  v.index = index;
  v.data = s.file ? s.file->data() : nullptr;
  v.capacity = s.file ? s.file->size() : 0;
  v.key = SlotDirName(index) + "/" + opts_.file_key;
  v.path = opts_.root_dir + "/" + v.key;
  return v;
}

Result<StagingSlot> StagingPool::AcquireLocked(size_t index, uint64_t min_bytes, ThreadPool* pool) {
  Slot& s = *slots_[index];
  std::string key = SlotDirName(index) + "/" + opts_.file_key;
  std::string path = opts_.root_dir + "/" + key;
  auto ctx = [&](const Status& st) {
    return st.WithContext("staging slot " + std::to_string(index) + " of rank " +
                          std::to_string(opts_.rank));
  };
  if (s.file && s.file.use_count() > 1) {
    return ctx(FailedPreconditionError("a restore is reading it"));
  }
  if (!s.file) {
    CAIRN_RETURN_IF_ERROR(ctx(internal::MkdirAll(path.substr(0, path.rfind('/')))));
    auto f = internal::MappedShmFile::Open(path);
    if (!f.ok()) return ctx(f.status());
    s.file = std::move(f).value();
  }
  if (min_bytes > s.file->size()) {
    CAIRN_RETURN_IF_ERROR(ctx(s.file->Grow(min_bytes)));
    s.populated = false;
  }
  if (opts_.populate && !s.populated) {
    CAIRN_RETURN_IF_ERROR(ctx(s.file->Populate(pool)));
    s.populated = true;
  }
  s.in_use = true;
  return SlotView(index);
}

Result<StagingSlot> StagingPool::Acquire(uint64_t min_bytes, ThreadPool* pool) {
  std::lock_guard<std::mutex> l(mu_);
  if (closed_) return FailedPreconditionError("staging pool is closed");
  size_t best = slots_.size();
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = *slots_[i];
    if (s.in_use || (s.file && s.file.use_count() > 1)) continue;  // staging, or being read
    if (best == slots_.size() || slots_[i]->last_release < slots_[best]->last_release) best = i;
  }
  if (best == slots_.size()) {
    return ResourceExhaustedError("all " + std::to_string(slots_.size()) +
                                  " staging slots are in use or being read (release one, or "
                                  "open the pool with more slots)");
  }
  return AcquireLocked(best, min_bytes, pool);
}

Result<StagingSlot> StagingPool::AcquireSlot(size_t index, uint64_t min_bytes, ThreadPool* pool) {
  std::lock_guard<std::mutex> l(mu_);
  if (closed_) return FailedPreconditionError("staging pool is closed");
  if (index >= slots_.size()) {
    return InvalidArgumentError("staging slot " + std::to_string(index) +
                                " out of range (pool has " + std::to_string(slots_.size()) + ")");
  }
  if (slots_[index]->in_use) {
    return FailedPreconditionError("staging slot " + std::to_string(index) + " is in use");
  }
  return AcquireLocked(index, min_bytes, pool);
}

Status StagingPool::Release(size_t index) {
  std::lock_guard<std::mutex> l(mu_);
  if (index >= slots_.size()) {
    return InvalidArgumentError("staging slot " + std::to_string(index) + " out of range");
  }
  Slot& s = *slots_[index];
  if (!s.in_use) {
    return FailedPreconditionError("staging slot " + std::to_string(index) + " is not in use");
  }
  s.in_use = false;
  s.last_release = ++release_seq_;
  return Status::OK();
}

namespace {

// A slot's bytes read out of its mapping (StagingPool::OpenMapped). Holding
// the mapping keeps the slot from being acquired, so it cannot change size.
class MappedSlotFile final : public ReadableFile {
 public:
  explicit MappedSlotFile(std::shared_ptr<internal::MappedShmFile> file) : file_(std::move(file)) {}

  Status ReadAt(uint64_t offset, void* buf, size_t n) const override {
    if (offset > file_->size() || file_->size() - offset < n) {
      return OutOfRangeError("read of " + std::to_string(n) + " bytes at " +
                             std::to_string(offset) + " past the end of " + file_->path());
    }
    std::memcpy(buf, file_->data() + offset, n);
    return Status::OK();
  }
  uint64_t Size() const override { return file_->size(); }
  const char* MappedData() const override { return file_->data(); }

 private:
  std::shared_ptr<internal::MappedShmFile> file_;
};

}  // namespace

Result<std::unique_ptr<ReadableFile>> StagingPool::OpenMapped(size_t index,
                                                              const std::string& path) {
  std::lock_guard<std::mutex> l(mu_);
  if (closed_) return FailedPreconditionError("staging pool is closed");
  if (index >= slots_.size()) {
    return InvalidArgumentError("staging slot " + std::to_string(index) + " out of range");
  }
  const Slot& s = *slots_[index];
  const std::string what = "staging slot " + std::to_string(index);
  if (s.in_use) return FailedPreconditionError(what + " is in use");
  if (!s.file || s.file->data() == nullptr) {
    return FailedPreconditionError(what + " is not mapped in this process");
  }
  if (!s.file->IsAt(path)) return FailedPreconditionError(path + " is not " + what + "'s file");
  return std::unique_ptr<ReadableFile>(new MappedSlotFile(s.file));
}

Status StagingPool::AcquiredMemory(size_t index, std::string_view what, char** data,
                                   uint64_t* size) const {
  std::lock_guard<std::mutex> l(mu_);
  if (index >= slots_.size()) {
    return InvalidArgumentError("staging slot " + std::to_string(index) + " out of range");
  }
  if (!slots_[index]->in_use) {
    return FailedPreconditionError(std::string(what) + " staging slot " + std::to_string(index) +
                                   ", which is not acquired");
  }
  *data = slots_[index]->file->data();
  *size = slots_[index]->file->size();
  return Status::OK();
}

template <typename Span>
Status StagingPool::CopySlot(size_t index, std::span<const Span> spans, ThreadPool* pool,
                             uint64_t piece_bytes) {
  constexpr bool kIn = std::is_same_v<Span, CopySpan>;
  char* data;
  uint64_t cap;
  CAIRN_RETURN_IF_ERROR(AcquiredMemory(index, kIn ? "copy into" : "copy out of", &data, &cap));
  // The slot is the caller's until Release, so the copy runs unlocked.
  if constexpr (kIn) {
    SetPaddingZeroed(index, nullptr, {});  // it may write into the padding
    return ParallelCopy(data, cap, spans, pool, piece_bytes)
        .WithContext("staging into slot " + std::to_string(index));
  } else {
    return ParallelCopyOut(data, cap, spans, pool, piece_bytes)
        .WithContext("copying out of staging slot " + std::to_string(index));
  }
}

bool StagingPool::PaddingKnownZero(size_t index, const char* data,
                                   const std::vector<uint64_t>& ranges) const {
  std::lock_guard<std::mutex> l(mu_);
  if (index >= slots_.size()) return false;
  const Slot& s = *slots_[index];
  return data != nullptr && s.zeroed_data == data && s.zeroed == ranges;
}

void StagingPool::SetPaddingZeroed(size_t index, const char* data, std::vector<uint64_t> ranges) {
  std::lock_guard<std::mutex> l(mu_);
  if (index >= slots_.size()) return;
  slots_[index]->zeroed = std::move(ranges);
  slots_[index]->zeroed_data = data;
}

Status StagingPool::CopyIn(size_t index, std::span<const CopySpan> spans, ThreadPool* pool,
                           uint64_t piece_bytes) {
  return CopySlot(index, spans, pool, piece_bytes);
}

Status StagingPool::CopyOut(size_t index, std::span<const CopyOutSpan> spans, ThreadPool* pool,
                            uint64_t piece_bytes) {
  return CopySlot(index, spans, pool, piece_bytes);
}

Result<StagingSlot> StagingPool::Peek(size_t index) const {
  std::lock_guard<std::mutex> l(mu_);
  if (index >= slots_.size()) {
    return InvalidArgumentError("staging slot " + std::to_string(index) + " out of range");
  }
  return SlotView(index);
}

bool StagingPool::in_use(size_t index) const {
  std::lock_guard<std::mutex> l(mu_);
  return index < slots_.size() && slots_[index]->in_use;
}

uint64_t StagingPool::footprint() const {
  std::lock_guard<std::mutex> l(mu_);
  uint64_t total = 0;
  for (const auto& s : slots_) total += s->file ? s->file->size() : 0;
  return total;
}

Status StagingPool::RemoveFiles() {
  std::lock_guard<std::mutex> l(mu_);
  return RemoveFilesLocked();
}

namespace {

// Deletes `path` unless a live process holds its flock (then it is that
// process's slot, not a leftover); false when it was left alone.
bool RemoveUnlessLocked(const std::string& path, Status* first) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return true;  // nothing there
  bool ours = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
  if (ours && ::unlink(path.c_str()) != 0 && errno != ENOENT && first->ok()) {
    *first = ErrnoToStatus(errno, "delete " + path);
  }
  ::close(fd);
  return ours;
}

// Removes the directories from dirname(path) up to (excluding) `root` that
// are empty, innermost first. Another rank's files keep them alive
// (ENOTEMPTY): that rank removes them, and the last rank to finish its
// unlinks always finds them empty.
void RemoveEmptyParents(const std::string& path, const std::string& root) {
  std::string dir = path.substr(0, path.rfind('/'));
  while (dir.size() > root.size()) {
    if (::rmdir(dir.c_str()) != 0) break;
    dir = dir.substr(0, dir.rfind('/'));
  }
}

}  // namespace

Status StagingPool::RemoveFilesLocked() {
  Status first;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = *slots_[i];
    std::string path = opts_.root_dir + "/" + SlotDirName(i) + "/" + opts_.file_key;
    if (s.file) {
      Status st = s.file->Unlink();
      if (first.ok() && !st.ok()) first = st;
    } else if (!RemoveUnlessLocked(path, &first)) {
      continue;  // a live process's file: its directories stay too
    }
    RemoveEmptyParents(path, opts_.root_dir);
  }
  // Slots beyond num_slots, left by an earlier run configured with more.
  if (DIR* d = ::opendir(opts_.root_dir.c_str())) {
    std::vector<std::string> extra;
    while (struct dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name.size() <= 4 || name.compare(0, 4, "slot") != 0 || name.size() > 10) continue;
      if (name.find_first_not_of("0123456789", 4) != std::string::npos) continue;
      if (std::stoul(name.substr(4)) >= slots_.size()) extra.push_back(name);
    }
    ::closedir(d);
    for (const std::string& name : extra) {
      std::string path = opts_.root_dir + "/" + name + "/" + opts_.file_key;
      if (RemoveUnlessLocked(path, &first)) RemoveEmptyParents(path, opts_.root_dir);
    }
  }
  ::rmdir(opts_.root_dir.c_str());
  return first.WithContext("removing staging files of rank " + std::to_string(opts_.rank) + " in " +
                           opts_.root_dir);
}

Status StagingPool::Close() {
  std::lock_guard<std::mutex> l(mu_);
  if (closed_) return Status::OK();
  closed_ = true;
  // Unlink first, while this process still holds each file's lock.
  Status first = opts_.remove_on_close ? RemoveFilesLocked() : Status::OK();
  for (auto& s : slots_) {
    if (s->file && s->file.use_count() == 1) {
      Status st = s->file->Close(/*unlink=*/false);
      if (first.ok() && !st.ok()) first = st.WithContext("closing staging pool " + opts_.root_dir);
    }
    s->file.reset();  // a file OpenMapped returned unmaps it when it goes
    s->in_use = false;
  }
  return first;
}

}  // namespace cairn
