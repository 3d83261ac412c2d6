#!/usr/bin/env python
"""cairn's demo: a 2-rank training run is killed mid-run and resumes by itself.

1. An uninterrupted reference run of the reference trainer (examples/train.py) on 2
   CPU ranks under torchrun, checkpointing every few steps with cairn.
2. The same run again, under `torchrun --max-restarts 1`, where rank 1 is SIGKILLed
   mid-run: torchrun restarts the workers, cairn.CheckpointManager restores the newest
   checkpoint every rank can load (from the shared-memory tier), and training ends.
3. The final parameters of both runs are compared bit for bit, the sample sequences
   too, and the checkpoint figures (blocking stall, persist time) are printed, with
   `cairn ls` and `cairn verify` of the durable tier.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "python"))


def run(nproc: int, args: list[str], log: str, restarts: int = 0) -> str:
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", f"--max-restarts={restarts}",
           os.path.join(HERE, "train.py"), *args]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    out = open(log).read()
    if rc != 0:
        sys.stdout.write(out[-3000:])
        raise SystemExit(f"demo: torchrun exited with {rc} (log: {log})")
    return out


def cli() -> str:
    for c in (os.path.join(REPO, "build", "cairn"), shutil.which("cairn")):
        if c and os.path.exists(c):
            return c
    raise SystemExit("demo: the cairn CLI is not built (run scripts/setup.sh)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--crash-at-step", type=int, default=23)
    p.add_argument("--workdir", default=None)
    a = p.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="cairn-demo-")
    os.makedirs(work, exist_ok=True)
    common = ["--steps", str(a.steps), "--ckpt-every", str(a.ckpt_every),
              "--data-dir", os.path.join(work, "corpus"), "--num-workers", "1"]
    print(f"== cairn demo in {work}")
    print(f"== 1. uninterrupted reference run: 2 ranks (DDP, gloo), {a.steps} steps, "
          f"a checkpoint every {a.ckpt_every}")
    ref = run(2, common + ["--ckpt-dir", f"{work}/ref", "--out", f"{work}/ref.pt",
                           "--sample-log", f"{work}/ref.samples"], f"{work}/ref.log")
    print("\n".join("   " + line for line in ref.splitlines() if line.startswith("[train]")))

    print(f"== 2. the same run, rank 1 killed with SIGKILL at step {a.crash_at_step}; "
          "torchrun --max-restarts 1 restarts it")
    out = run(2, common + ["--ckpt-dir", f"{work}/ckpt", "--out", f"{work}/crash.pt",
                           "--sample-log", f"{work}/crash.samples",
                           "--crash-at-step", str(a.crash_at_step), "--crash-rank", "1"],
              f"{work}/crash.log", restarts=1)
    print("\n".join("   " + line for line in out.splitlines() if line.startswith("[train]")))

    import torch

    x, y = torch.load(f"{work}/ref.pt"), torch.load(f"{work}/crash.pt")
    same = x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

    def samples(path):
        d = {}
        for line in open(path):
            r, s, *ids = line.split()
            d[(r, s)] = ids
        return d

    same_samples = samples(f"{work}/ref.samples") == samples(f"{work}/crash.samples")
    m = re.search(r"resuming from step (\d+) \(([a-z]+) tier\)", out)
    print("== 3. result")
    print(f"   resumed from step {m.group(1)} ({m.group(2)} tier) after the crash" if m else
          "   did not resume?")
    print(f"   final parameters bitwise equal to the uninterrupted run: {same} "
          f"({len(x)} tensors)")
    print(f"   same sample sequence as the uninterrupted run: {same_samples}")
    figs = re.search(r'"median_stall_s": ([0-9.]+), "median_persist_s": ([0-9.]+)', out)
    if figs:
        print(f"   checkpoints: median blocking stall {1000 * float(figs.group(1)):.1f} ms, "
              f"median persist {1000 * float(figs.group(2)):.1f} ms")
    exe = cli()
    print(f"== cairn ls {work}/ckpt")
    subprocess.run([exe, "ls", f"{work}/ckpt"], check=False)
    import cairn

    latest = cairn.latest_valid(f"{work}/ckpt")
    print(f"== cairn verify {latest}")
    subprocess.run([exe, "verify", latest], check=True)
    if not (same and same_samples):
        print("demo: FAILED: the resumed run differs from the uninterrupted one")
        return 1
    print("demo: OK")
    if a.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
