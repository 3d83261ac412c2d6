"""cairn.data.DataLoader over CachedFileDataset with real processes: ranks
(gloo, spawned), DataLoader workers (forked, persistent), kill -9 and resume."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch.multiprocessing as mp

import cairn.data as cd
from cairn.data import _partition

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_source(root, n, size=2000):
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        sub = os.path.join(root, f"d{i % 3}")
        os.makedirs(sub, exist_ok=True)
        with open(os.path.join(sub, f"f{i:03d}.bin"), "wb") as f:
            f.write(rng.bytes(size + i))
    return root


def identity(batch):
    return batch


def rel(path):
    return "/".join(path.split("/")[-2:])


def _rank_main(rank, ws, tmp, src, nw_by_rank, epochs):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=ws)
    out = {"epochs": [], "error": None}
    try:
        ds = cd.CachedFileDataset(src, cache_dir=f"{tmp}/cache", shuffle=True, seed=5)
        dl = cd.DataLoader(ds, batch_size=2, num_workers=nw_by_rank[rank], collate_fn=identity,
                           multiprocessing_context="fork")
        for e in range(epochs):
            dl.set_epoch(e)
            out["epochs"].append([rel(p) for b in dl for p in b])
    except ValueError as exc:
        out["error"] = str(exc)
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def test_three_ranks_three_workers_see_every_sample_once_per_epoch(tmp_path):
    tmp = str(tmp_path)
    n = 27
    src = "slow://" + make_source(f"{tmp}/src", n) + "?latency=0.002"
    mp.spawn(_rank_main, args=(3, tmp, src, [3, 3, 3], 2), nprocs=3, join=True)
    res = [json.load(open(f"{tmp}/rank{r}.json")) for r in range(3)]
    keys = cd.CachedFileDataset(src, cache_dir=f"{tmp}/cache").keys
    for e in range(2):
        order = _partition.epoch_order(n, 5, e, True)
        seen = []
        for r in range(3):
            got = res[r]["epochs"][e]
            assert len(got) == n // 3
            # Rank r consumes the global order with stride 3, in order.
            assert got == [keys[i] for i in order[r::3]]
            seen += got
        assert sorted(seen) == sorted(keys)
    assert res[0]["epochs"][0] != res[0]["epochs"][1]  # set_epoch reached the workers
    # Nine worker processes shared one cache: every file fetched exactly once.
    stats = cd.CachedFileDataset(src, cache_dir=f"{tmp}/cache").cache_stats()
    assert stats["shared_fetched_files"] == n
    assert stats["shared_fetched_bytes"] == sum(2000 + i for i in range(n))


def test_mismatched_num_workers_is_rejected(tmp_path):
    tmp = str(tmp_path)
    src = make_source(f"{tmp}/src", 8)
    mp.spawn(_rank_main, args=(2, tmp, src, [1, 2], 1), nprocs=2, join=True)
    for r in range(2):
        res = json.load(open(f"{tmp}/rank{r}.json"))
        assert res["error"] is not None and "num_workers" in res["error"], res
        assert "rank 0: num_workers=1" in res["error"] and "rank 1: num_workers=2" in res["error"]


TRAIN = textwrap.dedent(
    """
    import json, os, sys, time
    import cairn.data as cd

    def ident(b):
        return b

    def main():
        src, cache, log, epochs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
        ds = cd.CachedFileDataset(src, cache_dir=cache, shuffle=True, seed=11)
        # Default start method (forkserver): the script guards its main, as it must.
        dl = cd.DataLoader(ds, batch_size=2, num_workers=2, collate_fn=ident)
        state = None
        if os.path.exists(log):
            for line in open(log):
                try:
                    state = json.loads(line)["state"]
                except ValueError:
                    pass  # a line cut by the kill
        if state is not None:
            dl.load_state_dict(state)
        with open(log, "a") as f:
            for epoch in range(dl.epoch, epochs):
                dl.set_epoch(epoch)
                for batch in dl:
                    names = ["/".join(p.split("/")[-2:]) for p in batch]
                    f.write(json.dumps({"batch": names, "state": dl.state_dict()}) + "\\n")
                    f.flush()
                    os.fsync(f.fileno())
                    time.sleep(0.03)  # the training step

    if __name__ == "__main__":
        main()
    """
)


def _batches(log):
    out = []
    for line in open(log):
        try:
            out.append(json.loads(line)["batch"])
        except ValueError:
            pass
    return out


def _kill_trainer(proc):
    """SIGKILLs the trainer alone (its workers, forkserver and resource tracker exit
    by themselves, and the tracker unlinks the named semaphores of the dead run),
    then waits for its process group to be empty."""
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("the trainer's workers outlived it by 10 s")


def _kill_resume_setup(tmp_path):
    """Writes the TRAIN script and a slow 22-file source, runs it once
    uninterrupted; returns (tmp, src, script, env, the reference batches)."""
    tmp = str(tmp_path)
    src = "slow://" + make_source(f"{tmp}/src", 22) + "?latency=0.005"
    script = f"{tmp}/train.py"
    with open(script, "w") as f:
        f.write(TRAIN)
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    subprocess.run([sys.executable, script, src, f"{tmp}/cache_ref", f"{tmp}/ref.jsonl", "2"],
                   env=env, check=True, timeout=120)
    return tmp, src, script, env, _batches(f"{tmp}/ref.jsonl")


def test_kill_9_mid_epoch_and_resume_gives_the_same_sequence(tmp_path):
    tmp, src, script, env, reference = _kill_resume_setup(tmp_path)
    assert len(reference) == 22  # 11 batches per epoch, 2 epochs

    log = f"{tmp}/run.jsonl"
    proc = subprocess.Popen([sys.executable, script, src, f"{tmp}/cache", log, "2"], env=env,
                            start_new_session=True)
    deadline = time.time() + 90
    while time.time() < deadline and (not os.path.exists(log) or len(_batches(log)) < 5):
        time.sleep(0.01)
    _kill_trainer(proc)
    killed_at = len(_batches(log))
    assert 5 <= killed_at < 22
    subprocess.run([sys.executable, script, src, f"{tmp}/cache", log, "2"], env=env,
                   check=True, timeout=120)
    assert _batches(log) == reference


def test_resume_with_another_world_size_continues_the_global_order(tmp_path, monkeypatch):
    tmp = str(tmp_path)
    n, bs = 40, 2
    src = make_source(f"{tmp}/src", n)
    keys = cd.CachedFileDataset(src, cache_dir=f"{tmp}/cache").keys
    order = _partition.epoch_order(n, 3, 0, True)

    def loader(nw):
        ds = cd.CachedFileDataset(src, cache_dir=f"{tmp}/cache", shuffle=True, seed=3)
        return cd.DataLoader(ds, batch_size=bs, num_workers=nw, collate_fn=identity)

    # Phase 1: 2 ranks x 2 workers take 3 steps. (Each rank's loader runs in
    # turn; the rank is read from the environment at iteration time.)
    monkeypatch.setenv("WORLD_SIZE", "2")
    first, state = [], None
    for r in range(2):
        monkeypatch.setenv("RANK", str(r))
        dl = loader(2)
        it = iter(dl)
        first.append([rel(p) for _ in range(3) for p in next(it)])
        state = dl.state_dict()
        del it, dl
    assert state["consumed"] == 3 * bs * 2
    for r in range(2):
        assert first[r] == [keys[i] for i in order[r::2][: 3 * bs]]
    # Phase 2: 3 ranks x 1 worker finish the epoch from the saved state.
    monkeypatch.setenv("WORLD_SIZE", "3")
    rest = []
    for r in range(3):
        monkeypatch.setenv("RANK", str(r))
        dl = loader(1)
        dl.load_state_dict(state)
        got = [rel(p) for b in dl for p in b]
        start = state["consumed"]
        expect_pos = _partition.rank_positions(n, start, 3, r, False)
        assert got == [keys[order[p % n]] for p in expect_pos]
        rest += got
    consumed = first[0] + first[1]
    assert sorted(set(consumed + rest)) == sorted(keys)
    assert len(consumed + rest) - n < 3  # only the wrap-around padding repeats


def test_state_counts_only_batches_handed_out(tmp_path):
    src = make_source(f"{tmp_path}/src", 30)
    ds = cd.CachedFileDataset(src, cache_dir=f"{tmp_path}/cache")
    dl = cd.DataLoader(ds, batch_size=3, num_workers=2, prefetch_factor=4, collate_fn=identity)
    assert len(ds) == 30 and len(dl) == 10
    it = iter(dl)
    next(it)
    next(it)
    time.sleep(0.3)  # workers prefetch further meanwhile
    assert dl.state_dict()["consumed"] == 6
    assert dl.state_dict()["epoch"] == 0
    rest = [rel(p) for b in it for p in b]
    assert len(rest) == 24
    assert dl.state_dict() == {"version": 1, "items": 30, "epoch": 1, "consumed": 0, "batches": 0}


def test_file_larger_than_cache_limit_is_a_clear_error(tmp_path):
    src = make_source(f"{tmp_path}/src", 3, size=5000)
    with pytest.raises(ValueError, match="smaller than file"):
        cd.CachedFileDataset(src, cache_dir=f"{tmp_path}/cache", cache_limit=4000)


def test_loader_rejects_other_datasets():
    with pytest.raises(TypeError):
        cd.DataLoader([1, 2, 3])


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("CAIRN_SLOW"), reason="long: set CAIRN_SLOW=1")
def test_repeated_random_kills_always_resume_exactly(tmp_path):
    import random

    tmp, src, script, env, reference = _kill_resume_setup(tmp_path)
    rnd = random.Random(1234)
    for trial in range(8):
        log = f"{tmp}/run{trial}.jsonl"
        for _ in range(rnd.randint(1, 3)):  # several kills in one run
            target = len(_batches(log)) + rnd.randint(1, 6) if os.path.exists(log) else rnd.randint(1, 8)
            proc = subprocess.Popen([sys.executable, script, src, f"{tmp}/cache", log, "2"],
                                    env=env, start_new_session=True)
            while proc.poll() is None and (not os.path.exists(log) or len(_batches(log)) < target):
                time.sleep(0.002)
            if proc.poll() is None:
                time.sleep(rnd.random() * 0.03)  # anywhere inside a step
                _kill_trainer(proc)
            proc.wait()
        subprocess.run([sys.executable, script, src, f"{tmp}/cache", log, "2"], env=env,
                       check=True, timeout=120)
        assert _batches(log) == reference, f"trial {trial}"


def test_batches_per_epoch_caps_every_epoch_and_resumes(tmp_path):
    src = make_source(f"{tmp_path}/src", 30)

    def loader():
        ds = cd.CachedFileDataset(src, cache_dir=f"{tmp_path}/cache", shuffle=True)
        return cd.DataLoader(ds, batch_size=4, num_workers=2, batches_per_epoch=3,
                             collate_fn=identity)

    dl = loader()
    full = []
    for e in range(2):
        dl.set_epoch(e)
        full.append([rel(p) for b in dl for p in b])
    assert [len(x) for x in full] == [12, 12]
    assert len(dl) == 3
    dl = loader()
    dl.set_epoch(0)
    it = iter(dl)
    got = [rel(p) for p in next(it)]
    state = dl.state_dict()
    assert state["batches"] == 1
    dl = loader()
    dl.load_state_dict(state)
    for e in range(dl.epoch, 2):
        dl.set_epoch(e)
        got += [rel(p) for b in dl for p in b]
    assert got == full[0] + full[1]


def test_loader_is_a_dcp_stateful(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = make_source(f"{tmp_path}/src", 20)

    def loader():
        ds = cd.CachedFileDataset(src, cache_dir=f"{tmp_path}/cache", shuffle=True, seed=9)
        return cd.DataLoader(ds, batch_size=3, num_workers=1, collate_fn=identity)

    dl = loader()
    it = iter(dl)
    next(it)
    next(it)
    expected = [rel(p) for b in it for p in b]
    dl = loader()
    it = iter(dl)
    next(it)
    next(it)
    dcp.save({"data": dl}, checkpoint_id=str(tmp_path / "ckpt"))
    fresh = loader()
    dcp.load({"data": fresh}, checkpoint_id=str(tmp_path / "ckpt"))
    assert fresh.state_dict() == dl.state_dict()
    assert [rel(p) for b in fresh for p in b] == expected


def test_spawned_persistent_workers_follow_set_epoch_and_position(tmp_path):
    # Workers started with "spawn" get the dataset (and its shared control
    # block) pickled once; epochs and positions must still reach them.
    n = 12
    src = make_source(f"{tmp_path}/src", n)
    ds = cd.CachedFileDataset(src, cache_dir=f"{tmp_path}/cache", shuffle=True, seed=4)
    dl = cd.DataLoader(ds, batch_size=2, num_workers=2, collate_fn=identity,
                       multiprocessing_context="spawn")
    keys = ds.keys
    for e in range(2):
        dl.set_epoch(e)
        got = [rel(p) for b in dl for p in b]
        assert got == [keys[i] for i in _partition.epoch_order(n, 4, e, True)]
    dl.load_state_dict({"version": 1, "items": n, "epoch": 0, "consumed": 6})
    got = [rel(p) for b in dl for p in b]
    assert got == [keys[i] for i in _partition.epoch_order(n, 4, 0, True)[6:]]
