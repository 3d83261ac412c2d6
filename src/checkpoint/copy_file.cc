// CopyFile: one file from one storage to another, in parallel ranges.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include "cairn/checkpoint.h"
#include "checkpoint/io_util.h"

namespace cairn {

Result<uint64_t> CopyFile(Storage* src, std::string_view src_key, Storage* dst,
                          std::string_view dst_key, ThreadPool* pool, const CopyFileOptions& opts,
                          const ProgressFn& progress) {
  const std::string where = "copying " + src->Describe() + ": " + std::string(src_key) + " to " +
                            dst->Describe() + ": " + std::string(dst_key);
  if (opts.chunk_bytes == 0) return InvalidArgumentError(where + ": chunk size 0");
  auto opened = src->NewReadableFile(src_key, ReadOptions{});
  if (!opened.ok()) return opened.status().WithContext(where);
  std::unique_ptr<ReadableFile> in = std::move(opened).value();
  const uint64_t size = in->Size();
  WriteOptions wo;
  wo.direct_io = opts.direct_io;
  auto created = dst->NewWritableFile(dst_key, wo);
  if (!created.ok()) return created.status().WithContext(where);
  std::unique_ptr<WritableFile> out = std::move(created).value();
  Status s = out->Allocate(size);
  std::atomic<uint64_t> done{0};
  if (s.ok()) {
    TaskGroup group(pool);
    for (uint64_t start = 0; start < size; start += opts.chunk_bytes) {
      const uint64_t len = std::min(opts.chunk_bytes, size - start);
      group.Run([&, start, len]() -> Status {
        char* buf = internal::ThreadPieceBuffer();
        if (!buf) return ResourceExhaustedError("cannot allocate an I/O buffer");
        for (uint64_t off = start; off < start + len;) {
          const uint64_t n = std::min(internal::kIoPiece, start + len - off);
          Status rs = in->ReadAt(off, buf, n);
          if (!rs.ok()) {
            if (rs.code() == StatusCode::kOutOfRange) {
              return DataLossError(std::string(src_key) + ": truncated while being copied");
            }
            return rs;
          }
          CAIRN_RETURN_IF_ERROR(out->WriteAt(off, buf, n));
          off += n;
          const uint64_t d = done.fetch_add(n) + n;
          if (progress) progress(d, size);
        }
        return Status::OK();
      });
    }
    s = group.Wait();
  }
  if (s.ok() && opts.sync) s = out->Sync();
  if (!s.ok()) {
    out->Abort().IgnoreError();
    return s.WithContext(where);
  }
  s = out->Close();
  if (!s.ok()) return s.WithContext(where);
  return size;
}

}  // namespace cairn

// ---- WriteDataFileStaged -----------------------------------------------------
//
// The staged file is written through StagingTee, a StorageWrapper whose file
// (TeeFile) counts the bytes of each chunk that WriteAt and Hole have put in
// place. When a chunk is complete, a task on the copy pool reads it back from
// the staged file (page cache) and writes it to the target. WriteDataFile
// covers every byte of [0, size) with WriteAt or Hole except, possibly, a
// zero tail after the last item; Close() sends whatever chunk is still
// incomplete (its missing bytes are the zeros Allocate left), waits for every
// copy, and syncs and closes the target. A failed copy fails the next
// WriteAt (so the local write stops early) and Close(); Abort() and any
// failure abort the target file.

namespace cairn {
namespace {

class TeeFile final : public WritableFile {
 public:
  TeeFile(std::unique_ptr<WritableFile> local, Storage* stage, Storage* target, std::string key,
          ThreadPool* copy_pool, const CopyFileOptions& opts)
      : local_(std::move(local)),
        stage_(stage),
        target_(target),
        key_(std::move(key)),
        opts_(opts),
        group_(copy_pool) {}

  ~TeeFile() override {
    group_.Wait().IgnoreError();
    if (out_ && !closed_) out_->Abort().IgnoreError();
  }

  Status WriteAt(uint64_t offset, const void* data, size_t n) override {
    if (group_.Cancelled()) return group_.Wait();
    CAIRN_RETURN_IF_ERROR(local_->WriteAt(offset, data, n));
    Credit(offset, n);
    return Status::OK();
  }

  Status Hole(uint64_t offset, uint64_t n) override {
    CAIRN_RETURN_IF_ERROR(local_->Hole(offset, n));
    Credit(offset, n);
    return Status::OK();
  }

  Status Allocate(uint64_t size) override {
    CAIRN_RETURN_IF_ERROR(local_->Allocate(size));
    std::lock_guard<std::mutex> l(mu_);
    if (out_) return FailedPreconditionError(key_ + ": staged file allocated twice");
    WriteOptions wo;
    wo.direct_io = opts_.direct_io;
    CAIRN_ASSIGN_OR_RETURN(out_, target_->NewWritableFile(key_, wo));
    CAIRN_RETURN_IF_ERROR(out_->Allocate(size));
    CAIRN_ASSIGN_OR_RETURN(in_, stage_->NewReadableFile(key_, ReadOptions{}));
    size_ = size;
    const uint64_t chunks = (size + opts_.chunk_bytes - 1) / opts_.chunk_bytes;
    missing_.resize(chunks);
    for (uint64_t c = 0; c < chunks; ++c) missing_[c] = ChunkLen(c);
    return Status::OK();
  }

  Status Sync() override { return local_->Sync(); }

  Status Close() override {
    if (closed_) return Status::OK();
    closed_ = true;
    Status s = local_->Close();
    if (!out_) {  // never allocated: an empty file
      if (!s.ok()) return s;
      WriteOptions wo;
      wo.direct_io = opts_.direct_io;
      CAIRN_ASSIGN_OR_RETURN(out_, target_->NewWritableFile(key_, wo));
    } else if (s.ok()) {
      std::vector<uint64_t> rest;
      {
        std::lock_guard<std::mutex> l(mu_);
        for (uint64_t c = 0; c < missing_.size(); ++c) {
          if (missing_[c] != kSent) {
            missing_[c] = kSent;
            rest.push_back(c);
          }
        }
      }
      for (uint64_t c : rest) Copy(c);
    }
    Status copied = group_.Wait();
    if (s.ok()) s = copied;
    if (s.ok() && opts_.sync) s = out_->Sync();
    if (!s.ok()) {
      out_->Abort().IgnoreError();
      return s;
    }
    return out_->Close();
  }

  Status Abort() override {
    closed_ = true;
    Status s = local_->Abort();
    group_.Wait().IgnoreError();
    if (out_) out_->Abort().IgnoreError();
    return s;
  }

 private:
  static constexpr uint64_t kSent = ~uint64_t{0};

  uint64_t ChunkLen(uint64_t c) const {
    return std::min(opts_.chunk_bytes, size_ - c * opts_.chunk_bytes);
  }

  // Counts [offset, offset + n) as in place; sends each chunk it completes.
  void Credit(uint64_t offset, uint64_t n) {
    std::vector<uint64_t> ready;
    {
      std::lock_guard<std::mutex> l(mu_);
      while (n > 0 && offset < size_) {
        const uint64_t c = offset / opts_.chunk_bytes;
        const uint64_t take = std::min(n, (c + 1) * opts_.chunk_bytes - offset);
        if (missing_[c] != kSent) {
          missing_[c] -= std::min(missing_[c], take);
          if (missing_[c] == 0) {
            missing_[c] = kSent;
            ready.push_back(c);
          }
        }
        offset += take;
        n -= take;
      }
    }
    for (uint64_t c : ready) Copy(c);
  }

  void Copy(uint64_t c) {
    const uint64_t start = c * opts_.chunk_bytes, len = ChunkLen(c);
    group_.Run([this, start, len]() -> Status {
      char* buf = internal::ThreadPieceBuffer();
      if (!buf) return ResourceExhaustedError("cannot allocate an I/O buffer");
      for (uint64_t off = start; off < start + len;) {
        const uint64_t n = std::min(internal::kIoPiece, start + len - off);
        CAIRN_RETURN_IF_ERROR(in_->ReadAt(off, buf, n));
        CAIRN_RETURN_IF_ERROR(out_->WriteAt(off, buf, n));
        off += n;
      }
      return Status::OK();
    });
  }

  std::unique_ptr<WritableFile> local_;
  Storage* const stage_;
  Storage* const target_;
  const std::string key_;
  const CopyFileOptions opts_;
  std::unique_ptr<WritableFile> out_;
  std::unique_ptr<ReadableFile> in_;
  uint64_t size_ = 0;
  std::mutex mu_;
  std::vector<uint64_t> missing_;  // bytes not yet in place per chunk, kSent once sent
  bool closed_ = false;
  TaskGroup group_;  // last member: destroyed (joined) first
};

class StagingTee final : public StorageWrapper {
 public:
  StagingTee(Storage* stage, Storage* target, ThreadPool* copy_pool, const CopyFileOptions& opts)
      : StorageWrapper(stage), dst_(target), copy_pool_(copy_pool), opts_(opts) {}

  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view key,
                                                        const WriteOptions& wo) override {
    CAIRN_ASSIGN_OR_RETURN(auto local, StorageWrapper::NewWritableFile(key, wo));
    return std::unique_ptr<WritableFile>(
        new TeeFile(std::move(local), this->target(), dst_, std::string(key), copy_pool_, opts_));
  }

 private:
  Storage* const dst_;  // the upload target (target() is the staging storage)
  ThreadPool* const copy_pool_;
  const CopyFileOptions opts_;
};

}  // namespace

Result<DataFileResult> WriteDataFileStaged(Storage* stage, Storage* target, std::string_view key,
                                           const std::vector<BufferRef>& buffers, ThreadPool* pool,
                                           ThreadPool* copy_pool, const DataFileOptions& opts,
                                           const CopyFileOptions& copy_opts) {
  const std::string where = "staging " + std::string(key) + " to " + target->Describe();
  if (copy_opts.chunk_bytes == 0) return InvalidArgumentError(where + ": chunk size 0");
  if (copy_pool == nullptr || copy_pool == pool) {
    return InvalidArgumentError(where + ": the copy pool must be a pool of its own");
  }
  StagingTee tee(stage, target, copy_pool, copy_opts);
  DataFileOptions local_opts = opts;
  local_opts.direct_io = false;
  local_opts.sync = false;
  auto r = WriteDataFile(&tee, key, buffers, pool, local_opts);
  if (!r.ok()) return r.status().WithContext(where);
  return r;
}

}  // namespace cairn
