#!/usr/bin/env python3
"""Decoding cached files: token shards behind a slow mount, fed to training.

CachedFileDataset yields *local paths* (the file is already in the node-local
cache, so decoding never touches the slow mount); a small IterableDataset
wraps it and decodes each file into tensors, inside the DataLoader workers.
The loader's position goes into the checkpoint with everything else.

    PYTHONPATH=python python examples/decode_example.py [SOURCE_DIR]

Without SOURCE_DIR, it writes 64 demo token files to a temp dir and reads
them through ``slow://`` (5 ms per file, 50 MB/s), to feel like a network mount.
"""

import os
import sys
import tempfile

import numpy as np
import torch

import cairn.data

SEQ = 128


class TokenFiles(torch.utils.data.IterableDataset):
    """Decodes each cached token file (raw int32) into SEQ-long sequences."""

    def __init__(self, paths: cairn.data.CachedFileDataset):
        self.paths = paths  # cairn.data.DataLoader finds it here

    def __iter__(self):
        for local_path in self.paths:
            tokens = np.fromfile(local_path, dtype=np.int32)
            # Whole file decoded while the path is pinned; the pin is released
            # a few files later, so nothing is evicted under our feet.
            yield torch.from_numpy(tokens[: len(tokens) // SEQ * SEQ].reshape(-1, SEQ)[0].copy())


SHARE = f"decode-example-{os.getpid()}"  # names the demo's bandwidth pipe in /dev/shm


def demo_source(root: str) -> str:
    rng = np.random.default_rng(0)
    for i in range(64):
        rng.integers(0, 50_000, size=4 * SEQ, dtype=np.int32).tofile(f"{root}/shard{i:03d}.bin")
    return f"slow://{root}?latency=0.005&bandwidth=50e6&share={SHARE}"


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="cairn-example-") as tmp:
        if len(sys.argv) > 1:
            source = sys.argv[1]
        else:
            os.makedirs(f"{tmp}/src")
            source = demo_source(f"{tmp}/src")
        try:
            run(source, cache_dir=f"{tmp}/cache")
        finally:
            if os.path.exists(f"/dev/shm/cairn-throttle-{SHARE}"):
                os.unlink(f"/dev/shm/cairn-throttle-{SHARE}")


def run(source: str, cache_dir: str) -> None:
    paths = cairn.data.CachedFileDataset(source, cache_dir=cache_dir, shuffle=True, seed=0)
    loader = cairn.data.DataLoader(TokenFiles(paths), batch_size=8, num_workers=2)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for step, batch in enumerate(loader):
            if step == 3 and epoch == 0:
                # This dict goes into the checkpoint (it is a DCP Stateful);
                # load_state_dict() on restart resumes at the next batch.
                print("position after 4 batches:", loader.state_dict())
        print(f"epoch {epoch}: last batch {tuple(batch.shape)}, cache:",
              {k: v for k, v in paths.cache_stats().items() if k.startswith("shared")})


if __name__ == "__main__":
    main()
