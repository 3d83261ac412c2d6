"""cairn with stock ``dcp.async_save``: cairn.Writer under the default stager and
thread executor, and cairn.SharedMemoryStager (real gloo processes where ranks
matter)."""

from __future__ import annotations

import collections
import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import cairn
import toy_training
from gloo_harness import run_ranks
from cairn.errors import InvalidArgumentError, PreconditionError, TimeoutError


def make_model(seed=0):
    return toy_training.make_model(seed, sizes=(64, 256, 8))


def train_step(model, opt, seed):
    toy_training.train_step(model, opt, seed, batch=16)


def clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone_tree(v) for k, v in x.items()}
    return x


def zeros_like_tree(x):
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x)
    if isinstance(x, dict):
        return {k: zeros_like_tree(v) for k, v in x.items()}
    return x


def trees_equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(trees_equal(a[k], b[k]) for k in a)
    return a == b


def shm_entries(prefix):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


# ---- cairn.Writer under dcp.async_save's default stager ----------------------------

def _writer_default_stager(rank, world, root):
    model, opt = make_model(seed=0)  # replicated, as under DDP: each tensor written once
    train_step(model, opt, 1)
    own = torch.full((1000,), float(rank))  # a tensor only this rank has
    sd = {"model": model.state_dict(), "extra": {"step": 7}, f"rank{rank}": own}
    expected = clone_tree(sd)
    fut = dcp.async_save(sd, storage_writer=cairn.Writer(os.path.join(root, "step_7")))
    # Training goes on while the background thread writes: mutate everything in place.
    for s in range(2, 6):
        train_step(model, opt, s)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100.0)
    own.fill_(-1.0)
    metadata = fut.result(timeout=120)
    assert isinstance(metadata, dcp.metadata.Metadata)
    assert {"model.0.weight", "rank0", "rank1"} <= set(metadata.state_dict_metadata)
    dist.barrier()
    target = zeros_like_tree(expected)
    target["extra"]["step"] = 0
    dcp.load(target, storage_reader=cairn.Reader(os.path.join(root, "step_7")))
    return (trees_equal(target["model"], expected["model"])
            and trees_equal(target[f"rank{rank}"], expected[f"rank{rank}"]),
            target["extra"]["step"])


def test_writer_with_async_save_default_stager(tmp_path):
    results = run_ranks(2, _writer_default_stager, str(tmp_path))
    assert results == [(True, 7), (True, 7)]
    cairn.verify(str(tmp_path / "step_7"))  # every byte checks out (raises otherwise)


# ---- SharedMemoryStager: single process ----------------------------------------------

def odd_state():
    g = torch.Generator().manual_seed(3)
    return {
        "contig": torch.randn(300, 17, generator=g),
        "transposed": torch.randn(40, 30, generator=g).t(),
        "sliced": torch.randn(50, 8, generator=g)[::3, 1:6],
        "empty": torch.zeros(0, 5),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(1000, dtype=torch.int64),
        "big": torch.randn(300_000, generator=g),  # >= 1 MiB: page aligned
        "param": torch.nn.Parameter(torch.randn(7, generator=g)),
        "nested": collections.OrderedDict(
            a=[torch.ones(4, dtype=torch.int8), {"n": 3, "s": "text"}],
            b=(torch.full((2, 2), 9.0), None)),
        "meta": {"lr": 0.1, "names": ["x", "y"]},
    }


def test_stage_preserves_structure_dtypes_and_values():
    state = odd_state()
    with cairn.SharedMemoryStager() as stager:
        staged = stager.stage(state)
        assert type(staged["nested"]) is collections.OrderedDict
        assert isinstance(staged["nested"]["b"], tuple)
        for key in ("contig", "transposed", "sliced", "empty", "scalar", "bf16", "mask", "ids",
                    "big", "param"):
            src, dst = state[key], staged[key]
            assert dst.dtype == src.dtype and dst.shape == src.shape, key
            assert dst.device.type == "cpu" and dst.is_contiguous(), key
            assert torch.equal(dst.detach(), src.detach()), key
        assert staged["param"].requires_grad and not staged["contig"].requires_grad
        assert staged["big"].data_ptr() % 4096 == 0
        assert torch.equal(staged["nested"]["a"][0], state["nested"]["a"][0])
        assert staged["nested"]["a"][1] == {"n": 3, "s": "text"}
        assert staged["meta"] == state["meta"] and staged["meta"] is not state["meta"]
        assert staged["nested"]["b"][1] is None
        # Views over the slot, not private copies.
        slot_bytes = stager.last_stage_bytes
        assert slot_bytes >= sum(t.nbytes for t in state.values() if isinstance(t, torch.Tensor))
        assert stager.footprint >= slot_bytes


def test_staged_values_survive_mutation_of_the_originals():
    state = odd_state()
    expected = {k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    with cairn.SharedMemoryStager() as stager:
        staged = stager.stage(state)
        with torch.no_grad():
            for k in expected:
                if state[k].numel():
                    state[k].copy_(torch.ones_like(state[k]) * 7 if state[k].dtype != torch.bool
                                   else torch.zeros_like(state[k]))
        state["meta"]["names"].append("z")
        for k, v in expected.items():
            assert torch.equal(staged[k].detach(), v), k
        assert staged["meta"]["names"] == ["x", "y"]


def test_tied_tensors_are_staged_once():
    w = torch.randn(100, 10)
    with cairn.SharedMemoryStager() as stager:
        staged = stager.stage({"enc": w, "dec": w})
        assert staged["enc"] is staged["dec"]
        assert stager.last_stage_bytes == w.nbytes


def test_repeated_stages_reuse_slots_and_footprint_is_flat():
    state = {f"p{i}": torch.randn(20_000 + i) for i in range(12)}
    with cairn.SharedMemoryStager(slots=2) as stager:
        sizes, ptrs = [], set()
        for step in range(8):
            for t in state.values():
                t.add_(1.0)
            staged = stager.stage(state)
            assert all(torch.equal(staged[k], state[k]) for k in state)
            ptrs.add(staged["p0"].data_ptr())
            done = concurrent.futures.Future()
            done.set_result(None)
            stager.track(done)
            del staged
            sizes.append(stager.footprint)
        assert len(ptrs) == 2  # two slots, alternating
        assert len(set(sizes[1:])) == 1, sizes  # flat from the second save on
        assert sizes[-1] <= 2 * (stager.last_stage_bytes + (2 << 20))


def test_a_slot_in_use_by_a_tracked_save_is_not_overwritten():
    a = {"w": torch.full((1000,), 1.0)}
    with cairn.SharedMemoryStager(slots=1, timeout=0.2) as stager:
        staged1 = stager.stage(a)
        pending = concurrent.futures.Future()
        stager.track(pending)
        a["w"].fill_(2.0)
        with pytest.raises(TimeoutError, match="still used by a save"):
            stager.stage(a)
        assert torch.equal(staged1["w"], torch.full((1000,), 1.0))
        pending.set_result(None)
        staged2 = stager.stage(a)
        assert torch.equal(staged2["w"], torch.full((1000,), 2.0))


def test_two_slots_keep_the_previous_save_intact():
    a = {"w": torch.full((1000,), 1.0)}
    with cairn.SharedMemoryStager(slots=2) as stager:
        staged1 = stager.stage(a)
        stager.track(concurrent.futures.Future())  # the first save is still running
        a["w"].fill_(2.0)
        staged2 = stager.stage(a)
        assert torch.equal(staged1["w"], torch.full((1000,), 1.0))
        assert torch.equal(staged2["w"], torch.full((1000,), 2.0))


def test_growing_state_grows_its_slot():
    with cairn.SharedMemoryStager(slots=1) as stager:
        s1 = stager.stage({"w": torch.ones(1000)})
        del s1
        big = torch.randn(3_000_000)
        s2 = stager.stage({"w": big})
        assert torch.equal(s2["w"], big)
        assert stager.footprint >= big.nbytes


def test_bad_input_and_misuse_raise_clear_errors():
    with pytest.raises(InvalidArgumentError):
        cairn.SharedMemoryStager(slots=0)
    stager = cairn.SharedMemoryStager()
    with pytest.raises(InvalidArgumentError, match="dense tensors only"):
        stager.stage({"s": torch.eye(3).to_sparse()})
    with pytest.raises(PreconditionError, match="no staged save"):
        stager.track(concurrent.futures.Future())
    with pytest.raises(InvalidArgumentError, match="future"):
        stager.track("not a future")
    stager.close()
    with pytest.raises(PreconditionError, match="closed"):
        stager.stage({"w": torch.ones(3)})


def test_close_leaves_nothing_in_shared_memory():
    stager = cairn.SharedMemoryStager()
    name = os.path.basename(stager.shm_dir)
    staged = stager.stage({"w": torch.randn(10_000)})
    assert shm_entries(name) == [name]
    stager.close()  # a staged dict is still alive: files go now, the mapping later
    assert shm_entries(name) == []
    del staged
    stager.close()  # idempotent


@pytest.mark.serial  # another test's stager would remove the leftover first
def test_leftovers_of_a_killed_process_are_removed_by_the_next_stager():
    code = ("import os, signal, torch, cairn\n"
            "s = cairn.SharedMemoryStager()\n"
            "s.stage({'w': torch.ones(1000)})\n"
            "print(os.path.basename(s.shm_dir), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(cairn.__file__)))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    name = proc.stdout.strip()
    assert shm_entries(name) == [name]  # a crash leaves the files
    # A directory of a live process is left alone, even with no file locked yet.
    mine = f"cairn-stager-{os.getpid()}-livelivelive"
    os.makedirs(os.path.join("/dev/shm", mine, "slot0"))
    try:
        cairn.SharedMemoryStager().close()
        assert shm_entries(name) == []
        assert shm_entries(mine) == [mine]
    finally:
        shutil.rmtree(os.path.join("/dev/shm", mine), ignore_errors=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_stage_through_pinned_slot():
    state = {"w": torch.randn(1000, 100, device="cuda"),
             "t": torch.randn(64, 32, device="cuda").t(), "c": torch.randn(10)}
    expected = {k: v.cpu() for k, v in state.items()}
    with cairn.SharedMemoryStager() as stager:
        staged = stager.stage(state)
        for v in state.values():
            v.add_(1.0)
        for k in state:
            assert staged[k].device.type == "cpu" and torch.equal(staged[k], expected[k]), k
        assert stager._registered  # the slot is registered as pinned memory


# ---- SharedMemoryStager with dcp.async_save on 2 ranks -------------------------------

def _stager_async_save(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model, opt = make_model(seed=0)  # replicated: the planner writes each tensor once
    torch.manual_seed(1)
    sharded = distribute_tensor(torch.randn(64, 48), mesh, [Shard(0)])
    ckpt_pg = dist.new_group(backend="gloo")
    stager = cairn.SharedMemoryStager(slots=2)
    footprints, fut, saved = [], None, {}
    for step in range(1, 4):
        train_step(model, opt, step)
        with torch.no_grad():
            sharded.add_(1.0)
        sd = {"model": model.state_dict(), "sharded": sharded, "extra": {"step": step}}
        if fut is not None:
            fut.result(timeout=120)
        # Collectives of the training thread (full_tensor) must not run on the group the
        # save thread uses: the save gets its own.
        saved[step] = (clone_tree(sd["model"]), sharded.full_tensor())
        fut = dcp.async_save(sd, storage_writer=cairn.Writer(os.path.join(root, f"s{step}")),
                             async_stager=stager, process_group=ckpt_pg)
        stager.track(fut)
        sharded.full_tensor()  # a training collective while the save runs
        # Training mutates everything while the save is written.
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-3.0)
            sharded.mul_(5.0)
        footprints.append(stager.footprint)
    fut.result(timeout=120)
    name = os.path.basename(stager.shm_dir)
    stager.close()
    left = os.path.exists(os.path.join("/dev/shm", name))
    dist.barrier()
    ok = []
    for step, (model_sd, full) in saved.items():
        target = {"model": zeros_like_tree(model_sd),
                  "sharded": distribute_tensor(torch.zeros(64, 48), mesh, [Shard(0)]),
                  "extra": {"step": 0}}
        dcp.load(target, storage_reader=cairn.Reader(os.path.join(root, f"s{step}")))
        assert isinstance(target["sharded"], DTensor)
        ok.append(trees_equal(target["model"], model_sd)
                  and torch.equal(target["sharded"].full_tensor(), full)
                  and target["extra"]["step"] == step)
    return ok, footprints[1] == footprints[2], left


def test_stager_with_async_save_and_cairn_writer_two_ranks(tmp_path):
    results = run_ranks(2, _stager_async_save, str(tmp_path))
    assert results == [([True] * 3, True, False)] * 2


def test_stager_rebuilds_dtensor_with_same_spec():
    results = run_ranks(2, _stage_dtensor)
    assert results == [True, True]


def _stage_dtensor(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    dt = distribute_tensor(torch.randn(10, 6), mesh, [Shard(0)])
    rep = distribute_tensor(torch.randn(4), mesh, [Replicate()])
    with cairn.SharedMemoryStager() as stager:
        staged = stager.stage({"dt": dt, "rep": rep})
        local_before = dt.to_local().clone()
        with torch.no_grad():
            dt.add_(1.0)
        s = staged["dt"]
        return (isinstance(s, DTensor) and s.placements == dt.placements
                and s.device_mesh == dt.device_mesh and s.shape == dt.shape
                and s.stride() == dt.stride() and torch.equal(s.to_local(), local_before)
                and isinstance(staged["rep"], DTensor)
                and torch.equal(staged["rep"].to_local(), rep.to_local()))
