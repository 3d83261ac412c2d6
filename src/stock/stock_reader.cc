// Loading tensor items of a stock DCP checkpoint into their destinations.
//
// A load runs in three steps (ReadTensors):
//  1. Open each data file once (the Storage refuses symlinks and non-regular
//     files) and, on the pool, per item: check it against the file's size,
//     walk its zip records and decode its tensor record through a window
//     that serves the archive's first and last bytes from two small reads
//     (the headers, data.pkl and the directory live there), and validate the
//     record against the metadata and the requested slice.
//  2. On the pool, move the bytes. A slice that is one contiguous run of its
//     storage and lands in a contiguous destination is read straight into the
//     destination, in pieces of kPieceSize read in parallel, each piece's
//     CRC32 computed as it lands (when the whole storage is read). Anything
//     else (a strided source, a resharded slice under CRC checking, a strided
//     destination) reads the storage into a bounce buffer, verifies it and
//     copies the slice out; at most kMaxBounces run at once, so memory stays
//     bounded.
//  3. On the calling thread, combine each direct item's piece CRCs
//     (crc32_combine) and compare them with the directory's.
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <semaphore>
#include <string>
#include <vector>

#include "cairn/stock.h"

namespace cairn::stock {
namespace {

constexpr uint64_t kPieceSize = uint64_t{16} << 20;
constexpr uint64_t kHeadSize = 4096;
constexpr uint64_t kTailSize = 64 << 10;
constexpr ptrdiff_t kMaxBounces = 8;

// An archive whose first kHeadSize and last kTailSize bytes are read once and
// served from memory; other reads go to the archive.
class WindowedFile : public ReadableFile {
 public:
  static Result<std::unique_ptr<WindowedFile>> Open(const ReadableFile* f) {
    auto w = std::unique_ptr<WindowedFile>(new WindowedFile(f));
    const uint64_t size = f->Size();
    w->head_.resize(std::min(size, kHeadSize));
    CAIRN_RETURN_IF_ERROR(f->ReadAt(0, w->head_.data(), w->head_.size()));
    const uint64_t tail = std::min(size, kTailSize);
    w->tail_begin_ = size - tail;
    w->tail_.resize(tail);
    if (w->tail_begin_ < w->head_.size()) {  // overlaps the head: copy what is there
      std::memcpy(w->tail_.data(), w->head_.data() + w->tail_begin_,
                  w->head_.size() - w->tail_begin_);
      const uint64_t rest = size - w->head_.size();
      CAIRN_RETURN_IF_ERROR(
          f->ReadAt(w->head_.size(), w->tail_.data() + (w->head_.size() - w->tail_begin_), rest));
    } else {
      CAIRN_RETURN_IF_ERROR(f->ReadAt(w->tail_begin_, w->tail_.data(), tail));
    }
    return w;
  }
  Status ReadAt(uint64_t offset, void* buf, size_t n) const override {
    if (offset > Size() || n > Size() - offset) return OutOfRangeError("read past the item");
    if (offset + n <= head_.size()) {
      std::memcpy(buf, head_.data() + offset, n);
    } else if (offset >= tail_begin_) {
      std::memcpy(buf, tail_.data() + (offset - tail_begin_), n);
    } else {
      return file_->ReadAt(offset, buf, n);
    }
    return Status::OK();
  }
  uint64_t Size() const override { return file_->Size(); }

 private:
  explicit WindowedFile(const ReadableFile* f) : file_(f) {}
  const ReadableFile* file_;
  std::string head_, tail_;
  uint64_t tail_begin_ = 0;
};

std::string Shape(const std::string& dtype, const std::vector<int64_t>& dims) {
  std::string s = "torch." + dtype + "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// What step 2 does for one item.
struct Plan {
  const TensorRequest* req = nullptr;
  const ReadableFile* file = nullptr;  // the item (a FileRange)
  TensorRecord rec;
  int64_t src_start = 0;  // first viewed element in the storage
  uint64_t numel = 0;     // elements of the slice
  bool direct = false;    // the slice is one run of the storage, the destination dense
  bool crc = false;       // check the storage's CRC32
  std::vector<uint32_t> piece_crcs;
  std::unique_ptr<FileRange> range;
};

// Whether `stride` is the row-major dense stride of `shape` (size-1 dims free).
bool Dense(const std::vector<int64_t>& shape, const std::vector<int64_t>& stride) {
  int64_t expect = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] != 1 && stride[d] != expect) return false;
    expect *= shape[d];
  }
  return true;
}

// Copies the slice: element i (multi-index) moves from
// src + (start + sum i[d] * src_stride[d]) to dest + sum i[d] * dst_stride[d].
void StridedCopy(const char* src, int64_t start, const std::vector<int64_t>& src_stride, char* dst,
                 const std::vector<int64_t>& dst_stride, const std::vector<int64_t>& shape,
                 uint32_t itemsize) {
  const size_t nd = shape.size();
  for (int64_t n : shape) {
    if (n == 0) return;
  }
  if (nd == 0) {
    std::memcpy(dst, src + start * itemsize, itemsize);
    return;
  }
  // The innermost dimension as one run when both sides are contiguous in it.
  const int64_t inner = shape[nd - 1];
  const bool run = src_stride[nd - 1] == 1 && dst_stride[nd - 1] == 1;
  std::vector<int64_t> idx(nd, 0);
  while (true) {
    int64_t s = start, t = 0;
    for (size_t d = 0; d + 1 < nd; ++d) {
      s += idx[d] * src_stride[d];
      t += idx[d] * dst_stride[d];
    }
    if (run) {
      std::memcpy(dst + t * itemsize, src + s * itemsize, inner * itemsize);
    } else {
      for (int64_t k = 0; k < inner; ++k) {
        std::memcpy(dst + (t + k * dst_stride[nd - 1]) * itemsize,
                    src + (s + k * src_stride[nd - 1]) * itemsize, itemsize);
      }
    }
    size_t d = nd - 1;
    while (d-- > 0) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
    if (d == static_cast<size_t>(-1)) return;
  }
}

// Step 1 for one request: decode and validate; fills `plan` or sets *fallback.
Status PlanItem(const TensorRequest& r, const ReadableFile* data_file, bool verify_crc, Plan* plan,
                bool* fallback) {
  const uint64_t file_size = data_file->Size();
  if (r.offset > file_size || r.length > file_size - r.offset) {
    return DataLossError("data file is truncated (item ends at " +
                         std::to_string(r.offset + r.length) + ", file has " +
                         std::to_string(file_size) + " bytes)");
  }
  plan->req = &r;
  plan->range = std::make_unique<FileRange>(data_file, r.offset, r.length);
  plan->file = plan->range.get();
  CAIRN_ASSIGN_OR_RETURN(auto window, WindowedFile::Open(plan->file));
  CAIRN_ASSIGN_OR_RETURN(auto entries, ReadZipDirectory(*window));
  Result<TensorRecord> rec = DecodeTensorRecord(*window, entries, verify_crc);
  if (!rec.ok() && rec.status().code() == StatusCode::kUnimplemented) {
    *fallback = true;
    return Status::OK();
  }
  if (!rec.ok()) return rec.status();
  plan->rec = std::move(*rec);
  const TensorRecord& t = plan->rec;
  if (t.dtype != r.dtype || t.size != r.chunk_size) {
    return DataLossError("stored chunk is " + Shape(t.dtype, t.size) + ", metadata says " +
                         Shape(r.dtype, r.chunk_size));
  }
  const size_t nd = t.size.size();
  if (r.slice_offset.size() != nd || r.slice_length.size() != nd || r.dest_stride.size() != nd) {
    return DataLossError("request rank does not match the chunk");
  }
  plan->src_start = t.storage_offset;
  plan->numel = 1;
  for (size_t d = 0; d < nd; ++d) {
    const int64_t off = r.slice_offset[d], n = r.slice_length[d];
    if (off < 0 || n < 0 || off > t.size[d] || n > t.size[d] - off) {
      return DataLossError("request lies outside the stored chunk");
    }
    if (r.dest_stride[d] < 0) return InvalidArgumentError("negative destination stride");
    plan->src_start += off * t.stride[d];
    plan->numel *= static_cast<uint64_t>(n);
  }
  plan->crc = verify_crc;
  const bool whole = plan->src_start == 0 && plan->numel == t.storage_numel;
  plan->direct = plan->numel > 0 && Dense(r.slice_length, t.stride) &&
                 Dense(r.slice_length, r.dest_stride) && (whole || !verify_crc);
  return Status::OK();
}

// Step 2, bounce path: the whole storage into memory, verified, slice copied.
Status BounceItem(Plan& p, std::counting_semaphore<kMaxBounces>& bounces) {
  const TensorRecord& t = p.rec;
  if (p.numel == 0 && !p.crc) return Status::OK();
  bounces.acquire();
  struct Release {
    std::counting_semaphore<kMaxBounces>& s;
    ~Release() { s.release(); }
  } release{bounces};
  std::unique_ptr<char[]> buf(new char[std::max<uint64_t>(t.storage.size, 1)]);
  CAIRN_RETURN_IF_ERROR(p.file->ReadAt(t.storage.data_begin, buf.get(), t.storage.size));
  if (p.crc) CAIRN_RETURN_IF_ERROR(VerifyEntry(t.storage, buf.get(), t.storage.size));
  StridedCopy(buf.get(), p.src_start, t.stride, static_cast<char*>(p.req->dest), p.req->dest_stride,
              p.req->slice_length, t.itemsize);
  return Status::OK();
}

}  // namespace

Status ReadTensors(Storage* storage, const std::vector<TensorRequest>& requests, ThreadPool* pool,
                   bool verify_crc, std::vector<bool>* fallback) {
  fallback->assign(requests.size(), false);
  std::map<std::string, std::unique_ptr<ReadableFile>> files;
  for (const TensorRequest& r : requests) {
    if (files.count(r.file)) continue;
    Result<std::unique_ptr<ReadableFile>> f = storage->NewReadableFile(r.file);
    const std::string path = JoinKey(storage->Describe(), r.file);
    if (!f.ok() && f.status().code() == StatusCode::kNotFound) {
      return DataLossError(path + ": data file of tensor " + r.fqn + " is missing");
    }
    if (!f.ok()) {
      return DataLossError(path + ": cannot open data file of tensor " + r.fqn + ": " +
                           f.status().message());
    }
    files[r.file] = std::move(*f);
  }
  // Step 1.
  std::vector<Plan> plans(requests.size());
  std::unique_ptr<bool[]> fell(new bool[requests.size()]());
  {
    TaskGroup g(pool);
    for (size_t i = 0; i < requests.size(); ++i) {
      g.Run([&, i] {
        const TensorRequest& r = requests[i];
        return PlanItem(r, files[r.file].get(), verify_crc, &plans[i], &fell[i])
            .WithContext(r.where);
      });
    }
    CAIRN_RETURN_IF_ERROR(g.Wait());
  }
  // Step 2.
  std::counting_semaphore<kMaxBounces> bounces(kMaxBounces);
  {
    TaskGroup g(pool);
    for (size_t i = 0; i < requests.size(); ++i) {
      if (fell[i]) {
        (*fallback)[i] = true;
        continue;
      }
      Plan& p = plans[i];
      if (!p.direct) {
        g.Run([&p, &bounces] { return BounceItem(p, bounces).WithContext(p.req->where); });
        continue;
      }
      const uint64_t begin = p.rec.storage.data_begin + p.src_start * p.rec.itemsize;
      const uint64_t nbytes = p.numel * p.rec.itemsize;
      const size_t pieces = (nbytes + kPieceSize - 1) / kPieceSize;
      p.piece_crcs.assign(pieces, 0);
      for (size_t k = 0; k < pieces; ++k) {
        g.Run([&p, begin, nbytes, k] {
          const uint64_t at = k * kPieceSize, n = std::min(kPieceSize, nbytes - at);
          char* dst = static_cast<char*>(p.req->dest) + at;
          CAIRN_RETURN_IF_ERROR(p.file->ReadAt(begin + at, dst, n).WithContext(p.req->where));
          if (p.crc) p.piece_crcs[k] = Crc32(0, dst, n);
          return Status::OK();
        });
      }
    }
    CAIRN_RETURN_IF_ERROR(g.Wait());
  }
  // Step 3.
  for (Plan& p : plans) {
    if (p.req == nullptr || !p.direct || !p.crc) continue;
    const uint64_t nbytes = p.numel * p.rec.itemsize;
    uint32_t crc = 0;
    for (size_t k = 0; k < p.piece_crcs.size(); ++k) {
      const uint64_t n = std::min(kPieceSize, nbytes - k * kPieceSize);
      crc = static_cast<uint32_t>(crc32_combine(crc, p.piece_crcs[k], static_cast<z_off_t>(n)));
    }
    if (crc != p.rec.storage.crc32) {
      return DataLossError(p.req->where + ": checksum mismatch in " + p.rec.storage.name +
                           " (if it was saved with CRC32 disabled, pass verify_crc=False)");
    }
  }
  return Status::OK();
}

Status ReadItem(Storage* storage, const std::string& file, uint64_t offset, uint64_t length,
                const std::string& where, const std::string& fqn, void* dest) {
  Result<std::unique_ptr<ReadableFile>> f = storage->NewReadableFile(file);
  const std::string path = JoinKey(storage->Describe(), file);
  if (!f.ok() && f.status().code() == StatusCode::kNotFound) {
    return DataLossError(path + ": data file of tensor " + fqn + " is missing");
  }
  if (!f.ok()) {
    return DataLossError(path + ": cannot open data file of tensor " + fqn + ": " +
                         f.status().message());
  }
  const uint64_t size = (*f)->Size();
  if (offset > size || length > size - offset) {
    return DataLossError(where + ": data file is truncated (item ends at " +
                         std::to_string(offset + length) + ", file has " + std::to_string(size) +
                         " bytes)");
  }
  return (*f)->ReadAt(offset, dest, length).WithContext(where);
}

bool IsStockCheckpoint(Storage* storage) {
  for (const char* name : {".metadata", "__0.metadata"}) {
    Result<std::unique_ptr<ReadableFile>> f = storage->NewReadableFile(name);
    char first = 0;
    if (f.ok() && (*f)->Size() > 0 && (*f)->ReadAt(0, &first, 1).ok() &&
        static_cast<uint8_t>(first) == 0x80) {
      return true;
    }
  }
  return false;
}

Result<std::string> ReadMetadataFile(Storage* storage, const std::string& name, uint64_t max_size) {
  const std::string path = JoinKey(storage->Describe(), name);
  Result<std::unique_ptr<ReadableFile>> f = storage->NewReadableFile(name);
  if (!f.ok() && f.status().code() == StatusCode::kNotFound) {
    return NotFoundError(path + ": no DCP metadata file");
  }
  if (!f.ok()) return DataLossError(path + ": cannot open DCP metadata: " + f.status().message());
  if ((*f)->Size() > max_size) {
    return DataLossError(path + ": DCP metadata larger than " + std::to_string(max_size) +
                         " bytes");
  }
  std::string raw((*f)->Size(), '\0');
  Status s = (*f)->ReadAt(0, raw.data(), raw.size());
  if (!s.ok()) return DataLossError(path + ": cannot read DCP metadata: " + s.message());
  return raw;
}

}  // namespace cairn::stock
