#include "cairn/thread_pool.h"

#include <algorithm>
#include <system_error>

namespace cairn {

size_t DefaultThreadCount(PoolKind kind) {
  size_t cores = std::max<size_t>(std::thread::hardware_concurrency(), 1);
  switch (kind) {
    case PoolKind::kIo:
      return std::clamp<size_t>(2 * cores, 16, 32);
    case PoolKind::kCopy:
      return std::clamp<size_t>(cores, 2, 8);
  }
  return 2;
}

ThreadPool::ThreadPool(size_t num_threads) {
  if (num_threads == 0) num_threads = 1;
  threads_.reserve(num_threads);
  for (size_t i = 0; i < num_threads; ++i) {
    try {
      threads_.emplace_back([this] { Loop(); });
    } catch (const std::system_error&) {
      // The system refused another thread (EAGAIN: a task limit, no room for
      // its stack). The pool works with the ones that started; with none it
      // cannot work, and the error goes to the caller with nothing to join.
      if (threads_.empty()) throw;
      break;
    }
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::Submit(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> l(mu_);
    queue_.push_back(std::move(fn));
  }
  cv_.notify_one();
}

void ThreadPool::Loop() {
  for (;;) {
    std::function<void()> fn;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      fn = std::move(queue_.front());
      queue_.pop_front();
    }
    fn();
  }
}

TaskGroup::~TaskGroup() { Wait().IgnoreError(); }

void TaskGroup::Run(std::function<Status()> fn) {
  {
    std::lock_guard<std::mutex> l(mu_);
    ++pending_;
  }
  pool_->Submit([this, fn = std::move(fn)] {
    Status s = Cancelled() ? Status::OK() : fn();
    std::lock_guard<std::mutex> l(mu_);
    if (!s.ok() && first_error_.ok()) first_error_ = s;
    if (--pending_ == 0) cv_.notify_all();
  });
}

Status TaskGroup::Wait() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [this] { return pending_ == 0; });
  return first_error_;
}

bool TaskGroup::Cancelled() const {
  std::lock_guard<std::mutex> l(mu_);
  return !first_error_.ok();
}

}  // namespace cairn
