// Bindings for the stock-checkpoint reader (include/cairn/stock.h).
//
// Destinations cross as raw CPU addresses with their strides (the caller
// keeps the tensors alive for the call); the GIL is released while bytes move.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "cairn/stock.h"
#include "common.h"
#include "without_gil.h"

namespace nb = nanobind;

namespace cairn::python {
namespace {

using TensorRequestTuple = std::tuple<std::string, uint64_t, uint64_t, std::string, std::string,
                                      std::string, std::vector<int64_t>, std::vector<int64_t>,
                                      std::vector<int64_t>, uintptr_t, std::vector<int64_t>>;

// A contiguous buffer (bytes, bytearray, memoryview) held for the call.
class BufferView {
 public:
  explicit BufferView(nb::handle obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_C_CONTIGUOUS) != 0) throw nb::python_error();
  }
  ~BufferView() { PyBuffer_Release(&view_); }
  const void* data() const { return view_.buf; }
  uint64_t size() const { return static_cast<uint64_t>(view_.len); }

 private:
  Py_buffer view_;
};

}  // namespace

void RegisterStock(nb::module_& m) {
  m.def(
      "read_stock_tensors",
      [](PyStorage& storage, const std::vector<TensorRequestTuple>& requests, ThreadPool& pool,
         bool verify_crc) {
        std::vector<stock::TensorRequest> reqs;
        reqs.reserve(requests.size());
        for (const auto& [file, offset, length, where, fqn, dtype, chunk, slice_off, slice_len,
                          dest, dest_stride] : requests) {
          reqs.push_back({.file = file,
                          .offset = offset,
                          .length = length,
                          .where = where,
                          .fqn = fqn,
                          .dtype = dtype,
                          .chunk_size = chunk,
                          .slice_offset = slice_off,
                          .slice_length = slice_len,
                          .dest = reinterpret_cast<void*>(dest),
                          .dest_stride = dest_stride});
        }
        std::vector<bool> fallback;
        WithoutGil([&] {
          return stock::ReadTensors(storage.s.get(), reqs, &pool, verify_crc, &fallback);
        });
        return fallback;
      },
      nb::arg("storage"), nb::arg("requests"), nb::arg("pool"), nb::arg("verify_crc"),
      "Loads tensor items of the stock checkpoint rooted at `storage` into CPU memory. "
      "requests: (file, offset, length, where, fqn_repr, dtype, chunk_size, slice_offset, "
      "slice_length, dest_address, dest_stride). Returns, per request, True when its archive "
      "is not torch.save's plain form (nothing written: decode it another way).");
  m.def(
      "read_stock_item",
      [](PyStorage& storage, const std::string& file, uint64_t offset, uint64_t length,
         const std::string& where, const std::string& fqn) {
        nb::object out = nb::steal(PyByteArray_FromStringAndSize(nullptr, 0));
        if (PyByteArray_Resize(out.ptr(), static_cast<Py_ssize_t>(length)) != 0) {
          throw nb::python_error();
        }
        void* dest = PyByteArray_AsString(out.ptr());
        WithoutGil([&] {
          return stock::ReadItem(storage.s.get(), file, offset, length, where, fqn, dest);
        });
        return out;
      },
      nb::arg("storage"), nb::arg("file"), nb::arg("offset"), nb::arg("length"), nb::arg("where"),
      nb::arg("fqn_repr"), "One item's bytes as a bytearray, bounds-checked against the file.");
  m.def(
      "is_stock_checkpoint",
      [](PyStorage& storage) {
        nb::gil_scoped_release release;
        return stock::IsStockCheckpoint(storage.s.get());
      },
      nb::arg("storage"), "Whether `storage` holds a stock DCP metadata pickle at its root.");
  // The decoded metadata: read-only views that DCP's Metadata is built from.
  nb::class_<stock::StockChunk>(m, "StockChunk")
      .def_ro("offsets", &stock::StockChunk::offsets)
      .def_ro("sizes", &stock::StockChunk::sizes);
  nb::class_<stock::StockItem>(m, "StockItem")
      .def_ro("fqn", &stock::StockItem::fqn)
      .def_ro("is_bytes", &stock::StockItem::is_bytes)
      .def_ro("dtype", &stock::StockItem::dtype)
      .def_ro("layout", &stock::StockItem::layout)
      .def_ro("requires_grad", &stock::StockItem::requires_grad)
      .def_ro("memory_format", &stock::StockItem::memory_format)
      .def_ro("pin_memory", &stock::StockItem::pin_memory)
      .def_ro("size", &stock::StockItem::size)
      .def_ro("chunks", &stock::StockItem::chunks);
  nb::class_<stock::StockLocation>(m, "StockLocation")
      .def_ro("fqn", &stock::StockLocation::fqn)
      .def_ro("index_offset", &stock::StockLocation::index_offset)
      .def_ro("index", &stock::StockLocation::index)
      .def_ro("relative_path", &stock::StockLocation::relative_path)
      .def_ro("offset", &stock::StockLocation::offset)
      .def_ro("length", &stock::StockLocation::length);
  nb::class_<stock::StockStorageMeta>(m, "StockStorageMeta")
      .def_ro("checkpoint_id", &stock::StockStorageMeta::checkpoint_id)
      .def_ro("save_id", &stock::StockStorageMeta::save_id)
      .def_ro("modules", &stock::StockStorageMeta::modules);
  nb::class_<stock::StockMetadata>(m, "StockMetadata")
      .def_ro("state", &stock::StockMetadata::state)
      .def_ro("locations", &stock::StockMetadata::locations)
      .def_ro("planner_data", &stock::StockMetadata::planner_data)
      .def_ro("storage_meta", &stock::StockMetadata::storage_meta)
      .def_ro("version", &stock::StockMetadata::version);
  m.def(
      "read_stock_metadata",
      [](PyStorage& storage, const std::string& name) {
        return WithoutGil([&] { return stock::ReadStockMetadata(storage.s.get(), name); });
      },
      nb::arg("storage"), nb::arg("name"),
      "Reads and validates the metadata file `name` of the stock checkpoint in `storage` with the\n"
      "engine's restricted pickle reader (nothing is unpickled). CorruptionError for a\n"
      "hostile or malformed file, NotFoundError when it is missing.");
  m.def(
      "decode_stock_tensor",
      [](nb::handle buffer, const std::string& where,
         bool verify_crc) -> std::optional<std::tuple<std::string, uint64_t, uint64_t, int64_t,
                                                      std::vector<int64_t>, std::vector<int64_t>>> {
        BufferView buf(buffer);
        Result<stock::TensorRecord> rec = InternalError("unset");
        {
          nb::gil_scoped_release release;
          stock::MemoryFile file(buf.data(), buf.size());
          rec = [&]() -> Result<stock::TensorRecord> {
            CAIRN_ASSIGN_OR_RETURN(auto entries, stock::ReadZipDirectory(file));
            if (verify_crc) {  // every stored entry, before anything is decoded
              for (const stock::ZipEntry& e : entries) {
                if (e.method != 0) continue;
                CAIRN_RETURN_IF_ERROR(stock::VerifyEntry(
                    e, static_cast<const char*>(buf.data()) + e.data_begin, e.size));
              }
            }
            return stock::DecodeTensorRecord(file, entries, /*verify_crc=*/false);
          }();
        }
        if (!rec.ok() && rec.status().code() == StatusCode::kUnimplemented) return std::nullopt;
        if (!rec.ok()) RaiseStatus(rec.status().WithContext(where));
        return std::make_tuple(rec->dtype, rec->storage.data_begin, rec->storage_numel,
                               rec->storage_offset, rec->size, rec->stride);
      },
      nb::arg("buffer"), nb::arg("where"), nb::arg("verify_crc"),
      "Decodes the torch.save archive in `buffer`: (dtype, storage byte offset, storage numel, "
      "storage offset, size, stride), or None when it is not the plain one-tensor form.");
}

}  // namespace cairn::python
