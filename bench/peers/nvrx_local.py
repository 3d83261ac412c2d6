"""NVIDIA Resiliency Ext 0.4.1, checkpointing.local (docs: "Local Checkpointing" in
nvidia.github.io/nvidia-resiliency-ext): ``LocalCheckpointManager(root_local_ckpt_dir,
session_id, repl_strategy)`` saves every rank's state into a node-local directory
("local storage devices like SSDs or RAM disks"), optionally replicated to other
ranks (``CliqueReplicationStrategy``); ``save(sd, iteration, is_async=True)`` returns
an ``AsyncRequest`` that an ``AsyncCallsQueue`` runs in a helper process (its
``torch.save`` of the file, then a rename); finalizing it (``maybe_finalize_async_calls
(blocking=True)``) checks on every rank that the iteration is complete everywhere and
removes older iterations. ``find_latest()`` + ``load()`` restore the newest complete
iteration (from the replica of another rank where this rank's own file is gone).
The queue: its persistent caller (one spawned worker) on 1 rank; with replication
(2 ranks) its caller that forks a process per save, because the persistent one
cannot carry a replicated save (see ``__init__``).

Two placements of the local directory, two registry names:
* ``nvrx-local``: ``/dev/shm`` (its RAM-disk use: the memory tier it has; a file
  there survives the trainer's SIGKILL, not the node). "durable" = the iteration is
  finalized in that directory (nothing is on disk);
* ``nvrx-local-disk``: the benchmark's scratch directory on the local disk;
  ``wait()`` fsyncs the files after finalizing (torch.save does not), so "durable"
  = on local disk, as for the other peers.

The state the package gets is a ``TensorAwareStateDict``, its documented interface
for the user to implement. Its only implementation, ``BasicTensorAwareStateDict``,
asserts that every tensor is on CUDA and moves restored tensors to CUDA, so the
adapter implements the interface for CPU (``CpuTensorAwareStateDict`` below, a
subclass): ``copy_tensors_to_cpu`` must "store CPU copies of tensors ... without
destroying them", which for a CPU tensor means a ``clone()`` (``.to("cpu")``, what
the CUDA class does, would return the tensor itself: the no-copy race of
``nvrx_async``); ``restore_tensor_device`` leaves them on the CPU. The package also
rewrites the dict it is given in place (``pop_tensors`` replaces the tensors by
placeholders while replicating), so it gets a copy of the containers, never the
caller's. Replication (2 ranks): ``CliqueReplicationStrategy.from_replication_params(
replication_jump=1, replication_factor=2)`` (its default jump is
``torch.cuda.device_count()``, 0 here).

PATCH (CPU), the same as ``nvrx_async``: ``torch.cuda.synchronize`` -> no-op (called
by ``save(is_async=True)`` and the queue) and ``torch.cuda.current_device`` ->
``"cpu"`` (the queue's finalize all-reduce). Not patched, and so not benchmarked:
retrieving a rank's checkpoint from another rank's replica (``isend_state_dict`` /
``irecv_state_dict`` move every tensor through ``.cuda()``), which a restart on the
same node never needs (its own file is there).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
    BasicTensorAwareStateDict, dict_list_map_inplace)

from ._fsync import fsync_file
from .nvrx_async import PATCH, VERSION, _ensure_dist, apply_cpu_patch


def _containers(obj):
    """A copy of the dicts and lists of `obj`, sharing its tensors and other leaves."""
    if isinstance(obj, dict):
        return {k: _containers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_containers(v) for v in obj]
    return obj


class CpuTensorAwareStateDict(BasicTensorAwareStateDict):
    """``BasicTensorAwareStateDict`` for a state held in CPU memory (module level:
    the persistent queue pickles the request, and with it this object)."""

    def __init__(self, state_dict):  # the base class asserts is_cuda
        self.state_dict = state_dict
        self._is_hollow = False

    def copy_tensors_to_cpu(self, non_blocking=False):
        assert not self.is_hollow
        dict_list_map_inplace(
            lambda x: x.clone() if isinstance(x, torch.Tensor) else x, self.state_dict)

    def restore_tensor_device(self, non_blocking=True):
        pass  # they are where they belong


class NvrxLocal:
    name = "nvrx-local"
    version = VERSION
    patch = PATCH
    fastest_tier = "local (RAM disk: /dev/shm)"
    on_shm = True
    has_disk_tier = False  # its directory is in /dev/shm: no disk copy to read cold

    def __init__(self, root: Path):
        apply_cpu_patch()
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
            LocalCheckpointManager)
        from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
            CliqueReplicationStrategy)

        self.root = Path(root) / "nvrx-local"
        self.root.mkdir(parents=True, exist_ok=True)
        _ensure_dist(self.root)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.on_shm:
            # Named after the run's root, so that the restarted process finds it.
            tag = hashlib.sha1(str(self.root.resolve()).encode()).hexdigest()[:12]
            self.local_dir = Path("/dev/shm") / f"cairn-peers-nvrx-{tag}"
        else:
            self.local_dir = self.root / "local"
        repl = None
        if self.world > 1:
            repl = CliqueReplicationStrategy.from_replication_params(
                replication_jump=1, replication_factor=2)
        self.mgr = LocalCheckpointManager(self.local_dir, session_id="bench",
                                          repl_strategy=repl)
        # Its persistent queue (a spawned worker fed through a multiprocessing queue)
        # pickles the request, whose save function is a method of the manager; with
        # replication the manager holds process groups, which do not pickle: the
        # queue's feeder thread prints the TypeError and the save never completes
        # (seen here on 2 ranks: the trainer waits forever). So with replication the
        # queue's other caller, a process forked per save, is used.
        self.queue_kind = "persistent" if repl is None else "fork per save"
        self.queue = AsyncCallsQueue(persistent=repl is None)
        self.step = None

    def shm_dirs(self) -> list[str]:
        return [str(self.local_dir)] if self.on_shm else []

    def save(self, step: int, state: dict) -> None:
        req = self.mgr.save(CpuTensorAwareStateDict(_containers(state)), step, is_async=True)
        self.queue.schedule_async_request(req)
        self.step = step

    def wait(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True)
        if not self.on_shm:
            # This iteration's files (its own and the replicas it holds) and the
            # directory; not the whole tree: finalizing has just started removing
            # the older iterations in a thread of its own.
            d = Path(self.mgr.local_ckpt_dir)
            for f in d.glob(self.mgr._filename_from_template(self.step, "*")):
                fsync_file(f)
            fsync_file(d)

    def _load(self, dest: dict) -> int:
        from . import copy_into

        self.mgr.latest_iteration = -1  # no cached answer: ask every rank's directory
        it = self.mgr.find_latest()
        if it < 0:
            raise RuntimeError(f"nvrx-local: no complete checkpoint in {self.local_dir}")
        sd, _ = self.mgr.load()
        copy_into(dest, sd.state_dict)
        return it

    def restore(self, dest: dict) -> str:
        self._load(dest)
        return "local (/dev/shm)" if self.on_shm else "local disk"

    def restore_disk(self, dest: dict) -> None:
        if not self.has_disk_tier:
            raise NotImplementedError("nvrx-local keeps no copy on disk")
        self._load(dest)

    def close(self) -> None:
        self.queue.close()


class NvrxLocalDisk(NvrxLocal):
    name = "nvrx-local-disk"
    fastest_tier = "local disk"
    on_shm = False
    has_disk_tier = True
