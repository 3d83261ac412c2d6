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

Protocol of one ``stage(state_dict)``:
  1. Walk the state dict (dicts, lists, tuples; DTensors by their local shard) and
     lay its tensors out back to back in one buffer (64-byte aligned; 4 KiB for
     tensors of 1 MiB or more).
  2. Pick a slot, oldest first: a slot never used or whose tracked save completed;
     otherwise the oldest slot, waiting (up to ``timeout``) for its tracked save to
     complete. An untracked slot is taken as done (see the contract below).
  3. Acquire the slot from the ``_ext.StagingPool`` (a file in /dev/shm, mapped once,
     pre-faulted, grown only when the state grows), so after the first save no page
     fault and no allocation happens.
  4. Copy: CUDA tensors device-to-host on a side stream per device (which first waits
     for the device's current stream) into the slot, registered once as pinned memory
     (``cudaHostRegister``); meanwhile contiguous CPU tensors are copied by one parallel
     memcpy in C++ with the GIL released; other CPU tensors (non-contiguous, conjugate
     or negative views) by ``Tensor.copy_``; then the side streams are synchronized.
  5. Return the same structure with each tensor replaced by a CPU tensor viewing the
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
import fcntl
import gc
import os
import shutil
import uuid
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import AsyncStager

from cairn import _ext
from cairn.errors import InvalidArgumentError, PreconditionError, TimeoutError

__all__ = ["SharedMemoryStager"]

_SMALL_ALIGN = 64
_LARGE_ALIGN = 4096
_LARGE = 1 << 20


def _align(nbytes: int) -> int:
    return _LARGE_ALIGN if nbytes >= _LARGE else _SMALL_ALIGN


_PREFIX = "cairn-stager-"


def _remove_stale(parent: str) -> None:
    """Deletes staging directories left in `parent` by stagers whose process died
    without closing (a crash, SIGKILL): the process named in the directory is gone
    and no live process holds a lock on any of its files (every open pool flocks its
    slot files), so nothing can still be using them."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        try:
            os.kill(int(name[len(_PREFIX):].split("-")[0]), 0)
            continue  # alive (or not ours to signal): leave it
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError, OSError):
            continue
        path = os.path.join(parent, name)
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        if all(_unlocked(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files):
            shutil.rmtree(path, ignore_errors=True)


def _unlocked(path: str) -> bool:
    try:
        # O_NONBLOCK: a FIFO in the tree must not block the scan.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _free(pool: Any, shm_dir: str) -> None:
    """Closes the pool and removes its directory (also run at interpreter exit)."""
    try:
        pool.close()
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


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


class SharedMemoryStager(AsyncStager):
    """An ``AsyncStager`` for ``dcp.async_save`` that stages into reusable buffers in
    node shared memory (see the module docstring for the protocol and contract).

    Args:
        slots: staging buffers (>= 1): saves in flight while the next one stages + 1.
        threads: memcpy threads, counting the calling one (default: up to 8).
        timeout: seconds ``stage`` waits for a tracked save to free its slot.
        pin_memory: register the slots as pinned CUDA host memory when CUDA tensors
            are staged (device-to-host copies then run asynchronously on a side stream).

    Owns its shared-memory directory (``shm_dir``, unique to this stager); ``close()``
    deletes it.
    """

    _synchronize_after_execute = False  # stage() returns once the copy is complete

    def __init__(self, slots: int = 2, *, threads: int | None = None, timeout: float = 600.0,
                 pin_memory: bool = True) -> None:
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise InvalidArgumentError(f"slots must be an int >= 1, got {slots!r}")
        if not timeout or timeout <= 0:
            raise InvalidArgumentError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.pin_memory = bool(pin_memory)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.shm_dir = _ext.shm_directory(f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        _remove_stale(os.path.dirname(self.shm_dir))
        self._pool = _ext.StagingPool(self.shm_dir, rank=rank, num_slots=slots,
                                      threads=threads or max(2, min(8, os.cpu_count() or 2)),
                                      remove_on_close=True)
        # Frees the shared memory if close() is never called (garbage collection or
        # interpreter exit); a crash leaves files that the next stager on the node removes.
        self._finalizer = weakref.finalize(self, _free, self._pool, self.shm_dir)
        self._slots = [_Slot(i) for i in range(slots)]
        self._stages = 0
        self._registered: dict[int, tuple[int, int]] = {}  # slot -> pinned (address, size)
        self._streams: dict[torch.device, Any] = {}
        self._closed = False
        self.last_stage_bytes = 0

    # ---- the AsyncStager protocol ------------------------------------------------

    @torch.no_grad()
    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        """Returns a copy of `state_dict` whose tensors live in a staging slot."""
        if self._closed:
            raise PreconditionError("SharedMemoryStager is closed")
        leaves: dict[int, tuple[torch.Tensor, int, int]] = {}  # id -> (src, offset, nbytes)
        keep: list[torch.Tensor] = []  # keeps ids unique while we walk
        total = 0

        def collect(x: Any) -> None:
            nonlocal total
            if isinstance(x, torch.Tensor):
                src = self._local(x)
                if id(src) in leaves:
                    return
                self._check_tensor(src)
                nbytes = src.numel() * src.element_size()
                if nbytes:
                    total = (total + _align(nbytes) - 1) // _align(nbytes) * _align(nbytes)
                leaves[id(src)] = (src, total, nbytes)
                keep.append(src)
                total += nbytes
            elif isinstance(x, dict):
                for v in x.values():
                    collect(v)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    collect(v)

        collect(state_dict)
        self._stages += 1
        views: dict[int, torch.Tensor] = {}
        if total:
            slot = self._take_slot()
            info, base = self._acquire(slot.index, total)
            self._copy(slot.index, info, base, leaves.values(), views)
            slot.used, slot.stamp, slot.future = True, self._stages, None
            slot.awaiting_track = True
            for s in self._slots:
                if s is not slot:
                    s.awaiting_track = False
        for src, _, nbytes in leaves.values():
            if not nbytes:
                views[id(src)] = torch.empty(src.shape, dtype=src.dtype,
                                             requires_grad=src.requires_grad)
        self.last_stage_bytes = total
        return self._rebuild(state_dict, views, {})

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once its copies are complete."""

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

    def _acquire(self, index: int, nbytes: int) -> tuple[dict, torch.Tensor]:
        if self._pool.in_use(index):
            self._pool.release(index)
        pinned = self._registered.get(index)
        if pinned is not None and nbytes > pinned[1]:
            self._unpin(index)  # growing moves the mapping: unregister it while it exists
        try:
            info = self._pool.acquire_slot(index, nbytes)
        except PreconditionError:
            # The slot must grow, which moves its memory, but tensors over it are still
            # alive: typically the previous state dict waiting for the collector.
            gc.collect()
            info = self._pool.acquire_slot(index, nbytes)
        return info, torch.frombuffer(self._pool.buffer(index), dtype=torch.uint8)

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

    def _copy(self, index: int, info: dict, base: torch.Tensor, leaves: Any,
              views: dict[int, torch.Tensor]) -> None:
        spans, torch_copies, device_copies = [], [], []
        for src, off, nbytes in leaves:
            if not nbytes:
                continue
            dst = base[off:off + nbytes].view(src.dtype).view(src.shape)
            if src.requires_grad:
                dst.requires_grad_(True)
            views[id(src)] = dst
            if src.device.type != "cpu":
                device_copies.append((src, dst))
            elif src.is_contiguous() and not src.is_conj() and not src.is_neg():
                spans.append((src.data_ptr(), off, nbytes))
            else:
                torch_copies.append((src, dst))
        streams = self._copy_from_devices(index, info, device_copies) if device_copies else []
        if spans:
            self._pool.copy_in(index, spans)
        for src, dst in torch_copies:
            dst.detach().copy_(src)
        for s in streams:
            s.synchronize()

    def _copy_from_devices(self, index: int, info: dict, items: list) -> list:
        """Enqueues device-to-host copies; returns the streams to synchronize."""
        cuda = [(s, d) for s, d in items if s.device.type == "cuda"]
        for src, dst in items:
            if src.device.type != "cuda":
                dst.detach().copy_(src)  # other accelerators: a plain blocking copy
        if not cuda:
            return []
        pinned = self._pin(index, int(info["address"]), int(info["capacity"]))
        streams = []
        for device in {s.device for s, _ in cuda}:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            # The tensors may still be written by kernels queued on the current stream.
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for src, dst in cuda:
                    if src.device == device:
                        dst.detach().copy_(src, non_blocking=pinned)
            streams.append(stream)
        return streams

    def _pin(self, index: int, address: int, size: int) -> bool:
        """Registers slot `index` as pinned host memory (again if it moved)."""
        if not self.pin_memory:
            return False
        if self._registered.get(index) == (address, size):
            return True
        self._unpin(index)
        rc = torch.cuda.cudart().cudaHostRegister(address, size, 1)  # cudaHostRegisterPortable
        if int(rc) != 0:
            warnings.warn(f"cairn: cudaHostRegister of a {size}-byte staging slot failed "
                          f"(error {int(rc)}); device-to-host copies will not be asynchronous",
                          RuntimeWarning, stacklevel=4)
            self.pin_memory = False
            return False
        self._registered[index] = (address, size)
        return True

    def _unpin(self, index: int) -> None:
        old = self._registered.pop(index, None)
        if old is not None:
            rc = torch.cuda.cudart().cudaHostUnregister(old[0])
            if int(rc) != 0:
                warnings.warn(f"cairn: cudaHostUnregister of a staging slot failed "
                              f"(error {int(rc)})", RuntimeWarning, stacklevel=3)

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
            for index in list(self._registered):
                self._unpin(index)
        finally:
            self._finalizer()

    def __enter__(self) -> "SharedMemoryStager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
