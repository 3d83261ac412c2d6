"""The CheckpointManager with an s3:// durable tier and CachedFileDataset over an s3://
prefix, against a real local S3 server (moto, SigV4 checked), with gloo ranks and
DataLoader workers."""

from __future__ import annotations

import os

import pytest
import torch

import cairn
import cairn.data as cd
from cairn import _ext
from gloo_harness import run_ranks
from toy_training import flat, make_state, train_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def s3(moto, monkeypatch):
    """Points cairn at moto; returns (root URI, boto3 client, bucket, prefix, env)."""
    root, prefix, env = moto.use(monkeypatch)
    return root, moto.boto3_client(), moto.bucket, prefix, env


# ---- the manager -------------------------------------------------------------------


def _save_steps(rank, world, env, root, local, steps, expected_dir):
    os.environ.update(env)
    model, opt, state = make_state()
    mgr = cairn.CheckpointManager(root, local=local, keep=2, keep_local=1)
    for step in steps:
        train_step(model, opt, step)
        mgr.save(step, state)
        mgr.wait()
        torch.save(flat(model), os.path.join(expected_dir, f"step{step}.rank{rank}.pt"))
    mgr.close()  # the memory tier ends with the manager


def _restore(rank, world, env, root, local, expected_dir):
    os.environ.update(env)
    model, opt, state = make_state(seed=77)
    mgr = cairn.CheckpointManager(root, local=local)
    step = mgr.restore(state)
    tier = mgr.restored[1] if step is not None else None
    ok = step is not None and torch.equal(
        flat(model), torch.load(os.path.join(expected_dir, f"step{step}.rank{rank}.pt")))
    mgr.close()
    return step, tier, ok


def _committed_steps(uri):
    return sorted(e["step"] for e in cairn.list_checkpoints(uri) if e["committed"])


def test_manager_saves_to_s3_with_per_tier_retention_and_restores_from_it(s3, tmp_path):
    root, client, bucket, prefix, env = s3
    local = str(tmp_path / "local")
    run_ranks(2, _save_steps, env, root, local, [1, 2, 3], str(tmp_path))
    assert _committed_steps(root) == [2, 3]  # keep=2 on s3
    assert _committed_steps(local) == [3]  # keep_local=1
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
    assert not any("step_0000000001" in k for k in keys), keys  # pruned objects are gone
    assert client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []
    cairn.verify(cairn.latest_valid(root))
    # The memory tier is gone (close() wiped it) and no local tier is given:
    # the durable s3 tier serves the restore, bit-exact.
    assert run_ranks(2, _restore, env, root, None, str(tmp_path)) == [(3, "durable", True)] * 2


def test_manager_restore_falls_back_when_the_newest_s3_checkpoint_is_corrupt(s3, tmp_path):
    root, client, bucket, prefix, env = s3
    run_ranks(2, _save_steps, env, root, None, [1, 2], str(tmp_path))
    newest = cairn.latest_valid(root)
    assert newest.endswith("step_0000000002")
    # Flip a byte inside the first tensor stored in rank 1's data file.
    manifest = _ext.CheckpointReader(_ext.open_storage(newest, create=False)).manifest()
    file_index = [f.key for f in manifest.files].index("data/r1.bin")
    loc = next(c.location for t in manifest.tensors for c in t.chunks
               if c.location.file == file_index and c.location.length > 0)
    key = f"{prefix}/step_0000000002/data/r1.bin"
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[loc.offset + loc.length // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with pytest.raises(cairn.CorruptionError):
        cairn.verify(newest)
    assert run_ranks(2, _restore, env, root, None, str(tmp_path)) == [(1, "durable", True)] * 2


def test_manager_refuses_an_s3_local_tier(s3):
    root, *_ = s3
    with pytest.raises(ValueError):
        cairn.CheckpointManager(str(root) + "-durable", local=root)


# ---- the dataset -------------------------------------------------------------------


def identity(batch):
    return batch


def test_cached_dataset_over_an_s3_prefix_yields_every_object_once_per_epoch(s3, tmp_path):
    root, client, bucket, prefix, _ = s3
    objects = {}
    for i in range(23):
        key = f"{prefix}/data/{'sub/' if i % 3 == 0 else ''}sample_{i:03d}.bin"
        body = os.urandom(1000 + 97 * i)
        client.put_object(Bucket=bucket, Key=key, Body=body)
        objects[key.rsplit("/", 1)[1]] = body
    ds = cd.CachedFileDataset(root + "/data", cache_dir=str(tmp_path / "cache"), shuffle=True,
                              seed=3)
    assert len(ds.keys) == 23
    dl = cd.DataLoader(ds, batch_size=2, num_workers=3, collate_fn=identity,
                       multiprocessing_context="fork")
    for epoch in range(2):
        dl.set_epoch(epoch)
        seen = []
        for batch in dl:
            for path in batch:
                name = os.path.basename(path)  # the key's last component
                with open(path, "rb") as f:
                    assert f.read() == objects[name], name
                seen.append(name)
        assert sorted(seen) == sorted(objects), epoch  # every object exactly once
    # The node cache fetched each object from s3 once, across workers and epochs.
    stats = cd.CachedFileDataset(root + "/data", cache_dir=str(tmp_path / "cache")).cache_stats()
    assert stats["shared_fetched_files"] == 23
    assert stats["shared_fetched_bytes"] == sum(len(b) for b in objects.values())
