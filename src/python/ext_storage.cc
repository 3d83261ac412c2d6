// Bindings for the storage layer: a Storage opened from a URI (whole-file
// helpers for the Python package and tests) and the fault injector that tests
// use to make saves fail through "fault://NAME/..." URIs.
//
// Every call that touches storage releases the GIL.
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cairn/fault_injection.h"
#include "cairn/storage.h"
#include "common.h"
#include "without_gil.h"

namespace nb = nanobind;

namespace cairn::python {
namespace {

// A FaultInjector, optionally registered under a name for fault:// URIs.
struct PyFaultInjector {
  std::shared_ptr<FaultInjector> inj = std::make_shared<FaultInjector>();
  std::string name;  // empty when not registered

  ~PyFaultInjector() { Unregister(); }
  void Unregister() {
    if (!name.empty()) UnregisterFaultInjector(name, inj.get());
    name.clear();
  }
};

FaultOp OpOrThrow(const std::string& op) { return ValueOrThrow(ParseFaultOp(op)); }

}  // namespace

void RegisterStorage(nb::module_& m) {
  m.def(
      "validate_key", [](const std::string& key) { ThrowIfError(ValidateKey(key)); },
      "Raises ValueError if `key` is not a safe relative storage key.");
  m.def(
      "shm_directory", [](const std::string& name) { return ShmDirectory(name); }, nb::arg("name"),
      "The local directory behind shm://NAME (/dev/shm/NAME).");
  m.def(
      "local_dir_of_uri", [](const std::string& uri) { return LocalDirOfUri(uri); }, nb::arg("uri"),
      "The local directory the storage at `uri` is (or would be) rooted at, without I/O; "
      "'' when it has none (s3, mem, fault, slow).");

  m.def(
      "check_checkpoint_uri",
      [](const std::string& uri) {
        ThrowIfError(CheckCheckpointUri(uri));
        return uri;
      },
      nb::arg("uri"),
      "Returns `uri` if it can name a checkpoint (a path, file://, shm://, s3://, fault://);\n"
      "InvalidArgumentError otherwise.");

  nb::class_<PyStorage>(m, "Storage",
                        "A storage backend opened with open_storage(uri). Keys are relative, "
                        "'/'-separated and never leave the root.")
      .def("describe", [](PyStorage& self) { return self.s->Describe(); })
      .def("local_path", [](PyStorage& self) { return self.s->LocalPath(); })
      .def(
          "write_file",
          [](PyStorage& self, const std::string& key, nb::bytes data, bool sync) {
            std::string buf(data.c_str(), data.size());
            WithoutGil([&]() -> Status {
              CAIRN_ASSIGN_OR_RETURN(auto f, self.s->NewWritableFile(key));
              CAIRN_RETURN_IF_ERROR(f->WriteAt(0, buf.data(), buf.size()));
              if (sync) CAIRN_RETURN_IF_ERROR(f->Sync());
              return f->Close();
            });
          },
          nb::arg("key"), nb::arg("data"), nb::arg("sync") = true,
          "Creates (or replaces) `key` with `data`, fsyncs it unless sync=False.")
      .def(
          "read_file",
          [](PyStorage& self, const std::string& key) {
            std::string buf = WithoutGil([&] { return ReadWholeFile(*self.s, key); });
            return nb::bytes(buf.data(), buf.size());
          },
          nb::arg("key"))
      .def(
          "list",
          [](PyStorage& self, const std::string& dir) {
            std::vector<DirEntry> entries = WithoutGil([&] { return self.s->List(dir); });
            std::vector<std::tuple<std::string, bool, uint64_t>> out;
            for (auto& e : entries) out.emplace_back(e.name, e.is_dir, e.size);
            return out;
          },
          nb::arg("dir") = "", "Sorted (name, is_dir, size) entries directly inside `dir`.")
      .def(
          "exists",
          [](PyStorage& self, const std::string& key) {
            return WithoutGil([&] { return self.s->Exists(key); });
          },
          nb::arg("key"))
      .def(
          "file_size",
          [](PyStorage& self, const std::string& key) {
            return WithoutGil([&] { return self.s->FileSize(key); });
          },
          nb::arg("key"))
      .def(
          "rename",
          [](PyStorage& self, const std::string& from, const std::string& to) {
            ThrowIfError(self.s->Rename(from, to));
          },
          nb::arg("src"), nb::arg("dst"), nb::call_guard<nb::gil_scoped_release>())
      .def(
          "sync_dir",
          [](PyStorage& self, const std::string& dir) { ThrowIfError(self.s->SyncDir(dir)); },
          nb::arg("dir") = "", nb::call_guard<nb::gil_scoped_release>())
      .def(
          "create_dir",
          [](PyStorage& self, const std::string& dir) { ThrowIfError(self.s->CreateDir(dir)); },
          nb::arg("dir"), nb::call_guard<nb::gil_scoped_release>())
      .def(
          "delete_file",
          [](PyStorage& self, const std::string& key) { ThrowIfError(self.s->DeleteFile(key)); },
          nb::arg("key"), nb::call_guard<nb::gil_scoped_release>())
      .def(
          "delete_dir",
          [](PyStorage& self, const std::string& dir) { ThrowIfError(self.s->DeleteDir(dir)); },
          nb::arg("dir"), nb::call_guard<nb::gil_scoped_release>());

  m.def(
      "open_storage",
      [](const std::string& uri, bool create) {
        return new PyStorage{WithoutGil([&] { return OpenStorage(uri, create); })};
      },
      nb::arg("uri"), nb::arg("create") = true, nb::rv_policy::take_ownership,
      "Opens a path, file://PATH, shm://NAME, mem:// or fault://NAME/SUB.");

  nb::class_<PyFaultInjector>(
      m, "FaultInjector",
      "Injects storage faults. FaultInjector(name, base) registers fault://name/... as `base` "
      "(a path, file:// or shm:// URI) seen through this injector, in this process, until "
      "close(). Rules: add_rule(op, errno=EIO, nth=1, count=1, key='', partial_bytes=-1, "
      "crash=False); op is one of create, open, write, allocate, sync, close, read, rename, "
      "syncdir, createdir, delete, deletedir, list, exists, filesize.")
      .def(
          "__init__",
          [](PyFaultInjector* self, const std::string& name, const std::string& base) {
            new (self) PyFaultInjector();
            ThrowIfError(RegisterFaultInjector(name, base, self->inj));
            self->name = name;
          },
          nb::arg("name"), nb::arg("base"))
      .def_prop_ro("uri", [](PyFaultInjector& self) { return "fault://" + self.name; })
      .def(
          "add_rule",
          [](PyFaultInjector& self, const std::string& op, int err, uint64_t nth, uint64_t count,
             const std::string& key, int64_t partial_bytes, bool crash) {
            return self.inj->AddRule({.op = OpOrThrow(op),
                                      .key_contains = key,
                                      .nth = nth,
                                      .count = count,
                                      .error = err,
                                      .partial_bytes = partial_bytes,
                                      .crash = crash});
          },
          nb::arg("op"), nb::arg("errno") = EIO, nb::arg("nth") = 1, nb::arg("count") = 1,
          nb::arg("key") = "", nb::arg("partial_bytes") = -1, nb::arg("crash") = false,
          "Fails calls nth .. nth+count-1 of `op` (count=0: every call from the nth on) whose key "
          "contains `key`, with `errno`; a failing write first writes `partial_bytes`; crash=True "
          "SIGKILLs the process instead. Returns the rule id.")
      .def("remove_rule", [](PyFaultInjector& self, int id) { return self.inj->RemoveRule(id); })
      .def("clear", [](PyFaultInjector& self) { self.inj->ClearRules(); })
      .def(
          "set_latency",
          [](PyFaultInjector& self, const std::string& op, double seconds) {
            self.inj->SetLatency(OpOrThrow(op),
                                 std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6)));
          },
          nb::arg("op"), nb::arg("seconds"))
      .def(
          "set_bandwidth", [](PyFaultInjector& self, uint64_t bps) { self.inj->SetBandwidth(bps); },
          nb::arg("bytes_per_second"), "Caps reads+writes to this many bytes/s (0 = no cap).")
      .def("calls", [](PyFaultInjector& self,
                       const std::string& op) { return self.inj->Calls(OpOrThrow(op)); })
      .def_prop_ro("injected", [](PyFaultInjector& self) { return self.inj->Injected(); })
      .def("reset_counters", [](PyFaultInjector& self) { self.inj->ResetCounters(); })
      .def("close", [](PyFaultInjector& self) { self.Unregister(); })
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); })
      .def("__exit__", [](PyFaultInjector& self, nb::args) { self.Unregister(); });
}

}  // namespace cairn::python
