"""ShardDataset through cairn.data.DataLoader: partitioning over ranks and
workers, exact mid-epoch resume, resume on another number of slots."""

import json

import pytest
import torch.multiprocessing as mp

import cairn.data as cd

SHARD_LEN = [5, 9, 3, 7, 6, 8, 4, 10, 2]
ALL = sorted(s * 1000 + i for s, k in enumerate(SHARD_LEN) for i in range(k))


def read_shard(s):
    return [s * 1000 + i for i in range(SHARD_LEN[s])]


def make_loader(nw):
    ds = cd.ShardDataset(list(range(len(SHARD_LEN))), read_shard, shuffle=True, seed=2,
                         shuffle_buffer=4)
    return cd.DataLoader(ds, batch_size=2, num_workers=nw, multiprocessing_context="fork")


def _rank(rank, ws, tmp, phase, nw, steps):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg-{phase}", rank=rank,
                            world_size=ws)
    dl = make_loader(nw)
    if phase != "ref" and phase != "first":
        with open(f"{tmp}/state.json") as f:
            dl.load_state_dict(json.load(f))
    dl.set_epoch(0)
    got = []
    for k, batch in enumerate(dl):
        got += batch.tolist()
        if steps is not None and k + 1 == steps:
            break
    state = dl.state_dict()  # a collective: every rank calls it
    if rank == 0 and phase == "first":
        with open(f"{tmp}/state.json", "w") as f:
            json.dump(state, f)
    with open(f"{tmp}/{phase}-{rank}.json", "w") as f:
        json.dump(got, f)
    dist.destroy_process_group()


def _run(tmp, phase, ws, nw, steps=None):
    mp.spawn(_rank, args=(ws, tmp, phase, nw, steps), nprocs=ws, join=True)
    return [json.load(open(f"{tmp}/{phase}-{r}.json")) for r in range(ws)]


def test_shards_exactly_once_and_exact_resume(tmp_path):
    tmp = str(tmp_path)
    ref = _run(tmp, "ref", 2, 2)
    assert sorted(ref[0] + ref[1]) == ALL
    first = _run(tmp, "first", 2, 2, steps=3)
    rest = _run(tmp, "resume", 2, 2)
    for r in range(2):
        assert first[r] + rest[r] == ref[r]


def test_resume_on_fewer_slots_loses_and_repeats_nothing(tmp_path):
    tmp = str(tmp_path)
    first = _run(tmp, "first", 2, 2, steps=2)
    rest = _run(tmp, "other", 1, 1)
    assert sorted(first[0] + first[1] + rest[0]) == ALL


def test_collapse_work_keeps_progress():
    from cairn.data.shards import collapse_work

    work = [[0, 0], [1, 0], [2, 0], [3, 0], [4, 0]]
    # 2 slots: slot 0 has [0, 2, 4], slot 1 has [1, 3].
    new = collapse_work(work, [[1, 2], [2, 0]], 3)
    assert new == [[2, 2], [4, 0]]


def test_empty_shards_rejected():
    with pytest.raises(ValueError):
        cd.ShardDataset([], read_shard)
