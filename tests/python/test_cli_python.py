"""The CLI finds its Python however it is run, and its errors are clear (issue 21).

`cairn drill` and `cairn bench` are Python modules the C++ CLI execs: these tests
run build/cairn with a bare PATH (the venv inactive), through a symlink in a
venv-like bin/ directory, and with $CAIRN_PYTHON, and check the error that lists
what was tried when no Python can import cairn. Also: verify of a root or of a
stock DCP checkpoint, `cairn rm` of an shm:// checkpoint, and an exception in
the CLI becoming an error instead of an abort.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cairn

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(os.environ.get("CAIRN_CLI", str(ROOT / "build" / "cairn")))
BARE_PATH = "/usr/bin:/bin"


@pytest.fixture(autouse=True)
def _built():
    if not os.access(CLI, os.X_OK):
        pytest.fail(f"the cairn CLI is not built at {CLI}")


def _env(**extra: str) -> dict[str, str]:
    """A bare environment: PATH without the venv, no CAIRN_PYTHON, this tree's package."""
    env = {k: v for k, v in os.environ.items() if k not in ("CAIRN_PYTHON", "VIRTUAL_ENV")}
    env["PATH"] = BARE_PATH
    env["PYTHONPATH"] = str(ROOT / "python")
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def _save(path: Path | str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {"w": torch.randn(32, 8, generator=g), "step": seed}
    dcp.save(sd, storage_writer=cairn.Writer(str(path)))
    return sd


def test_drill_by_path_with_a_bare_path(tmp_path):
    _save(tmp_path / "step_3", 3)
    r = _run([str(CLI), "drill", str(tmp_path)], _env())
    assert r.returncode == 0, r.stderr
    assert "OK: restored" in r.stdout and "step_3" in r.stdout


def test_bench_help_through_a_venv_symlink_with_a_bare_path(tmp_path):
    # A venv's bin/: its python and the cairn symlink scripts/setup.sh makes.
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python3").symlink_to(sys.executable)
    (bin_dir / "cairn").symlink_to(CLI)
    r = _run([str(bin_dir / "cairn"), "bench", "--help"], _env())
    assert r.returncode == 0, r.stderr
    assert "usage: cairn bench" in r.stdout and "--size-gb" in r.stdout
    # Found on PATH by name, too.
    r = _run(["cairn", "bench", "--help"], _env(PATH=f"{bin_dir}:{BARE_PATH}"))
    assert r.returncode == 0, r.stderr
    assert "usage: cairn bench" in r.stdout


def test_cairn_python_is_used_and_a_wrong_one_is_named(tmp_path):
    r = _run([str(CLI), "bench", "--help"], _env(CAIRN_PYTHON=sys.executable))
    assert r.returncode == 0, r.stderr
    bogus = str(tmp_path / "no-python")
    r = _run([str(CLI), "drill", "--help"], _env(CAIRN_PYTHON=bogus))
    assert r.returncode == 2
    assert f"$CAIRN_PYTHON={bogus}" in r.stderr and "No such file" in r.stderr, r.stderr


def test_no_python_that_runs_cairn_lists_what_was_tried(tmp_path):
    # A CLI symlinked into a bin/ without python, and a PYTHONHOME that stops every
    # interpreter from starting: each candidate is named with why it was passed over.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cairn").symlink_to(CLI)
    r = _run([str(bin_dir / "cairn"), "drill", str(tmp_path)],
             _env(PYTHONHOME=str(tmp_path / "no-python-home")))
    assert r.returncode == 2, r.stderr
    err = r.stderr
    assert err.startswith("cairn drill: no Python that can import cairn"), err
    assert "$CAIRN_PYTHON (unset)" in err, err
    assert f"{bin_dir}/python3 (next to {bin_dir}/cairn): not there" in err, err
    assert "(the Python this CLI was built for): does not run" in err, err
    assert "python3 (on PATH): " in err and "Set CAIRN_PYTHON" in err, err


def test_verify_of_a_root_names_its_checkpoints(tmp_path):
    _save(tmp_path / "step_1", 1)
    _save(tmp_path / "step_5", 5)
    (tmp_path / "step_9" / "data").mkdir(parents=True)  # a save in flight
    r = _run([str(CLI), "verify", str(tmp_path)], _env())
    assert r.returncode == 2, r.stderr
    assert "DataLoss" not in r.stderr and "never committed" not in r.stderr, r.stderr
    assert "is a root of checkpoints" in r.stderr, r.stderr
    assert "step_1, step_5, step_9 (partial)" in r.stderr, r.stderr
    assert f"{tmp_path}/step_5" in r.stderr, r.stderr
    with pytest.raises(cairn.InvalidArgumentError, match="root of checkpoints"):
        cairn.verify(tmp_path)


def test_verify_of_a_stock_checkpoint_says_what_it_is(tmp_path):
    sd = {"w": torch.arange(12.0)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "stock"))
    r = _run([str(CLI), "verify", str(tmp_path / "stock")], _env())
    assert r.returncode == 2, r.stderr
    assert "DataLoss" not in r.stderr and "never committed" not in r.stderr, r.stderr
    assert "stock torch.distributed.checkpoint" in r.stderr and "cairn.Reader loads it" in r.stderr
    with pytest.raises(cairn.InvalidArgumentError, match="stock"):
        cairn.verify(tmp_path / "stock")
    out = {"w": torch.zeros(12)}
    dcp.load(out, storage_reader=cairn.Reader(str(tmp_path / "stock")))  # as the message says
    assert torch.equal(out["w"], sd["w"])


def test_a_partial_checkpoint_is_still_data_loss(tmp_path):
    (tmp_path / "step_2" / "data").mkdir(parents=True)
    r = _run([str(CLI), "verify", str(tmp_path / "step_2")], _env())
    assert r.returncode == 1 and "partial (never committed" in r.stderr, r.stderr


def test_rm_frees_an_shm_checkpoint(tmp_path):
    name = f"cairn-rm-test-{uuid.uuid4().hex[:8]}"
    try:
        _save(f"shm://{name}")
        assert Path("/dev/shm", name, "cairn.manifest").exists()
        # A root is refused before anything is removed.
        _save(tmp_path / "step_1")
        r = _run([str(CLI), "rm", str(tmp_path)], _env())
        assert r.returncode == 1 and "a root of checkpoints" in r.stderr, r.stderr
        assert (tmp_path / "step_1" / "cairn.manifest").exists()
        r = _run([str(CLI), "rm", f"shm://{name}"], _env())
        assert r.returncode == 0, r.stderr
        assert not Path("/dev/shm", name).exists()
        # And from Python.
        _save(f"shm://{name}")
        cairn.remove_checkpoint(f"shm://{name}")
        assert not Path("/dev/shm", name).exists()
        with pytest.raises(cairn.NotFoundError):
            cairn.remove_checkpoint(f"shm://{name}")
    finally:
        subprocess.run(["rm", "-rf", f"/dev/shm/{name}"], check=False)


def test_an_exception_in_the_cli_is_an_error_not_an_abort(tmp_path):
    # Every thread of the I/O pool would reserve a 1 GiB stack in a 600 MB address
    # space: no thread can start, and std::thread throws std::system_error.
    _save(tmp_path / "step_1")
    r = _run(["bash", "-c", f"ulimit -s 1048576; ulimit -v 600000; exec {CLI} verify "
              f"{tmp_path}/step_1"], _env())
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "terminate called" not in r.stderr and r.stderr.startswith("cairn: error: "), r.stderr


def test_a_pool_the_system_starts_only_part_of_still_works(tmp_path):
    # 64 MiB stacks in a 600 MB address space: a few of the pool's threads start,
    # the others are refused; the pool works with those that started.
    _save(tmp_path / "step_1")
    r = _run(["bash", "-c", f"ulimit -s 65536; ulimit -v 600000; exec {CLI} -j 64 verify "
              f"{tmp_path}/step_1"], _env())
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.startswith("OK: "), r.stdout
