"""torchsnapshot 0.1.0 (https://pytorch.org/torchsnapshot): ``Snapshot.async_take``
returns a PendingSnapshot once the state is staged in host memory; ``wait()``
returns once it is written; ``Snapshot(path).restore(app_state)`` loads in place.
DDP: every rank takes part, ``replicated=["**"]`` writes replicated tensors once.
No memory tier: the fastest restore is from disk. torchsnapshot does not fsync what it
writes (no fsync in the package): ``wait()`` fsyncs the snapshot's files (counted)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
import torchsnapshot
from torchsnapshot import Snapshot, StateDict

from ._fsync import fsync_tree


class TorchSnapshotAsync:
    name = "torchsnapshot"
    version = torchsnapshot.__version__
    patch = None
    fastest_tier = "disk"

    def __init__(self, root: Path):
        self.root = Path(root) / "torchsnapshot"
        self.pending = None
        self.step = None

    def shm_dirs(self) -> list[str]:
        return []

    def _path(self, step: int) -> str:
        return str(self.root / f"step_{step}")

    def save(self, step: int, state: dict) -> None:
        self.pending = Snapshot.async_take(
            self._path(step), app_state={"s": StateDict(state)},
            replicated=["**"] if dist.is_initialized() else None)
        self.step = step

    def wait(self) -> None:
        self.pending.wait()
        self.pending = None
        if dist.is_initialized():
            dist.barrier()  # every rank's files are written
        if not dist.is_initialized() or dist.get_rank() == 0:
            fsync_tree(Path(self._path(self.step)))
            (self.root / "latest").write_text(str(self.step))  # the user's pointer

    def _latest(self) -> str:
        return self._path(int((self.root / "latest").read_text()))

    def restore(self, dest: dict) -> str:
        self.restore_disk(dest)
        return "disk"

    def restore_disk(self, dest: dict) -> None:
        Snapshot(self._latest()).restore(app_state={"s": StateDict(dest)})

    def close(self) -> None:
        if self.pending is not None:
            self.wait()
