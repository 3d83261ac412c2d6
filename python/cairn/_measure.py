"""Measuring pieces shared by ``bench/checkpoint.py`` and ``cairn bench``.

The reference state, repeated timings, and the machine's floors: the copy floor
(the faster of a single-threaded memcpy of the whole state into a pre-faulted
buffer and torch's own ``Tensor.copy_`` of the same tensors into pre-faulted ones)
and the disk's direct-I/O floors (an O_DIRECT write, and fio-style parallel
O_DIRECT reads: ``READ_STREAMS`` threads, each with its own aligned 16 MiB buffer,
reading interleaved 16 MiB blocks of one file, what ``fio --rw=read --direct=1
--numjobs=8 --offset_increment`` does; our own reader, so no fio is needed).

A floor is a function ``(ctx) -> (seconds, bytes)``, where ``ctx`` has ``nbytes``,
``state``, ``scratch`` (a local directory) and ``cold()`` (drops the page cache
where permitted).
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import mmap
import os
import shutil
import statistics
import threading
import time
from pathlib import Path

import torch

GB = 1e9
DIRECT_CHUNK = 16 << 20
READ_STREAMS = 8

try:
    _LIBC = ctypes.CDLL(None)
    _MALLOC_TRIM = _LIBC.malloc_trim
except (OSError, AttributeError):  # not glibc
    _MALLOC_TRIM = None


def trim() -> None:
    """Returns freed heap pages to the system (glibc), so memory figures are honest."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


# --------------------------------------------------------------------------- state


def build_state(size_gb: float, layers: int = 16, seed: int = 0) -> dict:
    """A GPT-like model + Adam state totalling ~size_gb, as nested state dicts.

    Per layer: qkv (d x 3d), proj (d x d), fc1 (4d x d), fc2 (d x 4d) weights;
    plus an embedding and an output head (4d x d each). Each parameter has
    exp_avg and exp_avg_sq of its shape, so 3 x 66 = 198 tensors (+ 66 step
    scalars). float32 throughout.
    """
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


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(state))


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
        return {"median_s": self.median, "seconds": self.seconds, "bytes": self.nbytes,
                "GBps": self.gbps}


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


def drop_caches() -> bool:
    """sync, then drops the page cache; False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- floors


def _aligned_buffer(size: int) -> mmap.mmap:
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    chunk = os.urandom(1 << 20)
    for off in range(0, size, len(chunk)):
        buf[off: off + len(chunk)] = chunk[: size - off]
    return buf


def floor_memcpy(ctx) -> tuple[float, int]:
    """One single-threaded memcpy of as many bytes as the whole state between two
    pre-faulted buffers."""
    n = ctx.nbytes
    src = torch.empty(n, dtype=torch.uint8).fill_(7)
    dst = torch.empty(n, dtype=torch.uint8).fill_(0)
    t0 = time.perf_counter()
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
    seconds = time.perf_counter() - t0
    del src, dst
    trim()
    return seconds, n


def floor_tensor_copy(ctx) -> tuple[float, int]:
    """torch's own ``Tensor.copy_`` of every tensor of the state into a pre-faulted
    tensor of its shape (intra-op threads as torch is configured)."""
    dst = like(ctx.state)
    pairs = list(zip(tensors(ctx.state), tensors(dst)))
    t0 = time.perf_counter()
    for s, d in pairs:
        d.copy_(s)
    seconds = time.perf_counter() - t0
    del dst, pairs
    trim()
    return seconds, ctx.nbytes


def _direct_file(ctx) -> tuple[Path, int]:
    n = (ctx.nbytes + DIRECT_CHUNK - 1) // DIRECT_CHUNK * DIRECT_CHUNK
    return Path(ctx.scratch) / "direct-io.bin", n


def floor_direct_write(ctx) -> tuple[float, int]:
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


def parallel_direct_read(path: Path, n: int, streams: int = READ_STREAMS) -> float:
    """Seconds to read the first `n` bytes (a multiple of 16 MiB) of `path` with
    O_DIRECT by `streams` threads, each reading every `streams`-th 16 MiB block
    into its own aligned buffer (os.preadv releases the GIL)."""
    errors: list[BaseException] = []
    bufs = [_aligned_buffer(DIRECT_CHUNK) for _ in range(streams)]
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    start = threading.Barrier(streams + 1)

    def run(i: int) -> None:
        start.wait()
        try:
            for off in range(i * DIRECT_CHUNK, n, streams * DIRECT_CHUNK):
                if os.preadv(fd, [bufs[i]], off) != DIRECT_CHUNK:
                    raise OSError("short direct read")
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    try:
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        for b in bufs:
            b.close()
    if errors:
        raise errors[0]
    return seconds


def floor_direct_read(ctx) -> tuple[float, int]:
    """Parallel O_DIRECT reads (see the module docstring), cold, of the file the
    write floor just wrote (then removed)."""
    path, n = _direct_file(ctx)
    ctx.cold()
    seconds = parallel_direct_read(path, n)
    remove(path)
    return seconds, n


def copy_floor(floors: dict[str, Sample]) -> tuple[str, Sample]:
    """The faster of the memcpy and Tensor.copy_ floors: (name, sample)."""
    names = [k for k in ("memcpy", "Tensor.copy_") if k in floors]
    best = min(names, key=lambda k: floors[k].median)
    return best, floors[best]
