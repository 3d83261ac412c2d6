#!/usr/bin/env python3
"""Checkpoint save/load benchmark: cairn vs torch.save and DCP's filesystem backend.

Run from the repository root::

    .venv/bin/python bench/checkpoint.py                 # reference state, >= 1.5 GB
    .venv/bin/python bench/checkpoint.py --size-gb 0.3   # smoke run

It builds one reference state (a GPT-like stack of linear weights plus Adam's
exp_avg / exp_avg_sq, ~200 CPU tensors) and, in the same run, on the same disk:

* floors: memcpy bandwidth into a pre-faulted buffer, and the disk's direct-I/O
  (O_DIRECT) write and read bandwidth on a file as large as the state;
* peers: for each of torch.save/torch.load, dcp.save/dcp.load with DCP's
  FileSystemWriter/Reader, and dcp.save/dcp.load with cairn.Writer/Reader, the
  time of a synchronous save until it is durable (fsync'd) and of a load into
  the state (cold: after ``sync; echo 3 > /proc/sys/vm/drop_caches`` when
  permitted).

Every figure is the median of ``--reps`` repetitions. It prints a table with the
ratios SPEC §4 judges (cairn/dcp save and load time, cairn save bandwidth /
direct-I/O write bandwidth) and writes JSON (default bench/results/checkpoint.json).

Layout for later rows: a floor is a function ``(ctx) -> (seconds, bytes)`` in
FLOORS, a peer is a ``Peer`` with one function per operation in PEERS; each
function times one repetition itself, so new operations (async-save stall,
memory-tier restore, RSS) are new Peer fields and rows, not new loops.
Repetitions are the outer loop (every floor and peer once per repetition).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
import cairn  # noqa: E402

GB = 1e9
ALIGN = 4096

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


# --------------------------------------------------------------------------- state


def build_state(size_gb: float, layers: int = 16, seed: int = 0) -> dict:
    """A GPT-like model + Adam state totalling ~size_gb, as nested state dicts.

    Per layer: qkv (d x 3d), proj (d x d), fc1 (4d x d), fc2 (d x 4d) weights;
    plus an embedding and an output head (4d x d each). Each parameter has
    exp_avg and exp_avg_sq of its shape, so 3 x 66 = 198 tensors (+ 66 step
    scalars). float32 throughout.
    """
    # elements: layers * 12 d^2 + 8 d^2, times 3 (param + 2 moments), 4 bytes each
    per_d2 = (layers * 12 + 8) * 3 * 4
    d = max(8, math.ceil((size_gb * GB / per_d2) ** 0.5 / 8) * 8)  # >= size_gb
    shapes = {"embed.weight": (4 * d, d), "head.weight": (4 * d, d)}
    for i in range(layers):
        shapes[f"layers.{i}.attn.qkv.weight"] = (3 * d, d)
        shapes[f"layers.{i}.attn.proj.weight"] = (d, d)
        shapes[f"layers.{i}.mlp.fc1.weight"] = (4 * d, d)
        shapes[f"layers.{i}.mlp.fc2.weight"] = (d, 4 * d)
    g = torch.Generator().manual_seed(seed)
    model, state = {}, {}
    for name, shape in shapes.items():
        model[name] = torch.randn(shape, generator=g)
        state[name] = {
            "step": torch.tensor(100.0),
            "exp_avg": torch.randn(shape, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(shape, generator=g) * 1e-6,
        }
    optim = {
        "state": state,
        "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": list(shapes)}],
    }
    return {"model": model, "optim": optim}


def tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []


def like(obj):
    """Same structure, every tensor replaced by a pre-faulted zero tensor."""
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj).fill_(0)
    if isinstance(obj, dict):
        return {k: like(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [like(v) for v in obj]
    return obj


def same(a, b) -> bool:
    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb))


# --------------------------------------------------------------------------- context


@dataclasses.dataclass
class Context:
    state: dict
    nbytes: int
    ntensors: int
    scratch: Path
    reps: int
    drop_caches: bool
    dropped: bool = False  # whether a cache drop actually succeeded
    counter: int = 0

    def fresh_path(self, name: str) -> Path:
        self.counter += 1
        return self.scratch / f"{name}-{self.counter}"

    def cold(self) -> None:
        """Makes the next read cold: flush dirty pages, drop the page cache."""
        os.sync()
        if not self.drop_caches:
            return
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            self.dropped = True
        except OSError:
            self.drop_caches = False  # not permitted: reads are warm; reported


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclasses.dataclass
class Sample:
    """Repeated timings of one operation moving ``nbytes``."""

    seconds: list[float]
    nbytes: int

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.median / GB

    def as_json(self) -> dict:
        return {
            "median_s": self.median,
            "seconds": self.seconds,
            "bytes": self.nbytes,
            "GBps": self.gbps,
        }


# --------------------------------------------------------------------------- floors


def _aligned_buffer(size: int) -> mmap.mmap:
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    chunk = os.urandom(1 << 20)
    for off in range(0, size, len(chunk)):
        buf[off : off + len(chunk)] = chunk[: size - off]
    return buf


DIRECT_CHUNK = 16 << 20


def floor_memcpy(ctx: Context) -> tuple[float, int]:
    """One copy of min(state, 1 GiB) bytes into a pre-faulted buffer."""
    n = min(ctx.nbytes, 1 << 30)
    src = torch.empty(n, dtype=torch.uint8).random_()
    dst = torch.empty(n, dtype=torch.uint8).fill_(0)  # pre-faulted
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0, n


def _direct_file(ctx: Context) -> tuple[Path, int]:
    n = (ctx.nbytes + DIRECT_CHUNK - 1) // DIRECT_CHUNK * DIRECT_CHUNK
    return ctx.scratch / "direct-io.bin", n


def floor_direct_write(ctx: Context) -> tuple[float, int]:
    """O_DIRECT sequential writes of 16 MiB from an aligned buffer, then fsync;
    as many bytes as the state (rounded up to 16 MiB)."""
    path, n = _direct_file(ctx)
    buf = _aligned_buffer(DIRECT_CHUNK)
    remove(path)
    os.sync()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for off in range(0, n, DIRECT_CHUNK):
            if os.pwrite(fd, buf, off) != DIRECT_CHUNK:
                raise OSError("short direct write")
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)
    seconds = time.perf_counter() - t0
    buf.close()
    return seconds, n


def floor_direct_read(ctx: Context) -> tuple[float, int]:
    """O_DIRECT sequential reads of 16 MiB into an aligned buffer, cold, of the
    file the write floor just wrote (then removed)."""
    path, n = _direct_file(ctx)
    buf = _aligned_buffer(DIRECT_CHUNK)
    ctx.cold()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for off in range(0, n, DIRECT_CHUNK):
            if os.preadv(fd, [buf], off) != DIRECT_CHUNK:
                raise OSError("short direct read")
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    buf.close()
    remove(path)
    return seconds, n


# Each floor runs once per repetition and returns (seconds, bytes moved).
FLOORS: dict[str, Callable[[Context], tuple[float, int]]] = {
    "memcpy": floor_memcpy,
    "direct-I/O write": floor_direct_write,
    "direct-I/O read": floor_direct_read,
}


# --------------------------------------------------------------------------- peers
#
# A save function writes ctx.state to a fresh path until it is durable and
# returns (seconds, path); a load function reads that path into memory (cold)
# and returns (seconds, loaded state).


def torch_save(ctx: Context) -> tuple[float, Path]:
    path = ctx.fresh_path("torch").with_suffix(".pt")
    os.sync()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(ctx.state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)
    return time.perf_counter() - t0, path


def torch_load(ctx: Context, path: Path) -> tuple[float, dict]:
    ctx.cold()
    t0 = time.perf_counter()
    out = torch.load(path, map_location="cpu", weights_only=True)
    return time.perf_counter() - t0, out


def dcp_save(ctx: Context) -> tuple[float, Path]:
    path = ctx.fresh_path("dcp")
    os.sync()
    t0 = time.perf_counter()
    dcp.save(ctx.state, storage_writer=dcp.FileSystemWriter(str(path)))
    return time.perf_counter() - t0, path


def dcp_load(ctx: Context, path: Path) -> tuple[float, dict]:
    dest = like(ctx.state)
    ctx.cold()
    t0 = time.perf_counter()
    dcp.load(dest, storage_reader=dcp.FileSystemReader(str(path)))
    return time.perf_counter() - t0, dest


def cairn_save(ctx: Context) -> tuple[float, Path]:
    path = ctx.fresh_path("cairn")
    os.sync()
    t0 = time.perf_counter()
    dcp.save(ctx.state, storage_writer=cairn.Writer(str(path)))
    return time.perf_counter() - t0, path


def cairn_load(ctx: Context, path: Path) -> tuple[float, dict]:
    dest = like(ctx.state)
    ctx.cold()
    t0 = time.perf_counter()
    dcp.load(dest, storage_reader=cairn.Reader(str(path)))
    return time.perf_counter() - t0, dest


def stock_cairn_load(ctx: Context, path: Path) -> tuple[float, dict]:
    """cairn.Reader on a checkpoint written by stock dcp.save (the migration path:
    cairn._stock.StockReader, CRC-checked, no unsafe unpickling)."""
    dest = like(ctx.state)
    ctx.cold()
    t0 = time.perf_counter()
    dcp.load(dest, storage_reader=cairn.Reader(str(path)))
    return time.perf_counter() - t0, dest


@dataclasses.dataclass
class Peer:
    save: Callable[[Context], tuple[float, Path]]
    load: Callable[[Context, Path], tuple[float, dict]]


PEERS: dict[str, Peer] = {
    "torch.save": Peer(torch_save, torch_load),
    "dcp": Peer(dcp_save, dcp_load),
    "cairn": Peer(cairn_save, cairn_load),
    # Not run by default (--peers ...,stock->cairn): loading stock checkpoints.
    "stock->cairn": Peer(dcp_save, stock_cairn_load),
}
DEFAULT_PEERS = ["torch.save", "dcp", "cairn"]


def run_peer_once(ctx: Context, name: str, peer: Peer, check: bool) -> tuple[float, float]:
    """One save (durable) + one cold load; returns their seconds."""
    save_s, path = peer.save(ctx)
    load_s, loaded = peer.load(ctx, path)
    if check and not same(loaded, ctx.state):
        raise RuntimeError(f"{name}: the state loaded from {path} differs from the saved one")
    del loaded
    remove(path)
    return save_s, load_s


def run_all(ctx: Context, peer_names: list[str]):
    """Repetitions are the outer loop, so a burst of background load on a shared
    machine hits every floor and peer alike rather than one peer's reps."""
    floors: dict[str, Sample] = {}
    peers: dict[str, dict[str, Sample]] = {}
    for rep in range(ctx.reps):
        print(f"rep {rep + 1}/{ctx.reps}:", end="", flush=True)
        for name, fn in FLOORS.items():
            seconds, n = fn(ctx)
            floors.setdefault(name, Sample([], n)).seconds.append(seconds)
            print(f" {name} {seconds:.2f}s", end="", flush=True)
        for name in peer_names:
            save_s, load_s = run_peer_once(ctx, name, PEERS[name], check=rep == 0)
            ops = peers.setdefault(
                name, {"save": Sample([], ctx.nbytes), "load": Sample([], ctx.nbytes)}
            )
            ops["save"].seconds.append(save_s)
            ops["load"].seconds.append(load_s)
            print(f" | {name} save {save_s:.2f}s load {load_s:.2f}s", end="", flush=True)
        print(flush=True)
    return floors, peers


# --------------------------------------------------------------------------- report


def fs_type(path: Path) -> str:
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, parts[2]
    return kind


def ratios(floors: dict[str, Sample], peers: dict[str, dict[str, Sample]]) -> dict:
    out = {}
    if "cairn" in peers and "dcp" in peers:
        out["cairn_save_time / dcp_save_time"] = {
            "value": peers["cairn"]["save"].median / peers["dcp"]["save"].median,
            "target": "<= 0.5",
            "met": peers["cairn"]["save"].median <= 0.5 * peers["dcp"]["save"].median,
        }
        out["cairn_load_time / dcp_load_time"] = {
            "value": peers["cairn"]["load"].median / peers["dcp"]["load"].median,
            "target": "<= 0.5",
            "met": peers["cairn"]["load"].median <= 0.5 * peers["dcp"]["load"].median,
        }
    if "cairn" in peers and "direct-I/O write" in floors:
        v = peers["cairn"]["save"].gbps / floors["direct-I/O write"].gbps
        out["cairn_save_bw / direct_write_bw"] = {"value": v, "target": ">= 0.8", "met": v >= 0.8}
    if "cairn" in peers and "direct-I/O read" in floors:
        v = peers["cairn"]["load"].gbps / floors["direct-I/O read"].gbps
        out["cairn_load_bw / direct_read_bw"] = {"value": v, "target": "(info)", "met": None}
    if "stock->cairn" in peers and "dcp" in peers:
        v = peers["stock->cairn"]["load"].median / peers["dcp"]["load"].median
        out["stock_ckpt_cairn_load_time / dcp_load_time"] = {
            "value": v,
            "target": "(info)",
            "met": None,
        }
    return out


def print_report(ctx: Context, meta: dict, floors, peers, rat) -> None:
    print()
    print(
        f"state {ctx.nbytes / GB:.2f} GB in {ctx.ntensors} tensors; scratch "
        f"{ctx.scratch} ({meta['scratch_fs']}); {ctx.reps} reps (medians); "
        f"cold reads: {'yes (page cache dropped)' if ctx.dropped else 'NO (warm cache)'}; "
        f"{meta['cpus']} CPUs, torch threads {meta['torch_threads']}, load average "
        f"{meta['loadavg_before'][0]:.1f} before / {meta['loadavg_after'][0]:.1f} after"
    )
    print(f"{'floor':<22}{'median s':>10}{'GB/s':>9}")
    for name, s in floors.items():
        print(f"{name:<22}{s.median:>10.3f}{s.gbps:>9.2f}")
    print()
    print(f"{'peer':<12}{'save s':>9}{'GB/s':>8}{'load s':>9}{'GB/s':>8}")
    for name, ops in peers.items():
        sv, ld = ops["save"], ops["load"]
        print(f"{name:<12}{sv.median:>9.3f}{sv.gbps:>8.2f}{ld.median:>9.3f}{ld.gbps:>8.2f}")
    print()
    for name, r in rat.items():
        met = "" if r["met"] is None else ("  met" if r["met"] else "  NOT met")
        print(f"{name:<44}{r['value']:>7.2f}   target {r['target']}{met}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.5, help="state size (default 1.5)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per figure")
    ap.add_argument(
        "--dir",
        default=str(REPO / "bench" / "results"),
        help="parent of the scratch directory (must be on the disk to measure)",
    )
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "checkpoint.json"))
    ap.add_argument(
        "--peers",
        default=",".join(DEFAULT_PEERS),
        help=f"comma-separated, from {list(PEERS)} (default: %(default)s)",
    )
    ap.add_argument(
        "--torch-threads",
        type=int,
        help="torch intra-op threads (default: torch's). On a machine whose cores "
        "are busy with other work, 1 avoids OpenMP spin-waits that slow every "
        "Tensor.copy_ (and so torch.load and dcp.load) several-fold",
    )
    ap.add_argument("--no-drop-caches", action="store_true")
    ap.add_argument("--allow-tmpfs", action="store_true", help="allow a RAM-backed scratch")
    args = ap.parse_args(argv)

    unknown = set(args.peers.split(",")) - set(PEERS)
    if unknown:
        ap.error(f"unknown peers {sorted(unknown)}; choose from {list(PEERS)}")
    parent = Path(args.dir)
    parent.mkdir(parents=True, exist_ok=True)
    kind = fs_type(parent)
    if kind in ("tmpfs", "ramfs") and not args.allow_tmpfs:
        ap.error(f"{parent} is on {kind}, not a disk; pass --dir on a real disk")

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    t_start = time.perf_counter()
    state = build_state(args.size_gb)
    ts = tensors(state)
    scratch = Path(tempfile.mkdtemp(prefix="cairn-bench-", dir=parent))
    ctx = Context(
        state=state,
        nbytes=sum(t.numel() * t.element_size() for t in ts),
        ntensors=len(ts),
        scratch=scratch,
        reps=args.reps,
        drop_caches=not args.no_drop_caches,
    )
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_before": os.getloadavg(),
        "scratch_fs": kind,
        "state_bytes": ctx.nbytes,
        "state_tensors": ctx.ntensors,
        "reps": ctx.reps,
    }
    print(f"state: {ctx.nbytes / GB:.2f} GB in {ctx.ntensors} tensors; scratch {scratch}")
    try:
        floors, peers = run_all(ctx, args.peers.split(","))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    rat = ratios(floors, peers)
    meta["cold_reads"] = ctx.dropped
    meta["loadavg_after"] = os.getloadavg()
    meta["wall_s"] = time.perf_counter() - t_start
    print_report(ctx, meta, floors, peers, rat)
    result = {
        "meta": meta,
        "floors": {k: v.as_json() for k, v in floors.items()},
        "peers": {p: {op: s.as_json() for op, s in ops.items()} for p, ops in peers.items()},
        "ratios": rat,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
