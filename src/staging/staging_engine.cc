// The staging engine: one save into one StagingPool slot (the steps are
// listed at the top of include/cairn/staging.h).
//
// Why the slot layout is the data-file layout. A staged slot is a memory-tier
// checkpoint as it stands (its manifest points into the slot file), and the
// slower tiers get the same bytes written out unchanged, in one sequential,
// page-aligned write. Both only work if items sit in the slot where a data
// file puts them, so the layout comes from format::LayOutDataFile, the rule
// WriteDataFile itself follows, and WriteDataFile below checks that the file
// it wrote kept every item at its slot offset.
#include <algorithm>
#include <cstring>

#include "cairn/checksum.h"
#include "cairn/staging.h"
#include "io/parallel.h"

namespace cairn {

namespace {

// A byte range of the slot to zero.
struct Range {
  uint64_t begin;
  uint64_t end;
};

// Every byte of [0, capacity) outside the items, as ranges.
std::vector<Range> PaddingRanges(const StagedSave& save, uint64_t capacity) {
  std::vector<Range> out;
  uint64_t cursor = 0;  // items are laid out in order, non-empty ones ascending
  for (size_t i = 0; i < save.offsets.size(); ++i) {
    if (save.lengths[i] == 0) continue;
    if (save.offsets[i] > cursor) out.push_back({cursor, save.offsets[i]});
    cursor = save.offsets[i] + save.lengths[i];
  }
  if (capacity > cursor) out.push_back({cursor, capacity});
  return out;
}

// PaddingRanges flattened to [begin, end) pairs (StagingPool::PaddingKnownZero).
std::vector<uint64_t> Flat(const std::vector<Range>& ranges) {
  std::vector<uint64_t> out;
  out.reserve(2 * ranges.size());
  for (const Range& r : ranges) {
    out.push_back(r.begin);
    out.push_back(r.end);
  }
  return out;
}

}  // namespace

uint64_t StagedBytes(std::span<const uint64_t> lengths) {
  return std::max(format::AlignItemOffset(format::LayOutDataFile(lengths).end),
                  format::kItemAlignment);
}

Status StagingPool::SaveMemory(const StagedSave& save, std::string_view what, char** data,
                               uint64_t* size) const {
  CAIRN_RETURN_IF_ERROR(AcquiredMemory(save.slot, what, data, size));
  if (*size < save.bytes || save.offsets.size() != save.lengths.size()) {
    return FailedPreconditionError("staging slot " + std::to_string(save.slot) + " holds " +
                                   std::to_string(*size) + " bytes, not the save of " +
                                   std::to_string(save.bytes) + " bytes laid out in it");
  }
  return Status::OK();
}

Result<StagedSave> StagingPool::BeginSave(size_t index, std::span<const uint64_t> lengths,
                                          ThreadPool* pool) {
  format::DataFileLayout layout = format::LayOutDataFile(lengths);
  StagedSave save;
  save.slot = index;
  save.lengths.assign(lengths.begin(), lengths.end());
  save.offsets = std::move(layout.offsets);
  save.end = layout.end;
  save.bytes = StagedBytes(lengths);
  CAIRN_ASSIGN_OR_RETURN(StagingSlot slot, AcquireSlot(index, save.bytes, pool));
  save.data = slot.data;
  save.capacity = slot.capacity;
  // Items laid out otherwise than the last zeroed save's may write into its
  // padding: forget it before a byte is copied.
  std::vector<uint64_t> padding = Flat(PaddingRanges(save, slot.capacity));
  if (!PaddingKnownZero(index, static_cast<const char*>(slot.data), padding)) {
    SetPaddingZeroed(index, nullptr, {});
  }
  return save;
}

Status StagingPool::CopyItems(const StagedSave& save, std::span<const StageSource> sources,
                              ThreadPool* pool, uint64_t piece_bytes) {
  std::vector<CopySpan> spans;
  spans.reserve(sources.size());
  for (const StageSource& s : sources) {
    if (s.item >= save.lengths.size()) {
      return InvalidArgumentError("staging item " + std::to_string(s.item) + " out of range (" +
                                  std::to_string(save.lengths.size()) + " items)");
    }
    spans.push_back(CopySpan{s.src, save.offsets[s.item], save.lengths[s.item]});
  }
  char* data;
  uint64_t cap;
  CAIRN_RETURN_IF_ERROR(SaveMemory(save, "copy into", &data, &cap));
  // The slot is the caller's until Release, so the copy runs unlocked.
  return ParallelCopy(data, cap, spans, pool, piece_bytes)
      .WithContext("staging into slot " + std::to_string(save.slot));
}

Status StagingPool::ZeroPadding(const StagedSave& save, ThreadPool* pool) {
  char* data;
  uint64_t cap;
  CAIRN_RETURN_IF_ERROR(SaveMemory(save, "zero the padding of", &data, &cap));
  // Gaps are under 4 KiB each; the tail may be large (the state shrank), so
  // ranges are cut into pieces to spread it over the threads.
  std::vector<Range> padding = PaddingRanges(save, cap);
  std::vector<uint64_t> flat = Flat(padding);
  if (PaddingKnownZero(save.slot, data, flat)) return Status::OK();
  std::vector<Range> pieces;
  uint64_t total = 0;
  for (const Range& r : padding) {
    for (uint64_t b = r.begin; b < r.end; b += kDefaultCopyPieceBytes) {
      pieces.push_back({b, std::min(r.end, b + kDefaultCopyPieceBytes)});
    }
    total += r.end - r.begin;
  }
  // A few KiB of gaps are zeroed here: waking the helpers would cost more.
  if (total < internal::kInlineCopyBytes) pool = nullptr;
  internal::ParallelFor(pieces.size(), pool, 0, [&](size_t i) {
    std::memset(data + pieces[i].begin, 0, static_cast<size_t>(pieces[i].end - pieces[i].begin));
  });
  SetPaddingZeroed(save.slot, data, std::move(flat));
  return Status::OK();
}

Result<std::vector<ItemLocation>> StagingPool::ItemChecksums(const StagedSave& save,
                                                             uint64_t block_size,
                                                             ThreadPool* pool) {
  if (block_size == 0) return InvalidArgumentError("checksum block size must be positive");
  char* data;
  uint64_t cap;
  CAIRN_RETURN_IF_ERROR(SaveMemory(save, "checksum", &data, &cap));
  std::vector<ItemLocation> locs(save.lengths.size());
  struct Block {
    size_t item;
    size_t index;
  };
  std::vector<Block> blocks;
  for (size_t i = 0; i < locs.size(); ++i) {
    locs[i].offset = save.offsets[i];
    locs[i].length = save.lengths[i];
    size_t n = static_cast<size_t>((save.lengths[i] + block_size - 1) / block_size);
    locs[i].checksums.resize(n);
    for (size_t b = 0; b < n; ++b) blocks.push_back({i, b});
  }
  // One task list over every block of every item: small items hash in
  // parallel with each other, not one after another.
  internal::ParallelFor(blocks.size(), pool, 0, [&](size_t k) {
    ItemLocation& loc = locs[blocks[k].item];
    uint64_t start = blocks[k].index * block_size;
    uint64_t len = std::min(block_size, loc.length - start);
    loc.checksums[blocks[k].index] = Checksum(data + loc.offset + start, static_cast<size_t>(len));
  });
  return locs;
}

Result<uint64_t> StagingPool::WriteDataFile(const StagedSave& save, Storage* storage,
                                            std::string_view key, const DataFileOptions& opts,
                                            ThreadPool* pool) {
  char* data;
  uint64_t cap;
  CAIRN_RETURN_IF_ERROR(SaveMemory(save, "write out", &data, &cap));
  // The slot's first `bytes` bytes, as one buffer: a data file's first item
  // is at offset 0, so every item keeps its slot offset in the file.
  std::vector<BufferRef> one = {BufferRef{data, save.bytes}};
  CAIRN_ASSIGN_OR_RETURN(DataFileResult r, cairn::WriteDataFile(storage, key, one, pool, opts));
  if (r.file_size != save.bytes || r.items.size() != 1 || r.items[0].offset != 0) {
    return InternalError("data file " + std::string(key) + " of staging slot " +
                         std::to_string(save.slot) + " does not keep the slot's layout");
  }
  return r.file_size;
}

}  // namespace cairn
