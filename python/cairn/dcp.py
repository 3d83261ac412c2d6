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

import dataclasses
import io
import json
import os
import uuid
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import (
    Metadata,
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
    Location,
    dtype_name,
    manifest_from_metadata,
    metadata_from_manifest,
    manifest_extra,
)
from cairn._stock_reader import StockReader, check_value_is_safe, is_stock_checkpoint
from cairn.discovery import open_path


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



def _uri(path: "str | os.PathLike | _ext.Storage | None") -> str:
    """The storage URI of a checkpoint path: a directory, file://DIR, shm://NAME
    or s3://BUCKET/PREFIX (the scheme checked by the engine's registry), or the
    URI an open storage was opened from."""
    if isinstance(path, _ext.Storage):
        return path.uri
    if path is None:
        raise InvalidArgumentError(
            "no checkpoint path: pass one to cairn.Writer/Reader or as checkpoint_id"
        )
    s = os.fspath(path)
    if not isinstance(s, str):
        raise InvalidArgumentError(f"invalid checkpoint path {path!r}")
    return _ext.check_checkpoint_uri(s)


def _open_storage(path: "str | os.PathLike | _ext.Storage", create: bool) -> _ext.Storage:
    """The storage of a checkpoint path, opened once by the engine's registry (a
    Storage given instead, e.g. a fault-injecting wrapper, is used as it is).
    Without `create`, a missing directory is cairn.NotFoundError "no such
    checkpoint"."""
    return open_path(path if isinstance(path, _ext.Storage) else _uri(path), "checkpoint", create)


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
# NumPy arrays/scalars (e.g. the RNG dict) natively instead: VALUE_MAGIC, then tagged
# UTF-8 JSON (docs/format.md), encoded and decoded by the engine
# (include/cairn/value_codec.h); loading it needs no unpickler at all. Any other value
# keeps DCP's pickle bytes, checked by the safe unpickler on load.

VALUE_MAGIC = _ext.VALUE_MAGIC
encode_value = _ext.encode_value  # (value) -> bytes | None: None = not native
decode_value = _ext.decode_value  # (data, where) -> value; CorruptionError naming where


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
        # The target, opened once per save (on first use) and passed to every engine
        # call; a Storage given as `path` is used as it is, for every save.
        self._given: _ext.Storage | None = path if isinstance(path, _ext.Storage) else None
        self._storage = self._given
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
            self._given = checkpoint_id if isinstance(checkpoint_id, _ext.Storage) else None
            self._storage = self._given
        self.save_id = uuid.uuid4().hex

    def _target(self) -> _ext.Storage:
        """The checkpoint's storage, opened (and created) once per save."""
        if self._storage is None:
            self._storage = _open_storage(self.path, create=True)
        return self._storage

    def __getstate__(self) -> dict:
        # A process-based async save pickles the writer: its open storage and
        # pool stay behind (the copy reopens them); a Storage object given as
        # the path cannot cross a process.
        if self._given is not None:
            raise InvalidArgumentError("a cairn.Writer over an open Storage cannot be pickled")
        state = dict(self.__dict__)
        state["_storage"] = None
        state["_pool"] = None
        return state

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        _uri(self.path)
        # A new save opens its target afresh: a directory removed and made again
        # between two saves of one Writer is followed, as its path is.
        self._storage = self._given
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
        target = self._target()
        if not self.overwrite and _ext.has_manifest(target):
            raise PreconditionError(
                f"a committed checkpoint already exists at {self.path} and "
                "cairn.Writer(overwrite=False) refuses to replace it"
            )
        _ext.uncommit(target, clear_data=True)
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
                self._target(),
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
        return _ext.write_data_file_staged(  # removes the staged copy, also on failure
            os.path.join(self.staging_dir, f"cairn-{self.save_id}-r{self.rank}"),
            self._target(), key, buffers, self._thread_pool(), _pools.upload_pool(),
            direct_io=self.direct_io, sync=self.sync, block_size=self.block_size,
        )

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        extra = {"save_id": self.save_id, "path": self.path, "user": self.user_metadata}
        manifest = manifest_from_metadata(metadata, results, self.block_size, extra)
        _ext.commit_manifest(self._target(), manifest)

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


# (offsets, lengths, sizes, itemsize) -> (byte offset, nbytes) of a box of a stored
# chunk when it is one contiguous byte range, else None (include/cairn/read_plan.h).
_byte_range = _ext.chunk_byte_range


@dataclasses.dataclass
class InPlaceLoad:
    """Reader.plan_in_place's plan: engine read requests and where values go."""

    state_dict: dict[str, Any]
    keys: list[str]
    stateful_sd: dict[str, Any]
    mappings: dict[str, Any]
    engine: _ext.InPlacePlan  # the reads (tensors straight into their memory)
    values: list[str]  # fqns of the non-tensor values, in the order the engine reads them


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
        self._metadata: Metadata | None = None  # _dcp_metadata()
        self._user_metadata: dict | None = {}  # None: not converted yet
        self._storage: _ext.Storage | None = None  # opened once per path
        self._dir = ""  # the checkpoint's directory in it
        if path is not None:
            self._open(path)

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    @property
    def user_metadata(self) -> dict:
        """The ``user_metadata`` the checkpoint was saved with ({} if none)."""
        if self._user_metadata is None:
            user = self._converted(manifest_extra).get("user", {})
            self._user_metadata = user if isinstance(user, dict) else {}
        return dict(self._user_metadata)

    @classmethod
    def _of_engine_reader(cls, uri: str, engine: _ext.CheckpointReader) -> "Reader":
        """A Reader of `uri` over an engine reader already open on it (the manager
        opened it to list its memory tier), so the manifest is not read twice."""
        reader = cls()
        reader._open(uri, engine=engine)
        return reader

    @classmethod
    def _in(cls, storage: _ext.Storage, dir: str, uri: str) -> "Reader":
        """A Reader of the checkpoint in `dir` of an open storage (a manager's tier),
        called `uri`."""
        reader = cls()
        reader._open(uri, storage=storage, dir=dir)
        return reader

    def _reopen(self) -> None:
        self._open(self.path, storage=self._storage, dir=self._dir)

    def _open(self, path: "str | os.PathLike | _ext.Storage",
              engine: _ext.CheckpointReader | None = None,
              storage: _ext.Storage | None = None, dir: str = "") -> None:
        uri = _uri(path)
        if storage is None and isinstance(path, _ext.Storage):
            storage = path
        self.path = uri
        self._reader = None
        self._stock = None
        self._metadata = None
        self._user_metadata = {}
        self._dir = dir
        try:
            if engine is not None:
                self._reader = engine
            else:
                if storage is None:
                    storage = _open_storage(uri, create=False)
                self._storage = storage
                self._reader = _ext.CheckpointReader(storage, dir)
        except NotFoundError:
            local = "" if storage is None or dir else storage.local_path()  # '' for s3
            if local and not _ext.has_manifest(storage) and is_stock_checkpoint(storage):
                self._stock = StockReader(storage, allow_pickle=self.allow_pickle)
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
        # DCP's Metadata and the user metadata are converted from the manifest on
        # first use: a load in place (a manager's restore) needs neither.
        self._user_metadata = None

    def _converted(self, convert: Callable[[_ext.Manifest], Any]) -> Any:
        """convert(the engine's manifest). The engine validated the manifest
        (extra.dcp included); anything that still fails to convert is a damaged
        manifest, not a bug."""
        if self._reader is None:
            self._reopen()
        try:
            return convert(self._reader.manifest())
        except Error as e:
            if self.path in str(e):
                raise
            raise type(e)(f"{self.path}: {e}") from e
        except Exception as e:  # noqa: BLE001 - untrusted input
            raise CorruptionError(f"{self.path}: malformed manifest ({e!r})") from e

    def _dcp_metadata(self) -> Metadata:
        if self._metadata is None:
            self._metadata = self._converted(metadata_from_manifest)
        return self._metadata

    def close(self) -> None:
        """Releases the open data files (the reader reopens on next use)."""
        self._reader = None
        self._metadata = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.load_id = uuid.uuid4().hex
        if checkpoint_id is not None:  # a new load: opened afresh, as a path is followed
            self._open(checkpoint_id)
        elif self._stock is not None:
            self._stock.reset()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._stock is not None:
            if self._metadata is not None and kwargs.get("rank") is None:
                return self._metadata  # read and validated when opened
            return self._stock.read_metadata(*args, **kwargs)
        return self._dcp_metadata()

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
            self._reopen()
        assert self._reader is not None
        # The engine reads each region of a stored chunk into contiguous memory
        # (ReadBoxes): the destination itself when it is a contiguous CPU tensor of
        # the stored dtype, else a scratch tensor copied into it afterwards.
        boxes, values, value_items, commits, copies = [], [], [], [], []
        for ri in plan.items:
            index = ri.storage_index
            if ri.type == LoadItemType.BYTE_IO:
                values.append(index.fqn)
                value_items.append(ri)
                continue
            meta = self._dcp_metadata().state_dict_metadata.get(index.fqn)
            if not isinstance(meta, TensorStorageMetadata):
                raise InvalidArgumentError(
                    f"{index.fqn!r} is not a tensor of the checkpoint at {self.path}")
            dtype = meta.properties.dtype
            lengths = tuple(ri.lengths)
            dest = planner.resolve_tensor(ri).detach()
            if tuple(dest.shape) != lengths:
                raise InvalidArgumentError(
                    f"{ri.dest_index.fqn!r}: destination of shape {tuple(dest.shape)} for a "
                    f"stored region of shape {lengths}"
                )
            into = dest
            if dest.device.type != "cpu" or dest.dtype != dtype or not dest.is_contiguous():
                into = torch.empty(lengths, dtype=dtype)
                copies.append((dest, into))
            boxes.append((index.fqn, list(index.offset or ()), list(ri.storage_offsets),
                          list(lengths), into.data_ptr(), into.numel() * into.element_size()))
            commits.append((ri, dest))

        datas = self._reader.read_items(boxes, values, self._thread_pool())

        for ri, data in zip(value_items, datas):
            load_value_bytes(planner, ri, data,
                             f"{self.path}: value '{ri.storage_index.fqn}'", self.allow_pickle)
        for dest, src in copies:
            dest.copy_(src)
        for ri, dest in commits:
            planner.commit_tensor(ri, dest)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # ---- in-place load without DCP's planner (CheckpointManager.restore) ----------

    def stored_keys(self) -> set[str]:
        """The flattened keys the checkpoint stores (its Metadata's
        ``state_dict_metadata`` keys)."""
        if self._stock is not None:
            return set(self.read_metadata().state_dict_metadata)
        if self._reader is None:
            self._reopen()
        return set(self._reader.keys())

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
            self._reopen()
        keys = sorted(state_dict.keys())
        stateful_sd = {}
        for k in keys:
            elem = state_dict[k]
            stateful_sd[k] = elem.state_dict() if isinstance(elem, Stateful) else elem
        flat, mappings = flatten_state_dict(stateful_sd)
        missing = self.stored_keys() - flat.keys()
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
        # The matching against the manifest is the engine's (PlanInPlaceRead).
        targets, values = [], []
        for fqn, v in flat.items():
            if not isinstance(v, torch.Tensor):
                targets.append((fqn, None, [], 0, 0))
                values.append(fqn)
            elif (type(v) in (torch.Tensor, torch.nn.Parameter) and v.device.type == "cpu"
                    and v.is_contiguous()):  # not DTensor, ShardedTensor, ...
                targets.append((fqn, str(v.dtype).removeprefix("torch."), list(v.shape),
                                v.data_ptr(), v.numel() * v.element_size()))
            else:
                return None
        engine = self._reader.plan_in_place(targets)
        if engine is None:
            return None
        return InPlaceLoad(state_dict, keys, stateful_sd, mappings, engine, values)

    def load_in_place(self, plan: "InPlaceLoad") -> None:
        """Carries out plan_in_place's plan: every tensor and value is read, verified,
        in one engine call (in parallel, each block hashed as it is copied), straight
        into the state's tensors; values are decoded as read_data does, Statefuls get
        ``load_state_dict``. A corrupt byte raises CorruptionError naming the file and
        tensor; the state's contents are then unspecified."""
        assert self._reader is not None
        datas = self._reader.load_in_place(plan.engine, self._thread_pool())
        for fqn, data in zip(plan.values, datas):
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
