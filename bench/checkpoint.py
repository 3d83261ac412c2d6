#!/usr/bin/env python3
"""Checkpoint save/load benchmark: cairn vs torch.save and DCP's filesystem backend.

Run from the repository root::

    .venv/bin/python bench/checkpoint.py                 # reference state, >= 1.5 GB
    .venv/bin/python bench/checkpoint.py --size-gb 0.3   # smoke run

It builds one reference state (a GPT-like stack of linear weights plus Adam's
exp_avg / exp_avg_sq, ~200 CPU tensors) and, in the same run, on the same disk:

* floors: memcpy bandwidth into a pre-faulted buffer (as many bytes as the state),
  and the disk's direct-I/O (O_DIRECT) write and read bandwidth on a file as large
  as the state;
* peers: for each of torch.save/torch.load, dcp.save/dcp.load with DCP's
  FileSystemWriter/Reader, and dcp.save/dcp.load with cairn.Writer/Reader, the
  time of a synchronous save until it is durable (fsync'd) and of a load into
  the state (cold: after ``sync; echo 3 > /proc/sys/vm/drop_caches`` when
  permitted);
* repeated saves, one series per peer (torch.save, dcp.async_save with its default
  stager, dcp.async_save with cairn.SharedMemoryStager, cairn.CheckpointManager):
  the blocking stall, the time until durable and the extra memory of every save
  (see "memory" below); the first save of each series is reported apart;
* restore by the CheckpointManager of the step it just saved, from its memory tier
  and (a manager with memory=False) from the durable tier, cold.

Every figure is the median of ``--reps`` repetitions. It prints tables with the
ratios SPEC §4 judges (cairn/dcp save and load time, cairn save bandwidth /
direct-I/O write bandwidth; the manager's stall vs dcp.async_save's and vs the
memcpy floor, its extra memory vs the state, memory- vs disk-tier restore) and
writes JSON (default bench/results/checkpoint.json).

Layout: a floor is a function ``(ctx) -> (seconds, bytes)`` in FLOORS, a peer
is a ``Peer`` with one (optional) function per operation in PEERS (``save``,
``load``, ``stall``: one save of a repeated series, ``restore``); each function
times one repetition itself, so a new operation is a new Peer field and rows,
not a new loop. Repetitions are the outer loop (every floor and peer once per
repetition); objects that live across a peer's saves sit in ``Context.sessions``.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
import cairn  # noqa: E402

GB = 1e9
ALIGN = 4096

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


# --------------------------------------------------------------------------- state


def build_state(size_gb: float, layers: int = 16, seed: int = 0) -> dict:
    """A GPT-like model + Adam state totalling ~size_gb, as nested state dicts.

    Per layer: qkv (d x 3d), proj (d x d), fc1 (4d x d), fc2 (d x 4d) weights;
    plus an embedding and an output head (4d x d each). Each parameter has
    exp_avg and exp_avg_sq of its shape, so 3 x 66 = 198 tensors (+ 66 step
    scalars). float32 throughout.
    """
    # elements: layers * 12 d^2 + 8 d^2, times 3 (param + 2 moments), 4 bytes each
    per_d2 = (layers * 12 + 8) * 3 * 4
    d = max(8, math.ceil((size_gb * GB / per_d2) ** 0.5 / 8) * 8)  # >= size_gb
    shapes = {"embed.weight": (4 * d, d), "head.weight": (4 * d, d)}
    for i in range(layers):
        shapes[f"layers.{i}.attn.qkv.weight"] = (3 * d, d)
        shapes[f"layers.{i}.attn.proj.weight"] = (d, d)
        shapes[f"layers.{i}.mlp.fc1.weight"] = (4 * d, d)
        shapes[f"layers.{i}.mlp.fc2.weight"] = (d, 4 * d)
    g = torch.Generator().manual_seed(seed)
    model, state = {}, {}
    for name, shape in shapes.items():
        model[name] = torch.randn(shape, generator=g)
        state[name] = {
            "step": torch.tensor(100.0),
            "exp_avg": torch.randn(shape, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(shape, generator=g) * 1e-6,
        }
    optim = {
        "state": state,
        "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": list(shapes)}],
    }
    return {"model": model, "optim": optim}


def tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []


def like(obj):
    """Same structure, every tensor replaced by a pre-faulted zero tensor."""
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj).fill_(0)
    if isinstance(obj, dict):
        return {k: like(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [like(v) for v in obj]
    return obj


def same(a, b) -> bool:
    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb))


# --------------------------------------------------------------------------- context


@dataclasses.dataclass
class Context:
    state: dict
    nbytes: int
    ntensors: int
    scratch: Path
    reps: int
    drop_caches: bool
    dropped: bool = False  # whether a cache drop actually succeeded
    counter: int = 0
    # Objects that live across the repeated saves of one peer (a manager, a stager),
    # their process-memory baselines, and how to close them at the end (in order).
    sessions: dict = dataclasses.field(default_factory=dict)
    baselines: dict = dataclasses.field(default_factory=dict)
    closers: list = dataclasses.field(default_factory=list)

    def fresh_path(self, name: str) -> Path:
        self.counter += 1
        return self.scratch / f"{name}-{self.counter}"

    def cold(self) -> None:
        """Makes the next read cold: flush dirty pages, drop the page cache."""
        os.sync()
        if not self.drop_caches:
            return
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            self.dropped = True
        except OSError:
            self.drop_caches = False  # not permitted: reads are warm; reported


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclasses.dataclass
class Sample:
    """Repeated timings of one operation moving ``nbytes``."""

    seconds: list[float]
    nbytes: int

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.median / GB

    def as_json(self) -> dict:
        return {
            "median_s": self.median,
            "seconds": self.seconds,
            "bytes": self.nbytes,
            "GBps": self.gbps,
        }


# --------------------------------------------------------------------------- memory
#
# Extra memory of a save = peak over the save (call to durable) of
#     RssAnon(this process) + bytes allocated to the peer's own /dev/shm files
# minus RssAnon at the start of the peer's series of saves (after malloc_trim).
# RssAnon is the process's private memory (a stager's fresh CPU copy lands there);
# shared-memory staging lands in tmpfs files, which count in the process's RSS
# (RssShmem) only for pages it touched and whose pages outlive it, so they are
# counted by their allocated size (st_blocks) instead; RssShmem and RssFile (page
# cache of mapped files) are left out so nothing counts twice. A thread samples
# every 5 ms; malloc_trim(0) before every save returns freed heap pages, so memory
# an earlier save freed is not mistaken for (or hidden from) the next one.

try:
    _LIBC = ctypes.CDLL(None)
    _MALLOC_TRIM = _LIBC.malloc_trim
except (OSError, AttributeError):  # not glibc
    _MALLOC_TRIM = None


def trim() -> None:
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def shm_bytes(dirs: list[str]) -> int:
    """Bytes allocated to the files under `dirs` (tmpfs pages, touched or not)."""
    total = 0
    for top in dirs:
        for base, _, files in os.walk(top):
            for name in files:
                try:
                    total += os.stat(os.path.join(base, name)).st_blocks * 512
                except FileNotFoundError:
                    pass
    return total


class MemSampler:
    """Peak of rss_anon() + shm_bytes(dirs()) while the `with` block runs, sampled
    every `period` seconds by a daemon thread (and once at entry and exit)."""

    def __init__(self, dirs: Callable[[], list[str]], period: float = 0.005):
        self.dirs = dirs
        self.period = period
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.peak = max(self.peak, rss_anon() + shm_bytes(self.dirs()))
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> "MemSampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


# --------------------------------------------------------------------------- floors


def _aligned_buffer(size: int) -> mmap.mmap:
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    chunk = os.urandom(1 << 20)
    for off in range(0, size, len(chunk)):
        buf[off : off + len(chunk)] = chunk[: size - off]
    return buf


DIRECT_CHUNK = 16 << 20


def floor_memcpy(ctx: Context) -> tuple[float, int]:
    """One copy of as many bytes as the whole state into a pre-faulted buffer (the
    floor of the async-save stall: staging can be no cheaper than this copy)."""
    n = ctx.nbytes
    src = torch.empty(n, dtype=torch.uint8).fill_(7)  # pre-faulted
    dst = torch.empty(n, dtype=torch.uint8).fill_(0)  # pre-faulted
    t0 = time.perf_counter()
    dst.copy_(src)
    seconds = time.perf_counter() - t0
    del src, dst
    trim()
    return seconds, n


def _direct_file(ctx: Context) -> tuple[Path, int]:
    n = (ctx.nbytes + DIRECT_CHUNK - 1) // DIRECT_CHUNK * DIRECT_CHUNK
    return ctx.scratch / "direct-io.bin", n


def floor_direct_write(ctx: Context) -> tuple[float, int]:
    """O_DIRECT sequential writes of 16 MiB from an aligned buffer, then fsync;
    as many bytes as the state (rounded up to 16 MiB)."""
    path, n = _direct_file(ctx)
    buf = _aligned_buffer(DIRECT_CHUNK)
    remove(path)
    os.sync()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for off in range(0, n, DIRECT_CHUNK):
            if os.pwrite(fd, buf, off) != DIRECT_CHUNK:
                raise OSError("short direct write")
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)
    seconds = time.perf_counter() - t0
    buf.close()
    return seconds, n


def floor_direct_read(ctx: Context) -> tuple[float, int]:
    """O_DIRECT sequential reads of 16 MiB into an aligned buffer, cold, of the
    file the write floor just wrote (then removed)."""
    path, n = _direct_file(ctx)
    buf = _aligned_buffer(DIRECT_CHUNK)
    ctx.cold()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for off in range(0, n, DIRECT_CHUNK):
            if os.preadv(fd, [buf], off) != DIRECT_CHUNK:
                raise OSError("short direct read")
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    buf.close()
    remove(path)
    return seconds, n


# Each floor runs once per repetition and returns (seconds, bytes moved).
FLOORS: dict[str, Callable[[Context], tuple[float, int]]] = {
    "memcpy": floor_memcpy,
    "direct-I/O write": floor_direct_write,
    "direct-I/O read": floor_direct_read,
}


# --------------------------------------------------------------------------- peers
#
# A save function writes ctx.state to a fresh path until it is durable and
# returns (seconds, path); a load function reads that path into memory (cold)
# and returns (seconds, loaded state).


def torch_save(ctx: Context) -> tuple[float, Path]:
    path = ctx.fresh_path("torch").with_suffix(".pt")
    os.sync()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(ctx.state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)
    return time.perf_counter() - t0, path


def torch_load(ctx: Context, path: Path) -> tuple[float, dict]:
    ctx.cold()
    t0 = time.perf_counter()
    out = torch.load(path, map_location="cpu", weights_only=True)
    return time.perf_counter() - t0, out


def dcp_save(ctx: Context) -> tuple[float, Path]:
    path = ctx.fresh_path("dcp")
    os.sync()
    t0 = time.perf_counter()
    dcp.save(ctx.state, storage_writer=dcp.FileSystemWriter(str(path)))
    return time.perf_counter() - t0, path


def dcp_load(ctx: Context, path: Path) -> tuple[float, dict]:
    dest = like(ctx.state)
    ctx.cold()
    t0 = time.perf_counter()
    dcp.load(dest, storage_reader=dcp.FileSystemReader(str(path)))
    return time.perf_counter() - t0, dest


def cairn_save(ctx: Context) -> tuple[float, Path]:
    path = ctx.fresh_path("cairn")
    os.sync()
    t0 = time.perf_counter()
    dcp.save(ctx.state, storage_writer=cairn.Writer(str(path)))
    return time.perf_counter() - t0, path


def cairn_load(ctx: Context, path: Path) -> tuple[float, dict]:
    dest = like(ctx.state)
    ctx.cold()
    t0 = time.perf_counter()
    dcp.load(dest, storage_reader=cairn.Reader(str(path)))
    return time.perf_counter() - t0, dest


def stock_cairn_load(ctx: Context, path: Path) -> tuple[float, dict]:
    """cairn.Reader on a checkpoint written by stock dcp.save (the migration path:
    cairn._stock_reader.StockReader, CRC-checked, no unsafe unpickling)."""
    dest = like(ctx.state)
    ctx.cold()
    t0 = time.perf_counter()
    dcp.load(dest, storage_reader=cairn.Reader(str(path)))
    return time.perf_counter() - t0, dest


# Async saves. A stall function makes one save of a series (round 0 is the first,
# which pays one-time costs: page faults of fresh staging buffers, pool set-up) and
# returns {"stall_s": time until the call returns (the training thread is blocked),
# "durable_s": call to durable, "extra_bytes": peak extra memory (see above)}.
# The next save starts only once the previous one is durable.


def timed_save(ctx: Context, key: str, dirs: Callable[[], list[str]],
               save: Callable[[], object], wait: Callable[[object], None]) -> dict:
    trim()
    base = ctx.baselines.setdefault(key, rss_anon())
    os.sync()
    with MemSampler(dirs) as mem:
        t0 = time.perf_counter()
        handle = save()
        t1 = time.perf_counter()
        wait(handle)
        t2 = time.perf_counter()
    return {"stall_s": t1 - t0, "durable_s": t2 - t0, "extra_bytes": mem.peak - base,
            "samples": mem.samples}


def torch_stall(ctx: Context, rnd: int) -> dict:
    """torch.save blocks for its whole time (serialize + write + fsync)."""
    holder = {}

    def save():
        holder["seconds"], holder["path"] = torch_save(ctx)

    out = timed_save(ctx, "torch.save", list, save, lambda _: None)
    remove(holder["path"])
    # torch_save's own clock starts after its os.sync(), like every other peer's.
    out["stall_s"] = out["durable_s"] = holder["seconds"]
    return out


def dcp_async_stall(ctx: Context, rnd: int) -> dict:
    """dcp.async_save with FileSystemWriter, which is also its stager (DCP's default
    for this writer: a fresh CPU copy of the state per save); durable when the
    returned future is done."""
    path = ctx.fresh_path("dcp-async")
    out = timed_save(
        ctx, "dcp.async_save", list,
        lambda: dcp.async_save(ctx.state, storage_writer=dcp.FileSystemWriter(str(path))),
        lambda fut: fut.result(),
    )
    remove(path)
    return out


def dcp_async_shm_stall(ctx: Context, rnd: int) -> dict:
    """dcp.async_save staged by cairn.SharedMemoryStager (one reused shared-memory
    slot: each save is waited for before the next) and written by cairn.Writer."""
    stager = ctx.sessions.get("shm-stager")
    if stager is None:
        stager = ctx.sessions["shm-stager"] = cairn.SharedMemoryStager(slots=1)
        ctx.closers.append(stager.close)
    path = ctx.fresh_path("dcp-async-shm")

    def save():
        fut = dcp.async_save(ctx.state, storage_writer=cairn.Writer(str(path)),
                             async_stager=stager)
        stager.track(fut)
        return fut

    out = timed_save(ctx, "dcp.async_save+shm", lambda: [stager.shm_dir], save,
                     lambda fut: fut.result())
    remove(path)
    return out


def _manager(ctx: Context) -> "cairn.CheckpointManager":
    mgr = ctx.sessions.get("manager")
    if mgr is None:
        mgr = ctx.sessions["manager"] = cairn.CheckpointManager(
            ctx.scratch / "manager", memory=True, keep=1)
        ctx.closers.append(mgr.close)
    return mgr


def manager_stall(ctx: Context, rnd: int) -> dict:
    """CheckpointManager.save() (returns once staged into its shared-memory slot, the
    memory tier) then wait() (memory tier committed and durable tier fsync'd)."""
    mgr = _manager(ctx)
    return timed_save(ctx, "cairn.manager", lambda: [mgr.shm_dir],
                      lambda: mgr.save(rnd, ctx.state), lambda _: mgr.wait())


def manager_restore(ctx: Context, rnd: int, check: bool) -> dict[str, float]:
    """restore() of the step just saved: by the saving manager, from its memory tier;
    by a manager with memory=False, from the durable tier, cold."""
    mgr = _manager(ctx)
    dest = like(ctx.state)
    trim()
    t0 = time.perf_counter()
    step = mgr.restore(dest)
    memory_s = time.perf_counter() - t0
    if step != rnd or mgr.restored != (rnd, "memory"):
        raise RuntimeError(f"manager restored {mgr.restored}, expected ({rnd}, 'memory')")
    if check and not same(dest, ctx.state):
        raise RuntimeError("manager: the state restored from memory differs from the saved one")
    del dest
    disk = ctx.sessions.get("manager-disk")
    if disk is None:
        # Closed after the saving manager (closing removes the run's shm directory).
        disk = ctx.sessions["manager-disk"] = cairn.CheckpointManager(
            ctx.scratch / "manager", memory=False, keep=1)
        ctx.closers.append(disk.close)
    dest = like(ctx.state)
    trim()
    ctx.cold()
    t0 = time.perf_counter()
    step = disk.restore(dest)
    disk_s = time.perf_counter() - t0
    if step != rnd or disk.restored != (rnd, "durable"):
        raise RuntimeError(f"manager restored {disk.restored}, expected ({rnd}, 'durable')")
    if check and not same(dest, ctx.state):
        raise RuntimeError("manager: the state restored from disk differs from the saved one")
    del dest
    trim()
    return {"restore memory": memory_s, "restore disk (cold)": disk_s}


@dataclasses.dataclass
class Peer:
    """The operations one peer takes part in (None: not measured for it)."""

    save: Callable[[Context], tuple[float, Path]] | None = None  # durable sync save
    load: Callable[[Context, Path], tuple[float, dict]] | None = None  # cold load
    stall: Callable[[Context, int], dict] | None = None  # one save of a repeated series
    restore: Callable[[Context, int, bool], dict[str, float]] | None = None  # after stall


PEERS: dict[str, Peer] = {
    "torch.save": Peer(torch_save, torch_load, stall=torch_stall),
    "dcp": Peer(dcp_save, dcp_load),
    "cairn": Peer(cairn_save, cairn_load),
    "dcp.async_save": Peer(stall=dcp_async_stall),
    "dcp.async_save+shm": Peer(stall=dcp_async_shm_stall),
    "cairn.manager": Peer(stall=manager_stall, restore=manager_restore),
    # Not run by default (--peers ...,stock->cairn): loading stock checkpoints.
    "stock->cairn": Peer(dcp_save, stock_cairn_load),
}
DEFAULT_PEERS = ["torch.save", "dcp", "cairn", "dcp.async_save", "dcp.async_save+shm",
                 "cairn.manager"]


def run_peer_once(ctx: Context, name: str, peer: Peer, check: bool) -> tuple[float, float]:
    """One save (durable) + one cold load; returns their seconds."""
    save_s, path = peer.save(ctx)
    load_s, loaded = peer.load(ctx, path)
    if check and not same(loaded, ctx.state):
        raise RuntimeError(f"{name}: the state loaded from {path} differs from the saved one")
    del loaded
    remove(path)
    trim()
    return save_s, load_s


def run_all(ctx: Context, peer_names: list[str]):
    """Repetitions are the outer loop, so a burst of background load on a shared
    machine hits every floor and peer alike rather than one peer's reps. Async
    peers save once more before the first repetition (their first save, reported
    apart), so every repetition times a 2nd-or-later save."""
    floors: dict[str, Sample] = {}
    peers: dict[str, dict[str, Sample]] = {}
    series: dict[str, dict] = {}  # async peers: first save, per-save extra memory
    stallers = [n for n in peer_names if PEERS[n].stall is not None]
    if stallers:
        print("first saves:", end="", flush=True)
        for name in stallers:
            r = PEERS[name].stall(ctx, 0)
            series[name] = {"first": r, "extra_bytes": [r["extra_bytes"]]}
            print(f" | {name} stall {r['stall_s']:.2f}s", end="", flush=True)
        print(flush=True)
    for rep in range(ctx.reps):
        print(f"rep {rep + 1}/{ctx.reps}:", end="", flush=True)
        for name, fn in FLOORS.items():
            seconds, n = fn(ctx)
            floors.setdefault(name, Sample([], n)).seconds.append(seconds)
            print(f" {name} {seconds:.2f}s", end="", flush=True)
        for name in peer_names:
            peer = PEERS[name]
            ops = peers.setdefault(name, {})
            if peer.save is not None:
                save_s, load_s = run_peer_once(ctx, name, peer, check=rep == 0)
                ops.setdefault("save", Sample([], ctx.nbytes)).seconds.append(save_s)
                ops.setdefault("load", Sample([], ctx.nbytes)).seconds.append(load_s)
                print(f" | {name} save {save_s:.2f}s load {load_s:.2f}s", end="", flush=True)
        for name in stallers:
            peer, ops = PEERS[name], peers[name]
            r = peer.stall(ctx, rep + 1)
            ops.setdefault("stall", Sample([], ctx.nbytes)).seconds.append(r["stall_s"])
            ops.setdefault("durable", Sample([], ctx.nbytes)).seconds.append(r["durable_s"])
            series[name]["extra_bytes"].append(r["extra_bytes"])
            print(f" | {name} stall {r['stall_s']:.2f}s", end="", flush=True)
            if peer.restore is not None:
                for op, seconds in peer.restore(ctx, rep + 1, rep == 0).items():
                    ops.setdefault(op, Sample([], ctx.nbytes)).seconds.append(seconds)
                    print(f" {op} {seconds:.2f}s", end="", flush=True)
        print(flush=True)
    return floors, peers, series


# --------------------------------------------------------------------------- report


def fs_type(path: Path) -> str:
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, parts[2]
    return kind


def ratios(floors: dict[str, Sample], peers: dict[str, dict[str, Sample]],
           series: dict | None = None, nbytes: int = 1) -> dict:
    out = {}
    if "save" in peers.get("cairn", {}) and "save" in peers.get("dcp", {}):
        out["cairn_save_time / dcp_save_time"] = {
            "value": peers["cairn"]["save"].median / peers["dcp"]["save"].median,
            "target": "<= 0.5",
            "met": peers["cairn"]["save"].median <= 0.5 * peers["dcp"]["save"].median,
        }
        out["cairn_load_time / dcp_load_time"] = {
            "value": peers["cairn"]["load"].median / peers["dcp"]["load"].median,
            "target": "<= 0.5",
            "met": peers["cairn"]["load"].median <= 0.5 * peers["dcp"]["load"].median,
        }
    if "save" in peers.get("cairn", {}) and "direct-I/O write" in floors:
        v = peers["cairn"]["save"].gbps / floors["direct-I/O write"].gbps
        out["cairn_save_bw / direct_write_bw"] = {"value": v, "target": ">= 0.8", "met": v >= 0.8}
    if "save" in peers.get("cairn", {}) and "direct-I/O read" in floors:
        v = peers["cairn"]["load"].gbps / floors["direct-I/O read"].gbps
        out["cairn_load_bw / direct_read_bw"] = {"value": v, "target": "(info)", "met": None}
    mgr = peers.get("cairn.manager", {})
    ref = peers.get("dcp.async_save", {})
    if "stall" in mgr and "stall" in ref:
        v = mgr["stall"].median / ref["stall"].median
        out["manager_stall / dcp_async_save_stall"] = {"value": v, "target": "<= 0.5",
                                                       "met": v <= 0.5}
        v = mgr["durable"].median / ref["durable"].median
        out["manager_durable / dcp_async_save_durable"] = {"value": v, "target": "(info)",
                                                           "met": None}
    if "stall" in mgr and "memcpy" in floors:
        v = mgr["stall"].median / floors["memcpy"].median
        out["manager_stall / memcpy_floor"] = {"value": v, "target": "<= 1.25", "met": v <= 1.25}
    shm = peers.get("dcp.async_save+shm", {})
    if "stall" in shm and "stall" in ref:
        v = shm["stall"].median / ref["stall"].median
        out["shm_stager_stall / dcp_async_save_stall"] = {"value": v, "target": "(info)",
                                                          "met": None}
    if series and "cairn.manager" in series:
        per_save = series["cairn.manager"]["extra_bytes"]
        v = max(per_save) / nbytes
        out["manager_peak_extra_mem / state"] = {"value": v, "target": "<= 1.1", "met": v <= 1.1}
        v = (max(per_save) - min(per_save)) / nbytes
        out["manager_extra_mem_spread_over_saves / state"] = {
            "value": v, "target": "<= 0.05 (flat)", "met": v <= 0.05}
    if "restore memory" in mgr:
        v = mgr["restore disk (cold)"].median / mgr["restore memory"].median
        out["manager_restore_disk / restore_memory"] = {"value": v, "target": ">= 5",
                                                        "met": v >= 5}
    if "stock->cairn" in peers and "dcp" in peers:
        v = peers["stock->cairn"]["load"].median / peers["dcp"]["load"].median
        out["stock_ckpt_cairn_load_time / dcp_load_time"] = {
            "value": v,
            "target": "(info)",
            "met": None,
        }
    return out


def print_report(ctx: Context, meta: dict, floors, peers, series, rat) -> None:
    print()
    print(
        f"state {ctx.nbytes / GB:.2f} GB in {ctx.ntensors} tensors; scratch "
        f"{ctx.scratch} ({meta['scratch_fs']}); {ctx.reps} reps (medians); "
        f"cold reads: {'yes (page cache dropped)' if ctx.dropped else 'NO (warm cache)'}; "
        f"{meta['cpus']} CPUs, torch threads {meta['torch_threads']}, load average "
        f"{meta['loadavg_before'][0]:.1f} before / {meta['loadavg_after'][0]:.1f} after"
    )
    print(f"{'floor':<22}{'median s':>10}{'GB/s':>9}")
    for name, s in floors.items():
        print(f"{name:<22}{s.median:>10.3f}{s.gbps:>9.2f}")
    print()
    print(f"{'peer':<12}{'save s':>9}{'GB/s':>8}{'load s':>9}{'GB/s':>8}")
    for name, ops in peers.items():
        if "save" not in ops:
            continue
        sv, ld = ops["save"], ops["load"]
        print(f"{name:<12}{sv.median:>9.3f}{sv.gbps:>8.2f}{ld.median:>9.3f}{ld.gbps:>8.2f}")
    print()
    if series:
        print("repeated saves (medians of saves 2..; the first save apart); extra memory "
              "in GB and x state, per save, first save first")
        print(f"{'peer':<20}{'stall s':>9}{'durable s':>11}{'1st stall':>11}"
              f"{'1st durable':>13}  extra memory per save")
        for name, ser in series.items():
            ops, first = peers[name], ser["first"]
            per = " ".join(f"{b / GB:.2f}" for b in ser["extra_bytes"])
            peak = max(ser["extra_bytes"]) / ctx.nbytes
            print(f"{name:<20}{ops['stall'].median:>9.3f}{ops['durable'].median:>11.3f}"
                  f"{first['stall_s']:>11.3f}{first['durable_s']:>13.3f}  {per} "
                  f"(peak {peak:.2f}x)")
        print()
        for name, ops in peers.items():
            for op in ("restore memory", "restore disk (cold)"):
                if op in ops:
                    print(f"{name} {op:<22}{ops[op].median:>9.3f} s{ops[op].gbps:>8.2f} GB/s")
        for name, label in (("dcp", "dcp.load (cold)"), ("cairn", "cairn.Reader (cold)")):
            if "load" in peers.get(name, {}):
                print(f"reference {label:<24}{peers[name]['load'].median:>9.3f} s")
        print()
    for name, r in rat.items():
        met = "" if r["met"] is None else ("  met" if r["met"] else "  NOT met")
        print(f"{name:<44}{r['value']:>7.2f}   target {r['target']}{met}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.5, help="state size (default 1.5)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per figure")
    ap.add_argument(
        "--dir",
        default=str(REPO / "bench" / "results"),
        help="parent of the scratch directory (must be on the disk to measure)",
    )
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "checkpoint.json"))
    ap.add_argument(
        "--peers",
        default=",".join(DEFAULT_PEERS),
        help=f"comma-separated, from {list(PEERS)} (default: %(default)s)",
    )
    ap.add_argument(
        "--torch-threads",
        type=int,
        help="torch intra-op threads (default: torch's). On a machine whose cores "
        "are busy with other work, 1 avoids OpenMP spin-waits that slow every "
        "Tensor.copy_ (and so torch.load and dcp.load) several-fold",
    )
    ap.add_argument("--no-drop-caches", action="store_true")
    ap.add_argument("--allow-tmpfs", action="store_true", help="allow a RAM-backed scratch")
    args = ap.parse_args(argv)

    unknown = set(args.peers.split(",")) - set(PEERS)
    if unknown:
        ap.error(f"unknown peers {sorted(unknown)}; choose from {list(PEERS)}")
    parent = Path(args.dir)
    parent.mkdir(parents=True, exist_ok=True)
    kind = fs_type(parent)
    if kind in ("tmpfs", "ramfs") and not args.allow_tmpfs:
        ap.error(f"{parent} is on {kind}, not a disk; pass --dir on a real disk")

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    t_start = time.perf_counter()
    state = build_state(args.size_gb)
    ts = tensors(state)
    scratch = Path(tempfile.mkdtemp(prefix="cairn-bench-", dir=parent))
    ctx = Context(
        state=state,
        nbytes=sum(t.numel() * t.element_size() for t in ts),
        ntensors=len(ts),
        scratch=scratch,
        reps=args.reps,
        drop_caches=not args.no_drop_caches,
    )
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_before": os.getloadavg(),
        "scratch_fs": kind,
        "state_bytes": ctx.nbytes,
        "state_tensors": ctx.ntensors,
        "reps": ctx.reps,
    }
    print(f"state: {ctx.nbytes / GB:.2f} GB in {ctx.ntensors} tensors; scratch {scratch}")
    try:
        floors, peers, series = run_all(ctx, args.peers.split(","))
    finally:
        for close in ctx.closers:
            try:
                close()
            except Exception as e:  # noqa: BLE001 - report, keep cleaning up
                print(f"closing: {e}", file=sys.stderr)
        shutil.rmtree(scratch, ignore_errors=True)

    rat = ratios(floors, peers, series, ctx.nbytes)
    meta["cold_reads"] = ctx.dropped
    meta["loadavg_after"] = os.getloadavg()
    meta["wall_s"] = time.perf_counter() - t_start
    print_report(ctx, meta, floors, peers, series, rat)
    result = {
        "meta": meta,
        "floors": {k: v.as_json() for k, v in floors.items()},
        "peers": {p: {op: s.as_json() for op, s in ops.items()} for p, ops in peers.items()},
        "series": {
            p: {"first": ser["first"], "extra_bytes_per_save": ser["extra_bytes"],
                "extra_over_state_per_save": [b / ctx.nbytes for b in ser["extra_bytes"]],
                "memory_method": "peak(RssAnon + allocated bytes of the peer's /dev/shm "
                "files) during save..durable, 5 ms sampling, minus RssAnon before the "
                "peer's first save (malloc_trim before each)"}
            for p, ser in series.items()
        },
        "ratios": rat,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
