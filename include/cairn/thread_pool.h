// ThreadPool: a fixed set of worker threads running submitted closures, and
// TaskGroup: a way to wait for a batch of Status-returning tasks.
//
// Thread-safe. The pool owns its threads; the destructor finishes queued work
// and joins them. Executors are passed to the components that need them
// (never a hidden global), so tests can choose sizes and callers can share
// one pool between reads and writes.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "cairn/status.h"

namespace cairn {

// What a pool's threads mostly do, which decides how many it should have.
enum class PoolKind {
  // Reads, writes and fsyncs: the threads mostly wait on the device, and more
  // requests in flight keep it busy.
  kIo,
  // memcpy, zeroing and hashing: bound by memory bandwidth, which a few
  // cores saturate; more threads than cores only add switches.
  kCopy,
};

// The size cairn gives a pool of `kind` on this machine: the one sizing rule,
// used by the CLI and the Python package alike. kIo: 2 per core, 16 to 32 (16
// measured ~1.2x faster than 4 on a 2-core VM with a virtio disk). kCopy: 1
// per core, 2 to 8.
size_t DefaultThreadCount(PoolKind kind);

class ThreadPool {
 public:
  // Starts `num_threads` workers (at least 1).
  explicit ThreadPool(size_t num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Queues `fn` to run on a worker. Never blocks.
  void Submit(std::function<void()> fn);

  size_t size() const { return threads_.size(); }

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// Runs Status-returning tasks on a pool and waits for all of them. The first
// non-OK status is kept; once a task fails, tasks that have not started yet
// are skipped (they see Cancelled()). Thread-safe; not reusable after Wait().
class TaskGroup {
 public:
  explicit TaskGroup(ThreadPool* pool) : pool_(pool) {}
  ~TaskGroup();  // waits for outstanding tasks

  void Run(std::function<Status()> fn);

  // Blocks until every task finished; returns the first error or OK.
  Status Wait();

  // True once a task failed.
  bool Cancelled() const;

 private:
  ThreadPool* pool_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  size_t pending_ = 0;
  Status first_error_;
};

}  // namespace cairn
