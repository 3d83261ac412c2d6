#!/usr/bin/env python3
"""Worker start-up of cairn.data.DataLoader: the time from ``iter()`` to the first
batch, in fresh processes (one per run), for a tiny local dataset, so that nothing
but the start of the workers is measured.

    PYTHONPATH=python .venv/bin/python bench/data_startup.py                 # 2 workers
    PYTHONPATH=python .venv/bin/python bench/data_startup.py --workers 4
    PYTHONPATH=python .venv/bin/python bench/data_startup.py --pause 3       # 3 s of the
        # trainer's own work between constructing the loader and its first iter()
    PYTHONPATH=python .venv/bin/python bench/data_startup.py --loaders 2     # a second
        # loader in the same process
    OMP_NUM_THREADS=1 PYTHONPATH=python ... bench/data_startup.py            # a trainer
        # with a single thread: the default then forks

Each run prints, per loader, the start method its workers got and the seconds from
``iter()`` to the first batch; the last line gives the medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def read_bytes(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def collate(batch):
    return batch


def child(src: str, workers: int, pause: float, loaders: int, ctx: str | None) -> None:
    import cairn.data as cd

    out = []
    for i in range(loaders):
        ds = cd.CachedFileDataset(src, cache_dir=f"{src}.cache{i}", shuffle=True,
                                  transform=read_bytes)
        kw = {"multiprocessing_context": ctx} if ctx else {}
        dl = cd.DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=collate, **kw)
        time.sleep(pause)  # the trainer's own work before its first iter()
        t0 = time.perf_counter()
        it = iter(dl)
        next(it)
        first = time.perf_counter() - t0
        method = dl.multiprocessing_context.get_start_method()
        for _ in it:
            pass
        out.append(f"{method} {first:.3f}")
        del it, dl
    print(" ".join(out), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--pause", type=float, default=0.0,
                    help="seconds between constructing the loader and iter()")
    ap.add_argument("--loaders", type=int, default=1, help="loaders per process, in turn")
    ap.add_argument("--mp", default=None, help="multiprocessing_context (default: cairn's)")
    ap.add_argument("--child", nargs=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.workers, args.pause, args.loaders, args.mp)
        return 0
    work = tempfile.mkdtemp(prefix="cairn-data-startup-")
    try:
        src = os.path.join(work, "src")
        os.makedirs(src)
        for i in range(64):
            with open(os.path.join(src, f"s{i:05d}.bin"), "wb") as f:
                f.write(b"x" * 4096)
        per_loader: list[list[float]] = [[] for _ in range(args.loaders)]
        for run in range(args.runs):
            for d in os.listdir(work):
                if d != "src":
                    shutil.rmtree(os.path.join(work, d))
            cmd = [sys.executable, "-W", "ignore", os.path.abspath(__file__), "--child", src,
                   "--workers", str(args.workers), "--pause", str(args.pause),
                   "--loaders", str(args.loaders)] + (["--mp", args.mp] if args.mp else [])
            line = subprocess.run(cmd, check=True, capture_output=True, text=True,
                                  timeout=300).stdout.strip().splitlines()[-1]
            parts = line.split()
            print(f"run {run}: " + ", ".join(f"loader {i}: {parts[2 * i]} {parts[2 * i + 1]} s"
                                             for i in range(args.loaders)), flush=True)
            for i in range(args.loaders):
                per_loader[i].append(float(parts[2 * i + 1]))
        print("median iter() -> first batch: " + ", ".join(
            f"loader {i} {statistics.median(v):.2f} s" for i, v in enumerate(per_loader))
            + f"  (load average {os.getloadavg()[0]:.1f})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
