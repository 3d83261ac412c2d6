// FileCache: a node-local, cross-process cache of the files of a slow source
// (a directory on a FUSE/NFS mount; later S3), with prefetching driven by the
// known future order of reads. It backs cairn.data.CachedFileDataset.
//
// One cache directory serves every process of a node (all DataLoader workers
// of all ranks): a file is fetched from the source at most once while it stays
// cached, the total size of cached files stays within a byte limit, and a file
// is never evicted while some process holds it (a "pin"). The protocol that
// makes this safe across processes that may be killed at any instant is
// described at the top of src/cache/file_cache.cc.
//
// Typical use (one FileCache per process):
//   ThreadPool pool(8);
//   auto src = OpenSourceStorage("slow:///mnt/data?latency=0.02");
//   auto files = ListFiles(src->get());
//   auto cache = FileCache::Open(std::move(*src), *files, &pool, opts);
//   cache->SetPlan(order, next_order, my_positions);   // what this process reads
//   for (size_t i = 0; i < my_positions.size(); ++i) {
//     auto path = cache->Acquire(i);    // blocks until the file is local
//     ... read *path ...
//     cache->Release(cache->PlanFile(i));
//   }
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "cairn/status.h"
#include "cairn/storage.h"
#include "cairn/thread_pool.h"

namespace cairn {

// One file of a source: its key (relative path) and size in bytes.
struct SourceFile {
  std::string key;
  uint64_t size = 0;
};

// Lists every regular file below the root of `source`, recursively, sorted by
// key. Symlinks are skipped (the backends do not report them). Names that
// contain the cache's temp marker (".cairn-tmp-") are rejected with
// kInvalidArgument, so a cached file can never be confused with a temp file.
Result<std::vector<SourceFile>> ListFiles(Storage* source);

// Opens a read-only source: OpenStorage(uri, /*create=*/false), so anything
// the one registry accepts, "slow://PATH?..." (a throttled source) included.
Result<std::unique_ptr<Storage>> OpenSourceStorage(std::string_view uri);

struct FileCacheOptions {
  // Directory that holds the cache (node-local, fast). The cache of one
  // dataset lives in a subdirectory named after a fingerprint of the source
  // and its file list, so several datasets can share `cache_dir`.
  std::string cache_dir;
  // Upper bound on the bytes of cached files (complete and in-flight) of this
  // dataset. Every process sharing the cache should pass the same value: each
  // enforces its own when admitting a file. Must be > 0.
  uint64_t limit_bytes = 0;
  // Prefetch window: at most this many files / bytes ahead of the consumer
  // are fetched (or held) by this process.
  size_t prefetch_files = 32;
  uint64_t prefetch_bytes = 256ull << 20;
  // How long Acquire() waits for room in the cache (all cached files pinned)
  // or for another process's copy, before failing.
  double wait_timeout_s = 120;
  // Size of one read from the source.
  size_t chunk_bytes = 4u << 20;
};

struct FileCacheStats {
  // This process.
  uint64_t fetched_files = 0;  // copied from the source by this process
  uint64_t fetched_bytes = 0;
  uint64_t hits = 0;    // Acquire() found the file already cached or prefetched
  uint64_t misses = 0;  // Acquire() had to wait for a fetch
  uint64_t evictions = 0;
  double wait_s = 0;  // total time Acquire() blocked
  // The whole cache (all processes, since the cache directory was created).
  uint64_t shared_fetched_files = 0;
  uint64_t shared_fetched_bytes = 0;
  uint64_t shared_evictions = 0;
  uint64_t used_bytes = 0;  // bytes of cached + in-flight files now
};

// Thread-safe: Acquire/Release/Stats may be called from several threads;
// SetPlan must not race Acquire. Owns the source storage; borrows the pool,
// which must outlive the cache. The destructor cancels prefetching, waits for
// copies in flight and releases every pin of this process.
class FileCache {
 public:
  // Opens (creating if needed) the cache of `files` of `source` below
  // opts.cache_dir; cleans temp files left by dead processes.
  static Result<std::unique_ptr<FileCache>> Open(std::unique_ptr<Storage> source,
                                                 std::vector<SourceFile> files, ThreadPool* pool,
                                                 FileCacheOptions opts);
  ~FileCache();
  FileCache(const FileCache&) = delete;
  FileCache& operator=(const FileCache&) = delete;

  // Declares the future: `order` is the global order of file ids (indexes
  // into the file list) for the current epoch, `next_order` the one of the
  // next epoch (used to rank eviction candidates: Belady's rule, evict the
  // file needed furthest in the future), and `positions` the indexes into
  // `order` that this process will Acquire, in that sequence. Prefetching of
  // positions[0..] starts at once. On success returns OK; kInvalidArgument for an id or position
  // out of range.
  Status SetPlan(std::vector<int64_t> order, std::vector<int64_t> next_order,
                 std::vector<int64_t> positions);

  // Number of entries of the plan and the file id of entry `i`.
  size_t PlanSize() const;
  int64_t PlanFile(size_t i) const;

  // Blocks until the file of plan entry `i` is in the cache and returns its
  // local path. The file is pinned (never evicted) until Release(id). Moves
  // the consumer cursor to `i`, which drives prefetching and eviction.
  Result<std::string> Acquire(size_t i);

  // Like Acquire, for file `id` outside any plan.
  Result<std::string> AcquireFile(int64_t id);

  // Drops one pin of file `id` taken by Acquire/AcquireFile.
  void Release(int64_t id);

  FileCacheStats Stats() const;
  // The directory holding this dataset's cache (table, lock, files/).
  const std::string& root() const { return root_; }
  const std::vector<SourceFile>& files() const { return files_; }

  struct Table;  // the shared index (file_cache.cc)

 private:
  FileCache(std::unique_ptr<Storage> source, std::vector<SourceFile> files, ThreadPool* pool,
            FileCacheOptions opts);
  Status Init();
  Status CleanStale();

  // Makes `id` cached and adds one pin of this process to it. Sets
  // *admitted=false (and returns OK) when a prefetch (demand=false) decides
  // not to fetch: no room without evicting a file needed sooner, or another
  // process is already fetching it.
  Status Fetch(int64_t id, bool demand, bool* admitted);
  Status Copy(int64_t id, int fd, const std::string& tmp_path);
  // The eviction decision: the cached files to evict, in order, to make room
  // for `size` more bytes for file `id` (empty when there is room). Belady:
  // latest next use first; a prefetch (!demand) stops before any file needed
  // no later than `id`. The caller evicts along it until there is room,
  // skipping pinned files. Needs the index lock; takes mu_.
  std::vector<int64_t> EvictionOrder(int64_t id, uint64_t size, bool demand);
  int64_t NextUse(int64_t id) const;  // needs mu_ (reads plan state)
  void Pump();                        // schedules prefetches; takes mu_
  void AddPin(int64_t id, int fd);    // takes mu_; adopts fd or closes it
  std::string FinalPath(int64_t id) const;
  Result<std::string> WaitFor(int64_t id, bool count_hit);

  std::unique_ptr<Storage> source_;
  std::vector<SourceFile> files_;
  ThreadPool* pool_;
  FileCacheOptions opts_;
  std::string root_;
  std::unique_ptr<Table> table_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Plan.
  std::vector<int64_t> pos_cur_, pos_next_;  // first position of each id
  int64_t order_len_ = 0;
  std::vector<int64_t> plan_;      // file ids in consumption order
  std::vector<int64_t> plan_pos_;  // their global positions
  size_t cursor_ = 0;              // plan entry the consumer is at
  size_t next_prefetch_ = 0;       // next plan entry to consider prefetching
  uint64_t generation_ = 0;        // bumped by SetPlan
  // Local state.
  struct Pin {
    int fd = -1;
    int refs = 0;
  };
  std::map<int64_t, Pin> pins_;
  std::set<int64_t> prefetched_;      // prefetched (cached, unpinned), not yet consumed
  std::map<int64_t, bool> inflight_;  // id -> is a prefetch (false = demand)
  uint64_t window_bytes_ = 0;         // bytes prefetched-unconsumed + prefetching
  size_t active_fetches_ = 0;         // prefetches fetching (bounded by the pool size)
  size_t running_tasks_ = 0;          // prefetch closures alive (the destructor waits for 0)
  bool closing_ = false;
  FileCacheStats stats_;
};

}  // namespace cairn
