"""Two real gloo ranks saving and loading through cairn.Writer/Reader.

Covers: replicated (DDP-style) state is stored once; a 2-rank checkpoint loads
on 2 ranks and on 1 process; DTensor state sharded on 2 ranks round-trips and
loads from a 1-process checkpoint (read items with non-zero storage offsets,
uneven and zero-size shards included). The resharding matrix proper lives in
the dcp tests; this file keeps the engine's read path honest.
"""

from __future__ import annotations

import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import cairn

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replicated_state() -> dict:
    g = torch.Generator().manual_seed(42)
    return {
        "model": {
            "w": torch.randn(300, 200, generator=g),
            "b": torch.randn(200, generator=g).to(torch.bfloat16),
            "mask": torch.rand(50, generator=g) > 0.5,
        },
        "step": 3,
        "meta": {"name": "replicated"},
    }


# Global tensors the DTensor scenarios shard (rows 7 and 1 give uneven and
# zero-size shards on 2 ranks).
def sharded_globals() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "rows": torch.randn(7, 5, generator=g),
        "cols": torch.randn(4, 9, generator=g),
        "tiny": torch.randn(1, 3, generator=g),
    }


def _worker(rank: int, world: int, port: int, root: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        # 1. Replicated state saved by both ranks.
        sd = replicated_state()
        dcp.save(sd, storage_writer=cairn.Writer(f"{root}/replicated"))
        # 2. ...and loaded by both ranks.
        out = {
            "model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
            "step": 0,
            "meta": {"name": ""},
        }
        dcp.load(out, storage_reader=cairn.Reader(f"{root}/replicated"))
        for k, v in sd["model"].items():
            assert torch.equal(out["model"][k], v), k
        assert out["step"] == 3 and out["meta"]["name"] == "replicated"

        mesh = init_device_mesh("cpu", (world,))
        glob = sharded_globals()
        dims = {"rows": 0, "cols": 1, "tiny": 0}
        # 3. Load a 1-process checkpoint into DTensors: each rank reads a
        #    region of one stored chunk (non-zero storage offsets; for "cols"
        #    a non-contiguous region).
        dt = {
            k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(dims[k])])
            for k, v in glob.items()
        }
        dcp.load(dt, storage_reader=cairn.Reader(f"{root}/single"))
        for k, v in glob.items():
            assert torch.equal(dt[k].full_tensor(), v), k
        # 4. Save DTensor shards from both ranks (the parent loads them whole).
        dt = {k: distribute_tensor(v, mesh, [Shard(dims[k])]) for k, v in glob.items()}
        dcp.save(dt, storage_writer=cairn.Writer(f"{root}/sharded"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_save_and_load(tmp_path):
    root = str(tmp_path)
    dcp.save(sharded_globals(), storage_writer=cairn.Writer(f"{root}/single"))
    mp.spawn(_worker, args=(2, free_port(), root), nprocs=2, join=True)

    # Replicated tensors are stored once: the data files together hold one
    # copy of the state, not two.
    sd = replicated_state()
    state_bytes = sum(t.numel() * t.element_size() for t in sd["model"].values())
    data_dir = tmp_path / "replicated" / "data"
    stored = sum(os.path.getsize(data_dir / f) for f in os.listdir(data_dir))
    assert state_bytes <= stored < state_bytes * 1.2 + 64 * 1024
    listing = cairn.list_checkpoints(tmp_path)
    assert {c["name"]: c["world_size"] for c in listing}["replicated"] == 2

    # A 2-rank checkpoint loads in one process.
    out = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}
    dcp.load(out, storage_reader=cairn.Reader(tmp_path / "replicated"))
    for k, v in sd["model"].items():
        assert torch.equal(out["model"][k], v), k

    # DTensor shards written by 2 ranks assemble into the full tensors.
    glob = sharded_globals()
    full = {k: torch.zeros_like(v) for k, v in glob.items()}
    dcp.load(full, storage_reader=cairn.Reader(tmp_path / "sharded"))
    for k, v in glob.items():
        assert torch.equal(full[k], v), k
    assert sorted(os.listdir(tmp_path / "sharded" / "data")) == ["r0.bin", "r1.bin"]
    cairn.verify(tmp_path / "sharded")
    cairn.verify(tmp_path / "replicated")
