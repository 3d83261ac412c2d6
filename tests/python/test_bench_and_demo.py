"""Smoke tests: the checkpoint benchmark and the README demo keep running.

No timing assertions (benchmarks live in bench/): only that the scripts run to
completion and the benchmark writes well-formed JSON.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "python") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_script(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs REPO/script with this interpreter and the worktree's package first."""
    return subprocess.run([sys.executable, str(REPO / script), *args], capture_output=True,
                          text=True, env=_env(), timeout=timeout)


def test_checkpoint_benchmark_runs_and_writes_json(tmp_path):
    out = tmp_path / "checkpoint.json"
    r = _run_script("bench/checkpoint.py", "--size-gb", "0.02", "--reps", "1",
                    "--dir", str(tmp_path), "--json", str(out), "--no-drop-caches",
                    "--allow-tmpfs")
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["meta"]["state_tensors"] >= 198
    assert set(result["floors"]) == {"memcpy", "Tensor.copy_", "direct-I/O write",
                                     "direct-I/O read"}
    peers = result["peers"]
    assert set(peers) == {"torch.save", "dcp", "cairn", "dcp.async_save", "dcp.async_save+shm",
                          "cairn.manager"}
    for name in ("torch.save", "dcp", "cairn"):
        for op in ("save", "load"):
            assert peers[name][op]["median_s"] > 0 and math.isfinite(peers[name][op]["GBps"])
    # Async saves: stall and time until durable of the 2nd and later saves, the first
    # save apart, extra memory of every save (first included); restore from both tiers.
    assert set(result["series"]) == {"torch.save", "dcp.async_save", "dcp.async_save+shm",
                                     "cairn.manager"}
    for name, ser in result["series"].items():
        stall, durable = peers[name]["stall"], peers[name]["durable"]
        assert len(stall["seconds"]) == 1 and 0 < stall["median_s"] <= durable["median_s"]
        assert 0 < ser["first"]["stall_s"] <= ser["first"]["durable_s"]
        assert len(ser["extra_bytes_per_save"]) == 2
    # The staged copy is in shared memory, so the manager's footprint is at least the state.
    state_bytes = result["meta"]["state_bytes"]
    assert min(result["series"]["cairn.manager"]["extra_bytes_per_save"]) >= state_bytes
    for op in ("restore memory", "restore disk (cold)"):
        assert peers["cairn.manager"][op]["median_s"] > 0
    for name in ("cairn_save_time / dcp_save_time", "cairn_save_bw / direct_write_bw",
                 "manager_stall / dcp_async_save_stall", "manager_stall / copy_floor",
                 "manager_first_stall / steady_stall", "manager_restore_memory / copy_floor",
                 "cairn_cold_load_bw / parallel_direct_read_bw",
                 "manager_peak_extra_mem / state", "manager_extra_mem_spread_over_saves / state",
                 "manager_restore_disk / restore_memory"):
        assert math.isfinite(result["ratios"][name]["value"]), name
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.json"]  # scratch removed


def test_cairn_bench_prints_floors_figures_and_ratios(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "cairn.bench", str(tmp_path), "--size-gb", "0.005",
         "--reps", "1", "--layers", "1", "--json"],
        capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout)
    assert set(result["figures"]) == {"memcpy", "Tensor.copy_", "direct write",
                                      "parallel direct read", "save", "load", "stall",
                                      "memory restore"}
    assert all(f["median_s"] > 0 for f in result["figures"].values())
    assert set(result["ratios"]) == {"save / direct write", "load / parallel direct read",
                                     "stall / copy floor", "first stall / steady stall",
                                     "memory restore / copy floor"}
    assert all(math.isfinite(x["value"]) for x in result["ratios"].values())
    assert "rep 1/1: save" in r.stderr  # progress
    assert list(tmp_path.iterdir()) == []  # scratch removed


def test_demo_runs(tmp_path):
    r = _run_script("examples/reshard_demo.py", "--root", str(tmp_path / "d"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bit-identical" in r.stdout and "demo OK" in r.stdout


def test_resume_demo_is_bit_exact(tmp_path):
    r = _run_script("examples/resume_demo.py", "--steps", "20", "--ckpt-every", "5",
                    "--crash-at-step", "12", "--workdir", str(tmp_path / "w"), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "bitwise equal to the uninterrupted run: True" in r.stdout
    assert "same sample sequence as the uninterrupted run: True" in r.stdout
    assert "demo: OK" in r.stdout


def test_s3_benchmark_runs_and_writes_json(tmp_path):
    out = tmp_path / "s3.json"
    r = _run_script("bench/s3.py", "--size-gb", "0.01", "--reps", "1", "--staged-mb", "4",
                    "--throttle-mbps", "50", "--dir", str(tmp_path), "--json", str(out),
                    timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert set(result["peers"]) == {"boto3 (floor)", "cairn", "dcp+fsspec", "s3torchconnector"}
    for name, peer in result["peers"].items():
        assert peer["checked"] is True, name  # the first load equals the state
        for op in ("save", "load"):
            assert peer[op]["median_s"] > 0 and math.isfinite(peer[op]["MBps"]), (name, op)
    staged = result["staged"]
    assert 0 < staged["staged_async_stall_s"]["median_s"] <= staged["staged_async_published_s"][
        "median_s"]
    for name in ("cairn_save_throughput / boto3_floor", "cairn_load_time / fsspec_dcp_load_time",
                 "staged_async_published / bandwidth_bound"):
        assert math.isfinite(result["ratios"][name]["value"]), name
    assert [p.name for p in tmp_path.iterdir()] == ["s3.json"]  # scratch removed
