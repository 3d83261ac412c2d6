// FaultInjectionStorage: a Storage wrapper that makes chosen calls fail, so
// every error path of the checkpoint engine can be tested without a real full
// disk or a dying drive (the idea of LevelDB's FaultInjectionTestEnv).
//
// What it can do, per operation (FaultOp):
//   * fail the Nth matching call, N consecutive calls, or every call from the
//     Nth on, optionally only for keys containing a substring, with a chosen
//     errno (ENOSPC -> kResourceExhausted, EIO -> kIOError, EACCES ->
//     kPermissionDenied ... the usual ErrnoToStatus mapping);
//   * short writes: a failing WriteAt first writes the leading
//     `partial_bytes` through, leaving a partial file as a crash would;
//   * crash: SIGKILL the whole process at that call (for crash-recovery tests);
//   * latency: sleep a fixed time before every call of an operation;
//   * bandwidth: a cap in bytes/s shared by all reads and writes through the
//     injector, modelling one slow pipe;
//   * counters: calls seen per operation and faults injected.
//
// The rules, latencies and counters live in a FaultInjector, shared by every
// storage and file that wraps with it, so a test can keep a handle on it while
// the code under test uses the wrapped storage it was given:
//
//   auto inj = std::make_shared<FaultInjector>();
//   std::shared_ptr<Storage> base = *OpenStorage("/tmp/ckpt");
//   FaultInjectionStorage st(base, inj);   // pass &st (Python: inj.wrap(storage))
//   inj->AddRule({.op = FaultOp::kWrite, .key_contains = "r1.bin", .error = ENOSPC});
//
// There is no fault:// scheme: engine calls take Storage objects, so a test
// wraps the storage it hands over instead of registering a name.
//
// Thread-safety: FaultInjector and FaultInjectionStorage are thread-safe;
// rules may change while calls are in flight.
#pragma once

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "cairn/storage.h"

namespace cairn {

// The operations a rule can target. File operations carry the file's key.
enum class FaultOp : int {
  kCreate = 0,  // Storage::NewWritableFile
  kOpen,        // Storage::NewReadableFile
  kWrite,       // WritableFile::WriteAt
  kAllocate,    // WritableFile::Allocate
  kSync,        // WritableFile::Sync
  kClose,       // WritableFile::Close
  kRead,        // ReadableFile::ReadAt
  kRename,      // Storage::Rename (matches on either key)
  kSyncDir,     // Storage::SyncDir
  kCreateDir,   // Storage::CreateDir
  kDelete,      // Storage::DeleteFile
  kDeleteDir,   // Storage::DeleteDir
  kList,        // Storage::List
  kExists,      // Storage::Exists
  kFileSize,    // Storage::FileSize
};
inline constexpr int kNumFaultOps = 15;

// "create", "open", "write", "allocate", "sync", "close", "read", "rename",
// "syncdir", "createdir", "delete", "deletedir", "list", "exists", "filesize".
std::string_view FaultOpName(FaultOp op);
// The inverse of FaultOpName; kInvalidArgument for an unknown name.
Result<FaultOp> ParseFaultOp(std::string_view name);

struct FaultRule {
  FaultOp op = FaultOp::kWrite;
  // Only calls whose key contains this substring match ("" = every key).
  std::string key_contains;
  // The first matching call that fails, counted from 1 since the rule was
  // added.
  uint64_t nth = 1;
  // How many consecutive matching calls fail from the nth on; 0 = every
  // matching call from the nth on.
  uint64_t count = 1;
  // The errno of the failure (translated by ErrnoToStatus).
  int error = EIO;
  // kWrite only: write this many leading bytes of the call (at most all but
  // one) to the base storage before failing. Negative = write nothing.
  int64_t partial_bytes = -1;
  // Instead of failing, SIGKILL the process at that call (before the call).
  bool crash = false;
};

// Shared fault state: rules, latencies, bandwidth cap and counters.
class FaultInjector {
 public:
  FaultInjector() = default;
  FaultInjector(const FaultInjector&) = delete;
  FaultInjector& operator=(const FaultInjector&) = delete;

  // Adds a rule and returns its id (for RemoveRule). Every rule matching a
  // call counts it; if several fire on the same call, the first added wins.
  int AddRule(FaultRule rule);
  // Removes a rule; false if there is no such id.
  bool RemoveRule(int id);
  void ClearRules();

  // Sleeps `delay` before every call of `op` (zero = none).
  void SetLatency(FaultOp op, std::chrono::microseconds delay);
  // Caps the bytes/s of all WriteAt and ReadAt calls together (0 = no cap).
  void SetBandwidth(uint64_t bytes_per_second);

  // Calls of `op` seen since construction or ResetCounters().
  uint64_t Calls(FaultOp op) const;
  // Faults injected (failed calls) since construction or ResetCounters().
  uint64_t Injected() const;
  void ResetCounters();

  // --- used by FaultInjectionStorage and its files -----------------------
  struct Decision {
    Status status;               // OK: go on with the real call
    int64_t partial_bytes = -1;  // for a failing kWrite
  };
  // Counts a call of `op` on `key` (and `key2` for Rename), applies its
  // latency, and says whether it fails.
  Decision OnCall(FaultOp op, std::string_view key, std::string_view key2 = {});
  // Blocks as long as moving `bytes` takes under the bandwidth cap.
  void Throttle(uint64_t bytes);

 private:
  struct ActiveRule {
    int id;
    FaultRule rule;
    uint64_t matched = 0;
  };

  mutable std::mutex mu_;
  std::vector<ActiveRule> rules_;
  int next_id_ = 1;
  std::chrono::microseconds latency_[kNumFaultOps] = {};
  uint64_t bandwidth_ = 0;
  std::chrono::steady_clock::time_point pipe_free_{};
  std::atomic<uint64_t> calls_[kNumFaultOps] = {};
  std::atomic<uint64_t> injected_{0};
};

// A Storage that forwards to a base Storage through a FaultInjector: a
// StorageWrapper overriding the calls a fault can hit. Thread-safe as the base
// is. Owns the base when given a unique_ptr, shares it when given a
// shared_ptr; the Storage* form borrows it (the base must outlive the wrapper
// and its files).
class FaultInjectionStorage final : public StorageWrapper {
 public:
  explicit FaultInjectionStorage(std::unique_ptr<Storage> base,
                                 std::shared_ptr<FaultInjector> injector = nullptr);
  explicit FaultInjectionStorage(std::shared_ptr<Storage> base,
                                 std::shared_ptr<FaultInjector> injector = nullptr);
  explicit FaultInjectionStorage(Storage* base, std::shared_ptr<FaultInjector> injector = nullptr);

  FaultInjector& injector() { return *injector_; }
  const std::shared_ptr<FaultInjector>& shared_injector() const { return injector_; }
  Storage* base() const { return target(); }

  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view key,
                                                        const WriteOptions& opts = {}) override;
  Result<std::unique_ptr<ReadableFile>> NewReadableFile(std::string_view key,
                                                        const ReadOptions& opts = {}) override;
  Status Rename(std::string_view from, std::string_view to) override;
  Status SyncDir(std::string_view dir) override;
  Status CreateDir(std::string_view dir) override;
  Status DeleteFile(std::string_view key) override;
  Status DeleteDir(std::string_view dir) override;
  Result<std::vector<DirEntry>> List(std::string_view dir) override;
  Result<bool> Exists(std::string_view key) override;
  Result<uint64_t> FileSize(std::string_view key) override;
  // The default commit (temp file, sync, rename, sync dir) through this
  // wrapper, so manifest commits meet the injected faults too.
  Status PutAtomic(std::string_view key, std::string_view data, bool if_absent = false) override {
    return Storage::PutAtomic(key, data, if_absent);
  }
  Status AbortStaleUploads(std::string_view dir, double older_than_s,
                           size_t* aborted = nullptr) override {
    return Storage::AbortStaleUploads(dir, older_than_s, aborted);
  }

 private:
  Storage* base_;  // == target()
  std::shared_ptr<FaultInjector> injector_;
};

}  // namespace cairn
