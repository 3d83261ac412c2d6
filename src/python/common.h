// Shared helpers for the binding code: Status -> Python exception mapping.
// The binding layer only converts arguments and releases the GIL around
// blocking calls; the exception classes themselves live in cairn/errors.py,
// which keeps retryable codes (Unavailable, DeadlineExceeded) apart as
// cairn.TransientError subclasses.
#pragma once

#include <nanobind/nanobind.h>

#include "cairn/status.h"

namespace cairn::python {

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

// Each area of the extension registers its functions from its own file.
void RegisterStorage(nanobind::module_& m);
void RegisterCheckpoint(nanobind::module_& m);
void RegisterStaging(nanobind::module_& m);
void RegisterCache(nanobind::module_& m);

}  // namespace cairn::python
