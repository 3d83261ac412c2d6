#!/usr/bin/env python3
"""Where the blocking time of a small CheckpointManager save goes, per rank.

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 bench/save_fixed_cost.py
    .venv/bin/python bench/save_fixed_cost.py          # one process

Saves a ~3 MB state in 198 tensors (+ 66 scalars, bench/checkpoint.py's shape)
``--saves`` times, back to back as every-step checkpointing does (each save first
waits for the previous one), and times, with time.perf_counter wrappers installed
around the manager's own methods (nothing in cairn is changed): the whole
``save()`` call as training sees it, and inside it ``wait()`` (the previous save's
background persistence still running), the flattening of the state, the all-reduces
of the checkpoint group, and the copy into the slot (``_StagingWriter.stage``).
The copy floor (``Tensor.copy_`` of the state into pre-faulted tensors) is measured
in the same process. Prints medians per rank and writes --out (JSON) on rank 0.
With ``--profile``, rank 0 also runs cProfile over the saves and prints the top.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# CAIRN_TREE: another checkout's python/ to time (e.g. before a change), default this one.
sys.path.insert(0, str(Path(os.environ.get("CAIRN_TREE", REPO)) / "python"))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cairn  # noqa: E402
from cairn import manager as M  # noqa: E402

from bench.peers.worker import build_state, leaves, like  # noqa: E402

TIMES: dict[str, list[float]] = {}


def timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES.setdefault(label, []).append(time.perf_counter() - t0)
    setattr(owner, name, wrapper)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, default=3.0)
    ap.add_argument("--saves", type=int, default=50)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--durable-every", type=int, default=1,
                    help="the manager's durable_every (1: every save fsyncs the disk tier)")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="sleep between saves, standing in for a training step")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "save_fixed_cost.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    print(f"rank {rank}: cairn from {cairn.__file__}", flush=True) if rank == 0 else None
    state = build_state(args.size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in leaves(state))
    dst = like(state)
    pairs = list(zip(leaves(state), leaves(dst)))
    floors = []
    for _ in range(20):
        t0 = time.perf_counter()
        for s, d in pairs:
            d.copy_(s)
        floors.append(time.perf_counter() - t0)
    del dst, pairs
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="cairn-fixed-", dir=args.out.parent)) if rank == 0 else None
    if dist.is_initialized():
        box = [str(root)]
        dist.broadcast_object_list(box, src=0)
        root = Path(box[0])
    mgr = cairn.CheckpointManager(root, memory=True, keep=1, durable_every=args.durable_every)
    timed(mgr, "wait", "wait (previous save)")
    timed(mgr, "_all", "all_reduce (_all)")
    timed(M, "flatten_state_dict", "flatten_state_dict")
    timed(M._StagingWriter, "stage", "copy into slot (stage)")
    timed(mgr, "_stage_planned", "_stage_planned (cached plan)")
    totals = []
    prof = cProfile.Profile() if (args.profile and rank == 0) else None
    for i in range(args.saves + 2):
        if i == 2:  # the first two pay planning and the slots' first touch
            TIMES.clear()
            if prof:
                prof.enable()
        if args.step_ms:
            time.sleep(args.step_ms / 1e3)
        if dist.is_initialized():
            dist.barrier()  # both ranks start the save together, as after a DDP step
        t0 = time.perf_counter()
        mgr.save(i, state)
        totals.append(time.perf_counter() - t0)
    if prof:
        prof.disable()
    mgr.wait()
    persist_ms = mgr.stats().get("median_persist_s", 0.0) * 1e3
    mgr.close()
    totals = totals[2:]
    med = {k: statistics.median(v) * 1e3 for k, v in TIMES.items()}
    per_save = {k: sum(v) / args.saves * 1e3 for k, v in TIMES.items()}
    row = {"rank": rank, "world": world, "bytes": nbytes, "saves": args.saves,
           "durable_every": args.durable_every, "step_ms": args.step_ms,
           "save_ms_median": statistics.median(totals) * 1e3,
           "copy_floor_ms": statistics.median(floors) * 1e3,
           "persist_ms_median": persist_ms,
           "parts_ms_median_per_call": med, "parts_ms_per_save": per_save}
    rows = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(rows, row)
    else:
        rows = [row]
    if rank == 0:
        for r in rows:
            print(f"rank {r['rank']}: save() median {r['save_ms_median']:.2f} ms, copy floor "
                  f"{r['copy_floor_ms']:.2f} ms, fixed cost "
                  f"{r['save_ms_median'] - r['copy_floor_ms']:.2f} ms ({r['bytes'] / 1e6:.1f} MB), "
                  f"background persistence {r['persist_ms_median']:.1f} ms")
            for k, v in sorted(r["parts_ms_per_save"].items(), key=lambda kv: -kv[1]):
                print(f"    {k:32s} {v:7.3f} ms per save")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "loadavg": os.getloadavg()}, indent=1))
        import shutil
        shutil.rmtree(root, ignore_errors=True)
        if prof:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
