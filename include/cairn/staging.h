// StagingPool: reusable staging buffers in node shared memory, the first half
// of an async checkpoint (stage, then persist in the background).
//
// Layout. A pool is a directory on tmpfs, normally ShmDirectory("cairn-JOB"),
// shared by the ranks of a node. It holds `num_slots` slots; slot k of rank r
// is one file, by default
//
//   <root_dir>/slot<k>/data/r<r>.bin
//
// i.e. the data file name of a cairn checkpoint (format::DataFileKey), so a
// slot directory becomes a complete memory-tier checkpoint once a manifest is
// written next to data/ (the tier manager's job, not the pool's).
//
// Life of a slot. Acquire() picks the free slot released longest ago (so a
// freshly staged checkpoint stays intact as long as possible, and ranks that
// make the same calls pick the same slot) and makes sure its file holds at
// least the requested bytes: the file grows (fallocate, never truncation),
// is mapped MAP_SHARED and is pre-faulted once per process, so later saves
// into it take no page faults and touch no allocator. The caller then fills
// it (CopyIn: a parallel memcpy), persists it from the same memory, and
// Release()s it; the memory stays mapped for the next Acquire. A slot held by
// a persist, or kept as a memory-tier checkpoint, is simply not released.
// Memory use is the sum of the slot capacities: flat across saves of the
// same state, growing only when the state grows.
//
// Crashes. The files are in shared memory, so the staged bytes survive a
// crash of the process (not of the node). A new pool opened on the same
// directory and rank finds the files as they were; AcquireSlot(k, 0) maps
// slot k's existing bytes for a restore. Close() unmaps and deletes the
// rank's files (and the directories once empty); set remove_on_close=false to
// keep them. Each file is flock()ed while open: a second live process opening
// the same rank's pool fails instead of corrupting it.
//
// The staging engine. One save into one slot is, in this order:
//   1. BeginSave(slot, lengths): lays the items out exactly as a data file
//      lays them out (format::LayOutDataFile: 4 KiB aligned, empty items at
//      0), acquires the slot with room for them and returns the StagedSave;
//   2. CopyItems(save, sources): the items in host memory, by one parallel
//      memcpy (items on a device are copied by the caller, at
//      save.offsets[i] of save.data, e.g. device-to-host on a side stream);
//   3. ZeroPadding(save): every byte of the slot that is no item's (gaps and
//      the tail, which a reused slot may still hold from an older save) is
//      zeroed, as a checkpoint's padding must be;
// after which the slot is a complete cairn data file (its whole capacity,
// for a memory-tier checkpoint) and its first save.bytes bytes are one too:
//   4. ItemChecksums(save) gives each item's location and block checksums;
//   5. WriteDataFile(save, storage, key) writes those bytes out as a data
//      file (persisting the slot to a slower tier), with the same layout.
// Nothing outside this file and staging_engine.cc knows the slot layout.
//
// Thread-safety: every method may be called from any thread; the bytes of an
// acquired slot belong to its acquirer until Release(). Close() (or the
// destructor) must not race other calls, and invalidates every address
// handed out. An address stays valid until Close() or until an Acquire of
// the same slot grows it (which may move it: read StagingSlot::data again
// after every Acquire, and re-register pinned memory if it changed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cairn/checkpoint.h"
#include "cairn/manifest.h"
#include "cairn/status.h"
#include "cairn/storage.h"
#include "cairn/thread_pool.h"

namespace cairn {

// One contiguous copy of `nbytes` from `src` to byte `dst_offset` of the
// destination. Spans of one call must not overlap in the destination.
struct CopySpan {
  const void* src = nullptr;
  uint64_t dst_offset = 0;
  uint64_t nbytes = 0;
};

// Copies are cut into pieces of this size, spread over the threads.
inline constexpr uint64_t kDefaultCopyPieceBytes = uint64_t{16} << 20;

// Copies every span into [dst, dst + dst_size) on `pool` plus the calling
// thread (just the caller when pool is null), big spans cut into pieces of
// `piece_bytes`. kOutOfRange (and nothing copied) if a span does not fit;
// kInvalidArgument for a null src with nbytes > 0. Blocks until done.
Status ParallelCopy(void* dst, uint64_t dst_size, std::span<const CopySpan> spans, ThreadPool* pool,
                    uint64_t piece_bytes = kDefaultCopyPieceBytes);

// One contiguous copy of `nbytes` from byte `src_offset` of the source to
// `dst` (restoring from a staged slot into tensors).
struct CopyOutSpan {
  void* dst = nullptr;
  uint64_t src_offset = 0;
  uint64_t nbytes = 0;
};

// The reverse of ParallelCopy: copies out of [src, src + src_size), with the
// same checks and threading.
Status ParallelCopyOut(const void* src, uint64_t src_size, std::span<const CopyOutSpan> spans,
                       ThreadPool* pool, uint64_t piece_bytes = kDefaultCopyPieceBytes);

struct StagingPoolOptions {
  // The pool's directory, absolute; created if missing. Normally on tmpfs
  // (ShmDirectory(...)); any local directory works (then it is a page-cache
  // backed mapping, for tests).
  std::string root_dir;
  // The rank whose files this pool object owns.
  uint32_t rank = 0;
  // Number of slots (>= 1): keep-in-memory count + 1 for the save in flight.
  size_t num_slots = 2;
  // The slot file below "slot<k>/"; empty = "data/r<rank>.bin".
  std::string file_key;
  // Pre-fault each slot's pages once per process (recommended).
  bool populate = true;
  // Close() deletes this rank's files (and empty directories).
  bool remove_on_close = true;
};

// A view of one acquired slot.
struct StagingSlot {
  size_t index = 0;
  char* data = nullptr;   // the mapped bytes, MAP_SHARED
  uint64_t capacity = 0;  // bytes mapped (>= the bytes asked for)
  std::string path;       // the file's local path
  std::string key;        // the file relative to root_dir: "slot<k>/data/r<rank>.bin"
};

// One save laid out in a staging slot (StagingPool::BeginSave). A value:
// copy it freely; it stays meaningful while the slot holds this save.
struct StagedSave {
  size_t slot = 0;
  std::vector<uint64_t> offsets;  // item i starts here in the slot
  std::vector<uint64_t> lengths;  // and has this many bytes
  // One past the last item's byte (format::DataFileLayout::end).
  uint64_t end = 0;
  // `end` rounded up to kItemAlignment, at least kItemAlignment: the bytes
  // of the slot this save uses, and the size of the data file that
  // WriteDataFile makes of them (whole pages, so O_DIRECT writes it as is).
  uint64_t bytes = 0;
  // The slot's mapping when the save began (for device copies and pinning).
  char* data = nullptr;
  uint64_t capacity = 0;
};

// The slot bytes a save of items of `lengths` bytes uses (StagedSave::bytes).
uint64_t StagedBytes(std::span<const uint64_t> lengths);

// Deletes the leftovers of staging directories whose process died without
// closing its pool (a crash, SIGKILL): every directory directly below
// `parent` named `prefix`<pid>[-anything] whose process <pid> no longer
// exists (kill(pid, 0) fails with ESRCH) and below which no live process
// holds a flock on any file (every open pool flocks its slot files). A
// symbolic link, a non-directory, a name without a decimal pid, or a live or
// foreign (EPERM) process's directory is left alone. Best effort: errors are
// ignored. Returns the number of directories removed.
size_t RemoveStaleStagingDirs(const std::string& parent, std::string_view prefix);

// An item of a StagedSave in host memory: copy `lengths[item]` bytes from `src`.
struct StageSource {
  size_t item = 0;
  const void* src = nullptr;
};

class StagingPool {
 public:
  // Creates the directory and remembers the options; maps nothing yet.
  static Result<std::unique_ptr<StagingPool>> Open(StagingPoolOptions opts);
  ~StagingPool();  // Close(), ignoring errors; neither copyable nor movable (mu_)

  // Acquires the free slot released longest ago with at least `min_bytes`
  // of capacity (growing it if needed). kResourceExhausted when every slot is
  // in use or shared memory is full.
  // `pool` (optional) spreads the one-time pre-faulting over threads. The
  // pool's lock is held while a slot grows and pre-faults (once per size).
  Result<StagingSlot> Acquire(uint64_t min_bytes, ThreadPool* pool = nullptr);
  // Acquires slot `index` specifically (e.g. to hold or restore a staged
  // checkpoint found after a restart; min_bytes 0 maps what the file has).
  // kFailedPrecondition if it is in use, kInvalidArgument if out of range.
  Result<StagingSlot> AcquireSlot(size_t index, uint64_t min_bytes, ThreadPool* pool = nullptr);
  // Returns slot `index` to the pool; its bytes and mapping stay.
  Status Release(size_t index);

  // ParallelCopy into acquired slot `index`.
  Status CopyIn(size_t index, std::span<const CopySpan> spans, ThreadPool* pool,
                uint64_t piece_bytes = kDefaultCopyPieceBytes);

  // ParallelCopyOut from acquired slot `index` (e.g. a restore from memory).
  Status CopyOut(size_t index, std::span<const CopyOutSpan> spans, ThreadPool* pool,
                 uint64_t piece_bytes = kDefaultCopyPieceBytes);

  // ---- The staging engine (see the top of this file) ----------------------

  // Lays out items of `lengths` bytes and acquires slot `index` with room
  // for them (as AcquireSlot: kFailedPrecondition if it is in use).
  Result<StagedSave> BeginSave(size_t index, std::span<const uint64_t> lengths,
                               ThreadPool* pool = nullptr);
  // Copies each source into the slot of `save` at its item's offset, in
  // parallel. Checks every source first (item in range, src not null when
  // the item is not empty; kInvalidArgument) and copies nothing on error.
  Status CopyItems(const StagedSave& save, std::span<const StageSource> sources, ThreadPool* pool,
                   uint64_t piece_bytes = kDefaultCopyPieceBytes);
  // Zeroes every byte of the slot of `save` that belongs to no item. Skipped
  // when the previous save into this mapping of the slot had the same padding
  // and zeroed it: every save of an unchanged state (the tail of a slot is
  // ~1/3 of a small save's bytes).
  Status ZeroPadding(const StagedSave& save, ThreadPool* pool);
  // Each item's location in the slot (file 0) with one checksum per
  // `block_size` block, hashed in parallel over every block of every item.
  Result<std::vector<ItemLocation>> ItemChecksums(const StagedSave& save, uint64_t block_size,
                                                  ThreadPool* pool);
  // Writes the first save.bytes bytes of the slot as data file `key` of
  // `storage` (WriteDataFile with `opts`): the file then holds every item at
  // its slot offset, so ItemChecksums describe it. Returns its size
  // (save.bytes). The slot must be acquired (again, after a restart).
  Result<uint64_t> WriteDataFile(const StagedSave& save, Storage* storage, std::string_view key,
                                 const DataFileOptions& opts, ThreadPool* pool);

  // The bytes of slot `index` as a ReadableFile, served from this process's
  // mapping of it: a restore of the memory-tier checkpoint this process
  // staged then copies out of memory whose pages are already mapped, with no
  // system call or page fault per piece (ReadableFile::MappedData). `path`
  // is where the reader would open the file; it must name this slot's file
  // (the same inode). kFailedPrecondition when the slot is in use, not
  // mapped in this process, or `path` names another file: read the file the
  // usual way then. While the returned file lives, the slot cannot be
  // acquired (no save can grow or overwrite it; kFailedPrecondition), and
  // its mapping outlives Close() and the pool itself.
  Result<std::unique_ptr<ReadableFile>> OpenMapped(size_t index, const std::string& path);

  // The current view of slot `index`, acquired or not (data is null and
  // capacity 0 while this process has not mapped it). For bookkeeping; the
  // bytes belong to whoever acquired the slot.
  Result<StagingSlot> Peek(size_t index) const;

  size_t num_slots() const { return slots_.size(); }
  bool in_use(size_t index) const;
  // Bytes of shared memory held by this rank's slot files.
  uint64_t footprint() const;
  const StagingPoolOptions& options() const { return opts_; }
  // "slot<k>", the slot's directory relative to root_dir.
  static std::string SlotDirName(size_t index);

  // Deletes this rank's slot files (and the directories left empty) now,
  // keeping the mappings valid until Close(): the shared memory is freed at
  // the last unmap. Leftover files of a dead earlier process of this rank
  // are deleted too; a file another live process holds is left alone.
  Status RemoveFiles();

  // Unmaps every slot and, with remove_on_close, deletes this rank's files
  // and the directories left empty. Idempotent.
  Status Close();

 private:
  struct Slot;
  explicit StagingPool(StagingPoolOptions opts);
  Result<StagingSlot> AcquireLocked(size_t index, uint64_t min_bytes, ThreadPool* pool);
  Result<StagingSlot> SlotView(size_t index) const;
  Status RemoveFilesLocked();
  // The mapping of acquired slot `index`, or an error naming `what`.
  Status AcquiredMemory(size_t index, std::string_view what, char** data, uint64_t* size) const;
  // AcquiredMemory of save.slot, checked to hold save.bytes.
  Status SaveMemory(const StagedSave& save, std::string_view what, char** data,
                    uint64_t* size) const;
  // The padding ZeroPadding last zeroed in slot `index` ([begin, end) pairs,
  // flattened) while mapped at `data`. BeginSave forgets it unless the new save
  // has the same padding (its items then write none of those bytes); CopyIn
  // forgets it (it writes anywhere).
  bool PaddingKnownZero(size_t index, const char* data, const std::vector<uint64_t>& ranges) const;
  void SetPaddingZeroed(size_t index, const char* data, std::vector<uint64_t> ranges);
  // CopyIn (Span = CopySpan) or CopyOut (CopyOutSpan) of acquired slot `index`.
  template <typename Span>
  Status CopySlot(size_t index, std::span<const Span> spans, ThreadPool* pool,
                  uint64_t piece_bytes);

  StagingPoolOptions opts_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Slot>> slots_;
  uint64_t release_seq_ = 0;
  bool closed_ = false;
};

}  // namespace cairn
