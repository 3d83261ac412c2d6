"""One peer's session, in its own process (run by bench/peers.py; one per rank
under torchrun for 2 ranks). Phases:

* ``save``: builds the reference state (the same on every rank, as under DDP),
  opens the adapter, then ``--reps`` + 1 saves (the first one reported apart),
  each timed: stall (``save`` returns), durable (``wait`` returns), and the peak
  extra memory of this process and every process it started (RssAnon) plus the
  peer's shared-memory files, sampled every 5 ms, over the baseline after the
  adapter was opened. Writes ``<out>.rank<R>.json``; with ``--kill`` it then
  SIGKILLs itself (every rank, after a barrier), as a crash would.
* ``restore``: a fresh process (the restart) opens the adapter on the same root,
  restores from the fastest tier the peer has (timed, checked bit for bit), then
  from disk after dropping the page cache (timed, checked), and closes.

The peer's helper processes inherit CAIRN_PEERS_RUN, so the harness can find
those left behind.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import peers  # noqa: E402


def _load_reference_state():
    """cairn/_reference_state.py, loaded by path: the module imports torch only, so a
    peer's session checkpoints cairn's benchmark state without importing cairn."""
    spec = importlib.util.spec_from_file_location(
        "cairn_reference_state", REPO / "python" / "cairn" / "_reference_state.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_state(size_mb: float, layers: int = 16, seed: int = 0) -> dict:
    """bench/checkpoint.py's reference state (cairn._measure.build_state), of
    `size_mb` MiB."""
    return _load_reference_state().build_state(size_mb * 2**20, layers=layers, seed=seed)


def like(obj):
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj).fill_(0)
    if isinstance(obj, dict):
        return {k: like(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [like(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(like(v) for v in obj)
    return obj


def leaves(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in leaves(v)]
    return []


def same(a, b) -> bool:
    ta, tb = leaves(a), leaves(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb))


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in leaves(state))


# ---------------------------------------------------------------- memory sampling

def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo and len(out) < 256:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def shm_bytes(paths: list[str]) -> int:
    total = 0
    for top in paths:
        if os.path.isfile(top):
            try:
                total += os.stat(top).st_blocks * 512
            except OSError:
                pass
            continue
        for base, _, files in os.walk(top):
            for name in files:
                try:
                    total += os.stat(os.path.join(base, name)).st_blocks * 512
                except OSError:
                    pass
    return total


class Sampler:
    """Peak of the RssAnon of this process tree + the peer's shm bytes, every 5 ms."""

    def __init__(self, shm):
        self.shm = shm
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def value(self) -> int:
        return sum(rss_anon(p) for p in tree(os.getpid())) + shm_bytes(self.shm())

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.value())

    def __enter__(self):
        self.peak = self.value()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.value())


def trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def max_over_ranks(x: float) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# ---------------------------------------------------------------- phases

def phase_save(args, cls, state, adapter=None) -> dict:
    t_open = time.perf_counter()
    adapter = adapter or cls(Path(args.root))
    open_s = time.perf_counter() - t_open
    barrier()
    trim()
    sampler_shm = lambda: [p for p in adapter.shm_dirs() if p != "/dev/shm"] or (
        [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if "ckpt_shm_" in n]
        if "/dev/shm" in adapter.shm_dirs() else [])
    base = Sampler(sampler_shm).value()
    saves = []
    for i in range(args.reps + 1):
        step = i + 1
        trim()
        barrier()
        with Sampler(sampler_shm) as s:
            t0 = time.perf_counter()
            adapter.save(step, state)
            t1 = time.perf_counter()
            adapter.wait()
            t2 = time.perf_counter()
        saves.append({"step": step, "stall_s": max_over_ranks(t1 - t0),
                      "durable_s": max_over_ranks(t2 - t0),
                      "extra_bytes": max_over_ranks(float(s.peak - base)),
                      "t0": t0, "t1": t1, "t2": t2})
    info = {"peer": cls.name, "version": cls.version, "patch": cls.patch,
            "fastest_tier": cls.fastest_tier, "open_s": open_s, "saves": saves,
            "shm_dirs": adapter.shm_dirs(), "bytes": nbytes(state)}
    return info, adapter


def phase_restore(args, cls, state, adapter=None) -> dict:
    t_open = time.perf_counter()
    adapter = adapter or cls(Path(args.root))
    open_s = time.perf_counter() - t_open
    dest = like(state)
    trim()
    barrier()
    t0 = time.perf_counter()
    tier = adapter.restore(dest)
    fast_s = max_over_ranks(time.perf_counter() - t0)
    ok_fast = same(dest, state)
    evidence = getattr(adapter, "evidence", None)
    disk_s, ok_disk, cold = None, True, False
    if getattr(cls, "has_disk_tier", True):
        dest = like(state)
        trim()
        barrier()
        cold = drop_caches()
        barrier()
        t0 = time.perf_counter()
        adapter.restore_disk(dest)
        disk_s = max_over_ranks(time.perf_counter() - t0)
        ok_disk = same(dest, state)
    adapter.close()
    return {"peer": cls.name, "open_s": open_s, "tier": tier, "restore_fast_s": fast_s,
            "restore_fast_ok": ok_fast, "restore_disk_s": disk_s, "restore_disk_ok": ok_disk,
            "cold": cold, "evidence": evidence,
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", required=True, choices=sorted(peers.ADAPTERS))
    # supervised: under a launcher that restarts the worker (dlrover-run): the first
    # start saves and SIGKILLs itself, the restart restores (TORCHELASTIC_RESTART_COUNT)
    # and writes <out>.restore.rank<R>.json.
    ap.add_argument("--phase", required=True, choices=["save", "restore", "supervised"])
    ap.add_argument("--size-mb", type=float, required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kill", action="store_true")
    args = ap.parse_args(argv)
    if args.phase == "supervised":
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        args.phase = "restore" if restarted else "save"
        args.kill = not restarted
        if restarted:
            args.out = f"{args.out}.restore"
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    cls = peers.load(args.peer)
    # DLRover's saver, forked when its checkpointer opens, did not open its sockets
    # within DLRover's 60 s when forked from a process already holding the 1.5 GB
    # state on this loaded machine (three tries); it is opened first, as a trainer
    # may (the figures do not depend on the order; the memory baseline is taken after
    # both).
    early = cls(Path(args.root)) if getattr(cls, "open_before_state", False) else None
    state = build_state(args.size_mb)
    if args.phase == "save":
        info, adapter = phase_save(args, cls, state, early)
    else:
        info, adapter = phase_restore(args, cls, state, early), None
    info["rank"] = rank
    info["world"] = dist.get_world_size() if dist.is_initialized() else 1
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(info))
    barrier()
    if args.kill:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if adapter is not None:
        adapter.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
