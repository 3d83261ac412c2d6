// Shared helpers for the binding code: Status -> Python exception mapping.
// The binding layer only converts arguments and releases the GIL around
// blocking calls; the exception classes themselves live in cairn/errors.py,
// which keeps retryable codes (Unavailable, DeadlineExceeded) apart as
// cairn.TransientError subclasses.
#pragma once

#include <nanobind/nanobind.h>

#include <memory>
#include <string>

#include "cairn/checkpoint.h"
#include "cairn/status.h"
#include "cairn/storage.h"

namespace cairn::python {

// A Storage owned by Python (_ext.Storage, from _ext.open_storage).
struct PyStorage {
  std::unique_ptr<Storage> s;
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

// Each area of the extension registers its functions from its own file.
void RegisterStorage(nanobind::module_& m);
void RegisterManifest(nanobind::module_& m);
void RegisterCheckpoint(nanobind::module_& m);
void RegisterStaging(nanobind::module_& m);
void RegisterCache(nanobind::module_& m);
void RegisterTier(nanobind::module_& m);
void RegisterStock(nanobind::module_& m);
void RegisterReplication(nanobind::module_& m);
void RegisterValues(nanobind::module_& m);
void RegisterFloors(nanobind::module_& m);
void RegisterData(nanobind::module_& m);

}  // namespace cairn::python
