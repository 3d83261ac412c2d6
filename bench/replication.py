#!/usr/bin/env python
"""Replication bench (not a test): two simulated nodes (tests/python/multinode.py:
own hostname, own tmpfs on /dev/shm; needs root), one rank each, over loopback.

Figures, medians of --runs runs:
  replication throughput vs a raw gloo isend/irecv of the same bytes between the same
  processes (both directions at once, as the 2-node ring does);
  blocking stall of a save with replicas=1 vs replicas=0;
  restore of a node from its peer's replica vs from the durable tier.

    python bench/replication.py --mib 256 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def worker(a) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(REPO, "python"))
    import cairn

    rank, world = cairn.init_distributed("gloo")
    n = a.mib * 2**20 // 4 // 16
    state = {f"r{rank}.t{i}": torch.randn(n, generator=torch.Generator().manual_seed(rank * 100 + i))
             for i in range(16)}
    out = {}
    g = dist.new_group(backend="gloo")
    peer = 1 - rank
    buf_s = torch.empty(a.mib * 2**20, dtype=torch.uint8).fill_(1)
    buf_r = torch.zeros_like(buf_s)  # touched: a replica file's pages are allocated too
    raw = []

    def raw_runs() -> None:
        for _ in range(a.runs):
            dist.barrier(group=g)
            t0 = time.perf_counter()
            ws = [dist.isend(buf_s, peer, group=g), dist.irecv(buf_r, peer, group=g)]
            for w in ws:
                w.wait()
            raw.append(time.perf_counter() - t0)

    raw_runs()  # before and after the managers' runs: the median of both
    for k in (0, 1):
        root = os.path.join(a.workdir, f"root{k}")
        # Two slots in both runs: replicas need them, and the stalls compare alike.
        mgr = cairn.CheckpointManager(root, replicas=k, memory_slots=2, durable_every=1000)
        reps, phases = [], []
        for step in range(a.runs + 1):  # the first save is the warm-up
            mgr.save(step, state, durable=(step == a.runs))
            mgr.wait()
            if step:
                reps.append(mgr._repl.last_s)
                phases.append(dict(mgr._repl.last_phases))
        stalls = [h["stall_s"] for h in mgr._history[1:]]
        out[f"stall_r{k}_s"] = float(np.median(stalls))
        if k:
            out["replicate_s"] = float(np.median(reps))
            out["replicated"] = mgr._repl.replicated
            out["phases"] = {p: float(np.median([x.get(p, 0.0) for x in phases]))
                             for p in phases[0]}
            # Node b loses its memory tier; a fresh manager restores it from node a's
            # replica (node a from its own memory), then every rank from durable.
            peer_t, dur_t, tiers = [], [], []
            for _ in range(a.runs):
                if rank == 1:  # gone after the first run; the replica on node a stays
                    for slot in range(mgr.num_slots):
                        shutil.rmtree(os.path.join(mgr.shm_dir, f"slot{slot}"),
                                      ignore_errors=True)
                dist.barrier(group=g)
                sd = {k2: torch.empty_like(v) for k2, v in state.items()}
                m2 = cairn.CheckpointManager(root, replicas=1)
                t0 = time.perf_counter()
                m2.restore(sd)
                peer_t.append(time.perf_counter() - t0)
                tiers.append(m2.restored)
                assert all(torch.equal(sd[x], state[x]) for x in state)
                m3 = cairn.CheckpointManager(root, memory=False)
                t0 = time.perf_counter()
                m3.restore(sd)
                dur_t.append(time.perf_counter() - t0)
                tiers.append(m3.restored)
                m2._closed = m3._closed = True  # mgr keeps the shared memory
                m2._repl.store.release_lease()
                m2._lease.release()
                m3._lease.release()
            out["restore_peer_s"] = float(np.median(peer_t))
            out["restore_durable_s"] = float(np.median(dur_t))
            out["tiers"] = [list(t) for t in tiers]
        mgr.close()
    raw_runs()
    out["raw_gloo_s"] = float(np.median(raw[1:]))  # the first one sets the pair up
    out["bytes"] = a.mib * 2**20
    with open(os.path.join(a.workdir, f"out{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=256, help="state per rank (MiB)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workdir")
    p.add_argument("--worker", action="store_true")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    sys.path.insert(0, os.path.join(REPO, "tests", "python"))
    import multinode

    if not multinode.available():
        print("needs root, unshare and nsenter")
        return 2
    work = tempfile.mkdtemp(prefix="cairn-repl-bench-")
    nodes = [multinode.Node(f"bench-{c}", shm_size=f"{8 * a.mib}m") for c in "ab"]
    try:
        port = multinode.free_port()
        procs = []
        for r, node in enumerate(nodes):
            env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"), RANK=str(r),
                       WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            log = open(os.path.join(work, f"r{r}.log"), "w")
            procs.append(node.popen([sys.executable, __file__, "--worker", "--mib", str(a.mib),
                                     "--runs", str(a.runs), "--workdir", work], env, log))
        rcs = [pr.wait(900) for pr in procs]
        if rcs != [0, 0]:
            for r in range(2):
                print(open(os.path.join(work, f"r{r}.log")).read()[-3000:])
            return 1
        res = [json.load(open(os.path.join(work, f"out{r}.json"))) for r in range(2)]
        o = res[1]
        gbs = lambda s: o["bytes"] / s / 1e9  # noqa: E731
        print(json.dumps({"per_rank_MiB": a.mib, "runs": a.runs,
                          "raw_gloo_GBps": round(gbs(o["raw_gloo_s"]), 3),
                          "replication_GBps": round(gbs(o["replicate_s"]), 3),
                          "replication_vs_raw": round(o["raw_gloo_s"] / o["replicate_s"], 3),
                          "stall_replicas0_s": round(o["stall_r0_s"], 4),
                          "stall_replicas1_s": round(o["stall_r1_s"], 4),
                          "stall_ratio": round(o["stall_r1_s"] / o["stall_r0_s"], 3),
                          "restore_peer_s": round(o["restore_peer_s"], 3),
                          "restore_durable_s": round(o["restore_durable_s"], 3),
                          "replication_phases_s": {p: round(v, 4) for p, v in o["phases"].items()},
                          "load_average": [round(x, 1) for x in os.getloadavg()],
                          "tiers_rank1": o["tiers"]}, indent=1))
        return 0
    finally:
        for n in nodes:
            n.lose()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
