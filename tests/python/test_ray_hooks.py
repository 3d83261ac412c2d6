"""The manager hooks cairn.ray is built on (keep=None, save()'s on_durable and its
return value, flush_on_close) and cairn.ray's parts that need no Ray cluster
(storage root mapping, argument checks, settling of checkpoints Ray does not track).
Single process; the Ray runs are in test_ray.py."""

from __future__ import annotations

import errno
import os
import threading

import pyarrow.fs as pafs
import pytest
import torch

import cairn
import cairn.ray
from cairn import _ext


def _state():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return model, {"model": model.state_dict()}


def _steps(root):
    return sorted(n for n in os.listdir(root) if n.startswith("step_"))


def _committed(root):
    return [n for n in _steps(root) if os.path.exists(os.path.join(root, n, "cairn.manifest"))]


def test_keep_none_keeps_every_committed_checkpoint_and_removes_partials(tmp_path):
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "step_0000000002", "data"))  # a crashed save's leftover
    _, state = _state()
    with cairn.CheckpointManager(root, memory=False, keep=None) as mgr:
        for s in (1, 3, 4, 5, 6):
            mgr.save(s, state)
            mgr.wait()
    assert _steps(root) == [f"step_{s:010d}" for s in (1, 3, 4, 5, 6)]
    assert _committed(root) == _steps(root)


def test_on_durable_runs_after_the_durable_commit(tmp_path):
    root = str(tmp_path)
    _, state = _state()
    seen = []
    done = threading.Event()

    def on_durable(err):
        seen.append((err, os.path.exists(os.path.join(root, "step_0000000007", "cairn.manifest")),
                     threading.current_thread() is threading.main_thread()))
        done.set()

    with cairn.CheckpointManager(root, memory=True, keep=None) as mgr:
        assert mgr.save(7, state, on_durable=on_durable) is True
        assert done.wait(60)
        mgr.wait()
    assert seen == [(None, True, False)]  # once, from the background, manifest committed


def test_on_durable_is_not_called_for_a_memory_only_save(tmp_path):
    _, state = _state()
    calls = []
    with cairn.CheckpointManager(str(tmp_path), memory=True, keep=None, durable_every=2) as mgr:
        assert mgr.save(1, state, on_durable=calls.append) is False  # 1st of every 2nd
        mgr.wait()
        assert mgr.save(2, state, on_durable=calls.append) is True
        mgr.wait()
        assert mgr.save(3, state, durable=False, on_durable=calls.append) is False
        mgr.wait()
    assert calls == [None]


def test_on_durable_gets_the_error_that_wait_raises(tmp_path):
    inj = _ext.FaultInjector()
    if True:  # the durable tier seen through the injector
        _, state = _state()
        got = []
        mgr = cairn.CheckpointManager(inj.wrap(_ext.open_storage(str(tmp_path))), memory=False,
                                      keep=None)
        inj.add_rule("write", errno=errno.ENOSPC, count=0)
        mgr.save(1, state, on_durable=got.append)
        with pytest.raises(cairn.Error, match="step 1") as exc:
            mgr.wait()
        assert len(got) == 1 and got[0] is exc.value
        inj.clear()
        mgr.close()


def test_flush_on_close_false_leaves_a_memory_only_save_out_of_the_durable_tier(tmp_path):
    class NoFlush(cairn.CheckpointManager):
        flush_on_close = False

    _, state = _state()
    for cls, expected in ((cairn.CheckpointManager, ["step_0000000001"]), (NoFlush, [])):
        root = str(tmp_path / cls.__name__)
        with cls(root, memory=True, keep=None) as mgr:
            mgr.save(1, state, durable=False)
        assert _committed(root) == expected


# ---- cairn.ray without a cluster --------------------------------------------------------

class _Storage:
    """The two attributes of Ray's StorageContext that cairn.ray reads."""

    def __init__(self, fs, path):
        self.storage_filesystem = fs
        self.experiment_fs_path = path


def test_storage_root_maps_local_and_s3_and_refuses_others(tmp_path):
    assert cairn.ray.storage_root(_Storage(pafs.LocalFileSystem(), str(tmp_path))) == str(tmp_path)
    s3 = pafs.S3FileSystem(anonymous=True, region="us-east-1")
    assert cairn.ray.storage_root(_Storage(s3, "bucket/runs/exp")) == "s3://bucket/runs/exp"
    sub = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    with pytest.raises(ValueError, match="not supported"):
        cairn.ray.storage_root(_Storage(sub, "exp"))


def test_checkpoint_manager_refuses_root_and_keep_and_needs_a_worker():
    with pytest.raises(ValueError, match="num_to_keep"):
        cairn.ray.checkpoint_manager(keep=3)
    with pytest.raises(ValueError, match="storage_path"):
        cairn.ray.checkpoint_manager(root="/x")
    with pytest.raises(cairn.Error, match="inside a Ray Train worker"):
        cairn.ray.checkpoint_manager()


def test_report_needs_a_ray_manager(tmp_path):
    with cairn.CheckpointManager(str(tmp_path), memory=False) as mgr:
        with pytest.raises(ValueError, match="checkpoint_manager"):
            cairn.ray.report(mgr, 1, {}, {})


def test_untracked_checkpoints_are_removed_except_the_restored_one(tmp_path):
    """What restore() does after a restart on rank 0: of the step_<N> directories
    Ray does not track, the restored one is adopted, the others (committed or
    partial) removed; Ray's checkpoints and its own files are left alone."""
    root = str(tmp_path)
    _, state = _state()
    with cairn.CheckpointManager(root, memory=False, keep=None) as plain:
        for s in (2, 4, 6, 7, 8):
            plain.save(s, state)
            plain.wait()
    os.makedirs(os.path.join(root, "step_0000000009", "data"))  # partial
    open(os.path.join(root, "checkpoint_manager_snapshot.json"), "w").close()
    os.makedirs(os.path.join(root, "driver_artifacts"))
    mgr = cairn.ray.RayCheckpointManager(root, _Storage(pafs.LocalFileSystem(), root),
                                         memory=False)
    try:
        mgr.ray_tracked = frozenset({"step_0000000004", "step_0000000006"})
        adopt, removed = cairn.ray._settle_untracked(mgr, 7)
    finally:
        mgr.close()
    assert adopt == "step_0000000007"
    assert removed == ["step_0000000002", "step_0000000008", "step_0000000009"]
    assert _steps(root) == ["step_0000000004", "step_0000000006", "step_0000000007"]
    assert {"checkpoint_manager_snapshot.json", "driver_artifacts", "cairn.run"} <= set(
        os.listdir(root))
    assert mgr.keep is None
    assert mgr.checkpoint_path("step_0000000007") == root + "/step_0000000007"


class _FakeTrain:
    """The parts of ray.train that cairn.ray.report calls, recording each report."""

    class Checkpoint:
        def __init__(self, path, filesystem=None):
            self.path, self.filesystem = path, filesystem

    class CheckpointUploadMode:
        ASYNC, NO_UPLOAD = "ASYNC", "NO_UPLOAD"

    def __init__(self):
        self.reports = []

    def report(self, metrics, checkpoint=None, **kwargs):
        self.reports.append((metrics, checkpoint, kwargs))


def test_report_uploads_asynchronously_and_the_upload_waits_for_the_commit(tmp_path,
                                                                          monkeypatch):
    fake = _FakeTrain()
    monkeypatch.setattr(cairn.ray, "_ray_train", lambda: fake)
    inj = _ext.FaultInjector()
    root = str(tmp_path)
    _, state = _state()
    mgr = cairn.ray.RayCheckpointManager(inj.wrap(_ext.open_storage(root)),
                                         _Storage(pafs.LocalFileSystem(), root),
                                         memory=True, durable_every=2)
    try:
        cairn.ray.report(mgr, 1, state, {"loss": 1.0})  # 1st of every 2nd: memory only
        assert fake.reports[-1] == ({"loss": 1.0}, None, {})
        cairn.ray.report(mgr, 2, state, {"loss": 0.5})
        metrics, ckpt, kw = fake.reports[-1]
        assert ckpt.path == root + "/step_0000000002"
        assert kw["checkpoint_dir_name"] == "step_0000000002"
        assert kw["checkpoint_upload_mode"] == "ASYNC"
        assert kw["delete_local_checkpoint_after_upload"] is False
        # Ray's upload thread: returns the checkpoint once it is committed.
        assert kw["checkpoint_upload_fn"](ckpt, "step_0000000002") is ckpt
        assert os.path.exists(os.path.join(root, "step_0000000002", "cairn.manifest"))
        mgr.wait()

        inj.add_rule("write", errno=errno.ENOSPC, count=0)
        cairn.ray.report(mgr, 3, state, {}, durable=True)
        upload = fake.reports[-1][2]["checkpoint_upload_fn"]
        with pytest.raises(cairn.Error, match="step 3"):
            upload(fake.reports[-1][1], "step_0000000003")  # Ray fails the worker group
        with pytest.raises(cairn.Error, match="step 3"):
            cairn.ray.report(mgr, 4, state, {})  # and the next report raises it too
        inj.clear()
    finally:
        mgr.close()
    assert _committed(root) == ["step_0000000002"]
