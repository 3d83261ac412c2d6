"""cairn: CheckpointManager(root, memory=True) (docs/manager.md): save() stages into
the node's shared-memory slot and returns; the durable tier is written in the
background; a restarted process's manager restores from the memory tier."""

from __future__ import annotations

from pathlib import Path

import cairn


class CairnManager:
    name = "cairn"
    version = getattr(cairn, "__version__", "tree")
    patch = None
    fastest_tier = "memory (/dev/shm slot)"

    def __init__(self, root: Path):
        self.root = Path(root)
        self.mgr = cairn.CheckpointManager(self.root / "cairn", memory=True, keep=1)

    def shm_dirs(self) -> list[str]:
        return [self.mgr.shm_dir]

    def save(self, step: int, state: dict) -> None:
        self.mgr.save(step, state)

    def wait(self) -> None:
        self.mgr.wait()

    def restore(self, dest: dict) -> str:
        step = self.mgr.restore(dest)
        if step is None:
            raise RuntimeError("cairn restored nothing")
        return self.mgr.restored[1]

    def restore_disk(self, dest: dict) -> None:
        # Timed from the manager's construction to restore()'s return, as a restarted
        # job's start is; its close() comes with the session's (close() first waits
        # for the next save's planning, which restore() left to the background, and
        # is no more part of a restore than the fast tier's close is).
        self._disk = cairn.CheckpointManager(self.root / "cairn", memory=False, keep=1)
        if self._disk.restore(dest) is None or self._disk.restored[1] != "durable":
            raise RuntimeError(f"cairn disk restore: {self._disk.restored}")

    def close(self) -> None:
        disk, self._disk = getattr(self, "_disk", None), None
        if disk is not None:
            disk.close()
        self.mgr.close()
