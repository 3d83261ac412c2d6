"""cairn: cheap checkpoints, quick recovery and exact resume for PyTorch training.

Three depths of use: ``cairn.Writer``/``cairn.Reader`` as DCP storage backends;
``cairn.CheckpointManager`` owning checkpointing and recovery of a run; and
``cairn.data`` for a cached, partitioned, resumable data pipeline.
"""

from cairn.discovery import (
    copy_checkpoint,
    latest_valid,
    list_checkpoints,
    remove_checkpoint,
    verify,
)
from cairn.errors import (
    CorruptionError,
    Error,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    ResourceExhaustedError,
    StorageError,
    TimeoutError,
    TransientError,
    UnavailableError,
)

__version__ = "0.1.0"

# Everything that imports torch loads on first use, so `import cairn` stays cheap
# for data workers and tools.
_LAZY = {
    "Writer": "cairn.dcp",
    "Reader": "cairn.dcp",
    "dcp": "cairn.dcp",
    "CheckpointManager": "cairn.manager",
    "SharedMemoryStager": "cairn.stager",
    "init_distributed": "cairn.distributed",
    "settle_ddp_buckets": "cairn.distributed",
    "RNGState": "cairn.state",
    "TrainState": "cairn.state",
    "seed_everything": "cairn.state",
    "data": "cairn.data",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cairn' has no attribute {name!r}")
    import importlib

    mod = importlib.import_module(module)
    return mod if name in ("dcp", "data") else getattr(mod, name)


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
