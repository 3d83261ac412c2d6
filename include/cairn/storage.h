// Storage: the one small interface behind which every backend lives.
//
// A Storage is rooted at one location (a directory, a shared-memory
// namespace, an in-memory map, later an S3 prefix). Every path given to it is
// a *relative key* below that root: '/'-separated, no empty, "." or ".."
// component, no leading '/', no NUL. ValidateKey() enforces this in every
// backend, so no call can reach outside the root.
//
// Backends (one folder each under src/storage/):
//   posix  plain directories; direct I/O with aligned buffers where the
//          filesystem allows it, buffered I/O otherwise. Symbolic links inside
//          the root are never followed.
//   shm    node shared memory (/dev/shm); survives the process, not the node.
//   mem    a process-local map, for tests.
//   fault  a wrapper that injects errors, short writes and latency
//          (cairn/fault_injection.h).
//   s3     an S3 bucket prefix over libcurl (cairn/s3.h).
// Every backend passes the conformance suite in
// tests/cpp/storage_conformance_test.cc, which is also the precise contract
// of each method below (error codes included).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cairn/status.h"

namespace cairn {

// A file being written. Positional writes to disjoint ranges may run
// concurrently from several threads; Sync() and Close() must not race writes.
class WritableFile {
 public:
  virtual ~WritableFile() = default;

  // Writes `n` bytes from `data` at byte `offset`. On success all n bytes were
  // written (short writes are retried internally or reported as an error).
  virtual Status WriteAt(uint64_t offset, const void* data, size_t n) = 0;

  // Reserves space for `size` bytes (fallocate where supported) so that a
  // disk-full condition surfaces early. A no-op where unsupported.
  virtual Status Allocate(uint64_t size) { return Status::OK(); }

  // Makes everything written so far durable (fsync / fdatasync).
  virtual Status Sync() = 0;

  // Releases the file. Writes after Close() fail. Close() does not imply Sync().
  // (On s3, Close() publishes the object like Sync() does: see cairn/s3.h.)
  virtual Status Close() = 0;

  // Declares that [offset, offset+n) will never be written: it reads as
  // zeros (padding between items). Lets a backend that uploads in parts (s3)
  // send a part as soon as the rest of it is written. A no-op elsewhere.
  virtual Status Hole(uint64_t offset, uint64_t n) { return Status::OK(); }

  // Gives up on the file after a failed write: releases it like Close(), and
  // a backend that publishes only at the end (s3) discards what was written
  // (aborts the multipart upload). What remains of the file is unspecified
  // (posix keeps the partial file); callers never commit it.
  virtual Status Abort() { return Close(); }
};

// A file being read. ReadAt may be called concurrently from several threads.
class ReadableFile {
 public:
  virtual ~ReadableFile() = default;

  // Reads exactly `n` bytes at `offset` into `buf`. Reading past the end of the
  // file returns kOutOfRange (a truncated file is detected by the caller and
  // reported as data loss with the file's name).
  virtual Status ReadAt(uint64_t offset, void* buf, size_t n) const = 0;

  // The file's size in bytes at open time.
  virtual uint64_t Size() const = 0;

  // One piece of a vectored read: `n` bytes into `buf`, or `n` bytes
  // skipped when `buf` is null.
  struct Segment {
    char* buf = nullptr;
    size_t n = 0;
  };

  // Reads the consecutive bytes starting at `offset` into `segs` in order
  // (null segments skip their bytes), with the errors of ReadAt. A backend
  // with a cost per request (s3) serves it with one request; the default
  // is one ReadAt per non-null segment. May be called concurrently.
  virtual Status ReadV(uint64_t offset, const std::vector<Segment>& segs) const {
    for (const Segment& s : segs) {
      if (s.buf != nullptr && s.n > 0) {
        Status st = ReadAt(offset, s.buf, s.n);
        if (!st.ok()) return st;
      }
      offset += s.n;
    }
    return Status::OK();
  }

  // Reads smaller than this are worth coalescing with their neighbours into
  // one ReadV (0 = no preference: each read may be issued on its own, as on
  // local disks). s3: its part size, the size of one ranged GET.
  virtual uint64_t PreferredReadSize() const { return 0; }

  // The file's bytes, mapped in this process for as long as the file is open
  // (a staging slot read back, StagingPool::OpenMapped), or null. A reader
  // then hashes them a cache-sized piece at a time and copies each piece
  // while it is in cache, with no system call.
  virtual const char* MappedData() const { return nullptr; }
};

struct WriteOptions {
  // Ask for O_DIRECT where the backend and filesystem support it. Backends
  // fall back to buffered I/O silently when they cannot honour it.
  bool direct_io = false;
};

struct ReadOptions {
  bool direct_io = false;
};

// One entry returned by List().
struct DirEntry {
  std::string name;  // the last path component
  bool is_dir = false;
  uint64_t size = 0;  // bytes, for files

  // List() returns its entries in this order: by name.
  friend bool operator<(const DirEntry& a, const DirEntry& b) { return a.name < b.name; }
};

// Thread-safe: every method may be called concurrently.
class Storage {
 public:
  virtual ~Storage() = default;

  // Creates (or truncates) the file `key`, creating parent directories.
  virtual Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view key,
                                                                const WriteOptions& opts = {}) = 0;

  // Opens the existing file `key`; kNotFound if it does not exist.
  virtual Result<std::unique_ptr<ReadableFile>> NewReadableFile(std::string_view key,
                                                                const ReadOptions& opts = {}) = 0;

  // Atomically replaces `to` by `from` (rename(2) semantics): a reader sees
  // either the old or the new `to`, never a mix. Creates the parents of `to`.
  // kNotFound if `from` does not exist.
  virtual Status Rename(std::string_view from, std::string_view to) = 0;

  // Makes the directory entries of `dir` ("" = the root) durable (fsync on
  // the directory), so a preceding create or rename survives a power cut.
  virtual Status SyncDir(std::string_view dir) = 0;

  // Creates directory `dir` and its parents; OK if it already exists.
  virtual Status CreateDir(std::string_view dir) = 0;

  // Deletes the file `key`; kNotFound if absent.
  virtual Status DeleteFile(std::string_view key) = 0;

  // Deletes the directory `dir` and everything below it; OK if absent.
  // DeleteDir("") empties the root but keeps it.
  virtual Status DeleteDir(std::string_view dir) = 0;

  // Lists the entries directly inside `dir` ("" = the root), sorted by name;
  // kNotFound if `dir` is not a directory.
  virtual Result<std::vector<DirEntry>> List(std::string_view dir) = 0;

  // Whether a file or directory named `key` exists.
  virtual Result<bool> Exists(std::string_view key) = 0;

  // The size of file `key` in bytes.
  virtual Result<uint64_t> FileSize(std::string_view key) = 0;

  // Creates `key` holding exactly `data`, atomically and durably: readers see
  // no file (or the previous one) or all of `data`, never a part; on OK it
  // survives a crash. With `if_absent`, fails with kAlreadyExists when `key`
  // exists, changing nothing. The commit of a checkpoint's manifest uses it.
  // The default writes `key`.tmp, syncs it, renames it over `key` and syncs
  // the directory (if_absent is then checked before the rename, which is
  // enough for a single committer); s3 does one PUT with If-None-Match: *.
  virtual Status PutAtomic(std::string_view key, std::string_view data, bool if_absent = false);

  // Aborts unfinished uploads below `dir` ("" = the root) started more than
  // `older_than_s` seconds ago (left behind by killed saves); OK and a no-op
  // for backends without them. `aborted` (optional) counts them.
  virtual Status AbortStaleUploads(std::string_view dir, double older_than_s,
                                   size_t* aborted = nullptr) {
    if (aborted) *aborted = 0;
    return Status::OK();
  }

  // A human-readable name of the root, e.g. "/data/ckpt" or "shm://job1".
  virtual std::string Describe() const = 0;

  // The local filesystem path of the root, when the backend has one (posix,
  // shm); empty otherwise.
  virtual std::string LocalPath() const { return {}; }
};

// A Storage that forwards every call to a target storage (LevelDB's
// EnvWrapper). Wrappers that change a few calls (fault injection, throttling)
// derive from it and override only those; anything else reaches the target
// unchanged. Thread-safe as the target is. Owns the target when constructed
// from a unique_ptr, shares it when constructed from a shared_ptr (a storage
// the Python package holds and wraps); a raw target must outlive the wrapper.
class StorageWrapper : public Storage {
 public:
  explicit StorageWrapper(Storage* target) : target_(target) {}
  explicit StorageWrapper(std::unique_ptr<Storage> target)
      : owned_(std::move(target)), target_(owned_.get()) {}
  explicit StorageWrapper(std::shared_ptr<Storage> target)
      : owned_(std::move(target)), target_(owned_.get()) {}

  Storage* target() const { return target_; }

  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view key,
                                                        const WriteOptions& opts = {}) override {
    return target_->NewWritableFile(key, opts);
  }
  Result<std::unique_ptr<ReadableFile>> NewReadableFile(std::string_view key,
                                                        const ReadOptions& opts = {}) override {
    return target_->NewReadableFile(key, opts);
  }
  Status Rename(std::string_view from, std::string_view to) override {
    return target_->Rename(from, to);
  }
  Status SyncDir(std::string_view dir) override { return target_->SyncDir(dir); }
  Status CreateDir(std::string_view dir) override { return target_->CreateDir(dir); }
  Status DeleteFile(std::string_view key) override { return target_->DeleteFile(key); }
  Status DeleteDir(std::string_view dir) override { return target_->DeleteDir(dir); }
  Result<std::vector<DirEntry>> List(std::string_view dir) override { return target_->List(dir); }
  Result<bool> Exists(std::string_view key) override { return target_->Exists(key); }
  Result<uint64_t> FileSize(std::string_view key) override { return target_->FileSize(key); }
  Status PutAtomic(std::string_view key, std::string_view data, bool if_absent = false) override {
    return target_->PutAtomic(key, data, if_absent);
  }
  Status AbortStaleUploads(std::string_view dir, double older_than_s,
                           size_t* aborted = nullptr) override {
    return target_->AbortStaleUploads(dir, older_than_s, aborted);
  }
  std::string Describe() const override { return target_->Describe(); }
  std::string LocalPath() const override { return target_->LocalPath(); }

 private:
  std::shared_ptr<Storage> owned_;
  Storage* target_;
};

// Checks that `key` is a safe relative key (see the comment at the top).
// The empty key is valid only when `allow_root` is true.
Status ValidateKey(std::string_view key, bool allow_root = false);

// Joins two keys with '/', skipping empty parts.
std::string JoinKey(std::string_view a, std::string_view b);

// Backends. Each returns a Storage rooted at the given place, creating the
// root directory when `create` is true.
Result<std::unique_ptr<Storage>> NewPosixStorage(const std::string& root_dir, bool create = true);
// Shared memory of this node: files under /dev/shm/<name>/ ("shm://name").
// `name` is a key (it may contain '/').
Result<std::unique_ptr<Storage>> NewShmStorage(const std::string& name, bool create = true);
// Where node shared memory is mounted, and the directory behind shm://NAME.
inline constexpr std::string_view kShmRoot = "/dev/shm";
std::string ShmDirectory(std::string_view name);
// A fresh, empty in-memory storage. Its contents die with the object.
std::unique_ptr<Storage> NewMemStorage();

// Wraps `base` so that it behaves like a slow mount: every open, list and
// stat sleeps `latency_s` (operations from several threads overlap, as they do
// on a network mount), and reads share a bandwidth cap of `bytes_per_s` (0 =
// none). The cap is shared by every process of the node that wraps a source
// with the same `share_name`: its state lives in a page of /dev/shm named
// "cairn-throttle-<share_name>". Thread-safe.
Result<std::unique_ptr<Storage>> NewThrottledStorage(std::unique_ptr<Storage> base,
                                                     double latency_s, double bytes_per_s,
                                                     const std::string& share_name);

// "slow://PATH?latency=SECONDS&bandwidth=BYTES_PER_S&share=NAME": the storage
// at PATH (opened without creating it) behind NewThrottledStorage, for tests
// and benchmarks of slow mounts. `share` defaults to one per (user, PATH, rate).
Result<std::unique_ptr<Storage>> OpenThrottledStorage(std::string_view uri);

// The one registry: opens the storage named by `uri`: a plain path or
// "file://PATH" (posix), "shm://NAME" (shm), "mem://" (a fresh mem storage),
// "s3://BUCKET/PREFIX" (s3, configured from the environment: cairn/s3.h)
// or "slow://PATH?..." (OpenThrottledStorage). A URI is opened once, where
// the user's path enters (a Writer, Reader, tier or cache); the engine calls
// then take the Storage. Wrappers (fault injection) wrap an open Storage and
// have no scheme.
Result<std::unique_ptr<Storage>> OpenStorage(std::string_view uri, bool create = true);

// The local directory that OpenStorage(uri) is (or would be) rooted at, whether
// or not it exists yet: the path of a plain or file:// URI, ShmDirectory(NAME)
// of shm://NAME; empty for every other scheme and for a malformed URI.
std::string LocalDirOfUri(std::string_view uri);

// Checks that `uri` can name a checkpoint (the Writer's and Reader's path):
// a plain path or file://, shm:// or s3:// URI. InvalidArgument for
// an empty one or another scheme (mem:// and slow:// hold no checkpoints).
Status CheckCheckpointUri(std::string_view uri);

}  // namespace cairn
