#include "common.h"

namespace cairn::python {

void RegisterCheckpoint(nanobind::module_& m) {}

}  // namespace cairn::python
