"""Measuring pieces shared by ``bench/checkpoint.py`` and ``cairn bench``.

The reference state, repeated timings, and the machine's floors: the copy floor
(the faster of a single-threaded memcpy of the whole state into a pre-faulted
buffer and torch's own ``Tensor.copy_`` of the same tensors into pre-faulted ones)
and the disk's direct-I/O floors (an O_DIRECT write, and fio-style parallel
O_DIRECT reads). The memcpy and direct-I/O floors run in C++ without the GIL
(``include/cairn/floors.h`` says what each one times); only torch's own copy is
measured here.

A floor is a function ``(ctx) -> (seconds, bytes)`` (the direct-I/O floors, one
file written then read: ``(ctx) -> (write, read)``), where ``ctx`` has ``nbytes``,
``state``, ``scratch`` (a local directory), ``drop_caches`` (whether to try to
drop the page cache before reads) and ``dropped`` (set when a drop succeeded).
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import time
from pathlib import Path

import torch

from cairn import _ext, _reference_state

GB = 1e9
trim = _ext.trim_heap  # returns freed heap pages to the system, so memory figures are honest
drop_caches = _ext.drop_caches  # sync, then drops the page cache; False when not permitted


# --------------------------------------------------------------------------- state


def build_state(size_gb: float, layers: int = 16, seed: int = 0) -> dict:
    """The reference state (cairn._reference_state) totalling ~size_gb."""
    return _reference_state.build_state(size_gb * GB, layers=layers, seed=seed)


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


def floor_memcpy(ctx) -> tuple[float, int]:
    """One single-threaded memcpy of as many bytes as the whole state between two
    pre-faulted buffers."""
    return _ext.memcpy_floor(ctx.nbytes)


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


def floor_direct_io(ctx) -> tuple[tuple[float, int], tuple[float, int]]:
    """(write, read): O_DIRECT writes of a file as large as the state (rounded up to
    16 MiB) in ``ctx.scratch``, then parallel O_DIRECT reads of it, cold when the
    page cache can be dropped; the file is removed, even on error."""
    r = _ext.direct_io_floors(str(ctx.scratch), ctx.nbytes, drop_caches=ctx.drop_caches)
    ctx.dropped = ctx.dropped or r["cold"]
    return (r["write_s"], r["bytes"]), (r["read_s"], r["bytes"])


def copy_floor(floors: dict[str, Sample]) -> tuple[str, Sample]:
    """The faster of the memcpy and Tensor.copy_ floors: (name, sample)."""
    names = [k for k in ("memcpy", "Tensor.copy_") if k in floors]
    best = min(names, key=lambda k: floors[k].median)
    return best, floors[best]
