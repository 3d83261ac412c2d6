// Bindings for the staging pool and checksums.
//
// Memory safety of slot buffers. pool.buffer(i) hands Python a numpy array
// over slot i's shared mapping (torch.frombuffer can wrap it without a copy).
// Each such array keeps the Python pool object alive and is counted per
// slot; while any is alive:
//   * acquiring slot i with more bytes than it has (which would move the
//     mapping) raises instead of leaving the array dangling;
//   * close() deletes the shared-memory files at once, but the unmapping
//     waits until the last array is gone.
// Every call that copies or hashes releases the GIL.
//
// The staging engine (StagingPool::BeginSave ... WriteDataFile) is bound as
// pool.begin_save(index, lengths) -> StagedSave, then pool.copy_items,
// zero_padding, item_checksums and write_data_file on that StagedSave: Python
// hands C++ one list of (item, address) descriptors per save and loops over
// no bytes.
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cairn/checksum.h"
#include "cairn/staging.h"
#include "cairn/storage.h"
#include "cairn/thread_pool.h"
#include "common.h"
#include "without_gil.h"

namespace nb = nanobind;

namespace cairn::python {
namespace {

using SpanTuple = std::tuple<uint64_t, uint64_t, uint64_t>;

struct PyStagingPool {
  std::unique_ptr<StagingPool> pool;
  std::unique_ptr<ThreadPool> threads;  // helpers; the calling thread works too
  std::vector<size_t> live_views;       // numpy arrays alive, per slot
  bool closed = false;

  size_t total_views() const {
    size_t n = 0;
    for (size_t v : live_views) n += v;
    return n;
  }
  StagingPool& Checked() {
    if (closed || !pool) RaiseStatus(FailedPreconditionError("staging pool is closed"));
    return *pool;
  }
  ThreadPool* helpers() { return threads ? threads.get() : nullptr; }
  // The final unmap, once closed and no array is left.
  void Finish() {
    if (!pool) return;
    Status s = pool->Close();
    pool.reset();
    threads.reset();
    s.IgnoreError();  // files were already removed by close(); nothing to report to
  }
};

// copy_in / copy_out: (address, offset in the slot, nbytes) tuples, copied in
// parallel without the GIL.
template <typename Span,
          Status (StagingPool::*kCopy)(size_t, std::span<const Span>, ThreadPool*, uint64_t)>
void CopySlot(PyStagingPool& self, size_t index, const std::vector<SpanTuple>& spans) {
  StagingPool& p = self.Checked();
  std::vector<Span> v;
  v.reserve(spans.size());
  for (auto& [address, offset, n] : spans)
    v.push_back({reinterpret_cast<void*>(address), offset, n});
  WithoutGil([&] { return (p.*kCopy)(index, v, self.helpers(), kDefaultCopyPieceBytes); });
}

struct ViewToken {
  PyObject* pool_obj;
  size_t index;
};

nb::dict SlotDict(const StagingSlot& s) {
  nb::dict d;
  d["index"] = s.index;
  d["address"] = reinterpret_cast<uintptr_t>(s.data);
  d["capacity"] = s.capacity;
  d["path"] = s.path;
  d["key"] = s.key;
  return d;
}

// Growing a slot moves its mapping: refuse while arrays over it are alive.
void CheckNoGrowthUnderViews(PyStagingPool& self, size_t index, uint64_t nbytes) {
  if (index >= self.live_views.size() || self.live_views[index] == 0) return;
  StagingSlot s = ValueOrThrow(self.pool->Peek(index));
  if (nbytes > s.capacity) {
    RaiseStatus(FailedPreconditionError("staging slot " + std::to_string(index) +
                                        " would grow from " + std::to_string(s.capacity) + " to " +
                                        std::to_string(nbytes) +
                                        " bytes, moving its memory, "
                                        "but " +
                                        std::to_string(self.live_views[index]) +
                                        " buffer(s) over it are still alive; drop them first"));
  }
}

nb::list ItemList(const std::vector<uint64_t>& v) {
  nb::list out;
  for (uint64_t x : v) out.append(x);
  return out;
}

StagingSlot AcquiredView(PyStagingPool& self, size_t index) {
  StagingPool& p = self.Checked();
  StagingSlot s = ValueOrThrow(p.Peek(index));
  if (!p.in_use(index)) {
    RaiseStatus(
        FailedPreconditionError("staging slot " + std::to_string(index) + " is not acquired"));
  }
  return s;
}

}  // namespace

void RegisterStaging(nb::module_& m) {
  m.def(
      "checksum",
      [](nb::bytes data) {
        nb::gil_scoped_release r;
        return Checksum(data.c_str(), data.size());
      },
      nb::arg("data"), "XXH3-64 (seed 0) of `data`: the checksum of checkpoint blocks.");
  m.def(
      "checksum_address",
      [](uintptr_t address, uint64_t nbytes) {
        nb::gil_scoped_release r;
        return Checksum(reinterpret_cast<const void*>(address), nbytes);
      },
      nb::arg("address"), nb::arg("nbytes"), "XXH3-64 of `nbytes` at a raw address.");
  m.def(
      "block_checksums_address",
      [](uintptr_t address, uint64_t nbytes, uint64_t block_size) {
        return WithoutGil([&] {
          return BlockChecksums(reinterpret_cast<const void*>(address), nbytes, block_size,
                                nullptr);
        });
      },
      nb::arg("address"), nb::arg("nbytes"), nb::arg("block_size") = kChecksumBlockSize,
      "XXH3-64 of each `block_size` block of `nbytes` at a raw address.");
  m.attr("CHECKSUM_BLOCK_SIZE") = kChecksumBlockSize;
  m.def(
      "staged_bytes", [](const std::vector<uint64_t>& lengths) { return StagedBytes(lengths); },
      nb::arg("lengths"),
      "The slot bytes a save of items of `lengths` bytes uses (StagedSave.bytes).");

  m.def(
      "remove_stale_staging_dirs",
      [](const std::string& parent, const std::string& prefix) {
        nb::gil_scoped_release r;
        return RemoveStaleStagingDirs(parent, prefix);
      },
      nb::arg("parent"), nb::arg("prefix"),
      "Deletes the directories `prefix`<pid>-... below `parent` left by dead processes (no\n"
      "file below them locked); returns how many (include/cairn/staging.h).");

  nb::class_<StagedSave>(m, "StagedSave",
                         "One save laid out in a staging slot (StagingPool.begin_save): item i "
                         "at offsets[i], the layout of a data file.")
      .def_ro("slot", &StagedSave::slot)
      .def_prop_ro("offsets", [](const StagedSave& s) { return ItemList(s.offsets); })
      .def_prop_ro("lengths", [](const StagedSave& s) { return ItemList(s.lengths); })
      .def_ro("end", &StagedSave::end)
      .def_ro("bytes", &StagedSave::bytes)
      .def_prop_ro("address",
                   [](const StagedSave& s) { return reinterpret_cast<uintptr_t>(s.data); })
      .def_ro("capacity", &StagedSave::capacity);

  nb::class_<PyStagingPool>(
      m, "StagingPool",
      "Reusable staging buffers in node shared memory (see include/cairn/staging.h). "
      "StagingPool(root_dir, rank=0, num_slots=2, threads=2, remove_on_close=True) -- "
      "threads counts the calling thread; slots are pre-faulted, files data/r<rank>.bin.")
      .def(
          "__init__",
          [](PyStagingPool* self, const std::string& root_dir, uint32_t rank, size_t num_slots,
             size_t threads, bool remove_on_close) {
            const StagingPoolOptions o{.root_dir = root_dir,
                                       .rank = rank,
                                       .num_slots = num_slots,
                                       .remove_on_close = remove_on_close};
            auto pool = WithoutGil([&] { return StagingPool::Open(o); });
            new (self) PyStagingPool();
            self->pool = std::move(pool);
            if (threads > 1) self->threads = std::make_unique<ThreadPool>(threads - 1);
            self->live_views.assign(num_slots, 0);
          },
          nb::arg("root_dir"), nb::arg("rank") = 0, nb::arg("num_slots") = 2,
          nb::arg("threads") = 2, nb::arg("remove_on_close") = true)
      .def(
          "read_through",
          [](PyStagingPool& self, PyCheckpointReader& reader, size_t slot) {
            StagingPool& pool = self.Checked();
            const std::string root = reader.storage().LocalPath();
            if (root.empty()) return false;
            const std::string& key = pool.options().file_key;
            const auto& files = reader.manifest().files;
            if (std::none_of(files.begin(), files.end(),
                             [&](const ManifestFile& f) { return f.key == key; })) {
              return false;  // the checkpoint holds no data file of this rank
            }
            auto file = pool.OpenMapped(slot, JoinKey(root, JoinKey(reader.engine().dir(), key)));
            if (!file.ok()) return false;
            ThrowIfError(reader.engine().UseFile(key, std::move(file).value()));
            return true;
          },
          nb::arg("reader"), nb::arg("slot"),
          "Serves `reader`'s data file from slot `slot`'s mapping in this process when the\n"
          "file is that slot's (StagingPool::OpenMapped): a restore of what this process\n"
          "staged copies out of memory already mapped. False when it is not (the reader reads\n"
          "the file as usual). The slot cannot be acquired until reader.close_files().")
      .def(
          "acquire",
          [](PyStagingPool& self, uint64_t nbytes) {
            StagingPool& p = self.Checked();
            for (size_t i = 0; i < self.live_views.size(); ++i) {
              if (!p.in_use(i)) CheckNoGrowthUnderViews(self, i, nbytes);
            }
            StagingSlot s = WithoutGil([&] { return p.Acquire(nbytes, self.helpers()); });
            return SlotDict(s);
          },
          nb::arg("nbytes"),
          "Acquires the free slot released longest ago with >= nbytes; returns a dict "
          "{index, address, capacity, path, key}.")
      .def(
          "acquire_slot",
          [](PyStagingPool& self, size_t index, uint64_t nbytes) {
            StagingPool& p = self.Checked();
            CheckNoGrowthUnderViews(self, index, nbytes);
            return SlotDict(
                WithoutGil([&] { return p.AcquireSlot(index, nbytes, self.helpers()); }));
          },
          nb::arg("index"), nb::arg("nbytes") = 0,
          "Acquires slot `index` (nbytes=0 maps what its file already holds).")
      .def(
          "begin_save",
          [](PyStagingPool& self, size_t index, const std::vector<uint64_t>& lengths) {
            StagingPool& p = self.Checked();
            CheckNoGrowthUnderViews(self, index, StagedBytes(lengths));
            return WithoutGil([&] { return p.BeginSave(index, lengths, self.helpers()); });
          },
          nb::arg("index"), nb::arg("lengths"),
          "Lays out items of `lengths` bytes as a data file lays them out and acquires slot "
          "`index` with room for them; returns the StagedSave.")
      .def(
          "copy_items",
          [](PyStagingPool& self, const StagedSave& save,
             const std::vector<std::pair<size_t, uintptr_t>>& sources) {
            StagingPool& p = self.Checked();
            std::vector<StageSource> v;
            v.reserve(sources.size());
            for (auto& [item, src] : sources) {
              v.push_back(StageSource{item, reinterpret_cast<const void*>(src)});
            }
            WithoutGil([&] { return p.CopyItems(save, v, self.helpers()); });
          },
          nb::arg("save"), nb::arg("sources"),
          "Copies each (item, src_address) into the slot at the item's offset, in parallel.")
      .def(
          "zero_padding",
          [](PyStagingPool& self, const StagedSave& save) {
            StagingPool& p = self.Checked();
            WithoutGil([&] { return p.ZeroPadding(save, self.helpers()); });
          },
          nb::arg("save"), "Zeroes every byte of the slot that belongs to no item.")
      .def(
          "item_checksums",
          [](PyStagingPool& self, const StagedSave& save, uint64_t block_size) {
            StagingPool& p = self.Checked();
            std::vector<ItemLocation> locs =
                WithoutGil([&] { return p.ItemChecksums(save, block_size, self.helpers()); });
            nb::list out;
            for (const ItemLocation& l : locs) out.append(ItemList(l.checksums));
            return out;
          },
          nb::arg("save"), nb::arg("block_size") = kChecksumBlockSize,
          "Each item's block checksums (XXH3-64 per block), hashed in parallel.")
      .def(
          "write_data_file",
          [](PyStagingPool& self, const StagedSave& save, PyStorage& storage,
             const std::string& key, ThreadPool& io_pool, bool direct_io, bool sync,
             uint64_t block_size) {
            StagingPool& p = self.Checked();
            DataFileOptions opts = MakeDataFileOptions(direct_io, sync, block_size);
            return WithoutGil(
                [&] { return p.WriteDataFile(save, storage.s.get(), key, opts, &io_pool); });
          },
          nb::arg("save"), nb::arg("storage"), nb::arg("key"), nb::arg("pool"),
          nb::arg("direct_io") = true, nb::arg("sync") = true,
          nb::arg("block_size") = kChecksumBlockSize,
          "Writes the save's bytes of the slot as data file `key` of `storage` (on the I/O "
          "`pool`); every item keeps its slot offset. Returns the file size.")
      .def(
          "release",
          [](PyStagingPool& self, size_t index) { ThrowIfError(self.Checked().Release(index)); },
          nb::arg("index"))
      .def(
          "buffer",
          [](nb::handle self_h, size_t index) {
            PyStagingPool& self = *nb::inst_ptr<PyStagingPool>(self_h);
            StagingSlot s = AcquiredView(self, index);
            auto* token = new ViewToken{self_h.ptr(), index};
            Py_INCREF(self_h.ptr());
            ++self.live_views[index];
            nb::capsule owner(token, [](void* ptr) noexcept {
              auto* t = static_cast<ViewToken*>(ptr);
              PyStagingPool* pool = nb::inst_ptr<PyStagingPool>(nb::handle(t->pool_obj));
              if (--pool->live_views[t->index] == 0 && pool->closed && pool->total_views() == 0) {
                pool->Finish();
              }
              Py_DECREF(t->pool_obj);
              delete t;
            });
            size_t shape[1] = {static_cast<size_t>(s.capacity)};
            return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(s.data, 1, shape, owner);
          },
          nb::arg("index"),
          "A writable numpy uint8 array over acquired slot `index` (its whole capacity), "
          "without a copy.")
      .def("copy_in", &CopySlot<CopySpan, &StagingPool::CopyIn>, nb::arg("index"), nb::arg("spans"),
           "Copies each (src_address, dst_offset, nbytes) into slot `index` in parallel.")
      .def("copy_out", &CopySlot<CopyOutSpan, &StagingPool::CopyOut>, nb::arg("index"),
           nb::arg("spans"),
           "Copies each (dst_address, src_offset, nbytes) out of slot `index` in parallel.")
      .def(
          "checksums",
          [](PyStagingPool& self, size_t index, uint64_t offset, uint64_t nbytes,
             uint64_t block_size) {
            StagingSlot s = AcquiredView(self, index);
            if (offset > s.capacity || s.capacity - offset < nbytes) {
              RaiseStatus(OutOfRangeError("checksum range [" + std::to_string(offset) + ", +" +
                                          std::to_string(nbytes) + ") outside slot " +
                                          std::to_string(index) + " of " +
                                          std::to_string(s.capacity) + " bytes"));
            }
            return WithoutGil([&] {
              return BlockChecksums(s.data + offset, nbytes, block_size, self.helpers());
            });
          },
          nb::arg("index"), nb::arg("offset"), nb::arg("nbytes"),
          nb::arg("block_size") = kChecksumBlockSize,
          "XXH3-64 of each block of [offset, offset + nbytes) of acquired slot `index`, in "
          "parallel.")
      .def("in_use",
           [](PyStagingPool& self, size_t i) { return !self.closed && self.pool->in_use(i); })
      .def_prop_ro("num_slots", [](PyStagingPool& self) { return self.live_views.size(); })
      .def_prop_ro("footprint",
                   [](PyStagingPool& self) { return self.pool ? self.pool->footprint() : 0; })
      .def_prop_ro("root_dir",
                   [](PyStagingPool& self) { return self.Checked().options().root_dir; })
      .def_prop_ro("rank", [](PyStagingPool& self) { return self.Checked().options().rank; })
      .def_prop_ro("live_buffers", [](PyStagingPool& self) { return self.total_views(); })
      .def_prop_ro("closed", [](PyStagingPool& self) { return self.closed; })
      .def(
          "close",
          [](PyStagingPool& self) {
            if (self.closed) return;
            self.closed = true;
            if (!self.pool) return;
            if (self.total_views() == 0) {
              Status s;
              {
                nb::gil_scoped_release g;
                s = self.pool->Close();
              }
              self.pool.reset();
              self.threads.reset();
              ThrowIfError(s);
              return;
            }
            // Arrays still point into the mappings: delete the files now
            // (nothing is left in /dev/shm), unmap when the last array goes.
            Status s =
                self.pool->options().remove_on_close ? self.pool->RemoveFiles() : Status::OK();
            ThrowIfError(s);
          },
          "Deletes this rank's shared-memory files and unmaps (the unmap waits for live "
          "buffers).")
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); })
      .def("__exit__", [](nb::handle self, nb::args) { self.attr("close")(); });
}

}  // namespace cairn::python
