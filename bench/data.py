#!/usr/bin/env python3
"""Data pipeline benchmark: cairn.data vs a stock torch DataLoader, side by side.

A synthetic dataset sits behind a slow source (cairn's ``slow://`` throttle,
implemented in C++ and shared by every process of the node: a per-file
latency and a node-wide bandwidth cap). A training loop sleeps a fixed step
time per batch. Both loaders use the same ``num_workers`` and batch size and
do the same work per sample (read the whole file):

* stock: ``torch.utils.data.DataLoader`` over a map-style dataset that reads
  each file from the slow source (``cairn._ext.SourceReader``, the same
  throttle), shuffled;
* cairn: ``cairn.data.DataLoader`` over ``CachedFileDataset(slow://...)``
  with ``transform`` reading the cached file.

Scenarios: ``latency`` (small files, high per-file latency) and ``bandwidth``
(large files, a bandwidth cap; the training step is short so the run is
data-bound). For each: a cold epoch (empty cache) and a warm one (second
epoch, same persistent workers). Reported per loader and epoch: throughput,
fraction of wall time the loop waited for data, bytes fetched from the source
vs the dataset size. Medians of ``--runs`` runs; JSON on stdout (or --out).

Targets (SPEC §4, issue 5): warm-epoch data wait <= 2% of step time; cold
epoch from the latency-bound source >= 3x the stock loader; >= 0.9x the cap
from the bandwidth-bound one; bytes fetched = dataset size.

    PYTHONPATH=python .venv/bin/python bench/data.py            # full (~1 min)
    PYTHONPATH=python .venv/bin/python bench/data.py --tiny     # smoke
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

import numpy as np
import torch
import torch.utils.data

import cairn.data as cd
from cairn import _ext


def read_bytes(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def collate_sizes(batch):
    return batch


class StockDataset(torch.utils.data.Dataset):
    """Reads each file through the slow source, like a plain Dataset on a mount."""

    def __init__(self, uri: str, keys: list[str]) -> None:
        self.uri, self.keys = uri, keys
        self._reader = None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> int:
        if self._reader is None:
            self._reader = _ext.SourceReader(self.uri)
        return len(self._reader.read(self.keys[i]))


def make_source(root: str, n: int, size: int) -> None:
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    block = rng.bytes(size)
    for i in range(n):
        with open(os.path.join(root, f"s{i:05d}.bin"), "wb") as f:
            f.write(block[i % 97 :] + block[: i % 97])


def train_epoch(loader, step_s: float) -> dict:
    """Runs one epoch; returns wall time, data wait and samples."""
    waited = 0.0
    first = 0.0
    samples = 0
    nbytes = 0
    t0 = time.perf_counter()
    it = iter(loader)
    while True:
        w0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            waited += time.perf_counter() - w0
            break
        dt = time.perf_counter() - w0
        waited += dt
        if samples == 0:
            first = dt
        samples += len(batch)
        nbytes += sum(int(x) for x in batch)
        time.sleep(step_s)  # the training step
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "wait_s": waited, "first_wait_s": first, "samples": samples,
            "bytes": nbytes}


def run_once(kind: str, sc: dict, work: str, run: int) -> dict:
    src = os.path.join(work, f"src-{sc['name']}")
    uri = f"slow://{src}?latency={sc['latency']}&bandwidth={sc['bandwidth']}&share=bench-{os.getpid()}"
    keys, sizes = _ext.list_source(src)
    total = int(sum(sizes))
    epochs = []
    if kind == "stock":
        ds = StockDataset(uri, list(keys))
        g = torch.Generator()
        g.manual_seed(run)
        loader = torch.utils.data.DataLoader(
            ds, batch_size=sc["batch"], shuffle=True, generator=g, num_workers=sc["workers"],
            collate_fn=collate_sizes, persistent_workers=True,
        )
        for e in range(2):
            r = train_epoch(loader, sc["step_s"])
            r["fetched_bytes"] = r["bytes"]  # every read goes to the source
            epochs.append(r)
        del loader
    else:
        cache = os.path.join(work, f"cache-{sc['name']}-{run}")
        shutil.rmtree(cache, ignore_errors=True)
        ds = cd.CachedFileDataset(uri, cache_dir=cache, shuffle=True, seed=run,
                                  transform=read_bytes, fetch_threads=sc["fetch_threads"])
        loader = cd.DataLoader(ds, batch_size=sc["batch"], num_workers=sc["workers"],
                               collate_fn=collate_sizes)
        probe = cd.CachedFileDataset(src, cache_dir=cache)  # same cache, for counters
        before = 0
        for e in range(2):
            loader.set_epoch(e)
            r = train_epoch(loader, sc["step_s"])
            fetched = probe.cache_stats()["shared_fetched_bytes"]
            r["fetched_bytes"] = fetched - before
            before = fetched
            epochs.append(r)
        del loader
        shutil.rmtree(cache, ignore_errors=True)
    out = {}
    for name, r in zip(("cold", "warm"), epochs):
        out[name] = {
            "samples_per_s": r["samples"] / r["wall_s"],
            "bytes_per_s": r["bytes"] / r["wall_s"],
            "wait_fraction": r["wait_s"] / r["wall_s"],
            # Without the first batch (worker start / epoch restart latency).
            "steady_wait_fraction": (r["wait_s"] - r["first_wait_s"])
            / max(1e-9, r["wall_s"] - r["first_wait_s"]),
            "first_batch_wait_s": r["first_wait_s"],
            "wall_s": r["wall_s"],
            "fetched_bytes": r["fetched_bytes"],
            "dataset_bytes": total,
            "samples": r["samples"],
        }
    return out


class InMemory(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return 0


def floor_wait(sc: dict) -> float:
    """Wait fraction of a stock DataLoader serving in-memory items with the
    same batch size, workers and step: the IPC floor of any multi-process
    loader on this machine."""
    loader = torch.utils.data.DataLoader(
        InMemory(sc["n"]), batch_size=sc["batch"], num_workers=sc["workers"],
        collate_fn=collate_sizes, persistent_workers=True,
    )
    train_epoch(loader, sc["step_s"])
    r = train_epoch(loader, sc["step_s"])
    return r["wait_s"] / r["wall_s"]


def median_of(runs: list[dict]) -> dict:
    out = {}
    for epoch in runs[0]:
        out[epoch] = {k: statistics.median(r[epoch][k] for r in runs) for k in runs[0][epoch]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (smoke test)")
    args = ap.parse_args()

    w = args.workers
    if args.tiny:
        scenarios = [
            dict(name="latency", n=24, size=4096, latency=0.005, bandwidth=0, batch=4,
                 step_s=0.002, workers=w, fetch_threads=4, cap=None),
            dict(name="bandwidth", n=8, size=64 << 10, latency=0.0, bandwidth=8e6, batch=2,
                 step_s=0.001, workers=w, fetch_threads=4, cap=8e6),
        ]
    else:
        scenarios = [
            # 640 x 32 KiB behind 20 ms per file; a 50 ms step of 32 samples
            # (640 samples/s of compute: 6.4x what 2 sequential workers can
            # fetch, so the cold epoch shows the fetch concurrency).
            dict(name="latency", n=640, size=32 << 10, latency=0.02, bandwidth=0, batch=32,
                 step_s=0.05, workers=w, fetch_threads=8, cap=None),
            # 96 x 1 MiB behind a 48 MB/s pipe; a short step: data-bound.
            dict(name="bandwidth", n=96, size=1 << 20, latency=0.001, bandwidth=48e6,
                 batch=4, step_s=0.001, workers=w, fetch_threads=8, cap=48e6),
        ]
    work = args.dir or tempfile.mkdtemp(prefix="cairn-bench-data-")
    result = {"num_workers": w, "runs": args.runs, "scenarios": {}}
    try:
        for sc in scenarios:
            make_source(os.path.join(work, f"src-{sc['name']}"), sc["n"], sc["size"])
            per_kind = {}
            for kind in ("stock", "cairn"):
                runs = [run_once(kind, sc, work, r) for r in range(args.runs)]
                per_kind[kind] = median_of(runs)
            s, c = per_kind["stock"], per_kind["cairn"]
            floor = statistics.median(floor_wait(sc) for _ in range(args.runs))
            summary = {
                "warm_wait_floor_in_memory": floor,
                "cold_speedup_vs_stock": c["cold"]["samples_per_s"] / s["cold"]["samples_per_s"],
                "warm_wait_fraction": c["warm"]["wait_fraction"],
                "warm_steady_wait_fraction": c["warm"]["steady_wait_fraction"],
                "fetched_over_dataset": (c["cold"]["fetched_bytes"] + c["warm"]["fetched_bytes"])
                / c["cold"]["dataset_bytes"],
            }
            if sc["cap"]:
                summary["cold_bytes_per_s_over_cap"] = c["cold"]["bytes_per_s"] / sc["cap"]
            result["scenarios"][sc["name"]] = {
                "config": {k: v for k, v in sc.items() if k != "name"},
                "stock": s,
                "cairn": c,
                "summary": summary,
            }
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
        shm = f"/dev/shm/cairn-throttle-bench-{os.getpid()}"
        if os.path.exists(shm):
            os.unlink(shm)

    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    for name, r in result["scenarios"].items():
        s, c, m = r["stock"], r["cairn"], r["summary"]
        print(
            f"# {name}: cold {c['cold']['samples_per_s']:.0f}/s vs stock "
            f"{s['cold']['samples_per_s']:.0f}/s ({m['cold_speedup_vs_stock']:.2f}x); "
            f"warm wait {100 * m['warm_wait_fraction']:.2f}% "
            f"(steady {100 * m['warm_steady_wait_fraction']:.2f}%, first batch "
            f"{1000 * c['warm']['first_batch_wait_s']:.1f} ms; in-memory floor "
            f"{100 * m['warm_wait_floor_in_memory']:.2f}%; stock "
            f"{100 * s['warm']['wait_fraction']:.1f}%); fetched/dataset "
            f"{m['fetched_over_dataset']:.3f}"
            + (f"; cold bw/cap {m['cold_bytes_per_s_over_cap']:.2f}"
               if "cold_bytes_per_s_over_cap" in m else ""),
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
