"""fsync of a peer's files, for peers that do not fsync what they write: "durable"
means the same for every row (the bytes and the directory entry on disk)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_tree(top: Path) -> None:
    for base, dirs, files in os.walk(top):
        for name in files:
            fsync_file(os.path.join(base, name))
        fsync_file(base)


def fsync_file(path: Path) -> None:
    """fsync of one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
