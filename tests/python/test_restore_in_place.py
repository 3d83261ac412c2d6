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


# ---- a replicated state restored from disk by several ranks of one node --------------

def _replicated_state(rank):
    """8 MiB every rank holds alike (DDP's model and optimizer) and 1 MiB of its own."""
    g = torch.Generator().manual_seed(7)
    model = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(8)}
    model[f"own{rank}"] = torch.full((256, 1024), float(rank + 1))
    return {"model": model}


def _read_bytes():
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _restore_replicated(rank, world, root):
    import torch.distributed as dist

    expected = _replicated_state(rank)
    with cairn.CheckpointManager(root, memory=False) as mgr:
        mgr.save(1, expected)
        mgr.wait()
    dist.barrier()
    if rank == 0:  # a cold restore: none of the checkpoint's pages in memory
        for top, _, files in os.walk(root):
            for name in files:
                fd = os.open(os.path.join(top, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    dest = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
    with cairn.CheckpointManager(root, memory=False) as mgr:
        dist.barrier()
        before = _read_bytes()
        step = mgr.restore(dest)
        fetched = _read_bytes() - before
        tier = mgr.restored
    ok = all(torch.equal(dest["model"][k], v) for k, v in expected["model"].items())
    return step, tier, ok, fetched


def test_ranks_of_one_node_fetch_a_replicated_state_from_disk_once(tmp_path):
    # Every rank loads the 8 MiB both hold: read direct, the disk would deliver them
    # once per rank (16 MiB in all); restore() reads the chunks other ranks of the
    # node read too through the page cache, so they come from the disk once, and each
    # rank's own 1 MiB direct.
    with open("/proc/self/mounts") as f:
        mounts = [line.split() for line in f]
    best = max((m for m in mounts if str(tmp_path).startswith(m[1].rstrip("/") + "/")),
               key=lambda m: len(m[1]))
    if best[2] in ("tmpfs", "ramfs", "overlay"):
        pytest.skip(f"{tmp_path} is on {best[2]}: no disk reads to count")
    from gloo_harness import run_ranks

    out = run_ranks(2, _restore_replicated, str(tmp_path / "root"))
    for step, tier, ok, _ in out:
        assert (step, tier, ok) == (1, (1, "durable"), True)
    fetched = sum(f for *_, f in out) / 2**20
    # 8 MiB once + 1 MiB per rank, and the reads' edges (manifests, readahead).
    assert 9.5 <= fetched <= 12.5, f"the ranks fetched {fetched:.1f} MiB from disk"
