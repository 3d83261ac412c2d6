"""CheckpointManager.prepare(): the first save's shared memory is created and
pre-faulted in the background after restore(), sized from the state or the
restored checkpoint."""

from __future__ import annotations

import glob
import os

import pytest
import torch

import cairn

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def slot_files(mgr) -> dict[str, int]:
    return {os.path.relpath(p, mgr.shm_dir): os.stat(p).st_size
            for p in glob.glob(os.path.join(mgr.shm_dir, "slot*", "data", "*.bin"))}


def test_restore_with_nothing_prefaults_a_slot_sized_for_the_state(tmp_path):
    state = {"w": torch.randn(1 << 20), "b": torch.randn(3)}
    with cairn.CheckpointManager(tmp_path / "root") as mgr:
        assert slot_files(mgr) == {}
        assert mgr.restore(state) is None
        mgr.wait()
        (size,) = slot_files(mgr).values()
        assert size >= (1 << 20) * 4 + 12
        mgr.save(1, state)
        mgr.wait()
        # The second of the two default slots is pre-faulted once step 1 committed;
        # the save of step 2 waits for it and stages there.
        mgr.save(2, state)
        mgr.wait()
        assert list(slot_files(mgr).values()) == [size, size]  # no save grew a slot


def test_restore_from_disk_prefaults_the_restored_size(tmp_path):
    state = {"w": torch.randn(1 << 18)}
    with cairn.CheckpointManager(tmp_path / "root", memory=False) as mgr:
        mgr.save(3, state)
    with cairn.CheckpointManager(tmp_path / "root") as mgr:
        assert mgr.restore({"w": torch.zeros(1 << 18)}) == 3
        assert mgr.restored == (3, "durable")
        mgr.wait()
        (size,) = slot_files(mgr).values()
        assert size >= (1 << 18) * 4


def test_memory_false_prefaults_nothing(tmp_path):
    with cairn.CheckpointManager(tmp_path / "root", memory=False) as mgr:
        mgr.restore({"w": torch.randn(1000)})
        mgr.wait()
        assert slot_files(mgr) == {}
