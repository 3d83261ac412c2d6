"""CheckpointManager reuses DCP's plan while the state's structure is unchanged
(manager._PlanCache): saves staged with the cached plan restore exactly, a changed
structure on every rank is planned anew on every rank, a changed structure on some
ranks only skips that step on every rank (and plans the next one anew), and a staging
failure on one rank fails the save on every rank."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import torch
import torch.distributed.checkpoint as dcp

import cairn
from cairn import manager as manager_mod
from gloo_harness import run_ranks


def _state(rank, scale, extra=False, lr=0.1):
    """Each rank's own tensors (keys of its own), a tensor every rank holds alike (a
    replicated one, which DCP stores once) and non-tensor values (the coordinator's
    are stored)."""
    torch.manual_seed(rank)
    s = {
        "model": {f"r{rank}.w": torch.randn(64, 32) * scale,
                  f"r{rank}.b": torch.arange(8.0) * scale,
                  "shared": torch.full((16,), float(scale))},
        "meta": {"lr": lr, "name": f"s{scale}", "ints": [1, 2, 3]},
    }
    if extra:
        s["model"][f"r{rank}.new"] = torch.ones(3, 3, dtype=torch.float64) * scale
    return s


@contextlib.contextmanager
def _counted_manager(root):
    """A manager (keep=5) and the list of the dcp.save calls it makes (its DCP
    planning; dcp.save is patched in this process while the manager is open)."""
    calls = []
    real = dcp.save

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    manager_mod.dcp.save = counted
    try:
        with cairn.CheckpointManager(root, keep=5) as mgr:
            yield mgr, calls
    finally:
        manager_mod.dcp.save = real


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _restore_into(root, like, memory):
    dest = {"model": {k: torch.zeros_like(v) for k, v in like["model"].items()},
            "meta": {"lr": 0.0, "name": "", "ints": [0, 0, 0]}}
    with cairn.CheckpointManager(root, memory=memory) as mgr:
        step = mgr.restore(dest)
    return step, dest


def _repeated(rank, world, root):
    with _counted_manager(root) as (mgr, calls):
        expected = {}
        for step, scale, lr in ((1, 1.0, 0.1), (2, 2.0, 0.2), (3, 3.0, 0.3)):
            state = _state(rank, scale, lr=lr)  # new tensors, same structure; lr changes
            mgr.save(step, state)
            mgr.wait()
            expected[step] = state
        planned = len(calls)
        tiers = mgr._last.tiers_done
    step, got = _restore_into(root, expected[3], memory=False)
    cairn.verify(f"{root}/step_0000000003")
    cairn.verify(f"{root}/step_0000000002")
    return planned, tiers, step, _equal(got, expected[3])


def test_repeated_saves_reuse_the_plan_and_restore_exactly(tmp_path):
    results = run_ranks(2, _repeated, str(tmp_path))
    # One save through dcp.save (the first), two staged with its plan; values exact,
    # including a non-tensor value that changed.
    ok = (1, ["memory", "durable"], 3, True)
    assert results == [ok, ok]


def _structure_changes_on_one_rank(rank, world, root):
    seen = []
    with _counted_manager(root) as (mgr, calls):
        mgr.save(1, _state(rank, 1.0))
        mgr.wait()
        # Only rank 1 gains a tensor. Rank 0 stages with the cached plan and goes on
        # before it learns (the agreement is not waited for in the stall): step 2
        # cannot be saved consistently, so every rank skips it (a WARNING, on_durable
        # gets the error, wait() raises nothing) and both plan step 3 anew (else rank
        # 0 would stage with a plan that does not know rank 1's new item).
        state = _state(rank, 2.0, extra=(rank == 1))
        mgr.save(2, state, durable=True, on_durable=seen.append)
        mgr.wait()
        planned_after_change = len(calls)
        mgr.save(3, state)  # planned anew on both ranks, then reused
        mgr.wait()
        mgr.save(4, state)
        mgr.wait()
        planned_total = len(calls)
    step, got = _restore_into(root, state, memory=False)
    skipped = [isinstance(e, cairn.Error) and "step 2 was not checkpointed" in str(e)
               for e in seen]
    return (planned_after_change, planned_total, step, _equal(got, state), skipped,
            os.path.exists(f"{root}/step_0000000002"))


def test_changed_structure_on_one_rank_skips_that_step_and_plans_anew_on_every_rank(tmp_path):
    results = run_ranks(2, _structure_changes_on_one_rank, str(tmp_path))
    for r in results:
        assert r == (1, 2, 4, True, [True], False), r


def _fails_on_rank1(rank, world, root):
    mgr = cairn.CheckpointManager(root, keep=5)
    errors = []
    try:
        mgr.save(1, _state(rank, 1.0))
        mgr.wait()
        real = mgr._stager.stage

        def broken(*a, **k):
            raise OSError("injected staging failure")

        if rank == 1:
            mgr._stager.stage = broken
        try:
            # Rank 0 learns of rank 1's failure in the background: every rank raises
            # from the same call, wait() here.
            mgr.save(2, _state(rank, 2.0))
            mgr.wait()
        except Exception as e:  # noqa: BLE001 - what each rank saw
            errors.append((type(e).__name__, "injected staging failure" in str(e)))
        mgr._stager.stage = real
        state = _state(rank, 3.0)
        mgr.save(3, state)  # training goes on: the next save works on every rank
        mgr.wait()
    finally:
        mgr.close()
    step, got = _restore_into(root, state, memory=False)
    return errors, sorted(n for n in os.listdir(root) if n.startswith("step_")), step, \
        _equal(got, state)


def test_staging_failure_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    results = run_ranks(2, _fails_on_rank1, str(tmp_path))
    steps = ["step_0000000001", "step_0000000003"]
    # Rank 0: "staging failed on another rank"; rank 1: its own failure, as a cairn.Error.
    assert results == [([("Error", False)], steps, 3, True), ([("Error", True)], steps, 3, True)]


def test_single_process_bytes_values_and_dtype_change(tmp_path):
    """One process: a tensor whose dtype changes is planned anew; a non-tensor value
    that changes is saved as it is at each save."""
    root = str(tmp_path)
    with _counted_manager(root) as (mgr, calls):
        a = {"t": torch.arange(10.0), "meta": {"lr": 1.0, "name": "", "ints": [0]}}
        mgr.save(1, a)
        mgr.wait()
        a["meta"]["lr"] = 0.5
        mgr.save(2, a)
        mgr.wait()
        assert len(calls) == 1
        b = {"t": torch.arange(10, dtype=torch.int64),
             "meta": {"lr": 0.25, "name": "x", "ints": [4]}}
        mgr.save(3, b)
        mgr.wait()
        assert len(calls) == 2
    for step, want in ((2, {"t": torch.arange(10.0), "meta": {"lr": 0.5, "name": "",
                                                              "ints": [0]}}),
                       (3, b)):
        dest = {"t": torch.zeros_like(want["t"]),
                "meta": {"lr": 0.0, "name": "?", "ints": [9]}}
        dcp.load(dest, storage_reader=cairn.Reader(f"{root}/step_{step:010d}"))
        assert _equal(dest, want)


def _first_save_planned_by_restore(rank, world, root):
    with _counted_manager(root) as (mgr, calls):
        state = _state(rank, 1.0)
        assert mgr.restore(state) is None
        mgr.save(1, state)  # waits for restore()'s planning, on the background thread
        mgr.wait()
        planned = len(calls)
    step, got = _restore_into(root, state, memory=False)
    return planned, step, _equal(got, state)


def test_restore_plans_the_first_save_ahead(tmp_path):
    """restore() (here with nothing to restore) plans the first save on every rank,
    so the first save() stages like a steady one (one dcp.save in all: restore()'s
    planning); what it saved restores exactly."""
    results = run_ranks(2, _first_save_planned_by_restore, str(tmp_path))
    assert results == [(1, 1, True), (1, 1, True)]


def _restore_returns_before_planning(rank, world, root):
    state = _state(rank, 1.0)
    with cairn.CheckpointManager(root, keep=5) as mgr:
        mgr.save(1, state)
    gate = threading.Event()
    calls = []
    real = dcp.save

    def gated(*a, **k):  # DCP's planning of the next save, held until the gate opens
        calls.append(threading.current_thread().name)
        assert gate.wait(60)
        return real(*a, **k)

    manager_mod.dcp.save = gated
    try:
        with cairn.CheckpointManager(root, keep=5) as mgr:
            dest = _state(rank, 0.0)
            step = mgr.restore(dest)  # returns while the planning is held
            returned_first = not mgr._plan_job.is_set()
            restored = _equal(dest, state)
            # candidates() may gather from every rank: it waits for the planning's
            # collectives, which must come first on every rank.
            threading.Timer(0.5, gate.set).start()
            t0 = time.monotonic()
            cands = {c[0] for c in mgr.candidates()}
            waited = time.monotonic() - t0 >= 0.3
            dest["model"][f"r{rank}.w"].add_(1.0)  # training goes on
            mgr.save(2, dest)  # stages with the plan made in the background
            mgr.wait()
            hit = mgr._plan_cache is not None and len(calls) == 1
    finally:
        manager_mod.dcp.save = real
        gate.set()
    step2, got = _restore_into(root, dest, memory=False)
    return step, returned_first, restored, (cands, waited), calls, hit, step2, _equal(got, dest)


def test_restore_returns_before_the_next_save_is_planned(tmp_path):
    """restore() loads on the caller's thread and leaves DCP's planning of the next
    save to the background thread (a restarted job trains sooner): it returns while
    that planning is held; candidates() and the next save() wait for it (their
    collectives must not overtake its, on any rank); that save stages with its plan
    and restores exactly."""
    results = run_ranks(2, _restore_returns_before_planning, str(tmp_path))
    for step, first, restored, cands, calls, hit, step2, exact in results:
        assert (step, first, restored, hit, step2, exact) == (1, True, True, True, 2, True)
        assert calls == ["cairn-persist"]
        assert cands == ({1}, True)
