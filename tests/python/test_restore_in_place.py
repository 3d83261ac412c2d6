"""Reader.plan_in_place / load_in_place (CheckpointManager.restore's path without DCP's
planner): the same result as dcp.load, declined where dcp.load must decide, and
corruption still named."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import cairn

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def make_state(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    extra = {"step": seed, "betas": (0.9, 0.95), "counts": np.arange(5 + seed),
             "nested": {"w": torch.randn(3, 5), "empty": torch.zeros(0, 7)}}
    return model, opt, {"train": cairn.TrainState(model, opt), "rng": cairn.RNGState(),
                        "extra": extra}


def tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj.detach().clone()]
    if isinstance(obj, dict):
        return [t for k in sorted(obj) for t in tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []


def snapshot(model, opt, state):
    return (tensors(model.state_dict()), tensors(opt.state_dict()), state["extra"]["step"],
            state["extra"]["betas"], state["extra"]["counts"].tolist(),
            tensors(state["extra"]["nested"]), opt.state_dict()["param_groups"])


def same(a, b):
    ta = [x for part in a for x in (part if isinstance(part, list) else [part])]
    tb = [x for part in b for x in (part if isinstance(part, list) else [part])]
    if len(ta) != len(tb):
        return False
    for x, y in zip(ta, tb):
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def test_in_place_load_matches_dcp_load(tmp_path):
    model, opt, state = make_state(1)
    expected = snapshot(model, opt, state)
    dcp.save(state, storage_writer=cairn.Writer(tmp_path / "c"))

    m1, o1, s1 = make_state(2)
    reader = cairn.Reader(tmp_path / "c")
    plan = reader.plan_in_place(s1)
    assert plan is not None
    reader.load_in_place(plan)
    m2, o2, s2 = make_state(3)
    dcp.load(s2, storage_reader=cairn.Reader(tmp_path / "c"))
    assert same(snapshot(m1, o1, s1), expected)
    assert same(snapshot(m2, o2, s2), expected)
    assert isinstance(s1["extra"]["betas"], tuple)


@pytest.mark.parametrize("change", ["reshard", "dtype", "non_contiguous", "missing_key"])
def test_plan_declines_what_dcp_load_must_decide(tmp_path, change):
    sd = {"w": torch.randn(8, 4), "b": torch.randn(4)}
    dcp.save(sd, storage_writer=cairn.Writer(tmp_path / "c"))
    dest = {"w": torch.zeros(8, 4), "b": torch.zeros(4)}
    if change == "reshard":
        dest["w"] = torch.zeros(4, 4)
    elif change == "dtype":
        dest["w"] = torch.zeros(8, 4, dtype=torch.float64)
    elif change == "non_contiguous":
        dest["w"] = torch.zeros(4, 8).t()
    else:
        dest["extra"] = torch.zeros(2)
    assert cairn.Reader(tmp_path / "c").plan_in_place(dest) is None


def test_in_place_load_names_file_and_tensor_of_a_corrupt_byte(tmp_path):
    sd = {"w": torch.randn(256, 64), "b": torch.randn(64)}
    dcp.save(sd, storage_writer=cairn.Writer(tmp_path / "c"))
    data = tmp_path / "c" / "data" / "r0.bin"
    with open(data, "r+b") as f:  # "w" is the first item
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 1]))
    reader = cairn.Reader(tmp_path / "c")
    plan = reader.plan_in_place({"w": torch.zeros(256, 64), "b": torch.zeros(64)})
    assert plan is not None
    with pytest.raises(cairn.CorruptionError, match=r"data/r0\.bin.*tensor 'w'"):
        reader.load_in_place(plan)


def test_manager_restores_memory_tier_in_place_and_falls_back_on_corruption(tmp_path):
    model, opt, state = make_state(1)
    mgr = cairn.CheckpointManager(str(tmp_path / "root"), keep=2, memory_slots=2)
    try:
        assert mgr.restore(state) is None
        mgr.save(1, state, durable=False)
        mgr.wait()
        expected = snapshot(model, opt, state)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        mgr.save(2, state, durable=False)
        mgr.wait()
        newest = mgr._memory_checkpoints()
        assert sorted(step for step, _ in newest.values()) == [1, 2]
        slot = max(newest, key=lambda k: newest[k][0])
        reader = cairn.Reader(newest[slot][1])
        assert reader.plan_in_place(make_state(5)[2]) is not None  # restore()'s path
        # Flip a byte of step 2's data: restore() falls back to step 1.
        (data,) = glob.glob(os.path.join(mgr.shm_dir, f"slot{slot}", "data", "*.bin"))
        with open(data, "r+b") as f:
            b = f.read(1)
            f.seek(0)
            f.write(bytes([b[0] ^ 0x40]))
        m2, o2, s2 = make_state(6)
        assert mgr.restore(s2) == 1
        assert mgr.restored == (1, "memory")
        assert same(snapshot(m2, o2, s2), expected)
    finally:
        mgr.close()


def test_a_rollback_reads_the_slot_it_staged_and_gives_it_back(tmp_path, monkeypatch):
    # A restore by the process that staged the step reads its slot through the
    # staging pool's mapping (StagingPool.read_through); the next saves then stage
    # into that slot again.
    model, opt, state = make_state(1)
    mgr = cairn.CheckpointManager(str(tmp_path / "root"), keep=1, memory_slots=1)
    lent = []
    real = mgr._read_through_slot
    monkeypatch.setattr(mgr, "_read_through_slot",
                        lambda reader, name: lent.append(real(reader, name)) or lent[-1])
    try:
        assert mgr.restore(state) is None
        mgr.save(1, state, durable=False)
        mgr.wait()
        expected = snapshot(model, opt, state)
        m2, o2, s2 = make_state(6)
        assert mgr.restore(s2) == 1
        assert mgr.restored == (1, "memory")
        assert lent == [True]
        assert same(snapshot(m2, o2, s2), expected)
        for step in (2, 3):
            with torch.no_grad():
                for p in m2.parameters():
                    p.add_(1.0)
            mgr.save(step, s2, durable=False)
            mgr.wait()
        expected = snapshot(m2, o2, s2)
        m3, o3, s3 = make_state(7)
        assert mgr.restore(s3) == 3
        assert lent == [True, True]
        assert same(snapshot(m3, o3, s3), expected)
    finally:
        mgr.close()
