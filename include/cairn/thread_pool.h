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
