// `cairn floors PATH` (floors_command.h). Repetitions are the outer loop, so
// a burst of background load hits every floor alike; each figure is the
// median of its repetitions.
#include "floors_command.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <vector>

#include "cairn/floors.h"
#include "cairn/storage.h"

namespace cairn::cli {
namespace {

constexpr double kGB = 1e9;

struct Series {
  std::vector<double> seconds;
  uint64_t bytes = 0;
  double Median() const {
    std::vector<double> s = seconds;
    std::sort(s.begin(), s.end());
    size_t n = s.size();
    return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
  }
};

int Fail(const char* floor, const Status& s) {
  std::fprintf(stderr, "cairn floors: %s: %s\n", floor, s.ToString().c_str());
  return 1;
}

}  // namespace

int CmdFloors(const FloorsCommandOptions& opts) {
  std::string dir = LocalDirOfUri(opts.path);
  struct stat st;
  if (dir.empty() || opts.path.rfind("shm://", 0) == 0 || ::stat(dir.c_str(), &st) != 0 ||
      !S_ISDIR(st.st_mode)) {
    std::fprintf(stderr, "cairn floors: %s is not an existing local directory\n",
                 opts.path.c_str());
    return 2;
  }
  // Names in print order.
  const char* kNames[] = {"memcpy", "direct write", "parallel direct read"};
  std::map<std::string, Series> series;
  bool cold = opts.drop_caches;
  DirectIoFloorOptions dio;
  dio.drop_caches = opts.drop_caches;
  for (int rep = 0; rep < opts.reps; ++rep) {
    std::fprintf(stderr, "cairn floors: rep %d/%d\n", rep + 1, opts.reps);
    Result<FloorSample> m = MeasureMemcpyFloor(opts.bytes);
    if (!m.ok()) return Fail("memcpy", m.status());
    Result<DirectIoFloors> d = MeasureDirectIoFloors(dir, opts.bytes, dio);
    if (!d.ok()) return Fail("direct I/O", d.status());
    cold = cold && d->cold;
    for (auto [name, s] : {std::pair{kNames[0], *m}, {kNames[1], d->write}, {kNames[2], d->read}}) {
      series[name].seconds.push_back(s.seconds);
      series[name].bytes = s.bytes;
    }
  }
  if (opts.as_json) {
    nlohmann::json j = {{"path", opts.path},
                        {"bytes", opts.bytes},
                        {"reps", opts.reps},
                        {"cold_reads", cold},
                        {"read_streams", kFloorReadStreams}};
    for (const char* name : kNames) {
      const Series& s = series[name];
      j["floors"][name] = {{"median_s", s.Median()},
                           {"seconds", s.seconds},
                           {"bytes", s.bytes},
                           {"GBps", static_cast<double>(s.bytes) / s.Median() / kGB}};
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("cairn floors %s: %.2f GB, medians of %d; cold reads: %s; reads by %zu streams\n",
              opts.path.c_str(), static_cast<double>(opts.bytes) / kGB, opts.reps,
              cold ? "yes" : "no (page cache not dropped)", kFloorReadStreams);
  std::printf("%-24s%10s%9s\n", "floor", "median s", "GB/s");
  for (const char* name : kNames) {
    const Series& s = series[name];
    std::printf("%-24s%10.3f%9.2f\n", name, s.Median(),
                static_cast<double>(s.bytes) / s.Median() / kGB);
  }
  return 0;
}

}  // namespace cairn::cli
