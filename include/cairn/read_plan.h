// Planning reads of a checkpoint into caller memory: which byte range of a
// stored chunk a requested box is, and the in-place load of a whole state
// (every tensor read straight into its destination, no resharding).
//
// Plain functions of their arguments: thread-safe. The plans only name
// memory; CheckpointReader::Read (checkpoint.h) carries them out.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cairn/checkpoint.h"
#include "cairn/manifest.h"
#include "cairn/status.h"

namespace cairn {

struct ByteRange {
  uint64_t offset = 0;
  uint64_t size = 0;
};

// The bytes [offset, offset + size) of a row-major chunk of shape `sizes`
// (elements of `itemsize` bytes) that the box `offsets + lengths` occupies,
// when the box is one contiguous range (whole rows, e.g. FSDP-style Shard(0)
// resharding: every dimension before the last partial one has length 1), else
// nullopt. An empty box is {0, 0}. InvalidArgument when the ranks differ, a
// value is negative, the box lies outside the chunk or its size overflows.
Result<std::optional<ByteRange>> ChunkByteRange(std::span<const int64_t> offsets,
                                                std::span<const int64_t> lengths,
                                                std::span<const int64_t> sizes, uint64_t itemsize);

// A manifest's items by name: a tensor chunk by its tensor's name and the
// chunk's offsets, a bytes item by its name. Built once, O(items); refers to
// the manifest, which must outlive it. Thread-safe to read.
class ItemIndex {
 public:
  explicit ItemIndex(const Manifest& m);
  std::optional<ItemRef> Chunk(const std::string& fqn, const std::vector<uint64_t>& offsets) const;
  std::optional<ItemRef> Bytes(const std::string& fqn) const;
  // The one chunk of tensor `fqn` (nullopt if it has another number).
  std::optional<ItemRef> OnlyChunk(const std::string& fqn) const;

 private:
  const Manifest& m_;
  std::map<std::pair<std::string, std::vector<uint64_t>>, ItemRef> chunks_;
  std::map<std::string, uint32_t> tensors_, bytes_;
};

// One entry of a state to load in place: a tensor (its dtype's manifest
// name, shape, and `nbytes` of contiguous host memory at `data`) or, with
// `tensor` false, a non-tensor value (its bytes item is read whole).
struct InPlaceTarget {
  std::string fqn;
  bool tensor = true;
  std::string dtype;
  std::vector<uint64_t> shape;
  void* data = nullptr;
  uint64_t nbytes = 0;
};

// The reads that load every target in place from a checkpoint of manifest
// `m` (`index` is ItemIndex(m)): one ReadRequest per target, in order. A tensor's request reads its
// one stored chunk straight into `data` (size 0 for an empty tensor); a
// value's request reads its whole bytes item and has a null `dest` for the
// caller to point at `size` bytes of its own. nullopt when some target cannot
// be loaded so: a name the checkpoint lacks or stores as the other kind, a
// tensor stored in more than one chunk or not as one chunk at offset 0 of its
// exact shape, a different dtype, or a length other than `nbytes`. (The layer
// above then uses a general planner, which reshards or reports the mismatch.)
std::optional<std::vector<ReadRequest>> PlanInPlaceRead(const Manifest& m, const ItemIndex& index,
                                                        std::span<const InPlaceTarget> targets);

// A box of a stored tensor chunk to read into contiguous memory: the
// elements `offsets + lengths` (relative to the chunk's origin) in row-major
// order, at `dest`, which holds exactly `nbytes` = prod(lengths) * itemsize.
struct BoxRead {
  uint32_t tensor = 0;  // into Manifest::tensors
  uint32_t chunk = 0;   // into its chunks
  std::vector<int64_t> offsets;
  std::vector<int64_t> lengths;
  void* dest = nullptr;
  uint64_t nbytes = 0;
};

// Reads every box, and every request of `others` (e.g. bytes items), in one
// parallel, verified reader->Read(): a box that is one contiguous byte range
// of its chunk (ChunkByteRange) is read straight into its dest; the others
// share one scratch copy of each chunk they need (read once per call), whose
// rows are copied into their dests afterwards, in parallel on `pool`. An
// empty box reads nothing. InvalidArgument, before anything is read, for a
// box naming no stored chunk, lying outside its chunk, or whose nbytes is
// not its size; Read()'s errors otherwise (the dests are then unspecified).
Status ReadBoxes(CheckpointReader* reader, std::span<const BoxRead> boxes,
                 std::span<const ReadRequest> others, ThreadPool* pool);

}  // namespace cairn
