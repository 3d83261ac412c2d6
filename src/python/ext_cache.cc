// Bindings for the file cache (cairn.data): argument conversion only; every
// call that can block (listing a slow source, fetching, waiting) releases the
// GIL.
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "cairn/cache.h"
#include "cairn/partition.h"
#include "common.h"
#include "struct_fields.h"
#include "without_gil.h"

namespace nb = nanobind;

namespace cairn::python {
namespace {

using IdArray = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

std::vector<int64_t> ToVector(const IdArray& a) {
  return std::vector<int64_t>(a.data(), a.data() + a.shape(0));
}

// Owns the pool the cache prefetches on. The cache is destroyed first
// (member order), so no task outlives the pool.
struct PyFileCache {
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<FileCache> cache;
};

// Reads whole files from a source (possibly slow://), for code that bypasses
// the cache (the stock-loader side of bench/data.py, tests).
struct PySourceReader {
  std::unique_ptr<Storage> source;
};

FileCache* Live(PyFileCache& self) {
  if (!self.cache) ThrowIfError(FailedPreconditionError("the file cache is closed"));
  return self.cache.get();
}

}  // namespace

void RegisterCache(nb::module_& m) {
  m.def(
      "list_source",
      [](const std::string& uri) {
        std::vector<SourceFile> files = WithoutGil([&]() -> Result<std::vector<SourceFile>> {
          CAIRN_ASSIGN_OR_RETURN(auto src, OpenSourceStorage(uri));
          return ListFiles(src.get());
        });
        std::vector<std::string> keys;
        std::vector<uint64_t> sizes;
        keys.reserve(files.size());
        sizes.reserve(files.size());
        for (auto& f : files) {
          keys.push_back(std::move(f.key));
          sizes.push_back(f.size);
        }
        return std::make_pair(keys, sizes);
      },
      nb::arg("uri"),
      "Lists the files of a source (path, file://, slow://...) recursively: (keys, sizes).");

  nb::class_<PySourceReader>(m, "SourceReader")
      .def(
          "__init__",
          [](PySourceReader* self, const std::string& uri) {
            new (self) PySourceReader{ValueOrThrow(OpenSourceStorage(uri))};
          },
          nb::arg("uri"))
      .def(
          "read",
          [](PySourceReader& self, const std::string& key) {
            std::string buf = WithoutGil([&]() -> Result<std::string> {
              auto r = ReadWholeFile(*self.source, key);
              if (!r.ok())
                return r.status().WithContext("reading " + key + " from " +
                                              self.source->Describe());
              return r;
            });
            return nb::bytes(buf.data(), buf.size());
          },
          nb::arg("key"), "Reads the whole file `key` from the source.");

  nb::class_<PyFileCache>(m, "FileCache", nb::is_weak_referenceable())
      .def(
          "__init__",
          [](PyFileCache* self, const std::string& source, const std::string& cache_dir,
             uint64_t limit, std::vector<std::string> keys, std::vector<uint64_t> sizes,
             size_t threads, size_t prefetch_files, uint64_t prefetch_bytes, double timeout) {
            if (keys.size() != sizes.size()) {
              ThrowIfError(InvalidArgumentError("keys and sizes differ in length"));
            }
            std::vector<SourceFile> files(keys.size());
            for (size_t i = 0; i < keys.size(); ++i) files[i] = {std::move(keys[i]), sizes[i]};
            const FileCacheOptions o{.cache_dir = cache_dir,
                                     .limit_bytes = limit,
                                     .prefetch_files = prefetch_files,
                                     .prefetch_bytes = prefetch_bytes,
                                     .wait_timeout_s = timeout};
            auto pool = std::make_unique<ThreadPool>(threads);
            auto c = WithoutGil([&]() -> Result<std::unique_ptr<FileCache>> {
              CAIRN_ASSIGN_OR_RETURN(auto src, OpenSourceStorage(source));
              return FileCache::Open(std::move(src), std::move(files), pool.get(), o);
            });
            new (self) PyFileCache{std::move(pool), std::move(c)};
          },
          nb::arg("source"), nb::arg("cache_dir"), nb::arg("limit"), nb::arg("keys"),
          nb::arg("sizes"), nb::arg("threads") = 8, nb::arg("prefetch_files") = 32,
          nb::arg("prefetch_bytes") = uint64_t{256} << 20, nb::arg("timeout") = 120.0)
      .def(
          "set_plan",
          [](PyFileCache& self, IdArray order, IdArray next_order, IdArray positions) {
            auto o = ToVector(order), n = ToVector(next_order), p = ToVector(positions);
            FileCache* c = Live(self);
            WithoutGil([&] { return c->SetPlan(std::move(o), std::move(n), std::move(p)); });
          },
          nb::arg("order"), nb::arg("next_order"), nb::arg("positions"))
      .def(
          "set_epoch_plan",
          [](PyFileCache& self, IdArray order, IdArray next_order, int64_t start,
             int64_t world_size, int64_t rank, bool drop_last, int64_t num_workers,
             int64_t worker_id, int64_t batch_size) {
            if (world_size < 1) ThrowIfError(InvalidArgumentError("world_size must be >= 1"));
            int64_t n = static_cast<int64_t>(order.shape(0));
            std::vector<int64_t> padded =
                Padded({order.data(), order.shape(0)}, EpochEnd(n, start, world_size, drop_last));
            std::vector<int64_t> positions =
                WorkerPositions(RankPositions(n, start, world_size, rank, drop_last), num_workers,
                                worker_id, batch_size);
            auto next = ToVector(next_order);
            FileCache* c = Live(self);
            WithoutGil([&] {
              return c->SetPlan(std::move(padded), std::move(next), std::move(positions));
            });
            return c->PlanSize();
          },
          nb::arg("order"), nb::arg("next_order"), nb::arg("start"), nb::arg("world_size"),
          nb::arg("rank"), nb::arg("drop_last"), nb::arg("num_workers"), nb::arg("worker_id"),
          nb::arg("batch_size"),
          "set_plan for the part of the epoch `order` (from position `start`) that DataLoader "
          "worker `worker_id` of `rank` produces (cairn/partition.h); returns the plan size.")
      .def("plan_size", [](PyFileCache& self) { return Live(self)->PlanSize(); })
      .def("plan_file", [](PyFileCache& self, size_t i) { return Live(self)->PlanFile(i); })
      .def(
          "acquire",
          [](PyFileCache& self, size_t i) {
            FileCache* c = Live(self);
            return WithoutGil([&] { return c->Acquire(i); });
          },
          nb::arg("i"), "Waits for plan entry i; returns its local path (pinned).")
      .def(
          "acquire_file",
          [](PyFileCache& self, int64_t id) {
            FileCache* c = Live(self);
            return WithoutGil([&] { return c->AcquireFile(id); });
          },
          nb::arg("id"))
      .def(
          "release", [](PyFileCache& self, int64_t id) { Live(self)->Release(id); }, nb::arg("id"))
      .def_prop_ro("root", [](PyFileCache& self) { return Live(self)->root(); })
      .def("stats",
           [](PyFileCache& self) {
             FileCacheStats s;
             FileCache* c = Live(self);
             {
               nb::gil_scoped_release nogil;
               s = c->Stats();
             }
             using S = FileCacheStats;
             return FieldsDict(
                 s, F("fetched_files", &S::fetched_files), F("fetched_bytes", &S::fetched_bytes),
                 F("hits", &S::hits), F("misses", &S::misses), F("evictions", &S::evictions),
                 F("wait_s", &S::wait_s), F("shared_fetched_files", &S::shared_fetched_files),
                 F("shared_fetched_bytes", &S::shared_fetched_bytes),
                 F("shared_evictions", &S::shared_evictions), F("used_bytes", &S::used_bytes));
           })
      .def("abandon",
           [](PyFileCache& self) {
             // In a forked child: the engine's threads do not exist here, so
             // it can be neither used nor destroyed. Leak it on purpose.
             (void)self.cache.release();
             (void)self.pool.release();
           })
      .def("close", [](PyFileCache& self) {
        std::unique_ptr<FileCache> c = std::move(self.cache);
        nb::gil_scoped_release nogil;
        c.reset();
      });
}

}  // namespace cairn::python
