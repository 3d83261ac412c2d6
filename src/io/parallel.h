// Internal: run N independent, equally cheap work items on a ThreadPool with
// the calling thread taking part.
//
// Items are claimed from one atomic counter, so there is one task per helper
// thread rather than one per item. The caller works too and, once every item
// is claimed, waits only for helpers that are running an item; helpers that
// start later (the pool was busy with other work) find the call closed and
// leave at once. So a call never waits for an unrelated queue to drain, and
// with a null or busy pool it simply runs on the caller.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "cairn/thread_pool.h"

namespace cairn::internal {

// Copies (and zeroings) of fewer bytes than this run on the calling thread
// alone: one thread copies 4 MiB in ~0.3 ms, about what waking helpers costs
// on a loaded machine.
inline constexpr uint64_t kInlineCopyBytes = uint64_t{4} << 20;

inline void ParallelFor(size_t n, ThreadPool* pool, size_t max_threads,
                        const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  size_t helpers = pool ? std::min(pool->size(), n - 1) : 0;
  if (max_threads > 0) helpers = std::min(helpers, max_threads - 1);
  if (helpers == 0) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // Shared with the helpers, which may outlive this call (see above).
  struct State {
    std::atomic<size_t> next{0};
    size_t n = 0;
    std::mutex mu;
    std::condition_variable cv;
    size_t active = 0;
    bool closed = false;
    const std::function<void(size_t)>* fn = nullptr;
  };
  auto st = std::make_shared<State>();
  st->n = n;
  st->fn = &fn;
  auto work = [](State& s) {
    for (size_t i = s.next.fetch_add(1); i < s.n; i = s.next.fetch_add(1)) (*s.fn)(i);
  };
  for (size_t h = 0; h < helpers; ++h) {
    pool->Submit([st, work] {
      {
        std::lock_guard<std::mutex> l(st->mu);
        if (st->closed) return;
        ++st->active;
      }
      work(*st);
      std::lock_guard<std::mutex> l(st->mu);
      if (--st->active == 0) st->cv.notify_all();
    });
  }
  work(*st);
  std::unique_lock<std::mutex> l(st->mu);
  st->closed = true;
  st->cv.wait(l, [&] { return st->active == 0; });
}

}  // namespace cairn::internal
