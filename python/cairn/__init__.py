"""cairn: cheap checkpoints, quick recovery and exact resume for PyTorch training.

Three depths of use: ``cairn.Writer``/``cairn.Reader`` as DCP storage backends;
``cairn.CheckpointManager`` owning checkpointing and recovery of a run; and
``cairn.data`` for a cached, partitioned, resumable data pipeline.
"""

from cairn.errors import (
    CorruptionError,
    Error,
    InvalidArgumentError,
    NotFoundError,
)
from cairn.checkpoint import latest_valid, list_checkpoints, verify
from cairn.dcp import Reader, Writer
from cairn.manager import CheckpointManager
from cairn.stager import SharedMemoryStager
from cairn.distributed import init_distributed
from cairn.state import RNGState, TrainState, seed_everything
from cairn import data  # noqa: F401 - cairn.data.CachedFileDataset, DataLoader, ShardDataset

__version__ = "0.1.0"
