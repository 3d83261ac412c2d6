#!/usr/bin/env python
"""Node-loss chaos harness: the reference trainer on simulated nodes
(tests/python/multinode.py: own hostname, own tmpfs on /dev/shm; needs root) with
``--replicas 1``; a rank is killed at a random instant, its whole node is lost (every
process killed, its tmpfs gone), the other nodes' processes are killed too (the job
restarts, as torchrun or a scheduler would), and the job restarts on a replacement node.

    python tests/chaos/node_chaos.py --trials 20                 # the long run
    python tests/chaos/node_chaos.py --trials 4 --layouts 2x2    # one layout

Phases (round-robin over trials): train (after the N-th optimizer step), stage
(half-way through the N-th staging copy), replicate (the N-th replication about to
start, memory tier committed), persist (the N-th durable save's data files written,
manifest not yet), timer (a random delay: whatever the run is doing). The run keeps
two memory slots (and so two replica slots), the least replicas accept: a node lost
while one step replicates still has the previous step in memory and on its peer. Layouts: 2x1
and 2x2 (nodes x ranks per node). Lost: node b, node a, or both (round-robin).

Each trial checks: the restarted job finished; the final parameters are bitwise equal
to the uninterrupted reference's; every (rank, step) consumed the same sample ids as
in the reference, and a replayed step the same ids both times; each rank restored from
a tier it may (losing both nodes leaves only the durable tier). Exits non-zero if any
trial fails; prints the restored tiers per phase. (A 4-rank run is bit-exact only because
examples/train.py calls ``cairn.settle_ddp_buckets``: DDP's first step reduces in
another bucket layout than its later ones.) ``trial()`` is what the pytest CI
subset (tests/python/test_replication.py) runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests", "python"))
import multinode  # noqa: E402

PHASES = ["train", "stage", "replicate", "persist", "timer"]
LOSSES = [(1,), (0,), (0, 1)]
STEPS, EVERY, DURABLE_EVERY = 12, 2, 3  # saves at 2, 4, ..., 12; durable at 6, 12


def train_args(workdir: str, name: str) -> list[str]:
    return ["--steps", str(STEPS), "--ckpt-every", str(EVERY), "--durable-every",
            str(DURABLE_EVERY), "--replicas", "1", "--memory-slots", "2", "--keep", "2",
            "--d-model", "32",
            "--layers", "1", "--seq-len", "32", "--num-workers", "0",
            "--data-dir", os.path.join(workdir, "corpus"),
            "--ckpt-dir", os.path.join(workdir, name, "ckpt"),
            "--out", os.path.join(workdir, name, "final.pt"),
            "--sample-log", os.path.join(workdir, name, "samples")]


def samples(path: str) -> dict:
    """{(rank, step): ids}; raises if a replayed step consumed other ids."""
    seen: dict = {}
    with open(path) as f:
        for line in f:
            rank, step, *ids = line.split()
            key = (int(rank), int(step))
            if seen.get(key, ids) != ids:
                raise AssertionError(f"replayed step {key} consumed other samples")
            seen[key] = ids
    return seen


def equal_params(a: str, b: str) -> bool:
    import torch

    x, y = torch.load(a), torch.load(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def restored(job: multinode.Job, rank: int) -> tuple[int, str] | None:
    m = re.search(r"rank \d+ restored \((\d+), '(\w+)'\)", job.log(rank))
    return (int(m.group(1)), m.group(2)) if m else None


def reference(workdir: str, per: int, timeout: float = 300) -> str:
    """Runs the uninterrupted job of `per` ranks per node; returns its directory (its
    training time, in ms, in its file ``run_ms``)."""
    name = f"ref{per}"
    os.makedirs(os.path.join(workdir, name))
    nodes = [multinode.Node("node-a"), multinode.Node("node-b")]
    try:
        job = multinode.Job(nodes, per, train_args(workdir, name), os.path.join(workdir, name))
        job.start()
        rcs = job.wait_all(timeout)
        if rcs != [0] * 2 * per:
            raise RuntimeError(f"reference run failed {rcs}: " + job.log(0)[-3000:])
        m = re.search(r"steps in ([0-9.]+)s", job.log(0))
        with open(os.path.join(workdir, name, "run_ms"), "w") as f:
            f.write(str(int(1000 * float(m.group(1))) if m else 2000))
    finally:
        for n in nodes:
            n.lose()
    return os.path.join(workdir, name)


def trial(workdir: str, ref: str, name: str, per: int, spec: str, lose: tuple[int, ...],
          timeout: float = 300) -> dict:
    """One trial: CAIRN_CHAOS=`spec` on the first rank of node lose[0]; once a process
    of the job dies, the nodes in `lose` are lost and the others' processes killed;
    the job restarts. Returns {"killed", "restored": [per rank], "errors": [...]}."""
    d = os.path.join(workdir, name)
    os.makedirs(d)
    nodes = [multinode.Node("node-a"), multinode.Node("node-b")]
    out = {"name": name, "spec": spec, "lose": list(lose), "killed": False, "restored": [],
           "errors": []}
    try:
        job = multinode.Job(nodes, per, train_args(workdir, name), d)
        victim = lose[0] * per
        procs = job.start(per_rank_env={victim: {"CAIRN_CHAOS": spec}})
        deadline = time.monotonic() + timeout
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)  # polls the job: the kill instant is the chaos point's
        out["killed"] = "[chaos]" in job.log(victim)
        if out["killed"]:
            job.lose_nodes(lose)
            job.start()
        rcs = job.wait_all(max(1.0, deadline - time.monotonic()) + timeout)
        world = 2 * per
        if rcs != [0] * world:
            out["errors"].append(f"rcs {rcs}: " + job.log(victim)[-2000:])
            return out
        out["restored"] = [restored(job, r) for r in range(world)]
        if not equal_params(os.path.join(d, "final.pt"), os.path.join(ref, "final.pt")):
            out["errors"].append("final parameters differ from the reference")
        try:
            if samples(os.path.join(d, "samples")) != samples(os.path.join(ref, "samples")):
                out["errors"].append("sample sequence differs from the reference")
        except AssertionError as e:
            out["errors"].append(str(e))
        if out["killed"]:
            for r, got in enumerate(out["restored"]):
                tier = None if got is None else got[1]
                allowed = {"durable", None} if len(lose) == 2 else {
                    "memory", "peer", "durable", None}
                if tier not in allowed:
                    out["errors"].append(f"rank {r} restored {got}, not allowed after "
                                         f"losing nodes {lose}")
                if tier == "memory" and r // per in lose:
                    out["errors"].append(f"rank {r} of a lost node restored from memory")
        return out
    finally:
        for n in nodes:
            n.lose()


def spec_for(phase: str, rng: random.Random, run_ms: int) -> str:
    saves = STEPS // EVERY
    if phase == "train":
        n = rng.randrange(1, STEPS)
    elif phase in ("stage", "replicate"):
        n = rng.randrange(1, saves + 1)
    elif phase == "persist":
        n = rng.randrange(1, STEPS // (EVERY * DURABLE_EVERY) + 1)
    else:
        n = rng.randrange(1, max(2, run_ms))  # from the manager's start, in training
    return f"{phase}:{n}:all"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=20, help="trials per layout")
    p.add_argument("--layouts", default="2x1,2x2")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--workdir")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", help="write the summary here")
    a = p.parse_args()
    if not multinode.available():
        print("[node-chaos] needs root, unshare and nsenter")
        return 2
    seed = a.seed if a.seed is not None else int(time.time())
    rng = random.Random(seed)
    work = a.workdir or tempfile.mkdtemp(prefix="cairn-node-chaos-")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    results = []
    try:
        for layout in a.layouts.split(","):
            per = int(layout.split("x")[1])
            ref = reference(work, per, a.timeout)
            with open(os.path.join(ref, "run_ms")) as f:
                run_ms = int(f.read())
            print(f"[node-chaos] seed {seed}; {layout} reference in {run_ms} ms", flush=True)
            for i in range(a.trials):
                phase = PHASES[i % len(PHASES)]
                lose = LOSSES[(i // len(PHASES) + i) % len(LOSSES)]
                r = trial(work, ref, f"{layout}-t{i}", per, spec_for(phase, rng, run_ms),
                          lose, a.timeout)
                r["layout"], r["phase"] = layout, phase
                results.append(r)
                print(f"[node-chaos] {layout} trial {i:3d} {r['spec']:16s} lose={lose} "
                      f"killed={r['killed']!s:5s} restored={r['restored']} "
                      f"{'OK' if not r['errors'] else 'FAIL ' + '; '.join(r['errors'])}",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tiers = collections.Counter((r["layout"], r["phase"], t[1]) for r in results
                                for t in r["restored"] if t)
    failed = [r for r in results if r["errors"]]
    summary = {"seed": seed, "trials": len(results), "failed": len(failed),
               "killed": sum(r["killed"] for r in results),
               "tiers": {"/".join(k): v for k, v in sorted(tiers.items())}}
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
