// Every on-disk constant of a cairn checkpoint, in one place.
//
// The layout and the manifest encoding are documented in docs/format.md. In
// short, a checkpoint is a directory:
//
//   <ckpt>/cairn.manifest      the commit marker, written last (see manifest.h)
//   <ckpt>/data/r<rank>.bin    raw tensor bytes of one rank, items 4 KiB aligned
//
// and the manifest file is
//
//   +-----------+-----------+-----------+--------------+------------------+
//   | magic (8) | version(4)| flags (4) | body len (8) | JSON body (len)  | XXH3-64 (8)
//   +-----------+-----------+-----------+--------------+------------------+
//
// with every integer little-endian, and the trailing XXH3-64 covering every
// byte before it. Changing anything here changes the format: bump
// kFormatVersion and keep reading the old one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cairn::format {

// Name of the manifest inside a checkpoint directory. Its presence is the
// commit: a directory without it is a partial (uncommitted) checkpoint.
inline constexpr std::string_view kManifestName = "cairn.manifest";
// The manifest is first written under this name, then renamed.
inline constexpr std::string_view kManifestTempName = "cairn.manifest.tmp";
// Directory of the data files inside a checkpoint.
inline constexpr std::string_view kDataDir = "data";

// First 8 bytes of a manifest.
inline constexpr char kManifestMagic[8] = {'C', 'A', 'I', 'R', 'N', 'M', 'F', '\n'};
inline constexpr size_t kMagicSize = sizeof(kManifestMagic);
// The version this build writes, and the only one it reads.
inline constexpr uint32_t kFormatVersion = 1;
// Fixed header: magic, version (u32), flags (u32, must be 0), body length (u64).
inline constexpr size_t kManifestHeaderSize = kMagicSize + 4 + 4 + 8;
// Trailer: XXH3-64 (seed 0) of header + body.
inline constexpr size_t kManifestTrailerSize = 8;
// A manifest body larger than this is rejected as absurd.
inline constexpr uint64_t kMaxManifestBodySize = uint64_t{1} << 30;

// Checksum algorithm of data blocks and of the manifest trailer.
inline constexpr std::string_view kChecksumAlgorithm = "xxh3-64";

// Each stored item (a tensor chunk or a bytes value) is checksummed per block
// of this many bytes, counted from the item's first byte; the last block may
// be shorter. Blocks let large items hash in parallel and let a reader verify
// only what it reads.
inline constexpr uint64_t kDefaultBlockSize = uint64_t{16} << 20;
inline constexpr uint64_t kMinBlockSize = uint64_t{4} << 10;
inline constexpr uint64_t kMaxBlockSize = uint64_t{1} << 30;

// Every item starts at a multiple of this offset in its data file, so that
// direct I/O works; the gaps between items are zero bytes.
inline constexpr uint64_t kItemAlignment = 4096;

// Sanity limits applied when a manifest is loaded ("never trust the manifest").
inline constexpr uint64_t kMaxFiles = uint64_t{1} << 20;
inline constexpr uint64_t kMaxItems = uint64_t{1} << 24;  // tensors, chunks, bytes each
inline constexpr uint64_t kMaxDims = 64;                  // dimensions of a tensor
inline constexpr uint64_t kMaxFileSize = uint64_t{1} << 50;
inline constexpr uint64_t kMaxWorldSize = uint64_t{1} << 20;
// A non-tensor (bytes) item is read whole into memory before it is decoded, so
// its length is bounded (besides by its file's real size): a sparse file must
// not make a reader allocate terabytes.
inline constexpr uint64_t kMaxBytesItemSize = uint64_t{1} << 30;
// Proving that a tensor's chunks tile its shape exactly once costs one step per
// (chunk, slab) pair of a sweep over the dimensions, plus n log n per sort:
// O(n log n) for the grids that sharding produces (a million chunks of one
// tensor take about 2^25 steps). A manifest whose chunk maps need more steps than
// this (a hostile, deliberately irregular layout) is refused.
inline constexpr uint64_t kMaxCoverageSteps = uint64_t{1} << 28;

static_assert(kMagicSize == 8);
static_assert(kManifestHeaderSize == 24);
static_assert(kManifestTrailerSize == 8);
static_assert((kDefaultBlockSize & (kDefaultBlockSize - 1)) == 0, "power of two");
static_assert(kDefaultBlockSize % kItemAlignment == 0);
static_assert(kMinBlockSize <= kDefaultBlockSize && kDefaultBlockSize <= kMaxBlockSize);
static_assert((kItemAlignment & (kItemAlignment - 1)) == 0, "power of two");
static_assert(kMinBlockSize % kItemAlignment == 0);
static_assert(kMaxBytesItemSize <= kMaxFileSize);

// Element types a tensor may have, by the name stored in the manifest (the
// torch name without "torch.", e.g. "float32", "bfloat16"). Returns the size
// of one element in bytes, or 0 for an unknown name.
size_t DtypeItemSize(std::string_view dtype);

// The key of rank `rank`'s data file: "data/r<rank>.bin".
std::string DataFileKey(uint64_t rank);

// `v` rounded up to the next multiple of kItemAlignment.
constexpr uint64_t AlignItemOffset(uint64_t v) {
  return (v + kItemAlignment - 1) / kItemAlignment * kItemAlignment;
}

// Where items go in a data file (the one layout rule; the writer and the
// staging engine both use it). Item i of `lengths[i]` bytes starts at
// offsets[i]: the first non-empty item at 0, every later one at the first
// multiple of kItemAlignment after the previous item's end; an empty item
// takes no space and sits at offset 0. Every other byte is zero.
struct DataFileLayout {
  std::vector<uint64_t> offsets;  // one per item
  uint64_t end = 0;               // one past the last item's byte: the file size
};
DataFileLayout LayOutDataFile(std::span<const uint64_t> lengths);

}  // namespace cairn::format
