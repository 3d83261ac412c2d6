"""`cairn drill`: restore the newest checkpoint in fresh processes, verify, report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import cairn
from gloo_harness import run_ranks
from test_s3 import s3  # noqa: F401 - fixture: a bucket prefix on the moto server of conftest.py

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROOT = Path(__file__).resolve().parents[2]
CLI = os.environ.get("CAIRN_CLI", str(ROOT / "build" / "cairn"))


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "optim": {"lr": 0.1, "betas": (0.9, 0.95)}, "step": seed}


def drill(*args: str, cli: bool = False) -> subprocess.CompletedProcess:
    cmd = [CLI, "drill"] if cli else [sys.executable, "-m", "cairn.drill"]
    env = dict(os.environ, CAIRN_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(cmd + list(args), capture_output=True, text=True, env=env, timeout=300)


def _save_on_ranks(rank: int, world: int, root: str, step: int) -> None:
    sd = state(step)  # replicated: the same on every rank
    dcp.save(sd, storage_writer=cairn.Writer(os.path.join(root, f"step_{step}")))
    dist.barrier()


def report(out: str) -> dict:
    return json.loads(out)


def test_good_checkpoint_saved_on_two_ranks_restores_on_one(tmp_path):
    run_ranks(2, _save_on_ranks, str(tmp_path), 3)
    run_ranks(2, _save_on_ranks, str(tmp_path), 5)
    r = drill(str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    rep = report(r.stdout)
    assert rep["checkpoint"].endswith("step_5") and rep["tier"] == "durable"
    assert rep["world_size"] == 1 and rep["saved_world_size"] == 2
    assert rep["tensors"] == 2 and rep["bytes"] == (64 * 32 + 32) * 4
    assert rep["verify_s"] is not None


def test_good_checkpoint_saved_on_one_rank_restores_on_two_through_the_cli(tmp_path):
    if not os.access(CLI, os.X_OK):
        pytest.fail(f"the cairn CLI is not built at {CLI}")
    dcp.save(state(4), storage_writer=cairn.Writer(tmp_path / "step_4"))
    r = drill(str(tmp_path), "--world-size", "2", cli=True)
    assert r.returncode == 0, r.stderr
    assert "OK: restored" in r.stdout and "step_4" in r.stdout
    assert "ranks       2 (saved on 1)" in r.stdout and "tier        durable" in r.stdout


def test_file_uri_and_checkpoint_path(tmp_path):
    dcp.save(state(1), storage_writer=cairn.Writer(tmp_path / "step_1"))
    r = drill(f"file://{tmp_path}/step_1", "--json")
    assert r.returncode == 0, r.stderr
    assert report(r.stdout)["checkpoint"] == f"file://{tmp_path}/step_1"


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("world", [1, 2])
def test_corrupt_data_file_fails_naming_file_and_tensor(tmp_path, world):
    dcp.save(state(2), storage_writer=cairn.Writer(tmp_path / "step_2"))
    offset = int(subprocess.run([sys.executable, "-c", (
        "import sys; sys.path.insert(0, %r); from cairn import _ext; "
        "m = _ext.CheckpointReader(_ext.open_storage(%r, create=False)).manifest(); "
        "print(next(t.chunks[0].location.offset for t in m.tensors if t.fqn == 'model.b'))")
        % (str(ROOT / "python"), str(tmp_path / "step_2"))],
        capture_output=True, text=True, check=True).stdout)
    _flip(tmp_path / "step_2" / "data" / "r0.bin", offset + 3)
    r = drill(str(tmp_path), "--world-size", str(world))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED" in r.stderr and "data/r0.bin" in r.stderr and "'model.b'" in r.stderr


def test_nothing_to_restore_exits_2(tmp_path):
    r = drill(str(tmp_path))
    assert r.returncode == 2 and "no committed checkpoint" in r.stderr


def test_tier_choice_with_a_manager_root(tmp_path):
    root, local = tmp_path / "durable", tmp_path / "local"
    mgr = cairn.CheckpointManager(root, memory=True, local=local, keep=2)
    try:
        for step in (10, 20):
            mgr.save(step, {"model": state(step)["model"]})
            mgr.wait()
        for tier, extra in (("memory", []), ("local", ["--local", str(local)]),
                            ("durable", [])):
            r = drill(str(root), "--tier", tier, "--json", *extra)
            assert r.returncode == 0, (tier, r.stderr)
            rep = report(r.stdout)
            assert rep["tier"] == tier and rep["tensors"] == 2, rep
            if tier == "memory":
                assert rep["checkpoint"].startswith("shm://cairn-")
            else:
                assert rep["checkpoint"].endswith("step_0000000020"), rep
        r = drill(str(root), "--tier", "local")
        assert r.returncode != 0 and "--local" in r.stderr
    finally:
        mgr.close()
    # The memory tier ends with the manager: nothing left to drill there.
    r = drill(str(root), "--tier", "memory")
    assert r.returncode == 2 and "memory tier" in r.stderr


def test_s3_checkpoint_restores_on_two_ranks(s3):  # noqa: F811 - the fixture
    root = s3[0]
    dcp.save(state(6), storage_writer=cairn.Writer(root + "/step_6"))
    r = drill(root, "--world-size", "2", "--json")
    assert r.returncode == 0, r.stderr
    rep = report(r.stdout)
    assert rep["checkpoint"] == root + "/step_6" and rep["tensors"] == 2
