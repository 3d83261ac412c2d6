"""The restore contract (docs/memory.md): a restarted process that ends without
saving keeps the memory tier's newest step; exiting after restore() never aborts;
restore() loads what dcp.load loads, from every tier; a state that does not match
is the caller's error, not corruption; errors are cairn.Error."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import cairn
from cairn import _ext
from cairn.manager import memory_tier_name

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A restarted process: restore() (the memory tier's step, pre-faulting the next
# slot in the background), then end as the test says.
_LIFE = textwrap.dedent("""
    import os, signal, sys, torch, cairn
    root, how = sys.argv[1], sys.argv[2]
    n = 1 << 22  # 16 MiB: the next slot is still being pre-faulted at exit
    if how == "seed":
        m = cairn.CheckpointManager(root, memory=True)
        for s in (1, 2, 3):  # 1 durable, 2 and 3 in memory only
            m.save(s, {"w": torch.full((n,), float(s)), "epoch": s, "tag": f"t{s}"},
                   durable=s == 1)
            m.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    m = cairn.CheckpointManager(root, memory=True)
    state = {"w": torch.zeros(n), "epoch": 0, "tag": ""}
    step = m.restore(state)
    assert (step, state["epoch"], state["tag"]) == (3, 3, "t3"), (step, state)
    assert bool((state["w"] == 3).all())
    print("restored", step, m.restored, flush=True)
    if how == "exit":
        sys.exit(0)
    if how == "raise":
        raise RuntimeError("user code fails after restore")
    if how == "raise-in-with":
        with m:
            raise RuntimeError("user code fails inside the with block")
""")


# One interpreter imports torch once and forks each life (as tests/chaos/crash_loop.py
# does): the child runs _LIFE at the top level, so it ends as a script does, through
# the interpreter's own exit (atexit hooks, finalization), with its own status.
_ZYGOTE = textwrap.dedent("""
    import os, sys, torch, cairn
    for line in sys.stdin:
        root, how, log = line.split()
        pid = os.fork()
        if pid == 0:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            sys.argv = ["life", root, how]
            break
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
    else:
        sys.exit(0)
""")


class _Lives:
    """The driver's side of _ZYGOTE: run(root, how) is one life's (status, output)."""

    def __init__(self, tmp_path) -> None:
        env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"), OMP_NUM_THREADS="1")
        self.tmp, self.n = tmp_path, 0
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE + _LIFE], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)

    def run(self, root: str, how: str) -> tuple[int, str]:
        self.n += 1
        log = str(self.tmp / f"life{self.n}.log")
        self.proc.stdin.write(f"{root} {how} {log}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the zygote ended: {open(log).read()[-3000:] if os.path.exists(log) else ''}"
        return int(line), open(log).read()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


def test_memory_only_step_survives_restarts_that_exit_raise_or_close(tmp_path):
    """Issue 21 points 1 and 2: steps 2 and 3 exist in memory only; restarted
    processes restore step 3 and then exit without close(), raise without close(),
    raise inside ``with`` (close() flushes it): each exits with its own status and
    no abort, and the next one still restores step 3."""
    root = str(tmp_path / "ckpt")
    shm = os.path.join("/dev/shm", memory_tier_name(root))
    lives = _Lives(tmp_path)
    try:
        rc, out = lives.run(root, "seed")
        assert rc == -9, out
        for how, rc, said in (("exit", 0, None), ("raise", 1, "user code fails after restore"),
                              ("raise-in-with", 1, "user code fails inside the with block")):
            got, out = lives.run(root, how)
            assert "terminate called" not in out and "Fatal Python" not in out, out
            assert got == rc, (how, got, out[-3000:])
            assert "restored 3" in out, (how, out[-3000:])
            if said:
                assert said in out and "Traceback" in out
        # The last one closed: step 3 is durable now and the memory tier is gone.
        assert not os.path.exists(shm)
        state = {"w": torch.zeros(1 << 22), "epoch": 0, "tag": ""}
        with cairn.CheckpointManager(root, memory=True) as m:
            assert m.restore(state) == 3 and m.restored == (3, "durable")
        assert state["epoch"] == 3 and state["tag"] == "t3" and bool((state["w"] == 3).all())
    finally:
        lives.close()
        import shutil
        shutil.rmtree(shm, ignore_errors=True)


# ---- restore() loads what dcp.load loads ------------------------------------------


class Counter:
    """A Stateful with a tensor and a plain value."""

    def __init__(self, n: int = 0):
        self.n = n
        self.t = torch.full((3,), float(n))

    def state_dict(self):
        return {"n": self.n, "t": self.t}

    def load_state_dict(self, sd):
        self.n = sd["n"]
        self.t = sd["t"]


def _every_kind(k: int) -> dict:
    """A state with every kind of value, all depending on `k` (0: blank)."""
    return {
        "w": torch.arange(8, dtype=torch.float32) * k,
        "strided": (torch.arange(12, dtype=torch.float64).reshape(3, 4) * k).t(),  # DCP path
        "i64": torch.tensor([k, -k], dtype=torch.int64),
        "epoch": k, "lr": 0.5 * k, "tag": f"tag{k}", "flag": k % 2 == 1,
        "nested": {"step": k, "names": [f"n{k}", "m"], "inner": {"t": torch.ones(2) * k,
                                                                 "x": k * 3}},
        "counter": Counter(k),
    }


def _plain(v):
    if isinstance(v, torch.Tensor):
        return ("tensor", str(v.dtype), tuple(v.shape), v.tolist())
    if isinstance(v, Counter):
        return ("counter", v.n, v.t.tolist())
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def test_restore_loads_what_dcp_load_loads_from_every_tier(tmp_path):
    """Issue 21 point 3: top-level plain values, nested containers, Statefuls and
    tensors (in place and through DCP's planner) come back from each tier exactly
    as dcp.load(state, storage_reader=cairn.Reader(path)) brings them back."""
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    mgr = cairn.CheckpointManager(root, memory=True, local=local)
    mgr.save(7, _every_kind(7))
    mgr.wait()
    by_dcp = _every_kind(0)
    dcp.load(by_dcp, storage_reader=cairn.Reader(os.path.join(root, _ext.TierSet.step_dir(7))))
    want = _plain(by_dcp)
    assert want == _plain(_every_kind(7))
    got = _every_kind(0)
    assert mgr.restore(got) == 7 and mgr.restored == (7, "memory")
    assert _plain(got) == want
    mgr.close()
    for kwargs, tier in (({"local": local}, "local"), ({}, "durable")):
        with cairn.CheckpointManager(root, memory=False, **kwargs) as m:
            got = _every_kind(0)
            assert m.restore(got) == 7 and m.restored == (7, tier)
            assert _plain(got) == want, tier
    # A fresh process's memory tier: a manager of the same root (the first one
    # kept it open, as a crashed process would have).
    keep = cairn.CheckpointManager(root, memory=True)
    keep.save(8, _every_kind(8), durable=False)
    keep.wait()
    keep._end_at_exit()  # ends as an exit without close() does: the tier stays
    with cairn.CheckpointManager(root, memory=True) as m:
        got = _every_kind(0)
        assert m.restore(got) == 8 and m.restored == (8, "memory")
        assert _plain(got) == _plain(_every_kind(8))


# ---- a mismatch is not corruption -------------------------------------------------


def test_mismatched_state_raises_invalid_argument_without_falling_back(tmp_path, caplog):
    """Issue 21 point 4: step 2's w has another shape than the state's: restore()
    raises InvalidArgumentError (a ValueError) naming the key and both shapes,
    rather than restoring step 1 silently; skip_mismatched=True restores step 1 and
    logs the skipped step at WARNING."""
    root = str(tmp_path)
    with cairn.CheckpointManager(root, memory=False) as m:
        m.save(1, {"w": torch.ones(4), "b": torch.zeros(2)})
        m.save(2, {"w": torch.ones(6), "b": torch.zeros(2, dtype=torch.float64)})
    with cairn.CheckpointManager(root, memory=False) as m:
        with pytest.raises(cairn.InvalidArgumentError) as e:
            m.restore({"w": torch.zeros(4), "b": torch.zeros(2)})
        msg = str(e.value)
        assert isinstance(e.value, ValueError) and "step 2" in msg
        assert "'w'" in msg and "(6,)" in msg and "(4,)" in msg
        assert "'b'" in msg and "float64" in msg and "float32" in msg
        with pytest.raises(cairn.InvalidArgumentError, match="'extra' is not in the checkpoint"):
            m.restore({"w": torch.zeros(6), "b": torch.zeros(2, dtype=torch.float64),
                       "extra": torch.zeros(1)})
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="cairn.manager"):
            state = {"w": torch.zeros(4), "b": torch.zeros(2)}
            assert m.restore(state, skip_mismatched=True) == 1
        assert bool((state["w"] == 1).all())
        assert any(r.levelno == logging.WARNING and "skipping step 2" in r.getMessage()
                   for r in caplog.records), caplog.text


def test_damaged_newest_step_falls_back_with_a_warning(tmp_path, caplog):
    """Fallback stays for damage: a flipped byte in step 2's data file restores
    step 1, and the skipped step is logged at WARNING with the reason."""
    root = str(tmp_path)
    with cairn.CheckpointManager(root, memory=False) as m:
        m.save(1, {"w": torch.ones(1024)})
        m.save(2, {"w": torch.full((1024,), 2.0)})
    data = os.path.join(root, _ext.TierSet.step_dir(2), _ext.data_file_key(0))
    with open(data, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    with caplog.at_level(logging.WARNING, logger="cairn.manager"):
        with cairn.CheckpointManager(root, memory=False) as m:
            state = {"w": torch.zeros(1024)}
            assert m.restore(state) == 1
    assert any(r.levelno == logging.WARNING and "skipping step 2" in r.getMessage()
               for r in caplog.records), caplog.text


# ---- errors are cairn.Error --------------------------------------------------------


class Custom:
    """A value only unrestricted unpickling loads."""

    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Custom) and other.x == self.x


def test_errors_are_cairn_errors_and_allow_pickle(tmp_path):
    """Issue 21 point 5: an unsavable value is InvalidArgumentError (an ordinary
    Exception, DCP's CheckpointException as __cause__); under a direct dcp.save,
    cairn.dcp.unwrap gives cairn's PreconditionError; a custom class warns at save
    and loads with CheckpointManager(allow_pickle=True)."""
    with cairn.CheckpointManager(str(tmp_path / "a"), memory=False) as m:
        with pytest.raises(cairn.InvalidArgumentError) as e:
            m.save(1, {"w": torch.ones(2), "f": lambda: 1})
        assert isinstance(e.value, Exception)
        assert isinstance(e.value.__cause__, CheckpointException)
        m.save(2, {"w": torch.ones(2)})  # the manager goes on
    path = str(tmp_path / "b")
    dcp.save({"w": torch.ones(2)}, storage_writer=cairn.Writer(path))
    with pytest.raises(CheckpointException) as e:
        dcp.save({"w": torch.ones(2)}, storage_writer=cairn.Writer(path, overwrite=False))
    assert isinstance(cairn.dcp.unwrap(e.value), cairn.PreconditionError)

    root = str(tmp_path / "c")
    with cairn.CheckpointManager(root, memory=False) as m:
        with pytest.warns(UserWarning, match="allow_pickle=True"):
            m.save(1, {"w": torch.ones(2), "obj": Custom(5)})
    with cairn.CheckpointManager(root, memory=False, allow_pickle=True) as m:
        state = {"w": torch.zeros(2), "obj": None}
        assert m.restore(state) == 1
        assert state["obj"] == Custom(5)
