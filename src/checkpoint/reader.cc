// Reading a checkpoint: CheckpointReader (verified parallel reads of items
// or byte ranges into caller memory) and LoadBuffers.
//
// Every byte read from a data file is checked against the manifest's block
// checksums before the caller sees success. A file whose size differs from
// the manifest's record, a missing file and a checksum mismatch are all
// DataLoss, and the message names the checkpoint, the file and the item, so a
// user knows what to delete or restore.
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "cairn/checkpoint.h"
#include "checkpoint/io_util.h"
#include "io/stream_copy.h"

namespace cairn {

namespace internal {

std::string Where(Storage* storage, std::string_view dir) {
  return storage->Describe() + (dir.empty() ? "" : "/") + std::string(dir);
}

Result<std::unique_ptr<ReadableFile>> OpenDataFile(Storage* storage, std::string_view dir,
                                                   const ManifestFile& f,
                                                   const std::string& needed_by,
                                                   const ReadOptions& opts) {
  auto file = storage->NewReadableFile(internal::JoinDir(dir, f.key), opts);
  if (!file.ok()) {
    if (file.status().code() == StatusCode::kNotFound) {
      return DataLossError(f.key + ": data file missing (holds " + needed_by + ")");
    }
    if (file.status().code() == StatusCode::kFailedPrecondition ||
        file.status().code() == StatusCode::kInvalidArgument) {
      // Not a regular file (a FIFO, a device, a directory): never read it.
      return DataLossError(f.key + ": " + file.status().message() + " (holds " + needed_by + ")");
    }
    return file.status().WithContext(f.key + " (holds " + needed_by + ")");
  }
  uint64_t size = (*file)->Size();
  if (size != f.size) {
    return DataLossError(f.key + ": " + (size < f.size ? "truncated" : "has extra bytes") + ": " +
                         std::to_string(size) + " bytes, the manifest records " +
                         std::to_string(f.size) + " (holds " + needed_by + ")");
  }
  return file;
}

}  // namespace internal

namespace {

using internal::kIoPiece;
using internal::OpenDataFile;
using internal::Where;

// What a block read out of a mapping (ReadableFile::MappedData) hashes and
// then copies: small enough to still be in L1/L2 for the copy.
constexpr uint64_t kMappedPiece = uint64_t{64} << 10;

// Reads block `b` of an item into dest (len bytes) and checks its checksum.
Status ReadBlock(const ReadableFile* file, const ManifestFile& f, const ItemLocation& loc,
                 uint64_t b, uint64_t block_size, char* dest, const std::string& name) {
  uint64_t start = b * block_size;
  uint64_t len = std::min(block_size, loc.length - start);
  internal::Hasher h;
  if (!h.ok()) return ResourceExhaustedError("cannot allocate a hash state");
  // Bytes this process has mapped are hashed a piece at a time, and each
  // piece copied while it is in cache, with streaming stores (the destination
  // is not read soon). The bytes copied are the bytes hashed: the slot is
  // held, and no cooperating process writes another's slot file. Other files
  // are read in large pieces, each hashed right after it lands.
  const char* mapped = file->MappedData();
  auto truncated = [&] {
    return DataLossError(f.key + ": truncated while reading block " + std::to_string(b) + " of " +
                         name);
  };
  for (uint64_t done = 0; done < len;) {
    const uint64_t n = std::min(mapped ? kMappedPiece : kIoPiece, len - done);
    const uint64_t at = loc.offset + start + done;
    if (mapped) {
      if (at > file->Size() || file->Size() - at < n) return truncated();
      h.Update(mapped + at, n);
      internal::StreamCopy(dest + done, mapped + at, n);
    } else {
      Status s = file->ReadAt(at, dest + done, n);
      if (s.code() == StatusCode::kOutOfRange) return truncated();
      if (!s.ok()) return s.WithContext(f.key + ": reading " + name);
      h.Update(dest + done, n);
    }
    done += n;
  }
  if (h.Digest() != loc.checksums[b]) {
    return DataLossError(f.key + ": checksum mismatch in block " + std::to_string(b) + " of " +
                         name);
  }
  return Status::OK();
}

// One whole block of an item, to be read into `dest` (CheckpointReader::Read).
struct BlockRead {
  const ReadableFile* file;
  const ManifestFile* mf;
  const ItemLocation* loc;
  uint64_t block;
  char* dest;
  uint64_t file_off;  // where the block starts in the file
  uint64_t len;
  const std::string* name;
};

// Padding between items that a coalesced read may fetch and drop.
constexpr uint64_t kMaxReadGap = uint64_t{64} << 10;

// Reads neighbouring blocks of one file (sorted, not overlapping) with one
// ReadV, skipping the gaps, then verifies each block's checksum.
Status ReadBlocks(const std::vector<BlockRead>& run) {
  std::vector<ReadableFile::Segment> segs;
  segs.reserve(2 * run.size());
  uint64_t at = run.front().file_off;
  for (const BlockRead& r : run) {
    if (r.file_off > at) segs.push_back({nullptr, static_cast<size_t>(r.file_off - at)});
    segs.push_back({r.dest, static_cast<size_t>(r.len)});
    at = r.file_off + r.len;
  }
  const BlockRead& first = run.front();
  Status s = first.file->ReadV(first.file_off, segs);
  if (!s.ok()) {
    if (s.code() == StatusCode::kOutOfRange) {
      return DataLossError(first.mf->key + ": truncated while reading block " +
                           std::to_string(first.block) + " of " + *first.name);
    }
    return s.WithContext(first.mf->key + ": reading " + *first.name);
  }
  for (const BlockRead& r : run) {
    if (XXH3_64bits(r.dest, r.len) != r.loc->checksums[r.block]) {
      return DataLossError(r.mf->key + ": checksum mismatch in block " + std::to_string(r.block) +
                           " of " + *r.name);
    }
  }
  return Status::OK();
}

}  // namespace

Result<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(Storage* storage, std::string dir,
                                                                 const ReadOptions& opts) {
  CAIRN_ASSIGN_OR_RETURN(Manifest m, ReadManifest(storage, dir));
  return std::unique_ptr<CheckpointReader>(
      new CheckpointReader(storage, std::move(dir), std::move(m), opts));
}

Result<const ItemLocation*> CheckpointReader::Locate(const ItemRef& item) const {
  if (item.kind == ItemRef::Kind::kBytes) {
    if (item.index >= manifest_.bytes.size()) {
      return InvalidArgumentError("bytes item " + std::to_string(item.index) + " out of range");
    }
    return &manifest_.bytes[item.index].location;
  }
  if (item.index >= manifest_.tensors.size() ||
      item.chunk >= manifest_.tensors[item.index].chunks.size()) {
    return InvalidArgumentError("tensor chunk " + std::to_string(item.index) + "/" +
                                std::to_string(item.chunk) + " out of range");
  }
  return &manifest_.tensors[item.index].chunks[item.chunk].location;
}

std::string CheckpointReader::ItemName(const ItemRef& item) const {
  if (item.kind == ItemRef::Kind::kBytes) {
    return item.index < manifest_.bytes.size() ? "item '" + manifest_.bytes[item.index].fqn + "'"
                                               : "?";
  }
  if (item.index >= manifest_.tensors.size()) return "?";
  return internal::ChunkName(manifest_.tensors[item.index], item.chunk);
}

Result<const ReadableFile*> CheckpointReader::File(uint32_t index, const std::string& needed_by,
                                                   bool shared) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = files_.find(index);
  if (shared && opts_.direct_io && given_.count(index) == 0) {
    // Read through the page cache (a file UseFile gave is read as it is).
    auto b = buffered_.find(index);
    if (b != buffered_.end()) return b->second.get();
    ReadOptions buffered = opts_;
    buffered.direct_io = false;
    CAIRN_ASSIGN_OR_RETURN(
        auto f, OpenDataFile(storage_, dir_, manifest_.files[index], needed_by, buffered));
    const ReadableFile* raw = f.get();
    buffered_.emplace(index, std::move(f));
    return raw;
  }
  if (it != files_.end()) return it->second.get();
  CAIRN_ASSIGN_OR_RETURN(auto f,
                         OpenDataFile(storage_, dir_, manifest_.files[index], needed_by, opts_));
  const ReadableFile* raw = f.get();
  files_.emplace(index, std::move(f));
  return raw;
}

Status CheckpointReader::CheckFiles() {
  std::vector<std::string> holder(manifest_.files.size());
  for (size_t t = 0; t < manifest_.tensors.size(); ++t) {
    for (size_t c = 0; c < manifest_.tensors[t].chunks.size(); ++c) {
      auto& h = holder[manifest_.tensors[t].chunks[c].location.file];
      if (h.empty()) h = internal::ChunkName(manifest_.tensors[t], c);
    }
  }
  for (const auto& b : manifest_.bytes) {
    auto& h = holder[b.location.file];
    if (h.empty()) h = "item '" + b.fqn + "'";
  }
  for (size_t f = 0; f < manifest_.files.size(); ++f) {
    auto r = File(static_cast<uint32_t>(f), holder[f].empty() ? "no items" : holder[f]);
    if (!r.ok()) return r.status().WithContext("opening " + Where(storage_, dir_));
  }
  return Status::OK();
}

Status CheckpointReader::UseFile(std::string_view key, std::unique_ptr<ReadableFile> file) {
  for (uint32_t i = 0; i < manifest_.files.size(); ++i) {
    const ManifestFile& f = manifest_.files[i];
    if (f.key != key) continue;
    if (file->Size() != f.size) {
      return DataLossError(Where(storage_, dir_) + ": " + f.key + ": " +
                           std::to_string(file->Size()) + " bytes, the manifest records " +
                           std::to_string(f.size));
    }
    std::lock_guard<std::mutex> l(mu_);
    files_[i] = std::move(file);
    given_.insert(i);
    return Status::OK();
  }
  return InvalidArgumentError(Where(storage_, dir_) + " has no data file '" + std::string(key) +
                              "'");
}

void CheckpointReader::CloseFiles() {
  std::lock_guard<std::mutex> l(mu_);
  files_.clear();
  buffered_.clear();
  given_.clear();
}

Status CheckpointReader::Read(const std::vector<ReadRequest>& requests, ThreadPool* pool) {
  const std::string where = "reading " + Where(storage_, dir_);
  // Validate every request and open the files first (serially: cheap), so
  // the parallel part only reads.
  std::vector<const ReadableFile*> files(requests.size());
  std::vector<const ItemLocation*> locs(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const ReadRequest& r = requests[i];
    auto loc = Locate(r.item);
    if (!loc.ok()) return loc.status().WithContext(where);
    if (r.offset > (*loc)->length || (*loc)->length - r.offset < r.size) {
      return InvalidArgumentError(where + ": bytes [" + std::to_string(r.offset) + ", +" +
                                  std::to_string(r.size) + ") requested from " + ItemName(r.item) +
                                  ", which has " + std::to_string((*loc)->length));
    }
    if (r.size > 0 && r.dest == nullptr) {
      return InvalidArgumentError(where + ": null destination for " + ItemName(r.item));
    }
    locs[i] = *loc;
    if (r.size == 0) continue;
    auto f = File((*loc)->file, ItemName(r.item), r.shared);
    if (!f.ok()) return f.status().WithContext(where);
    files[i] = *f;
  }
  std::vector<std::string> names(requests.size());
  std::vector<BlockRead> coalesce;  // whole blocks from files that prefer few requests
  TaskGroup group(pool);
  const uint64_t bs = manifest_.block_size;
  for (size_t i = 0; i < requests.size(); ++i) {
    const ItemLocation* loc = locs[i];
    const ManifestFile* mf = &manifest_.files[loc->file];
    const ReadableFile* f = files[i];
    char* dest = static_cast<char*>(requests[i].dest);
    const uint64_t begin = requests[i].offset, end = begin + requests[i].size;
    if (begin == end) continue;
    names[i] = ItemName(requests[i].item);
    const std::string& name = names[i];
    for (uint64_t b = begin / bs; b * bs < end; ++b) {
      const uint64_t bstart = b * bs, bend = std::min(bstart + bs, loc->length);
      if (bstart >= begin && bend <= end) {
        if (f->PreferredReadSize() > 0) {
          coalesce.push_back(
              {f, mf, loc, b, dest + (bstart - begin), loc->offset + bstart, bend - bstart, &name});
          continue;
        }
        group.Run([=] { return ReadBlock(f, *mf, *loc, b, bs, dest + (bstart - begin), name); });
        continue;
      }
      // An edge block: verify it whole in scratch memory, keep the overlap.
      group.Run([=]() -> Status {
        std::unique_ptr<char[]> scratch(new (std::nothrow) char[bend - bstart]);
        if (!scratch) return ResourceExhaustedError("cannot allocate a read buffer");
        CAIRN_RETURN_IF_ERROR(ReadBlock(f, *mf, *loc, b, bs, scratch.get(), name));
        const uint64_t lo = std::max(bstart, begin), hi = std::min(bend, end);
        std::memcpy(dest + (lo - begin), scratch.get() + (lo - bstart), hi - lo);
        return Status::OK();
      });
    }
  }
  // Neighbouring blocks of one file (items separated by padding only) go
  // into one vectored read of up to two preferred reads (on s3: one ranged
  // GET straight into the destinations), then each block is verified.
  std::sort(coalesce.begin(), coalesce.end(), [](const BlockRead& a, const BlockRead& b) {
    return a.file != b.file ? a.file < b.file : a.file_off < b.file_off;
  });
  for (size_t i = 0; i < coalesce.size();) {
    const uint64_t limit = 2 * coalesce[i].file->PreferredReadSize();
    size_t j = i + 1;
    uint64_t span_end = coalesce[i].file_off + coalesce[i].len;
    while (j < coalesce.size() && coalesce[j].file == coalesce[i].file &&
           coalesce[j].file_off >= span_end && coalesce[j].file_off - span_end <= kMaxReadGap &&
           coalesce[j].file_off + coalesce[j].len - coalesce[i].file_off <= limit) {
      span_end = coalesce[j].file_off + coalesce[j].len;
      ++j;
    }
    std::vector<BlockRead> run(coalesce.begin() + i, coalesce.begin() + j);
    group.Run([run = std::move(run)] { return ReadBlocks(run); });
    i = j;
  }
  return group.Wait().WithContext(where);
}

Result<std::vector<LoadedBuffer>> LoadBuffers(Storage* storage, std::string_view dir,
                                              ThreadPool* pool) {
  CAIRN_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(storage, std::string(dir)));
  const Manifest& m = reader->manifest();
  std::vector<LoadedBuffer> out(m.tensors.size());
  // Chunks are read into scratch buffers, then scattered into the dense
  // result (a single chunk covering the tensor is read in place).
  std::vector<std::vector<uint8_t>> scratch;
  struct Pending {
    size_t tensor, chunk, scratch;
  };
  std::vector<Pending> pending;
  std::vector<ReadRequest> reqs;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const ManifestTensor& t = m.tensors[i];
    size_t itemsize = format::DtypeItemSize(t.dtype);
    uint64_t numel = 1;
    for (uint64_t d : t.shape) numel *= d;  // validated: no overflow
    out[i].name = t.fqn;
    out[i].dtype = t.dtype;
    out[i].shape = t.shape;
    out[i].data.resize(numel * itemsize);
    for (size_t c = 0; c < t.chunks.size(); ++c) {
      const TensorChunk& ch = t.chunks[c];
      ItemRef ref{ItemRef::Kind::kTensorChunk, static_cast<uint32_t>(i), static_cast<uint32_t>(c)};
      if (ch.sizes == t.shape) {
        reqs.push_back({ref, out[i].data.data(), ch.location.length});
      } else {
        scratch.emplace_back(ch.location.length);
        pending.push_back({i, c, scratch.size() - 1});
      }
    }
  }
  for (const auto& p : pending) {
    ItemRef ref{ItemRef::Kind::kTensorChunk, static_cast<uint32_t>(p.tensor),
                static_cast<uint32_t>(p.chunk)};
    reqs.push_back({ref, scratch[p.scratch].data(), scratch[p.scratch].size()});
  }
  CAIRN_RETURN_IF_ERROR(reader->Read(reqs, pool));
  // Scatter: copy each chunk row by row (the last dimension is contiguous in
  // both the chunk and the tensor).
  for (const auto& p : pending) {
    const ManifestTensor& t = m.tensors[p.tensor];
    const TensorChunk& ch = t.chunks[p.chunk];
    size_t itemsize = format::DtypeItemSize(t.dtype);
    size_t nd = t.shape.size();
    if (ch.location.length == 0) continue;
    uint64_t row = (nd ? ch.sizes[nd - 1] : 1) * itemsize;
    uint64_t rows = ch.location.length / row;
    std::vector<uint64_t> idx(nd, 0);  // index within the chunk, last dim fixed at 0
    const uint8_t* src = scratch[p.scratch].data();
    for (uint64_t r = 0; r < rows; ++r) {
      uint64_t lin = 0;
      for (size_t d = 0; d < nd; ++d) lin = lin * t.shape[d] + ch.offsets[d] + idx[d];
      std::memcpy(out[p.tensor].data.data() + lin * itemsize, src + r * row, row);
      for (size_t d = nd >= 1 ? nd - 1 : 0; d-- > 0;) {
        if (++idx[d] < ch.sizes[d]) break;
        idx[d] = 0;
      }
    }
  }
  return out;
}

}  // namespace cairn
