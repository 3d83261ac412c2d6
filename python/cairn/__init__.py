"""cairn: cheap checkpoints, quick recovery and exact resume for PyTorch training."""

from cairn.errors import (
    CorruptionError,
    Error,
    InvalidArgumentError,
    NotFoundError,
)

__version__ = "0.1.0"
from cairn import data  # noqa: E402,F401 - cairn.data.CachedFileDataset etc.
