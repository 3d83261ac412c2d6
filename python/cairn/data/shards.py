"""ShardDataset: streaming samples from shards, with a checkpointable position.

Work of an epoch: a list of ``(shard index, start offset)``; by default every
shard from offset 0, in the epoch's shard order (a pure function of
``(seed, epoch)``, see ``_partition``). Slots are ``world_size x num_workers``:
slot ``s = rank + world_size * worker_id`` processes work items ``s, s + S,
s + 2S, ...`` (S = number of slots), one after the other.

Position of a slot = ``(done, offset)``: work items completed, and samples
already yielded from the current one. Within a shard, samples pass through an
optional shuffle buffer whose RNG is seeded by ``(seed, epoch, shard)``: the
RNG state at any point is a pure function of the shard and the number of
samples drawn, so resuming replays the shard from its start with the same RNG
and skips ``offset`` samples, which is exact without storing RNG bytes or
buffer contents.

Resuming with the same number of slots continues every slot exactly; the
loader also records, per rank, which worker's batch comes next, and the
resumed iteration rotates worker ids so that torch's round-robin (which
always starts at worker 0) yields batches in the original order. With a
different world size or number of workers the remaining work is re-dealt:
items in progress first (each from where it stopped), then untouched ones, so
no sample is lost or repeated (the interleaving differs).

Shards of different lengths give ranks different numbers of samples; a run
that needs equal counts per rank (DDP) passes ``batches_per_epoch`` to
cairn.data.DataLoader (every rank stops after that many batches) or uses
shards of equal length.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch.utils.data

from cairn import _ext
from cairn.data import _partition

# The position of the iterator running in this process (one per DataLoader
# worker), read by cairn.data.DataLoader's batch tagging right after a batch
# is collated.
_CURRENT: dict = {}


def collapse_work(work: list, progress: list, num_slots: int) -> list:
    """Re-deals the remaining work of ``work`` (dealt over ``len(progress)``
    slots, each at ``(done, offset)``) as a fresh work list (the same for any
    ``num_slots``): include/cairn/partition.h's CollapseWork."""
    return _ext.collapse_work(work, progress)


class ShardDataset(torch.utils.data.IterableDataset):
    """Streams ``read_shard(shard)`` for each shard of the epoch's work,
    partitioned over ranks and workers.

    Args:
        shards: the shards (any picklable objects, e.g. paths).
        read_shard: ``read_shard(shard) -> iterable of samples``; must return the
            same samples in the same order each time it is called. With DataLoader
            workers started by forkserver (the default) or spawn it is pickled, so it
            must be a module-level function (cairn.data.DataLoader refuses a lambda).
        shuffle, seed: shuffle the shard order per epoch.
        shuffle_buffer: if > 1, shuffle samples within each shard through a
            buffer of this size.
    """

    def __init__(
        self,
        shards: Sequence[Any],
        read_shard: Callable[[Any], Iterable[Any]],
        shuffle: bool = False,
        seed: int = 0,
        shuffle_buffer: int = 0,
    ) -> None:
        super().__init__()
        self.shards = list(shards)
        if not self.shards:
            raise ValueError("ShardDataset: no shards")
        self.read_shard = read_shard
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.shuffle_buffer = int(shuffle_buffer)
        self._control = None
        self._epoch = 0
        # Set by load_state_dict: {"epoch", "work", "progress"}.
        self._resume: dict | None = None

    def _num_items(self) -> int:
        return len(self.shards)

    def set_epoch(self, epoch: int) -> None:
        if self._control is not None:
            self._control.set(epoch=epoch, start=0)
        self._epoch = int(epoch)

    def work_for(self, epoch: int, num_slots: int) -> tuple[list, list]:
        """(work, progress) for ``epoch`` dealt over ``num_slots`` slots."""
        r = self._resume
        if r is not None and r["epoch"] == epoch:
            return _ext.resume_work(r["work"], r["progress"], num_slots)
        order = _partition.epoch_order(len(self.shards), self.seed, epoch, self.shuffle)
        return [[int(i), 0] for i in order], [[0, 0] for _ in range(num_slots)]

    def shift_for(self, epoch: int, num_slots: int, rank: int) -> int:
        r = self._resume
        if r is None or r["epoch"] != epoch or len(r["progress"]) != num_slots:
            return 0
        shift = r.get("shift") or []
        return int(shift[rank]) if rank < len(shift) else 0

    def _samples(self, shard_idx: int, epoch: int):
        it = iter(self.read_shard(self.shards[shard_idx]))
        k = self.shuffle_buffer
        if k <= 1:
            yield from it
            return
        rng = np.random.Generator(np.random.PCG64([self.seed & (2**63 - 1), epoch, shard_idx]))
        buf: list = []
        for sample in it:
            if len(buf) < k:
                buf.append(sample)
                continue
            j = int(rng.integers(k))
            yield buf[j]
            buf[j] = sample
        for j in rng.permutation(len(buf)):
            yield buf[int(j)]

    def __iter__(self):
        c = self._control
        if c is not None and c.world_size > 0:
            epoch, rank, ws = c.epoch, c.rank, c.world_size
        else:
            epoch = self._epoch
            rank, ws = _partition.world()
        wid, nw = _partition.worker()
        slots = ws * nw
        work, progress = self.work_for(epoch, slots)
        # torch starts every iteration at worker 0; a resumed epoch must start
        # at the worker whose batch came next, so worker ids are rotated.
        slot = rank + ws * ((wid + self.shift_for(epoch, slots, rank)) % nw)
        return self._generate(work[slot::slots], progress[slot], slot, epoch)

    def _generate(self, mine: list, start: list, slot: int, epoch: int):
        done, offset = start
        pos = {"slot": slot, "done": done, "offset": offset}
        _CURRENT.clear()
        _CURRENT.update(pos)
        for k in range(done, len(mine)):
            shard_idx, base = mine[k]
            skip = base + (offset if k == done else 0)
            _CURRENT.update(done=k, offset=offset if k == done else 0)
            for i, sample in enumerate(self._samples(shard_idx, epoch)):
                if i < skip:
                    continue
                _CURRENT["offset"] += 1
                yield sample
            _CURRENT.update(done=k + 1, offset=0)
