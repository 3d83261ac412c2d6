#include "common.h"

namespace cairn::python {

void RegisterCache(nanobind::module_& m) {}

}  // namespace cairn::python
