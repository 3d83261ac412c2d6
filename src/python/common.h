// Shared helpers for the binding code: Status -> Python exception mapping.
// The binding layer only converts arguments and releases the GIL around
// blocking calls; the exception classes themselves live in cairn/errors.py,
// which keeps retryable codes (Unavailable, DeadlineExceeded) apart as
// cairn.TransientError subclasses.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cairn/checkpoint.h"
#include "cairn/read_plan.h"
#include "cairn/status.h"
#include "cairn/storage.h"

namespace cairn::python {

// A Storage owned by Python (_ext.Storage, from _ext.open_storage).
struct PyStorage {
  std::unique_ptr<Storage> s;
};

// A CheckpointReader together with the Storage it reads from
// (_ext.CheckpointReader): opened from a URI, or handed over by the engine
// (the memory-tier readers TierSet opened while listing candidates).
class PyCheckpointReader {
 public:
  // Opens the committed checkpoint at `uri`: manifest validated, data file
  // sizes checked (raises on failure).
  explicit PyCheckpointReader(const std::string& uri);
  PyCheckpointReader(std::string uri, std::unique_ptr<Storage> storage,
                     std::unique_ptr<CheckpointReader> reader);

  const Manifest& manifest() const { return reader_->manifest(); }

  // (kind, index, chunk, dest address, nbytes, byte offset in the item);
  // kind 0 = tensor chunk, 1 = bytes item.
  using ReadTuple = std::tuple<int, uint32_t, uint32_t, uintptr_t, uint64_t, uint64_t>;
  void Read(const std::vector<ReadTuple>& requests, ThreadPool& pool);

  // boxes: (fqn, chunk offsets, offsets in the chunk, lengths, dest address,
  // nbytes); values: names of bytes items. Reads both (ReadBoxes); returns
  // each value's bytes, in order.
  using BoxTuple = std::tuple<std::string, std::vector<uint64_t>, std::vector<int64_t>,
                              std::vector<int64_t>, uintptr_t, uint64_t>;
  nanobind::list ReadItems(const std::vector<BoxTuple>& boxes,
                           const std::vector<std::string>& values, ThreadPool& pool);

  // PlanInPlace's plan: the engine reads, with the requests of non-tensor
  // values (positions `values`) still to be pointed at buffers of their own.
  struct InPlacePlan {
    std::vector<ReadRequest> requests;
    std::vector<size_t> values;
  };
  // targets: (fqn, dtype name or None for a non-tensor value, shape, address,
  // nbytes). The plan (PlanInPlaceRead), or None.
  using TargetTuple = std::tuple<std::string, std::optional<std::string>, std::vector<uint64_t>,
                                 uintptr_t, uint64_t>;
  std::optional<InPlacePlan> PlanInPlace(const std::vector<TargetTuple>& targets);
  // Reads the plan, verified, in parallel; returns the bytes of each value
  // target, in target order.
  nanobind::list LoadInPlace(const InPlacePlan& plan, ThreadPool& pool);

 private:
  std::string uri_;
  std::unique_ptr<Storage> storage_;
  std::unique_ptr<CheckpointReader> reader_;
  std::unique_ptr<ItemIndex> index_;  // over reader_'s manifest
};

// Raises the Python exception matching `s` (see cairn/errors.py). `s` must
// not be OK.
[[noreturn]] void RaiseStatus(const Status& s);

inline void ThrowIfError(const Status& s) {
  if (!s.ok()) RaiseStatus(s);
}

template <typename T>
T ValueOrThrow(Result<T>&& r) {
  if (!r.ok()) RaiseStatus(r.status());
  return std::move(r).value();
}

// Opens the storage at `uri` and returns fn(storage), all with the GIL
// released (the caller converts the Result afterwards).
template <typename T, typename Fn>
Result<T> WithStorage(const std::string& uri, bool create, Fn&& fn) {
  nanobind::gil_scoped_release release;
  Result<std::unique_ptr<Storage>> storage = OpenStorage(uri, create);
  if (!storage.ok()) return storage.status();
  return fn(storage->get());
}

inline DataFileOptions MakeDataFileOptions(bool direct_io, bool sync, uint64_t block_size) {
  DataFileOptions opts;
  opts.direct_io = direct_io;
  opts.sync = sync;
  opts.block_size = block_size;
  return opts;
}

// Each area of the extension registers its functions from its own file
// (RegisterStorage in ext_storage.cc, ...); ext.cc calls them in this order.
// clang-format off
#define CAIRN_EXT_AREAS(X) \
  X(Storage) X(Manifest) X(Checkpoint) X(Staging) X(Cache) X(Tier) X(Tiers) X(Stock) \
  X(Replication) X(Values) X(Floors) X(Data)
// clang-format on
#define CAIRN_DECLARE_REGISTER(area) void Register##area(nanobind::module_& m);
CAIRN_EXT_AREAS(CAIRN_DECLARE_REGISTER)
#undef CAIRN_DECLARE_REGISTER

}  // namespace cairn::python
