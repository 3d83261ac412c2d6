"""CachedFileDataset: the files of a slow source, served from a node-local cache.

Each DataLoader worker process (or the main process when ``num_workers=0``)
runs its own C++ ``FileCache`` engine (``cairn._ext.FileCache``; protocol in
``src/cache/file_cache.cc``) over one shared cache directory. At the start of
each iteration the worker hands the engine the order of this epoch and the
next (for Belady eviction) and its slice of the epoch (start, rank, worker;
the engine works out the positions it will produce, ``cairn/partition.h``),
and then yields the local path of each file as
the engine delivers it; the engine prefetches ahead on its own threads while
training computes.

Pinning: a yielded path stays pinned (never evicted by any process) until
``pin_window`` further items have been produced by the same worker, or the
iteration ends. :class:`cairn.data.DataLoader` sizes the window to cover the
batches its workers prefetch. Decode inside the worker (``transform=`` or a
wrapping dataset) or within that window.

Engines and fork: an engine owns threads, which a forked child does not
inherit. A child therefore abandons (never uses, never destroys) the engines
it inherited and builds its own; engines are never pickled.
"""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
import warnings
import weakref
from typing import Any, Callable

import torch.utils.data

from cairn import _ext
from cairn.data import _partition

_ENGINES: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _abandon_inherited_engines() -> None:
    for eng in list(_ENGINES):
        eng.abandon()
    _ENGINES.clear()


os.register_at_fork(after_in_child=_abandon_inherited_engines)


def default_cache_dir() -> str:
    """``$CAIRN_CACHE_DIR``, else ``<tmp>/cairn-cache-<uid>``."""
    return os.environ.get("CAIRN_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"cairn-cache-{os.getuid()}"
    )


def _normalize_source(source: Any) -> str:
    s = os.fspath(source)
    if "://" in s:
        return s
    return os.path.abspath(s)


class CachedFileDataset(torch.utils.data.IterableDataset):
    """Yields the local cached path of every file of ``source``, in an order that
    is a pure function of ``(seed, epoch)``, partitioned over ranks and
    DataLoader workers.

    Args:
        source: a directory (a slow mount), ``file://PATH``, or
            ``slow://PATH?latency=S&bandwidth=B`` (a throttled directory, for
            tests and benchmarks).
        cache_dir: node-local directory shared by all processes of the node
            (default :func:`default_cache_dir`).
        cache_limit: bytes the cache may hold (default: 90% of the free space
            of ``cache_dir``'s filesystem). Must be at least the largest file.
        shuffle, seed: shuffle the order each epoch, seeded by ``(seed, epoch)``.
        drop_last: when the files do not split evenly over ranks, drop the
            remainder (True) or pad by wrapping around (False, default). Either
            way every rank gets the same number of samples.
        transform: called on each local path in the worker; its result is
            yielded instead of the path (the file is pinned meanwhile).
        fetch_threads: concurrent copies per process.
        prefetch_files, prefetch_bytes: prefetch window per process.
        pin_window: items that stay pinned after being yielded (default: set
            by cairn.data.DataLoader, else 64).
        timeout: seconds to wait for room in the cache or another process's copy.
    """

    def __init__(
        self,
        source: Any,
        cache_dir: str | None = None,
        cache_limit: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        *,
        drop_last: bool = False,
        transform: Callable[[str], Any] | None = None,
        fetch_threads: int = 8,
        prefetch_files: int = 64,
        prefetch_bytes: int | None = None,
        pin_window: int | None = None,
        timeout: float = 120.0,
    ) -> None:
        super().__init__()
        self.source = _normalize_source(source)
        self.cache_dir = os.path.abspath(cache_dir or default_cache_dir())
        os.makedirs(self.cache_dir, exist_ok=True)
        keys, sizes = _ext.list_source(self.source)
        if not keys:
            raise ValueError(f"CachedFileDataset: no files in {self.source}")
        self.keys: list[str] = list(keys)
        self.sizes: list[int] = [int(s) for s in sizes]
        if cache_limit is None:
            cache_limit = int(shutil.disk_usage(self.cache_dir).free * 0.9)
        cache_limit = int(cache_limit)
        largest = max(range(len(self.sizes)), key=self.sizes.__getitem__)
        if cache_limit < max(1, self.sizes[largest]):
            raise ValueError(
                f"cache_limit of {cache_limit} bytes is smaller than file "
                f"{self.keys[largest]!r} ({self.sizes[largest]} bytes)"
            )
        self.cache_limit = cache_limit
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.transform = transform
        self.fetch_threads = int(fetch_threads)
        self.prefetch_files = int(prefetch_files)
        self.prefetch_bytes = prefetch_bytes
        self.pin_window = pin_window
        self.timeout = float(timeout)
        self._control = None  # set by cairn.data.DataLoader
        self._epoch = 0
        self._start = 0
        self._engine = None
        self._engine_pid = -1

    # -- position (standalone use; a cairn DataLoader manages it instead) --
    def __len__(self) -> int:
        """Samples this rank gets in a full epoch (rank and world size read now;
        ``len(self.keys)`` is the number of files). torch's ``len(loader)`` is
        then the number of batches per epoch."""
        _, ws = _partition.world()
        return _partition.per_rank(len(self.keys), 0, ws, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch (and so the order) of the next iteration."""
        if self._control is not None:
            self._control.set(epoch=epoch, start=0)
        self._epoch = int(epoch)
        self._start = 0

    def _num_items(self) -> int:
        return len(self.keys)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_engine"] = None
        state["_engine_pid"] = -1
        return state

    def engine(self, consumers: int = 1):
        """This process's FileCache engine (created on first use)."""
        if self._engine is None or self._engine_pid != os.getpid():
            if self.prefetch_bytes is not None:
                window = int(self.prefetch_bytes)
            else:
                window = min(256 << 20, self.cache_limit // (2 * max(1, consumers)))
            window = max(window, max(self.sizes))
            self._engine = _ext.FileCache(
                self.source,
                self.cache_dir,
                self.cache_limit,
                self.keys,
                self.sizes,
                threads=self.fetch_threads,
                prefetch_files=self.prefetch_files,
                prefetch_bytes=window,
                timeout=self.timeout,
            )
            self._engine_pid = os.getpid()
            _ENGINES.add(self._engine)
        return self._engine

    def cache_stats(self) -> dict:
        """Counters of this process's engine and of the whole shared cache
        (``shared_fetched_bytes``: bytes copied from the source by every
        process; ``used_bytes``: bytes cached now), plus ``root``."""
        eng = self.engine()
        stats = eng.stats()
        stats["root"] = eng.root
        return stats

    def _iteration_params(self) -> dict:
        c = self._control
        if c is not None and c.world_size > 0:
            return c.snapshot()
        rank, ws = _partition.world()
        # A stock DataLoader: its workers read the cache at once (this node's other
        # ranks too, which are not known here).
        _, nw = _partition.worker()
        return {
            "epoch": self._epoch,
            "start": self._start,
            "rank": rank,
            "world_size": ws,
            "batch_size": 1,
            "pin_window": self.pin_window or 64,
            "consumers": max(1, nw),
            "stock": True,
        }

    def __iter__(self):
        p = self._iteration_params()
        wid, nw = _partition.worker()
        n = len(self.keys)
        ws, rank, bs = p["world_size"], p["rank"], p["batch_size"]
        order = _partition.epoch_order(n, self.seed, p["epoch"], self.shuffle)
        next_order = _partition.epoch_order(n, self.seed, p["epoch"] + 1, self.shuffle)
        pin_window = max(1, self.pin_window or p["pin_window"])
        # Every consumer of the node must be able to hold its pins plus the
        # file it waits for, or all could wait for room forever.
        fit = self.cache_limit // max(1, p["consumers"]) // max(1, max(self.sizes)) - 1
        if fit < pin_window:
            # Said up front, before the first file: later, a reader that cannot get
            # room fails after its timeout with ResourceExhaustedError.
            need = p["consumers"] * (pin_window + 1) * max(self.sizes)
            warnings.warn(
                f"cairn.data: cache_limit {self.cache_limit} holds fewer pins than "
                f"{p['consumers']} concurrent reader(s) with a pin window of {pin_window} "
                f"need (files up to {max(self.sizes)} bytes: about {need} bytes); "
                + ("readers may wait for room and fail with ResourceExhaustedError"
                   if fit < 1 else f"the pin window is shrunk to {fit}, so open each "
                   "path within that many items")
                + (" (a stock torch DataLoader prefetches prefetch_factor x num_workers "
                   "batches: use cairn.data.DataLoader, or a larger cache_limit)"
                   if p.get("stock") else ""),
                RuntimeWarning,
                stacklevel=2,
            )
            pin_window = max(1, fit)
        eng = self.engine(p["consumers"])
        # The part of the epoch this worker of this rank produces (cairn/partition.h).
        size = eng.set_epoch_plan(order, next_order, p["start"], ws, rank, self.drop_last, nw,
                                  wid, bs)
        return self._generate(eng, size, pin_window)

    def _generate(self, eng, size, pin_window):
        pinned: collections.deque[int] = collections.deque()
        try:
            for i in range(size):
                path = eng.acquire(i)
                pinned.append(eng.plan_file(i))
                item = self.transform(path) if self.transform is not None else path
                while len(pinned) > pin_window:
                    eng.release(pinned.popleft())
                yield item
        finally:
            for fid in pinned:
                eng.release(fid)
