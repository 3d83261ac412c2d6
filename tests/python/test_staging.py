"""The shared-memory staging pool seen from Python (cairn._ext.StagingPool)."""

import os
import shutil
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest
import torch

from cairn import _ext
from cairn import errors


@pytest.fixture
def shm_dir():
    d = _ext.shm_directory(f"cairn-pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def make_state(seed=0, n=20):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(1000 + 37 * i, generator=g) for i in range(n)}


def layout(state):
    """(name, offset, nbytes) with 4 KiB aligned offsets, and the total."""
    out, off = [], 0
    for name, t in state.items():
        out.append((name, off, t.nbytes))
        off += (t.nbytes + 4095) // 4096 * 4096
    return out, off


def test_copy_in_stages_tensors_into_shared_memory(shm_dir):
    state = make_state()
    items, total = layout(state)
    with _ext.StagingPool(shm_dir, num_slots=2, threads=2) as pool:
        slot = pool.acquire(total)
        assert slot["capacity"] >= total
        pool.copy_in(slot["index"], [(state[n].data_ptr(), off, nb) for n, off, nb in items])
        buf = pool.buffer(slot["index"])
        assert buf.ctypes.data == slot["address"]
        staged = torch.frombuffer(buf, dtype=torch.uint8)
        for name, off, nb in items:
            assert torch.equal(staged[off:off + nb].view(torch.float32), state[name])
        # The bytes are the shared file's bytes.
        with open(slot["path"], "rb") as f:
            f.seek(items[3][1])
            assert f.read(items[3][2]) == state["t3"].numpy().tobytes()
        del staged, buf


def test_copy_out_restores_tensors(shm_dir):
    state = make_state(1)
    items, total = layout(state)
    with _ext.StagingPool(shm_dir, num_slots=1) as pool:
        idx = pool.acquire(total)["index"]
        pool.copy_in(idx, [(state[n].data_ptr(), off, nb) for n, off, nb in items])
        restored = {n: torch.empty_like(t) for n, t in state.items()}
        pool.copy_out(idx, [(restored[n].data_ptr(), off, nb) for n, off, nb in items])
        for n in state:
            assert torch.equal(restored[n], state[n])


def test_checksums_are_xxh3_per_block(shm_dir):
    with _ext.StagingPool(shm_dir, num_slots=1) as pool:
        slot = pool.acquire(3 << 20)
        buf = pool.buffer(slot["index"])
        buf[:] = np.random.default_rng(0).integers(0, 256, buf.size, dtype=np.uint8)
        sums = pool.checksums(slot["index"], 100, (2 << 20) + 5, block_size=1 << 20)
        assert len(sums) == 3
        for i, s in enumerate(sums):
            start = 100 + (i << 20)
            end = min(start + (1 << 20), 100 + (2 << 20) + 5)
            assert s == _ext.checksum(buf[start:end].tobytes())
            assert s == _ext.checksum_address(slot["address"] + start, end - start)
        assert _ext.block_checksums_address(slot["address"] + 100, (2 << 20) + 5, 1 << 20) == sums
        with pytest.raises(errors.InvalidArgumentError):
            pool.checksums(slot["index"], slot["capacity"] - 10, 100)
        del buf
    assert _ext.checksum(b"") == 0x2D06800538D394C2  # XXH3-64 of nothing, seed 0
    assert _ext.CHECKSUM_BLOCK_SIZE == 16 << 20


def test_repeated_saves_reuse_the_same_memory(shm_dir):
    state = make_state(2)
    items, total = layout(state)
    with _ext.StagingPool(shm_dir, num_slots=2) as pool:
        seen = set()
        footprints = set()
        for step in range(6):
            slot = pool.acquire(total)
            pool.copy_in(slot["index"], [(state[n].data_ptr(), o, nb) for n, o, nb in items])
            seen.add((slot["index"], slot["address"]))
            footprints.add(pool.footprint)
            pool.release(slot["index"])
        # Two slots used in turn (least recently released first), never remapped.
        assert len(seen) == 2
        assert len(footprints) <= 2 and max(footprints) == 2 * slot["capacity"]


def test_busy_slots_are_not_handed_out(shm_dir):
    with _ext.StagingPool(shm_dir, num_slots=2) as pool:
        a = pool.acquire(1)
        b = pool.acquire(1)
        assert a["index"] != b["index"]
        with pytest.raises(errors.ResourceExhaustedError):
            pool.acquire(1)
        with pytest.raises(errors.PreconditionError):
            pool.acquire_slot(a["index"])
        pool.release(b["index"])
        assert pool.acquire(1)["index"] == b["index"]
        assert pool.in_use(a["index"])


def test_bad_copy_spans_raise(shm_dir):
    with _ext.StagingPool(shm_dir, num_slots=1) as pool:
        slot = pool.acquire(1 << 20)
        t = torch.ones(100)
        with pytest.raises(errors.InvalidArgumentError):
            pool.copy_in(slot["index"], [(t.data_ptr(), slot["capacity"] - 8, t.nbytes)])
        pool.release(slot["index"])
        with pytest.raises(errors.PreconditionError):
            pool.copy_in(slot["index"], [(t.data_ptr(), 0, t.nbytes)])
    with pytest.raises(errors.InvalidArgumentError):
        _ext.StagingPool("relative/path")


def test_growing_a_slot_under_a_live_buffer_is_refused(shm_dir):
    with _ext.StagingPool(shm_dir, num_slots=1) as pool:
        idx = pool.acquire(1 << 20)["index"]
        view = torch.frombuffer(pool.buffer(idx), dtype=torch.uint8)
        pool.release(idx)
        with pytest.raises(errors.PreconditionError, match="still alive"):
            pool.acquire(8 << 20)
        assert pool.acquire(1 << 20)["index"] == idx  # no growth: fine
        pool.release(idx)
        del view
        assert pool.live_buffers == 0
        assert pool.acquire(8 << 20)["capacity"] >= 8 << 20


def test_close_leaves_nothing_in_shared_memory_even_with_live_buffers(shm_dir):
    pool = _ext.StagingPool(shm_dir, num_slots=2)
    slot = pool.acquire(1 << 20)
    buf = pool.buffer(slot["index"])
    buf[:4] = [1, 2, 3, 4]
    pool.close()
    assert not os.path.exists(shm_dir)
    assert list(buf[:4]) == [1, 2, 3, 4]  # still mapped while referenced
    assert pool.live_buffers == 1
    del buf
    assert pool.live_buffers == 0
    with pytest.raises(errors.PreconditionError):
        pool.acquire(1)
    pool.close()  # idempotent


def test_staged_bytes_survive_a_killed_process(shm_dir):
    child = textwrap.dedent(f"""
        import os, signal, torch
        from cairn import _ext
        pool = _ext.StagingPool({shm_dir!r}, rank=0, num_slots=2)
        slot = pool.acquire_slot(1, 1 << 20)
        t = torch.arange(1000, dtype=torch.float64)
        pool.copy_in(1, [(t.data_ptr(), 4096, t.nbytes)])
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", child], env=env)
    assert proc.returncode == -9
    pool = _ext.StagingPool(shm_dir, rank=0, num_slots=2)
    slot = pool.acquire_slot(1)  # map what the dead process staged
    got = torch.empty(1000, dtype=torch.float64)
    pool.copy_out(1, [(got.data_ptr(), 4096, got.nbytes)])
    assert torch.equal(got, torch.arange(1000, dtype=torch.float64))
    assert slot["capacity"] >= 1 << 20
    pool.close()
    assert not os.path.exists(shm_dir)


def test_two_ranks_share_a_directory(shm_dir):
    r0 = _ext.StagingPool(shm_dir, rank=0, num_slots=1)
    r1 = _ext.StagingPool(shm_dir, rank=1, num_slots=1)
    s0, s1 = r0.acquire(4096), r1.acquire(4096)
    assert s0["path"].endswith("slot0/data/r0.bin")
    assert s1["path"].endswith("slot0/data/r1.bin")
    r0.close()
    assert os.path.exists(s1["path"]) and not os.path.exists(s0["path"])
    r1.close()
    assert not os.path.exists(shm_dir)


def _rank_worker(rank, root, barrier, rounds):
    import torch as _torch

    from cairn import _ext as ext

    for i in range(rounds):
        pool = ext.StagingPool(root, rank=rank, num_slots=2)
        t = _torch.full((1 << 18,), float(rank + i))
        for _ in range(2):
            slot = pool.acquire(t.nbytes)
            pool.copy_in(slot["index"], [(t.data_ptr(), 0, t.nbytes)])
        barrier.wait()
        pool.close()  # both ranks close at the same moment
        barrier.wait()
        assert not os.path.exists(root), f"round {i}: {os.listdir(root)}"
        barrier.wait()  # before the next round re-creates it


def test_ranks_closing_concurrently_leave_nothing(shm_dir):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    mp.spawn(_rank_worker, args=(shm_dir, barrier, 5), nprocs=2, join=True)
    assert not os.path.exists(shm_dir)
