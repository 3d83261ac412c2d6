// Writing a checkpoint: data files, then the manifest.
//
// The commit protocol (one place, here):
//   1. UncommitCheckpoint: if the directory already holds a manifest, delete
//      it and sync the directory. From now on the directory is partial.
//   2. Every rank writes its data file(s) with WriteDataFile: allocate the
//      final size (ENOSPC surfaces now), declare the padding between items
//      as holes (an S3 file then uploads each part as soon as it is full),
//      write blocks in parallel, fsync, close. A failed write aborts the
//      file (an S3 multipart upload is discarded, not completed).
//   3. Once every data file is durable (the DCP layer knows this after its
//      gather of write results), one process calls CommitManifest:
//        a. fsync the data/ directory and the checkpoint directory, so the
//           data files' directory entries are durable;
//        b. Storage::PutAtomic(cairn.manifest, if_absent): on posix/shm/mem
//           write cairn.manifest.tmp, fsync, rename it to cairn.manifest
//           (atomic), fsync the directory; on S3 one PUT with
//           If-None-Match: * (S3 has no atomic rename). if_absent means two
//           writers can never both commit the same step: the second gets
//           kAlreadyExists.
//      A crash before (b) completes leaves no manifest: the checkpoint is
//      partial and readers skip it. After (b) it is committed and survives
//      a power cut.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "cairn/checkpoint.h"
#include "checkpoint/io_util.h"

namespace cairn {
namespace internal {

char* ThreadPieceBuffer() {
  thread_local std::unique_ptr<AlignedBuffer> buf;
  if (!buf) buf = std::make_unique<AlignedBuffer>(kIoPiece);
  return buf->data();
}

std::string JoinDir(std::string_view dir, std::string_view key) { return JoinKey(dir, key); }

std::string ChunkName(const ManifestTensor& t, size_t chunk) {
  std::string s = "tensor '" + t.fqn + "'";
  if (t.chunks.size() > 1 && chunk < t.chunks.size()) {
    s += " chunk at [";
    const auto& off = t.chunks[chunk].offsets;
    for (size_t i = 0; i < off.size(); ++i) s += (i ? ", " : "") + std::to_string(off[i]);
    s += "]";
  }
  return s;
}

}  // namespace internal

namespace {

using internal::kIoPiece;

// Hashes and writes one block [src, src+len) at `file_off`, in pieces so each
// piece is still in cache when it is written. With direct I/O and a source
// that is not page aligned, each piece is first copied into the thread's
// aligned buffer (the hash is taken from that copy), so the storage can send
// it with O_DIRECT instead of bouncing it again.
Status WriteBlock(WritableFile* file, const char* src, uint64_t len, uint64_t file_off,
                  bool direct_io, uint64_t* checksum) {
  internal::Hasher h;
  if (!h.ok()) return ResourceExhaustedError("cannot allocate a hash state");
  bool stage = direct_io && reinterpret_cast<uintptr_t>(src) % format::kItemAlignment != 0;
  char* piece_buf = stage ? internal::ThreadPieceBuffer() : nullptr;
  if (stage && !piece_buf) return ResourceExhaustedError("cannot allocate an I/O buffer");
  for (uint64_t done = 0; done < len;) {
    uint64_t n = std::min(kIoPiece, len - done);
    const char* p = src + done;
    if (stage) {
      std::memcpy(piece_buf, p, n);
      p = piece_buf;
    }
    h.Update(p, n);
    CAIRN_RETURN_IF_ERROR(file->WriteAt(file_off + done, p, n));
    done += n;
  }
  *checksum = h.Digest();
  return Status::OK();
}

}  // namespace

Result<DataFileResult> WriteDataFile(Storage* storage, std::string_view key,
                                     const std::vector<BufferRef>& buffers, ThreadPool* pool,
                                     const DataFileOptions& opts) {
  const std::string where = storage->Describe() + ": " + std::string(key);
  if (opts.block_size < format::kMinBlockSize || opts.block_size > format::kMaxBlockSize ||
      opts.block_size % format::kItemAlignment != 0) {
    return InvalidArgumentError("block size " + std::to_string(opts.block_size) + " out of range");
  }
  std::vector<uint64_t> lengths(buffers.size());
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i].size > 0 && buffers[i].data == nullptr) {
      return InvalidArgumentError("buffer " + std::to_string(i) + " is null");
    }
    lengths[i] = buffers[i].size;
  }
  const format::DataFileLayout layout = format::LayOutDataFile(lengths);
  const uint64_t end = layout.end;
  DataFileResult result;
  result.items.resize(buffers.size());
  for (size_t i = 0; i < buffers.size(); ++i) {
    ItemLocation& loc = result.items[i];
    loc.offset = layout.offsets[i];
    loc.length = lengths[i];
    loc.checksums.resize(internal::BlockCount(lengths[i], opts.block_size));
  }
  result.file_size = end;

  WriteOptions wopts;
  wopts.direct_io = opts.direct_io;
  auto created = storage->NewWritableFile(key, wopts);
  if (!created.ok()) return created.status().WithContext("writing " + where);
  std::unique_ptr<WritableFile> file = std::move(created).value();
  Status s = file->Allocate(end);
  for (size_t i = 0, prev_end = 0; s.ok() && i < buffers.size(); ++i) {
    const ItemLocation& loc = result.items[i];
    if (loc.length == 0) continue;
    if (loc.offset > prev_end) s = file->Hole(prev_end, loc.offset - prev_end);
    prev_end = loc.offset + loc.length;
  }
  if (s.ok()) {
    TaskGroup group(pool);
    for (size_t i = 0; i < buffers.size(); ++i) {
      const char* data = static_cast<const char*>(buffers[i].data);
      ItemLocation& loc = result.items[i];
      for (size_t b = 0; b < loc.checksums.size(); ++b) {
        uint64_t start = b * opts.block_size;
        uint64_t len = std::min(opts.block_size, loc.length - start);
        WritableFile* f = file.get();
        uint64_t* sum = &loc.checksums[b];
        uint64_t off = loc.offset + start;
        bool direct = opts.direct_io;
        group.Run([=] { return WriteBlock(f, data + start, len, off, direct, sum); });
      }
    }
    s = group.Wait();
  }
  if (s.ok() && opts.sync) s = file->Sync();
  if (!s.ok()) {
    file->Abort().IgnoreError();
    return s.WithContext("writing " + where);
  }
  s = file->Close();
  if (!s.ok()) return s.WithContext("writing " + where);
  return result;
}

Status UncommitCheckpoint(Storage* storage, std::string_view dir) {
  std::string key = internal::JoinDir(dir, format::kManifestName);
  CAIRN_ASSIGN_OR_RETURN(bool exists, storage->Exists(key));
  if (!exists) return Status::OK();
  // Several local ranks uncommit their node's shared slot at once: the one that
  // loses the race finds the manifest already gone, which is what it wanted.
  Status s = storage->DeleteFile(key);
  if (!s.ok() && s.code() != StatusCode::kNotFound) return s;
  return storage->SyncDir(dir);
}

Status CommitManifest(Storage* storage, std::string_view dir, const Manifest& m) {
  const std::string where =
      "committing " + storage->Describe() + (dir.empty() ? "" : "/") + std::string(dir);
  auto encoded = EncodeManifest(m);
  if (!encoded.ok()) return encoded.status().WithContext(where);
  Status s = [&]() -> Status {
    std::string data_dir = internal::JoinDir(dir, format::kDataDir);
    CAIRN_ASSIGN_OR_RETURN(bool has_data, storage->Exists(data_dir));
    if (has_data) CAIRN_RETURN_IF_ERROR(storage->SyncDir(data_dir));
    // PutAtomic's default writes JoinDir(dir, kManifestTempName) first.
    static_assert(format::kManifestTempName.substr(0, format::kManifestName.size()) ==
                  format::kManifestName);
    return storage->PutAtomic(internal::JoinDir(dir, format::kManifestName), *encoded,
                              /*if_absent=*/true);
  }();
  return s.WithContext(where);
}

namespace {
// A manifest is read header first, then this much, then doubling what was read.
constexpr uint64_t kManifestFirstRead = uint64_t{4} << 20;
}  // namespace

Result<Manifest> ReadManifest(Storage* storage, std::string_view dir) {
  const std::string name = internal::JoinDir(dir, format::kManifestName);
  const std::string where = storage->Describe() + "/" + name;
  auto file = storage->NewReadableFile(name);
  if (!file.ok()) {
    if (file.status().code() == StatusCode::kNotFound) {
      CAIRN_ASSIGN_OR_RETURN(bool dir_exists, storage->Exists(dir));
      return NotFoundError(dir_exists ? "no committed checkpoint at " + storage->Describe() +
                                            (dir.empty() ? "" : "/") + std::string(dir) + " (no " +
                                            std::string(format::kManifestName) +
                                            ": partial or not a cairn checkpoint)"
                                      : "no such checkpoint: " + storage->Describe() +
                                            (dir.empty() ? "" : "/") + std::string(dir));
    }
    // A FIFO, socket or device (or a directory) where the manifest belongs:
    // the checkpoint is damaged, never something to wait on.
    if (file.status().code() == StatusCode::kFailedPrecondition ||
        (file.status().code() == StatusCode::kInvalidArgument && ValidateKey(name).ok())) {
      return DataLossError(file.status().message() + " (a damaged checkpoint: " +
                           std::string(format::kManifestName) + " must be a regular file)");
    }
    return file.status();
  }
  uint64_t size = (*file)->Size();
  if (size >
      format::kMaxManifestBodySize + format::kManifestHeaderSize + format::kManifestTrailerSize) {
    return DataLossError(where + ": manifest of " + std::to_string(size) + " bytes is absurd");
  }
  // The size is what the storage declares (for S3, a server's header): read
  // in growing steps, so that memory follows the bytes actually received,
  // and check the header's body length against the declared size first.
  std::string bytes;
  uint64_t step = std::min<uint64_t>(size, format::kManifestHeaderSize);
  while (bytes.size() < size) {
    const uint64_t at = bytes.size(), n = std::min<uint64_t>(step, size - at);
    bytes.resize(at + n);
    Status s = (*file)->ReadAt(at, bytes.data() + at, n);
    if (!s.ok()) {
      if (s.code() == StatusCode::kOutOfRange) return DataLossError(where + ": " + s.message());
      return s.WithContext(where);
    }
    if (at == 0 && bytes.size() >= format::kManifestHeaderSize) {
      uint64_t body_len = 0;  // little-endian, after the magic, version and flags
      for (int i = 7; i >= 0; --i) {
        body_len = (body_len << 8) | static_cast<uint8_t>(bytes[format::kMagicSize + 8 + i]);
      }
      if (body_len > format::kMaxManifestBodySize ||
          body_len + format::kManifestHeaderSize + format::kManifestTrailerSize != size) {
        return DataLossError(where + ": manifest truncated or damaged: header says " +
                             std::to_string(body_len) + " body bytes, the file has " +
                             std::to_string(size));
      }
    }
    step = std::max<uint64_t>(kManifestFirstRead, bytes.size());  // then double what is held
  }
  auto m = DecodeManifest(bytes);
  if (!m.ok()) return m.status().WithContext(where);
  return m;
}

Status SaveBuffers(Storage* storage, std::string_view dir, const std::vector<NamedBuffer>& buffers,
                   ThreadPool* pool, const DataFileOptions& opts) {
  Manifest m;
  m.world_size = 1;
  m.block_size = opts.block_size;
  std::vector<BufferRef> refs;
  for (const auto& b : buffers) {
    size_t itemsize = format::DtypeItemSize(b.dtype);
    if (itemsize == 0) {
      return InvalidArgumentError("buffer '" + b.name + "': unknown dtype '" + b.dtype + "'");
    }
    uint64_t n = itemsize;
    for (uint64_t d : b.shape) {
      if (__builtin_mul_overflow(n, d, &n)) {
        return InvalidArgumentError("buffer '" + b.name + "': shape overflows");
      }
    }
    refs.push_back({b.data, n});
    ManifestTensor t;
    t.fqn = b.name;
    t.dtype = b.dtype;
    t.shape = b.shape;
    TensorChunk c;
    c.offsets.assign(b.shape.size(), 0);
    c.sizes = b.shape;
    t.chunks.push_back(std::move(c));
    m.tensors.push_back(std::move(t));
  }
  CAIRN_RETURN_IF_ERROR(UncommitCheckpoint(storage, dir));
  std::string key = internal::JoinDir(dir, format::DataFileKey(0));
  CAIRN_ASSIGN_OR_RETURN(DataFileResult r, WriteDataFile(storage, key, refs, pool, opts));
  m.files.push_back({format::DataFileKey(0), r.file_size});
  for (size_t i = 0; i < m.tensors.size(); ++i) m.tensors[i].chunks[0].location = r.items[i];
  m.created_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  return CommitManifest(storage, dir, m);
}

}  // namespace cairn
