"""Smoke run of every bench/peers adapter on a tiny state, in the peers' environment.

The peers (DLRover, torchsnapshot, NVIDIA Resiliency Ext: its async queue and its
LocalCheckpointManager) are installed by
scripts/bench_peers_setup.sh into .venv-peers, which CI does not create (it would add
minutes of downloads): without it these tests are skipped, saying so. With it, each
adapter runs bench/peers.py's whole sequence once (save, wait, SIGKILL, restore from
its fastest tier and from disk, both checked bit for bit, leftovers removed; DLRover
under dlrover-run with its master, restarted by its agent), and
NVRx's CPU queue is checked to share (not copy) the tensors it saves. The medians
of several runs (``bench/peers.py --median``) are checked without the peers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PEERS_PY = REPO / ".venv-peers" / "bin" / "python"

needs_peers = pytest.mark.skipif(
    not PEERS_PY.exists(),
    reason="no .venv-peers: run scripts/bench_peers_setup.sh to install the peers "
           "(not done in CI: it would add minutes)")


# DLRover runs under dlrover-run with its master (the harness's supervised path, the
# one that restores from its memory); its plain-python path is the other peers' path.
@needs_peers
@pytest.mark.parametrize("peer", ["cairn", "dlrover-run", "torchsnapshot", "nvrx",
                                  "nvrx-local"])
def test_adapter_smoke(peer, tmp_path):
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'python'}")
    r = subprocess.run([str(PEERS_PY), str(REPO / "bench" / "peers.py"), "--size-mb", "1",
                        "--ranks", "1", "--reps", "1", "--peers", peer, "--out", str(out),
                        "--no-chart"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    row, = json.loads(out.read_text())["rows"]
    assert row["restore_ok"], row
    assert row["stall_s"] > 0 and row["durable_s"] >= row["stall_s"], row
    assert row["left_after_close"]["processes"] == 0, row
    if peer == "cairn":
        assert row["restore_tier"] == "memory", row  # a restarted manager reads its slot
        assert row["left_after_close"]["/dev/shm"] == [], row
    if peer == "dlrover-run":
        # The restarted worker read the agent's shared memory while the checkpoint's
        # files were renamed away, and got the saved values (restore_ok).
        assert row["restore_tier"] == "memory" and row["restart_count"] == 1, row
        assert "renamed away" in row["restore_evidence"], row
        assert row["left_after_master_stop"]["processes"] == 0, row
    if peer == "nvrx-local":
        assert row["restore_tier"] == "local (/dev/shm)", row
        assert row["restore_disk_s"] is None, row  # it keeps no disk copy
    # Whatever the session left was removed by the harness.
    assert not any(n for n in os.listdir("/dev/shm")
                   if n in row["left_after_close"]["/dev/shm"]), row
    assert not any(os.path.exists(os.path.join("/tmp", n))
                   for n in row["left_after_close"]["/tmp"]), row


@needs_peers
def test_nvrx_cpu_queue_shares_tensors(tmp_path):
    """The correctness finding bench/README.md reports: on CPU, NVRx's persistent
    async queue does not copy the tensors it saves (its preload returns the caller's
    storage, which the queue moves to shared memory and sends by reference), so a
    change made after async_save() returned races with the worker's write."""
    code = ("if __name__ == '__main__':\n"
            "    import sys\n"
            "    from pathlib import Path\n"
            "    sys.path.insert(0, sys.argv[1])\n"
            "    from bench.peers.nvrx_async import shares_tensors\n"
            "    import json\n"
            "    print(json.dumps(shares_tensors(Path(sys.argv[2]))))\n")
    r = subprocess.run([str(PEERS_PY), "-W", "ignore", "-c", code, str(REPO), str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    # Deterministic: the scheduled save holds the caller's storage, not a copy (whether
    # the later change lands in the file is a race; both outcomes have been seen).
    assert found["same_storage"], found


def _run(time_, stall, disk, failed=False):
    row = {"peer": "cairn", "ranks": 2, "version": "0.1.0", "patch": None,
           "stall_s": stall, "durable_s": 0.2, "restore_fast_s": 0.05, "restore_tier": "memory",
           "restore_disk_s": disk, "extra_bytes": 1e8, "restore_ok": True,
           "first_save": {"stall_s": 0.1, "durable_s": 0.3}, "saves": [],
           "left_after_kill": {"processes": 0, "/dev/shm": [], "/tmp": []},
           "left_after_close": {"processes": 0, "/dev/shm": [], "/tmp": []}}
    if failed:
        row = {"peer": "cairn", "ranks": 2, "failed": "boom"}
    return {"size_mb": 1, "bytes": 1e6, "ntensors": 3, "reps": 3, "rows": [row],
            "floors": {"copy": 0.01, "memcpy": 0.01, "Tensor.copy_": 0.02,
                       "direct-I/O write": 0.1, "direct-I/O read": 0.2, "bytes": 1e6},
            "loadavg": [1.0, 1.0, 1.0], "cpus": 2, "time": time_}


def test_median_of_runs(tmp_path):
    import importlib.util

    sys.path.insert(0, str(REPO))  # bench.peers (the adapters' package) is the script's
    spec = importlib.util.spec_from_file_location("bench_peers_script",
                                                  REPO / "bench" / "peers.py")
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)

    runs = [_run("t1", 0.010, 0.5), _run("t2", 0.030, None), _run("t3", 0.020, 0.7),
            _run("t4", 0.0, 0.0, failed=True)]
    paths = []
    for i, r in enumerate(runs):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(r))
    combined = peers.combine([json.loads(p.read_text()) for p in paths])
    row, = combined["rows"]
    assert row["stall_s"] == 0.020 and row["ok_runs"] == 3
    assert row["restore_disk_s"] == 0.6  # the median of the runs that have one
    assert row["runs"]["stall_s"] == [0.010, 0.030, 0.020]
    text = peers.markdown(combined)
    assert "medians of 4 runs" in text and "[3 of 4 runs]" in text
    assert "| 20.0 (10.0, 30.0, 20.0) |" in text and "0.600 (0.500, –, 0.700)" in text
