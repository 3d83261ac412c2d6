// Bindings for the manifest types (include/cairn/manifest.h).
//
// The engine owns the manifest schema and its encoding: Python builds and
// reads these typed objects (the DCP layer converts its Metadata to and from
// them, cairn/_dcp_metadata.py) and never sees the JSON. Fields are copied in
// and out by value (a list read from `Manifest.tensors` is a copy: assign the
// whole list back to change it). A Manifest pickles as its JSON encoding, so
// ranks can agree on one with torch.distributed object collectives.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "cairn/manifest.h"
#include "common.h"
#include "struct_fields.h"
#include "without_gil.h"

namespace nb = nanobind;

namespace cairn::python {

void RegisterManifest(nb::module_& m) {
  BindStruct(m, "ManifestFile", F("key", &ManifestFile::key), F("size", &ManifestFile::size));
  BindStruct(m, "ItemLocation", F("file", &ItemLocation::file), F("offset", &ItemLocation::offset),
             F("length", &ItemLocation::length), F("checksums", &ItemLocation::checksums));
  BindStruct(m, "TensorChunk", F("offsets", &TensorChunk::offsets), F("sizes", &TensorChunk::sizes),
             F("location", &TensorChunk::location));
  BindStruct(
      m, "ManifestTensor", F("fqn", &ManifestTensor::fqn), F("dtype", &ManifestTensor::dtype),
      F("shape", &ManifestTensor::shape), F("requires_grad", &ManifestTensor::requires_grad),
      F("layout", &ManifestTensor::layout), F("memory_format", &ManifestTensor::memory_format),
      F("pin_memory", &ManifestTensor::pin_memory), F("chunks", &ManifestTensor::chunks));
  BindStruct(m, "ManifestBytes", F("fqn", &ManifestBytes::fqn),
             F("location", &ManifestBytes::location));

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
      "place_written_items",
      [](Manifest& manifest,
         const std::vector<
             std::tuple<std::string, std::optional<std::vector<uint64_t>>, std::string, uint64_t,
                        uint64_t, uint64_t, std::vector<uint64_t>>>& written) {
        std::vector<WrittenItem> items;
        items.reserve(written.size());
        for (const auto& [fqn, offsets, file, file_size, offset, length, sums] : written) {
          items.push_back({fqn, offsets.has_value(), offsets.value_or(std::vector<uint64_t>{}),
                           file, file_size, ItemLocation{0, offset, length, sums}});
        }
        ThrowIfError(PlaceWrittenItems(&manifest, items));
      },
      nb::arg("manifest"), nb::arg("written"),
      "Sets the manifest's files and item locations from (fqn, chunk offsets or None, file,\n"
      "file_size, offset, length, checksums) write results (include/cairn/manifest.h).");

  m.def(
      "decode_manifest",
      [](nb::bytes data) {
        std::string_view bytes(data.c_str(), data.size());
        return WithoutGil([&] { return DecodeManifest(bytes); });
      },
      nb::arg("data"),
      "Decodes and validates complete manifest file bytes (no I/O). Raises\n"
      "CorruptionError for a damaged or invalid manifest.");
}

}  // namespace cairn::python
