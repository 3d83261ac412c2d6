"""cairn's storage backends for ``torch.distributed.checkpoint`` (DCP).

``Writer`` and ``Reader`` implement DCP's ``StorageWriter`` / ``StorageReader``
on top of the C++ engine::

    import torch.distributed.checkpoint as dcp, cairn
    dcp.save(state_dict, storage_writer=cairn.Writer("/ckpt/step_100"))
    dcp.load(state_dict, storage_reader=cairn.Reader("/ckpt/step_100"))

Saving: every rank writes one data file, ``data/r<rank>.bin``, holding the raw
bytes of the items DCP's planner assigned to it (replicated tensors are
deduplicated by the planner, so each is written once), in parallel and
checksummed, then fsyncs it. The coordinator's ``finish`` turns DCP's
``Metadata`` into a cairn manifest (JSON inside a checksummed binary envelope,
never pickle) and commits it last. See docs/format.md.

Loading: ``Reader`` opens and validates the manifest and checks every data
file's size when it is created (or reset to a new path), so a missing
checkpoint raises :class:`cairn.NotFoundError` and a damaged manifest or a
missing/truncated data file raises :class:`cairn.CorruptionError` directly.
``read_data`` reads every item of the rank's plan in one parallel C++ call,
straight into the destination tensors when they are contiguous CPU tensors
covering a whole stored chunk, verifying checksums on the way. A checksum
mismatch found during ``dcp.load`` surfaces, as DCP does for every storage
error in a collective step, inside a ``CheckpointException`` whose
``failures`` hold the :class:`cairn.CorruptionError`.

A path without a cairn manifest that holds a checkpoint written by stock
``dcp.save`` (filesystem writer) is read through ``cairn._stock_reader.StockReader``.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import shutil
import uuid
from typing import Any, Sequence

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from cairn import _ext, _pools
from cairn.errors import (
    CorruptionError,
    Error,
    InvalidArgumentError,
    NotFoundError,
    PreconditionError,
)

from cairn._dcp_metadata import (
    Item,
    Location,
    dtype_name,
    manifest_from_metadata,
    metadata_from_manifest,
    manifest_extra,
)
from cairn._stock_reader import StockReader, check_value_is_safe, is_stock_checkpoint


__all__ = ["Writer", "Reader", "unwrap"]


# ---- helpers ----------------------------------------------------------------


def unwrap(exc: BaseException) -> BaseException:
    """The error a rank raised inside a DCP collective step.

    DCP reports every storage error of ``dcp.save``/``dcp.load`` steps as a
    ``CheckpointException`` holding each failing rank's exception. This returns
    the lowest failing rank's exception (e.g. a :class:`cairn.CorruptionError`
    naming the file and tensor), or ``exc`` itself when it is not a
    ``CheckpointException``::

        try:
            dcp.load(state, storage_reader=cairn.Reader(path))
        except BaseException as e:
            if isinstance(cairn.dcp.unwrap(e), cairn.CorruptionError): ...
    """
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException) and exc.failures:
        first = exc.failures[min(exc.failures)]
        return first[0] if isinstance(first, tuple) else first
    return exc



def _uri(path: str | os.PathLike | None) -> str:
    """The storage URI of a checkpoint path: a directory, file://DIR, shm://NAME
    or s3://BUCKET/PREFIX."""
    if path is None:
        raise InvalidArgumentError(
            "no checkpoint path: pass one to cairn.Writer/Reader or as checkpoint_id"
        )
    s = os.fspath(path)
    if not isinstance(s, str) or not s:
        raise InvalidArgumentError(f"invalid checkpoint path {path!r}")
    if "://" in s and not s.startswith(("file://", "shm://", "fault://", "s3://")):
        raise InvalidArgumentError(f"unsupported checkpoint URI scheme: {s}")
    return s


def _staging_dir(path: str | os.PathLike) -> str:
    """A local staging directory: a plain path or file://PATH, made absolute."""
    s = os.fspath(path)
    if not isinstance(s, str) or not s:
        raise InvalidArgumentError(f"invalid staging_dir {path!r}")
    local = _ext.local_dir_of_uri(s)
    if not local:
        raise InvalidArgumentError(
            f"staging_dir must be a local directory (a fast local disk), got {s}"
        )
    return os.path.abspath(local)


def _local_path(uri: str) -> str | None:
    """The local directory of the storage at ``uri`` (the engine parses the
    URI), or None when it has none (s3)."""
    return _ext.local_dir_of_uri(uri) or None


def _io_pool(thread_count: int | None) -> _ext.ThreadPool:
    """A Writer's or Reader's I/O pool: its own when it was given a thread_count,
    else the process-wide one (cairn._pools)."""
    return _ext.ThreadPool(thread_count) if thread_count else _pools.io_pool()


def _check_serialization_format(fmt: Any) -> None:
    """Accepts FileSystemWriter's default SerializationFormat.TORCH_SAVE only."""
    if fmt != SerializationFormat.TORCH_SAVE:
        raise InvalidArgumentError(
            f"cairn.Writer cannot write serialization_format={fmt!r}: its data files hold raw "
            "tensor bytes described by the cairn manifest (docs/format.md); use "
            "SerializationFormat.TORCH_SAVE (the default) or keep FileSystemWriter"
        )


# ---- non-tensor values: a native encoding -------------------------------------------
#
# DCP's planner hands a storage writer every non-tensor value as torch.save (pickle)
# bytes, and loads them back with torch.load(weights_only=False). cairn stores a
# value made only of None, bool, int, float, str, bytes, lists, tuples, dicts and
# NumPy arrays/scalars (e.g. the RNG dict {"python": random.getstate(), "numpy":
# np.random.get_state(), ...}) natively instead: VALUE_MAGIC, then UTF-8 JSON with
# tagged tuples, dicts, bytes and arrays (dtype, shape, base64 of the raw bytes).
# Loading it needs no unpickler at all; any other value keeps DCP's pickle bytes,
# checked by the safe unpickler on load (cairn._stock_reader.check_value_is_safe).

VALUE_MAGIC = b"\x00cairn-value-v1\n"


class _NotNative(Exception):
    pass


def _value_to_json(v: Any) -> Any:
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int) and type(v) is int:
        return v
    if isinstance(v, float) and type(v) is float:
        return v if v == v and v not in (float("inf"), float("-inf")) else {"__float__": repr(v)}
    if type(v) is list:
        return [_value_to_json(x) for x in v]
    if type(v) is tuple:
        return {"__tuple__": [_value_to_json(x) for x in v]}
    if type(v) is dict:
        return {"__dict__": [[_value_to_json(k), _value_to_json(x)] for k, x in v.items()]}
    if type(v) is bytes:
        return {"__bytes__": base64.b64encode(v).decode()}
    if isinstance(v, (np.ndarray, np.generic)) and type(v) in (np.ndarray,) + tuple(
            np.sctypeDict.values()):
        a = np.asarray(v)
        if a.dtype.hasobject or a.dtype.fields is not None:
            raise _NotNative
        tag = "__ndarray__" if isinstance(v, np.ndarray) else "__npscalar__"
        return {tag: {"dtype": a.dtype.str, "shape": list(a.shape),
                      "data": base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()}}
    raise _NotNative


def encode_value(value: Any) -> bytes | None:
    """The native encoding of a non-tensor value, or None when it holds a type the
    encoding does not cover (it is then stored as DCP's pickle bytes)."""
    try:
        body = json.dumps(_value_to_json(value), separators=(",", ":"), allow_nan=False)
    except (_NotNative, ValueError, TypeError, RecursionError):
        return None
    return VALUE_MAGIC + body.encode()


def _value_from_json(v: Any, where: str) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_value_from_json(x, where) for x in v]
    if not isinstance(v, dict) or len(v) != 1:
        raise CorruptionError(f"{where}: malformed stored value")
    (tag, body), = v.items()
    if tag == "__tuple__" and isinstance(body, list):
        return tuple(_value_from_json(x, where) for x in body)
    if tag == "__dict__" and isinstance(body, list):
        out = {}
        for pair in body:
            if not isinstance(pair, list) or len(pair) != 2:
                raise CorruptionError(f"{where}: malformed stored dict")
            key = _value_from_json(pair[0], where)
            if isinstance(key, (list, dict)):
                raise CorruptionError(f"{where}: unhashable key in a stored dict")
            out[key] = _value_from_json(pair[1], where)
        return out
    if tag == "__float__" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "__bytes__" and isinstance(body, str):
        return base64.b64decode(body, validate=True)
    if tag in ("__ndarray__", "__npscalar__") and isinstance(body, dict):
        try:
            dtype = np.dtype(str(body["dtype"]))
            shape = tuple(int(n) for n in body["shape"])
            raw = base64.b64decode(body["data"], validate=True)
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptionError(f"{where}: malformed stored array ({e})") from None
        if dtype.hasobject or dtype.fields is not None or any(n < 0 for n in shape) or (
                int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != len(raw)):
            raise CorruptionError(f"{where}: malformed stored array")
        a = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
        return a if tag == "__ndarray__" else a[()]
    raise CorruptionError(f"{where}: malformed stored value")


def decode_value(data: bytes, where: str) -> Any:
    """The value stored by encode_value (never unpickles)."""
    try:
        body = json.loads(data[len(VALUE_MAGIC):].decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptionError(f"{where}: malformed stored value ({e})") from None
    try:
        return _value_from_json(body, where)
    except RecursionError:
        raise CorruptionError(f"{where}: stored value nested too deeply") from None


def value_bytes(planner: SavePlanner, item: Any) -> Any:
    """What a writer stores for the BYTE_IO write `item`: the native encoding of
    its value where it has one, else the planner's pickle bytes."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is not None:
        try:
            native = encode_value(lookup(item.index))
        except Exception:  # noqa: BLE001 - a planner without the object: pickle bytes
            native = None
        if native is not None:
            return native
    data = planner.resolve_data(item)
    return data.getbuffer() if isinstance(data, io.BytesIO) else data


def load_value_bytes(planner: LoadPlanner, ri: Any, data: bytes, where: str,
                     allow_pickle: bool) -> None:
    """Hands a stored non-tensor value to the planner (which torch.loads what it
    gets): a native value is decoded and re-pickled here, from types the decoder
    alone produced; pickle bytes must pass the safe unpickler first."""
    if data.startswith(VALUE_MAGIC):
        buf = io.BytesIO()
        torch.save(decode_value(data, where), buf)
        buf.seek(0)
        planner.load_bytes(ri, buf)
        return
    if not allow_pickle:
        check_value_is_safe(data, where)
    planner.load_bytes(ri, io.BytesIO(data))


@dataclasses.dataclass(frozen=True)
class _RankFile:
    """SavePlan.storage_data: the data file a rank writes."""

    key: str


# ---- Writer -----------------------------------------------------------------


class Writer(StorageWriter):
    """A DCP ``StorageWriter`` that writes a cairn checkpoint to ``path``.

    The positional and keyword arguments up to ``serialization_format`` are
    those of DCP's ``FileSystemWriter``, in its order, so
    ``FileSystemWriter(path, ...)`` becomes ``cairn.Writer(path, ...)``
    (README, "Migrating from FileSystemWriter/FileSystemReader").

    Args:
        path: checkpoint directory, ``file://DIR``, ``shm://NAME`` or
            ``s3://BUCKET/PREFIX`` (configured as the AWS tools are). May be
            omitted when ``dcp.save`` is given ``checkpoint_id``.
        single_file_per_rank: accepted, either value: cairn always writes one
            data file per rank (by many threads in parallel), so False, which
            makes FileSystemWriter write a file per item, changes nothing.
        sync_files: fsync every data file before the commit (turn off only
            for tiers that need no durability, e.g. shared memory); the
            manifest's commit is always durable (docs/format.md). ``sync``, cairn's
            older name for it, wins when given.
        thread_count: I/O threads of this writer's own pool (default: the
            process-wide pool, 16 to 32 threads).
        per_thread_copy_ahead: accepted, no effect: cairn copies a rank's
            device tensors to host memory before writing them.
        cache_staged_state_dict: must be False: cairn.Writer is not a
            ``dcp.async_save`` stager. For staging buffers reused across
            saves pass ``async_stager=cairn.SharedMemoryStager()``.
        overwrite: replace a committed checkpoint at ``path`` (True, the
            default, as FileSystemWriter's), or refuse it with
            :class:`cairn.errors.PreconditionError` (a ``RuntimeError``)
            naming it, before anything there is touched (False). A partial,
            uncommitted save at ``path`` is no checkpoint and is replaced.
        _extensions: must be empty: cairn does not apply stream transforms
            (e.g. DCP's ZStandard), it writes raw, checksummed bytes.
        serialization_format: must be ``SerializationFormat.TORCH_SAVE`` (the
            default): cairn's data files hold raw tensor bytes described by
            its manifest (docs/format.md); SAFETENSORS files are not written.
        direct_io: write with O_DIRECT where the filesystem allows it.
        block_size: checksum block size in bytes.
        user_metadata: a JSON-serializable dict stored in the manifest
            (``extra.user``); read it back with ``Reader.user_metadata``.
        staging_dir: a fast local directory (NVMe) for targets that are slow
            (a FUSE/NFS mount, ``s3://``). Each rank writes its data file
            there first, then uploads it to ``path`` in parallel ranges and
            removes the staged copy; the manifest is committed only after
            every rank's upload is complete (and synced) at the target.
            Under ``dcp.async_save`` the upload is part of the background
            work. Loads are unaffected (they read the target with large
            parallel reads).

    Raises :class:`cairn.InvalidArgumentError` (a ``ValueError``) for a value
    cairn cannot honour, never ignoring it.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int | None = None,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
        *,
        sync: bool | None = None,
        direct_io: bool = True,
        block_size: int = _ext.DEFAULT_BLOCK_SIZE,
        user_metadata: dict | None = None,
        staging_dir: str | os.PathLike | None = None,
    ) -> None:
        super().__init__()
        self.path = None if path is None else _uri(path)
        self.staging_dir = None if staging_dir is None else _staging_dir(staging_dir)
        self.user_metadata = dict(user_metadata or {})
        json.dumps(self.user_metadata)  # fail early if it cannot be stored
        if thread_count is not None and (type(thread_count) is not int or thread_count < 1):
            raise InvalidArgumentError(f"thread_count must be a positive int, got {thread_count!r}")
        if type(per_thread_copy_ahead) is not int or per_thread_copy_ahead < 0:
            raise InvalidArgumentError(
                f"per_thread_copy_ahead must be a non-negative int, got {per_thread_copy_ahead!r}"
            )
        if cache_staged_state_dict:
            raise InvalidArgumentError(
                "cairn.Writer does not stage for dcp.async_save, so cache_staged_state_dict=True "
                "cannot be honoured; pass async_stager=cairn.SharedMemoryStager() to "
                "dcp.async_save for staging buffers reused across saves"
            )
        if _extensions:
            names = [type(e).__name__ for e in _extensions]
            raise InvalidArgumentError(
                f"cairn.Writer does not support stream _extensions ({', '.join(names)}): it "
                "writes raw, checksummed bytes that loads read straight into tensors; "
                "drop _extensions (or keep FileSystemWriter for compressed checkpoints)"
            )
        _check_serialization_format(serialization_format)
        self.single_file_per_rank = bool(single_file_per_rank)
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.overwrite = bool(overwrite)
        self.thread_count = thread_count or _pools.thread_count("io")
        self._own_threads = thread_count
        self.direct_io = direct_io
        self.sync = bool(sync_files if sync is None else sync)
        self.block_size = block_size
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self.rank = 0
        self._pool: _ext.ThreadPool | None = None

    @property
    def sync_files(self) -> bool:
        return self.sync

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = _uri(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        _uri(self.path)
        rank = kwargs.get("rank")
        if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        self.rank = int(rank or 0)
        if kwargs.get("use_collectives") is False:
            # Without coordination every rank would name its file r0.bin and
            # commit a manifest of its own items: refuse rather than corrupt.
            raise InvalidArgumentError(
                "cairn.Writer needs dcp.save(..., use_collectives=True): a cairn checkpoint "
                "has one manifest for all ranks"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator before any rank writes (DCP scatters the
        # plans afterwards): an old manifest in the directory must go first,
        # or it would "commit" half-new data; old data files go too. With
        # overwrite=False a committed checkpoint is refused before that.
        uri = _uri(self.path)
        if not self.overwrite and _ext.has_manifest(uri):
            raise PreconditionError(
                f"a committed checkpoint already exists at {self.path} and "
                "cairn.Writer(overwrite=False) refuses to replace it"
            )
        _ext.uncommit(uri, clear_data=True)
        return [
            dataclasses.replace(plan, storage_data=_RankFile(_ext.data_file_key(rank)))
            for rank, plan in enumerate(plans)
        ]

    def _thread_pool(self) -> _ext.ThreadPool:
        if self._pool is None:
            self._pool = _io_pool(self._own_threads)
        return self._pool

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut: Future[list[WriteResult]] = Future()
        if not plan.items:
            fut.set_result([])
            return fut
        if isinstance(plan.storage_data, _RankFile):
            key = plan.storage_data.key
        else:  # a planner that dropped our storage_data: fall back to the rank
            key = _ext.data_file_key(self.rank)
        keep_alive: list[Any] = []
        buffers: list[tuple[int, int]] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                arr = np.frombuffer(value_bytes(planner, item), dtype=np.uint8)
                keep_alive.append(arr)
                buffers.append((arr.ctypes.data, arr.nbytes))
            else:
                t = planner.resolve_data(item).detach()
                dtype_name(t.dtype)  # refuse unstorable dtypes before writing anything
                if t.device.type != "cpu":
                    t = t.cpu()
                t = t.contiguous()
                keep_alive.append(t)
                buffers.append((t.data_ptr(), t.numel() * t.element_size()))
        if self.staging_dir is None:
            file_size, locations = _ext.write_data_file(
                _uri(self.path),
                key,
                buffers,
                self._thread_pool(),
                direct_io=self.direct_io,
                sync=self.sync,
                block_size=self.block_size,
            )
        else:
            file_size, locations = self._write_staged(key, buffers)
        del keep_alive
        results = [
            WriteResult(
                index=item.index,
                size_in_bytes=length,
                storage_data=Location(key, file_size, offset, length, tuple(sums)),
            )
            for item, (offset, length, sums) in zip(plan.items, locations)
        ]
        fut.set_result(results)
        return fut

    def _write_staged(self, key: str, buffers: list[tuple[int, int]]):
        """Writes the rank's data file into the staging directory (page cache, no
        fsync: it is a transient copy) and uploads it to the target while it is
        being written: each range goes up as soon as it is complete locally, on
        the upload pool (synced at the target when ``sync_files``). The staged
        copy is removed whatever happened."""
        local = os.path.join(self.staging_dir, f"cairn-{self.save_id}-r{self.rank}")
        try:
            return _ext.write_data_file_staged(
                local, _uri(self.path), key, buffers, self._thread_pool(),
                _pools.upload_pool(), direct_io=self.direct_io, sync=self.sync,
                block_size=self.block_size,
            )
        finally:
            shutil.rmtree(local, ignore_errors=True)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        extra = {"save_id": self.save_id, "path": self.path, "user": self.user_metadata}
        manifest = manifest_from_metadata(metadata, results, self.block_size, extra)
        _ext.commit_manifest(_uri(self.path), manifest)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            _uri(checkpoint_id)
        except (InvalidArgumentError, TypeError):
            return False
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)


# ---- Reader -----------------------------------------------------------------


def _byte_range(
    offsets: tuple[int, ...], lengths: tuple[int, ...], sizes: tuple[int, ...], itemsize: int
) -> tuple[int, int] | None:
    """The (byte offset, nbytes) of the box ``offsets + lengths`` inside a
    row-major chunk of shape ``sizes`` when that box is one contiguous byte
    range (e.g. whole rows: FSDP-style Shard(0) resharding), else None."""
    if len(offsets) != len(sizes) or len(lengths) != len(sizes):
        raise InvalidArgumentError("read item and stored chunk differ in rank")
    for o, n, s in zip(offsets, lengths, sizes):
        if o < 0 or n < 0 or o + n > s:
            raise InvalidArgumentError(f"read region {offsets}+{lengths} outside chunk {sizes}")
    if any(n == 0 for n in lengths):
        return 0, 0
    partial = [d for d in range(len(sizes)) if lengths[d] != sizes[d]]
    last = partial[-1] if partial else -1
    if any(lengths[d] != 1 for d in range(last)):
        return None
    linear = 0
    for o, s in zip(offsets, sizes):
        linear = linear * s + o
    numel = 1
    for n in lengths:
        numel *= n
    return linear * itemsize, numel * itemsize



@dataclasses.dataclass
class InPlaceLoad:
    """Reader.plan_in_place's plan: engine read requests and where values go."""

    state_dict: dict[str, Any]
    keys: list[str]
    stateful_sd: dict[str, Any]
    mappings: dict[str, Any]
    requests: list[tuple[int, int, int, int, int, int]]
    values: list[tuple[str, np.ndarray]]


class Reader(StorageReader):
    """A DCP ``StorageReader`` for cairn checkpoints (and stock DCP ones).

    ``path`` and ``_extension_registry`` are FileSystemReader's arguments, in
    its order, so ``FileSystemReader(path, ...)`` becomes
    ``cairn.Reader(path, ...)``.

    Args:
        path: checkpoint directory, ``file://DIR``, ``shm://NAME`` or
            ``s3://BUCKET/PREFIX`` (configured as the AWS tools are). May be
            omitted when ``dcp.load`` is given ``checkpoint_id``.
        _extension_registry: accepted, never needed: cairn checkpoints carry
            no stream transforms (``cairn.Writer`` refuses ``_extensions``),
            and a stock checkpoint saved with ``_extensions`` (e.g. ZStandard)
            is refused with :class:`cairn.InvalidArgumentError` naming the
            item, whatever the registry.
        thread_count: I/O threads of this reader's own pool (default: the
            process-wide pool, 16 to 32 threads).
        allow_pickle: load non-tensor values that need unrestricted unpickling.
            By default each must decode with ``torch.load(weights_only=True)``
            plus cairn's allowlist ``cairn._stock_reader.SAFE_VALUE_GLOBALS``
            (numbers, strings, containers, tensors, ``io.BytesIO``, optimizer
            ``param_groups``, LR scheduler states), and any other value is
            refused with :class:`cairn.CorruptionError`: DCP's planner would
            otherwise unpickle it with ``weights_only=False``, so a hostile
            checkpoint could run code. Pass True only for trusted checkpoints.

    Raises (from the constructor or ``reset``): :class:`cairn.NotFoundError`
    when there is no committed checkpoint at ``path``;
    :class:`cairn.CorruptionError` when its manifest is damaged or a data file
    is missing or truncated.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        _extension_registry: Any = None,
        *,
        thread_count: int | None = None,
        allow_pickle: bool = False,
    ) -> None:
        super().__init__()
        self.path: str | None = None
        self._extension_registry = _extension_registry
        self.thread_count = thread_count or _pools.thread_count("io")
        self._own_threads = thread_count
        # DCP's planner unpickles non-tensor values with weights_only=False: a
        # hostile checkpoint could run code through one. Unless the caller trusts
        # the checkpoint, every value must first decode with weights_only=True.
        self.allow_pickle = allow_pickle
        self.load_id = uuid.uuid4().hex
        self._pool: _ext.ThreadPool | None = None
        self._reader: _ext.CheckpointReader | None = None
        self._stock: StorageReader | None = None
        self._metadata: Metadata | None = None
        self._items: dict[MetadataIndex, Item] = {}
        self._user_metadata: dict = {}
        if path is not None:
            self._open(_uri(path))

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    @property
    def user_metadata(self) -> dict:
        """The ``user_metadata`` the checkpoint was saved with ({} if none)."""
        return dict(self._user_metadata)

    @classmethod
    def _of_engine_reader(cls, uri: str, engine: _ext.CheckpointReader) -> "Reader":
        """A Reader of `uri` over an engine reader already open on it (the manager
        opened it to list its memory tier), so the manifest is not read twice."""
        reader = cls()
        reader._open(uri, engine)
        return reader

    def _open(self, uri: str, engine: _ext.CheckpointReader | None = None) -> None:
        self.path = uri
        self._reader = None
        self._stock = None
        self._metadata = None
        self._items = {}
        try:
            self._reader = engine if engine is not None else _ext.CheckpointReader(uri)
        except NotFoundError:
            local = _local_path(uri)
            if (
                not _ext.has_manifest(uri)
                and local is not None
                and is_stock_checkpoint(local)
            ):
                self._stock = StockReader(local, allow_pickle=self.allow_pickle)
                # Validated now, not lazily inside dcp.load: DCP reports a
                # failed read_metadata as a bare AssertionError. Saved without
                # collectives, a checkpoint has only rank-local metadata: check
                # this rank's (DCP asks for it once the global one is missing).
                try:
                    self._metadata = self._stock.read_metadata()
                except NotFoundError:
                    td = torch.distributed
                    rank = td.get_rank() if td.is_available() and td.is_initialized() else 0
                    try:
                        self._stock.read_metadata(rank=rank)
                    except NotFoundError:
                        pass
                return
            raise
        try:
            # The engine validated the manifest (extra.dcp included); anything
            # that still fails to convert is a damaged manifest, not a bug.
            manifest = self._reader.manifest()
            self._metadata, self._items = metadata_from_manifest(manifest)
        except Error as e:
            if uri in str(e):
                raise
            raise type(e)(f"{uri}: {e}") from e
        except Exception as e:  # noqa: BLE001 - untrusted input
            raise CorruptionError(f"{uri}: malformed manifest ({e!r})") from e
        user = manifest_extra(manifest).get("user", {})
        self._user_metadata = user if isinstance(user, dict) else {}

    def close(self) -> None:
        """Releases the open data files (the reader reopens on next use)."""
        self._reader = None
        self._metadata = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.load_id = uuid.uuid4().hex
        if checkpoint_id is not None:
            self._open(_uri(checkpoint_id))
        elif self._stock is not None:
            self._stock.reset()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._stock is not None:
            if self._metadata is not None and kwargs.get("rank") is None:
                return self._metadata  # read and validated when opened
            return self._stock.read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._open(_uri(self.path))
        assert self._metadata is not None
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._stock is not None:
            self._stock.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            return
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self._stock is not None:
            return self._stock.prepare_local_plan(plan)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if self._stock is not None:
            return self._stock.prepare_global_plan(plans)
        return plans

    def _thread_pool(self) -> _ext.ThreadPool:
        if self._pool is None:
            self._pool = _io_pool(self._own_threads)
        return self._pool

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._stock is not None:
            return self._stock.read_data(plan, planner)
        if self._reader is None:
            self._open(_uri(self.path))
        assert self._reader is not None
        # (kind, item index, chunk index, address, nbytes, byte offset in item)
        requests: list[tuple[int, int, int, int, int, int]] = []
        in_place: list[tuple[Any, torch.Tensor]] = []
        # Read into scratch memory, then copied: (read item, destination, source view).
        copies: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        whole_chunks: dict[tuple[int, int], torch.Tensor] = {}
        byte_reads: list[tuple[Any, np.ndarray]] = []
        for ri in plan.items:
            item = self._items.get(ri.storage_index)
            if item is None:
                raise InvalidArgumentError(
                    f"{ri.storage_index.fqn!r} at {ri.storage_index.offset} "
                    f"is not in the checkpoint at {self.path}"
                )
            if ri.type == LoadItemType.BYTE_IO:
                buf = np.empty(item.length, dtype=np.uint8)
                requests.append((1, item.index, 0, buf.ctypes.data, item.length, 0))
                byte_reads.append((ri, buf))
                continue
            meta_tensor = self._metadata.state_dict_metadata[ri.storage_index.fqn]
            dtype = meta_tensor.properties.dtype
            sizes = tuple(meta_tensor.chunks[item.chunk].sizes)
            lengths = tuple(ri.lengths)
            dest = planner.resolve_tensor(ri).detach()
            if tuple(dest.shape) != lengths:
                raise InvalidArgumentError(
                    f"{ri.dest_index.fqn!r}: destination of shape {tuple(dest.shape)} for a "
                    f"stored region of shape {lengths}"
                )
            region = _byte_range(tuple(ri.storage_offsets), lengths, sizes, dtype.itemsize)
            if region is not None:
                offset, nbytes = region
                if nbytes == 0:
                    in_place.append((ri, dest))
                elif dest.device.type == "cpu" and dest.dtype == dtype and dest.is_contiguous():
                    # The common case: straight into the destination's memory.
                    requests.append((0, item.index, item.chunk, dest.data_ptr(), nbytes, offset))
                    in_place.append((ri, dest))
                else:
                    tmp = torch.empty(lengths, dtype=dtype)
                    requests.append((0, item.index, item.chunk, tmp.data_ptr(), nbytes, offset))
                    copies.append((ri, dest, tmp))
                continue
            # A non-contiguous region of a stored chunk: read the chunk once
            # (shared by every item of this call that needs it) and narrow.
            key = (item.index, item.chunk)
            tmp = whole_chunks.get(key)
            if tmp is None:
                tmp = whole_chunks[key] = torch.empty(sizes, dtype=dtype)
                requests.append(
                    (0, item.index, item.chunk, tmp.data_ptr(), tmp.numel() * dtype.itemsize, 0)
                )
            src = tmp
            for dim, (off, length) in enumerate(zip(ri.storage_offsets, lengths)):
                src = src.narrow(dim, off, length)
            copies.append((ri, dest, src))

        self._reader.read(requests, self._thread_pool())

        for ri, buf in byte_reads:
            load_value_bytes(planner, ri, buf.tobytes(),
                             f"{self.path}: value '{ri.storage_index.fqn}'", self.allow_pickle)
        for ri, dest in in_place:
            planner.commit_tensor(ri, dest)
        for ri, dest, src in copies:
            dest.copy_(src)
            planner.commit_tensor(ri, dest)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # ---- in-place load without DCP's planner (CheckpointManager.restore) ----------

    def plan_in_place(self, state_dict: dict[str, Any]) -> "InPlaceLoad | None":
        """A plan to load `state_dict` as ``dcp.load(state_dict, storage_reader=self)``
        does, when every value can be loaded in place without DCP's planner: each
        tensor a plain contiguous CPU tensor whose stored tensor is one chunk of its
        exact shape and dtype (no resharding), each other value a stored value. None
        when anything else is asked (DTensor, resharding, a key missing from the
        checkpoint, ...): then use dcp.load, which handles (or reports) it. Reads
        nothing; Statefuls' ``state_dict()`` is called, as dcp.load does."""
        if self._stock is not None:
            return None
        if self._reader is None:
            self._open(_uri(self.path))
        assert self._metadata is not None
        keys = sorted(state_dict.keys())
        stateful_sd = {}
        for k in keys:
            elem = state_dict[k]
            stateful_sd[k] = elem.state_dict() if isinstance(elem, Stateful) else elem
        flat, mappings = flatten_state_dict(stateful_sd)
        md = self._metadata.state_dict_metadata
        missing = md.keys() - flat.keys()
        if missing:
            # DCP re-flattens the old (torch <= 2.3) way when that explains the
            # missing keys (DefaultLoadPlanner.create_local_plan): leave it to DCP.
            _version._derived_version = "2_3"
            try:
                old, _ = flatten_state_dict(stateful_sd)
            finally:
                _version._derived_version = None
            if old.keys() & missing:
                return None
        requests: list[tuple[int, int, int, int, int, int]] = []
        values: list[tuple[str, np.ndarray]] = []
        for fqn, v in flat.items():
            m = md.get(fqn)
            if m is None:
                return None  # DCP raises its own "missing key" error
            if isinstance(v, torch.Tensor):
                if type(v) not in (torch.Tensor, torch.nn.Parameter):
                    return None  # DTensor, ShardedTensor, other subclasses
                if not isinstance(m, TensorStorageMetadata) or len(m.chunks) != 1:
                    return None
                chunk = m.chunks[0]
                shape = tuple(v.shape)
                if (tuple(m.size) != shape or tuple(chunk.sizes) != shape
                        or any(chunk.offsets) or v.device.type != "cpu"
                        or v.dtype != m.properties.dtype or not v.is_contiguous()):
                    return None
                item = self._items.get(MetadataIndex(fqn, chunk.offsets))
                nbytes = v.numel() * v.element_size()
                if item is None or item.kind != 0 or item.length != nbytes:
                    return None
                if nbytes:
                    requests.append((0, item.index, item.chunk, v.data_ptr(), nbytes, 0))
                continue
            if not isinstance(m, BytesStorageMetadata):
                return None
            item = self._items.get(MetadataIndex(fqn))
            if item is None or item.kind != 1:
                return None
            buf = np.empty(item.length, dtype=np.uint8)
            requests.append((1, item.index, 0, buf.ctypes.data, item.length, 0))
            values.append((fqn, buf))
        return InPlaceLoad(state_dict, keys, stateful_sd, mappings, requests, values)

    def load_in_place(self, plan: "InPlaceLoad") -> None:
        """Carries out plan_in_place's plan: every tensor and value is read, verified,
        in one engine call (in parallel, each block hashed as it is copied), straight
        into the state's tensors; values are decoded as read_data does, Statefuls get
        ``load_state_dict``. A corrupt byte raises CorruptionError naming the file and
        tensor; the state's contents are then unspecified."""
        assert self._reader is not None
        self._reader.read(plan.requests, self._thread_pool())
        for fqn, buf in plan.values:
            data = buf.tobytes()
            where = f"{self.path}: value '{fqn}'"
            if data.startswith(VALUE_MAGIC):
                value = decode_value(data, where)
            else:
                if not self.allow_pickle:
                    check_value_is_safe(data, where)
                value = torch.load(io.BytesIO(data), weights_only=False)
            set_element(plan.stateful_sd, plan.mappings[fqn], value)
        for k in plan.keys:
            elem = plan.state_dict[k]
            if isinstance(elem, Stateful):
                elem.load_state_dict(plan.stateful_sd[k])
            else:
                plan.state_dict[k] = plan.stateful_sd[k]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return Writer.validate_checkpoint_id(checkpoint_id)
