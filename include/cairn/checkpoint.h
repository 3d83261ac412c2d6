// The checkpoint engine's public C++ API: write data files, commit a
// manifest, read and verify a checkpoint, find the newest valid one, copy one
// between storages, and a convenience API for saving named buffers.
//
// Usable without Python. A checkpoint lives in a directory `dir` (a key below
// a Storage's root; "" is the root itself) laid out as in format.h. Every
// function here is thread-compatible: it may run concurrently with other
// calls on different checkpoints; it uses the ThreadPool it is given for its
// parallel I/O, waits for its tasks, and never keeps a reference to the pool
// after returning. Do not call these functions from a thread of that same
// pool: the caller blocks while the pool's threads do the work.
//
// Durability contract: a checkpoint is committed if and only if its manifest
// exists. CommitManifest() writes the manifest last, after the data files are
// synced; writers that reuse a directory first remove an old manifest
// (UncommitCheckpoint), so a half-rewritten directory is never "valid".
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "cairn/format.h"
#include "cairn/manifest.h"
#include "cairn/status.h"
#include "cairn/storage.h"
#include "cairn/thread_pool.h"

namespace cairn {

// Called with (bytes done, bytes in all) as a long operation advances. It may
// be called concurrently from pool threads, so it must be thread-safe, and
// must not block for long.
using ProgressFn = std::function<void(uint64_t done, uint64_t total)>;

// ---- Writing data files ----------------------------------------------------

// Caller memory to store. It must stay valid and unchanged until the call that
// uses it returns.
struct BufferRef {
  const void* data = nullptr;
  uint64_t size = 0;
};

struct DataFileOptions {
  // Ask the storage for direct I/O (O_DIRECT): data goes to disk without
  // filling the page cache. Ignored where the backend cannot honour it.
  bool direct_io = false;
  // Checksum block size; must match the Manifest's block_size.
  uint64_t block_size = format::kDefaultBlockSize;
  // fsync the file before returning. Off only for tests and for tiers where
  // durability is not wanted (shared memory).
  bool sync = true;
};

struct DataFileResult {
  uint64_t file_size = 0;
  // One per input buffer, in order; `file` is left 0 for the caller to set.
  std::vector<ItemLocation> items;
};

// Writes `buffers` into the new file `key` (replacing any old one): each
// buffer at the next kItemAlignment-aligned offset, gaps zero. The file is
// first allocated at its final size so a full disk fails early. Buffers are
// split into blocks that are checksummed and written in parallel on `pool`,
// each block hashed while it is hot in cache. On success the file is synced
// (unless !opts.sync) and closed, and the result has each buffer's location
// and block checksums.
Result<DataFileResult> WriteDataFile(Storage* storage, std::string_view key,
                                     const std::vector<BufferRef>& buffers, ThreadPool* pool,
                                     const DataFileOptions& opts = {});

// ---- Committing ----------------------------------------------------------

// Commits the checkpoint in `dir`: syncs the directory entries of the data
// files, writes `m` to a temp file, syncs it, renames it to the manifest name
// and syncs `dir`. Returns InvalidArgument if `m` is not valid. After an OK
// return the checkpoint survives a power cut.
Status CommitManifest(Storage* storage, std::string_view dir, const Manifest& m);

// Removes the manifest of `dir` if there is one (and syncs `dir`), so that
// rewriting the directory in place never leaves a manifest that describes
// half-new data. OK when there is no manifest, also when another process
// removes it concurrently (safe to call from several processes for one `dir`).
Status UncommitCheckpoint(Storage* storage, std::string_view dir);

// Reads and validates the manifest of `dir`. NotFound if `dir` has no
// manifest (the checkpoint is partial or absent); DataLoss if it is damaged
// or invalid; FailedPrecondition for an unknown format version.
Result<Manifest> ReadManifest(Storage* storage, std::string_view dir);

// ---- Reading -------------------------------------------------------------

// Names one stored item of a manifest.
struct ItemRef {
  enum class Kind : uint8_t { kTensorChunk = 0, kBytes = 1 };
  Kind kind = Kind::kTensorChunk;
  uint32_t index = 0;  // into Manifest::tensors or Manifest::bytes
  uint32_t chunk = 0;  // into ManifestTensor::chunks (kTensorChunk only)
};

// Read bytes [offset, offset + size) of an item into `dest` (the whole item
// when offset is 0 and size is its length). Every block the range touches is
// read and verified whole; blocks inside the range go straight into `dest`,
// blocks at its edges through a scratch buffer.
//
// `shared`: other processes of this node read the same bytes at about the
// same time (a replicated state loaded by every rank). Such a request is
// read through the page cache even when the reader reads direct, so the
// device delivers the bytes once for all of them rather than once each.
struct ReadRequest {
  ItemRef item;
  void* dest = nullptr;
  uint64_t size = 0;
  uint64_t offset = 0;  // byte offset within the item
  bool shared = false;
};

// Reads items of one committed checkpoint into caller memory, verifying every
// block's checksum on the way.
//
// Thread-safe: Read() may be called concurrently. Data files are opened on
// first use and kept open until the reader is destroyed. The reader does not
// own the Storage, which must outlive it.
class CheckpointReader {
 public:
  // Reads and validates the manifest of `dir` (see ReadManifest). Data files
  // are opened with `opts` (direct I/O by default: checkpoint data is read
  // once, so the page cache would only cost a copy), and opened a second
  // time buffered for ReadRequest::shared requests.
  static Result<std::unique_ptr<CheckpointReader>> Open(Storage* storage, std::string dir,
                                                        const ReadOptions& opts = {true});

  const Manifest& manifest() const { return manifest_; }

  // Location and human name ("tensor 'w'", "bytes 'step'") of an item;
  // InvalidArgument for a reference outside the manifest.
  Result<const ItemLocation*> Locate(const ItemRef& item) const;
  std::string ItemName(const ItemRef& item) const;

  // Opens every data file and checks that its size is the recorded one, so a
  // missing or truncated file is reported before any read (DataLoss naming
  // the file and an item it holds). Cheap: no data is read.
  Status CheckFiles();

  // Reads every request in parallel on `pool`. On success each dest holds the
  // requested verified bytes. A range outside its item is InvalidArgument. A checksum mismatch, a
  // truncated or missing data file is DataLoss naming the file and the tensor, e.g.
  //   "/ckpt/step_5: data/r1.bin: checksum mismatch in block 3 of tensor 'w'".
  // On error the contents of the destinations are unspecified.
  Status Read(const std::vector<ReadRequest>& requests, ThreadPool* pool);

  // Serves data file `key` from `file` instead of opening it in the storage
  // (a staging slot's mapping that holds it, StagingPool::OpenMapped).
  // kInvalidArgument when no data file has that key, DataLoss when the
  // file's size is not the recorded one. Not while a Read() is running.
  Status UseFile(std::string_view key, std::unique_ptr<ReadableFile> file);
  // Closes every data file opened so far (and those UseFile gave); a later
  // Read() opens them again. Not while a Read() is running.
  void CloseFiles();
  // The checkpoint's directory in its storage.
  const std::string& dir() const { return dir_; }

 private:
  CheckpointReader(Storage* storage, std::string dir, Manifest m, ReadOptions opts)
      : storage_(storage), dir_(std::move(dir)), manifest_(std::move(m)), opts_(opts) {}
  // Data file `index`, opened on first use; `shared`: the one to read shared
  // requests through (buffered, unless UseFile gave a mapping).
  Result<const ReadableFile*> File(uint32_t index, const std::string& needed_by,
                                   bool shared = false);

  Storage* storage_;
  std::string dir_;
  Manifest manifest_;
  ReadOptions opts_;
  std::mutex mu_;
  std::map<uint32_t, std::unique_ptr<ReadableFile>> files_;     // guarded by mu_
  std::map<uint32_t, std::unique_ptr<ReadableFile>> buffered_;  // guarded by mu_
  std::set<uint32_t> given_;  // indices UseFile gave; guarded by mu_
};

// ---- Verification --------------------------------------------------------

// Checks that the data files of `dir` match manifest `m`: every file exists
// with its exact size, every block of every item has its checksum, and every
// padding byte between items is zero. Streams the data (bounded memory),
// in parallel on `pool`. Returns DataLoss naming the first culprit found.
Status VerifyData(Storage* storage, std::string_view dir, const Manifest& m, ThreadPool* pool,
                  const ProgressFn& progress = {});

// ReadManifest + VerifyData: is the checkpoint in `dir` intact? A directory
// without a manifest is DataLoss (partial); NotFound only if `dir` is absent.
Status Verify(Storage* storage, std::string_view dir, ThreadPool* pool,
              const ProgressFn& progress = {});

// ---- Discovery -----------------------------------------------------------

// The step of a checkpoint directory named "step_<N>" (N decimal, no sign),
// or nullopt for any other name.
std::optional<uint64_t> ParseStep(std::string_view name);

struct CheckpointInfo {
  std::string name;  // directory name below the root
  std::optional<uint64_t> step;
  bool committed = false;  // has a manifest that decodes and validates
  Status status;           // why it is not committed (NotFound, DataLoss, ...)
  uint64_t bytes = 0;      // committed: sum of data files; partial: files found
  int64_t created_unix_ms = 0;
  uint64_t world_size = 0;
};

// Describes every directory directly below `root`, newest last (the order
// LatestValid uses).
Result<std::vector<CheckpointInfo>> ListCheckpoints(Storage* storage, std::string_view root);

// The newest committed checkpoint directly below `root`, as its directory
// name, or nullopt when there is none. Partial directories (no manifest, or a
// manifest that does not decode and validate) are skipped; data files are not
// read (use Verify for that).
//
// "Newest": directories named step_<N> order by N; they all count as newer
// than directories with any other name, which order by the manifest's
// creation time, then by name. NotFound if `root` does not exist.
Result<std::optional<std::string>> LatestValid(Storage* storage, std::string_view root);

// ---- Retention -------------------------------------------------------------

struct PruneOptions {
  // Committed step_<N> checkpoints to keep (>= 1): the newest `keep` by step.
  uint64_t keep = 1;
  // Also remove partial step_<N> directories newer than the newest committed
  // one. Off by default: such a directory may be a save still in flight. A
  // partial directory older than the newest committed checkpoint is always a
  // leftover of a crashed save and is removed.
  bool remove_newer_partials = false;
  // Only report what would be removed.
  bool dry_run = false;
  // Called after a checkpoint's manifest is removed and before its data is
  // (tests use it to kill the process between the two steps).
  std::function<void(const std::string& name)> after_uncommit;
  // Unfinished uploads below the root (multipart uploads of killed saves on
  // s3) older than this many seconds are aborted (Storage::AbortStaleUploads);
  // negative: never. Younger ones may belong to a save in flight.
  double stale_upload_age_s = 3600;
};

// Applies retention to the step_<N> checkpoints directly below `root`: keeps
// the newest `opts.keep` committed ones and removes the older ones and the
// partial leftovers (see PruneOptions). A checkpoint is removed manifest
// first, so a crash mid-way leaves a partial directory, never a committed one
// with missing data. The newest committed checkpoint is never removed.
// Directories not named step_<N> are left alone. Stale unfinished uploads
// are aborted (see PruneOptions). On success stores the names
// removed (or that would be, with dry_run) in *removed, oldest first.
Status Prune(Storage* storage, std::string_view root, const PruneOptions& opts,
             std::vector<std::string>* removed);

// Removes the one checkpoint at `uri` (committed or partial; a directory,
// file://, shm://NAME or s3://), manifest first, so a crash mid-way leaves a
// partial checkpoint, never a committed one with missing data; a local
// directory (an shm:// one in /dev/shm included) goes with it. Refused with
// FailedPrecondition, before anything is removed, when `uri` is no cairn
// checkpoint: a root holding checkpoints (name one of them), a stock DCP
// checkpoint or any other directory. NotFound when it does not exist. A
// CheckpointManager's memory tier is reclaimed by `cairn gc`, not by this.
Status RemoveCheckpointUri(std::string_view uri);

// ---- Copying -------------------------------------------------------------

struct CopyOptions {
  bool direct_io = true;  // on the destination, where possible
  bool sync = true;       // fsync destination files (off for memory tiers)
  // After copying, re-read the destination and verify it (costs a read).
  // Every block is always verified at the source as it passes through.
  bool verify_destination = false;
};

// How two directories lie relative to each other.
enum class DirRelation : uint8_t {
  kDisjoint = 0,
  kSame = 1,          // one place (a symlink, a bind mount or the same key)
  kFirstInside = 2,   // the first lies strictly inside the second
  kSecondInside = 3,  // the second lies strictly inside the first
};

// Relates two local directory paths, neither of which need exist. Symbolic
// links and mounts are resolved: the existing part of each path is
// canonicalized (realpath) and compared by identity (st_dev, st_ino) with every
// ancestor of the other, the part that does not exist yet by name.
Result<DirRelation> RelateLocalDirs(const std::string& a, const std::string& b);

// Relates directory `a_dir` of `a` to `b_dir` of `b`. Storages with a local
// path (posix, shm, and wrappers of them) are related as RelateLocalDirs does;
// two storages without one are the same namespace when one is the other or
// their Describe() names are equal, and then relate by name ("s3://b/p" holds
// "s3://b/p/x"); a local and a non-local storage are disjoint.
Result<DirRelation> RelateDirs(Storage* a, std::string_view a_dir, Storage* b,
                               std::string_view b_dir);

// Copies the committed checkpoint `src_dir` of `src` to `dst_dir` of `dst`:
// removes a manifest already at the destination, copies the data files in
// parallel (blocks verified against their checksums in transit), syncs them,
// optionally verifies the destination, and commits the manifest there last.
// Corruption at the source is DataLoss naming the file and tensor, and leaves
// the destination uncommitted.
//
// A destination that is the source (itself, through a symbolic link or a
// mount), lies inside it or contains it is refused with InvalidArgument
// before anything is written (RelateDirs): the copy would destroy the source.
Status CopyCheckpoint(Storage* src, std::string_view src_dir, Storage* dst,
                      std::string_view dst_dir, ThreadPool* pool, const ProgressFn& progress = {},
                      const CopyOptions& opts = {});

// CopyCheckpoint of the committed checkpoint at the root of `src` to the
// storage at `dst_uri`, opened (created) only after the overlap check, so a
// refused copy leaves no trace.
Status CopyCheckpointTo(Storage* src, std::string_view dst_uri, ThreadPool* pool,
                        const ProgressFn& progress = {}, const CopyOptions& opts = {});

// CopyCheckpoint between two storage URIs (OpenStorage): `src_uri` must hold
// a committed checkpoint; `dst_uri` is created. An overlapping copy is
// refused before the destination is created, so a refusal leaves no trace.
Status CopyCheckpointUri(std::string_view src_uri, std::string_view dst_uri, ThreadPool* pool,
                         const ProgressFn& progress = {}, const CopyOptions& opts = {});

struct CopyFileOptions {
  bool direct_io = false;  // on the destination, where possible
  bool sync = true;        // fsync the destination file
  // Bytes per task: the file is split into ranges of this size, copied in
  // parallel (each in pieces through the thread's I/O buffer).
  uint64_t chunk_bytes = uint64_t{16} << 20;
};

// Copies the whole file `src_key` of `src` to `dst_key` of `dst` (replacing
// it): ranges of opts.chunk_bytes are read and written in parallel on
// `pool`, every byte written once (an S3 destination uploads each part as
// soon as it is complete), then the file is synced (opts.sync) and closed.
// On failure the destination file is aborted (an S3 upload is discarded,
// a posix file is left partial: callers never commit it). The bytes are
// copied as they are: the checkpoint's checksums are verified on load.
// Staged writes (cairn.Writer(path, staging_dir=...)) use it to move a data
// file from the local staging directory to the slow target. Returns the
// number of bytes copied.
Result<uint64_t> CopyFile(Storage* src, std::string_view src_key, Storage* dst,
                          std::string_view dst_key, ThreadPool* pool,
                          const CopyFileOptions& opts = {}, const ProgressFn& progress = {});

// Writes `buffers` as the data file `key` of `stage` (a fast local directory)
// exactly as WriteDataFile does (unsynced there: it is a transient copy) and
// copies it to `key` of `target` while it is still being written: each range
// of copy_opts.chunk_bytes is read back from the staged file and written to
// `target` on `copy_pool` as soon as every byte of it is in the staged file
// (an S3 target uploads each part as soon as it is complete), so the upload
// starts after the first range instead of after the whole file. `copy_pool`
// must not be `pool` (copies would queue behind the whole local write). The
// target file is synced (copy_opts.sync) and closed before this returns; on
// failure it is aborted (never committed by callers) and the staged file is
// left for the caller to remove. The result is WriteDataFile's: the item
// locations and block checksums, hashed once from the caller's memory.
Result<DataFileResult> WriteDataFileStaged(Storage* stage, Storage* target, std::string_view key,
                                           const std::vector<BufferRef>& buffers, ThreadPool* pool,
                                           ThreadPool* copy_pool, const DataFileOptions& opts = {},
                                           const CopyFileOptions& copy_opts = {});

// ---- Convenience: named buffers -------------------------------------------

// A dense, row-major tensor in caller memory.
struct NamedBuffer {
  std::string name;
  std::string dtype;            // "float32", "int64", ... (format::DtypeItemSize)
  std::vector<uint64_t> shape;  // bytes = prod(shape) * itemsize
  const void* data = nullptr;
};

// Saves `buffers` as a one-rank checkpoint in `dir` (data/r0.bin + manifest),
// durably. InvalidArgument for unknown dtypes or duplicate names.
Status SaveBuffers(Storage* storage, std::string_view dir, const std::vector<NamedBuffer>& buffers,
                   ThreadPool* pool, const DataFileOptions& opts = {});

struct LoadedBuffer {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  std::vector<uint8_t> data;
};

// Loads every tensor of the checkpoint in `dir` (assembling multi-chunk
// tensors), verified. Bytes items are not returned.
Result<std::vector<LoadedBuffer>> LoadBuffers(Storage* storage, std::string_view dir,
                                              ThreadPool* pool);

}  // namespace cairn
