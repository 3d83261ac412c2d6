"""cairn: cheap checkpoints, quick recovery and exact resume for PyTorch training."""

from cairn.checkpoint import copy_checkpoint, latest_valid, list_checkpoints, verify
from cairn.errors import (
    CorruptionError,
    Error,
    InvalidArgumentError,
    NotFoundError,
)

__version__ = "0.1.0"

# The DCP adapters import torch.distributed.checkpoint (about a second), so
# they load on first use: `import cairn` stays cheap for data workers and tools.
_LAZY = {"Writer": "cairn.dcp", "Reader": "cairn.dcp", "dcp": "cairn.dcp"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cairn' has no attribute {name!r}")
    import importlib

    mod = importlib.import_module(module)
    return mod if name == "dcp" else getattr(mod, name)


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
