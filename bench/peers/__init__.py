"""One adapter per checkpointing library cairn is compared with (bench/peers.py).

Every adapter is a class with the same small interface (``Adapter`` below), written
from the peer's own documentation, used the way its docs recommend for a
data-parallel job whose every rank holds the same state (DDP):

* ``save(step, state)``: starts a save and returns when training may go on and
  change the state (the blocking stall);
* ``wait()``: returns once that save is durable on local disk;
* ``restore(dest) -> tier``: in a fresh process (after the saving one was
  SIGKILLed), loads the newest checkpoint from the fastest tier the peer has into
  ``dest`` (a state of the same structure) and names the tier;
* ``restore_disk(dest)``: the same from the disk copy only (an adapter whose
  ``has_disk_tier`` is False has none: the harness reports no figure);
* ``close()``: ends the session (what it leaves behind is measured by the harness).

``ADAPTERS`` maps a peer's name to ``module:Class``; modules are imported lazily
so that a missing peer only disables its own rows.
"""

from __future__ import annotations

import importlib

ADAPTERS = {
    "cairn": "bench.peers.cairn_manager:CairnManager",
    "dlrover": "bench.peers.dlrover_flash:DlroverFlash",
    "torchsnapshot": "bench.peers.torchsnapshot_async:TorchSnapshotAsync",
    "nvrx": "bench.peers.nvrx_async:NvrxAsync",
    "nvrx-local": "bench.peers.nvrx_local:NvrxLocal",
    "nvrx-local-disk": "bench.peers.nvrx_local:NvrxLocalDisk",
    # The same DLRover adapter, its job run under dlrover-run and DLRover's local
    # master (bench/peers.py: SUPERVISED): its agent keeps the shared memory
    # across the worker's SIGKILL and restarts the worker, which restores from it.
    "dlrover-run": "bench.peers.dlrover_flash:DlroverFlashAgent",
}


def load(name: str):
    """The adapter class registered as `name`."""
    module, cls = ADAPTERS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def copy_into(dest, src) -> None:
    """Copies the tensors of `src` into those of `dest` (same structure), in place;
    non-tensor leaves are checked to be equal."""
    import torch

    if isinstance(dest, torch.Tensor):
        if not isinstance(src, torch.Tensor) or src.shape != dest.shape:
            raise ValueError(f"restored leaf {type(src)} does not match {dest.shape}")
        dest.copy_(src)
    elif isinstance(dest, dict):
        if set(dest) != set(src):
            raise ValueError(f"restored keys {sorted(src)[:5]}... differ")
        for k in dest:
            copy_into(dest[k], src[k])
    elif isinstance(dest, (list, tuple)):
        if len(dest) != len(src):
            raise ValueError("restored list length differs")
        for a, b in zip(dest, src):
            copy_into(a, b)
    elif dest != src:
        raise ValueError(f"restored value {src!r} != {dest!r}")
