"""A user's mistake gets an error that says what is wrong (issue 21, point 8)."""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cairn
from cairn.dcp import unwrap

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_reader_of_a_regular_file_says_it_is_a_file(tmp_path):
    f = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, f)
    with pytest.raises(cairn.NotFoundError) as e:
        dcp.load({"w": torch.zeros(2)}, storage_reader=cairn.Reader(str(f)))
    msg = str(unwrap(e.value))
    assert "is a file, not a directory" in msg and "no such checkpoint" not in msg, msg
    with pytest.raises(cairn.NotFoundError, match="no such checkpoint"):  # still, when missing
        cairn.Reader(str(tmp_path / "absent")).read_metadata()


def test_dcp_save_to_a_missing_bucket_says_no_such_bucket(moto, monkeypatch):
    moto.use(monkeypatch)
    uri = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run/step_1"
    with pytest.raises(BaseException) as e:
        dcp.save({"w": torch.ones(4)}, storage_writer=cairn.Writer(uri))
    err = unwrap(e.value)
    assert isinstance(err, cairn.Error) and "NoSuchBucket" in str(err), repr(err)
    with pytest.raises(cairn.Error, match="NoSuchBucket"):  # as the manager says
        cairn.CheckpointManager(uri.rsplit("/", 1)[0], memory=False)


@pytest.mark.parametrize("limit", [1 << 20, 2 << 20, 1e-12])
def test_memory_limit_below_one_growth_step_is_refused_at_construction(tmp_path, limit):
    with pytest.raises(cairn.InvalidArgumentError, match="memory_limit .* below one step"):
        cairn.CheckpointManager(tmp_path / "ckpt", memory_limit=limit)
    assert not (tmp_path / "ckpt").exists()  # refused before anything was created


def test_memory_limit_of_one_growth_step_saves(tmp_path):
    mgr = cairn.CheckpointManager(tmp_path / "ckpt", memory_limit=(2 << 20) + (256 << 10))
    try:
        mgr.save(1, {"w": torch.ones(1024)})
        mgr.wait()
    finally:
        mgr.close()


def test_errors_about_an_unusable_root_or_local_name_the_argument(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("not a directory")
    with pytest.raises(cairn.Error, match=r"^root=.*a-file/ck \(the durable tier\)"):
        cairn.CheckpointManager(f / "ck")
    with pytest.raises(cairn.Error, match=r"^local=.*a-file/l \(the local tier\)"):
        cairn.CheckpointManager(tmp_path / "ok", local=f / "l")
    with pytest.raises(cairn.Error, match=r"^root=/proc/cairn-[0-9a-f]+ \(the durable tier\)"):
        cairn.CheckpointManager(f"/proc/cairn-{uuid.uuid4().hex[:8]}")  # mkdir refused
