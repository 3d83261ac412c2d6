"""The CUDA staging path, measured: how long training stalls while a GPU state is
copied to host memory for an async checkpoint.

State: ~200 CUDA float32 tensors, --gb GB in all (default 1.5), sizes spread like a
model + Adam state. Per method, --warmup repetitions (default 2, which also maps and
pins every slot) then --reps timed ones (default 5); medians are reported.

  floor        device-to-host copy of every tensor into one pre-pinned host buffer
               (non_blocking on a side stream, then synchronize): the best a stall can be
  stager       cairn.SharedMemoryStager.stage(): D2H into a shared-memory slot
               registered as pinned memory (slots reused across saves)
  async_save   dcp.async_save(..., storage_writer=cairn.Writer) with DCP's default
               stager: the time until it returns (the write itself runs after)
  manager      cairn.CheckpointManager.save(): stage into its shared-memory slot
               (CheckpointManager._stage_device_tensors) and return (memory tier only)

Every stall is measured from a synchronized device to the call's return, with the
previous save finished. Prints a table and a JSON line (and --json FILE). Exits 0 with
a message when no CUDA device is present. About a minute on an H200 at 1.5 GB.

  PYTHONPATH=python .venv/bin/python bench/gpu_stage.py [--gb 1.5] [--reps 5]

--device cpu runs the same measurements on CPU tensors (a quick check of the script
on a machine without a GPU; its figures say nothing about the CUDA path).
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
import warnings

import numpy as np
import torch

NO_GPU = "gpu_stage: no CUDA device here (torch.cuda.is_available() is False); nothing measured"


def make_state(total_bytes: int, device: str, n: int = 200, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    raw = np.exp(rng.uniform(np.log(64e3), np.log(60e6), n))
    sizes = (raw / raw.sum() * total_bytes / 4).astype(np.int64)
    g = torch.Generator(device=device).manual_seed(seed)
    return {f"layer{i}.w": torch.randn(int(s), generator=g, device=device)
            for i, s in enumerate(sizes)}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, before, after, warmup: int, reps: int, device: str) -> list[float]:
    """Runs before(); sync; t0; fn(); t; after() — warmup + reps times; returns the
    timed durations of fn."""
    out = []
    for r in range(warmup + reps):
        before()
        sync(device)
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        after()
        if r >= warmup:
            out.append(dt)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()
    if args.reps < 3 or args.warmup < 1:
        ap.error("--reps must be >= 3 and --warmup >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_GPU)
        return 0

    import torch.distributed.checkpoint as dcp

    import cairn

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    dev = args.device
    state = make_state(int(args.gb * 1e9), dev)
    names = list(state)
    payload = sum(t.nbytes for t in state.values())
    shm = os.statvfs("/dev/shm")
    if shm.f_bavail * shm.f_frsize < 2.2 * payload:  # the stager's two slots
        print(f"gpu_stage: /dev/shm has {shm.f_bavail * shm.f_frsize / 1e9:.2f} GB free, "
              f"{2.2 * payload / 1e9:.2f} GB needed; use a smaller --gb")
        return 2
    tmp = tempfile.mkdtemp(prefix="cairn-gpu-stage-")
    results: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                     "tensors": len(state), "payload_bytes": payload, "reps": args.reps,
                     "warmup": args.warmup, "median_s": {}}

    def touch() -> None:  # training goes on between saves
        state[names[0]].add_(1.0)

    def check(staged: dict) -> None:  # a staged copy holds the source values
        for k in (names[0], names[-1]):
            got = staged[k].detach()
            assert got.device.type == "cpu" and torch.equal(got, state[k].cpu()), k

    try:
        # 1. The floor: D2H into a pre-pinned buffer.
        offsets, off = [], 0
        for t in state.values():
            offsets.append(off)
            off += (t.nbytes + 4095) // 4096 * 4096
        pinned = torch.empty(off, dtype=torch.uint8, pin_memory=(dev == "cuda"))
        pinned.fill_(0)  # fault it in
        stream = torch.cuda.Stream() if dev == "cuda" else None

        def floor() -> None:
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for t, o in zip(state.values(), offsets):
                        pinned[o:o + t.nbytes].view(t.dtype).copy_(t, non_blocking=True)
                stream.synchronize()
            else:
                for t, o in zip(state.values(), offsets):
                    pinned[o:o + t.nbytes].view(t.dtype).copy_(t)

        floor_t = timed(floor, touch, lambda: None, args.warmup, args.reps, dev)
        del pinned

        # 2. cairn.SharedMemoryStager.stage (2 slots: each save recycles the older one).
        stager = cairn.SharedMemoryStager(slots=2)
        last: list = []

        def stage() -> None:
            last[:] = [stager.stage(state)]

        stager_t = timed(stage, touch, lambda: check(last[0]), args.warmup, args.reps, dev)
        results["stager_footprint_bytes"] = stager.footprint
        last.clear()
        stager.close()

        # 3. dcp.async_save with DCP's default stager, writing with cairn.Writer.
        fut: list = []

        def async_save() -> None:
            w = cairn.Writer(os.path.join(tmp, "dcp"), sync=False)
            fut[:] = [dcp.async_save(state, storage_writer=w)]

        dcp_t = timed(async_save, touch, lambda: fut[0].result(), args.warmup, args.reps, dev)
        shutil.rmtree(os.path.join(tmp, "dcp"), ignore_errors=True)

        # 4. CheckpointManager.save: the memory tier only (durable at close()).
        mgr = cairn.CheckpointManager(os.path.join(tmp, "mgr"), keep=1,
                                      durable_every=1_000_000, direct_io=False)
        step = [0]

        def mgr_save() -> None:
            step[0] += 1
            mgr.save(step[0], dict(state))

        mgr_t = timed(mgr_save, touch, mgr.wait, args.warmup, args.reps, dev)
        mgr.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    floor_s = statistics.median(floor_t)
    floor_name = "floor: D2H into pinned buffer" if dev == "cuda" else "floor: copy into buffer"
    rows = [("floor", floor_name, floor_t),
            ("stager", "cairn SharedMemoryStager", stager_t),
            ("dcp_async_save", "dcp.async_save default stager", dcp_t),
            ("manager", "CheckpointManager.save", mgr_t)]
    print(f"state: {len(state)} {dev} tensors, {payload / 1e9:.3f} GB; "
          f"median of {args.reps} after {args.warmup} warm-up")
    print(f"{'method':<34}{'median s':>10}{'min s':>9}{'GB/s':>8}{'x floor':>9}")
    for key, name, ts in rows:
        med = statistics.median(ts)
        results["median_s"][key] = med
        print(f"{name:<34}{med:>10.4f}{min(ts):>9.4f}{payload / med / 1e9:>8.2f}"
              f"{med / floor_s:>9.2f}")
    print(json.dumps(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
