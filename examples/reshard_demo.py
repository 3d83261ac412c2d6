#!/usr/bin/env python3
"""cairn demo: save a sharded checkpoint on 2 ranks, load it on 3, verify it.

    python examples/reshard_demo.py [--root DIR] [--keep]

1. 2 gloo (CPU) ranks train a small FSDP2-sharded MLP with Adam for a few
   steps and save model + optimizer with ``dcp.save(..., cairn.Writer(path))``.
2. 3 ranks build the same model sharded 3 ways, load the checkpoint with
   ``cairn.Reader`` (resharding 2 -> 3) and check every parameter and Adam
   moment equals what was saved, bit for bit.
3. ``cairn.verify`` checks every checksum; ``cairn ls`` / ``cairn inspect`` show
   what is on disk; a copy with one flipped byte is refused.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
import cairn  # noqa: E402

STEPS = 3


def shard_linears(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """FSDP2 as this demo uses it: every Linear its own unit, then the whole model."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def build(world: int):
    from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)
    )
    shard_linears(model, mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def full_state(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def save_rank(rank: int, world: int, ckpt: str, reference: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = build(world)
    for step in range(STEPS):
        torch.manual_seed(100 + step)  # same batch on every rank
        model(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": STEPS}, storage_writer=cairn.Writer(ckpt))
    ref = full_state(model, opt)
    if rank == 0:
        torch.save(ref, reference)
        shard = next(iter(msd.values()))
        print(
            f"  saved on {world} ranks: {len(msd)} parameters + Adam state, "
            f"each rank holds a shard (e.g. {shard.to_local().shape[0]} of "
            f"{shard.shape[0]} rows)"
        )


def load_rank(rank: int, world: int, ckpt: str, reference: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = build(world)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "step": 0}
    dcp.load(sd, storage_reader=cairn.Reader(ckpt))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got = full_state(model, opt)
    if rank == 0:
        want = torch.load(reference, weights_only=True)
        pairs = list(zip(_tensors(got), _tensors(want)))
        equal = sum(torch.equal(a, b) for a, b in pairs)
        assert equal == len(pairs) and len(pairs) > 0 and sd["step"] == STEPS, "mismatch"
        print(
            f"  loaded on {world} ranks (resharded 2 -> {world}): {equal}/{len(pairs)} "
            f"tensors bit-identical, step = {sd['step']}"
        )


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _entry(rank: int, world: int, store: str, fn, args) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (gloo threads can abort on exit)


def run_ranks(world: int, fn, *args) -> None:
    """Runs fn(rank, world, *args) on `world` gloo ranks forked from a server
    that has already imported torch (fast start)."""
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.checkpoint"])
    with tempfile.TemporaryDirectory(prefix="cairn-demo-store-") as d:
        mp.start_processes(
            _entry,
            args=(world, os.path.join(d, "store"), fn, args),
            nprocs=world,
            start_method="forkserver",
        )


def cli() -> list[str]:
    """This checkout's CLI build, else the one on PATH (the venv's, after setup)."""
    built = REPO / "build" / "cairn"
    return [str(built) if built.exists() else (shutil.which("cairn") or "cairn")]


def show(cmd: list[str], max_lines: int = 14) -> int:
    print("  $ cairn " + " ".join(cmd[1:]))
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = r.stdout.rstrip("\n").splitlines()
    for line in lines[:max_lines]:
        print("    " + line)
    if len(lines) > max_lines:
        print(f"    ... ({len(lines) - max_lines} more lines)")
    if r.returncode != 0:
        print("    " + r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "")
    return r.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description="cairn demo: save on 2 ranks, load on 3")
    ap.add_argument("--root", help="where to put checkpoints (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")

    root = Path(args.root or tempfile.mkdtemp(prefix="cairn-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    ckpt = root / f"step_{STEPS}"
    reference = root / "reference.pt"  # full state, only for the equality check
    try:
        print(f"1. save: 2 ranks, FSDP2-sharded MLP + Adam -> {ckpt}")
        run_ranks(2, save_rank, str(ckpt), str(reference))
        print("2. load: 3 ranks, cairn.Reader")
        run_ranks(3, load_rank, str(ckpt), str(reference))

        print("3. verify and inspect")
        cairn.verify(str(ckpt))
        print(f"  cairn.verify: OK; cairn.latest_valid(root) = {cairn.latest_valid(str(root))}")
        ls_rc = show(cli() + ["ls", str(root)])
        inspect_rc = show(cli() + ["inspect", str(ckpt)], max_lines=12)

        bad = root / "corrupted_copy"
        shutil.copytree(ckpt, bad)
        # Flip one bit inside the stored bytes of a weight (found by content).
        weight = torch.load(reference, weights_only=True)[0]["0.weight"]
        needle = weight[:2].numpy().tobytes()
        for data in (p for p in bad.rglob("*") if p.is_file()):
            raw = bytearray(data.read_bytes())
            at = raw.find(needle)
            if at >= 0:
                raw[at + 5] ^= 0x01
                data.write_bytes(bytes(raw))
                break
        else:
            raise RuntimeError("weight bytes not found in the checkpoint")
        try:
            cairn.verify(str(bad))
            print("  a flipped byte was NOT detected")
            return 1
        except cairn.CorruptionError as e:
            print(f"  one flipped byte in a copy -> cairn.CorruptionError: {e}")
        shutil.rmtree(bad)
        if ls_rc or inspect_rc:
            print("  the cairn CLI failed")
            return 1
        print("demo OK")
        return 0
    finally:
        if not args.keep and not args.root:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
