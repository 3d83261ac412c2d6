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

__all__ = ["init_distributed"]


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
