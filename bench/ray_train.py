#!/usr/bin/env python3
"""Checkpoint overhead per step under Ray Train: cairn.ray vs the seed's pattern.

Run from the repository root::

    .venv/bin/python bench/ray_train.py                  # 2 workers, 256 MB state each
    .venv/bin/python bench/ray_train.py --size-mb 64 --reps 3   # smoke run

One local Ray cluster, one ``TorchTrainer`` with ``--workers`` CPU workers over gloo,
each holding the same GPT-like model + Adam state (``bench/checkpoint.py``'s
``build_state``, ``--size-mb``), ``CheckpointConfig(num_to_keep=2)``. In the same
run, on the same state and disk, every repetition checkpoints once with each peer:

* ``seed``: the seed document's Ray Train pattern: ``dcp.async_save(state,
  storage_writer=FileSystemWriter(<experiment dir>/dcp_<i>))`` then
  ``ray.train.report(metrics, Checkpoint(that dir), checkpoint_upload_mode=ASYNC,
  checkpoint_upload_fn=<waits for the async_save future>,
  delete_local_checkpoint_after_upload=False)``;
* ``cairn``: ``cairn.ray.report(mgr, step, state, metrics)`` with
  ``mgr = cairn.ray.checkpoint_manager(memory=True)``.

Per checkpoint, on every rank (the figure is the slowest rank's, median over reps):

* blocking: from the call until it returns to training (save + Ray's report barrier),
  and its save part alone (``dcp.async_save`` returning / ``mgr.save``'s stall);
* durable: until the checkpoint is committed on disk (the future / ``mgr.wait()``);
* registered: until Ray's controller has registered it
  (``ray.train.get_all_reported_checkpoints(consistency_mode=COMMITTED)`` returns,
  called right after the report, so checkpoints are not pipelined).

Ray's controller polls its workers every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``
(2 s by default), which puts a floor under "registered" for both peers; the run
sets it to ``--poll-s`` (default 0.1) so the figure shows the checkpoint path.
Prints a table and writes JSON (default bench/results/ray_train.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "bench"))


def train_func(config: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    import ray.train
    from ray.train import Checkpoint, CheckpointConsistencyMode, CheckpointUploadMode

    import cairn.ray
    from checkpoint import build_state

    torch.set_num_threads(1)
    state = build_state(config["size_mb"] / 1024)
    storage = ray.train.get_context().get_storage()
    exp = storage.experiment_fs_path
    mgr = cairn.ray.checkpoint_manager(memory=True, timeout=300)
    mgr.restore(state)  # nothing to restore; settles what Ray does not track
    rows = []

    def registered() -> None:
        ray.train.get_all_reported_checkpoints(
            consistency_mode=CheckpointConsistencyMode.COMMITTED)

    def seed(i: int) -> dict:
        t0 = time.perf_counter()
        name = f"dcp_{i:04d}"
        fut = dcp.async_save(state, storage_writer=FileSystemWriter(f"{exp}/{name}"))
        t_stage = time.perf_counter() - t0

        def wait_for_upload(checkpoint, _name):
            fut.result()
            return checkpoint

        ray.train.report({"i": i}, checkpoint=Checkpoint(f"{exp}/{name}",
                                                         filesystem=storage.storage_filesystem),
                         checkpoint_dir_name=name,
                         checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
                         checkpoint_upload_fn=wait_for_upload,
                         delete_local_checkpoint_after_upload=False)
        t_block = time.perf_counter() - t0
        fut.result()
        t_durable = time.perf_counter() - t0
        registered()
        return {"blocking": t_block, "stage": t_stage, "durable": t_durable,
                "registered": time.perf_counter() - t0}

    def cairn_peer(i: int) -> dict:
        t0 = time.perf_counter()
        cairn.ray.report(mgr, i, state, {"i": i})
        t_block = time.perf_counter() - t0
        mgr.wait()
        t_durable = time.perf_counter() - t0
        t_stage = mgr.stats()["last"]["stall_s"]  # mgr.save's part of the blocking time
        registered()
        return {"blocking": t_block, "stage": t_stage, "durable": t_durable,
                "registered": time.perf_counter() - t0}

    peers = {"seed": seed, "cairn": cairn_peer}
    step = 0
    for rep in range(config["reps"] + 1):  # the first round warms up (reported apart)
        for name, fn in peers.items():
            step += 1
            dist.barrier()
            rows.append({"peer": name, "rep": rep, **fn(step)})
    mgr.close()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        with open(config["out"], "w") as f:
            json.dump(gathered, f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=256, help="state per worker (MB)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--poll-s", type=float, default=0.1,
                    help="RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (Ray's default: 2)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "ray_train.json"))
    a = ap.parse_args()

    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(a.poll_s)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "python"), str(REPO / "bench"), os.environ.get("PYTHONPATH", "")])
    import ray
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    work = tempfile.mkdtemp(prefix="cairn-raybench-", dir=a.dir)
    out = os.path.join(work, "rows.json")
    ray.init(num_cpus=max(2, a.workers), include_dashboard=False,
             _temp_dir=os.path.join(work, "ray"))
    try:
        trainer = TorchTrainer(
            train_func,
            train_loop_config={"size_mb": a.size_mb, "reps": a.reps, "out": out},
            torch_config=TorchConfig(backend="gloo", timeout_s=600),
            scaling_config=ScalingConfig(num_workers=a.workers,
                                         resources_per_worker={"CPU": 0.5}),
            run_config=RunConfig(name="bench", storage_path=os.path.join(work, "results"),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)))
        result = trainer.fit()
        if result.error:
            print(f"bench: the run failed: {result.error}")
            return 1
        per_rank = json.load(open(out))
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    # The slowest rank's figure per (peer, rep), then the median over reps >= 1.
    summary = {}
    for peer in ("seed", "cairn"):
        figs = {}
        for key in ("blocking", "stage", "durable", "registered"):
            by_rep = {}
            for rows in per_rank:
                for r in rows:
                    if r["peer"] == peer:
                        by_rep[r["rep"]] = max(by_rep.get(r["rep"], 0.0), r[key])
            figs[key] = statistics.median(v for k, v in by_rep.items() if k >= 1)
            figs[f"first_{key}"] = by_rep[0]
        summary[peer] = figs
    print(f"Ray Train checkpoint overhead: {a.workers} workers, {a.size_mb:.0f} MB state "
          f"each, median of {a.reps} (slowest rank), controller poll {a.poll_s}s")
    print(f"{'peer':8s} {'blocking ms':>12s} {'(save) ms':>10s} {'durable ms':>11s} "
          f"{'registered ms':>14s} {'1st blocking ms':>16s}")
    for peer, f in summary.items():
        print(f"{peer:8s} {1e3 * f['blocking']:12.1f} {1e3 * f['stage']:10.1f} "
              f"{1e3 * f['durable']:11.1f} {1e3 * f['registered']:14.1f} "
              f"{1e3 * f['first_blocking']:16.1f}")
    s, c = summary["seed"], summary["cairn"]
    ratios = {k: c[k] / s[k] for k in ("blocking", "durable", "registered")}
    print("cairn / seed: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"args": vars(a), "summary": summary, "ratios": ratios,
                   "per_rank": per_rank}, f, indent=1)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
