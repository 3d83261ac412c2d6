"""Executors: one process-wide, sized I/O pool; nothing creates a pool per call."""

import os
import subprocess
import sys
import textwrap

import torch
import torch.distributed.checkpoint as dcp

import cairn
from cairn import _ext, _pools


def test_sizes_come_from_the_one_sizing_rule():
    assert 16 <= _pools.thread_count("io") <= 32
    assert 2 <= _pools.thread_count("copy") <= 8
    assert _pools.io_pool().size == _pools.thread_count("io")
    assert _pools.io_pool() is _pools.io_pool()


def test_saves_loads_and_verifies_create_no_pool_per_call(tmp_path, monkeypatch):
    state = {"w": torch.randn(64, 8), "step": 3}
    dcp.save(state, storage_writer=cairn.Writer(str(tmp_path / "warm")))  # process pool exists
    made = []
    real = _ext.ThreadPool

    def counting(n):
        made.append(n)
        return real(n)

    monkeypatch.setattr(_ext, "ThreadPool", counting)
    for i in range(3):
        path = str(tmp_path / f"step_{i}")
        dcp.save(state, storage_writer=cairn.Writer(path))
        dcp.load({"w": torch.zeros(64, 8), "step": 0}, storage_reader=cairn.Reader(path))
        cairn.verify(path)
        cairn.copy_checkpoint(path, str(tmp_path / f"copy_{i}"), sync=False)
    assert made == []
    # A thread_count of one's own gives that object its own pool, once.
    w = cairn.Writer(str(tmp_path / "own"), thread_count=3)
    dcp.save(state, storage_writer=w)
    dcp.save(state, storage_writer=w, checkpoint_id=str(tmp_path / "own2"))
    assert made == [3]


def test_a_forked_child_gets_a_working_pool_of_its_own(tmp_path):
    path = str(tmp_path / "ck")
    dcp.save({"w": torch.randn(100)}, storage_writer=cairn.Writer(path))
    cairn.verify(path)  # the parent's pool has live threads now
    script = textwrap.dedent(f"""
        import os, sys
        import cairn
        from cairn import _pools
        cairn.verify({path!r})
        parent = _pools.io_pool()
        pid = os.fork()
        if pid == 0:
            ok = _pools.io_pool() is not parent
            cairn.verify({path!r})  # would hang on the parent's (threadless) pool
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "..",
                                                   "python"))
    r = subprocess.run([sys.executable, "-c", script], env=env, timeout=120)
    assert r.returncode == 0
