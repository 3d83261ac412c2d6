"""NVIDIA Resiliency Ext 0.4.1, checkpointing.async_ckpt (docs: "Async checkpointing"
in nvidia.github.io/nvidia-resiliency-ext): ``TorchAsyncCheckpoint`` schedules
``torch.save`` of the state on an ``AsyncCallsQueue`` whose persistent worker
process writes it; ``finalize_async_save(blocking=True)`` waits for every rank.
Every rank saves its own file (the queue's finalization is a collective).

PATCH (CPU): the package is written for CUDA and calls ``torch.cuda.synchronize()``
and ``torch.device(torch.cuda.current_device())`` on this path even for CPU
tensors. ``apply_cpu_patch()`` replaces, in this process only and at run time,
``torch.cuda.synchronize`` by a no-op and ``torch.cuda.current_device`` by
``lambda: "cpu"`` (so its finalize collectives run on CPU tensors over gloo).
Nothing else is changed; the figures in bench/README.md say so.

FINDING (CPU): the scheduling step "preloads" tensors with ``t.to("cpu")``, which
for a CPU tensor is the tensor itself, and hands them to the worker through a
multiprocessing queue, which (from its feeder thread, after the call returned) moves
their storage into shared memory and sends it by reference rather than copying it. What the worker writes is whatever the tensors hold
when it gets to them: a change training makes after ``async_save`` returned may or may
not reach the file (a race; both seen), see ``shares_tensors()``. Its stall is thus not a copy's; the figures mark it.

torch.save does not fsync: ``wait()`` fsyncs the file (counted in the figure)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from ._fsync import fsync_tree

try:
    from importlib.metadata import version as _v
    VERSION = _v("nvidia-resiliency-ext")
except Exception:  # pragma: no cover
    VERSION = "?"

PATCH = ("torch.cuda.synchronize -> no-op, torch.cuda.current_device -> 'cpu' "
         "(monkeypatched in the benchmark process at run time)")


def apply_cpu_patch() -> None:
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"


def _ensure_dist(root: Path) -> None:
    """The queue needs a process group; a 1-rank job gets a gloo group of one."""
    if not dist.is_initialized():
        store = dist.FileStore(str(root / "nvrx.store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


class NvrxAsync:
    name = "nvrx"
    version = VERSION
    patch = PATCH
    fastest_tier = "disk"

    def __init__(self, root: Path):
        apply_cpu_patch()
        from nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt import (
            TorchAsyncCheckpoint)

        self.root = Path(root) / "nvrx"
        self.root.mkdir(parents=True, exist_ok=True)
        _ensure_dist(self.root)
        self.rank = dist.get_rank()
        self.ckpt = TorchAsyncCheckpoint(persistent_queue=True)
        self.step = None

    def shm_dirs(self) -> list[str]:
        return []

    def _path(self, step: int) -> Path:
        return self.root / f"step_{step}" / f"rank_{self.rank}.pt"

    def save(self, step: int, state: dict) -> None:
        self._path(step).parent.mkdir(parents=True, exist_ok=True)
        self.ckpt.async_save(state, str(self._path(step)))
        self.step = step

    def wait(self) -> None:
        self.ckpt.finalize_async_save(blocking=True, no_dist=False)
        fsync_tree(self._path(self.step).parent)
        dist.barrier()
        if self.rank == 0:
            (self.root / "latest").write_text(str(self.step))

    def restore(self, dest: dict) -> str:
        self.restore_disk(dest)
        return "disk"

    def restore_disk(self, dest: dict) -> None:
        from . import copy_into
        step = int((self.root / "latest").read_text())
        copy_into(dest, torch.load(self._path(step), map_location="cpu", weights_only=False))

    def close(self) -> None:
        self.ckpt.finalize_async_save(blocking=True, no_dist=False, terminate=True)


def shares_tensors(root: Path) -> dict:
    """How NVRx's CPU queue hands a tensor to its worker: {"same_storage": its
    "preload" returns the caller's storage itself (no copy), "moved_to_shm": whether,
    right after async_save() returned, the caller's tensor is already in shared memory
    (the queue's feeder thread pickles it later, so often not yet), "change_reached_file": whether a change made right after
    async_save() returned is in the file (a race with the worker: either outcome has
    been seen)}."""
    from nvidia_resiliency_ext.checkpointing.utils import preload_tensors

    a = NvrxAsync(root)
    try:
        t = torch.zeros(1 << 22)
        same = preload_tensors({"t": t})["t"].data_ptr() == t.data_ptr()
        a.save(1, {"t": t})
        moved = t.is_shared()
        t.add_(1.0)  # training changes the state after the save returned
        a.wait()
        saved = torch.load(a._path(1), weights_only=False)["t"]
        return {"same_storage": same, "moved_to_shm": moved,
                "change_reached_file": bool(saved.eq(1.0).any())}
    finally:
        a.close()
