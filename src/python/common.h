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

// A Storage held by Python (_ext.Storage): opened once from a URI by
// _ext.open_storage where a user's path enters the package, made by a wrapper
// (FaultInjector.wrap), or a tier TierSet keeps. Every engine binding takes
// one (and a directory below its root), never a URI. Shared: a wrapper, a
// reader or a tier set keeps what it uses alive.
struct PyStorage {
  std::shared_ptr<Storage> s;
  // The URI it was opened from (a wrapper: its base's; a tier: its
  // Describe()), for messages.
  std::string uri;
};

// A CheckpointReader together with the Storage it reads from
// (_ext.CheckpointReader): opened on a Storage, or handed over by the engine
// (the memory-tier readers TierSet opened while listing candidates).
class PyCheckpointReader {
 public:
  // Opens the committed checkpoint in `dir` of `storage`: manifest
  // validated, data file sizes checked (raises on failure). Messages name it
  // by the storage's URI and `dir`.
  PyCheckpointReader(const PyStorage& storage, const std::string& dir);
  PyCheckpointReader(std::string uri, std::shared_ptr<Storage> storage,
                     std::unique_ptr<CheckpointReader> reader);

  const Manifest& manifest() const { return reader_->manifest(); }
  const std::string& uri() const { return uri_; }
  CheckpointReader& engine() { return *reader_; }
  Storage& storage() { return *storage_; }

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
  std::shared_ptr<Storage> storage_;
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

// The URI of `dir` below a storage's root, for messages.
std::string StorageUri(const PyStorage& storage, const std::string& dir);

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
