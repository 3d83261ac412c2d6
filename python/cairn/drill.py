"""Restore drill: load the newest committed checkpoint in fresh processes, verify it.

    python -m cairn.drill ROOT [--world-size N] [--tier memory|local|durable] [--local DIR]
    cairn drill ROOT ...          (the C++ CLI runs this module with the first Python that can
                                  import cairn: $CAIRN_PYTHON, the venv's, the one it was built
                                  for, PATH's; tools/cairn_cli.cc)

A drill answers "could this run restart from what it has saved?" without the
training script: it picks the checkpoint a restart would load, starts
``world_size`` fresh processes (a gloo group; the saved world size does not
matter, so 2 -> 1 or 1 -> 2 reshards), builds an empty state from the manifest
(tensors of the stored global shapes, sharded along dim 0 as DTensors across the
ranks, and every non-tensor value), loads it with ``dcp.load`` and
``cairn.Reader`` (which checks the checksum of every block it reads), then checks
every byte of the checkpoint once more with ``cairn.verify``. It reports the
checkpoint, its source tier, tensors, bytes and times, and exits 0; when the
checkpoint cannot be restored it exits 1 with the error, which names the file and
tensor (2: usage, or nothing to restore).

Which checkpoint (``ROOT`` is any URI cairn takes: a directory, ``file://``,
``shm://``, ``s3://``):

* no ``--tier``: ROOT itself when it is a committed checkpoint, else the newest
  committed one below it (``cairn.latest_valid``);
* ``--tier durable``: ROOT is a ``CheckpointManager`` root; its newest committed
  ``step_<N>``;
* ``--tier local``: the newest in the manager's local tier, ``--local DIR``;
* ``--tier memory``: the newest memory-tier slot of the run checkpointing to ROOT
  on this node (``shm://cairn-<hash of ROOT>/slot<K>``, the run identified by
  ``ROOT/cairn.run``), which lives while that run's manager does, or after it
  crashed until it is reclaimed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from cairn import _ext, _pools
from cairn.discovery import warn_skipped
from cairn.errors import Error

_TIERS = ("memory", "local", "durable")


class DrillError(Error):
    """The drill found nothing to restore or could not restore what it found."""


def pick_checkpoint(root: str, tier: str | None = None, local: str | None = None
                    ) -> tuple[str, str]:
    """(uri, tier) of the checkpoint a restart would load (the engine's
    PickDrillCheckpoint, cairn/tiers.h); raises DrillError when there is none."""
    uri, source, why, skipped = _ext.pick_drill_checkpoint(os.fspath(root), tier or "",
                                                           local or "")
    warn_skipped(skipped)
    if uri is None:
        raise DrillError(why)
    return uri, source


# ---------------------------------------------------------------------- one rank


def _empty_state(metadata: Any, world: int) -> tuple[dict, int, int]:
    """A flat state dict to load `metadata` into: tensors of the stored global shapes
    (sharded along dim 0 across `world` ranks when they can be), None for values."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {}
    count = nbytes = 0
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            state[fqn] = None
            continue
        size, dtype = tuple(md.size), md.properties.dtype
        count += 1
        nbytes += torch.Size(size).numel() * dtype.itemsize
        if mesh is not None and len(size) >= 1 and size[0] >= world:
            from torch.distributed.tensor import Shard, empty

            state[fqn] = empty(size, dtype=dtype, device_mesh=mesh, placements=[Shard(0)])
        else:
            state[fqn] = torch.empty(size, dtype=dtype)
    return state, count, nbytes


def _worker(uri: str, rank: int, world: int, store: str, out: str) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from datetime import timedelta

    from cairn.dcp import Reader, unwrap

    result: dict[str, Any] = {"rank": rank}
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=600))
    try:
        t0 = time.perf_counter()
        reader = Reader(uri)
        state, result["tensors"], result["bytes"] = _empty_state(reader.read_metadata(), world)
        t1 = time.perf_counter()
        try:
            dcp.load(state, storage_reader=reader)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            raise unwrap(e) from None
        result["load_s"] = time.perf_counter() - t1
        result["open_s"] = t1 - t0
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result.update(ok=False, error=f"{type(e).__name__}: {e}")
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    if world > 1:
        # A failed rank must not leave the others waiting in a collective: they
        # all end here, and the parent reports the first error.
        try:
            dist.destroy_process_group()
        except BaseException:  # noqa: BLE001
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------- the drill


def drill(root: str, world_size: int = 1, tier: str | None = None, local: str | None = None,
          timeout: float = 1800.0, verify: bool = True) -> dict[str, Any]:
    """Runs a restore drill (see the module docstring) and returns its report:
    checkpoint, tier, world_size, saved_world_size, tensors, bytes, load_s (the
    slowest rank), verify_s, total_s. Raises DrillError naming what failed."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    r = _ext.run_drill(os.fspath(root), tier or "", local or "", sys.executable, world_size,
                       timeout, verify, _pools.io_pool())  # the orchestration is C++
    warn_skipped(r.pop("skipped"))
    failure = r.pop("failure")
    if failure:
        raise DrillError(failure)
    return r


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--_worker":
        uri, rank, world, store, out = argv[1:6]
        return _worker(uri, int(rank), int(world), store, out)
    ap = argparse.ArgumentParser(prog="cairn drill", description=__doc__.split("\n\n")[0])
    ap.add_argument("root", metavar="ROOT", help="checkpoint root or checkpoint (any URI)")
    ap.add_argument("--world-size", type=int, default=1,
                    help="ranks to restore on (gloo processes; default 1)")
    ap.add_argument("--tier", choices=_TIERS,
                    help="restore from this tier of the CheckpointManager rooted at ROOT")
    ap.add_argument("--local", help="the manager's local tier (with --tier local)")
    ap.add_argument("--no-verify", action="store_true",
                    help="skip the full verify pass after the load (loading still checks "
                         "the checksum of every block it reads)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds (default 1800)")
    args = ap.parse_args(argv)
    if args.world_size < 1:
        ap.error("--world-size must be >= 1")
    print(f"cairn drill: restoring from {args.root} on {args.world_size} rank(s)...",
          file=sys.stderr, flush=True)
    try:
        r = drill(args.root, args.world_size, args.tier, args.local, args.timeout,
                  verify=not args.no_verify)
    except DrillError as e:
        print(f"cairn drill: FAILED: {e}", file=sys.stderr)
        return 2 if "no committed checkpoint" in str(e) else 1
    except (Error, OSError) as e:
        print(f"cairn drill: FAILED: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    gbps = r["bytes"] / r["load_s"] / 1e9 if r["load_s"] else float("inf")
    print(f"OK: restored {r['checkpoint']}")
    print(f"  tier        {r['tier']}")
    print(f"  ranks       {r['world_size']} (saved on {r['saved_world_size']})")
    print(f"  tensors     {r['tensors']}, {_ext.human_bytes(int(r['bytes']))}")
    print(f"  load        {r['load_s']:.3f} s ({gbps:.2f} GB/s, slowest rank, checksums checked)")
    if r["verify_s"] is not None:
        print(f"  verify      {r['verify_s']:.3f} s (every byte)")
    print(f"  total       {r['total_s']:.2f} s (process start-up included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
