// Plain C++ structs seen from Python, each field named once: as a bound class
// (BindStruct) or as a dict (FieldsDict).
#pragma once

#include <nanobind/nanobind.h>

#include <utility>

namespace cairn::python {

// One field of a struct as Python sees it: its name and the member.
template <typename T, typename M>
struct Field {
  const char* name;
  M T::*member;
};

template <typename T, typename M>
Field<T, M> F(const char* name, M T::*member) {
  return {name, member};
}

// Binds the plain struct T as a class whose __init__ takes `fields` as
// keyword arguments (in that order; each defaults to its value in T{}) and
// which has a read-write property per field.
template <typename T, typename... M>
nanobind::class_<T> BindStruct(nanobind::module_& m, const char* name, Field<T, M>... fields) {
  nanobind::class_<T> c(m, name);
  const T defaults{};
  c.def(
      "__init__",
      [fields...](T* self, M... values) {
        new (self) T{};
        ((self->*fields.member = std::move(values)), ...);
      },
      (nanobind::arg(fields.name) = defaults.*fields.member)...);
  (c.def_rw(fields.name, fields.member), ...);
  return c;
}

// A new dict with `fields` of `v` (their types must convert to Python).
template <typename T, typename... M>
nanobind::dict FieldsDict(const T& v, Field<T, M>... fields) {
  nanobind::dict d;
  ((d[fields.name] = v.*fields.member), ...);
  return d;
}

}  // namespace cairn::python
