"""cairn over s3:// against a real local S3 server (moto, SigV4 checked).

One moto server (tests/s3/moto_server.py, auth on: every request's signature
is verified) serves the module; each test works below its own prefix. The
fault tests put tests/python/s3_fault_proxy.py between cairn and moto.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cairn
import cairn.errors
import dcp_states
from gloo_harness import run_ranks
from s3_fault_proxy import FaultProxy

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROOT = Path(__file__).resolve().parents[2]
CLI = os.environ.get("CAIRN_CLI", str(ROOT / "build" / "cairn"))
PART = 5 << 20  # S3's minimum part size: small states still go multipart


@pytest.fixture
def s3(moto, monkeypatch):
    """Points cairn at moto; returns (root URI, boto3 client, bucket, prefix)."""
    root, prefix, _ = moto.use(monkeypatch, part_size=PART)
    return root, moto.boto3_client(), moto.bucket, prefix


def _state(seed=0, mib=12):
    g = torch.Generator().manual_seed(seed)
    n = (mib << 20) // 4 // 3
    return {
        "w1": torch.randn(n, generator=g),
        "w2": torch.randn(n // 7, 7, generator=g),
        "b": torch.randn(3, generator=g),
        "step": torch.tensor(seed),
    }


def _save(uri, sd):
    dcp.save(sd, storage_writer=cairn.Writer(uri))


def _load_equals(uri, ref):
    sd = {k: torch.zeros_like(v) for k, v in ref.items()}
    dcp.load(sd, storage_reader=cairn.Reader(uri))
    for k, v in ref.items():
        assert torch.equal(sd[k], v), k


def _keys(client, bucket, prefix):
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out += [o["Key"] for o in page.get("Contents", [])]
    return sorted(out)


def _uploads(client, bucket, prefix):
    return client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])


def _cli(*args, env=None, check=True):
    r = subprocess.run([CLI, *args], capture_output=True, text=True, env=env, timeout=300)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


# ---- the Python API and the CLI ---------------------------------------------------


def test_writer_reader_latest_valid_verify_roundtrip(s3):
    root, client, bucket, prefix = s3
    assert cairn.latest_valid(root) is None
    _save(root + "/step_1", _state(1))
    _save(root + "/step_2", _state(2))
    assert cairn.latest_valid(root) == root + "/step_2"
    cairn.verify(root + "/step_2")
    _load_equals(root + "/step_1", _state(1))
    _load_equals(root + "/step_2", _state(2))
    keys = _keys(client, bucket, prefix + "/step_2/")
    assert prefix + "/step_2/cairn.manifest" in keys
    assert not any(k.endswith(".tmp") for k in keys), keys
    assert _uploads(client, bucket, prefix) == []


def test_cli_ls_inspect_verify_cp_prune(s3, tmp_path):
    root, client, bucket, prefix = s3
    _save(root + "/step_3", _state(3))
    r = _cli("ls", root)
    assert "step_3" in r.stdout, r.stdout
    assert "w1" in _cli("inspect", root + "/step_3").stdout
    assert "OK" in _cli("verify", root + "/step_3").stdout
    local = tmp_path / "local"
    _cli("cp", root + "/step_3", str(local))
    _load_equals(str(local), _state(3))
    r = _cli("cp", "--verify", str(local), root + "/step_4")
    assert "copied" in r.stdout
    _load_equals(root + "/step_4", _state(3))
    _cli("prune", root, "-k", "1")
    assert cairn.latest_valid(root) == root + "/step_4"
    assert not any("/step_3/" in k for k in _keys(client, bucket, prefix + "/"))


def test_wrong_secret_is_permission_denied_without_the_secret(s3, monkeypatch):
    root, *_ = s3
    _save(root + "/step_1", _state(1, mib=1))
    wrong = "WrongSecret+abc/0123456789"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    with pytest.raises(cairn.errors.PermissionDeniedError) as e:
        cairn.verify(root + "/step_1")
    assert wrong not in str(e.value)
    r = _cli("ls", root, check=False)
    assert r.returncode != 0 and "PermissionDenied" in r.stderr and wrong not in r.stderr


def test_second_writer_of_a_step_cannot_commit_over_the_first(s3):
    root, *_ = s3
    _save(root + "/step_1", _state(1, mib=1))
    # The first commit wins; the second writer's manifest PUT (If-None-Match)
    # is refused, whatever it wrote before.
    # (A manifest byte for byte the stored one would be that same commit,
    # retried: it succeeds; another writer's differs, if only in its time.)
    ext = cairn._ext
    step = ext.open_storage(root + "/step_1", create=False)
    theirs = ext.CheckpointReader(step).manifest()
    ext.commit_manifest(step, theirs)  # the same bytes: the same commit
    theirs.created_unix_ms += 1
    with pytest.raises(cairn.Error) as e:
        ext.commit_manifest(step, theirs)
    assert "already exists" in str(e.value)
    _load_equals(root + "/step_1", _state(1, mib=1))


# ---- every object matters -------------------------------------------------------


def test_every_object_corrupted_or_deleted_in_turn_is_detected(s3):
    root, client, bucket, prefix = s3
    _save(root + "/step_1", _state(1, mib=6))
    keys = _keys(client, bucket, prefix + "/step_1/")
    assert len(keys) >= 2, keys
    for key in keys:
        orig = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        bad = bytearray(orig)
        bad[len(bad) // 2] ^= 0x40
        for damaged in (bytes(bad), orig[: len(orig) // 2]):
            client.put_object(Bucket=bucket, Key=key, Body=damaged)
            with pytest.raises(cairn.CorruptionError):
                cairn.verify(root + "/step_1")
        client.delete_object(Bucket=bucket, Key=key)
        with pytest.raises((cairn.CorruptionError, cairn.NotFoundError)):
            cairn.verify(root + "/step_1")
        client.put_object(Bucket=bucket, Key=key, Body=orig)
        cairn.verify(root + "/step_1")


# ---- several ranks --------------------------------------------------------------


def _with_env(rank, world, env, fn, *args):
    os.environ.update(env)  # ranks fork from a server started earlier
    return fn(rank, world, *args)


def test_two_ranks_save_three_ranks_load_through_s3(s3):
    root, *_ = s3
    env = {k: os.environ[k] for k in os.environ if k.startswith(("AWS_", "CAIRN_S3_"))}
    path = root + "/step_7"
    run_ranks(2, _with_env, env, dcp_states.save_worker, "cairn", path)
    run_ranks(3, _with_env, env, dcp_states.load_worker, "cairn", path, 2)
    dcp_states.load_full_single_process("cairn", path, 2)
    cairn.verify(path)


# ---- faults ------------------------------------------------------------------------


@pytest.fixture
def proxy(s3, moto, monkeypatch):
    with FaultProxy(moto.port) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
        monkeypatch.setenv("CAIRN_S3_RETRY_DEADLINE_S", "8")
        monkeypatch.setenv("CAIRN_S3_STALL_TIMEOUT_S", "2")
        yield p


def test_transient_faults_are_survived(s3, proxy):
    root, client, bucket, prefix = s3
    rules = [
        proxy.add("503", method="PUT", path=r"partNumber=", times=2),
        proxy.add("500", method="POST", path=r"uploads", times=1),
        proxy.add("reset", method="PUT", path=r"partNumber=", times=1),
        proxy.add("stall", method="HEAD", times=1),
        proxy.add("503", method="PUT", path=r"cairn\.manifest", times=1),
        proxy.add("reset", method="GET", path=r"list-type", times=1),
    ]
    _save(root + "/step_1", _state(1))
    proxy.add("503", method="GET", path=r"r0", times=2)
    proxy.add("reset", method="GET", times=1)
    _load_equals(root + "/step_1", _state(1))
    for r in rules:
        assert r.hits >= 1, r.fault
    assert _uploads(client, bucket, prefix) == []


def test_persistent_503_fails_the_save_in_time_and_hides_it(s3, proxy):
    root, client, bucket, prefix = s3
    _save(root + "/step_1", _state(1))
    proxy.add("503", method="PUT", path=r"partNumber=", times=-1)
    start = time.monotonic()
    # dcp.save wraps the rank's cairn.UnavailableError (a TransientError and a
    # StorageError: retryable) in a CheckpointException.
    with pytest.raises(BaseException) as e:  # CheckpointException is one
        _save(root + "/step_2", _state(2))
    elapsed = time.monotonic() - start
    msg = str(e.value)
    assert "UnavailableError" in msg and "503 SlowDown" in msg and "gave up after" in msg, msg
    assert elapsed < 30, elapsed  # 8 s retry deadline per request, never a hang
    proxy.clear()
    assert cairn.latest_valid(root) == root + "/step_1"
    cairn.verify(root + "/step_1")
    assert _uploads(client, bucket, prefix) == []  # the failed save aborted them


def test_stalled_server_gives_a_clear_error_within_the_timeout(s3, proxy):
    root, *_ = s3
    _save(root + "/step_1", _state(1, mib=1))
    proxy.add("stall", method="GET", times=-1)
    start = time.monotonic()
    with pytest.raises(cairn.Error) as e:
        cairn.verify(root + "/step_1")
    assert e.value.code == "Unavailable", e.value
    assert "timed out" in str(e.value) or "request failed" in str(e.value)
    assert time.monotonic() - start < 20


def test_dead_server_gives_a_clear_error_quickly(s3, monkeypatch):
    root, *_ = s3
    with FaultProxy(1) as p:  # any port; only its address is used
        dead = p.endpoint
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    monkeypatch.setenv("CAIRN_S3_RETRY_DEADLINE_S", "3")
    start = time.monotonic()
    with pytest.raises(cairn.Error) as e:
        cairn.verify(root + "/step_1")
    assert e.value.code == "Unavailable", e.value
    assert time.monotonic() - start < 10


KILLED_SAVE = textwrap.dedent(
    """
    import sys, torch, torch.distributed.checkpoint as dcp, cairn
    g = torch.Generator().manual_seed(9)
    sd = {"w": torch.randn((24 << 20) // 4, generator=g)}
    dcp.save(sd, storage_writer=cairn.Writer(sys.argv[1]))
    """
)


def test_save_killed_mid_upload_is_never_visible_and_prune_cleans_up(s3, proxy):
    root, client, bucket, prefix = s3
    _save(root + "/step_1", _state(1))
    # The save's 3rd part upload hangs; kill -9 the saver while it does.
    rule = proxy.add("stall", method="PUT", path=r"partNumber=3", times=1)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    p = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, root + "/step_2"], env=env)
    try:
        proxy.wait_for(rule, timeout=120)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert cairn.latest_valid(root) == root + "/step_1"
    cairn.verify(root + "/step_1")
    assert len(_uploads(client, bucket, prefix)) >= 1
    r = _cli("prune", root, "-k", "1", "--stale-uploads", "0")
    assert "step_2" in r.stdout or "nothing to remove" in r.stdout, r.stdout
    assert _uploads(client, bucket, prefix) == []
    _load_equals(root + "/step_1", _state(1))
