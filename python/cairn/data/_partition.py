"""Order and partitioning of an epoch: pure functions shared by the datasets.

The global order of an epoch is a pure function of ``(seed, epoch)``: a
``numpy.random.Generator(PCG64)`` permutation seeded with ``[seed, epoch]``
(or the identity when not shuffling). A *position* in an epoch is the number
of samples of that order already consumed by all ranks together.

Partitioning slices what remains of the epoch, from position ``start``:

* global position ``p = start + rank + world_size * j`` belongs to rank
  ``rank`` as its rank-local sample ``j`` (a stride over ranks);
* rank-local samples are cut into chunks of ``batch_size``; chunk ``k`` goes to
  worker ``k % num_workers`` (a stride over workers). Together the slots are
  ``world_size x num_workers``; ``torch.utils.data.DataLoader`` returns the
  workers' batches round-robin, so every rank consumes its rank-local samples
  in order, whatever ``num_workers`` is;
* every rank gets the same number of samples: ``ceil(remaining / world_size)``
  with wrap-around padding from the start of the order (``drop_last=False``)
  or ``floor(remaining / world_size)`` (``drop_last=True``).

So after ``t`` batches on every rank, positions ``< start + t * batch_size *
world_size`` are consumed, whatever the world size or number of workers, and
a run resumed with another world size or ``num_workers`` continues the same
global order. The position arithmetic is C++ (``include/cairn/partition.h``);
the order stays a numpy permutation, so it never changes.
"""

from __future__ import annotations

import os

import numpy as np

# The position arithmetic (include/cairn/partition.h, int64 numpy arrays):
# per_rank(n, start, world_size, drop_last), epoch_end(...), rank_positions(n,
# start, world_size, rank, drop_last), worker_positions(rank_pos, num_workers,
# worker_id, batch_size), padded(order, length).
from cairn._ext import epoch_end, padded, per_rank, rank_positions, worker_positions  # noqa: F401


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The global order of ``n`` items for ``epoch`` (int64 indices)."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    gen = np.random.Generator(np.random.PCG64([int(seed) & (2**63 - 1), int(epoch)]))
    return gen.permutation(n).astype(np.int64)


def world() -> tuple[int, int]:
    """(rank, world_size), read now: torch.distributed if initialized, else the
    RANK / WORLD_SIZE environment variables, else (0, 1)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - no usable torch.distributed
        pass
    ws = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if ws < 1 or not 0 <= rank < ws:
        raise ValueError(f"invalid RANK={rank} / WORLD_SIZE={ws} in the environment")
    return rank, ws


def worker() -> tuple[int, int]:
    """(worker_id, num_workers) of the calling DataLoader worker, (0, 1) outside one."""
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    if info is None:
        return 0, 1
    return info.id, info.num_workers
