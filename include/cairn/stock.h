// Reading the data of checkpoints written by stock `dcp.save` (PyTorch DCP's
// FileSystemWriter), without running any of their pickles.
//
// A stock data file (`__<rank>_<n>.distcp`) is a concatenation of items; DCP's
// `.metadata` (a pickle, decoded here by a restricted reader: ReadStockMetadata)
// says where each item lies. A tensor item is the output of
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
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
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

// ---- DCP metadata (.metadata) --------------------------------------------

// Bounds on what a metadata file may make the reader allocate before anything
// is validated (a sparse file costs nothing on disk): the pickle itself, and
// a tensor item beyond its chunk's bytes (torch.save's zip headers, pickle and
// alignment padding). A non-tensor item is bounded by format::kMaxBytesItemSize.
inline constexpr uint64_t kMaxStockMetadataSize = uint64_t{1} << 30;
inline constexpr uint64_t kStockTensorItemSlack = uint64_t{16} << 20;

// One chunk of a tensor (DCP ChunkStorageMetadata).
struct StockChunk {
  std::vector<uint64_t> offsets, sizes;
};

// A state_dict_metadata entry: a tensor (TensorStorageMetadata) or, when
// `is_bytes`, a non-tensor value (BytesStorageMetadata; the rest is unset).
struct StockItem {
  std::string fqn;
  bool is_bytes = false;
  std::string dtype;   // canonical torch name without "torch.": "float32" (not "float")
  std::string layout;  // torch name without "torch.": "strided", "sparse_coo", ...
  bool requires_grad = false;
  std::string memory_format;  // "contiguous_format", "channels_last" or "preserve_format"
  bool pin_memory = false;
  std::vector<uint64_t> size;
  std::vector<StockChunk> chunks;
};

// A storage_data entry: the item (MetadataIndex) and where it lies (_StorageInfo).
struct StockLocation {
  std::string fqn;
  std::optional<std::vector<uint64_t>> index_offset;  // MetadataIndex.offset
  std::optional<int64_t> index;                       // MetadataIndex.index (a hint)
  std::string relative_path;                          // a plain file name
  uint64_t offset = 0, length = 0;
};

// DCP StorageMeta, as far as a load uses it.
struct StockStorageMeta {
  std::optional<std::string> checkpoint_id, save_id;
  std::vector<std::string> modules;
};

// One element of a planner_data path (str or int; a bool stays a bool).
using StockPathPart = std::variant<std::string, int64_t, bool>;

// DCP Metadata of a stock checkpoint, validated: every tensor's chunks lie
// inside it and tile it exactly once; every item has a location whose data
// file is a plain file name and whose length fits what the item can hold.
struct StockMetadata {
  std::vector<StockItem> state;          // state_dict_metadata, in pickle order
  std::vector<StockLocation> locations;  // storage_data (equal keys merged: last wins)
  std::optional<std::vector<std::pair<std::string, std::vector<StockPathPart>>>> planner_data;
  std::optional<StockStorageMeta> storage_meta;
  std::optional<std::string> version;
};

// Decodes `pickle`, the bytes of a DCP `.metadata` file (`source` names it in
// errors), without a Python VM: a restricted pickle reader (protocol 2 to 5)
// that knows the data opcodes and resolves only the globals a DCP metadata
// pickle names (the metadata dataclasses, torch.Size, dtypes, layouts, the
// memory-format enum, pathlib paths, collections.OrderedDict) into inert
// values; every length is checked against the input, the nesting depth and
// the number of values are bounded. Any other opcode or global, and any
// malformed field, is kDataLoss "<source>: ..." ("refusing to unpickle
// 'os.system'", "malformed checkpoint metadata: 'w'.chunks[0] lies outside
// the tensor"). Stream transforms (compression) and a metadata version other
// than 1.x are kInvalidArgument. Thread-safe (a pure function).
Result<StockMetadata> DecodeStockMetadata(std::string_view pickle, const std::string& source);

// ReadMetadataFile(storage, name, kMaxStockMetadataSize), then
// DecodeStockMetadata, naming the file in errors.
Result<StockMetadata> ReadStockMetadata(Storage* storage, const std::string& name);

// Python's repr() of the str `s` (UTF-8), for names in error messages:
// 'w', "it's", 'a\nb'. Printable non-ASCII characters are kept as they are.
std::string PyRepr(std::string_view s);

}  // namespace cairn::stock
