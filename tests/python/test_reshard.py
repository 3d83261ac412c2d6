"""Save on N gloo ranks, load on M: plain, per-rank, DTensor and FSDP2 state."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

import ckpt_backend
import dcp_states
from gloo_harness import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from reshard_demo import shard_linears  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize("saved,loaded", [(1, 2), (2, 3), (4, 1), (3, 2)])
def test_save_on_n_ranks_loads_on_m_ranks(tmp_path, saved, loaded):
    path = str(tmp_path / "ckpt")
    run_ranks(saved, dcp_states.save_worker, "cairn", path)
    run_ranks(loaded, dcp_states.load_worker, "cairn", path, saved)
    dcp_states.load_full_single_process("cairn", path, saved)


# --- replicated (DDP-style) state is stored once ------------------------------

REPLICATED_BYTES = 4 * 64 * 1024 * 4  # four 64Ki-element float32 tensors


def _replicated_state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {f"layer{i}.weight": torch.randn(256, 256, generator=g) for i in range(4)}


def _save_replicated(rank, world, path):
    dcp.save(_replicated_state(), storage_writer=ckpt_backend.writer("cairn", path))


def test_replicated_state_of_two_ranks_is_stored_once(tmp_path):
    path = tmp_path / "ckpt"
    run_ranks(2, _save_replicated, str(path))
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert REPLICATED_BYTES <= total < 1.25 * REPLICATED_BYTES, total
    sd = {k: torch.zeros_like(v) for k, v in _replicated_state().items()}
    dcp.load(sd, storage_reader=ckpt_backend.reader("cairn", str(path)))
    for k, v in _replicated_state().items():
        assert torch.equal(sd[k], v), k


# --- FSDP2 model + optimizer --------------------------------------------------

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _fsdp_model(world):
    """A small MLP sharded as examples/reshard_demo.py shards its own."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)
    )
    shard_linears(model, mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, opt


def _fsdp_save(rank, world, path, ref_path):
    model, opt = _fsdp_model(world)
    for step in range(2):
        torch.manual_seed(100 + step)
        model(torch.randn(4, 7)).sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=ckpt_backend.writer("cairn", path))
    full = get_state_dict(model, opt, options=FULL)
    if rank == 0:
        torch.save(full, ref_path)


def _fsdp_load(rank, world, path, ref_path):
    model, opt = _fsdp_model(world)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=ckpt_backend.reader("cairn", path))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got = get_state_dict(model, opt, options=FULL)
    if rank == 0:
        want = torch.load(ref_path, weights_only=True)
        _assert_same(got, want, "state")
        assert len(got[1]["state"]) == 4  # Adam state for every parameter


def _assert_same(got, want, where):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def test_fsdp2_model_and_optimizer_reshard_from_2_to_1_and_3_ranks(tmp_path):
    path, ref = str(tmp_path / "ckpt"), str(tmp_path / "ref.pt")
    run_ranks(2, _fsdp_save, path, ref)
    assert os.path.exists(ref)
    run_ranks(1, _fsdp_load, path, ref)
    run_ranks(3, _fsdp_load, path, ref)
