// Bindings for the storage layer: small helpers the Python package and the
// tests use (key validation, whole-file reads and writes through a backend).
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "cairn/storage.h"
#include "common.h"

namespace nb = nanobind;

namespace cairn::python {

void RegisterStorage(nb::module_& m) {
  m.def(
      "validate_key", [](const std::string& key) { ThrowIfError(ValidateKey(key)); },
      "Raises ValueError if `key` is not a safe relative storage key.");
}

}  // namespace cairn::python
