// Staging copy vs the memcpy floor (SPEC §4: the blocking stall of an async
// save must stay within 1.25x a plain memcpy of the same bytes into a
// pre-faulted buffer).
//
// Builds a reference state of ~200 tensors (CAIRN_BENCH_BYTES, default
// 1.5 GB) in separate heap buffers and times, per repetition:
//   floor      one thread memcpy's every tensor into a pre-faulted heap buffer
//   stage T=k  StagingPool::CopyIn into a pre-faulted shared-memory slot with
//              k threads (the caller + k-1 pool workers)
//   xxh3 T=k   BlockChecksums over the staged bytes (16 MiB blocks), which a
//              persist pays in the background, for scale
// The first repetition warms up and is dropped; the table reports medians.
//
//   cmake -B build -DCAIRN_BUILD_BENCH=ON && cmake --build build --target bench_staging_copy
//   build/bench_staging_copy [repetitions]
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cairn/checksum.h"
#include "cairn/staging.h"
#include "cairn/storage.h"

namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

template <typename Fn>
double MedianSeconds(int reps, Fn&& fn) {
  std::vector<double> t;
  for (int r = 0; r <= reps; ++r) {
    auto t0 = Clock::now();
    fn();
    benchmark::ClobberMemory();
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (r > 0) t.push_back(s);  // repetition 0 warms up
  }
  return Median(t);
}

void Die(const cairn::Status& s) {
  std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
  std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = argc > 1 ? std::atoi(argv[1]) : 5;
  uint64_t target = 1'500'000'000ull;
  if (const char* e = std::getenv("CAIRN_BENCH_BYTES")) target = std::strtoull(e, nullptr, 10);
  constexpr int kTensors = 200;

  // Tensor sizes: log-uniform between 64 KiB and ~60 MiB, scaled to the target.
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<double> u(std::log(64e3), std::log(60e6));
  std::vector<double> raw(kTensors);
  double sum = 0;
  for (auto& r : raw) sum += (r = std::exp(u(rng)));
  std::vector<std::vector<char>> tensors;
  std::vector<cairn::CopySpan> spans;
  uint64_t offset = 0;
  for (int i = 0; i < kTensors; ++i) {
    size_t n = static_cast<size_t>(raw[i] / sum * static_cast<double>(target)) / 4 * 4;
    tensors.emplace_back(n, static_cast<char>(i));  // filled: pages are faulted in
    spans.push_back({tensors.back().data(), offset, n});
    offset += (n + 4095) / 4096 * 4096;  // items 4 KiB aligned, as in the data files
  }
  const uint64_t total = offset;
  uint64_t payload = 0;
  for (auto& s : spans) payload += s.nbytes;

  std::vector<char> floor_dst(total, 1);  // pre-faulted by the fill
  double floor_s = MedianSeconds(reps, [&] {
    for (auto& s : spans) std::memcpy(floor_dst.data() + s.dst_offset, s.src, s.nbytes);
  });
  floor_dst = std::vector<char>();  // give the memory back before staging

  cairn::StagingPoolOptions opts;
  opts.root_dir = cairn::ShmDirectory("cairn-bench-" + std::to_string(::getpid()));
  opts.num_slots = 1;
  auto pool = cairn::StagingPool::Open(opts);
  if (!pool.ok()) Die(pool.status());
  cairn::ThreadPool prefault_threads(1);
  auto t0 = Clock::now();
  auto slot = (*pool)->Acquire(total, &prefault_threads);
  if (!slot.ok()) Die(slot.status());
  double first_acquire_s = std::chrono::duration<double>(Clock::now() - t0).count();

  std::printf("state: %d tensors, %.3f GB (%.3f GB with 4 KiB alignment), %d repetitions\n",
              kTensors, payload / 1e9, total / 1e9, reps);
  std::printf("first Acquire (grow + pre-fault on 2 threads, paid once): %.3f s\n\n",
              first_acquire_s);
  std::printf("%-28s %10s %10s %10s\n", "method", "median s", "GB/s", "x floor");
  std::printf("%-28s %10.4f %10.2f %10.3f\n", "floor: memcpy, 1 thread", floor_s,
              payload / floor_s / 1e9, 1.0);
  for (size_t threads : {1, 2, 4}) {
    cairn::ThreadPool workers(std::max<size_t>(threads - 1, 1));
    cairn::ThreadPool* p = threads > 1 ? &workers : nullptr;
    double s = MedianSeconds(reps, [&] {
      cairn::Status st = (*pool)->CopyIn(slot->index, spans, p);
      if (!st.ok()) Die(st);
    });
    std::string name = "stage CopyIn, " + std::to_string(threads) + " thread(s)";
    std::printf("%-28s %10.4f %10.2f %10.3f\n", name.c_str(), s, payload / s / 1e9, s / floor_s);
  }
  for (size_t threads : {1, 2}) {
    cairn::ThreadPool workers(std::max<size_t>(threads - 1, 1));
    cairn::ThreadPool* p = threads > 1 ? &workers : nullptr;
    double s = MedianSeconds(reps, [&] {
      auto sums = cairn::BlockChecksums(slot->data, total, cairn::kChecksumBlockSize, p);
      benchmark::DoNotOptimize(sums);
    });
    std::string name = "xxh3 blocks, " + std::to_string(threads) + " thread(s)";
    std::printf("%-28s %10.4f %10.2f %10.3f\n", name.c_str(), s, total / s / 1e9, s / floor_s);
  }
  std::printf("\nshared-memory footprint: %.3f GB (state %.3f GB)\n", (*pool)->footprint() / 1e9,
              total / 1e9);
  cairn::Status st = (*pool)->Close();
  if (!st.ok()) Die(st);
  return 0;
}
