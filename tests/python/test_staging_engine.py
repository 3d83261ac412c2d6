"""The staging engine's Python side (cairn._staging.SlotStager over the C++
StagingPool), shared by the CheckpointManager and the SharedMemoryStager."""

import os
import shutil
import uuid
import warnings

import numpy as np
import pytest
import torch

import cairn
from cairn import _ext, _staging


@pytest.fixture
def pool():
    d = _ext.shm_directory(f"cairn-pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    p = _ext.StagingPool(d, num_slots=1, threads=2)
    yield p
    p.close()
    shutil.rmtree(d, ignore_errors=True)


def data_file_offsets(lengths):
    """docs/format.md: 4 KiB aligned, in order, empty items at 0."""
    out, end = [], 0
    for n in lengths:
        if n == 0:
            out.append(0)
            continue
        off = (end + 4095) // 4096 * 4096
        out.append(off)
        end = off + n
    return out


def test_stage_lays_items_out_as_a_data_file_and_copies_every_kind(pool):
    g = torch.Generator().manual_seed(1)
    sources = [torch.randn(300, 7, generator=g),
               torch.randn(20, 30, generator=g).t(),  # non-contiguous: copy_
               torch.zeros(0, 4),
               np.frombuffer(b"some pickled bytes", dtype=np.uint8),
               torch.randn(5, generator=g).to(torch.bfloat16)]
    lengths = [s.numel() * s.element_size() if isinstance(s, torch.Tensor) else s.nbytes
               for s in sources]
    stager = _staging.SlotStager(pool)
    save, views = stager.stage(0, sources, views=True)
    assert list(save.offsets) == data_file_offsets(lengths)
    assert list(save.lengths) == lengths and save.bytes % 4096 == 0
    buf = pool.buffer(0)
    for src, off, n, view in zip(sources, save.offsets, lengths, views):
        got = buf[off:off + n].tobytes()
        want = (src.contiguous().view(torch.uint8).numpy().tobytes()
                if isinstance(src, torch.Tensor) else src.tobytes())
        assert got == want
        if isinstance(src, torch.Tensor) and n:
            assert torch.equal(view, src)
    assert views[3] is None and views[2] is None
    del buf, views


def test_a_reused_slot_keeps_no_older_bytes_outside_the_items(pool):
    stager = _staging.SlotStager(pool)
    stager.stage(0, [torch.full((500_000,), 7.0)])
    pool.release(0)
    save, _ = stager.stage(0, [torch.ones(10), torch.ones(3)])
    buf = pool.buffer(0)
    mask = np.ones(len(buf), dtype=bool)
    for off, n in zip(save.offsets, save.lengths):
        mask[off:off + n] = False
    assert not buf[mask].any()
    del buf


def test_a_failed_stage_releases_the_slot(pool):
    stager = _staging.SlotStager(pool)

    def boom():
        raise RuntimeError("killed midway")

    with pytest.raises(RuntimeError, match="killed midway"):
        stager.stage(0, [torch.ones(10), torch.ones(10)], midway=boom)
    assert not pool.in_use(0)


def test_a_failed_pin_warns_once_and_copies_unpinned(pool, monkeypatch):
    class FakeCudart:
        calls = 0

        def cudaHostRegister(self, address, size, flags):
            FakeCudart.calls += 1
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    stager = _staging.SlotStager(pool)
    with pytest.warns(RuntimeWarning, match="cudaHostRegister"):
        assert stager._pin(0, 4096, 4096) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert stager._pin(0, 4096, 4096) is False  # no second warning, no second try
    assert FakeCudart.calls == 1 and not stager.pin_memory and not stager.registered


def test_manager_memory_tier_verifies_after_the_state_shrinks(tmp_path):
    big = {"w": torch.randn(300_000), "b": torch.randn(33)}
    small = {"w": torch.randn(1000)}
    with cairn.CheckpointManager(str(tmp_path), memory_slots=1, durable_every=100) as mgr:
        mgr.save(1, big)
        mgr.wait()
        mgr.save(2, small)  # the same slot: its tail still holds step 1's bytes
        mgr.wait()
        (step, uri), = mgr._memory_checkpoints().values()
        assert step == 2
        cairn.verify(uri)  # every padding byte is zero


def test_shared_memory_stager_uses_the_data_file_layout():
    state = {"a": torch.randn(10), "b": torch.randn(3, 3).t(), "c": torch.randn(70_000)}
    with cairn.SharedMemoryStager(slots=1) as stager:
        staged = stager.stage(state)
        base = min(t.data_ptr() for t in staged.values())
        offsets = sorted(t.data_ptr() - base for t in staged.values())
        assert offsets == data_file_offsets([t.nbytes for t in state.values()])
        del staged
