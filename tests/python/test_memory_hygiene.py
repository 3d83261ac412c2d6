"""Memory hygiene of CheckpointManager: orphaned memory tiers of crashed runs are
reclaimed (by the next manager and by ``cairn gc``), ``cairn ls --memory`` lists the
node's tiers, and ``memory_limit`` / a full /dev/shm refuse a save with a clear error
instead of SIGBUS."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import cairn
from cairn import _ext
from cairn.errors import ResourceExhaustedError
from cairn.manager import memory_tier_name

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(REPO, "build", "cairn")
ENV = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))

CRASH = textwrap.dedent(
    """
    import os, signal, sys, torch, cairn
    mgr = cairn.CheckpointManager(sys.argv[1], durable_every=1000)
    mgr.save(7, {"w": torch.arange(300000, dtype=torch.float32)})
    mgr.wait()
    os.kill(os.getpid(), signal.SIGKILL)  # a crash: no close(), the memory tier stays
    """
)


def crash_run(root):
    """A run that saves step 7 to its memory tier only, then dies by SIGKILL."""
    proc = subprocess.run([sys.executable, "-c", CRASH, str(root)], env=ENV, timeout=120,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    tier = _ext.shm_directory(memory_tier_name(str(root)))
    assert os.path.isdir(tier)
    return tier


def tier_info(tier):
    found = [t for t in _ext.list_memory_tiers() if t["path"] == tier]
    return found[0] if found else None


@pytest.fixture
def cleanup_tiers():
    tiers = []
    yield tiers
    for t in tiers:
        shutil.rmtree(t, ignore_errors=True)


def test_crashed_runs_tier_is_listed_with_size_step_root_and_dead_owner(tmp_path, cleanup_tiers):
    tier = crash_run(tmp_path / "run")
    cleanup_tiers.append(tier)
    t = tier_info(tier)
    assert t["kind"] == "memory" and t["step"] == 7
    assert t["run_root"] == str(tmp_path / "run")
    assert t["bytes"] >= 1_200_000
    assert not t["in_use"] and not t["orphaned"]  # within the grace period
    assert [o["state"] for o in t["owners"]] == ["dead"]
    out = subprocess.run([CLI, "ls", "--memory", "--json"], capture_output=True, text=True,
                         check=True).stdout
    listed = [x for x in json.loads(out) if x["path"] == tier]
    assert listed and listed[0]["steps"] == [7] and listed[0]["owners"][0]["state"] == "dead"
    table = subprocess.run([CLI, "ls", "--memory"], capture_output=True, text=True,
                           check=True).stdout
    line = next(x for x in table.splitlines() if os.path.basename(tier) in x)
    assert str(tmp_path / "run") in line and "(dead)" in line and " 7 " in line


def test_restart_within_the_grace_period_restores_from_the_kept_tier(tmp_path, cleanup_tiers):
    root = tmp_path / "run"
    tier = crash_run(root)
    cleanup_tiers.append(tier)
    # Another run starting on the node meanwhile reclaims nothing of it.
    with cairn.CheckpointManager(tmp_path / "other") as other:
        assert os.path.isdir(tier)
    state = {"w": torch.zeros(300000)}
    mgr = cairn.CheckpointManager(root, durable_every=1000)
    try:
        assert mgr.restore(state) == 7 and mgr.restored == (7, "memory")
        assert torch.equal(state["w"], torch.arange(300000, dtype=torch.float32))
        t = tier_info(tier)
        assert t["in_use"] and t["last_restored"] > 0
    finally:
        mgr.close()
    assert not os.path.exists(tier)
    assert other is not None


def test_next_manager_reclaims_a_crashed_tier_whose_run_root_is_gone(tmp_path, cleanup_tiers):
    tier = crash_run(tmp_path / "run")
    cleanup_tiers.append(tier)
    shutil.rmtree(tmp_path / "run")
    with cairn.CheckpointManager(tmp_path / "next"):
        assert not os.path.exists(tier)


GRACE = textwrap.dedent(
    """
    import os, subprocess, sys, cairn
    from cairn import _ext
    from cairn.manager import memory_tier_name
    crash, root = sys.argv[1], sys.argv[2]
    subprocess.run([sys.executable, "-c", crash, root], check=False)
    tier = _ext.shm_directory(memory_tier_name(root))
    with cairn.CheckpointManager(root + "-a"):  # the default grace keeps it
        print("KEPT" if os.path.isdir(tier) else "LOST")
    with cairn.CheckpointManager(root + "-b", orphan_grace=0.0):
        print("KEPT" if os.path.isdir(tier) else "RECLAIMED")
    """
)


def private_shm(script, *args):
    """Runs a Python script with a private tmpfs on /dev/shm (its own node), so that
    what it reclaims can only be its own."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private /dev/shm (CI runs as root)")
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "sh",
           sys.executable, "-c", script, *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=180)


def test_next_manager_reclaims_a_crashed_tier_after_the_grace_period(tmp_path):
    proc = private_shm(GRACE, CRASH, str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["KEPT", "RECLAIMED"], proc.stdout + proc.stderr


@pytest.mark.serial  # `cairn gc` reclaims every crashed run's tier on the node
def test_cairn_gc_keeps_young_orphans_and_removes_ones_whose_root_is_gone(tmp_path,
                                                                          cleanup_tiers):
    tier = crash_run(tmp_path / "run")
    cleanup_tiers.append(tier)
    out = subprocess.run([CLI, "gc"], capture_output=True, text=True, check=True).stdout
    assert os.path.basename(tier) not in out and os.path.isdir(tier)
    shutil.rmtree(tmp_path / "run")
    out = subprocess.run([CLI, "gc", "--dry-run"], capture_output=True, text=True,
                         check=True).stdout
    assert f"would remove {os.path.basename(tier)}" in out and os.path.isdir(tier)
    out = subprocess.run([CLI, "gc"], capture_output=True, text=True, check=True).stdout
    assert f"removed {os.path.basename(tier)}" in out and "is gone" in out
    assert not os.path.exists(tier)


@pytest.mark.serial  # `cairn gc` reclaims every crashed run's tier on the node
def test_a_live_managers_tier_is_in_use_and_never_reclaimed(tmp_path, cleanup_tiers):
    with cairn.CheckpointManager(tmp_path / "run") as mgr:
        # close() keeps the tier: it holds step 1, which the durable tier lost below.
        cleanup_tiers.append(mgr.shm_dir)
        mgr.save(1, {"w": torch.ones(1000)})
        mgr.wait()
        shutil.rmtree(tmp_path / "run")  # even with its run root gone
        subprocess.run([CLI, "gc", "--grace", "0"], capture_output=True, check=True)
        t = tier_info(mgr.shm_dir)
        assert t is not None and t["in_use"] and t["step"] == 1
        assert [o["state"] for o in t["owners"]] == ["alive"]
        os.makedirs(tmp_path / "run")  # close() keeps the tier, warning that it holds step 1


# ---- memory_limit --------------------------------------------------------------------

def test_memory_limit_refuses_a_save_that_would_exceed_it_and_keeps_the_last_one(tmp_path):
    small = {"w": torch.arange(250_000, dtype=torch.float32)}  # 1 MB: one 2 MiB slot step
    big = {"w": torch.ones(2_000_000)}  # 8 MB
    # Room for the two default slots of the small state (2 MiB each), not for big.
    with cairn.CheckpointManager(tmp_path / "run", memory_limit=6 << 20,
                                 durable_every=1000) as mgr:
        mgr.save(1, small)
        mgr.wait()
        with pytest.raises(ResourceExhaustedError, match="memory_limit.*unchanged"):
            mgr.save(2, big)
        assert [(s, t) for s, t, _ in mgr.candidates()] == [(1, "memory")]
        assert _ext.allocated_bytes(mgr.shm_dir) <= 6 << 20
        mgr.save(3, small)  # training goes on
        mgr.wait()
        # Two slots: step 3 went to the slot the refused save gave back, step 1 stays.
        assert sorted(s for s, t, _ in mgr.candidates() if t == "memory") == [1, 3]


def test_memory_limit_of_one_slot_is_enough_while_every_save_is_durable(tmp_path):
    """The default configuration needs one slot (the second is created only to keep
    a memory-only step): a limit with room for one slot of the state holds every
    durable save; a memory-only save then needs the second slot for the next one,
    which is refused, the memory-only step staying whole."""
    small = {"w": torch.arange(250_000, dtype=torch.float32)}  # one 2 MiB slot step
    with cairn.CheckpointManager(tmp_path / "run", memory_limit=3 << 20) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, small)
            mgr.wait()
        assert _ext.allocated_bytes(mgr.shm_dir) <= 3 << 20
        mgr.save(4, small, durable=False)
        mgr.wait()
        with pytest.raises(ResourceExhaustedError, match="memory_limit"):
            mgr.save(5, small)  # step 4's slot is kept: it would need a second one
        have = [(s, t) for s, t, _ in mgr.candidates()]
        assert have[0] == (4, "memory") and (3, "durable") in have, have


def test_memory_limit_as_a_fraction_of_dev_shm(tmp_path):
    total = _ext.shared_memory_room("/dev/shm")["total"]
    # Below one 2 MiB slot step every save would fail: refused at construction.
    with pytest.raises(cairn.InvalidArgumentError, match="memory_limit .* below one step"):
        cairn.CheckpointManager(tmp_path / "run", memory_limit=(1 << 20) / total)
    with cairn.CheckpointManager(tmp_path / "run", memory_limit=(3 << 20) / total) as mgr:
        mgr.save(1, {"w": torch.ones(1000)})  # one 2 MiB step fits in 3 MiB
        mgr.wait()
        with pytest.raises(ResourceExhaustedError, match="memory_limit"):
            mgr.save(2, {"w": torch.ones(2 << 20)})  # 8 MiB does not


@pytest.mark.parametrize("bad", [0, -5, 1.5, 0.0, "1G", True])
def test_bad_memory_limit_is_a_value_error(tmp_path, bad):
    with pytest.raises(ValueError, match="memory_limit"):
        cairn.CheckpointManager(tmp_path / "run", memory_limit=bad)


def test_memory_limit_counts_every_local_rank(tmp_path):
    from gloo_harness import run_ranks

    out = run_ranks(2, _two_ranks_over_budget, str(tmp_path / "run"))
    # Each rank's 3 MB slot fits 6 MiB alone; both together on this node do not.
    assert out[0] == out[1] and "memory_limit" in out[0] and "node" in out[0], out


def _two_ranks_over_budget(rank, world, root):
    mgr = cairn.CheckpointManager(root, memory_limit=6 << 20, durable_every=1000)
    try:
        mgr.save(1, {f"w{rank}": torch.ones(750_000)})
        mgr.wait()
        return "saved"
    except ResourceExhaustedError as e:
        return str(e)
    finally:
        mgr.close()


FULL_SHM = textwrap.dedent(
    """
    import sys, torch, cairn
    mgr = cairn.CheckpointManager(sys.argv[1], durable_every=1000)
    try:
        mgr.save(1, {"w": torch.ones(24 << 20)})  # 96 MB into a 64 MiB /dev/shm
        print("SAVED")
    except cairn.errors.ResourceExhaustedError as e:
        print("REFUSED", e)
    pool = cairn._ext.StagingPool("/dev/shm/direct", rank=0, num_slots=1)
    try:
        pool.acquire_slot(0, 96 << 20)  # no pre-check: fallocate must say ENOSPC
        print("GREW")
    except cairn.Error as e:
        print("ENOSPC", e)
    pool.close()
    mgr.close()
    """
)


def test_full_dev_shm_is_a_clear_error_never_sigbus(tmp_path):
    proc = private_shm(FULL_SHM, str(tmp_path / "run"))
    assert proc.returncode == 0, (proc.returncode, proc.stderr)  # SIGBUS would be -7
    assert "REFUSED" in proc.stdout and "free" in proc.stdout, proc.stdout
    assert "ENOSPC" in proc.stdout and "space" in proc.stdout, proc.stdout
