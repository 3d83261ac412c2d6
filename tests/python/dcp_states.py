"""State dicts and per-rank workers shared by the multi-rank checkpoint tests.

Every tensor's global value is a pure function of its key (``expected``), so a
loader on any world size knows what it must read back. Workers run inside
gloo_harness.run_ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ckpt_backend

# key -> (global shape, dtype, placement when saved, placement when loaded)
SHARDED = {
    "dt.rows7": ((7, 3), torch.float32, Shard(0), Shard(0)),  # uneven rows
    "dt.rows2": ((2, 5), torch.float32, Shard(0), Shard(0)),  # zero-size shards
    "dt.vec7": ((7,), torch.float64, Shard(0), Shard(0)),
    "dt.cols": ((3, 7), torch.float32, Shard(1), Shard(0)),  # Shard(1) -> Shard(0)
    "dt.empty": ((0, 4), torch.float32, Shard(0), Shard(0)),
    "dt.bf16": ((5, 2), torch.bfloat16, Shard(0), Replicate()),
}
REPLICATED = {"rep.w": ((4, 4), torch.float32), "rep.i": ((6,), torch.int64)}
EXTRA = {"lr": 0.5, "name": "abc", "ids": [1, 2, 3]}
STEP = 11


def expected(key: str, shape, dtype) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    base = torch.arange(n, dtype=torch.float64).reshape(shape) * 0.5
    return (base + sum(map(ord, key)) % 97).to(dtype)


def rank_key(r: int) -> str:
    return f"rank{r}.v"


def rank_value(r: int) -> torch.Tensor:
    return torch.full((3,), float(r)) + torch.arange(3.0)


def save_worker(rank: int, world: int, kind: str, path: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    sd = {"step": STEP, "extra": dict(EXTRA), rank_key(rank): rank_value(rank)}
    for k, (shape, dtype) in REPLICATED.items():
        sd[k] = expected(k, shape, dtype)
    for k, (shape, dtype, save_pl, _) in SHARDED.items():
        sd[k] = distribute_tensor(expected(k, shape, dtype), mesh, [save_pl])
    dcp.save(sd, storage_writer=ckpt_backend.writer(kind, path))


def _blank(saved_world: int, sharded) -> dict:
    """A zeroed load target for a checkpoint of `saved_world` ranks; sharded(zeros,
    load placement) makes each SHARDED entry."""
    sd = {"step": 0, "extra": {"lr": 0.0, "name": "", "ids": []}}
    for r in range(saved_world):
        sd[rank_key(r)] = torch.zeros(3)
    for k, (shape, dtype) in REPLICATED.items():
        sd[k] = torch.zeros(shape, dtype=dtype)
    for k, (shape, dtype, _, load_pl) in SHARDED.items():
        sd[k] = sharded(torch.zeros(shape, dtype=dtype), load_pl)
    return sd


def _check_unsharded(sd: dict, saved_world: int) -> None:
    """Asserts what `sd` read back, but for the SHARDED entries."""
    assert sd["step"] == STEP, sd["step"]
    assert sd["extra"] == EXTRA, sd["extra"]
    for r in range(saved_world):
        torch.testing.assert_close(sd[rank_key(r)], rank_value(r), rtol=0, atol=0)
    for k, (shape, dtype) in REPLICATED.items():
        assert torch.equal(sd[k], expected(k, shape, dtype)), k


def load_worker(rank: int, world: int, kind: str, path: str, saved_world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    sd = _blank(saved_world, lambda zeros, pl: distribute_tensor(zeros, mesh, [pl]))
    dcp.load(sd, storage_reader=ckpt_backend.reader(kind, path))

    _check_unsharded(sd, saved_world)
    for k, (shape, dtype, _, load_pl) in SHARDED.items():
        got = sd[k]
        assert isinstance(got, DTensor) and got.placements == (load_pl,), k
        want = distribute_tensor(expected(k, shape, dtype), mesh, [load_pl])
        assert got.to_local().shape == want.to_local().shape, k
        assert torch.equal(got.to_local(), want.to_local()), (k, rank)
        assert torch.equal(got.full_tensor(), expected(k, shape, dtype)), k


def load_full_single_process(kind: str, path: str, saved_world: int) -> None:
    """Loads everything into plain full tensors in this (non-distributed) process."""
    assert not dist.is_initialized()
    sd = _blank(saved_world, lambda zeros, _: zeros)
    dcp.load(sd, storage_reader=ckpt_backend.reader(kind, path))
    _check_unsharded(sd, saved_world)
    for k, (shape, dtype, _, _) in SHARDED.items():
        assert torch.equal(sd[k], expected(k, shape, dtype)), k
