// CopyFile: one file from one storage to another, in parallel ranges.
#include <algorithm>
#include <atomic>

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
