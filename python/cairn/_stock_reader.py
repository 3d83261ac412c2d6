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

1. **Decode** (the C++ engine, ``src/stock/metadata_pickle.cc``). A restricted
   pickle reader knows only the data opcodes and the handful of globals a DCP
   metadata pickle names (the metadata dataclasses, ``torch.Size``, dtypes,
   layouts, paths), each an inert value; it calls nothing. Any other global
   (``os.system``, ``builtins.eval``...) stops decoding with
   :class:`cairn.CorruptionError`.
2. **Validate** (the engine too). The decoded tree is checked field by field
   (types, non-negative sizes, chunks inside their tensor and tiling it, data
   file names that are plain file names inside the checkpoint directory, item
   lengths that fit what the item can hold); :func:`read_stock_metadata` builds
   the real DCP metadata objects that ``dcp.load``'s planner expects from it.
3. **Read items** (the C++ engine, ``src/stock/``). Data files are opened by
   validated name inside the checkpoint directory (no symlink, no FIFO); every
   item is bounds-checked against its file's size before it is read. A tensor
   item's zip records are walked and its CRC32s verified (torch.save writes
   them); its ``data.pkl`` is decoded by a tiny opcode reader that only
   recognises torch.save's one-tensor form (rebuild function, storage class,
   sizes, strides), the view is checked against its storage, and the slice
   the destination needs (resharding) is read straight into it, items and
   large items' pieces in parallel on cairn's I/O pool (a destination of
   another dtype or device gets a CPU tensor of the stored dtype, filled
   so and copied over). Any other form is decoded here with
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
import pickle
import threading
from typing import Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from cairn import _ext, _pools
from cairn.discovery import open_path
from cairn.errors import CorruptionError, Error, NotFoundError

__all__ = ["is_stock_checkpoint", "StockReader", "read_stock_metadata", "check_value_is_safe"]

METADATA_FILE = ".metadata"


def _path_str(path: str | os.PathLike) -> str:
    p = os.fspath(path)
    return os.fsdecode(p) if isinstance(p, bytes) else p


def _local_path(path: "str | os.PathLike | _ext.Storage") -> str:
    """The local directory of a checkpoint path (the engine resolves file://), or of
    an open storage."""
    if isinstance(path, _ext.Storage):
        return path.local_path()
    p = _path_str(path)
    return _ext.local_dir_of_uri(p) or p


def _open(path: "str | os.PathLike | _ext.Storage") -> _ext.Storage:
    """The storage of an existing checkpoint directory (NotFoundError when it is
    missing); an open storage as it is."""
    return open_path(path if isinstance(path, _ext.Storage) else _path_str(path))


def is_stock_checkpoint(path: "str | os.PathLike | _ext.Storage") -> bool:
    """True when ``path`` is a directory (or an open storage) holding a stock DCP
    ``.metadata`` pickle (global, or rank 0's when saved without collectives).
    Reads one byte."""
    try:
        return bool(_ext.is_stock_checkpoint(_open(path)))
    except (TypeError, Error):
        return False


def read_stock_metadata(path: str | os.PathLike, rank: int | None = None) -> _md.Metadata:
    """Reads and validates a stock checkpoint's metadata without unsafe unpickling.

    Raises NotFoundError when the file is missing, CorruptionError when it is not
    a well-formed DCP metadata pickle (including any pickle that names a global
    outside DCP's metadata classes)."""
    name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
    m = _ext.read_stock_metadata(_open(path), name)  # steps 1 and 2
    sdm: dict[str, Any] = {}
    for it in m.state:
        if it.is_bytes:
            sdm[it.fqn] = _md.BytesStorageMetadata()
            continue
        props = _md.TensorProperties(
            dtype=getattr(torch, it.dtype),
            layout=getattr(torch, it.layout),
            requires_grad=it.requires_grad,
            memory_format=getattr(torch, it.memory_format),
            pin_memory=it.pin_memory,
        )
        chunks = [_md.ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                  for c in it.chunks]
        sdm[it.fqn] = _md.TensorStorageMetadata(props, torch.Size(it.size), chunks)
    storage = {
        _md.MetadataIndex(loc.fqn, loc.index_offset, loc.index):
            _StorageInfo(loc.relative_path, loc.offset, loc.length)
        for loc in m.locations
    }
    sm = m.storage_meta
    return _md.Metadata(
        state_dict_metadata=sdm,
        planner_data=None if m.planner_data is None else {k: tuple(p) for k, p in m.planner_data},
        storage_data=storage,
        storage_meta=None if sm is None else _md.StorageMeta(
            checkpoint_id=sm.checkpoint_id, save_id=sm.save_id, modules=list(sm.modules)),
        version=m.version,
    )


# ----------------------------------------------------------------------------
# Step 3: read items. The zip walk, data.pkl decoding, bounds and CRC32 checks
# and the copies into the destinations are the C++ engine's (src/stock/,
# include/cairn/stock.h); Python resolves destinations and handles the rest.


def _decode_tensor(buf, where: str, verify_crc: bool) -> torch.Tensor:
    """The tensor of a torch.save item held in ``buf`` (one in another form than
    the engine reads itself), decoded by torch.load(weights_only=True) once the
    engine has checked the archive's records, CRC32s and, in the plain
    one-tensor form, the view against its storage."""
    _ext.decode_stock_tensor(buf, where, verify_crc)  # raises on damage
    try:
        t = torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CorruptionError(f"{where}: undecodable tensor item ({e})") from e
    if not isinstance(t, torch.Tensor):
        raise CorruptionError(f"{where}: item is a {type(t).__name__}, not a tensor")
    return t


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


class StockReader(FileSystemReader):
    """A DCP ``StorageReader`` for checkpoints written by stock ``dcp.save``
    with the filesystem writer, without unsafe unpickling (see the module doc).

    Supports loading on any world size (resharding: each request is narrowed to
    the slice the destination needs). One instance serves one ``dcp.load`` at a
    time. A tensor item in torch.save's plain one-tensor form is loaded by the
    C++ engine (``_ext.read_stock_tensors``: zip records and CRC32s checked,
    bytes read in parallel straight into the destination when it is a CPU
    tensor of the stored dtype, else into a CPU copy then copied over); other
    forms are decoded here (``torch.load(weights_only=True)``) and copied.

    Args:
        path: the checkpoint directory (or ``file://`` URI), or its open storage.
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
        super().__init__(_local_path(path))
        self.path = _local_path(path)
        # Opened once, on first use (and again after a reset to another path).
        self._storage: _ext.Storage | None = path if isinstance(path, _ext.Storage) else None
        self.thread_count = thread_count or _pools.thread_count("io")
        self._own_pool = _ext.ThreadPool(thread_count) if thread_count else None
        self.verify_crc = verify_crc
        self.allow_pickle = allow_pickle
        self._chunks: dict[_md.MetadataIndex, tuple[torch.Size, torch.dtype]] = {}

    # -- StorageReader (prepare_*_plan and checkpoint_id: FileSystemReader's) --

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self._chunks = {}
        if checkpoint_id:
            self.path = _local_path(checkpoint_id)
            self._storage = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> _md.Metadata:
        return read_stock_metadata(self._store(), kwargs.get("rank"))

    def set_up_storage_reader(
        self, metadata: _md.Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks = {}
        for fqn, v in metadata.state_dict_metadata.items():
            if isinstance(v, _md.TensorStorageMetadata):
                for c in v.chunks:
                    self._chunks[_md.MetadataIndex(fqn, c.offsets)] = (
                        c.sizes,
                        v.properties.dtype,
                    )

    def _store(self) -> _ext.Storage:
        """The checkpoint's storage, opened once (NotFoundError while it is missing)."""
        if self._storage is None:
            self._storage = _open(self.path)
        return self._storage

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            storage = self._store()
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
            if expected is None:
                slow.append(item + (target,))
                continue
            # A destination the engine cannot fill itself (another dtype or
            # device, a view with repeated elements) gets a CPU copy it fills.
            dest = target if _engine_can_fill(target, expected[1]) else torch.empty(
                list(req.lengths), dtype=expected[1])
            engine.append(item + (target, dest))
            engine_reqs.append((
                info.relative_path, info.offset, info.length, item[2],
                repr(req.storage_index.fqn), str(expected[1]).removeprefix("torch."),
                list(expected[0]), list(req.storage_offsets), list(req.lengths),
                dest.data_ptr(), list(dest.stride()),
            ))
        pool = self._own_pool or _pools.io_pool()
        fallback = _ext.read_stock_tensors(storage, engine_reqs, pool, self.verify_crc)
        for (req, info, where, target, dest), fell in zip(engine, fallback):
            if fell:
                slow.append((req, info, where, target))
                continue
            if dest is not target:
                target.copy_(dest)
            planner.commit_tensor(req, target)
        for item in slow:
            self._read_item(storage, planner, *item)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_stock_checkpoint(checkpoint_id)

    # -- internals ---------------------------------------------------------

    def _read_item(self, storage, planner: LoadPlanner, req, info, where, target=None) -> None:
        """One item the engine does not fill: a non-tensor value, or a tensor in
        another form than torch.save's plain one."""
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
