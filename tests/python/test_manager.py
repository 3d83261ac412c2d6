"""CheckpointManager with real gloo processes: async saves, the memory tier surviving a
crash, injected storage faults, fallback on corruption, retention, cleanup."""

from __future__ import annotations

import errno
import os
import signal

import pytest
import torch
import torch.distributed as dist

import cairn
from cairn import _ext
from gloo_harness import run_ranks
from toy_training import flat, make_state, train_step


# ---- async save captures the values at save() time ---------------------------------

def _async_capture(rank, world, root):
    model, opt, state = make_state()
    train_step(model, opt, 1)
    mgr = cairn.CheckpointManager(root, keep=2)
    mgr.save(1, state)
    expected = flat(model)
    # Training goes on while the save persists: mutate everything in place.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)
    train_step(model, opt, 2)
    mgr.wait()
    mgr.close()
    model2, opt2, state2 = make_state(seed=99)
    mgr2 = cairn.CheckpointManager(root, memory=False)
    step = mgr2.restore(state2)
    mgr2.close()
    return step, torch.equal(flat(model2), expected)


def test_async_save_holds_values_at_save_time(tmp_path):
    results = run_ranks(2, _async_capture, str(tmp_path))
    assert results == [(1, True), (1, True)]


# ---- the memory tier survives a crash of the training processes --------------------

def _crash_after_staging(rank, world, root):
    model, opt, state = make_state()
    train_step(model, opt, 1)
    mgr = cairn.CheckpointManager(root, keep=2, durable_every=1000)  # memory tier only
    mgr.save(1, state)
    mgr.wait()
    torch.save(flat(model), os.path.join(root, f"expected{rank}.pt"))
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def _restore_after_crash(rank, world, root):
    model, opt, state = make_state(seed=5)
    mgr = cairn.CheckpointManager(root, keep=2)
    step = mgr.restore(state)
    tier = mgr.restored[1] if step is not None else None
    ok = torch.equal(flat(model), torch.load(os.path.join(root, f"expected{rank}.pt")))
    mgr.close()
    return step, tier, ok


def test_crash_after_staging_restores_from_memory_tier(tmp_path):
    root = str(tmp_path)
    run_ranks(2, _crash_after_staging, root, expect_kill=True)
    assert cairn.latest_valid(root) is None  # nothing reached the disk
    results = run_ranks(2, _restore_after_crash, root)
    assert results == [(1, "memory", True), (1, "memory", True)]
    assert not any(n.startswith("cairn-") for n in os.listdir("/dev/shm")
                   if os.path.exists(os.path.join("/dev/shm", n, "slot0", "cairn.manifest"))
                   and root in n)


# ---- injected storage faults -------------------------------------------------------

def _enospc(rank, world, base, fail_op):
    inj = _ext.FaultInjector()
    model, opt, state = make_state()
    mgr = cairn.CheckpointManager(inj.wrap(_ext.open_storage(base)), memory=False, keep=3)
    train_step(model, opt, 1)
    mgr.save(1, state)
    mgr.wait()
    good = flat(model)
    # Every `fail_op` of this rank's durable tier fails from now on (count=0).
    inj.add_rule(fail_op, errno=errno.ENOSPC if fail_op == "write" else errno.EIO, count=0)
    train_step(model, opt, 2)
    mgr.save(2, state)  # staging succeeds; persistence fails in the background
    err = None
    try:
        mgr.wait()
    except cairn.Error as e:
        err = str(e)
    inj.clear()
    train_step(model, opt, 3)  # training goes on
    mgr.save(3, state)
    mgr.wait()
    mgr.close()
    return err, good.sum().item()


@pytest.mark.parametrize("fail_op", ["write", "sync"])
def test_storage_fault_surfaces_at_next_wait_and_training_goes_on(tmp_path, fail_op):
    base = str(tmp_path)
    results = run_ranks(2, _enospc, base, fail_op)
    for err, _ in results:
        assert err is not None and "step 2" in err, err
        assert "No space left" in err or "Input/output error" in err, err
    names = sorted(n for n in os.listdir(base) if n.startswith("step_"))
    committed = [n for n in names if os.path.exists(os.path.join(base, n, "cairn.manifest"))]
    assert committed == ["step_0000000001", "step_0000000003"]
    cairn.verify(os.path.join(base, "step_0000000001"))
    cairn.verify(os.path.join(base, "step_0000000003"))


# ---- corruption of the newest checkpoint falls back to the previous one --------------

def _save_steps(rank, world, root, steps):
    model, opt, state = make_state()
    mgr = cairn.CheckpointManager(root, keep=5)
    for s in steps:
        train_step(model, opt, s)
        mgr.save(s, state)
        mgr.wait()
        torch.save(flat(model), os.path.join(root, f"expected{rank}_{s}.pt"))
    mgr.close()


def _restore_one(rank, world, root, memory):
    model, opt, state = make_state(seed=7)
    mgr = cairn.CheckpointManager(root, memory=memory)
    step = mgr.restore(state)
    mgr.close()
    if step is None:
        return None, False
    return step, torch.equal(flat(model), torch.load(os.path.join(root, f"expected{rank}_{step}.pt")))


def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path):
    root = str(tmp_path)
    run_ranks(2, _save_steps, root, [1, 2])
    data = os.path.join(root, "step_0000000002", "data", "r1.bin")
    with open(data, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(cairn.CorruptionError):
        cairn.verify(os.path.join(root, "step_0000000002"))
    assert run_ranks(2, _restore_one, root, False) == [(1, True), (1, True)]


def test_missing_data_file_of_newest_falls_back(tmp_path):
    root = str(tmp_path)
    run_ranks(2, _save_steps, root, [1, 2, 3])
    os.remove(os.path.join(root, "step_0000000003", "data", "r0.bin"))
    assert run_ranks(2, _restore_one, root, False) == [(2, True), (2, True)]


# ---- retention -----------------------------------------------------------------------

def _retention(rank, world, root):
    model, opt, state = make_state()
    mgr = cairn.CheckpointManager(root, keep=2)
    for s in range(1, 6):
        train_step(model, opt, s)
        mgr.save(s, state)
    mgr.close()


def test_retention_keeps_newest_and_removes_partial_leftovers(tmp_path):
    root = str(tmp_path)
    # A leftover of a crashed save: a step directory without a manifest.
    os.makedirs(os.path.join(root, "step_0000000004", "data"))
    with open(os.path.join(root, "step_0000000004", "data", "r0.bin"), "wb") as f:
        f.write(b"partial")
    run_ranks(2, _retention, root)
    names = sorted(n for n in os.listdir(root) if n.startswith("step_"))
    assert names == ["step_0000000004", "step_0000000005"]
    assert cairn.latest_valid(root).endswith("step_0000000005")
    for n in names:
        cairn.verify(os.path.join(root, n))
    leftovers = [n for n in os.listdir(root) if n.endswith(".tmp")]
    assert leftovers == []


def test_close_leaves_no_shared_memory(tmp_path):
    """Nothing of this run's is left in /dev/shm: its memory tier (named after the
    root), nor anything else naming it (other tests may run beside this one)."""
    root = str(tmp_path)
    tier = cairn.manager.memory_tier_name(root)
    before = set(os.listdir("/dev/shm"))
    run_ranks(2, _retention, root)
    new = set(os.listdir("/dev/shm")) - before
    assert not os.path.exists(os.path.join("/dev/shm", tier))
    assert {n for n in new if tier[len("cairn-"):] in n} == set()


# ---- single process, argument checks --------------------------------------------------

def test_bad_arguments_raise_value_error(tmp_path):
    with pytest.raises(ValueError):
        cairn.CheckpointManager(str(tmp_path), keep=0)
    with pytest.raises(ValueError):
        cairn.CheckpointManager("gs://bucket/x")  # s3:// is a durable root, gs:// is not
    with cairn.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(ValueError):
            mgr.save(-1, {})
        with pytest.raises(ValueError):
            mgr.save(1, [1, 2])


def test_restore_with_nothing_returns_none(tmp_path):
    model, opt, state = make_state()
    with cairn.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.restore(state) is None


def test_memory_tier_of_another_run_is_ignored(tmp_path):
    root = str(tmp_path / "run")
    model, opt, state = make_state()
    mgr = cairn.CheckpointManager(root, durable_every=100)
    mgr.save(7, state)
    mgr.wait()
    # The user deletes the run directory and starts over on the same path.
    import shutil
    shutil.rmtree(root)
    with cairn.CheckpointManager(root) as fresh:
        assert fresh.restore(state) is None
    mgr._pool.close()


def test_device_staging_path_cpu_fallback_round_trips(tmp_path):
    """The device-to-host staging path (used for CUDA tensors) with CPU tensors: the
    slot views it writes must hold exactly the tensors' bytes, including odd dtypes,
    non-contiguous sources and zero-size tensors."""
    root = str(tmp_path)
    torch.manual_seed(3)
    state = {
        "a": torch.randn(37, 5),
        "b": torch.arange(10, dtype=torch.int16),
        "c": torch.randn(6, 4).t(),  # non-contiguous
        "d": torch.zeros(0, 3),
        "e": torch.randn(3).to(torch.bfloat16),
    }
    expected = {k: v.clone() for k, v in state.items()}
    with cairn.CheckpointManager(root) as mgr:
        mgr._device_path_for_tests = True
        mgr.save(1, state)
        for v in state.values():
            v.zero_() if v.numel() else None
        mgr.wait()
    cairn.verify(os.path.join(root, "step_0000000001"))
    loaded = {k: torch.empty_like(v) for k, v in expected.items()}
    import torch.distributed.checkpoint as dcp
    dcp.load(loaded, storage_reader=cairn.Reader(os.path.join(root, "step_0000000001")))
    for k in expected:
        assert torch.equal(loaded[k], expected[k]), k


def test_replicas_refuse_a_single_memory_slot_and_default_to_two(tmp_path):
    """With one slot a node lost while a save replicates leaves no step in cluster
    memory: replicas need two slots, the default with replicas; one is refused."""
    with pytest.raises(cairn.InvalidArgumentError, match="memory_slots >= 2"):
        cairn.CheckpointManager(str(tmp_path / "a"), replicas=1, memory_slots=1)
    mgr = cairn.CheckpointManager(str(tmp_path / "b"), replicas=1)
    try:
        assert mgr.num_slots == 2
    finally:
        mgr.close()
    mgr = cairn.CheckpointManager(str(tmp_path / "c"), memory=False, replicas=1, memory_slots=1)
    mgr.close()
    # Two slots by default with a memory tier (the restore contract, docs/memory.md),
    # one without.
    mgr = cairn.CheckpointManager(str(tmp_path / "d"))
    try:
        assert mgr.num_slots == 2
    finally:
        mgr.close()
    mgr = cairn.CheckpointManager(str(tmp_path / "e"), memory=False)
    try:
        assert mgr.num_slots == 1
    finally:
        mgr.close()
