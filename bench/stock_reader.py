"""Loading a stock ``dcp.save`` checkpoint: cairn's StockReader (the C++
engine's zip/pickle item decoder, bytes read straight into the destination) against the same
safety built on DCP's own ``FileSystemReader.read_data`` (``torch.load`` per
item, one more copy), and against DCP's unsafe ``FileSystemReader`` itself.

    python bench/stock_reader.py [--mib 512] [--tensors 64] [--repeat 3]

Prints the best of --repeat wall times of one ``dcp.load`` per reader (page
cache warm: the first load of each reader is not counted). Issue 10 asked for
the stock reader to be rebuilt on FileSystemReader unless cairn's own is
measurably faster; ``FileSystemStockReader`` below is that rebuild, kept here
as the measured alternative (see bench/README.md for the figures).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import io
import os
import shutil
import stat
import tempfile
import threading
import time
import warnings
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.futures import Future
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from cairn import _ext, _pools
from cairn._stock_reader import (
    StockReader,
    _local_path,
    check_value_is_safe,
    read_stock_metadata,
)
from cairn.errors import CorruptionError, InvalidArgumentError


# Step 3: read items, with DCP's own FileSystemReader.read_data.
#
# Stock read_data opens each data file through ``self.fs``, cuts each item out
# of it with ``self._slice_file`` and decodes tensor items with
# ``torch.load(weights_only=True)``; it hands non-tensor items to the planner,
# which unpickles them with ``weights_only=False``. So the reader overrides
# the file system (never-blocking, no-symlink opens), ``_slice_file`` (bounds,
# zip CRC32s, which torch.load does not check) and wraps the planner (the value
# allowlist before load_bytes, one planner call at a time).

_LOCAL_MAGIC = b"PK\x03\x04"


def _open_regular(path: str) -> int:
    """Opens ``path`` read-only without following a symlink and without ever
    blocking: a FIFO, socket or device is refused. (cairn's own reader has
    the engine's Storage open its files; this bench-only rebuild opens them
    through DCP's FileSystem, so it needs its own.)"""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptionError(f"{path}: not a regular file (refusing to read it)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _verify_zip_crcs(data: bytes, where: str) -> None:
    """Checks the CRC32 of every stored entry of the torch.save archive held in
    ``data`` (torch.save writes them; torch.load never checks them): the
    engine's archive walk (src/stock/), whose decoded record is not used."""
    _ext.decode_stock_tensor(data, where, True)


class _DataFiles(FileSystem):
    """DCP's FileSystem for reading data files by their validated names: paths
    stay plain strings (``file://`` stripped), opens never follow a symlink and
    never block (a FIFO, socket or device is refused)."""

    def init_path(self, path: str | os.PathLike) -> str:
        return _local_path(path)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return os.path.join(path, suffix)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):
        if mode != "rb":
            raise InvalidArgumentError(f"{path}: the stock reader only reads")
        try:
            fd = _open_regular(os.fspath(path))
        except CorruptionError as e:
            raise CorruptionError(f"{e} (a data file)") from e
        except FileNotFoundError as e:
            raise CorruptionError(f"{path}: data file is missing") from e
        except OSError as e:
            raise CorruptionError(f"{path}: cannot open data file: {e.strerror}") from e
        with os.fdopen(fd, "rb", buffering=0) as f:
            yield f


class _PlannerError(Exception):
    """An exception of the caller's planner, carried through unwrapped."""


class _SerializedPlanner:
    """The planner as the reader's item threads see it: one call at a time
    (DCP planners are not thread-safe), non-tensor values checked against the
    allowlist first, and the planner's own exceptions marked as its own."""

    def __init__(self, planner: LoadPlanner, reader: "FileSystemStockReader") -> None:
        self._planner = planner
        self._reader = reader
        self._lock = threading.Lock()

    def _call(self, name: str, *args: Any) -> Any:
        with self._lock:
            try:
                return getattr(self._planner, name)(*args)
            except Exception as e:
                raise _PlannerError() from e

    def load_bytes(self, req, value: io.BytesIO) -> None:
        if not self._reader.allow_pickle:
            check_value_is_safe(value.getbuffer(), self._reader._where(req))
        self._call("load_bytes", req, value)

    def resolve_tensor(self, req) -> torch.Tensor:
        return self._call("resolve_tensor", req)

    def commit_tensor(self, req, tensor: torch.Tensor) -> None:
        self._call("commit_tensor", req, tensor)


class FileSystemStockReader(FileSystemReader):
    """DCP's ``FileSystemReader`` for checkpoints written by stock ``dcp.save``
    with the filesystem writer, without unsafe unpickling (see the module doc).

    Only what is unsafe is replaced: ``read_metadata`` (the allowlisting
    unpickler and validation above), the opens, the item bounds and CRC32
    checks, and the value allowlist in front of the planner; decoding and
    resharding are stock ``read_data``'s. Items are read on a thread pool, in
    as many slices of the plan as it has threads. One instance serves one
    ``dcp.load`` at a time.

    Args:
        path: the checkpoint directory (or ``file://`` URI).
        verify_crc: check each item's zip CRC32s (torch.save writes them).
        allow_pickle: hand non-tensor items that need arbitrary unpickling to the
            planner anyway. Only for checkpoints you trust.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        verify_crc: bool = True,
        allow_pickle: bool = False,
    ) -> None:
        super().__init__(_local_path(path))
        self.fs = _DataFiles()
        self.path = self.fs.init_path(path)
        self.thread_count = _pools.thread_count("copy")
        self.verify_crc = verify_crc
        self.allow_pickle = allow_pickle
        self._names: dict[tuple[str, int], str] = {}
        self._current = threading.local()

    def read_metadata(self, *args: Any, **kwargs: Any) -> _md.Metadata:
        md = read_stock_metadata(self.path, kwargs.get("rank"))
        if md.storage_meta is None:
            md.storage_meta = _md.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(
        self, metadata: _md.Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._names = {
            (s.relative_path, s.offset): idx.fqn for idx, s in self.storage_data.items()
        }

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for req in plan.items:
            if req.storage_index not in self.storage_data:
                raise CorruptionError(
                    f"{self.path}: no data location for {req.storage_index.fqn!r}"
                )
        guarded = _SerializedPlanner(planner, self)
        # Slices of the plan, each read by stock read_data on one thread (it
        # opens each file once per slice); items in file order, dealt round-robin.
        def file_order(req) -> tuple[str, int]:
            info = self.storage_data[req.storage_index]
            return info.relative_path, info.offset

        items = sorted(plan.items, key=file_order)
        n = max(1, min(self.thread_count, len(items)))
        slices = [dataclasses.replace(plan, items=items[i::n]) for i in range(n)]
        if n == 1:
            self._read_slice(slices[0], guarded)
        else:
            pool = _pools.python_executor()
            futures = [pool.submit(self._read_slice, s, guarded) for s in slices]
            try:
                for f in futures:
                    f.result()
            finally:
                concurrent.futures.wait(futures)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    # The same directories as cairn's StockReader.
    validate_checkpoint_id = StockReader.validate_checkpoint_id

    # -- internals ---------------------------------------------------------

    def _where(self, req=None, info: _StorageInfo | None = None) -> str:
        if info is None and req is not None:
            info = self.storage_data.get(req.storage_index)
        if info is None:
            return getattr(self._current, "where", self.path)
        fqn = self._names.get((info.relative_path, info.offset), "?")
        return f"{os.path.join(self.path, info.relative_path)}: tensor {fqn!r}"

    def _read_slice(self, plan: LoadPlan, planner: _SerializedPlanner) -> None:
        try:
            super().read_data(plan, planner)
        except _PlannerError as e:
            raise e.__cause__ from None
        except (CorruptionError, InvalidArgumentError):
            raise
        except Exception as e:  # torch.load or narrowing of an untrusted item
            raise CorruptionError(f"{self._where()}: undecodable item ({e})") from e

    def _slice_file(self, file, sinfo: _StorageInfo) -> IO[bytes]:
        where = self._current.where = self._where(info=sinfo)
        size = os.fstat(file.fileno()).st_size
        if sinfo.offset + sinfo.length > size:
            raise CorruptionError(
                f"{where}: data file is truncated (item ends at "
                f"{sinfo.offset + sinfo.length}, file has {size} bytes)"
            )
        data = os.pread(file.fileno(), sinfo.length, sinfo.offset)
        if len(data) != sinfo.length:
            raise CorruptionError(f"{where}: short read")
        if self.verify_crc and data[:4] == _LOCAL_MAGIC:
            _verify_zip_crcs(data, where)
        return io.BytesIO(data)  # shares the bytes, no copy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    n = args.mib * (1 << 20) // 4 // args.tensors
    state = {f"t{i}": torch.randn(n) for i in range(args.tensors)}
    state["step"] = 7
    tmp = tempfile.mkdtemp(prefix="cairn-bench-stock-")
    try:
        dcp.save(state, checkpoint_id=tmp)
        readers = {
            "dcp.FileSystemReader": lambda: dcp.FileSystemReader(tmp),
            "cairn StockReader": lambda: StockReader(tmp),
            "FileSystemStockReader (bench only)": lambda: FileSystemStockReader(tmp),
        }
        print(f"{args.mib} MiB in {args.tensors} tensors, best of {args.repeat}")
        for name, make in readers.items():
            best = float("inf")
            for _ in range(args.repeat + 1):  # the first warms the page cache
                out = {k: torch.empty_like(v) if torch.is_tensor(v) else 0
                       for k, v in state.items()}
                t0 = time.perf_counter()
                dcp.load(out, storage_reader=make())
                best = min(best, time.perf_counter() - t0)
            assert torch.equal(out["t0"], state["t0"]) and out["step"] == 7
            print(f"  {name:40s} {best * 1000:8.1f} ms  {args.mib / best / 1024:6.2f} GiB/s")
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
