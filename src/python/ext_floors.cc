// Bindings for the machine floors (include/cairn/floors.h), used by
// cairn._measure (bench/checkpoint.py, `cairn bench`): every floor runs with
// the GIL released, so nothing in Python can stretch what is timed.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include "cairn/floors.h"
#include "common.h"
#include "without_gil.h"

namespace nb = nanobind;

namespace cairn::python {

void RegisterFloors(nb::module_& m) {
  m.attr("FLOOR_BLOCK_BYTES") = kFloorBlockBytes;
  m.attr("FLOOR_READ_STREAMS") = kFloorReadStreams;
  m.def(
      "memcpy_floor",
      [](uint64_t nbytes) {
        FloorSample s = WithoutGil([&] { return MeasureMemcpyFloor(nbytes); });
        return std::make_pair(s.seconds, s.bytes);
      },
      nb::arg("nbytes"),
      "Seconds of one single-threaded memcpy of nbytes between pre-faulted buffers: "
      "(seconds, bytes).");
  m.def(
      "direct_io_floors",
      [](const std::string& dir, uint64_t nbytes, bool drop_caches, size_t streams) {
        DirectIoFloorOptions o;
        o.drop_caches = drop_caches;
        o.read_streams = streams;
        DirectIoFloors f = WithoutGil([&] { return MeasureDirectIoFloors(dir, nbytes, o); });
        nb::dict d;
        d["write_s"] = f.write.seconds;
        d["read_s"] = f.read.seconds;
        d["bytes"] = f.write.bytes;
        d["cold"] = f.cold;
        return d;
      },
      nb::arg("dir"), nb::arg("nbytes"), nb::arg("drop_caches") = true,
      nb::arg("streams") = kFloorReadStreams,
      "O_DIRECT write floor and parallel O_DIRECT read floor of a file of nbytes (rounded up "
      "to 16 MiB) in dir, removed afterwards: {write_s, read_s, bytes, cold}.");
  m.def(
      "drop_caches", [] { return WithoutGil([] { return Result<bool>(DropPageCache()); }); },
      "sync, then drops the page cache; False when not permitted.");
  m.def("trim_heap", &TrimHeap, "Returns freed heap pages to the system (glibc malloc_trim).");
}

}  // namespace cairn::python
