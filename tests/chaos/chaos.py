#!/usr/bin/env python
"""kill -9 chaos harness: a 2-rank run of the reference trainer with frequent async
checkpoints, killed at random instants and phases, restarted by torchrun, compared
bit for bit with an uninterrupted run.

    python tests/chaos/chaos.py --trials 50          # the full run
    python tests/chaos/chaos.py --trials 5           # the CI subset (one per phase)

Phases (round-robin over trials, so each is hit): train (after the N-th optimizer
step), stage (half-way through the N-th staging copy), persist (data files of the
N-th save written, manifest not yet), commit (the coordinator about to publish the
N-th manifest), prune (a checkpoint uncommitted, its data not yet deleted), timer
(SIGKILL after a random delay: whatever the run is doing). The victim is rank 0,
rank 1 or both (commit and prune happen on the coordinator, rank 0).

Each trial checks: torchrun finished (after the restart); the final parameters are
bitwise equal to the uninterrupted reference's; every (rank, step) consumed the same
sample ids as in the reference, and steps replayed after the restore consumed the
same ids both times; the run resumed from a committed checkpoint step; no
shared-memory directory of the run and no temp file is left behind. One more trial
resumes a 2-rank checkpoint on 1 rank and checks that no sample is consumed twice.
Exits non-zero if any trial fails; prints the counts per phase.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TRAIN = os.path.join(REPO, "examples", "train.py")
PHASES = ["train", "stage", "persist", "commit", "prune", "timer"]


def torchrun(nproc: int, args: list[str], env: dict, log: str, timeout: float) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "--max-restarts=3", TRAIN, *args]
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return -1


def read_samples(path: str) -> tuple[dict, list]:
    """{(rank, step): ids} keeping the last attempt's entry, and the (rank, step)
    pairs whose replay consumed different ids than the first time."""
    seen: dict = {}
    diverged = []
    with open(path) as f:
        for line in f:
            rank, step, *ids = line.split()
            key = (int(rank), int(step))
            if key in seen and seen[key] != ids:
                diverged.append(key)
            seen[key] = ids
    return seen, diverged


def equal_params(a: str, b: str) -> bool:
    import torch

    x, y = torch.load(a), torch.load(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def leaks(ckpt: str) -> list[str]:
    sys.path.insert(0, os.path.join(REPO, "python"))
    from cairn.manager import memory_tier_name

    out = []
    shm = os.path.join("/dev/shm", memory_tier_name(os.path.abspath(ckpt)))
    if os.path.exists(shm):
        out.append(shm)
    for dirpath, _, files in os.walk(ckpt):
        out += [os.path.join(dirpath, f) for f in files if f.endswith(".tmp")]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--workdir", default="/tmp/cairn-chaos")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--no-reshard", action="store_true", help="skip the 2->1 trial")
    p.add_argument("--json", help="write the summary here")
    a = p.parse_args()
    seed = a.seed if a.seed is not None else int(time.time())
    rng = random.Random(seed)
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    corpus = os.path.join(a.workdir, "corpus")
    base_env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"), OMP_NUM_THREADS="1")
    base_env.pop("CAIRN_CHAOS", None)
    common = ["--steps", str(a.steps), "--ckpt-every", str(a.ckpt_every), "--keep", "2",
              "--data-dir", corpus, "--num-workers", "1"]
    saves = a.steps // a.ckpt_every

    print(f"[chaos] seed {seed}; reference run ({a.steps} steps, a save every "
          f"{a.ckpt_every})", flush=True)
    ref = os.path.join(a.workdir, "ref")
    rc = torchrun(2, common + ["--ckpt-dir", f"{ref}/ckpt", "--out", f"{ref}.pt",
                               "--sample-log", f"{ref}.samples"], base_env, f"{ref}.log",
                  a.timeout)
    if rc != 0:
        print(f"[chaos] reference run failed (rc {rc}); see {ref}.log")
        return 2
    ref_samples, _ = read_samples(f"{ref}.samples")
    m = re.search(r"steps in ([0-9.]+)s", open(f"{ref}.log").read())
    run_ms = int(1000 * float(m.group(1))) if m else 2000

    hits = collections.Counter()
    failures = []
    for i in range(a.trials):
        phase = PHASES[i % len(PHASES)]
        if phase == "train":
            n = rng.randrange(1, a.steps)
        elif phase == "timer":
            # The timer starts when the manager is created: before the restore and
            # the first step, so any instant of the run up to its last step.
            n = rng.randrange(50, max(100, int(0.8 * run_ms)))
        elif phase == "prune":
            n = rng.randrange(1, max(2, saves - 2))
        else:
            n = rng.randrange(1, saves)
        victims = "0" if phase in ("commit", "prune") else rng.choice(["0", "1", "all"])
        spec = f"{phase}:{n}:{victims}"
        d = os.path.join(a.workdir, f"t{i:03d}")
        env = dict(base_env, CAIRN_CHAOS=spec)
        t0 = time.time()
        rc = torchrun(2, common + ["--ckpt-dir", f"{d}/ckpt", "--out", f"{d}.pt",
                                   "--sample-log", f"{d}.samples"], env, f"{d}.log", a.timeout)
        log = open(f"{d}.log").read()
        killed = "[chaos]" in log
        problems = []
        if rc != 0:
            problems.append(f"torchrun exit code {rc}")
        else:
            if not equal_params(f"{ref}.pt", f"{d}.pt"):
                problems.append("final parameters differ from the reference")
            got, diverged = read_samples(f"{d}.samples")
            if got != ref_samples:
                problems.append("consumed samples differ from the reference")
            if diverged:
                problems.append(f"replayed steps consumed other samples: {diverged[:3]}")
            for m in re.finditer(r"resuming from step (\d+)", log):
                if int(m.group(1)) % a.ckpt_every:
                    problems.append(f"resumed from step {m.group(1)}, not a checkpoint step")
            left = leaks(f"{d}/ckpt")
            if left:
                problems.append(f"left behind: {left[:3]}")
        if killed:
            hits[phase] += 1
        status = "ok" if not problems else "FAIL: " + "; ".join(problems)
        print(f"[chaos] trial {i:3d} {spec:18s} killed={killed!s:5s} "
              f"{time.time() - t0:5.1f}s {status}", flush=True)
        if problems:
            failures.append({"trial": i, "spec": spec, "problems": problems, "log": f"{d}.log"})
        else:
            shutil.rmtree(d, ignore_errors=True)

    if not a.no_reshard:
        ok = reshard_trial(a, common, base_env, corpus)
        if not ok:
            failures.append({"trial": "reshard 2->1", "problems": ["see its log"]})

    summary = {"seed": seed, "trials": a.trials, "failed": len(failures),
               "kills_per_phase": dict(hits), "failures": failures}
    print(f"[chaos] {a.trials - len([f for f in failures if f['trial'] != 'reshard 2->1'])}"
          f"/{a.trials} trials exact; kills per phase: {dict(hits)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 1 if failures else 0


def reshard_trial(a, common, env, corpus) -> bool:
    """2 ranks train half the run; 1 rank resumes with twice the per-rank batch and
    finishes it. No sample may be consumed twice, and the resumed run must start
    from the 2-rank checkpoint."""
    d = os.path.join(a.workdir, "reshard")
    half = (a.steps // 2) // a.ckpt_every * a.ckpt_every
    first = ["--steps", str(half)] + common[2:]
    rc1 = torchrun(2, first + ["--ckpt-dir", f"{d}/ckpt", "--sample-log", f"{d}.samples"],
                   env, f"{d}.a.log", a.timeout)
    rest = list(common)
    rest[rest.index("--num-workers") + 1] = "1"
    rc2 = torchrun(1, rest + ["--ckpt-dir", f"{d}/ckpt", "--batch-size", "16",
                              "--sample-log", f"{d}.samples"], env, f"{d}.b.log", a.timeout)
    log = open(f"{d}.b.log").read()
    ids = []
    for (_, _), v in read_samples(f"{d}.samples")[0].items():
        ids += v
    dup = len(ids) - len(set(ids))
    resumed = f"resuming from step {half}" in log
    ok = rc1 == 0 and rc2 == 0 and dup == 0 and resumed
    print(f"[chaos] reshard 2->1: rc {rc1},{rc2} resumed_from_{half}={resumed} "
          f"samples={len(ids)} duplicates={dup} {'ok' if ok else 'FAIL'}", flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(main())
