"""Fault injection by wrapping an open storage (cairn._ext.FaultInjector.wrap)."""

import errno
import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from cairn import _ext
from cairn import errors


@pytest.fixture
def injector(tmp_path):
    inj = _ext.FaultInjector()
    yield inj, tmp_path, inj.wrap(_ext.open_storage(str(tmp_path)))


def test_a_wrapped_storage_reaches_its_base(injector):
    inj, base, root = injector
    s = inj.wrap(_ext.open_storage(str(base / "step_1")))
    assert s.local_path() == str(base / "step_1") and s.uri == str(base / "step_1")
    s.write_file("data/r0.bin", b"hello")
    assert (base / "step_1" / "data" / "r0.bin").read_bytes() == b"hello"
    assert s.read_file("data/r0.bin") == b"hello"
    assert s.list("data") == [("r0.bin", False, 5)]
    assert inj.calls("write") == 1 and inj.calls("sync") == 1 and inj.injected == 0


def test_enospc_on_a_chosen_file(injector):
    inj, _, s = injector
    inj.add_rule("write", errno=errno.ENOSPC, key="r1.bin", count=0)
    s.write_file("data/r0.bin", b"fine")
    with pytest.raises(errors.ResourceExhaustedError) as ei:
        s.write_file("data/r1.bin", b"no room")
    assert isinstance(ei.value, OSError)
    assert ei.value.sys_errno == errno.ENOSPC
    assert "injected fault: write data/r1.bin" in str(ei.value)
    with pytest.raises(errors.ResourceExhaustedError):
        s.write_file("data/r1.bin", b"still no room")
    assert inj.injected == 2


def test_nth_call_and_count(injector):
    inj, _, s = injector
    inj.add_rule("sync", errno=errno.EIO, nth=2, count=2)
    results = []
    for i in range(5):
        try:
            s.write_file(f"f{i}", b"x")
            results.append("ok")
        except errors.StorageError:
            results.append("EIO")
    assert results == ["ok", "EIO", "EIO", "ok", "ok"]


def test_short_write_leaves_a_partial_file(injector):
    inj, base, s = injector
    inj.add_rule("write", errno=errno.EIO, partial_bytes=10)
    with pytest.raises(errors.StorageError):
        s.write_file("partial.bin", b"x" * 100)
    assert (base / "partial.bin").stat().st_size == 10


def test_rename_and_syncdir_failures_keep_the_old_state(injector):
    inj, base, s = injector
    s.write_file("cairn.manifest.tmp", b"m")
    rid = inj.add_rule("rename", errno=errno.EACCES, key="cairn.manifest")
    with pytest.raises(errors.PermissionDeniedError):
        s.rename("cairn.manifest.tmp", "cairn.manifest")
    assert not (base / "cairn.manifest").exists()
    assert inj.remove_rule(rid)
    inj.add_rule("syncdir", errno=errno.EIO)
    s.rename("cairn.manifest.tmp", "cairn.manifest")
    with pytest.raises(errors.StorageError):
        s.sync_dir("")
    inj.clear()
    s.sync_dir("")


def test_latency_and_bandwidth(injector):
    inj, _, s = injector
    inj.set_latency("exists", 0.05)
    t0 = time.monotonic()
    assert not s.exists("nothing")
    assert time.monotonic() - t0 >= 0.05
    inj.set_bandwidth(1 << 20)  # 1 MiB/s
    t0 = time.monotonic()
    s.write_file("slow", b"z" * (256 << 10), sync=False)
    assert time.monotonic() - t0 >= 0.24
    inj.set_bandwidth(0)


def test_unknown_operation_and_no_fault_scheme():
    inj = _ext.FaultInjector()
    with pytest.raises(ValueError, match="unknown storage operation"):
        inj.add_rule("scribble")
    # Wrappers wrap open storages: there is no URI scheme (and no registry) for them.
    with pytest.raises(ValueError, match="unsupported storage URI scheme"):
        _ext.open_storage(f"fault://t{uuid.uuid4().hex[:8]}/x")


def test_wrappers_share_one_injector_and_keep_their_base_alive(tmp_path):
    inj = _ext.FaultInjector()
    a = inj.wrap(_ext.open_storage(str(tmp_path / "a")))  # the bases: only the wrappers hold them
    b = inj.wrap(_ext.open_storage(str(tmp_path / "b")))
    inj.add_rule("exists", errno=errno.EIO, count=0)
    for s in (a, b):
        with pytest.raises(errors.StorageError):
            s.exists("x")
    assert inj.calls("exists") == 2
    del inj  # the wrappers keep the injector too
    with pytest.raises(errors.StorageError):
        a.exists("x")
    twice = _ext.FaultInjector().wrap(b)  # a wrapper of a wrapper: both injectors apply
    with pytest.raises(errors.StorageError):
        twice.exists("x")


def test_invalid_keys_are_rejected(injector):
    inj, base, s = injector
    for key in ["../escape", "/abs", "a//b", "a\\b"]:
        with pytest.raises(ValueError):
            s.write_file(key, b"x")
    assert not (base.parent / "escape").exists()


def test_crash_rule_kills_the_process(tmp_path):
    child = textwrap.dedent(f"""
        from cairn import _ext
        inj = _ext.FaultInjector()
        inj.add_rule("rename", crash=True)
        s = inj.wrap(_ext.open_storage({str(tmp_path)!r}))
        s.write_file("a.tmp", b"data")
        s.rename("a.tmp", "a")
        print("survived")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert "survived" not in proc.stdout
    assert (tmp_path / "a.tmp").exists() and not (tmp_path / "a").exists()
