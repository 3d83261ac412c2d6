"""Process-group set-up that survives ``torchrun --max-restarts``.

Under torchrun the elastic agent hosts the rendezvous TCPStore and keeps it across
restarts of its workers. The keys the first attempt's process groups wrote (each
rank's gloo/NCCL address) are still there when the restarted workers look them up,
so a restarted worker can read a dead peer's address and fail with "Connection
refused" or hang in ``connectFullMesh``. :func:`init_distributed` namespaces the
store by ``TORCHELASTIC_RESTART_COUNT``, so every attempt starts from clean keys.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

__all__ = ["init_distributed", "settle_ddp_buckets"]


def init_distributed(backend: str | None = None, timeout: float = 600.0) -> tuple[int, int]:
    """Initializes the default process group from torchrun's environment
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and returns
    ``(rank, world_size)``. Safe to call again after a restart by torchrun.
    A no-op returning the current values when already initialized."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as e:
        raise ValueError(f"init_distributed needs torchrun's environment: {e} is not set") from None
    backend = backend or ("nccl" if _cuda() else "gloo")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    td = timedelta(seconds=timeout)
    store = dist.TCPStore(addr, port, world_size=world, is_master=(rank == 0 and not agent_store),
                          timeout=td, wait_for_workers=False)
    store = dist.PrefixStore(f"cairn/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=td)
    return rank, world


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def settle_ddp_buckets(model, forward_backward) -> bool:
    """Makes a ``DistributedDataParallel`` model reduce its gradients in the same
    bucket layout on every real step, so a resumed run sums them in the same order
    as an uninterrupted one. Call it on every attempt, right after wrapping the model
    (before or after ``mgr.restore``), with ``forward_backward(model)`` running one
    forward and backward pass of any well-formed input (every parameter must get a
    gradient, as DDP without ``find_unused_parameters`` requires anyway).

    Why: DDP reduces the first backward pass of a process in one bucket in parameter
    order, records the order in which gradients became ready, and from the next
    forward pass on reduces in buckets of that order. With three or more ranks the
    two layouts sum a gradient element in a different order (a ring all-reduce
    starts each chunk of the bucket at another rank, so the order an element is
    summed in depends on its offset), and an uninterrupted run's step k+1 (rebuilt
    buckets) and a run resumed at step k (its first pass: the initial bucket) differ
    in the last bits. (With two ranks a + b == b + a, which is why it shows from 3 ranks on.)
    Running that first pass here, on every attempt, gives every real step the rebuilt
    layout.

    The pass runs under ``torch.random.fork_rng`` (the run's random streams are
    untouched), its gradients are dropped (``grad = None``) and it is a collective:
    every rank calls it. Returns whether the pass ran: False for a model that is not
    DDP, or one whose buckets were already rebuilt (it had run a step)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or getattr(
            model, "_has_rebuilt_buckets", False):
        return False
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        forward_backward(model)
    for p in model.parameters():
        p.grad = None
    # DDP rebuilds at the start of its next forward pass; a no-grad forward skips that,
    # so rebuild here, the way DDP's own _pre_forward does.
    if model.reducer._rebuild_buckets():
        model._has_rebuilt_buckets = True
    return True
