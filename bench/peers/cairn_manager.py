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
        disk = cairn.CheckpointManager(self.root / "cairn", memory=False, keep=1)
        try:
            if disk.restore(dest) is None or disk.restored[1] != "durable":
                raise RuntimeError(f"cairn disk restore: {disk.restored}")
        finally:
            disk.close()

    def close(self) -> None:
        self.mgr.close()
