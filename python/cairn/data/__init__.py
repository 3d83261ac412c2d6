"""cairn.data: cached, partitioned, exactly resumable data pipelines.

* :class:`CachedFileDataset` serves the files of a slow source from a
  node-local cache filled by a C++ prefetching engine.
* :class:`ShardDataset` streams samples from shards with a checkpointable
  position.
* :class:`DataLoader` is a ``torch.utils.data.DataLoader`` with persistent
  workers, ``set_epoch`` and ``state_dict``/``load_state_dict``.
"""

from cairn.data._partition import epoch_order
from cairn.data.cached import CachedFileDataset, default_cache_dir
from cairn.data.loader import DataLoader
from cairn.data.shards import ShardDataset

__all__ = ["CachedFileDataset", "DataLoader", "ShardDataset", "default_cache_dir", "epoch_order"]
