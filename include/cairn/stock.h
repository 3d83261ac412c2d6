// Reading the data of checkpoints written by stock `dcp.save` (PyTorch DCP's
// FileSystemWriter), without running any of their pickles.
//
// A stock data file (`__<rank>_<n>.distcp`) is a concatenation of items; DCP's
// `.metadata` (decoded and validated by the Python package, which hands the
// locations over) says where each item lies. A tensor item is the output of
// `torch.save(tensor)`: a zip archive of stored (uncompressed) entries
//
//     archive/data.pkl        pickle: _rebuild_tensor_v2(persistent storage id,
//                             storage offset, size, stride, requires_grad, hooks)
//     archive/byteorder       "little"
//     archive/data/<key>      the storage's raw bytes (64-byte aligned)
//     archive/version, archive/.format_version, ... (small)
//     central directory, end of central directory (zip64 when large)
//
// This module walks the zip records (central directory, local headers, CRC32s),
// decodes data.pkl with a tiny opcode reader that accepts exactly the shapes
// torch.save emits for one tensor (anything else is "not simple": kUnimplemented,
// and the caller falls back to torch.load(weights_only=True)), validates the
// geometry against the storage and reads the storage bytes straight into the
// destination tensor. Corruption of any kind is kDataLoss naming the item.
//
// Thread-safe: pure functions over the (thread-safe) ReadableFile they are given.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cairn/status.h"
#include "cairn/storage.h"
#include "cairn/thread_pool.h"

namespace cairn::stock {

// One stored entry of a zip archive: where its bytes lie within the archive.
struct ZipEntry {
  std::string name;
  uint16_t method = 0;      // 0 = stored; anything else is compressed
  uint32_t crc32 = 0;       // from the central directory
  uint64_t data_begin = 0;  // byte offset of the entry's data within the archive
  uint64_t size = 0;        // compressed size (== the data's size when stored)
};

// The entries of the zip archive `archive` (a whole item), in central
// directory order. Reads the end-of-central-directory record (zip64 too), the
// central directory and every local header; every range is checked against
// the archive's size. kDataLoss ("not a torch.save archive", "zip entry X is
// truncated", ...) for anything malformed.
Result<std::vector<ZipEntry>> ReadZipDirectory(const ReadableFile& archive);

// The decoded tensor of a torch.save archive in the plain one-tensor form.
struct TensorRecord {
  std::string dtype;      // torch dtype name without "torch.": "float32", "bfloat16"
  uint32_t itemsize = 0;  // bytes per element
  ZipEntry storage;       // the archive/data/<key> entry
  uint64_t storage_numel = 0;
  int64_t storage_offset = 0;  // in elements
  std::vector<int64_t> size, stride;
};

// Decodes `archive`'s data.pkl and checks the tensor against its storage
// entry (present, numel * itemsize bytes, every viewed element inside it).
// With `verify_crc`, the CRC32 of every entry except the storage's is checked
// here (the caller checks the storage's while reading it: VerifyEntry).
// kUnimplemented when the archive is not in the plain form (compressed
// entries, another byte order, a data.pkl with other opcodes or globals):
// the caller decodes it some other way, safely. kDataLoss for corruption.
Result<TensorRecord> DecodeTensorRecord(const ReadableFile& archive,
                                        const std::vector<ZipEntry>& entries, bool verify_crc);

// Checks the CRC32 of `entry` over `data` (its bytes). kDataLoss on mismatch.
Status VerifyEntry(const ZipEntry& entry, const void* data, uint64_t n);

// The zip CRC32 of `n` bytes, continuing from `crc` (0 to start); zlib's
// crc32, computed with libdeflate.
uint32_t Crc32(uint32_t crc, const void* data, uint64_t n);

// The ReadableFile of `n` bytes at `data` (not owned; must outlive the view).
class MemoryFile : public ReadableFile {
 public:
  MemoryFile(const void* data, uint64_t n) : data_(static_cast<const char*>(data)), n_(n) {}
  Status ReadAt(uint64_t offset, void* buf, size_t n) const override;
  uint64_t Size() const override { return n_; }

 private:
  const char* data_;
  uint64_t n_;
};

// The byte range [offset, offset + length) of `file` as a file of its own
// (`file` must outlive the view). Reads beyond it are kOutOfRange.
class FileRange : public ReadableFile {
 public:
  FileRange(const ReadableFile* file, uint64_t offset, uint64_t length)
      : file_(file), offset_(offset), length_(length) {}
  Status ReadAt(uint64_t offset, void* buf, size_t n) const override;
  uint64_t Size() const override { return length_; }

 private:
  const ReadableFile* file_;
  uint64_t offset_, length_;
};

// One tensor item to load: where it is, what the metadata says it holds, the
// slice of it the destination wants and the destination itself.
struct TensorRequest {
  std::string file;                 // data file name relative to the checkpoint directory
  uint64_t offset = 0, length = 0;  // the item within the file
  std::string where;                // "<file path>: tensor 'fqn'", prefixed to errors
  std::string fqn;                  // for "data file of tensor 'fqn'"
  std::string dtype;                // expected, as TensorRecord::dtype
  std::vector<int64_t> chunk_size;  // expected stored shape (the metadata's chunk)
  std::vector<int64_t> slice_offset, slice_length;  // the slice of the chunk to load
  void* dest = nullptr;                             // CPU memory of the destination (same dtype)
  std::vector<int64_t> dest_stride;                 // in elements; its shape is slice_length
};

// Loads every request from the stock checkpoint in `storage` (rooted at the
// checkpoint directory): opens each data file once, checks each item against
// the file's size, decodes its record and copies the slice into `dest`, all on
// `pool` (never called from one of its threads). Large contiguous slices are
// read straight into the destination in pieces, in parallel, their CRC32
// combined; others through a bounce buffer. On return, `fallback[i]` is true
// for the requests whose archive is not in the plain form (nothing was
// written to their destination: the caller decodes them). The first error
// stops the load (destinations may then hold partial data).
Status ReadTensors(Storage* storage, const std::vector<TensorRequest>& requests, ThreadPool* pool,
                   bool verify_crc, std::vector<bool>* fallback);

// Reads the item [offset, offset + length) of data file `file` into `dest`,
// with ReadTensors's errors (missing, not regular, truncated).
Status ReadItem(Storage* storage, const std::string& file, uint64_t offset, uint64_t length,
                const std::string& where, const std::string& fqn, void* dest);

// Whether `storage` (rooted at a directory) is a stock checkpoint: it holds
// ".metadata" (or rank 0's "__0.metadata", saved without collectives) as a
// regular file that starts like a protocol >= 2 pickle. Reads one byte.
bool IsStockCheckpoint(Storage* storage);

// The bytes of the metadata file `name` (".metadata" or "__<rank>.metadata"),
// read without following a symlink or waiting on a FIFO. kNotFound when it is
// missing; kDataLoss when it is not a regular file, cannot be read, or is
// larger than `max_size` bytes (checked before anything is allocated).
Result<std::string> ReadMetadataFile(Storage* storage, const std::string& name, uint64_t max_size);

}  // namespace cairn::stock
