"""The Python side of the staging engine, shared by the CheckpointManager and the
SharedMemoryStager.

The slot layout, the host copies, the padding, the checksums and the writing of a
slot as a data file are C++ (``StagingPool`` in include/cairn/staging.h). What is
left here is what only torch can do: copying tensors that are not in host memory,
and pinning the slot for those copies. This is the one place that does it.

One save into slot k (``SlotStager.stage``):
  1. C++ lays the items out as a data file lays them out and acquires slot k with
     room for them (``begin_save``). A slot registered as pinned memory is
     unregistered first if it must grow: growing may move it.
  2. Tensors on a CUDA device: device-to-host copies into the slot on a side stream
     per device, which first waits for that device's current stream (the optimizer
     step may still be running), non-blocking when the slot is pinned
     (``cudaHostRegister``, once per slot mapping). Other devices: a blocking
     ``copy_``.
  3. Meanwhile, host items that memcpy can copy (contiguous tensors and byte
     buffers): one parallel memcpy in C++ with the GIL released, in two halves
     around ``midway()`` (the chaos harness's "stage" point).
  4. Host tensors memcpy cannot copy (non-contiguous, conjugate or negative views):
     ``Tensor.copy_`` into the slot.
  5. C++ zeroes every byte of the slot that is no item's; the side streams are
     synchronized. On any error the slot is released.

Pinning, one behaviour: when ``cudaHostRegister`` fails (e.g. the locked-memory
limit), the stager warns once (``RuntimeWarning``) and goes on with pageable
memory: device-to-host copies are then synchronous, slower but correct. A save
never fails because the slot could not be pinned.

Not thread-safe: one stager is used from one thread at a time.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from cairn import _ext
from cairn.errors import PreconditionError

__all__ = ["SlotStager"]

# cudaHostRegisterPortable: the memory is pinned for every CUDA context.
_HOST_REGISTER_PORTABLE = 1


def staged_nbytes(src: Any) -> int:
    """The bytes a source (a tensor or a uint8 array) takes in a slot."""
    if isinstance(src, torch.Tensor):
        return src.numel() * src.element_size()
    return int(src.nbytes)


class SlotStager:
    """Stages items (tensors, or uint8 numpy arrays) into the slots of one
    ``_ext.StagingPool`` (see the module docstring).

    Args:
        pool: the staging pool; its own copy threads do the memcpy.
        pin_memory: register slots as pinned memory for CUDA copies.
    """

    def __init__(self, pool: Any, *, pin_memory: bool = True) -> None:
        self.pool = pool
        self.pin_memory = bool(pin_memory)
        # Route host tensors through the device path too (tests of its CPU fallback).
        self.device_path_for_tests = False
        self.registered: dict[int, tuple[int, int]] = {}  # slot -> pinned (address, size)
        self._streams: dict[torch.device, Any] = {}
        self._warned = False

    def stage(self, slot: int, sources: Sequence[Any], *,
              midway: Callable[[], None] | None = None,
              views: bool = False,
              lengths: list[int] | None = None) -> tuple[Any, list[torch.Tensor | None]]:
        """Stages `sources` into slot `slot` (which must not be acquired). Returns the
        ``_ext.StagedSave`` (item i at ``offsets[i]``) and, with `views`, a CPU tensor
        over the slot for every tensor source (same dtype and shape; None for byte
        buffers and empty tensors). The slot stays acquired until released.
        `lengths`, when given, is ``[staged_nbytes(s) for s in sources]``."""
        if lengths is None:
            lengths = [staged_nbytes(s) for s in sources]
        save = self._begin(slot, lengths)
        try:
            out = self._fill(save, sources, lengths, midway, views)
        except BaseException:
            self.pool.release(slot)
            raise
        return save, out

    def _begin(self, slot: int, lengths: list[int]) -> Any:
        pinned = self.registered.get(slot)
        if pinned is not None and pinned[1] < _ext.staged_bytes(lengths):
            self.unpin(slot)  # it will grow, which may move it: unregister while it exists
        try:
            return self.pool.begin_save(slot, lengths)
        except PreconditionError:
            # Growing moves the slot's memory, but tensors over it are still alive:
            # typically the previous state dict waiting for the collector.
            gc.collect()
            return self.pool.begin_save(slot, lengths)

    def _fill(self, save: Any, sources: Sequence[Any], lengths: list[int],
              midway: Callable[[], None] | None, views: bool) -> list[torch.Tensor | None]:
        base = None
        out: list[torch.Tensor | None] = [None] * len(sources)
        memcpy: list[tuple[int, int]] = []  # (item, address)
        by_torch: list[tuple[torch.Tensor, torch.Tensor]] = []  # (src, slot view)
        on_device: list[tuple[torch.Tensor, torch.Tensor]] = []
        offsets = save.offsets
        for i, src in enumerate(sources):
            if not lengths[i]:
                continue
            if not isinstance(src, torch.Tensor):
                memcpy.append((i, src.ctypes.data))
                continue
            host = src.device.type == "cpu"
            plain = (host and src.is_contiguous() and not src.is_conj() and not src.is_neg()
                     and not self.device_path_for_tests)
            if plain and not views:
                memcpy.append((i, src.data_ptr()))
                continue
            if base is None:
                base = torch.frombuffer(self.pool.buffer(save.slot), dtype=torch.uint8)
            dst = base[offsets[i]:offsets[i] + lengths[i]].view(src.dtype).view(src.shape)
            out[i] = dst
            if plain:
                memcpy.append((i, src.data_ptr()))
            elif host:  # detached: a copy into the slot records no autograd history
                by_torch.append((src.detach(), dst))
            else:
                on_device.append((src.detach(), dst))
        streams = self._copy_from_devices(save, on_device) if on_device else []
        half = len(memcpy) // 2
        self.pool.copy_items(save, memcpy[:half])
        if midway is not None:
            midway()
        self.pool.copy_items(save, memcpy[half:])
        for src, dst in by_torch:
            dst.copy_(src)
        self.pool.zero_padding(save)
        for s in streams:
            s.synchronize()
        return out if views else []

    def _copy_from_devices(self, save: Any, items: list) -> list:
        """Enqueues device-to-host copies; returns the streams to synchronize."""
        cuda = [(s, d) for s, d in items if s.device.type == "cuda"]
        for src, dst in items:
            if src.device.type != "cuda":
                dst.copy_(src)  # other accelerators: a plain blocking copy
        if not cuda:
            return []
        pinned = self._pin(save.slot, int(save.address), int(save.capacity))
        streams = []
        for device in {s.device for s, _ in cuda}:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for src, dst in cuda:
                    if src.device == device:
                        dst.copy_(src, non_blocking=pinned)
            streams.append(stream)
        return streams

    def _pin(self, slot: int, address: int, size: int) -> bool:
        """Registers `slot` as pinned host memory (again if it moved); False when it
        is not pinned (see "Pinning" in the module docstring)."""
        if not self.pin_memory:
            return False
        if self.registered.get(slot) == (address, size):
            return True
        self.unpin(slot)
        rc = int(torch.cuda.cudart().cudaHostRegister(address, size, _HOST_REGISTER_PORTABLE))
        if rc != 0:
            if not self._warned:
                warnings.warn(f"cairn: cudaHostRegister of a {size}-byte staging slot failed "
                              f"(error {rc}); device-to-host copies will be synchronous",
                              RuntimeWarning, stacklevel=5)
                self._warned = True
            self.pin_memory = False
            return False
        self.registered[slot] = (address, size)
        return True

    def unpin(self, slot: int) -> None:
        """Unregisters `slot` as pinned memory, if it is."""
        old = self.registered.pop(slot, None)
        if old is not None:
            rc = int(torch.cuda.cudart().cudaHostUnregister(old[0]))
            if rc != 0:
                warnings.warn(f"cairn: cudaHostUnregister of a staging slot failed (error {rc})",
                              RuntimeWarning, stacklevel=3)

    def unpin_all(self) -> None:
        for slot in list(self.registered):
            self.unpin(slot)


def byte_source(buf: Any) -> np.ndarray:
    """A uint8 array over a bytes-like value (no copy), as ``stage`` takes it."""
    return np.frombuffer(buf, dtype=np.uint8)
