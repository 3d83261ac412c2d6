"""DLRover 0.6.1 Flash Checkpoint (dlrover/trainer/torch/flash_checkpoint, docs:
docs/blogs/flash_checkpoint.md): ``DdpCheckpointer(dir).save_checkpoint(step, state,
storage_type=StorageType.DISK)`` copies the state into shared memory (local rank 0
only: DDP's state is replicated) and returns; a saver process (forked by local
rank 0 under plain python/torchrun, the agent under ``dlrover-run``) writes it with
torch.save and then the tracker file ``dlrover_latest.txt``.
``load_checkpoint()`` reads the shared memory first, else the newest file.

Durable: the saver fsyncs the tracker file but not the ``.pt`` it wrote
(storage.PosixDiskStorage.write_state_dict calls torch.save as is), so ``wait()``
polls the tracker every 5 ms (its own ``wait_latest_checkpoint`` polls every 3 s)
and then fsyncs the checkpoint directory's files; that fsync is in the figure.
Restore from memory after a SIGKILL needs ``dlrover-run`` (its agent keeps the
shared memory); under plain python the restarted process's new saver starts with
empty shared memory, so ``restore`` reports the tier it actually read.
``DlroverFlashAgent`` ("dlrover-run") is this adapter run by bench/peers.py under
``dlrover-run`` with DLRover's local master (its ``--standalone`` mode fails on
torch 2.13: ``SubprocessHandler.__init__() missing ... 'numa_options'``).

How ``restore`` knows the state came from memory: it reads it with the engine's
``get_state_dict_from_memory()`` (the shared memory segment, no file) while the
checkpoint's step directory is renamed away, so no file of that step can be read
(rank 0 renames it, every rank reads, rank 0 renames it back), and the harness then
compares every restored tensor with the state that was saved. An empty answer
(no shared memory: plain python) falls back to the file, reported as "disk"."""

from __future__ import annotations

import os
import time
from pathlib import Path

import dlrover  # noqa: F401
import torch
import torch.distributed as dist
from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer
# The saver process (forked at DdpCheckpointer()) imports this module once it is told
# which saver to create, and the trainer gives it 60 s to open its sockets; on a loaded
# machine that import alone can take longer. Imported here, the fork inherits it.
import dlrover.python.elastic_agent.torch.ckpt_saver  # noqa: F401,E402

from ._fsync import fsync_tree

try:
    from importlib.metadata import version as _v
    VERSION = _v("dlrover")
except Exception:  # pragma: no cover
    VERSION = "?"


def _unwrap(sd: dict) -> dict:
    return sd.get("model_states", sd) if isinstance(sd, dict) else sd


class DlroverFlash:
    name = "dlrover"
    version = VERSION
    patch = None
    fastest_tier = "memory (/dev/shm), only under dlrover-run"
    open_before_state = True  # see bench/peers/worker.py main()

    def __init__(self, root: Path):
        self.root = Path(root) / "dlrover"
        self.root.mkdir(parents=True, exist_ok=True)
        self.ckpt = DdpCheckpointer(str(self.root))
        self.step = None
        self.evidence = None

    def shm_dirs(self) -> list[str]:
        return ["/dev/shm"]  # its segments are named by local rank, not by run

    def save(self, step: int, state: dict) -> None:
        self.ckpt.save_checkpoint(step, state, storage_type=StorageType.DISK)
        self.step = step

    def wait(self) -> None:
        tracker = self.root / "dlrover_latest.txt"
        deadline = time.monotonic() + 600
        while True:
            try:
                if int(tracker.read_text().strip() or -1) == self.step:
                    break
            except (FileNotFoundError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"dlrover did not persist step {self.step}")
            time.sleep(0.005)
        if not dist.is_initialized() or dist.get_rank() == 0:
            fsync_tree(self.root / str(self.step))
        if dist.is_initialized():
            dist.barrier()

    def restore(self, dest: dict) -> str:
        engine = self.ckpt._engine
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        tracker = self.root / "dlrover_latest.txt"
        step_dir = self.root / tracker.read_text().strip()
        hidden = step_dir.with_name(step_dir.name + ".hidden-during-memory-restore")
        if rank0:
            step_dir.rename(hidden)  # what the memory read returns cannot be this file
        if dist.is_initialized():
            dist.barrier()
        try:
            step, sd = engine.get_state_dict_from_memory()
        finally:
            if dist.is_initialized():
                dist.barrier()
            if rank0:
                hidden.rename(step_dir)
            if dist.is_initialized():  # no rank reads the files before they are back
                dist.barrier()
        if sd:
            from . import copy_into
            copy_into(dest, _unwrap(sd[list(sd)[0]]) if len(sd) == 1 else _unwrap(sd))
            self.evidence = (f"step {step} from get_state_dict_from_memory() while "
                             f"{step_dir.name}/ was renamed away")
            return "memory"
        self.restore_disk(dest)
        return "disk"

    def restore_disk(self, dest: dict) -> None:
        from . import copy_into
        step = int((self.root / "dlrover_latest.txt").read_text().strip())
        sd = torch.load(self.root / str(step) / "rank_0.pt", map_location="cpu",
                        weights_only=False)
        copy_into(dest, _unwrap(sd))

    def close(self) -> None:
        try:
            self.ckpt._engine.close()
        except Exception:
            pass


class DlroverFlashAgent(DlroverFlash):
    """The same adapter; bench/peers.py runs its session under ``dlrover-run`` (its
    agent hosts the saver and the shared memory, and restarts the SIGKILLed worker)
    with DLRover's local master."""

    name = "dlrover-run"
    fastest_tier = "memory (/dev/shm, kept by the dlrover-run agent)"
