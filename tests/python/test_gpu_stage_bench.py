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
    """The benchmark's CompletedProcess, with its pid (`.pid`)."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(cairn.__file__)))
    with subprocess.Popen([sys.executable, SCRIPT, *args], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as p:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
    proc = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    proc.pid = p.pid
    return proc


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_exits_cleanly_without_a_gpu():
    proc = run_bench()
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_measures_every_method_on_cpu_tensors():
    proc = run_bench("--device", "cpu", "--gb", "0.005", "--reps", "3", "--warmup", "1")
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results["tensors"] == 200
    assert set(results["median_s"]) == {"floor", "stager", "dcp_async_save", "manager"}
    assert all(v > 0 for v in results["median_s"].values())
    # The stager freed its shared memory (its names carry the benchmark's pid).
    mine = f"cairn-stager-{proc.pid}-"
    assert not any(n.startswith(mine) for n in os.listdir("/dev/shm"))
