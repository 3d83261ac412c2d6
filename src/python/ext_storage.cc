// Bindings for the storage layer: a Storage opened once from a URI (the
// object every engine binding takes, with whole-file helpers for the package
// and tests) and the fault injector that wraps one, so that tests can make the
// saves and loads that use the wrapped storage fail.
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

// A FaultInjector shared by the Python object and every storage it wrapped.
struct PyFaultInjector {
  std::shared_ptr<FaultInjector> inj = std::make_shared<FaultInjector>();
};

FaultOp OpOrThrow(const std::string& op) { return ValueOrThrow(ParseFaultOp(op)); }

}  // namespace

void RegisterStorage(nb::module_& m) {
  m.def(
      "validate_key", [](const std::string& key) { ThrowIfError(ValidateKey(key)); },
      "Raises ValueError if `key` is not a safe relative storage key.");
  m.def(
      "join_key", [](const std::string& a, const std::string& b) { return JoinKey(a, b); },
      nb::arg("a"), nb::arg("b"), "Two storage keys joined with '/', skipping empty parts.");
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
      "Returns `uri` if it can name a checkpoint (a path, file://, shm:// or s3://);\n"
      "InvalidArgumentError otherwise.");

  nb::class_<PyStorage>(m, "Storage",
                        "A storage backend opened with open_storage(uri). Keys are relative, "
                        "'/'-separated and never leave the root.")
      .def("describe", [](PyStorage& self) { return self.s->Describe(); })
      .def_prop_ro(
          "uri", [](PyStorage& self) { return self.uri; },
          "The URI it was opened from (a wrapper's: its Describe()).")
      .def("__repr__", [](PyStorage& self) { return "<cairn Storage " + self.uri + ">"; })
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
        std::unique_ptr<Storage> st = WithoutGil([&] { return OpenStorage(uri, create); });
        return new PyStorage{std::move(st), uri};
      },
      nb::arg("uri"), nb::arg("create") = true, nb::rv_policy::take_ownership,
      "Opens a path, file://PATH, shm://NAME, s3://BUCKET/PREFIX, mem:// or slow://PATH?...\n"
      "(the one scheme registry, include/cairn/storage.h).");

  nb::class_<PyFaultInjector>(
      m, "FaultInjector",
      "Injects storage faults into the storages it wraps: wrap(storage) returns a Storage that "
      "forwards to `storage` through this injector's rules, latencies and counters. Rules: "
      "add_rule(op, errno=EIO, nth=1, count=1, key='', partial_bytes=-1, crash=False); op is "
      "one of create, open, write, allocate, sync, close, read, rename, syncdir, createdir, "
      "delete, deletedir, list, exists, filesize.")
      .def(nb::init<>())
      .def(
          "wrap",
          [](PyFaultInjector& self, PyStorage& base) {
            auto st = std::make_shared<FaultInjectionStorage>(base.s, self.inj);
            return new PyStorage{std::move(st), base.uri};
          },
          nb::arg("storage"), nb::rv_policy::take_ownership,
          "A Storage over `storage` seen through this injector (it keeps both alive).")
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
      .def("reset_counters", [](PyFaultInjector& self) { self.inj->ResetCounters(); });
}

}  // namespace cairn::python
