// Bindings for the manifest types (include/cairn/manifest.h).
//
// The engine owns the manifest schema and its encoding: Python builds and
// reads these typed objects (the DCP layer converts its Metadata to and from
// them, cairn/_dcp_metadata.py) and never sees the JSON. Fields are copied in
// and out by value (a list read from `Manifest.tensors` is a copy: assign the
// whole list back to change it). A Manifest pickles as its JSON encoding, so
// ranks can agree on one with torch.distributed object collectives.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <new>
#include <string>

#include "cairn/manifest.h"
#include "common.h"

namespace nb = nanobind;

namespace cairn::python {

void RegisterManifest(nb::module_& m) {
  using U64s = std::vector<uint64_t>;
  nb::class_<ManifestFile>(m, "ManifestFile")
      .def(
          "__init__",
          [](ManifestFile* self, std::string key, uint64_t size) {
            new (self) ManifestFile{std::move(key), size};
          },
          nb::arg("key") = "", nb::arg("size") = 0)
      .def_rw("key", &ManifestFile::key)
      .def_rw("size", &ManifestFile::size);

  nb::class_<ItemLocation>(m, "ItemLocation")
      .def(
          "__init__",
          [](ItemLocation* self, uint32_t file, uint64_t offset, uint64_t length, U64s checksums) {
            new (self) ItemLocation{file, offset, length, std::move(checksums)};
          },
          nb::arg("file") = 0, nb::arg("offset") = 0, nb::arg("length") = 0,
          nb::arg("checksums") = U64s{})
      .def_rw("file", &ItemLocation::file)
      .def_rw("offset", &ItemLocation::offset)
      .def_rw("length", &ItemLocation::length)
      .def_rw("checksums", &ItemLocation::checksums);

  nb::class_<TensorChunk>(m, "TensorChunk")
      .def(
          "__init__",
          [](TensorChunk* self, U64s offsets, U64s sizes, ItemLocation location) {
            new (self) TensorChunk{std::move(offsets), std::move(sizes), std::move(location)};
          },
          nb::arg("offsets") = U64s{}, nb::arg("sizes") = U64s{},
          nb::arg("location") = ItemLocation{})
      .def_rw("offsets", &TensorChunk::offsets)
      .def_rw("sizes", &TensorChunk::sizes)
      .def_rw("location", &TensorChunk::location);

  nb::class_<ManifestTensor>(m, "ManifestTensor")
      .def(
          "__init__",
          [](ManifestTensor* self, std::string fqn, std::string dtype, U64s shape,
             bool requires_grad, std::string layout, std::string memory_format, bool pin_memory,
             std::vector<TensorChunk> chunks) {
            new (self) ManifestTensor{std::move(fqn), std::move(dtype),  std::move(shape),
                                      requires_grad,  std::move(layout), std::move(memory_format),
                                      pin_memory,     std::move(chunks)};
          },
          nb::arg("fqn") = "", nb::arg("dtype") = "", nb::arg("shape") = U64s{},
          nb::arg("requires_grad") = false, nb::arg("layout") = "strided",
          nb::arg("memory_format") = "contiguous_format", nb::arg("pin_memory") = false,
          nb::arg("chunks") = std::vector<TensorChunk>{})
      .def_rw("fqn", &ManifestTensor::fqn)
      .def_rw("dtype", &ManifestTensor::dtype)
      .def_rw("shape", &ManifestTensor::shape)
      .def_rw("requires_grad", &ManifestTensor::requires_grad)
      .def_rw("layout", &ManifestTensor::layout)
      .def_rw("memory_format", &ManifestTensor::memory_format)
      .def_rw("pin_memory", &ManifestTensor::pin_memory)
      .def_rw("chunks", &ManifestTensor::chunks);

  nb::class_<ManifestBytes>(m, "ManifestBytes")
      .def(
          "__init__",
          [](ManifestBytes* self, std::string fqn, ItemLocation location) {
            new (self) ManifestBytes{std::move(fqn), std::move(location)};
          },
          nb::arg("fqn") = "", nb::arg("location") = ItemLocation{})
      .def_rw("fqn", &ManifestBytes::fqn)
      .def_rw("location", &ManifestBytes::location);

  nb::class_<Manifest>(m, "Manifest")
      .def(nb::init<>())
      .def_rw("version", &Manifest::version)
      .def_rw("world_size", &Manifest::world_size)
      .def_rw("block_size", &Manifest::block_size)
      .def_rw("created_unix_ms", &Manifest::created_unix_ms)
      .def_rw("files", &Manifest::files)
      .def_rw("tensors", &Manifest::tensors)
      .def_rw("bytes", &Manifest::bytes)
      .def_rw("extra", &Manifest::extra, "A JSON object (serialized) for the layers above.")
      .def_prop_ro("total_bytes", &Manifest::TotalBytes)
      .def(
          "validate", [](const Manifest& self) { ThrowIfError(ValidateManifest(self)); },
          "Raises CorruptionError unless the manifest is valid (as CommitManifest checks).")
      .def(
          "to_json", [](const Manifest& self) { return ValueOrThrow(ManifestToJson(self)); },
          "The manifest body as JSON (docs/format.md).")
      .def_static(
          "from_json", [](const std::string& json) { return ValueOrThrow(ManifestFromJson(json)); },
          nb::arg("json"), "Parses and validates a manifest body.")
      .def("__getstate__", [](const Manifest& self) { return ValueOrThrow(ManifestToJson(self)); })
      .def("__setstate__", [](Manifest& self, const std::string& json) {
        new (&self) Manifest(ValueOrThrow(ManifestFromJson(json)));
      });

  m.def(
      "decode_manifest",
      [](nb::bytes data) {
        std::string_view bytes(data.c_str(), data.size());
        Result<Manifest> r = InternalError("unset");
        {
          nb::gil_scoped_release release;
          r = DecodeManifest(bytes);
        }
        return ValueOrThrow(std::move(r));
      },
      nb::arg("data"),
      "Decodes and validates complete manifest file bytes (no I/O). Raises\n"
      "CorruptionError for a damaged or invalid manifest.");
}

}  // namespace cairn::python
