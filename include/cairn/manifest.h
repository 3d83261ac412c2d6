// Manifest: the in-memory form of a checkpoint's cairn.manifest, and its
// encoding (docs/format.md has the byte layout and the JSON schema).
//
// The manifest lists every data file with its exact size, every tensor with
// its global metadata and the chunks it is stored in, and every bytes item
// (non-tensor values). Each stored item carries one XXH3-64 checksum per
// block of `block_size` bytes. A manifest read from storage is never trusted:
// ParseManifest validates every field (keys, ranges, sizes, counts) before
// anyone uses it.
//
// Plain structs: not thread-safe to mutate, safe to read concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cairn/format.h"
#include "cairn/status.h"

namespace cairn {

// One data file of the checkpoint.
struct ManifestFile {
  std::string key;    // relative to the checkpoint directory, e.g. "data/r0.bin"
  uint64_t size = 0;  // exact size in bytes
};

// Where a stored item's bytes are: a byte range of one data file.
struct ItemLocation {
  uint32_t file = 0;    // index into Manifest::files
  uint64_t offset = 0;  // byte offset in the file, a multiple of kItemAlignment
  uint64_t length = 0;  // bytes
  // One XXH3-64 per block of Manifest::block_size bytes of the item;
  // ceil(length / block_size) entries (none for an empty item).
  std::vector<uint64_t> checksums;
};

// A contiguous (row-major) box of a tensor, stored as raw bytes.
struct TensorChunk {
  std::vector<uint64_t> offsets;  // where the box starts in the global tensor
  std::vector<uint64_t> sizes;    // its extent per dimension
  ItemLocation location;          // length == prod(sizes) * itemsize
};

struct ManifestTensor {
  std::string fqn;              // fully qualified name, e.g. "model.layer0.weight"
  std::string dtype;            // torch name without "torch.": "float32", "bfloat16", ...
  std::vector<uint64_t> shape;  // global shape
  // DCP TensorProperties, kept so the Python layer can rebuild them.
  bool requires_grad = false;
  std::string layout = "strided";
  std::string memory_format = "contiguous_format";
  bool pin_memory = false;
  std::vector<TensorChunk> chunks;
};

// A non-tensor value (DCP BYTE_IO: serialized by the layer above).
struct ManifestBytes {
  std::string fqn;
  ItemLocation location;
};

struct Manifest {
  uint32_t version = format::kFormatVersion;
  uint64_t world_size = 1;  // ranks that wrote the checkpoint
  uint64_t block_size = format::kDefaultBlockSize;
  int64_t created_unix_ms = 0;  // wall clock at commit
  std::vector<ManifestFile> files;
  std::vector<ManifestTensor> tensors;
  std::vector<ManifestBytes> bytes;
  // Free-form JSON object (serialized) for the layers above: DCP planner
  // data, storage metadata, user metadata. "{}" when empty.
  std::string extra = "{}";

  // Sum of the sizes of all data files.
  uint64_t TotalBytes() const;
};

// Where one item of a save went: data file `file` (of `file_size` bytes) at
// `location` (whose `file` index is ignored). A tensor chunk (`chunk`) is
// named by its tensor and the chunk's offsets, a bytes item by name alone.
struct WrittenItem {
  std::string fqn;
  bool chunk = false;
  std::vector<uint64_t> offsets;
  std::string file;
  uint64_t file_size = 0;
  ItemLocation location;
};

// Sets m->files to the data files of `written` (shorter keys first, so
// data/r2.bin precedes data/r10.bin, then by name) and the location of every
// chunk and bytes item of `m` to where `written` says it went (a later entry
// for the same item wins; entries for items `m` lacks are ignored).
// InvalidArgument naming the first item nothing was written for.
Status PlaceWrittenItems(Manifest* m, const std::vector<WrittenItem>& written);

// Checks every invariant of `m` (see docs/format.md, "Validation"). Returns
// DataLoss "invalid manifest: <what>" naming the offending field, or
// FailedPrecondition for an unknown version.
Status ValidateManifest(const Manifest& m);

// Checks that the chunks of `t` tile its global shape exactly once: every
// element lies in exactly one chunk (no gap, no overlap, no repeated chunk, no
// tensor without chunks), chunks of zero elements aside (they cover nothing,
// and a tensor with zero elements may have any number of them, or none). Two
// chunks may not start at the same offsets. Assumes every chunk lies inside
// the shape (ValidateManifest checks that first). Returns DataLoss "invalid
// manifest: tensor '<fqn>': ..." naming an uncovered or doubly covered element.
// Cost: O(n log n) for the grids sharding produces; a layout that needs more
// than format::kMaxCoverageSteps steps is refused.
Status ValidateChunkCoverage(const ManifestTensor& t);

// Encodes `m` as the JSON body only (no header/trailer). Fails with
// InvalidArgument if `m` is not valid.
Result<std::string> ManifestToJson(const Manifest& m);

// Parses a JSON body (as produced by ManifestToJson, or by the Python layer)
// and validates it. Malformed JSON or a failed check -> DataLoss when
// `from_storage` (the bytes came from a checkpoint), InvalidArgument
// otherwise (the caller built a bad manifest). An unknown version is
// FailedPrecondition either way.
Result<Manifest> ManifestFromJson(std::string_view json, bool from_storage = false);

// Encodes `m` into the complete manifest file bytes: header, body, trailer.
Result<std::string> EncodeManifest(const Manifest& m);

// Decodes and validates complete manifest file bytes. A bad magic, a length
// mismatch, a checksum mismatch or malformed JSON is DataLoss; a version this
// build does not know is FailedPrecondition.
Result<Manifest> DecodeManifest(std::string_view bytes);

}  // namespace cairn
