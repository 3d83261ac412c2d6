// The cairn._ext module. Status codes become Python exceptions here, in one
// place: the classes are defined in cairn/errors.py and looked up by name.
#include <nanobind/stl/string.h>

#include "common.h"

namespace nb = nanobind;

namespace cairn::python {

void RaiseStatus(const Status& s) {
  nb::gil_scoped_acquire gil;
  nb::object errors = nb::module_::import_("cairn.errors");
  nb::object cls = errors.attr("exception_for_code")(std::string(StatusCodeName(s.code())));
  nb::object exc = cls(s.message());
  exc.attr("code") = std::string(StatusCodeName(s.code()));
  if (s.sys_errno() != 0) exc.attr("sys_errno") = s.sys_errno();
  PyErr_SetObject(cls.ptr(), exc.ptr());
  throw nb::python_error();
}

}  // namespace cairn::python

NB_MODULE(_ext, m) {
  m.doc() = "cairn's C++ engine (internal; use the cairn package)";
#define CAIRN_CALL_REGISTER(area) cairn::python::Register##area(m);
  CAIRN_EXT_AREAS(CAIRN_CALL_REGISTER)
#undef CAIRN_CALL_REGISTER
}
