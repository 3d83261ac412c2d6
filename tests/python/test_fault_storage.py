"""Fault injection through fault://NAME/... URIs (cairn._ext.FaultInjector)."""

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
    name = f"t{uuid.uuid4().hex[:8]}"
    with _ext.FaultInjector(name, str(tmp_path)) as inj:
        yield inj, tmp_path


def test_fault_uri_opens_the_registered_base(injector):
    inj, base = injector
    assert inj.uri.startswith("fault://")
    s = _ext.open_storage(inj.uri + "/step_1")
    s.write_file("data/r0.bin", b"hello")
    assert (base / "step_1" / "data" / "r0.bin").read_bytes() == b"hello"
    assert s.read_file("data/r0.bin") == b"hello"
    assert s.list("data") == [("r0.bin", False, 5)]
    assert inj.calls("write") == 1 and inj.calls("sync") == 1 and inj.injected == 0


def test_enospc_on_a_chosen_file(injector):
    inj, _ = injector
    inj.add_rule("write", errno=errno.ENOSPC, key="r1.bin", count=0)
    s = _ext.open_storage(inj.uri)
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
    inj, _ = injector
    inj.add_rule("sync", errno=errno.EIO, nth=2, count=2)
    s = _ext.open_storage(inj.uri)
    results = []
    for i in range(5):
        try:
            s.write_file(f"f{i}", b"x")
            results.append("ok")
        except errors.StorageError:
            results.append("EIO")
    assert results == ["ok", "EIO", "EIO", "ok", "ok"]


def test_short_write_leaves_a_partial_file(injector):
    inj, base = injector
    inj.add_rule("write", errno=errno.EIO, partial_bytes=10)
    s = _ext.open_storage(inj.uri)
    with pytest.raises(errors.StorageError):
        s.write_file("partial.bin", b"x" * 100)
    assert (base / "partial.bin").stat().st_size == 10


def test_rename_and_syncdir_failures_keep_the_old_state(injector):
    inj, base = injector
    s = _ext.open_storage(inj.uri)
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
    inj, _ = injector
    s = _ext.open_storage(inj.uri)
    inj.set_latency("exists", 0.05)
    t0 = time.monotonic()
    assert not s.exists("nothing")
    assert time.monotonic() - t0 >= 0.05
    inj.set_bandwidth(1 << 20)  # 1 MiB/s
    t0 = time.monotonic()
    s.write_file("slow", b"z" * (256 << 10), sync=False)
    assert time.monotonic() - t0 >= 0.24
    inj.set_bandwidth(0)


def test_unknown_operation_and_unregistered_name():
    with pytest.raises(errors.InvalidArgumentError):
        _ext.FaultInjector("bad/name", "/tmp")
    name = f"t{uuid.uuid4().hex[:8]}"
    inj = _ext.FaultInjector(name, "/tmp")
    with pytest.raises(ValueError, match="unknown storage operation"):
        inj.add_rule("scribble")
    inj.close()
    with pytest.raises(FileNotFoundError):
        _ext.open_storage(f"fault://{name}/x")


def test_closing_a_replaced_injector_keeps_the_new_one(tmp_path):
    name = f"t{uuid.uuid4().hex[:8]}"
    old = _ext.FaultInjector(name, str(tmp_path))
    new = _ext.FaultInjector(name, str(tmp_path))  # re-registers the name
    new.add_rule("exists", errno=errno.EIO)
    old.close()
    with pytest.raises(errors.StorageError):
        _ext.open_storage(f"fault://{name}").exists("x")
    new.close()


def test_invalid_keys_are_rejected(injector):
    inj, base = injector
    s = _ext.open_storage(inj.uri)
    for key in ["../escape", "/abs", "a//b", "a\\b"]:
        with pytest.raises(ValueError):
            s.write_file(key, b"x")
    with pytest.raises(ValueError):
        _ext.open_storage(inj.uri + "/../escape")
    assert not (base.parent / "escape").exists()


def test_crash_rule_kills_the_process(tmp_path):
    child = textwrap.dedent(f"""
        from cairn import _ext
        inj = _ext.FaultInjector("crash", {str(tmp_path)!r})
        inj.add_rule("rename", crash=True)
        s = _ext.open_storage("fault://crash")
        s.write_file("a.tmp", b"data")
        s.rename("a.tmp", "a")
        print("survived")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert "survived" not in proc.stdout
    assert (tmp_path / "a.tmp").exists() and not (tmp_path / "a").exists()
