"""Smoke tests of bench/gpu_stage.py (the CUDA staging benchmark): it must exit
cleanly where there is no GPU, and its measuring code must run (on CPU tensors)."""

import json
import os
import subprocess
import sys

import pytest
import torch

import cairn

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "bench", "gpu_stage.py")


def run_bench(*args):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(cairn.__file__)))
    return subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_exits_cleanly_without_a_gpu():
    proc = run_bench()
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_measures_every_method_on_cpu_tensors():
    before = {n for n in os.listdir("/dev/shm") if n.startswith("cairn-stager-")}
    proc = run_bench("--device", "cpu", "--gb", "0.005", "--reps", "3", "--warmup", "1")
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results["tensors"] == 200
    assert set(results["median_s"]) == {"floor", "stager", "dcp_async_save", "manager"}
    assert all(v > 0 for v in results["median_s"].values())
    after = {n for n in os.listdir("/dev/shm") if n.startswith("cairn-stager-")}
    assert after <= before  # the stager freed its shared memory
