"""cairn.data.DataLoader: a torch DataLoader that knows its position.

* Workers are persistent when ``num_workers > 0`` (they keep their cache
  engine and its eviction state across epochs), and batches come back in
  order (``in_order=True``), round-robin over workers, which the partitioning
  of ``_partition`` relies on.
* ``set_epoch(e)`` and the position reach persistent workers through a shared
  control block (``_control``), written in ``__iter__`` before the workers are
  told to start the next iteration.
* The position counts only batches returned by ``__next__`` to the training
  loop, never batches prefetched by workers.
* ``batches_per_epoch=N`` ends every epoch after N batches (the rest of the
  epoch is dropped). With :class:`ShardDataset`, whose shards may differ in
  length, this is how every rank gets the same number of batches (choose N no
  larger than the smallest rank's share), so no rank hangs at an epoch's end.
* Workers start from a forkserver by default (``multiprocessing_context``
  overrides it): a ``fork()`` of a trainer that runs threads (torch.distributed,
  a CheckpointManager) can leave a worker hung in a lock held at the fork. With
  a start method other than fork the dataset is pickled to the workers, so an
  unpicklable ``read_shard`` (a lambda) is refused here, with a ValueError.
  The forkserver is started when the loader is constructed, preloading torch,
  so that the workers it forks at the first ``iter()`` start in milliseconds
  once it is up (``_workers.start_forkserver``). Without a
  ``multiprocessing_context``, a trainer that has a single thread when the
  workers are created (no thread at all besides the calling one: e.g. a
  one-process job with ``OMP_NUM_THREADS=1``, before it starts any) forks them
  instead: with no other thread, no lock can be held at the fork, and fork
  costs milliseconds where a forkserver costs an ``import torch``.
* Workers never outlive the trainer, even when it dies by SIGKILL (see
  ``_workers``): each one watches the trainer process and kills itself when it
  is gone, and then the forkserver and the resource tracker exit too.
* At the start of each iteration, when torch.distributed is initialized, the
  ranks compare ``num_workers``, ``batch_size`` and the dataset size
  (``all_gather_object``) and raise ``ValueError`` on a mismatch: different
  ``num_workers`` would change the slots and duplicate or skip samples.
* ``state_dict()``/``load_state_dict()`` hold plain ints and lists, so the
  loader is a DCP ``Stateful`` and can sit in a cairn checkpoint. For a
  :class:`CachedFileDataset` the state is ``(epoch, consumed)``, the same on
  every rank. For a :class:`ShardDataset` it holds every slot's position;
  ``state_dict()`` gathers them from all ranks (a collective: call it on
  every rank, as checkpointing does: one all-reduce of a small int64 tensor).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
import torch.utils.data

from cairn.data import _partition, _workers, shards
from cairn.data._control import Control
from cairn.data.cached import CachedFileDataset
from cairn.data.shards import ShardDataset

_STATE_VERSION = 1


def _find_cairn_dataset(ds: Any, depth: int = 0):
    if isinstance(ds, (CachedFileDataset, ShardDataset)):
        return ds
    if depth >= 3 or not hasattr(ds, "__dict__"):
        return None
    for v in vars(ds).values():
        found = _find_cairn_dataset(v, depth + 1)
        if found is not None:
            return found
    return None


class _Tagged:
    """A batch and the position of the worker's iterator right after it."""

    def __init__(self, batch: Any, pos: dict) -> None:
        self.batch = batch
        self.pos = pos

    def pin_memory(self, device=None):
        from torch.utils.data._utils.pin_memory import pin_memory

        return _Tagged(pin_memory(self.batch, device), self.pos)


class _TaggingCollate:
    """Collates, then tags the batch with the ShardDataset position."""

    def __init__(self, collate) -> None:
        self.collate = collate

    def __call__(self, samples):
        return _Tagged(self.collate(samples), dict(shards._CURRENT))


class _Iter:
    def __init__(self, loader: "DataLoader", inner) -> None:
        self._loader = loader
        self._inner = inner

    def __iter__(self):
        return self

    def __len__(self):
        return len(self._inner)

    def __next__(self):
        ld = self._loader
        if ld._batches_per_epoch is not None and ld._batches >= ld._batches_per_epoch:
            ld._epoch_done = True
            raise StopIteration
        try:
            batch = next(self._inner)
        except StopIteration:
            ld._epoch_done = True
            raise
        ld._batches += 1
        if isinstance(batch, _Tagged):
            slot = batch.pos["slot"]
            ld._slot_pos[slot] = [batch.pos["done"], batch.pos["offset"]]
            ld._next_worker = (slot // ld._iter_ws + 1) % ld._iter_nw
            batch = batch.batch
        ld._consumed = min(ld._end, ld._consumed + ld._step)
        # After the epoch's last batch the epoch is over now, not only at a further
        # next(): a loop that knows len(loader) (Lightning's) never makes that call.
        if ((ld._batches_per_epoch is not None and ld._batches >= ld._batches_per_epoch)
                or (not ld._is_shards and ld._consumed >= ld._end)):
            ld._epoch_done = True
        return batch


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` over a :class:`CachedFileDataset` or
    :class:`ShardDataset` (possibly wrapped by another dataset that keeps it
    as an attribute), with persistent workers, ``set_epoch`` and an exact,
    checkpointable position."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        num_workers: int = 0,
        *,
        batches_per_epoch: int | None = None,
        **kwargs,
    ):
        cds = _find_cairn_dataset(dataset)
        if cds is None:
            raise TypeError(
                "cairn.data.DataLoader needs a cairn.data.CachedFileDataset or ShardDataset "
                "(or a dataset wrapping one as an attribute)"
            )
        # No start method given: chosen when the workers are created (__iter__),
        # fork if the trainer then has a single thread, else forkserver.
        self._auto_mp = num_workers > 0 and kwargs.get("multiprocessing_context") is None
        if num_workers > 0:
            kwargs["persistent_workers"] = True
            if self._auto_mp:
                kwargs["multiprocessing_context"] = "forkserver"  # until __iter__ decides
            method = _workers.start_method(kwargs["multiprocessing_context"])
            if method != "fork" and isinstance(cds, ShardDataset):
                # Also when fork may be chosen: whether it is depends on the threads
                # the trainer runs at its first iter(), not on anything known here.
                _workers.check_picklable("read_shard", cds.read_shard, method)
            kwargs["worker_init_fn"] = _workers.WorkerInit(os.getpid(),
                                                           kwargs.get("worker_init_fn"))
            if method == "forkserver" and not (self._auto_mp and _workers.single_threaded()):
                # Now, not at the first iter(): the forkserver's one import of torch
                # overlaps whatever the trainer does until then (see _workers).
                _workers.start_forkserver()
        if "in_order" in inspect.signature(torch.utils.data.DataLoader.__init__).parameters:
            if kwargs.get("in_order") is False:
                raise ValueError("cairn.data.DataLoader needs in_order=True")
            kwargs["in_order"] = True
        self._is_shards = isinstance(cds, ShardDataset)
        if self._is_shards:
            kwargs["collate_fn"] = _TaggingCollate(
                kwargs.get("collate_fn") or torch.utils.data.default_collate
            )
        if kwargs.get("generator") is None:
            # torch draws the workers' base seed from this generator at every
            # iter(); without one it draws from the global torch RNG, so merely
            # re-creating the iterator after a restore would shift the training
            # run's RNG stream (dropout...) and break bit-exact resume.
            kwargs["generator"] = torch.Generator().manual_seed(0x5EED ^ int(getattr(cds, "seed", 0)))
        prefetch_factor = kwargs.get("prefetch_factor") or 2
        super().__init__(dataset, batch_size=batch_size, num_workers=num_workers, **kwargs)
        self._cds = cds
        self._bs = batch_size or 1
        self._control = Control()
        self._pin_window = self._bs * (prefetch_factor + 2) if num_workers > 0 else self._bs + 1
        cds._control = self._control
        if batches_per_epoch is not None and batches_per_epoch < 1:
            raise ValueError("batches_per_epoch must be >= 1")
        self._batches_per_epoch = batches_per_epoch
        self._batches = 0  # batches handed out in this epoch
        self._epoch = 0
        self._consumed = 0
        self._epoch_done = False
        self._end = 0
        self._step = 0
        self._slots = 0
        self._slot_pos: dict[int, list] = {}
        self._base_progress: list = []
        self._work: list = []
        self._next_worker = 0
        self._iter_ws = 1
        self._iter_nw = 1

    def __len__(self) -> int:
        """Batches per full epoch on this rank."""
        n = super().__len__()
        return n if self._batches_per_epoch is None else min(n, self._batches_per_epoch)

    # -- epoch and position -------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch of the next iteration. Keeps a restored position
        when ``epoch`` is the restored epoch."""
        epoch = int(epoch)
        if epoch != self._epoch or self._epoch_done:
            self._epoch = epoch
            self._consumed = 0
            self._batches = 0
            self._epoch_done = False
            self._cds._resume = None if self._is_shards else getattr(self._cds, "_resume", None)

    @property
    def epoch(self) -> int:
        return self._epoch

    def _check_ranks(self, ws: int) -> None:
        if ws <= 1:
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        mine = (int(self.num_workers), int(self._bs), int(self._cds._num_items()))
        everyone: list = [None] * ws
        dist.all_gather_object(everyone, mine)
        if any(e != mine for e in everyone):
            desc = ", ".join(
                f"rank {r}: num_workers={e[0]} batch_size={e[1]} items={e[2]}"
                for r, e in enumerate(everyone)
            )
            raise ValueError(
                "cairn.data.DataLoader: all ranks must use the same num_workers, batch_size "
                f"and dataset (the partitioning depends on them); got {desc}"
            )

    def __iter__(self):
        if self._epoch_done:
            self._epoch += 1
            self._consumed = 0
            self._batches = 0
            self._epoch_done = False
            if self._is_shards:
                self._cds._resume = None
        rank, ws = _partition.world()
        self._check_ranks(ws)
        nw = max(1, self.num_workers)
        if self._is_shards:
            self._slots = ws * nw
            self._work, self._base_progress = self._cds.work_for(self._epoch, self._slots)
            self._next_worker = self._cds.shift_for(self._epoch, self._slots, rank)
            self._iter_ws, self._iter_nw = ws, nw
            self._slot_pos = {}
            self._end = 0
            self._step = 0
        else:
            n = self._cds._num_items()
            self._end = _partition.epoch_end(n, self._consumed, ws, self._cds.drop_last)
            self._step = self._bs * ws
        self._control.set(
            epoch=self._epoch,
            start=self._consumed,
            rank=rank,
            world_size=ws,
            batch_size=self._bs,
            pin_window=self._pin_window,
            consumers=nw * ws,
            num_workers=nw,
        )
        if self._auto_mp and getattr(self, "_iterator", None) is None:
            # The workers are created now: fork only if no other thread exists that
            # could hold a lock at the fork (see _workers.single_threaded).
            fork = _workers.single_threaded()
            self.multiprocessing_context = "fork" if fork else "forkserver"
            if not fork:
                _workers.start_forkserver()
        with _workers.arm_fork():  # the first iteration starts the workers
            inner = super().__iter__()
        return _Iter(self, inner)

    # -- DCP Stateful -------------------------------------------------------
    def state_dict(self) -> dict:
        """The position after the last batch handed out: plain ints/lists."""
        common = {"version": _STATE_VERSION, "items": int(self._cds._num_items())}
        if self._epoch_done:
            return {**common, "epoch": self._epoch + 1, "consumed": 0, "batches": 0}
        common["batches"] = int(self._batches)
        if not self._is_shards:
            return {**common, "epoch": self._epoch, "consumed": int(self._consumed)}
        progress, shift = self._gather_progress()
        return {
            **common,
            "epoch": self._epoch,
            "consumed": 0,
            "work": self._work,
            "progress": progress,
            "shift": shift,
        }

    def _gather_progress(self) -> list:
        if not self._work:  # not iterated yet in this epoch: keep what was loaded
            r = self._cds._resume
            if r and r["epoch"] == self._epoch:
                return [list(p) for p in r["progress"]], list(r.get("shift") or [])
            return [], []
        progress = [list(p) for p in self._base_progress]
        mine = dict(self._slot_pos)
        rank, ws = _partition.world()
        shift = [0] * ws
        shift[rank] = self._next_worker
        if ws > 1:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                mine, shift = self._combine_positions(dist, mine, rank, ws, len(progress))
        for s, p in mine.items():
            progress[int(s)] = list(p)
        return progress, shift

    def _combine_positions(self, dist, mine: dict, rank: int, ws: int,
                           slots: int) -> tuple[dict, list]:
        """Every rank's slot positions and next worker, from one all-reduce (MAX) of
        a fixed-size int64 tensor: a rank fills what only it knows (the slots it has
        seen, its next worker), -1 elsewhere. It runs inside every save's stall, where
        ``all_gather_object`` (pickling, two collectives) cost ~10 ms on 2 ranks."""
        buf = torch.full((slots * 2 + ws,), -1, dtype=torch.int64)
        for s, (done, offset) in mine.items():
            buf[2 * int(s)] = int(done)
            buf[2 * int(s) + 1] = int(offset)
        buf[2 * slots + rank] = int(self._next_worker)
        from torch.distributed.distributed_c10d import _get_object_coll_device

        dev = torch.device(_get_object_coll_device())
        out = buf.to(dev)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        vals = out.cpu().tolist()
        combined = {s: [vals[2 * s], vals[2 * s + 1]] for s in range(slots) if vals[2 * s] >= 0}
        return combined, vals[2 * slots:]

    def load_state_dict(self, state: dict) -> None:
        """Restores a position saved by :meth:`state_dict` (possibly with another
        world size or number of workers)."""
        def as_int(v):
            return int(v.item()) if isinstance(v, torch.Tensor) else int(v)

        items = as_int(state.get("items", -1))
        if items != self._cds._num_items():
            raise ValueError(
                f"cairn.data.DataLoader.load_state_dict: the state is for {items} items, "
                f"this dataset has {self._cds._num_items()}"
            )
        self._epoch = as_int(state["epoch"])
        self._consumed = as_int(state.get("consumed", 0))
        self._batches = as_int(state.get("batches", 0))
        self._epoch_done = False
        self._work = []
        if self._is_shards:
            progress = state.get("progress") or []
            self._cds._resume = (
                {"epoch": self._epoch, "work": [list(map(int, w)) for w in state["work"]],
                 "progress": [list(map(int, p)) for p in progress],
                 "shift": [int(x) for x in state.get("shift") or []]}
                if progress
                else None
            )
            # Persistent workers hold a copy of the dataset taken at their
            # start: restart them so they see the restored work.
            it = getattr(self, "_iterator", None)
            if it is not None and hasattr(it, "_shutdown_workers"):
                it._shutdown_workers()
                self._iterator = None
