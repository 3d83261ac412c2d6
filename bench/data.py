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

Peers (issue 23), each skipped with a printed reason when it does not import
(the project venv has neither; ``scripts/bench_peers_setup.sh`` installs both
in ``.venv-peers``):

* torchdata: ``torchdata.stateful_dataloader.StatefulDataLoader`` over the
  stock loader's dataset, same shuffle, workers and batch size;
* streaming: MosaicML Streaming. The same samples written once by ``MDSWriter``
  (one sample = one file's bytes + its index; shards of ``--mds-shard-bytes``,
  Streaming's default 64 MiB unless set) into a "remote" directory;
  ``StreamingDataset(remote=that dir, local=a fresh cache, shuffle=True)`` in a
  ``StreamingDataLoader``. Its local-directory remote is copied by
  ``LocalDownloader._download_file_impl`` (``shutil.copy``); the benchmark
  replaces that one method so the copy reads the file through the same
  ``slow://`` throttle as the other loaders (same per-file latency, same
  node-wide bandwidth cap, shared by all processes), then writes it and renames
  it as Streaming does. Streaming therefore pays the latency once per shard
  file (and once for ``index.json``) where the others pay it once per sample
  file: that is its format, not a difference of the throttle.

Resume (``latency`` scenario; cairn, torchdata, streaming; the stock loader has
no state): a training process (``--child``) iterates epoch 0, saves the
loader's ``state_dict()`` after every step (pickle, atomic rename) and logs the
sample ids; the harness SIGKILLs its process group once half the epoch is
saved. A fresh process loads the state into a fresh loader (same cache
directory, as on a restarted node) and finishes the epoch. Reported: the time
from constructing the loader in the fresh process to its first batch, the time
from the harness starting that process to its first batch, and exactness: the
killed run's saved prefix + the resumed samples must equal an uninterrupted
run's order (nothing repeated, nothing skipped).

Cold-epoch throughput is reported over the whole epoch (worker start-up
included) and after the first batch (``steady_samples_per_s``). cairn's
DataLoader starts its workers from a forkserver by default (started when the
loader is constructed, torch preloaded), or forks them when the process has a
single thread at its first ``iter()`` (e.g. under ``OMP_NUM_THREADS=1``); the
others fork theirs; ``--cairn-mp fork`` (or ``forkserver``) forces one. The start
method each run's workers got is recorded (``start_methods``).

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
import pickle
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.utils.data

import cairn.data as cd
from cairn import _ext

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import _shm  # noqa: E402


def read_bytes(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def collate_sizes(batch):
    return batch


def collate_tensor(batch):
    """StreamingDataLoader counts the samples of a batch as ``len(batch)`` of a
    tensor or ``len(batch[0])`` otherwise, so its batches are tensors."""
    return torch.tensor(batch, dtype=torch.int64)


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
    first_n = 0
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
            first_n = len(batch)
        samples += len(batch)
        nbytes += sum(int(x) for x in batch)
        time.sleep(step_s)  # the training step
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "wait_s": waited, "first_wait_s": first, "samples": samples,
            "bytes": nbytes, "first_n": first_n}


def read_id(path: str) -> int:
    """cairn transform in resume mode: reads the file, yields its index."""
    with open(path, "rb") as f:
        f.read()
    return int(os.path.basename(path)[1:6])


class StockIdDataset(StockDataset):
    """Reads the file like StockDataset, yields its index (resume mode)."""

    def __getitem__(self, i: int) -> int:
        super().__getitem__(i)
        return i


# -- peers -----------------------------------------------------------------

def _peer_import(kind: str):
    """Returns (module, None) or (None, reason) for an optional peer."""
    try:
        if kind == "torchdata":
            import torchdata
            from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: F401

            return torchdata, None
        if kind == "streaming":
            import streaming

            return streaming, None
    except Exception as e:  # ImportError, or a broken install
        return None, f"{type(e).__name__}: {e}"
    raise ValueError(kind)


def peer_versions() -> dict:
    out = {"torch": torch.__version__}
    for kind in ("torchdata", "streaming"):
        mod, why = _peer_import(kind)
        out[kind] = getattr(mod, "__version__", "?") if mod else None
    return out


_SLOW = {"uri": None, "root": None, "reader": None, "pid": -1, "log": None}


def _throttled_local_download(self, remote: str, local: str, timeout: float) -> None:
    """Replaces streaming's LocalDownloader._download_file_impl (which is
    ``shutil.copy(remote, local + '.tmp'); os.rename``): the same, but the
    bytes come through the slow:// throttle every other loader reads through."""
    if _SLOW["pid"] != os.getpid():
        _SLOW["reader"] = _ext.SourceReader(_SLOW["uri"])
        _SLOW["pid"] = os.getpid()
    key = os.path.relpath(remote, _SLOW["root"])
    data = _SLOW["reader"].read(key)
    local_tmp = local + ".tmp"
    if os.path.exists(local_tmp):
        os.remove(local_tmp)
    with open(local_tmp, "wb") as f:
        f.write(data)
    os.rename(local_tmp, local)
    if _SLOW["log"]:
        with open(_SLOW["log"], "a") as f:  # O_APPEND: one line per copy
            f.write(f"{len(data)}\n")


def streaming_throttle(remote_root: str, uri: str, log: str | None) -> None:
    from streaming.base.storage import download

    _SLOW.update(uri=uri, root=remote_root, reader=None, pid=-1, log=log)
    download.LocalDownloader._download_file_impl = _throttled_local_download


def make_mds(src: str, remote: str, shard_bytes: int) -> None:
    from streaming import MDSWriter

    shutil.rmtree(remote, ignore_errors=True)
    keys, _ = _ext.list_source(src)
    with MDSWriter(out=remote, columns={"data": "bytes", "idx": "int"},
                   size_limit=shard_bytes) as w:
        for i, k in enumerate(keys):
            with open(os.path.join(src, k), "rb") as f:
                w.write({"data": f.read(), "idx": i})


def _streaming_dataset_cls(ids: bool):
    from streaming import StreamingDataset

    class BenchStreamingDataset(StreamingDataset):
        def __getitem__(self, i):
            s = super().__getitem__(i)
            return int(s["idx"]) if ids else len(s["data"])

    return BenchStreamingDataset


def build_loader(kind: str, sc: dict, work: str, seed: int, cache: str, ids: bool = False,
                 share: str | None = None):
    """Returns (loader, fetched_bytes()) for one kind; ``ids``: batches of
    sample indices instead of sizes (resume checks)."""
    src = os.path.join(work, f"src-{sc['name']}")
    share = share or f"bench-{os.getpid()}"  # the harness's: one throttle for all processes
    uri = f"slow://{src}?latency={sc['latency']}&bandwidth={sc['bandwidth']}&share={share}"
    keys, _ = _ext.list_source(src)
    if kind in ("stock", "torchdata"):
        ds = (StockIdDataset if ids else StockDataset)(uri, list(keys))
        g = torch.Generator()
        g.manual_seed(seed)
        if kind == "stock":
            cls = torch.utils.data.DataLoader
        else:
            from torchdata.stateful_dataloader import StatefulDataLoader as cls
        loader = cls(ds, batch_size=sc["batch"], shuffle=True, generator=g,
                     num_workers=sc["workers"], collate_fn=collate_sizes,
                     persistent_workers=sc["workers"] > 0)
        return loader, None  # every read goes to the source
    if kind == "cairn":
        ds = cd.CachedFileDataset(uri, cache_dir=cache, shuffle=True, seed=seed,
                                  transform=read_id if ids else read_bytes,
                                  fetch_threads=sc["fetch_threads"])
        extra = {"multiprocessing_context": sc["cairn_mp"]} if sc.get("cairn_mp") else {}
        loader = cd.DataLoader(ds, batch_size=sc["batch"], num_workers=sc["workers"],
                               collate_fn=collate_sizes, **extra)
        probe = cd.CachedFileDataset(src, cache_dir=cache)  # same cache, for counters
        return loader, lambda: probe.cache_stats()["shared_fetched_bytes"]
    if kind == "streaming":
        from streaming import StreamingDataLoader

        remote = os.path.join(work, f"mds-{sc['name']}")
        log = cache + ".fetched"
        streaming_throttle(remote, uri.replace(src, remote, 1), log)
        ds = _streaming_dataset_cls(ids)(remote=remote, local=cache, shuffle=True,
                                         shuffle_seed=seed, batch_size=sc["batch"])
        loader = StreamingDataLoader(ds, batch_size=sc["batch"], num_workers=sc["workers"],
                                     collate_fn=collate_tensor,
                                     persistent_workers=sc["workers"] > 0)

        def fetched():
            try:
                with open(log) as f:
                    return sum(int(x) for x in f.read().split())
            except FileNotFoundError:
                return 0

        return loader, fetched
    raise ValueError(kind)


def _clean_streaming_shm() -> None:
    try:
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
    except Exception:
        pass


def worker_start_method(loader) -> str:
    """How `loader`'s workers were started (no context: multiprocessing's default)."""
    import multiprocessing

    ctx = loader.multiprocessing_context
    return ctx.get_start_method() if ctx is not None else multiprocessing.get_start_method()


def run_once(kind: str, sc: dict, work: str, run: int) -> dict:
    src = os.path.join(work, f"src-{sc['name']}")
    keys, sizes = _ext.list_source(src)
    total = int(sum(sizes))
    epochs = []
    cache = os.path.join(work, f"cache-{kind}-{sc['name']}-{run}")
    shutil.rmtree(cache, ignore_errors=True)
    if os.path.exists(cache + ".fetched"):
        os.unlink(cache + ".fetched")
    if kind == "streaming":
        _clean_streaming_shm()
    loader, fetched = build_loader(kind, sc, work, run, cache)
    before = 0
    method = None
    for e in range(2):
        if kind == "cairn":
            loader.set_epoch(e)
        r = train_epoch(loader, sc["step_s"])
        if method is None and loader.num_workers > 0:
            # The start method the workers got (cairn's default chooses at the first
            # iter(): fork in a single-threaded process, else forkserver).
            method = worker_start_method(loader)
        if fetched is None:
            r["fetched_bytes"] = r["bytes"]
        else:
            now = fetched()
            r["fetched_bytes"] = now - before
            before = now
        epochs.append(r)
    del loader
    if kind == "streaming":
        _clean_streaming_shm()
    shutil.rmtree(cache, ignore_errors=True)
    if os.path.exists(cache + ".fetched"):
        os.unlink(cache + ".fetched")
    out = {"start_method": method}
    for name, r in zip(("cold", "warm"), epochs):
        out[name] = {
            "samples_per_s": r["samples"] / r["wall_s"],
            "bytes_per_s": r["bytes"] / r["wall_s"],
            "wait_fraction": r["wait_s"] / r["wall_s"],
            # Without the first batch (worker start / epoch restart latency).
            "steady_wait_fraction": (r["wait_s"] - r["first_wait_s"])
            / max(1e-9, r["wall_s"] - r["first_wait_s"]),
            # Throughput after the first batch: without worker start-up (fork for
            # stock/torchdata/streaming, cairn's forkserver) and the first fetch.
            "steady_samples_per_s": (r["samples"] - r["first_n"])
            / max(1e-9, r["wall_s"] - r["first_wait_s"]),
            "first_batch_wait_s": r["first_wait_s"],
            "wall_s": r["wall_s"],
            "fetched_bytes": r["fetched_bytes"],
            "dataset_bytes": total,
            "samples": r["samples"],
        }
    return out


# -- resume after SIGKILL ----------------------------------------------------

def child_main(args) -> int:
    """One training process of the resume check (``--child``): phase ``full``
    runs epoch 0 uninterrupted; ``first`` runs it saving the loader's state
    after every step until killed; ``resume`` loads the saved state and
    finishes the epoch. Sample ids go to ``--log``, one line per batch."""
    return train_phase(json.loads(args.child), args.log)


def train_phase(spec: dict, log_path: str) -> int:
    sc, kind, phase = spec["sc"], spec["kind"], spec["phase"]
    t_start = time.time()
    if kind == "streaming" and phase != "full":
        _clean_streaming_shm()  # what the killed run left (it cannot clean up)
    t0 = time.perf_counter()
    loader, _ = build_loader(kind, sc, spec["work"], spec["seed"], spec["cache"], ids=True,
                              share=spec["share"])
    consumed0 = 0
    if phase == "resume":
        with open(spec["state"], "rb") as f:
            saved = pickle.load(f)
        loader.load_state_dict(saved["loader"])
        consumed0 = saved["consumed"]
    it = iter(loader)
    first = None
    consumed = consumed0
    method = worker_start_method(loader) if loader.num_workers > 0 else None
    with open(log_path, "w") as log:
        for batch in it:
            if first is None:
                first = time.perf_counter() - t0
                log.write(json.dumps({"first_batch_s": first, "t_start": t_start,
                                      "t_first": time.time(), "start_method": method}) + "\n")
            log.write(" ".join(str(int(x)) for x in batch) + "\n")
            log.flush()
            consumed += len(batch)
            time.sleep(sc["step_s"])
            if phase == "first":
                tmp = spec["state"] + ".tmp"
                with open(tmp, "wb") as f:
                    pickle.dump({"loader": loader.state_dict(), "consumed": consumed}, f)
                os.replace(tmp, spec["state"])
            if kind == "cairn" and consumed >= len(loader.dataset):
                break
    del it, loader
    return 0


def _streaming_shm_of(tree: str, remove: bool) -> list[str]:
    """Streaming's /dev/shm entries (``NNNNNN_<name>``) whose ``NNNNNN_locals``
    names a cache directory under ``tree``; removed when ``remove``."""
    prefixes = set()
    for name in os.listdir("/dev/shm"):
        if name.endswith("_locals") and name[:6].isdigit():
            try:
                with open(os.path.join("/dev/shm", name), "rb") as f:
                    if tree.encode() in f.read(1 << 16):
                        prefixes.add(name[:6])
            except OSError:
                pass
    found = sorted(n for n in os.listdir("/dev/shm") if n[:6] in prefixes and n[6:7] == "_")
    if remove:
        for n in found:
            try:
                os.unlink(os.path.join("/dev/shm", n))
            except FileNotFoundError:
                pass
    return found


def _read_ids(log: str) -> tuple[dict, list[int]]:
    with open(log) as f:
        lines = f.read().splitlines()
    head = json.loads(lines[0]) if lines else {}
    ids = [int(x) for line in lines[1:] for x in line.split()]
    return head, ids


def _spawn_child(spec: dict, log: str) -> subprocess.Popen:
    err = open(log + ".stderr", "w")
    try:
        return subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec), "--log", log],
            start_new_session=True, stderr=err,
        )
    finally:
        err.close()


def _child_failed(kind: str, what: str, p: subprocess.Popen, log: str) -> RuntimeError:
    try:
        with open(log + ".stderr") as f:
            tail = f.read()[-3000:]
    except OSError:
        tail = ""
    return RuntimeError(f"{kind}: {what} (exit {p.returncode}); its stderr:\n{tail}")


def resume_check(kind: str, sc: dict, work: str, runs: int) -> dict:
    """Uninterrupted order once, then ``runs`` x (SIGKILL mid-epoch, resume)."""
    d = os.path.join(work, f"resume-{kind}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    n = sc["n"]
    base = dict(sc=sc, kind=kind, work=work, seed=7, share=f"bench-{os.getpid()}")
    full_log = os.path.join(d, "full.log")
    # The uninterrupted order, in this process (the order is the loader's, not the process's).
    train_phase(dict(base, phase="full", cache=os.path.join(d, "cache-full")), full_log)
    _, full = _read_ids(full_log)
    trials = []
    for r in range(runs):
        cache = os.path.join(d, f"cache-{r}")
        state = os.path.join(d, f"state-{r}.pkl")
        spec = dict(base, cache=cache, state=state)
        sems_before = _shm.sem_names()
        p = _spawn_child(dict(spec, phase="first"), os.path.join(d, f"first-{r}.log"))
        deadline = time.monotonic() + 600
        killed_at = None
        while time.monotonic() < deadline and p.poll() is None:
            try:
                with open(state, "rb") as f:
                    c = pickle.load(f)["consumed"]
            except (FileNotFoundError, EOFError, pickle.UnpicklingError):
                c = 0
            if c >= n // 2:
                os.killpg(p.pid, signal.SIGKILL)
                killed_at = c
                break
            time.sleep(0.005)
        p.wait()
        if killed_at is None:
            raise _child_failed(kind, "the first run ended before the kill", p,
                                os.path.join(d, f"first-{r}.log"))
        time.sleep(0.5)  # let the killed workers notice (a restarted node has none)
        with open(state, "rb") as f:
            consumed = pickle.load(f)["consumed"]
        _, killed_ids = _read_ids(os.path.join(d, f"first-{r}.log"))
        rlog = os.path.join(d, f"resume-{r}.log")
        t_spawn = time.time()
        p = _spawn_child(dict(spec, phase="resume"), rlog)
        if p.wait(timeout=600) != 0:
            raise _child_failed(kind, "resume failed", p, rlog)
        head, resumed = _read_ids(rlog)
        # What the kill + resume left in /dev/shm (Streaming: its shared state of the
        # killed run); removed here, a restarted node would have to do the same.
        left = _streaming_shm_of(d, remove=True) if kind == "streaming" else []
        # Named semaphores of the killed run's forkserver queues (cairn's default when
        # the trainer has threads): killing its whole process group killed the resource
        # tracker that unlinks them (killing the trainer alone leaves none:
        # tests/python/test_data_loader.py). Removed, as a restarted node would.
        sems = _shm.remove_leaked_sems(sems_before)
        prefix_ok = killed_ids[:consumed] == full[:consumed]
        exact = prefix_ok and killed_ids[:consumed] + resumed == full
        repeated = len(killed_ids[:consumed] + resumed) - len(set(killed_ids[:consumed] + resumed))
        skipped = len(set(full) - set(killed_ids[:consumed] + resumed))
        trials.append({
            "killed_after_samples": consumed,
            "resume_to_first_batch_s": head.get("first_batch_s", float("nan")),
            "restart_to_first_batch_s": head.get("t_first", float("nan")) - t_spawn,
            "exact": bool(exact),
            "repeated": repeated,
            "skipped": skipped,
            "resumed_samples": len(resumed),
            "dev_shm_left": len(left),
            "named_semaphores_left": len(sems),
            "start_method": head.get("start_method"),
        })
        shutil.rmtree(cache, ignore_errors=True)
    if kind == "streaming":
        _clean_streaming_shm()
    shutil.rmtree(d, ignore_errors=True)
    return {
        "resume_to_first_batch_s": statistics.median(t["resume_to_first_batch_s"] for t in trials),
        "restart_to_first_batch_s": statistics.median(t["restart_to_first_batch_s"] for t in trials),
        "exact_runs": sum(t["exact"] for t in trials),
        "runs": len(trials),
        "start_methods": [t["start_method"] for t in trials],
        "uninterrupted_samples": len(full),
        "trials": trials,
    }


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
    out = {"start_methods": [r.get("start_method") for r in runs]}
    for epoch in ("cold", "warm"):
        out[epoch] = {k: statistics.median(r[epoch][k] for r in runs) for k in runs[0][epoch]}
    return out


KINDS = ("stock", "cairn", "torchdata", "streaming")
RESUMABLE = ("cairn", "torchdata", "streaming")


def chart(result: dict, path: str) -> str | None:
    """Bars per loader for each figure; returns why not when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return f"no chart: matplotlib does not import ({type(e).__name__}: {e})"
    kinds = [k for k in KINDS if k in result["kinds"]]
    colors = {"stock": "#999999", "cairn": "#1f77b4", "torchdata": "#ff7f0e",
              "streaming": "#2ca02c"}
    panels = []
    for name, sc in result["scenarios"].items():
        panels.append((f"{name}: cold epoch, samples/s", {k: sc[k]["cold"]["samples_per_s"]
                                                          for k in kinds}, None))
        panels.append((f"{name}: cold epoch after its 1st batch, samples/s",
                       {k: sc[k]["cold"]["steady_samples_per_s"] for k in kinds}, None))
        panels.append((f"{name}: warm epoch, data wait % of step time",
                       {k: 100 * sc[k]["warm"]["wait_fraction"] for k in kinds},
                       100 * sc["summary"]["warm_wait_floor_in_memory"]))
    res = result.get("resume", {})
    rk = [k for k in RESUMABLE if k in res]
    if rk:
        panels.append(("resume after SIGKILL: loader to first batch, s",
                       {k: res[k]["resume_to_first_batch_s"] for k in rk}, None))
        panels.append(("resume: process start to first batch, s",
                       {k: res[k]["restart_to_first_batch_s"] for k in rk}, None))
    cols = (len(panels) + 1) // 2
    fig, axes = plt.subplots(2, cols, figsize=(3.6 * cols, 6.4))
    axes = list(axes.flat)
    for ax in axes[len(panels):]:
        ax.axis("off")
    for ax, (title, vals, floor) in zip(axes, panels):
        names = list(vals)
        ax.bar(names, [vals[k] for k in names], color=[colors[k] for k in names])
        if floor is not None:
            ax.axhline(floor, ls="--", color="k", lw=1, label="in-memory floor")
            ax.legend(fontsize=7)
        ax.set_title(title, fontsize=8)
        ax.tick_params(labelsize=7)
        if "resume" in title:
            for i, k in enumerate(names):
                ex = f"{res[k]['exact_runs']}/{res[k]['runs']} exact"
                ax.text(i, vals[k], ex, ha="center", va="bottom", fontsize=6)
    fig.suptitle(f"bench/data.py: num_workers={result['num_workers']}, medians of "
                 f"{result['runs']}; " + ", ".join(f"{k} {v}" for k, v in
                                                  result["versions"].items() if v), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the JSON here too (and a PNG beside it)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help="loaders to run (default: all; a peer that does not import is "
                         "skipped with the reason)")
    ap.add_argument("--no-resume", action="store_true", help="skip the SIGKILL/resume check")
    ap.add_argument("--mds-shard-bytes", type=int, default=1 << 26,
                    help="MDSWriter size_limit (default: Streaming's own, 64 MiB)")
    ap.add_argument("--cairn-mp", default=None,
                    help="cairn's multiprocessing_context (default: its own choice, fork "
                         "in a single-threaded process, else forkserver)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--log", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child_main(args)

    kinds, skipped = [], {}
    for k in args.kinds.split(","):
        if k in ("torchdata", "streaming"):
            mod, why = _peer_import(k)
            if mod is None:
                skipped[k] = f"not installed here ({why}); scripts/bench_peers_setup.sh"
                print(f"# skipping {k}: {skipped[k]}", file=sys.stderr)
                continue
        elif k not in KINDS:
            ap.error(f"unknown loader {k!r}")
        kinds.append(k)

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
    for sc in scenarios:
        sc["cairn_mp"] = args.cairn_mp
    work = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="cairn-bench-data-"))
    os.makedirs(work, exist_ok=True)
    result = {"num_workers": w, "runs": args.runs, "kinds": kinds, "skipped": skipped,
              "versions": peer_versions(), "mds_shard_bytes": args.mds_shard_bytes,
              "loadavg_before": os.getloadavg()[0], "scenarios": {}}
    if "cairn" in kinds:
        result["versions"]["cairn"] = getattr(sys.modules["cairn"], "__version__", "?")
    try:
        for sc in scenarios:
            src = os.path.join(work, f"src-{sc['name']}")
            make_source(src, sc["n"], sc["size"])
            if "streaming" in kinds:
                make_mds(src, os.path.join(work, f"mds-{sc['name']}"), args.mds_shard_bytes)
            per_kind = {}
            # Repetitions are the outer loop: background load hits every loader alike.
            all_runs = {k: [] for k in kinds}
            for r in range(args.runs):
                for kind in kinds:
                    all_runs[kind].append(run_once(kind, sc, work, r))
            for kind in kinds:
                per_kind[kind] = median_of(all_runs[kind])
            if "stock" not in per_kind or "cairn" not in per_kind:
                result["scenarios"][sc["name"]] = {
                    "config": {k: v for k, v in sc.items() if k != "name"}, **per_kind,
                    "summary": {"warm_wait_floor_in_memory": floor_wait(sc)}}
                continue
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
            for peer in ("torchdata", "streaming"):
                if peer in per_kind:
                    p = per_kind[peer]
                    summary[f"cold_vs_{peer}"] = (c["cold"]["samples_per_s"]
                                                  / p["cold"]["samples_per_s"])
                    summary[f"{peer}_fetched_over_dataset"] = (
                        (p["cold"]["fetched_bytes"] + p["warm"]["fetched_bytes"])
                        / c["cold"]["dataset_bytes"])
            result["scenarios"][sc["name"]] = {
                "config": {k: v for k, v in sc.items() if k != "name"},
                **per_kind,
                "summary": summary,
            }
        if not args.no_resume:
            sc = dict(scenarios[0])  # latency-bound
            if args.tiny:
                sc["workers"] = 0  # smoke: no worker start-up in each of the processes
            result["resume"] = {"scenario": sc["name"],
                                "stock": "no state_dict: not resumable mid-epoch"}
            for kind in kinds:
                if kind in RESUMABLE:
                    result["resume"][kind] = resume_check(kind, sc, work, args.runs)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
        shm = f"/dev/shm/cairn-throttle-bench-{os.getpid()}"
        if os.path.exists(shm):
            os.unlink(shm)
        if "streaming" in kinds:
            _clean_streaming_shm()

    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        why = chart(result, os.path.splitext(args.out)[0] + ".png")
        print(f"# {why}" if why else f"# chart: {os.path.splitext(args.out)[0]}.png",
              file=sys.stderr)
    print(text)
    for name, r in result["scenarios"].items():
        for k in kinds:
            print(f"# {name} {k} ({','.join(str(m) for m in r[k]['start_methods'])}): "
                  f"cold {r[k]['cold']['samples_per_s']:.0f}/s (after the 1st "
                  f"batch {r[k]['cold']['steady_samples_per_s']:.0f}/s), warm wait "
                  f"{100 * r[k]['warm']['wait_fraction']:.2f}%, fetched "
                  f"{r[k]['cold']['fetched_bytes'] + r[k]['warm']['fetched_bytes']} of "
                  f"{r[k]['cold']['dataset_bytes']}", file=sys.stderr)
        if "stock" not in r or "cairn" not in r:
            continue
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
    for k, v in result.get("resume", {}).items():
        if isinstance(v, dict):
            print(f"# resume {k}: loader->first batch {v['resume_to_first_batch_s']:.3f} s, "
                  f"process->first batch {v['restart_to_first_batch_s']:.3f} s, exact "
                  f"{v['exact_runs']}/{v['runs']}, workers started by "
                  f"{','.join(str(m) for m in v['start_methods'])}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
