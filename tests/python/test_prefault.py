"""CheckpointManager.prepare(): the first save's shared memory is created and
pre-faulted in the background after restore(), sized from the state or the
restored checkpoint."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import cairn

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
        # Every save durable (the default): step 2 reuses the pre-faulted slot.
        mgr.save(2, state)
        mgr.wait()
        assert list(slot_files(mgr).values()) == [size]  # no save grew it


def test_default_config_keeps_one_slot_and_memory_only_saves_a_second(tmp_path):
    """The memory tier's footprint (docs/memory.md, "The restore contract"): with
    every save durable one slot file exists, across saves and a restart's restore;
    a memory-only save keeps its slot, so the next save stages into a second one,
    pre-faulted once the memory-only step committed."""
    state = {"w": torch.randn(1 << 18)}
    root = str(tmp_path / "root")
    # A run that saves steps 1-4 (durable, one slot file) and is SIGKILLed.
    seed = textwrap.dedent('''
        import glob, os, signal, sys, torch, cairn
        m = cairn.CheckpointManager(sys.argv[1])
        for step in range(1, 5):
            m.save(step, {"w": torch.ones(1 << 18)})
            m.wait()
            files = glob.glob(os.path.join(m.shm_dir, "slot*", "data", "*.bin"))
            assert len(files) == 1, files
        os.kill(os.getpid(), signal.SIGKILL)
    ''')
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", seed, root], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == -9, r.stderr
    with cairn.CheckpointManager(root) as mgr:
        assert mgr.restore({"w": torch.zeros(1 << 18)}) == 4
        assert mgr.restored == (4, "memory")
        for step in (5, 6):
            mgr.save(step, state)
            mgr.wait()
            assert len(slot_files(mgr)) == 1
        (size,) = slot_files(mgr).values()
        mgr.save(7, state, durable=False)
        mgr.wait()
        assert mgr._join_prefault_job()  # queued behind step 7's persistence
        # Step 7 is in memory only: its slot is kept, the other one is pre-faulted.
        assert list(slot_files(mgr).values()) == [size, size]
        kept = {t: s for s, t, _ in mgr.candidates()}
        mgr.save(8, state, durable=False)  # stages into the second slot
        mgr.wait()
        assert sorted(s for s, t, _ in mgr.candidates() if t == "memory") == [7, 8]
        assert kept["durable"] == 6


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
