#include "common.h"

namespace cairn::python {

void RegisterStaging(nanobind::module_& m) {}

}  // namespace cairn::python
