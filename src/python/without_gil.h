// WithoutGil: the one shape of a blocking engine call made from a binding;
// ReadWholeFile: the whole-file read the storage and source bindings share.
#pragma once

#include <nanobind/nanobind.h>

#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "cairn/status.h"
#include "cairn/storage.h"
#include "common.h"

namespace cairn::python {

// Runs fn() with the GIL released, then, with the GIL held again, hands its
// outcome to Python: a Status raises unless it is OK; a Result<T> raises or
// returns the T. fn must not touch Python objects.
template <typename Fn>
auto WithoutGil(Fn&& fn) {
  using R = std::invoke_result_t<Fn&>;
  if constexpr (std::is_same_v<R, Status>) {
    Status s;
    {
      nanobind::gil_scoped_release nogil;
      s = fn();
    }
    ThrowIfError(s);
  } else {
    std::optional<R> r;
    {
      nanobind::gil_scoped_release nogil;
      r.emplace(fn());
    }
    return ValueOrThrow(std::move(*r));
  }
}

// Reads all of `key` from `storage`. Blocks: call it inside WithoutGil.
inline Result<std::string> ReadWholeFile(Storage& storage, const std::string& key) {
  CAIRN_ASSIGN_OR_RETURN(auto f, storage.NewReadableFile(key));
  std::string buf(f->Size(), '\0');
  CAIRN_RETURN_IF_ERROR(f->ReadAt(0, buf.data(), buf.size()));
  return buf;
}

}  // namespace cairn::python
