"""Quick checkpoint benchmark of your own storage: floors, save, load, stall.

    python -m cairn.bench PATH [--size-gb 0.5] [--reps 3] [--json]
    cairn bench PATH ...          (the C++ CLI runs this module with the first Python that can
                                  import cairn: $CAIRN_PYTHON, the venv's, the one it was built
                                  for, PATH's; tools/cairn_cli.cc)

A short version of ``bench/checkpoint.py`` (the same measuring code,
``cairn._measure``) that runs on PATH, where your checkpoints would go (a
directory, ``file://``, ``shm://`` or ``s3://``). In a scratch directory below
PATH, removed at the end, it measures with a GPT-like model + Adam state of
``--size-gb``, medians of ``--reps``:

* floors: the copy floor (the faster of memcpy and ``Tensor.copy_`` of the same
  bytes into pre-faulted memory) and, for a local directory, the disk's O_DIRECT
  write and parallel O_DIRECT read bandwidth;
* save: ``dcp.save`` with ``cairn.Writer`` until durable;
* load: ``dcp.load`` with ``cairn.Reader`` (cold when the page cache can be
  dropped, i.e. as root);
* stall (local directories): ``CheckpointManager.save``'s blocking time, the first
  save apart, and the restore from the memory tier;

and prints a table with each figure against its target (SPEC §4). Progress goes to
stderr. Exit 0, or 1 when a measurement failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import types
import uuid
import warnings
from pathlib import Path

_TARGETS = {
    "save / direct write": (">= 0.8", lambda v: v >= 0.8),
    "load / parallel direct read": (">= 0.85", lambda v: v >= 0.85),
    "stall / copy floor": ("<= 1.25", lambda v: v <= 1.25),
    "first stall / steady stall": ("<= 2", lambda v: v <= 2),
    "memory restore / copy floor": ("<= 1.25", lambda v: v <= 1.25),
}


def _progress(msg: str) -> None:
    print(f"cairn bench: {msg}", file=sys.stderr, flush=True)


def _local_dir(path: str) -> Path | None:
    """The disk directory a plain or file:// path names (the engine parses it); None
    for shm:// (node memory, measured by the manager's memory tier) and s3://."""
    from cairn import _ext

    local = _ext.local_dir_of_uri(path)
    return Path(local) if local and not path.startswith("shm://") else None


def run(path: str, size_gb: float = 0.5, reps: int = 3, layers: int = 16) -> dict:
    """Measures (see the module docstring); returns {"meta", "figures", "ratios"}."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    import torch
    import torch.distributed.checkpoint as dcp

    import cairn
    from cairn import _ext, _measure as m

    local = _local_dir(path)
    if local is not None:
        local.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="cairn-bench-", dir=local))
        target = str(scratch)
    else:
        scratch = None
        prefix = f"cairn-bench-{uuid.uuid4().hex[:12]}"
        target = path.rstrip("/") + "/" + prefix
    load_before = os.getloadavg()
    _progress(f"building a {size_gb:g} GB state")
    state = m.build_state(size_gb, layers=layers)
    ts = m.tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    # What the floors of cairn._measure need.
    ctx = types.SimpleNamespace(state=state, nbytes=nbytes, scratch=scratch, drop_caches=True,
                                dropped=False)
    samples: dict[str, m.Sample] = {}

    def add(name: str, seconds: float, n: int = nbytes) -> None:
        samples.setdefault(name, m.Sample([], n)).seconds.append(seconds)

    floors = [("memcpy", m.floor_memcpy), ("Tensor.copy_", m.floor_tensor_copy)]
    mgr = None
    first_stall = None
    try:
        if scratch is not None:
            mgr = cairn.CheckpointManager(scratch / "manager", memory=True, keep=1)
            # As a run starts: restore() (nothing here) pre-faults the first save's
            # shared memory in the background; wait() stands for the first steps.
            mgr.restore(state)
            mgr.wait()
            _progress("first manager save")
            t0 = time.perf_counter()
            mgr.save(0, state)
            first_stall = time.perf_counter() - t0
            mgr.wait()
        for rep in range(reps):
            for name, fn in floors:
                _progress(f"rep {rep + 1}/{reps}: floor {name}")
                seconds, n = fn(ctx)
                add(name, seconds, n)
            if scratch is not None:
                _progress(f"rep {rep + 1}/{reps}: floors direct write, parallel direct read")
                (write_s, n), (read_s, _) = m.floor_direct_io(ctx)
                add("direct write", write_s, n)
                add("parallel direct read", read_s, n)
            _progress(f"rep {rep + 1}/{reps}: save")
            uri = f"{target}/ckpt"
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=cairn.Writer(uri))
            add("save", time.perf_counter() - t0)
            _progress(f"rep {rep + 1}/{reps}: load")
            dest = m.like(state)
            ctx.dropped = _ext.drop_caches() or ctx.dropped  # a cold load where permitted
            t0 = time.perf_counter()
            dcp.load(dest, storage_reader=cairn.Reader(uri))
            add("load", time.perf_counter() - t0)
            if rep == 0 and not m.same(dest, state):
                raise RuntimeError(f"the state loaded from {uri} differs from the saved one")
            del dest
            if mgr is not None:
                _progress(f"rep {rep + 1}/{reps}: manager save and memory restore")
                m.trim()
                t0 = time.perf_counter()
                mgr.save(rep + 1, state)
                add("stall", time.perf_counter() - t0)
                mgr.wait()
                dest = m.like(state)
                t0 = time.perf_counter()
                step = mgr.restore(dest)
                add("memory restore", time.perf_counter() - t0)
                if step != rep + 1 or mgr.restored != (rep + 1, "memory"):
                    raise RuntimeError(f"restored {mgr.restored}, expected ({rep + 1}, memory)")
                del dest
            m.trim()
    finally:
        if mgr is not None:
            mgr.close()
        if scratch is not None:
            m.remove(scratch)
        else:
            try:  # the scratch prefix and everything below it, on every backend
                _ext.open_storage(path, create=False).delete_dir(prefix)
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                _progress(f"could not remove {target}: {e}")

    copy_name, copy = m.copy_floor(samples)
    figures = {k: v.as_json() for k, v in samples.items()}
    ratios = {}

    def ratio(name: str, v: float) -> None:
        target, met = _TARGETS[name]
        ratios[name] = {"value": v, "target": target, "met": met(v)}

    if "direct write" in samples:
        ratio("save / direct write", samples["save"].gbps / samples["direct write"].gbps)
        ratio("load / parallel direct read",
              samples["load"].gbps / samples["parallel direct read"].gbps)
    if "stall" in samples:
        ratio("stall / copy floor", samples["stall"].median / copy.median)
        ratio("first stall / steady stall", first_stall / samples["stall"].median)
        ratio("memory restore / copy floor", samples["memory restore"].median / copy.median)
    meta = {"path": path, "state_bytes": nbytes, "tensors": len(ts), "reps": reps,
            "copy_floor": copy_name, "cold_reads": ctx.dropped, "first_stall_s": first_stall,
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    return {"meta": meta, "figures": figures, "ratios": ratios}


def print_table(r: dict) -> None:
    meta = r["meta"]
    print(f"cairn bench {meta['path']}: {meta['state_bytes'] / 1e9:.2f} GB in "
          f"{meta['tensors']} tensors, medians of {meta['reps']}; cold reads: "
          f"{'yes' if meta['cold_reads'] else 'no (page cache not dropped)'}; "
          f"{meta['cpus']} CPUs, load average {meta['loadavg_before'][0]:.1f} before / "
          f"{meta['loadavg_after'][0]:.1f} after")
    print(f"{'figure':<24}{'median s':>10}{'GB/s':>9}")
    for name, f in r["figures"].items():
        print(f"{name:<24}{f['median_s']:>10.3f}{f['GBps']:>9.2f}")
    if meta["first_stall_s"] is not None:
        print(f"{'first stall':<24}{meta['first_stall_s']:>10.3f}")
    if r["ratios"]:
        print()
        print(f"{'ratio':<30}{'value':>7}  target")
        for name, x in r["ratios"].items():
            print(f"{name:<30}{x['value']:>7.2f}  {x['target']:<8} "
                  f"{'met' if x['met'] else 'NOT met'}")
    print(f"(copy floor: {meta['copy_floor']})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cairn bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", metavar="PATH", help="where checkpoints would go (any URI)")
    ap.add_argument("--size-gb", type=float, default=0.5, help="state size (default 0.5)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument("--layers", type=int, default=16, help="model layers (3 x (4L+2) tensors)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    if args.size_gb <= 0 or args.reps < 1 or args.layers < 1:
        ap.error("--size-gb must be > 0, --reps and --layers >= 1")
    try:
        r = run(args.path, args.size_gb, args.reps, args.layers)
    except Exception as e:  # noqa: BLE001 - a CLI: report and exit non-zero
        print(f"cairn bench: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print_table(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
