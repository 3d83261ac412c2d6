"""Staging stall vs the memcpy floor, from Python, on a torch state.

Builds a reference state (~200 float32 tensors, --gb GB in all, sizes spread
like a model + Adam state) and times, per repetition (the first is dropped):

  floor        ctypes.memmove of every tensor into a pre-faulted numpy buffer
               (one thread, a plain libc memcpy)
  cairn T=k    the whole staging stall as the manager pays it: build the span
               list from the tensors, then StagingPool.copy_in into a
               pre-faulted shared-memory slot with k threads

and prints medians and the ratio to the floor (target: <= 1.25x).

  PYTHONPATH=python .venv/bin/python bench/staging.py [--gb 1.5] [--reps 5]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time

import numpy as np
import torch

from cairn import _ext


def make_state(total_bytes: int, n: int = 200, seed: int = 0) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    raw = np.exp(rng.uniform(np.log(64e3), np.log(60e6), n))
    sizes = (raw / raw.sum() * total_bytes / 4).astype(np.int64)
    return {f"p{i}": torch.full((int(s),), float(i), dtype=torch.float32) for i, s in enumerate(sizes)}


def layout(state):
    out, off = [], 0
    for t in state.values():
        out.append((t, off))
        off += (t.nbytes + 4095) // 4096 * 4096
    return out, off


def median_time(fn, reps: int) -> float:
    times = []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        fn()
        if r:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    state = make_state(int(args.gb * 1e9))
    items, total = layout(state)
    payload = sum(t.nbytes for t, _ in items)

    floor_buf = np.ones(total, dtype=np.uint8)  # pre-faulted by the fill
    base = floor_buf.ctypes.data

    def floor():
        for t, off in items:
            ctypes.memmove(base + off, t.data_ptr(), t.nbytes)

    floor_s = median_time(floor, args.reps)
    del floor_buf

    results = {"payload_bytes": payload, "tensors": len(items), "floor_s": floor_s, "cairn": {}}
    print(f"state: {len(items)} tensors, {payload / 1e9:.3f} GB, {args.reps} repetitions")
    print(f"{'method':<30}{'median s':>10}{'GB/s':>8}{'x floor':>9}")
    print(f"{'floor: memcpy, 1 thread':<30}{floor_s:>10.4f}{payload / floor_s / 1e9:>8.2f}{1:>9.3f}")
    for threads in (1, 2, 4):
        root = _ext.shm_directory(f"cairn-bench-py-{os.getpid()}-{threads}")
        with _ext.StagingPool(root, num_slots=1, threads=threads) as pool:
            t0 = time.perf_counter()
            idx = pool.acquire(total)["index"]
            first = time.perf_counter() - t0

            def stage():
                pool.copy_in(idx, [(t.data_ptr(), off, t.nbytes) for t, off in items])

            s = median_time(stage, args.reps)
            # Correctness spot check: the last tensor landed where it should.
            t, off = items[-1]
            got = torch.empty_like(t)
            pool.copy_out(idx, [(got.data_ptr(), off, got.nbytes)])
            assert torch.equal(got, t)
        name = f"cairn copy_in, {threads} thread(s)"
        print(f"{name:<30}{s:>10.4f}{payload / s / 1e9:>8.2f}{s / floor_s:>9.3f}")
        results["cairn"][threads] = {"stall_s": s, "ratio": s / floor_s, "first_acquire_s": first}
    print(f"(first acquire = grow + pre-fault, paid once per process: "
          f"{results['cairn'][1]['first_acquire_s']:.3f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
