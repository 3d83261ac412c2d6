"""SharedMemoryStager: reusable shared-memory staging for ``dcp.async_save``.

``dcp.async_save`` first *stages* the state dict (makes a copy that training may
not change), then writes the copy in a background thread. Its default stager
allocates a fresh CPU copy on every save. ``SharedMemoryStager`` copies into
buffers allocated once and reused instead::

    stager = cairn.SharedMemoryStager()          # 2 slots: stage while one save persists
    fut = None
    for step in ...:
        train_step()
        if step % every == 0:
            if fut is not None:
                fut.result()                      # the previous save is done
            fut = dcp.async_save(model.state_dict(), async_stager=stager,
                                 storage_writer=cairn.Writer(f"/ckpt/step_{step}"))
            stager.track(fut)                     # optional: exact slot recycling
    fut.result()
    stager.close()                                # frees the shared memory

The stager is DCP's own ``DefaultStager`` where that already does the same thing: it
takes DCP's ``StagingOptions`` (pinned memory, non-blocking copies), and DCP's
``stage()``/``synchronize_staging()``/``close()`` drive it. What it replaces is the
copy: DCP allocates a fresh copy per save, cairn copies into reusable slots of the
C++ staging engine (``StagingPool``, include/cairn/staging.h) through
``cairn._staging.SlotStager``, the same path as the CheckpointManager's.

Protocol of one ``stage(state_dict)``:
  1. Walk the state dict (dicts, lists, tuples; DTensors by their local shard) and
     collect its distinct tensors.
  2. Pick a slot, oldest first: a slot never used or whose tracked save completed;
     otherwise the oldest slot, waiting (up to ``timeout``) for its tracked save to
     complete. An untracked slot is taken as done (see the contract below).
  3. Stage the tensors into the slot with the staging engine (``SlotStager.stage``):
     laid out as a data file lays them out (format.h: 4 KiB aligned), into a file in
     /dev/shm mapped once, pre-faulted and grown only when the state grows (so after
     the first save no page fault and no allocation happens); CUDA tensors
     device-to-host on a side stream per device into the slot registered as pinned
     memory, contiguous CPU tensors by one parallel memcpy in C++ with the GIL
     released, other CPU tensors by ``Tensor.copy_``.
  4. Return the same structure with each tensor replaced by a CPU tensor viewing the
     slot (same dtype, shape, requires_grad; a DTensor rebuilt around its staged local
     shard with the same spec) and every other value deep-copied. Training may
     mutate the originals as soon as ``stage`` returns.

Contract: the returned state dict stays valid until the save that uses it completes;
after that its slot may be overwritten by a later ``stage``. With ``slots`` = K + 1,
K saves may be in flight while the next one stages. A save passed to ``track()`` is
waited for before its slot is reused; an untracked save must have completed (its
future waited for) before ``slots - 1`` further stages have happened. Memory: the
sum of the slot sizes, at most ``slots`` × the staged bytes, flat across saves of
the same state (``footprint``).

Thread-safety: a stager is used from one thread (the training loop); tracked
futures may complete on any thread.
"""

from __future__ import annotations

import concurrent.futures
import copy
import os
import uuid
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from cairn import _ext, _pools
from cairn._staging import SlotStager
from cairn.errors import InvalidArgumentError, PreconditionError, TimeoutError

__all__ = ["SharedMemoryStager"]

_PREFIX = "cairn-stager-"


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


class _Slot:
    """Bookkeeping of one staging slot: which save uses it and since when."""

    __slots__ = ("index", "stamp", "used", "future", "awaiting_track")

    def __init__(self, index: int) -> None:
        self.index = index
        self.stamp = 0  # the stage() count when last used; 0 = never
        self.used = False
        self.future: concurrent.futures.Future | None = None
        self.awaiting_track = False

    def free(self) -> bool:
        return not self.used or (self.future is not None and self.future.done())


class SharedMemoryStager(DefaultStager):
    """An ``AsyncStager`` for ``dcp.async_save`` that stages into reusable buffers in
    node shared memory (see the module docstring for the protocol and contract).

    Args:
        slots: staging buffers (>= 1): saves in flight while the next one stages + 1.
        threads: memcpy threads, counting the calling one (default: the "copy" size
            of ``cairn._pools.thread_count``).
        timeout: seconds ``stage`` waits for a tracked save to free its slot.
        pin_memory: register the slots as pinned CUDA host memory when CUDA tensors
            are staged (device-to-host copies then run asynchronously on a side stream).
        options: DCP ``StagingOptions``; ``use_pinned_memory`` is ``pin_memory`` (given
            both, both must allow pinning), ``use_shared_memory`` must be True (the
            slots are shared memory) and ``use_async_staging`` False (``stage``
            returns once its copies are complete).

    Owns its shared-memory directory (``shm_dir``, unique to this stager); ``close()``
    deletes it.
    """

    _synchronize_after_execute = False  # stage() returns once the copy is complete

    def __init__(self, slots: int = 2, *, threads: int | None = None, timeout: float = 600.0,
                 pin_memory: bool = True, options: StagingOptions | None = None) -> None:
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise InvalidArgumentError(f"slots must be an int >= 1, got {slots!r}")
        if not timeout or timeout <= 0:
            raise InvalidArgumentError(f"timeout must be > 0 seconds, got {timeout!r}")
        if options is not None:
            if options.use_async_staging or not options.use_shared_memory:
                raise InvalidArgumentError(
                    "SharedMemoryStager stages synchronously into shared memory: pass "
                    "StagingOptions(use_async_staging=False, use_shared_memory=True)")
            pin_memory = pin_memory and options.use_pinned_memory
        accel = torch.accelerator.is_available()
        super().__init__(StagingOptions(use_pinned_memory=bool(pin_memory) and accel,
                                        use_shared_memory=True, use_async_staging=False,
                                        use_non_blocking_copy=bool(pin_memory) and accel))
        self.timeout = float(timeout)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.shm_dir = _ext.shm_directory(f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        # Leftovers of stagers whose process died without closing (a crash, SIGKILL).
        _ext.remove_stale_staging_dirs(os.path.dirname(self.shm_dir), _PREFIX)
        self._pool = _ext.StagingPool(self.shm_dir, rank=rank, num_slots=slots,
                                      threads=threads or _pools.thread_count("copy"),
                                      remove_on_close=True)
        # Frees the shared memory (the pool's files and its directory) if close() is never
        # called (garbage collection or interpreter exit); a crash leaves files that the
        # next stager on the node removes.
        self._finalizer = weakref.finalize(self, self._pool.close)
        self._engine = SlotStager(self._pool, pin_memory=bool(pin_memory))
        self._slots = [_Slot(i) for i in range(slots)]
        self._stages = 0
        self._closed = False
        self.last_stage_bytes = 0

    @property
    def pin_memory(self) -> bool:
        return self._engine.pin_memory

    @property
    def _registered(self) -> dict[int, tuple[int, int]]:
        """slot -> (address, size) registered as pinned memory."""
        return self._engine.registered

    # ---- the AsyncStager protocol (DefaultStager.stage calls _stage) -------------

    @torch.no_grad()
    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        """Returns a copy of `state_dict` whose tensors live in a staging slot."""
        if self._closed:
            raise PreconditionError("SharedMemoryStager is closed")
        leaves: dict[int, torch.Tensor] = {}  # id -> distinct tensor (kept alive here)

        def collect(x: Any) -> None:
            if isinstance(x, torch.Tensor):
                src = self._local(x)
                if id(src) not in leaves:
                    self._check_tensor(src)
                    leaves[id(src)] = src
            elif isinstance(x, dict):
                for v in x.values():
                    collect(v)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    collect(v)

        collect(state_dict)
        self._stages += 1
        srcs = list(leaves.values())
        views: dict[int, torch.Tensor] = {}
        total = 0
        if any(t.numel() for t in srcs):
            slot = self._take_slot()
            if self._pool.in_use(slot.index):
                self._pool.release(slot.index)
            staged, staged_views = self._engine.stage(slot.index, srcs, views=True)
            total = int(staged.end)
            for src, dst in zip(srcs, staged_views):
                if dst is not None:
                    if src.requires_grad:
                        dst.requires_grad_(True)
                    views[id(src)] = dst
            slot.used, slot.stamp, slot.future = True, self._stages, None
            slot.awaiting_track = True
            for s in self._slots:
                if s is not slot:
                    s.awaiting_track = False
        for src in srcs:
            if id(src) not in views:
                views[id(src)] = torch.empty(src.shape, dtype=src.dtype,
                                             requires_grad=src.requires_grad)
        self.last_stage_bytes = total
        return self._rebuild(state_dict, views, {})

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    # ---- slots ---------------------------------------------------------------------

    def track(self, future: Any) -> None:
        """Ties the save started from the latest ``stage`` to `future` (what
        ``dcp.async_save`` returned: a Future or an AsyncSaveResponse), so its slot is
        reused only once that save completed."""
        fut = getattr(future, "upload_completion", future)
        if not isinstance(fut, concurrent.futures.Future):
            raise InvalidArgumentError(
                f"track() takes the future dcp.async_save returned, got {type(future).__name__}")
        slot = next((s for s in self._slots if s.awaiting_track), None)
        if slot is None:
            raise PreconditionError("track(): no staged save is waiting to be tracked "
                                    "(call it once, after the async_save that staged)")
        slot.future = fut
        slot.awaiting_track = False

    def _take_slot(self) -> _Slot:
        free = [s for s in self._slots if s.free()]
        if free:
            return min(free, key=lambda s: s.stamp)
        oldest = min(self._slots, key=lambda s: s.stamp)
        if oldest.future is not None:
            done, _ = concurrent.futures.wait([oldest.future], timeout=self.timeout)
            if not done:
                raise TimeoutError(
                    f"staging slot {oldest.index} is still used by a save after "
                    f"{self.timeout:.0f}s; every one of the {len(self._slots)} slots is busy")
        return oldest

    @property
    def footprint(self) -> int:
        """Bytes of shared memory held by the slots."""
        return int(self._pool.footprint)

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    # ---- copying -------------------------------------------------------------------

    @staticmethod
    def _local(x: torch.Tensor) -> torch.Tensor:
        DTensor = _dtensor_type()
        if DTensor is not None and isinstance(x, DTensor):
            return x._local_tensor
        return x

    @staticmethod
    def _check_tensor(t: torch.Tensor) -> None:
        if t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_meta:
            raise InvalidArgumentError(
                f"SharedMemoryStager stages dense tensors only, got layout {t.layout}, "
                f"dtype {t.dtype} on {t.device}")

    # ---- rebuilding the structure --------------------------------------------------

    def _rebuild(self, x: Any, views: dict[int, torch.Tensor], memo: dict) -> Any:
        if isinstance(x, torch.Tensor):
            local = self._local(x)
            staged = views[id(local)]
            if local is x:
                return staged
            return self._rebuild_dtensor(x, staged)
        if isinstance(x, dict):
            items = [(k, self._rebuild(v, views, memo)) for k, v in x.items()]
            if type(x) is dict:
                return dict(items)
            out = copy.copy(x)
            out.clear()
            out.update(items)
            return out
        if isinstance(x, list):
            items = [self._rebuild(v, views, memo) for v in x]
            if type(x) is list:
                return items
            out = copy.copy(x)
            out[:] = items
            return out
        if isinstance(x, tuple):
            items = [self._rebuild(v, views, memo) for v in x]
            return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
        return copy.deepcopy(x, memo)

    @staticmethod
    def _rebuild_dtensor(x: Any, staged: torch.Tensor) -> Any:
        DTensor = _dtensor_type()
        if x.device_mesh.device_type == "cpu":
            return DTensor.from_local(staged, x.device_mesh, x.placements, run_check=False,
                                      shape=x.shape, stride=x.stride())
        # from_local would move the staged shard back to the mesh's device: keep it on
        # the host under the same spec, as DCP's default stager does.
        return DTensor(staged, x._spec, requires_grad=x.requires_grad)

    # ---- closing -------------------------------------------------------------------

    def close(self) -> None:
        """Frees the shared memory. State dicts staged earlier must not be used after."""
        if self._closed:
            return
        self._closed = True
        try:
            self._engine.unpin_all()
        finally:
            self._finalizer()
            super().close()

    def __enter__(self) -> "SharedMemoryStager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
