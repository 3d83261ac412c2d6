"""cairn: cheap checkpoints, quick recovery and exact resume for PyTorch training."""

from cairn.checkpoint import copy_checkpoint, latest_valid, list_checkpoints, verify
from cairn.dcp import Reader, Writer
from cairn.errors import (
    CorruptionError,
    Error,
    InvalidArgumentError,
    NotFoundError,
)

__version__ = "0.1.0"
