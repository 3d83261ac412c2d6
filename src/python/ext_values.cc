// Bindings for the native value encoding (include/cairn/value_codec.h):
// Python objects to and from StoredValue. This file holds the only Python
// knowledge of the codec: which types are native (exact None, bool, int,
// float, str, bytes, list, tuple, dict; NumPy arrays and scalars without
// object or structured dtypes) and how a dtype name becomes a NumPy dtype.
// Nothing here unpickles.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cairn/manifest.h"
#include "cairn/value_codec.h"
#include "common.h"

namespace nb = nanobind;

namespace cairn::python {
namespace {

using Kind = StoredValue::Kind;

// NumPy, imported on first use and kept for the life of the process (never
// released: a module-level reference must not outlive the interpreter).
struct Numpy {
  nb::handle module;
  nb::handle ndarray;       // the exact array type
  nb::handle scalar_types;  // set(np.sctypeDict.values()): the exact scalar types
};

const Numpy& GetNumpy() {
  static const Numpy np = [] {
    nb::object m = nb::module_::import_("numpy");
    nb::object types = nb::steal(PySet_New(m.attr("sctypeDict").attr("values")().ptr()));
    if (!types.is_valid()) throw nb::python_error();
    nb::object ndarray = m.attr("ndarray");
    return Numpy{m.release(), ndarray.release(), types.release()};
  }();
  return np;
}

bool IsNativeArray(PyObject* o) {
  const Numpy& np = GetNumpy();
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(o));
  if (type == np.ndarray.ptr()) return true;
  int in = PySet_Contains(np.scalar_types.ptr(), type);
  if (in < 0) throw nb::python_error();
  return in == 1;
}

// An object or structured dtype has no raw-bytes form.
bool PlainDtype(nb::handle dtype) {
  return !nb::cast<bool>(dtype.attr("hasobject")) && dtype.attr("fields").is_none();
}

// Whether a Python error is one a value that cannot be encoded raises (the
// encoding then falls back to pickle bytes); others propagate.
bool EncodingError(const nb::python_error& e) {
  return e.matches(PyExc_ValueError) || e.matches(PyExc_TypeError) ||
         e.matches(PyExc_RecursionError);
}

// How ToStored takes Python objects.
struct Mode {
  // Planner data (DCP's planner_data): subclasses of int, float, list, tuple
  // and dict count as those (as json.dumps takes them); no bytes, no NumPy.
  // Else a value: exact types only (a subclass may not survive the trip).
  bool planner = false;
  // The type name of the first object refused.
  std::string refused;
};

// Fills *v from `o`; false when `o` holds something that is not native.
bool ToStored(PyObject* o, size_t depth, Mode& mode, StoredValue* v) {
  if (depth > kMaxValueDepth) {
    mode.refused = "a value nested deeper than " + std::to_string(kMaxValueDepth);
    return false;
  }
  if (o == Py_None) return true;
  if (PyBool_Check(o)) {
    v->kind = Kind::kBool;
    v->boolean = o == Py_True;
    return true;
  }
  if (PyUnicode_Check(o)) {  // str subclasses too (np.str_), stored as str
    Py_ssize_t n = 0;
    const char* s = PyUnicode_AsUTF8AndSize(o, &n);
    if (s == nullptr) {  // lone surrogates: not UTF-8
      PyErr_Clear();
      return false;
    }
    v->kind = Kind::kString;
    v->text.assign(s, static_cast<size_t>(n));
    return true;
  }
  if (mode.planner ? PyLong_Check(o) : PyLong_CheckExact(o)) {
    v->kind = Kind::kInt;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (!overflow) {
      v->text = std::to_string(x);
      return true;
    }
    PyObject* s = PyLong_Type.tp_repr(o);  // beyond int_max_str_digits: ValueError
    if (s == nullptr) {
      PyErr_Clear();
      return false;
    }
    v->text = PyUnicode_AsUTF8(s);
    Py_DECREF(s);
    return true;
  }
  if (mode.planner ? PyFloat_Check(o) : PyFloat_CheckExact(o)) {
    v->kind = Kind::kFloat;
    v->number = PyFloat_AS_DOUBLE(o);
    return true;
  }
  if (mode.planner) {
    bool list = PyList_Check(o), tuple = PyTuple_Check(o), dict = PyDict_Check(o);
    if (!list && !tuple && !dict) {
      mode.refused = Py_TYPE(o)->tp_name;
      return false;
    }
  } else if (PyBytes_CheckExact(o)) {
    v->kind = Kind::kBytes;
    v->text.assign(PyBytes_AS_STRING(o), static_cast<size_t>(PyBytes_GET_SIZE(o)));
    return true;
  }
  bool list = mode.planner ? PyList_Check(o) : PyList_CheckExact(o);
  if (list || (mode.planner ? PyTuple_Check(o) : PyTuple_CheckExact(o))) {
    v->kind = list ? Kind::kList : Kind::kTuple;
    Py_ssize_t n = list ? PyList_GET_SIZE(o) : PyTuple_GET_SIZE(o);
    v->items.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* x = list ? PyList_GET_ITEM(o, i) : PyTuple_GET_ITEM(o, i);
      if (!ToStored(x, depth + 1, mode, &v->items[static_cast<size_t>(i)])) return false;
    }
    return true;
  }
  if (mode.planner ? PyDict_Check(o) : PyDict_CheckExact(o)) {
    v->kind = Kind::kDict;
    v->items.resize(2 * static_cast<size_t>(PyDict_GET_SIZE(o)));
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    for (size_t i = 0; PyDict_Next(o, &pos, &key, &value); i += 2) {
      if (!ToStored(key, depth + 1, mode, &v->items[i]) ||
          !ToStored(value, depth + 1, mode, &v->items[i + 1])) {
        return false;
      }
    }
    return true;
  }
  if (!IsNativeArray(o)) {
    mode.refused = Py_TYPE(o)->tp_name;
    return false;
  }
  try {
    const Numpy& np = GetNumpy();
    nb::object a = np.module.attr("asarray")(nb::handle(o));
    nb::object dtype = a.attr("dtype");
    if (!PlainDtype(dtype)) return false;
    v->kind = nb::isinstance(nb::handle(o), np.ndarray) ? Kind::kArray : Kind::kScalar;
    v->dtype = nb::cast<std::string>(dtype.attr("str"));
    for (nb::handle d : a.attr("shape")) v->shape.push_back(nb::cast<uint64_t>(d));
    auto raw = nb::borrow<nb::bytes>(np.module.attr("ascontiguousarray")(a).attr("tobytes")());
    v->text.assign(raw.c_str(), raw.size());
    return true;
  } catch (nb::python_error& e) {
    if (EncodingError(e)) return false;
    throw;
  }
}

// The NumPy array or scalar of a decoded kArray/kScalar; DataLoss when its
// dtype is unknown or not plain, or its data does not hold its shape.
Result<nb::object> ArrayToPython(const StoredValue& v) {
  const Numpy& np = GetNumpy();
  nb::object dtype;
  try {
    dtype = np.module.attr("dtype")(v.dtype);
  } catch (nb::python_error& e) {
    return DataLossError("malformed stored array (dtype '" + v.dtype + "': " + e.what() + ")");
  }
  if (!PlainDtype(dtype)) return DataLossError("malformed stored array (dtype " + v.dtype + ")");
  uint64_t n = nb::cast<uint64_t>(dtype.attr("itemsize"));
  for (uint64_t d : v.shape) {
    if (__builtin_mul_overflow(n, d, &n)) return DataLossError("malformed stored array (shape)");
  }
  if (n != v.text.size()) return DataLossError("malformed stored array (data does not fit shape)");
  nb::list shape;
  for (uint64_t d : v.shape) shape.append(d);
  try {
    nb::object a = np.module.attr("frombuffer")(nb::bytes(v.text.data(), v.text.size()), dtype)
                       .attr("reshape")(nb::tuple(shape))
                       .attr("copy")();
    if (v.kind == Kind::kArray) return a;
    return a.attr("__getitem__")(nb::tuple());
  } catch (nb::python_error& e) {
    return DataLossError(std::string("malformed stored array (") + e.what() + ")");
  }
}

Result<nb::object> ToPython(const StoredValue& v) {
  switch (v.kind) {
    case Kind::kNone:
      return nb::none();
    case Kind::kBool:
      return nb::bool_(v.boolean);
    case Kind::kInt: {
      PyObject* i = PyLong_FromString(v.text.c_str(), nullptr, 10);
      if (i == nullptr) {  // more digits than sys.get_int_max_str_digits()
        nb::python_error e;
        return DataLossError(std::string("malformed stored value (") + e.what() + ")");
      }
      return nb::steal(i);
    }
    case Kind::kFloat:
      return nb::float_(v.number);
    case Kind::kString:
      return nb::str(v.text.data(), v.text.size());
    case Kind::kBytes:
      return nb::bytes(v.text.data(), v.text.size());
    case Kind::kList:
    case Kind::kTuple: {
      nb::list items;
      for (const StoredValue& x : v.items) {
        CAIRN_ASSIGN_OR_RETURN(nb::object o, ToPython(x));
        items.append(o);
      }
      if (v.kind == Kind::kList) return items;
      return nb::tuple(items);
    }
    case Kind::kDict: {
      nb::dict d;
      for (size_t i = 0; i + 1 < v.items.size(); i += 2) {
        CAIRN_ASSIGN_OR_RETURN(nb::object key, ToPython(v.items[i]));
        CAIRN_ASSIGN_OR_RETURN(nb::object value, ToPython(v.items[i + 1]));
        if (PyDict_SetItem(d.ptr(), key.ptr(), value.ptr()) != 0) {  // e.g. an array key
          nb::python_error e;
          return DataLossError("unhashable key in a stored dict");
        }
      }
      return d;
    }
    case Kind::kArray:
    case Kind::kScalar:
      return ArrayToPython(v);
  }
  return DataLossError("malformed stored value");
}

// The JSON of DCP planner data; InvalidArgumentError naming what it cannot hold.
std::string PlannerDataJson(nb::handle value) {
  StoredValue v;
  Mode mode{.planner = true};
  Result<std::string> json = InvalidArgumentError("");
  if (ToStored(value.ptr(), 0, mode, &v)) json = EncodePlannerData(v);
  if (!json.ok()) {
    RaiseStatus(InvalidArgumentError(
        "cannot store planner data " +
        (mode.refused.empty() ? json.status().message() : "of type " + mode.refused) +
        " in a cairn manifest (only dicts, lists, tuples and scalars: cairn never pickles)"));
  }
  return *json;
}

nb::object PlannerDataOf(const std::string& json) {
  Result<StoredValue> v = DecodePlannerData(json);
  if (!v.ok()) RaiseStatus(DataLossError("manifest: " + v.status().message()));
  Result<nb::object> o = ToPython(*v);
  if (!o.ok()) RaiseStatus(DataLossError("manifest planner data: " + o.status().message()));
  return std::move(o).value();
}

// DCP's StorageMeta as it crosses: (checkpoint_id, save_id, modules).
using StorageMetaTuple =
    std::tuple<std::optional<std::string>, std::optional<std::string>, std::vector<std::string>>;

}  // namespace

void RegisterValues(nb::module_& m) {
  m.attr("VALUE_MAGIC") = nb::bytes(kValueMagic.data(), kValueMagic.size());
  m.attr("MAX_VALUE_DEPTH") = kMaxValueDepth;
  m.def(
      "encode_value",
      [](nb::handle value) -> nb::object {
        StoredValue v;
        Mode mode;
        if (!ToStored(value.ptr(), 0, mode, &v)) return nb::none();
        Result<std::string> data = EncodeValue(v);
        if (!data.ok()) return nb::none();  // too deep, or not encodable
        return nb::bytes(data->data(), data->size());
      },
      nb::arg("value"),
      "The native encoding of a non-tensor value (VALUE_MAGIC + tagged JSON), or None when\n"
      "it holds a type the encoding does not cover (it is then stored as pickle bytes).");
  m.def(
      "decode_value",
      [](nb::bytes data, const std::string& where) -> nb::object {
        Result<StoredValue> v = DecodeValue(std::string_view(data.c_str(), data.size()));
        if (!v.ok()) RaiseStatus(DataLossError(where + ": " + v.status().message()));
        Result<nb::object> o = ToPython(*v);
        if (!o.ok()) RaiseStatus(DataLossError(where + ": " + o.status().message()));
        return std::move(o).value();
      },
      nb::arg("data"), nb::arg("where"),
      "The value encode_value stored in `data` (never unpickles); CorruptionError naming\n"
      "`where` when the bytes are not such a value.");
  m.def("encode_planner_data", &PlannerDataJson, nb::arg("value"),
        "The JSON of DCP planner data (dicts and tuples tagged; include/cairn/value_codec.h);\n"
        "InvalidArgumentError for any other type.");
  m.def("decode_planner_data", &PlannerDataOf, nb::arg("json"),
        "The planner data encode_planner_data encoded; CorruptionError otherwise.");

  // A manifest's extra.dcp section (DcpSection): DCP's Metadata fields.
  m.def(
      "dcp_extra_json",
      [](std::optional<std::string> version, nb::handle planner_data,
         std::optional<StorageMetaTuple> storage_meta, const std::string& extra) {
        DcpSection dcp;
        dcp.version = std::move(version);
        Mode mode{.planner = true};
        if (!ToStored(planner_data.ptr(), 0, mode, &dcp.planner_data)) {
          PlannerDataJson(planner_data);  // raises, naming what it cannot hold
        }
        if (storage_meta) {
          auto& [id, save_id, modules] = *storage_meta;
          dcp.storage_meta = DcpSection::StorageMeta{id, save_id, modules};
        }
        Result<std::string> json = ExtraWithDcpSection(extra, dcp);
        if (!json.ok()) PlannerDataJson(planner_data);  // raises when the planner data is why
        return ValueOrThrow(std::move(json));
      },
      nb::arg("version"), nb::arg("planner_data"), nb::arg("storage_meta"), nb::arg("extra"),
      "The manifest's extra JSON: the object `extra` with the DCP section of a save\n"
      "(version, planner data, storage_meta as (checkpoint_id, save_id, modules) or None).");
  m.def(
      "dcp_section",
      [](const Manifest& manifest) {
        Result<DcpSection> r = ReadDcpSection(manifest.extra);
        if (!r.ok()) RaiseStatus(DataLossError("manifest: " + r.status().message()));
        Result<nb::object> planner = ToPython(r->planner_data);
        if (!planner.ok()) RaiseStatus(DataLossError("manifest: " + planner.status().message()));
        std::optional<StorageMetaTuple> meta;
        if (const auto& sm = r->storage_meta)
          meta = StorageMetaTuple{sm->checkpoint_id, sm->save_id, sm->modules};
        return nb::make_tuple(r->version, *planner, meta);
      },
      nb::arg("manifest"),
      "(version, planner data, (checkpoint_id, save_id, modules) or None) of a validated\n"
      "manifest's extra.dcp section (None where absent).");
}

}  // namespace cairn::python
