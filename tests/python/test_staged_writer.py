"""cairn.Writer(path, staging_dir=...): each rank's data goes to a fast local
directory first and is uploaded to a slow target (a throttled directory, or
s3://), and the checkpoint is published only once every rank's upload is
complete."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cairn
from cairn import _ext
from gloo_harness import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "s3"))
from moto_server import MotoServer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed=0, mib=8):
    g = torch.Generator().manual_seed(seed)
    n = (mib << 20) // 4
    return {"a": torch.randn(n // 2, generator=g), "b": torch.randn(n // 2 - 5, generator=g),
            "step": torch.tensor(seed)}


def _load_equals(uri, ref):
    sd = {k: torch.zeros_like(v) for k, v in ref.items()}
    dcp.load(sd, storage_reader=cairn.Reader(uri))
    return all(torch.equal(sd[k], v) for k, v in ref.items())


def _files(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()] if d.exists() else []


def test_async_save_to_a_throttled_directory_publishes_after_the_upload(tmp_path):
    target, staging = tmp_path / "slow", tmp_path / "staging"
    target.mkdir()
    sd = _state(1)  # 8 MiB through a 10 MB/s pipe: the upload takes >= 0.8 s
    inj = _ext.FaultInjector()
    if True:  # the target seen through a 10 MB/s pipe
        inj.set_bandwidth(10_000_000)
        slow = inj.wrap(_ext.open_storage(str(target / "step_1")))
        fut = dcp.async_save(sd, storage_writer=cairn.Writer(slow, staging_dir=staging))
        # async_save returned after staging the state in memory; the upload is
        # background work, so nothing is published yet.
        assert cairn.latest_valid(str(target)) is None
        fut.result()
        assert inj.calls("write") > 0  # the data went through the throttled target
    assert cairn.latest_valid(str(target)) == str(target / "step_1")
    cairn.verify(str(target / "step_1"))
    assert _load_equals(str(target / "step_1"), sd)
    assert _files(staging) == []  # staged copies removed after the upload


def test_staging_dir_is_keyword_only_and_local():
    with pytest.raises(TypeError):
        cairn.Writer("/x", True, True, None, 10, False, True, None, cairn.dcp.SerializationFormat
                     .TORCH_SAVE, "/staging")
    with pytest.raises(ValueError):
        cairn.Writer("/x", staging_dir="s3://bucket/staging")


def _staged_save_with_failing_rank1_upload(rank, world, base, staging):
    inj = _ext.FaultInjector()
    if rank == 1:
        inj.add_rule("write", errno=errno.EIO, count=0, key="r1.bin")
    err = None
    target = inj.wrap(_ext.open_storage(base + "/step_1"))
    try:
        dcp.save(_state(rank, mib=2), storage_writer=cairn.Writer(target, staging_dir=staging))
    except BaseException as e:  # noqa: BLE001 - a CheckpointException
        err = type(cairn.dcp.unwrap(e)).__name__
    return err


def test_a_failed_upload_of_one_rank_publishes_nothing_and_cleans_the_staging(tmp_path):
    base, staging = tmp_path / "target", tmp_path / "staging"
    base.mkdir()
    errs = run_ranks(2, _staged_save_with_failing_rank1_upload, str(base), str(staging))
    assert errs[1] is not None and all(e is not None for e in errs), errs
    assert not (base / "step_1" / "cairn.manifest").exists()
    assert cairn.latest_valid(str(base)) is None
    assert _files(staging) == []


def _staged_s3_save(rank, world, env, uri, staging):
    os.environ.update(env)
    dcp.save(_rank_state(rank), storage_writer=cairn.Writer(uri, staging_dir=staging))


def _rank_state(rank):
    # Keys of each rank's own, so each rank's data file holds its own items.
    return {f"r{rank}.{k}": v for k, v in _state(rank, mib=6).items()}


def test_two_ranks_stage_locally_and_upload_to_s3(tmp_path, monkeypatch):
    with MotoServer() as srv:
        for k, v in srv.env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("CAIRN_S3_PART_SIZE", str(5 << 20))
        env = {k: os.environ[k] for k in os.environ if k.startswith(("AWS_", "CAIRN_S3_"))}
        uri = f"s3://{srv.bucket}/staged/step_1"
        staging = tmp_path / "staging"
        run_ranks(2, _staged_s3_save, env, uri, str(staging))
        cairn.verify(uri)
        assert _load_equals(uri, {**_rank_state(0), **_rank_state(1)})
        client = srv.boto3_client()
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=srv.bucket,
                                                          Prefix="staged/")["Contents"]]
        assert "staged/step_1/cairn.manifest" in keys
        assert client.list_multipart_uploads(Bucket=srv.bucket).get("Uploads", []) == []
        assert _files(staging) == []
