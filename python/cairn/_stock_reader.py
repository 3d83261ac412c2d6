"""Loading checkpoints written by stock ``dcp.save`` (the filesystem writer), safely.

A stock checkpoint directory holds::

    .metadata            a pickled torch.distributed.checkpoint.metadata.Metadata
    __<rank>_<n>.distcp  data files; every item is a byte range in one of them:
                         a tensor item is one ``torch.save``'d tensor (a zip file),
                         a non-tensor item is the planner's ``torch.save(obj)`` bytes

(``__<rank>.metadata`` replaces ``.metadata`` when it was saved without collectives.)

Stock ``FileSystemReader`` loads ``.metadata`` with ``pickle.load``: a hostile
checkpoint runs arbitrary code. :class:`StockReader` never does. It loads in
three steps:

1. **Decode into stand-ins.** A restricted unpickler resolves only the handful of
   globals a DCP metadata pickle names (the metadata dataclasses, ``torch.Size``,
   dtypes, layouts, paths) and each resolves to an inert stand-in created for this
   one decode, so ``BUILD`` opcodes cannot touch any real class or global object.
   Any other global (``os.system``, ``builtins.eval``...) stops decoding with
   :class:`cairn.CorruptionError` before anything is called.
2. **Validate and convert.** The stand-ins are checked field by field (types,
   non-negative sizes, chunks inside their tensor, data file names that are plain
   file names inside the checkpoint directory) and converted to the real DCP
   metadata objects that ``dcp.load``'s planner expects.
3. **Read items** (the C++ engine, ``src/stock/``). Data files are opened by
   validated name inside the checkpoint directory (no symlink, no FIFO); every
   item is bounds-checked against its file's size before it is read. A tensor
   item's zip records are walked and its CRC32s verified (torch.save writes
   them); its ``data.pkl`` is decoded by a tiny opcode reader that only
   recognises torch.save's one-tensor form (rebuild function, storage class,
   sizes, strides), the view is checked against its storage, and the slice
   the destination needs (resharding) is read straight into it, items and
   large items' pieces in parallel on cairn's I/O pool. Any other form, or a
   destination of another dtype or device, is decoded here with
   ``torch.load(weights_only=True)`` and copied. Non-tensor items are handed
   to the planner (which unpickles them with ``weights_only=False``) only if
   they also decode with ``weights_only=True`` (plus cairn's small allowlist,
   ``SAFE_VALUE_GLOBALS``: ``io.BytesIO`` and a few builtins), unless the
   caller passes ``allow_pickle=True``.

Planner calls stay on the calling thread (DCP planners are not thread-safe).
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import threading
import warnings
from typing import Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from cairn import _ext, _pools
from cairn.errors import CorruptionError, InvalidArgumentError, NotFoundError

__all__ = ["is_stock_checkpoint", "StockReader", "read_stock_metadata", "check_value_is_safe"]

METADATA_FILE = ".metadata"
# Bounds on what a metadata file may make us allocate before anything is
# validated (a sparse file costs nothing on disk): the metadata pickle itself,
# a non-tensor item, and a tensor item beyond its chunk's bytes (torch.save's
# zip headers, pickle and alignment padding).
_MAX_METADATA_SIZE = 1 << 30
_MAX_BYTES_ITEM_SIZE = int(_ext.MAX_BYTES_ITEM_SIZE)
_TENSOR_ITEM_SLACK = 16 << 20


_DTYPES = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_MEM_FORMATS = {
    0: torch.contiguous_format,
    1: torch.channels_last,
    2: torch.preserve_format,
}


def _local_path(path: str | os.PathLike) -> str:
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    return _ext.local_dir_of_uri(p) or p


def is_stock_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a directory holding a stock DCP ``.metadata`` pickle
    (global, or rank 0's when saved without collectives). Reads one byte."""
    try:
        return bool(_ext.is_stock_checkpoint(_local_path(path)))
    except TypeError:
        return False


# ----------------------------------------------------------------------------
# Step 1: decode the pickle into inert stand-ins.


class _Obj:
    """Stand-in for a metadata dataclass instance: just a bag of attributes."""

    __slots__ = ("kind", "fields", "state")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.fields: dict[str, Any] = {}
        self.state: Any = None


class _Enum:
    """Stand-in for a ``_MEM_FORMAT_ENCODING`` member."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


_DATACLASSES = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "StorageMeta",
    "MetadataIndex",
    "_StorageInfo",
)
# Where each class has lived across torch releases (all map to the stand-ins).
_CLASS_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed._shard.sharded_tensor.metadata",
    "torch.distributed._shard.metadata",
)


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler whose globals are fresh, per-decode stand-ins (see step 1)."""

    def __init__(self, file, source: str):
        super().__init__(file)
        self._source = source
        self._globals: dict[tuple[str, str], Any] = {}

    def _stand_in(self, module: str, name: str) -> Any:
        if module in _CLASS_MODULES and name in _DATACLASSES:
            kind = name

            class StandIn(_Obj):  # a new class per decode: BUILD cannot leak
                __slots__ = ()

                def __new__(cls, *args, **kwargs):
                    if args or kwargs:
                        raise CorruptionError("unexpected constructor arguments")
                    self = _Obj.__new__(cls)
                    _Obj.__init__(self, kind)
                    return self

                def __init__(self, *args, **kwargs):
                    pass

                def __setstate__(self, state):
                    if isinstance(state, dict):
                        self.fields.update(state)
                    elif (
                        isinstance(state, tuple)
                        and len(state) == 2
                        and (state[0] is None or isinstance(state[0], dict))
                        and isinstance(state[1], dict)
                    ):
                        self.fields.update(state[0] or {})
                        self.fields.update(state[1])
                    else:
                        self.state = state

            StandIn.__name__ = f"StandIn_{name}"
            return StandIn
        if module in _CLASS_MODULES and name in ("_MEM_FORMAT_ENCODING", "MEM_FORMAT_ENCODING"):
            return lambda value: _Enum(value)
        if module == "torch" and name == "Size":
            return lambda dims=(): _make_size(dims)
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]  # immutable singletons
        if module == "torch.serialization" and name == "_get_layout":
            return lambda name: _layout_by_name(name)
        if module == "pathlib" and name in (
            "PosixPath",
            "PurePosixPath",
            "WindowsPath",
            "PureWindowsPath",
            "Path",
        ):
            return lambda *parts: _path_from_parts(parts)
        if module == "collections" and name == "OrderedDict":
            return lambda *args: dict(*args)
        return None

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key not in self._globals:
            obj = self._stand_in(module, name)
            if obj is None:
                raise CorruptionError(
                    f"{self._source}: refusing to unpickle '{module}.{name}': it is not "
                    "part of DCP checkpoint metadata (a hostile or foreign .metadata file)"
                )
            self._globals[key] = obj
        return self._globals[key]

    def persistent_load(self, pid: Any) -> Any:
        raise CorruptionError(f"{self._source}: unexpected persistent id in .metadata")


def _make_size(dims: Any) -> torch.Size:
    if not isinstance(dims, (tuple, list)) or not all(
        type(d) is int and d >= 0 for d in dims
    ):
        raise CorruptionError(f"malformed torch.Size {dims!r}")
    return torch.Size(dims)


def _layout_by_name(name: Any) -> torch.layout:
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise CorruptionError(f"unknown tensor layout {name!r}")
    return _LAYOUTS[name]


def _path_from_parts(parts: tuple) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise CorruptionError("malformed path in .metadata")
    return str(pathlib.PurePosixPath(*parts)) if parts else ""


# ----------------------------------------------------------------------------
# Step 2: validate the stand-ins and convert them to real DCP objects.


class _Converter:
    def __init__(self, source: str):
        self.source = source

    def fail(self, what: str) -> CorruptionError:
        return CorruptionError(f"{self.source}: malformed checkpoint metadata: {what}")

    def obj(self, value: Any, kind: str, where: str) -> dict[str, Any]:
        if not isinstance(value, _Obj) or _obj_kind(value) != kind:
            raise self.fail(f"{where} is not a {kind}")
        return value.fields

    def size(self, value: Any, where: str) -> torch.Size:
        if not isinstance(value, torch.Size):
            # Old pickles may store plain tuples/lists.
            if isinstance(value, (tuple, list)):
                try:
                    return _make_size(value)
                except CorruptionError:
                    pass
            raise self.fail(f"{where} is not a size")
        return value

    def properties(self, value: Any, where: str) -> _md.TensorProperties:
        if not isinstance(value, _Obj) or _obj_kind(value) != "TensorProperties":
            raise self.fail(f"{where}.properties is not TensorProperties")
        state = value.state
        if state is None:  # pickled as a plain dict by some releases
            f = value.fields
            state = (
                f.get("dtype"),
                f.get("layout", torch.strided),
                f.get("requires_grad", False),
                f.get("memory_format", _Enum(0)),
                f.get("pin_memory", False),
            )
        if not isinstance(state, tuple) or len(state) != 5:
            raise self.fail(f"{where}.properties has an unexpected shape")
        dtype, layout, requires_grad, mem, pin = state
        if not isinstance(dtype, torch.dtype):
            raise self.fail(f"{where} has no valid dtype")
        if not isinstance(layout, torch.layout):
            raise self.fail(f"{where} has no valid layout")
        if isinstance(mem, _Enum):
            if mem.value not in _MEM_FORMATS:
                raise self.fail(f"{where} has an unknown memory format")
            mem = _MEM_FORMATS[mem.value]
        elif not isinstance(mem, torch.memory_format):
            raise self.fail(f"{where} has an unknown memory format")
        return _md.TensorProperties(
            dtype=dtype,
            layout=layout,
            requires_grad=bool(requires_grad),
            memory_format=mem,
            pin_memory=bool(pin),
        )

    def tensor_md(self, value: Any, where: str) -> _md.TensorStorageMetadata:
        f = self.obj(value, "TensorStorageMetadata", where)
        props = self.properties(f.get("properties"), where)
        size = self.size(f.get("size"), f"{where}.size")
        chunks_in = f.get("chunks")
        if not isinstance(chunks_in, list):
            raise self.fail(f"{where}.chunks is not a list")
        chunks = []
        for i, c in enumerate(chunks_in):
            cf = self.obj(c, "ChunkStorageMetadata", f"{where}.chunks[{i}]")
            offs = self.size(cf.get("offsets"), f"{where}.chunks[{i}].offsets")
            sizes = self.size(cf.get("sizes"), f"{where}.chunks[{i}].sizes")
            if len(offs) != len(size) or len(sizes) != len(size):
                raise self.fail(f"{where}.chunks[{i}] has the wrong rank")
            if any(o + s > d for o, s, d in zip(offs, sizes, size)):
                raise self.fail(f"{where}.chunks[{i}] lies outside the tensor")
            chunks.append(_md.ChunkStorageMetadata(offsets=offs, sizes=sizes))
        # The chunks must tile the tensor exactly once (no gap, overlap or
        # repeat): the same C++ proof as for cairn manifests.
        try:
            _ext.validate_chunk_coverage(
                where, list(size), [(list(c.offsets), list(c.sizes)) for c in chunks]
            )
        except CorruptionError as e:
            raise self.fail(str(e).removeprefix("invalid manifest: ")) from None
        return _md.TensorStorageMetadata(properties=props, size=size, chunks=chunks)

    def index(self, value: Any, where: str) -> _md.MetadataIndex:
        f = self.obj(value, "MetadataIndex", where)
        fqn = f.get("fqn")
        if not isinstance(fqn, str):
            raise self.fail(f"{where}.fqn is not a string")
        offset = f.get("offset")
        if offset is not None:
            offset = self.size(offset, f"{where}.offset")
        idx = f.get("index")
        if idx is not None and type(idx) is not int:
            raise self.fail(f"{where}.index is not an int")
        return _md.MetadataIndex(fqn=fqn, offset=offset, index=idx)

    def storage_info(self, value: Any, where: str) -> _StorageInfo:
        f = self.obj(value, "_StorageInfo", where)
        rel = f.get("relative_path")
        off = f.get("offset")
        length = f.get("length")
        td = f.get("transform_descriptors")
        if not _is_plain_file_name(rel):
            raise self.fail(
                f"{where}: data file name {rel!r} is not a plain file name in the "
                "checkpoint directory"
            )
        if type(off) is not int or type(length) is not int or off < 0 or length < 0:
            raise self.fail(f"{where}: bad offset/length {off!r}/{length!r}")
        if td:
            raise InvalidArgumentError(
                f"{self.source}: item {where} uses stream transforms {list(td)!r} "
                "(e.g. compression), which cairn's stock reader does not support"
            )
        return _StorageInfo(relative_path=rel, offset=off, length=length)

    def metadata(self, value: Any) -> _md.Metadata:
        f = self.obj(value, "Metadata", "the root object")
        sdm_in = f.get("state_dict_metadata")
        if not isinstance(sdm_in, dict):
            raise self.fail("state_dict_metadata is not a dict")
        sdm: dict[str, Any] = {}
        for fqn, v in sdm_in.items():
            if not isinstance(fqn, str):
                raise self.fail(f"key {fqn!r} is not a string")
            if _obj_kind(v) == "BytesStorageMetadata":
                sdm[fqn] = _md.BytesStorageMetadata()
            else:
                sdm[fqn] = self.tensor_md(v, repr(fqn))

        planner_data = f.get("planner_data")
        if planner_data is not None:
            if not isinstance(planner_data, dict):
                raise self.fail("planner_data is not a dict")
            for k, path in planner_data.items():
                if not isinstance(k, str) or not isinstance(path, tuple):
                    raise self.fail(f"planner_data[{k!r}] is malformed")
                if not all(isinstance(p, (str, int)) for p in path):
                    raise self.fail(f"planner_data[{k!r}] is malformed")

        sd_in = f.get("storage_data")
        if not isinstance(sd_in, dict):
            raise self.fail("storage_data is not a dict")
        storage: dict[_md.MetadataIndex, _StorageInfo] = {}
        for i, (k, v) in enumerate(sd_in.items()):
            idx = self.index(k, f"storage_data key #{i}")
            storage[idx] = self.storage_info(v, f"{idx.fqn!r}")

        # Every item the planner may ask for must have a location.
        for fqn, v in sdm.items():
            # Each item with a bound on what reading it allocates (its file
            # may be sparse, so the file's size alone bounds nothing).
            if isinstance(v, _md.BytesStorageMetadata):
                wanted = [(_md.MetadataIndex(fqn), _MAX_BYTES_ITEM_SIZE)]
            else:
                itemsize = v.properties.dtype.itemsize
                wanted = [
                    (_md.MetadataIndex(fqn, c.offsets),
                     itemsize * c.sizes.numel() + _TENSOR_ITEM_SLACK)
                    for c in v.chunks
                ]
            for w, limit in wanted:
                if w not in storage:
                    raise self.fail(f"no data location for {fqn!r} at {w.offset}")
                if storage[w].length > limit:
                    raise self.fail(
                        f"item {fqn!r} at {w.offset} declares {storage[w].length} bytes, "
                        f"more than it can hold ({limit})"
                    )

        meta = None
        sm = f.get("storage_meta")
        if sm is not None:
            smf = self.obj(sm, "StorageMeta", "storage_meta")
            ck = smf.get("checkpoint_id")
            meta = _md.StorageMeta(
                checkpoint_id=ck if isinstance(ck, str) else None,
                save_id=smf.get("save_id") if isinstance(smf.get("save_id"), str) else None,
                modules=[m for m in smf.get("modules") or [] if isinstance(m, str)],
            )
        version = f.get("version")
        if version is not None and not isinstance(version, str):
            raise self.fail("version is not a string")
        if isinstance(version, str) and not version.startswith("1."):
            raise InvalidArgumentError(
                f"{self.source}: unsupported DCP metadata version {version!r}"
            )
        return _md.Metadata(
            state_dict_metadata=sdm,
            planner_data=planner_data,
            storage_data=storage,
            storage_meta=meta,
            version=version,
        )


def _obj_kind(value: Any) -> str | None:
    if isinstance(value, _Obj):
        try:
            return value.kind
        except AttributeError:
            return None
    return None


def _is_plain_file_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def read_stock_metadata(path: str | os.PathLike, rank: int | None = None) -> _md.Metadata:
    """Reads and validates a stock checkpoint's metadata without unsafe unpickling.

    Raises NotFoundError when the file is missing, CorruptionError when it is not
    a well-formed DCP metadata pickle (including any pickle that names a global
    outside DCP's metadata classes)."""
    d = _local_path(path)
    name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
    f = os.path.join(d, name)
    # The engine opens it (no symlink, no FIFO) and bounds it before reading.
    raw = _ext.read_stock_metadata_file(d, name, _MAX_METADATA_SIZE)
    try:
        root = _RestrictedUnpickler(io.BytesIO(raw), f).load()
    except CorruptionError:
        raise
    except Exception as e:  # any decoding failure of untrusted bytes
        raise CorruptionError(f"{f}: unreadable DCP metadata: {e}") from e
    try:
        return _Converter(f).metadata(root)
    except (CorruptionError, InvalidArgumentError):
        raise
    except Exception as e:  # e.g. an unhashable value where a key belongs
        raise CorruptionError(f"{f}: malformed checkpoint metadata ({e!r})") from e


# ----------------------------------------------------------------------------
# Step 3: read items. The zip walk, data.pkl decoding, bounds and CRC32 checks
# and the copies into the destinations are the C++ engine's (src/stock/,
# include/cairn/stock.h); Python resolves destinations and handles the rest.


def _decode_tensor(buf, where: str, verify_crc: bool) -> torch.Tensor:
    """The tensor of a torch.save item held in ``buf``: a strided view of
    ``buf`` itself when the archive has the plain one-tensor form (no copy),
    else torch.load(weights_only=True). The archive's records and CRC32s are
    checked by the engine either way."""
    rec = _ext.decode_stock_tensor(buf, where, verify_crc)
    if rec is None:  # not the plain form: torch's own safe decoder
        try:
            t = torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
        except Exception as e:
            raise CorruptionError(f"{where}: undecodable tensor item ({e})") from e
        if not isinstance(t, torch.Tensor):
            raise CorruptionError(f"{where}: item is a {type(t).__name__}, not a tensor")
        return t
    dtype_name, begin, numel, offset, size, stride = rec
    dtype = getattr(torch, dtype_name)
    if numel == 0:
        return torch.empty(size, dtype=dtype)
    with warnings.catch_warnings():  # frombuffer warns about writable buffers
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(buf, dtype=dtype, count=numel, offset=begin)
    return flat.as_strided(size, stride, offset)


# Types a DCP state holds that torch.load(weights_only=True) does not rebuild on
# its own but that are safe to rebuild: building one calls no code of the
# pickle's choosing and reads no raw memory. io.BytesIO is DCP's documented way
# to save arbitrary bytes; its state (bytes, position, attribute dict) is itself
# decoded under the same restrictions. Not here on purpose: numpy (its
# multiarray.scalar rebuilds objects from raw bytes), deque/defaultdict (they
# would need arbitrary factories). Users extend the set for their own types with
# torch.serialization.add_safe_globals, which the check honours.
SAFE_VALUE_GLOBALS = (io.BytesIO, frozenset, range, slice)

# torch.serialization.safe_globals changes process-wide state: the lock keeps
# cairn's own concurrent checks (StockReader's item threads) from removing the
# allowlist under one another; each check adds only what the user has not added
# already, so leaving the block never removes a user's registration.
_safe_globals_lock = threading.Lock()


def check_value_is_safe(data, where: str) -> None:
    """Raises CorruptionError unless ``data`` (a non-tensor item: the planner's
    ``torch.save(obj)`` bytes) decodes with ``torch.load(weights_only=True)``
    under cairn's allowlist :data:`SAFE_VALUE_GLOBALS`.

    DCP's DefaultLoadPlanner.load_bytes unpickles such items with
    ``weights_only=False``, so without this check a hostile checkpoint runs
    code through any non-tensor value. Plain Python values (numbers, strings,
    lists, dicts, tuples, sets), tensors, ``io.BytesIO``, optimizer
    ``param_groups`` entries, LR scheduler states and
    torch.serialization.add_safe_globals' types pass."""
    try:
        with _safe_globals_lock:
            registered = set(torch.serialization.get_safe_globals())
            extra = [g for g in SAFE_VALUE_GLOBALS if g not in registered]
            with torch.serialization.safe_globals(extra):
                torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message leads with boilerplate; the line naming the refused
        # GLOBAL is what tells the user what the value holds.
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [repr(e)]
        first = next((line for line in lines if "GLOBAL" in line), lines[0])
        raise CorruptionError(
            f"{where}: this non-tensor value needs unrestricted unpickling, refused; "
            f"pass allow_pickle=True if you trust this checkpoint ({first})"
        ) from e
    except Exception as e:
        raise CorruptionError(f"{where}: unreadable value ({e})") from e


class StockReader(StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by stock ``dcp.save``
    with the filesystem writer, without unsafe unpickling (see the module doc).

    Supports loading on any world size (resharding: each request is narrowed to
    the slice the destination needs). One instance serves one ``dcp.load`` at a
    time. A tensor item in torch.save's plain one-tensor form that lands in a
    CPU tensor of its dtype is loaded by the C++ engine
    (``_ext.read_stock_tensors``: zip records and CRC32s checked, bytes read
    straight into the destination, in parallel); other forms and destinations
    are decoded here (``torch.load(weights_only=True)``) and copied.

    Args:
        path: the checkpoint directory (or ``file://`` URI).
        thread_count: threads of this reader's own I/O pool (default: the
            process-wide pool of cairn._pools).
        verify_crc: check each tensor item's zip CRC32s (torch.save writes them).
        allow_pickle: hand non-tensor items that need arbitrary unpickling to the
            planner anyway. Only for checkpoints you trust.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        thread_count: int | None = None,
        verify_crc: bool = True,
        allow_pickle: bool = False,
    ) -> None:
        super().__init__()
        self.path = _local_path(path)
        self.thread_count = thread_count or _pools.thread_count("io")
        self._own_pool = _ext.ThreadPool(thread_count) if thread_count else None
        self.verify_crc = verify_crc
        self.allow_pickle = allow_pickle
        self.storage_data: dict[_md.MetadataIndex, _StorageInfo] = {}
        self._chunks: dict[_md.MetadataIndex, tuple[torch.Size, torch.dtype]] = {}

    # -- StorageReader -----------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        self._chunks = {}
        if checkpoint_id:
            self.path = _local_path(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> _md.Metadata:
        md = read_stock_metadata(self.path, kwargs.get("rank"))
        return md

    def set_up_storage_reader(
        self, metadata: _md.Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data
        self._chunks = {}
        for fqn, v in metadata.state_dict_metadata.items():
            if isinstance(v, _md.TensorStorageMetadata):
                for c in v.chunks:
                    self._chunks[_md.MetadataIndex(fqn, c.offsets)] = (
                        c.sizes,
                        v.properties.dtype,
                    )

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            storage = _ext.open_storage(self.path, create=False)
        except NotFoundError as e:
            raise CorruptionError(f"{self.path}: checkpoint directory is missing") from e
        engine, engine_reqs, slow = [], [], []
        for req in plan.items:
            info = self.storage_data.get(req.storage_index)
            if info is None:
                raise CorruptionError(
                    f"{self.path}: no data location for {req.storage_index.fqn!r}"
                )
            item = (req, info, f"{os.path.join(self.path, info.relative_path)}: "
                    f"tensor {req.storage_index.fqn!r}")
            if req.type == LoadItemType.BYTE_IO:
                slow.append(item)
                continue
            target = planner.resolve_tensor(req).detach()
            expected = self._chunks.get(req.storage_index)
            if list(target.shape) != list(req.lengths):
                raise CorruptionError(
                    f"{item[2]}: destination slice is {list(target.shape)}, stored slice "
                    f"is {list(req.lengths)}"
                )
            if expected is None or not _engine_can_fill(target, expected[1]):
                slow.append(item + (target,))
                continue
            engine.append(item + (target,))
            engine_reqs.append((
                info.relative_path, info.offset, info.length, item[2],
                repr(req.storage_index.fqn), str(expected[1]).removeprefix("torch."),
                list(expected[0]), list(req.storage_offsets), list(req.lengths),
                target.data_ptr(), list(target.stride()),
            ))
        pool = self._own_pool or _pools.io_pool()
        fallback = _ext.read_stock_tensors(storage, engine_reqs, pool, self.verify_crc)
        for item, fell in zip(engine, fallback):
            if fell:
                slow.append(item)
            else:
                planner.commit_tensor(item[0], item[3])
        for item in slow:
            self._read_item(storage, planner, *item)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_stock_checkpoint(checkpoint_id)

    # -- internals ---------------------------------------------------------

    def _read_item(self, storage, planner: LoadPlanner, req, info, where, target=None) -> None:
        """One item the engine does not fill: a non-tensor value, a tensor in
        another form than torch.save's plain one, or a destination of another
        dtype or device."""
        data = _ext.read_stock_item(storage, info.relative_path, info.offset, info.length,
                                    where, repr(req.storage_index.fqn))
        if req.type == LoadItemType.BYTE_IO:
            if not self.allow_pickle:
                check_value_is_safe(data, where)
            planner.load_bytes(req, io.BytesIO(data))
            return
        t = _decode_tensor(data, where, self.verify_crc)
        expected = self._chunks.get(req.storage_index)
        if expected is not None:
            sizes, dtype = expected
            if t.shape != sizes or t.dtype != dtype:
                raise CorruptionError(
                    f"{where}: stored chunk is {t.dtype}{list(t.shape)}, metadata says "
                    f"{dtype}{list(sizes)}"
                )
        if len(req.storage_offsets) != t.dim() or len(req.lengths) != t.dim():
            raise CorruptionError(f"{where}: request rank does not match the chunk")
        for dim, (off, n) in enumerate(zip(req.storage_offsets, req.lengths)):
            if off < 0 or n < 0 or off + n > t.shape[dim]:
                raise CorruptionError(f"{where}: request lies outside the stored chunk")
            t = t.narrow(dim, off, n)
        target.copy_(t)
        planner.commit_tensor(req, target)


def _engine_can_fill(target: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the engine can write the item into ``target`` itself: CPU memory
    of the stored dtype, no two elements at one address (a stride 0)."""
    return (
        target.device.type == "cpu"
        and target.dtype == dtype
        and not target.is_conj()
        and not target.is_neg()
        and all(st > 0 or n <= 1 for n, st in zip(target.shape, target.stride()))
    )
