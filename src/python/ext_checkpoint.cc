// Bindings for the checkpoint engine (include/cairn/checkpoint.h).
//
// Only argument conversion happens here. Tensor bytes cross as raw addresses
// (tensor.data_ptr(), numpy .ctypes.data) with their sizes: the caller keeps
// the memory alive for the duration of the call; nothing is copied or
// pickled, and libtorch is not linked. The GIL is released around every call
// that does I/O.
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <filesystem>
#include <system_error>
#include <unordered_set>

#include "cairn/checkpoint.h"
#include "cairn/read_plan.h"
#include "cairn/tiers.h"
#include "common.h"
#include "without_gil.h"

namespace nb = nanobind;

namespace cairn::python {

namespace {

// Checks that `dir` of `storage` exists: NotFound says "no such <what>:
// <uri>". A storage's root always exists (it was opened).
Status CheckExists(const PyStorage& storage, const std::string& dir, const char* what) {
  if (dir.empty()) return Status::OK();
  CAIRN_ASSIGN_OR_RETURN(bool there, storage.s->Exists(dir));
  if (!there)
    return NotFoundError(std::string("no such ") + what + ": " + StorageUri(storage, dir));
  return Status::OK();
}

// A new bytes object of r->size bytes, which `r` then reads into (it is
// filled before anyone else sees it).
nb::object NewBytesFor(ReadRequest* r) {
  nb::object b = nb::steal(PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(r->size)));
  if (!b.is_valid()) throw nb::python_error();
  r->dest = PyBytes_AS_STRING(b.ptr());
  return b;
}

}  // namespace

std::string StorageUri(const PyStorage& storage, const std::string& dir) {
  return dir.empty() ? storage.uri : JoinUri(storage.uri, dir);
}

PyCheckpointReader::PyCheckpointReader(const PyStorage& storage, const std::string& dir)
    : uri_(StorageUri(storage, dir)), storage_(storage.s) {
  WithoutGil([&]() -> Status {
    CAIRN_RETURN_IF_ERROR(CheckExists(storage, dir, "checkpoint"));
    CAIRN_ASSIGN_OR_RETURN(reader_, CheckpointReader::Open(storage_.get(), dir));
    index_ = std::make_unique<ItemIndex>(reader_->manifest());
    return reader_->CheckFiles();
  });
}

PyCheckpointReader::PyCheckpointReader(std::string uri, std::shared_ptr<Storage> storage,
                                       std::unique_ptr<CheckpointReader> reader)
    : uri_(std::move(uri)),
      storage_(std::move(storage)),
      reader_(std::move(reader)),
      index_(std::make_unique<ItemIndex>(reader_->manifest())) {}

void PyCheckpointReader::Read(const std::vector<ReadTuple>& requests, ThreadPool& pool) {
  std::vector<ReadRequest> reqs;
  reqs.reserve(requests.size());
  for (const auto& [kind, index, chunk, addr, size, offset] : requests) {
    if (kind != 0 && kind != 1) ThrowIfError(InvalidArgumentError("bad item kind"));
    ReadRequest r;
    r.item.kind = kind == 0 ? ItemRef::Kind::kTensorChunk : ItemRef::Kind::kBytes;
    r.item.index = index;
    r.item.chunk = chunk;
    r.dest = reinterpret_cast<void*>(addr);
    r.size = size;
    r.offset = offset;
    reqs.push_back(r);
  }
  WithoutGil([&] { return reader_->Read(reqs, &pool); });
}

nb::list PyCheckpointReader::ReadItems(const std::vector<BoxTuple>& boxes,
                                       const std::vector<std::string>& values, ThreadPool& pool) {
  auto missing = [&](const std::string& fqn, const std::string& at) {
    RaiseStatus(
        InvalidArgumentError("'" + fqn + "'" + at + " is not in the checkpoint at " + uri_));
  };
  std::vector<BoxRead> bs;
  bs.reserve(boxes.size());
  for (const auto& [fqn, chunk_offsets, offsets, lengths, addr, nbytes] : boxes) {
    std::optional<ItemRef> item = index_->Chunk(fqn, chunk_offsets);
    if (!item) {
      std::string at;
      for (uint64_t o : chunk_offsets) at += (at.empty() ? "" : ", ") + std::to_string(o);
      missing(fqn, " at [" + at + "]");
    }
    bs.push_back(
        {item->index, item->chunk, offsets, lengths, reinterpret_cast<void*>(addr), nbytes});
  }
  std::vector<ReadRequest> reqs;
  nb::list out;
  for (const std::string& fqn : values) {
    std::optional<ItemRef> item = index_->Bytes(fqn);
    if (!item) missing(fqn, "");
    ReadRequest r;
    r.item = *item;
    r.size = manifest().bytes[item->index].location.length;
    out.append(NewBytesFor(&r));
    reqs.push_back(r);
  }
  WithoutGil([&] { return ReadBoxes(reader_.get(), bs, reqs, &pool); });
  return out;
}

std::optional<PyCheckpointReader::InPlacePlan> PyCheckpointReader::PlanInPlace(
    const std::vector<TargetTuple>& targets) {
  std::vector<InPlaceTarget> ts;
  ts.reserve(targets.size());
  for (const auto& [fqn, dtype, shape, addr, nbytes] : targets) {
    ts.push_back(
        {fqn, dtype.has_value(), dtype.value_or(""), shape, reinterpret_cast<void*>(addr), nbytes});
  }
  std::optional<std::vector<ReadRequest>> reqs = PlanInPlaceRead(manifest(), *index_, ts);
  if (!reqs) return std::nullopt;
  InPlacePlan plan;
  for (size_t i = 0; i < reqs->size(); ++i) {
    if (!ts[i].tensor) {
      plan.values.push_back(plan.requests.size());
    } else if ((*reqs)[i].size == 0) {
      continue;  // an empty tensor: nothing to read
    }
    plan.requests.push_back((*reqs)[i]);
  }
  return plan;
}

nb::list PyCheckpointReader::LoadInPlace(const InPlacePlan& plan, ThreadPool& pool) {
  std::vector<ReadRequest> reqs = plan.requests;
  nb::list values;
  for (size_t i : plan.values) values.append(NewBytesFor(&reqs[i]));
  WithoutGil([&] { return reader_->Read(reqs, &pool); });
  return values;
}

namespace {

using InPlacePlan = PyCheckpointReader::InPlacePlan;

// The (address, nbytes) buffers a data-file write takes from Python.
std::vector<BufferRef> BufferRefs(const std::vector<std::pair<uintptr_t, uint64_t>>& buffers) {
  std::vector<BufferRef> refs;
  refs.reserve(buffers.size());
  for (const auto& [addr, size] : buffers) {
    refs.push_back({reinterpret_cast<const void*>(addr), size});
  }
  return refs;
}

// A data-file write's result for Python: (file_size, [(offset, length, [block
// checksums])...]).
nb::tuple DataFileTuple(const DataFileResult& res) {
  nb::list items;
  for (const auto& loc : res.items) {
    nb::list sums;
    for (uint64_t c : loc.checksums) sums.append(c);
    items.append(nb::make_tuple(loc.offset, loc.length, sums));
  }
  return nb::make_tuple(res.file_size, items);
}

}  // namespace

void RegisterCheckpoint(nb::module_& m) {
  m.attr("FORMAT_VERSION") = format::kFormatVersion;
  m.attr("DEFAULT_BLOCK_SIZE") = format::kDefaultBlockSize;
  m.attr("ITEM_ALIGNMENT") = format::kItemAlignment;
  m.attr("MANIFEST_NAME") = std::string(format::kManifestName);
  m.attr("CHECKSUM_ALGORITHM") = std::string(format::kChecksumAlgorithm);

  nb::class_<ThreadPool>(m, "ThreadPool", "A fixed pool of I/O threads (C++ owned).")
      .def(nb::init<size_t>(), nb::arg("num_threads"))
      .def_prop_ro("size", &ThreadPool::size);
  m.def(
      "default_thread_count",
      [](const std::string& kind) {
        if (kind == "io") return DefaultThreadCount(PoolKind::kIo);
        if (kind == "copy") return DefaultThreadCount(PoolKind::kCopy);
        RaiseStatus(
            InvalidArgumentError("thread pool kind must be 'io' or 'copy', got '" + kind + "'"));
      },
      nb::arg("kind"),
      "Threads cairn gives a pool of `kind` ('io': reads/writes, 'copy': memcpy/hashing) on "
      "this machine (the one sizing rule, include/cairn/thread_pool.h).");

  m.def(
      "data_file_key", [](uint64_t rank) { return format::DataFileKey(rank); }, nb::arg("rank"),
      "The key of rank `rank`'s data file in a checkpoint: 'data/r<rank>.bin'.");
  m.def(
      "dtype_itemsize", [](const std::string& dtype) { return format::DtypeItemSize(dtype); },
      "Bytes per element of a manifest dtype name, 0 if unknown.");

  m.def(
      "write_data_file",
      [](PyStorage& storage, const std::string& key,
         const std::vector<std::pair<uintptr_t, uint64_t>>& buffers, ThreadPool& pool,
         bool direct_io, bool sync, uint64_t block_size) {
        std::vector<BufferRef> refs = BufferRefs(buffers);
        DataFileOptions opts = MakeDataFileOptions(direct_io, sync, block_size);
        DataFileResult res =
            WithoutGil([&] { return WriteDataFile(storage.s.get(), key, refs, &pool, opts); });
        return DataFileTuple(res);
      },
      nb::arg("storage"), nb::arg("key"), nb::arg("buffers"), nb::arg("pool"),
      nb::arg("direct_io") = false, nb::arg("sync") = true,
      nb::arg("block_size") = format::kDefaultBlockSize,
      "Writes (address, nbytes) buffers into file `key` of `storage`.\n"
      "Returns (file_size, [(offset, length, [block checksums])...]).");

  m.def(
      "write_data_file_staged",
      [](const std::string& stage_dir, PyStorage& target, const std::string& key,
         const std::vector<std::pair<uintptr_t, uint64_t>>& buffers, ThreadPool& pool,
         ThreadPool& copy_pool, bool direct_io, bool sync, uint64_t block_size) {
        std::vector<BufferRef> refs = BufferRefs(buffers);
        DataFileOptions opts = MakeDataFileOptions(false, false, block_size);
        DataFileResult res = WithoutGil([&]() -> Result<DataFileResult> {
          if (stage_dir.empty()) return InvalidArgumentError("empty staging directory");
          // The staged copy is transient: gone whatever happened.
          struct RemoveStage {
            const std::string& dir;
            ~RemoveStage() {
              std::error_code ec;
              std::filesystem::remove_all(dir, ec);
            }
          } remove_stage{stage_dir};
          CAIRN_ASSIGN_OR_RETURN(auto stage, NewPosixStorage(stage_dir, /*create=*/true));
          CopyFileOptions copy;
          copy.direct_io = direct_io;
          copy.sync = sync;
          // Small ranges: the upload starts once the first 4 MiB are staged
          // (16 MiB made the staged save 0.25 s slower than its bandwidth
          // bound at 50 MB/s; an S3 target still sends whole parts).
          copy.chunk_bytes = uint64_t{4} << 20;
          return WriteDataFileStaged(stage.get(), target.s.get(), key, refs, &pool, &copy_pool,
                                     opts, copy);
        });
        return DataFileTuple(res);
      },
      nb::arg("stage_dir"), nb::arg("target"), nb::arg("key"), nb::arg("buffers"), nb::arg("pool"),
      nb::arg("copy_pool"), nb::arg("direct_io") = false, nb::arg("sync") = true,
      nb::arg("block_size") = format::kDefaultBlockSize,
      "write_data_file into `key` of the local directory `stage_dir`, copied to `key` of the\n"
      "`target` storage while it is being written (each range as soon as it is complete, on\n"
      "`copy_pool`; the target synced unless sync=False), then `stage_dir` is removed, also\n"
      "on failure.\n"
      "Returns write_data_file's result.");

  m.def(
      "commit_manifest",
      [](PyStorage& storage, const Manifest& manifest, const std::string& dir) {
        WithoutGil([&] { return CommitManifest(storage.s.get(), dir, manifest); });
      },
      nb::arg("storage"), nb::arg("manifest"), nb::arg("dir") = "",
      "Validates a Manifest and commits it in `dir` of `storage` (written last, atomically).");

  m.def(
      "uncommit",
      [](PyStorage& storage, const std::string& dir, bool clear_data) {
        WithoutGil([&]() -> Status {
          CAIRN_RETURN_IF_ERROR(UncommitCheckpoint(storage.s.get(), dir));
          if (clear_data) return storage.s->DeleteDir(JoinKey(dir, format::kDataDir));
          return Status::OK();
        });
      },
      nb::arg("storage"), nb::arg("dir") = "", nb::arg("clear_data") = false,
      "Removes the manifest in `dir` of `storage` if any (the directory becomes partial),\n"
      "and with clear_data its old data files.");

  m.def(
      "remove_checkpoint",
      [](const std::string& uri) { WithoutGil([&] { return RemoveCheckpointUri(uri); }); },
      nb::arg("uri"), "RemoveCheckpointUri (cairn/checkpoint.h): removes one checkpoint.");

  m.def(
      "has_manifest",
      [](PyStorage& storage, const std::string& dir) {
        nb::gil_scoped_release release;
        auto e = storage.s->Exists(JoinKey(dir, format::kManifestName));
        return e.ok() && *e;
      },
      nb::arg("storage"), nb::arg("dir") = "",
      "Whether `dir` of `storage` holds a cairn manifest (committed or damaged).");

  m.attr("MAX_BYTES_ITEM_SIZE") = format::kMaxBytesItemSize;

  m.def(
      "validate_chunk_coverage",
      [](const std::string& fqn, const std::vector<uint64_t>& shape,
         const std::vector<std::pair<std::vector<uint64_t>, std::vector<uint64_t>>>& chunks) {
        ManifestTensor t;
        t.fqn = fqn;
        t.shape = shape;
        for (const auto& [offsets, sizes] : chunks) {
          TensorChunk c;
          if (offsets.size() != shape.size() || sizes.size() != shape.size()) {
            ThrowIfError(DataLossError("tensor '" + fqn + "': a chunk's rank differs"));
          }
          uint64_t n = 1;
          for (size_t d = 0; d < shape.size(); ++d) {
            if (offsets[d] > shape[d] || sizes[d] > shape[d] - offsets[d]) {
              ThrowIfError(DataLossError("tensor '" + fqn + "': a chunk lies outside the shape"));
            }
            n *= sizes[d];
          }
          c.offsets = offsets;
          c.sizes = sizes;
          c.location.length = n;  // only whether it is empty matters here
          t.chunks.push_back(std::move(c));
        }
        uint64_t numel = 1;
        for (uint64_t d : shape) {
          if (__builtin_mul_overflow(numel, d, &numel)) {
            ThrowIfError(DataLossError("tensor '" + fqn + "': shape overflows"));
          }
        }
        WithoutGil([&] { return ValidateChunkCoverage(t); });
      },
      nb::arg("fqn"), nb::arg("shape"), nb::arg("chunks"),
      "Raises CorruptionError unless the (offsets, sizes) chunks tile `shape` exactly once.");

  m.def(
      "relate_local_dirs",
      [](const std::string& a, const std::string& b) {
        Result<DirRelation> r = DirRelation::kDisjoint;
        {
          nb::gil_scoped_release release;
          r = RelateLocalDirs(a, b);
        }
        switch (ValueOrThrow(std::move(r))) {
          case DirRelation::kSame:
            return std::string("same");
          case DirRelation::kFirstInside:
            return std::string("first_inside");
          case DirRelation::kSecondInside:
            return std::string("second_inside");
          default:
            return std::string("disjoint");
        }
      },
      nb::arg("a"), nb::arg("b"),
      "How two local directories (existing or not) lie: 'disjoint', 'same', 'first_inside'\n"
      "or 'second_inside' (symlinks and mounts resolved).");

  m.def(
      "chunk_byte_range",
      [](const std::vector<int64_t>& offsets, const std::vector<int64_t>& lengths,
         const std::vector<int64_t>& sizes, uint64_t itemsize) {
        std::optional<ByteRange> r =
            ValueOrThrow(ChunkByteRange(offsets, lengths, sizes, itemsize));
        return r ? nb::make_tuple(r->offset, r->size) : nb::object(nb::none());
      },
      nb::arg("offsets"), nb::arg("lengths"), nb::arg("sizes"), nb::arg("itemsize"),
      "(byte offset, nbytes) of the box offsets + lengths inside a row-major chunk of shape\n"
      "`sizes` when it is one contiguous byte range, else None (include/cairn/read_plan.h).");

  nb::class_<InPlacePlan>(m, "InPlacePlan",
                          "CheckpointReader.plan_in_place's reads (tensors straight into "
                          "their memory).")
      .def_prop_ro("num_requests", [](const InPlacePlan& p) { return p.requests.size(); })
      .def_prop_ro("num_values", [](const InPlacePlan& p) { return p.values.size(); })
      .def(
          "tensor_items",
          [](const InPlacePlan& p) {
            std::vector<uint64_t> keys;
            for (const ReadRequest& r : p.requests) {
              if (r.item.kind == ItemRef::Kind::kTensorChunk && r.size > 0) {
                keys.push_back(uint64_t{r.item.index} << 32 | r.item.chunk);
              }
            }
            return keys;
          },
          "The stored tensor chunks the plan reads, each as index << 32 | chunk.")
      .def(
          "share",
          [](InPlacePlan& p, const std::vector<uint64_t>& keys) {
            std::unordered_set<uint64_t> set(keys.begin(), keys.end());
            size_t n = 0;
            for (ReadRequest& r : p.requests) {
              if (r.item.kind == ItemRef::Kind::kTensorChunk &&
                  set.count(uint64_t{r.item.index} << 32 | r.item.chunk) != 0) {
                r.shared = true;
                ++n;
              }
            }
            return n;
          },
          nb::arg("keys"),
          "Marks the reads of these tensor_items() shared (other processes of this node read\n"
          "them too: through the page cache, which fetches them from the device once); returns\n"
          "how many reads it marked.");

  nb::class_<PyCheckpointReader>(m, "CheckpointReader")
      .def(nb::init<const PyStorage&, const std::string&>(), nb::arg("storage"),
           nb::arg("dir") = "",
           "Opens the committed checkpoint in `dir` of `storage`: reads and validates the\n"
           "manifest and checks every data file's size.")
      .def_prop_ro("uri", [](const PyCheckpointReader& r) { return r.uri(); })
      .def("manifest", &PyCheckpointReader::manifest, nb::rv_policy::copy,
           "The validated Manifest (a copy).")
      .def("read", &PyCheckpointReader::Read, nb::arg("requests"), nb::arg("pool"),
           "Reads (kind, index, chunk, address, nbytes, offset) requests in parallel, verified.")
      .def("read_items", &PyCheckpointReader::ReadItems, nb::arg("boxes"), nb::arg("values"),
           nb::arg("pool"),
           "Reads (fqn, chunk offsets, offsets, lengths, address, nbytes) boxes of stored chunks\n"
           "into contiguous memory and the bytes items named `values`, in parallel, verified;\n"
           "returns the values' bytes (include/cairn/read_plan.h, ReadBoxes).")
      .def("plan_in_place", &PyCheckpointReader::PlanInPlace, nb::arg("targets"),
           "The InPlacePlan of (fqn, dtype or None for a value, shape, address, nbytes)\n"
           "targets: each tensor read straight into its contiguous host memory, each value's\n"
           "bytes read whole; None when a target is not stored so (include/cairn/read_plan.h).")
      .def("load_in_place", &PyCheckpointReader::LoadInPlace, nb::arg("plan"), nb::arg("pool"),
           "Carries out an InPlacePlan (parallel, verified); returns the bytes of each value\n"
           "target, in order. The targets' memory must still be alive.")
      .def(
          "keys",
          [](const PyCheckpointReader& r) {
            std::vector<std::string> out;
            for (const auto& t : r.manifest().tensors) out.push_back(t.fqn);
            for (const auto& b : r.manifest().bytes) out.push_back(b.fqn);
            return out;
          },
          "The names of the stored tensors and values (what DCP's Metadata lists).")
      .def(
          "close_files", [](PyCheckpointReader& r) { r.engine().CloseFiles(); },
          "Closes the data files opened so far (a later read opens them again); gives back\n"
          "a staging slot StagingPool.read_through lent.");

  m.def(
      "verify",
      [](PyStorage& storage, ThreadPool& pool, const std::string& dir) {
        WithoutGil([&]() -> Status {
          CAIRN_RETURN_IF_ERROR(CheckExists(storage, dir, "checkpoint"));
          return Verify(storage.s.get(), dir, &pool);
        });
      },
      nb::arg("storage"), nb::arg("pool"), nb::arg("dir") = "",
      "Checks every byte of the checkpoint in `dir` of `storage`.");

  m.def(
      "list_checkpoints",
      [](PyStorage& storage) {
        std::vector<CheckpointInfo> listed =
            WithoutGil([&] { return ListCheckpoints(storage.s.get(), ""); });
        nb::list out;
        for (const auto& c : listed) {
          nb::dict d;
          d["name"] = c.name;
          d["step"] = c.step ? nb::cast(*c.step) : nb::none();
          d["committed"] = c.committed;
          d["status"] = c.status.ToString();
          d["bytes"] = c.bytes;
          d["created_unix_ms"] = c.created_unix_ms;
          d["world_size"] = c.world_size;
          out.append(d);
        }
        return out;
      },
      nb::arg("storage"), "Every checkpoint directory in `storage`, oldest first, as dicts.");

  m.def(
      "copy_checkpoint_dir",
      [](PyStorage& src, const std::string& src_dir, PyStorage& dst, const std::string& dst_dir,
         ThreadPool& pool, bool direct_io, bool sync) {
        CopyOptions opts;
        opts.direct_io = direct_io;
        opts.sync = sync;
        WithoutGil([&] {
          return CopyCheckpoint(src.s.get(), src_dir, dst.s.get(), dst_dir, &pool, {}, opts);
        });
      },
      nb::arg("src"), nb::arg("src_dir"), nb::arg("dst"), nb::arg("dst_dir"), nb::arg("pool"),
      nb::arg("direct_io") = true, nb::arg("sync") = true,
      "Copies the committed checkpoint in directory `src_dir` of `src` to `dst_dir` of `dst`\n"
      "(CopyCheckpoint: blocks verified in transit, data synced, the manifest committed last).");
  m.def(
      "copy_checkpoint",
      [](PyStorage& src, const std::string& dst, ThreadPool& pool, bool direct_io, bool sync,
         bool verify_destination) {
        CopyOptions opts;
        opts.direct_io = direct_io;
        opts.sync = sync;
        opts.verify_destination = verify_destination;
        // The destination is opened (created) only once the copy is known not
        // to overlap its source, so a refused copy leaves nothing behind.
        WithoutGil([&] { return CopyCheckpointTo(src.s.get(), dst, &pool, {}, opts); });
      },
      nb::arg("src"), nb::arg("dst"), nb::arg("pool"), nb::arg("direct_io") = true,
      nb::arg("sync") = true, nb::arg("verify_destination") = false,
      "Copies the committed checkpoint in `src` to the URI `dst` (opened, created, only once\n"
      "it is known not to overlap `src`); the manifest is committed last there.");
}

}  // namespace cairn::python
