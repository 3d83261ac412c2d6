"""Which DCP storage backends the multi-rank tests exercise, in one place.

``writer(kind, path)`` / ``reader(kind, path)`` with kind ``"cairn"`` (cairn's own
format) or ``"stock"`` (a checkpoint written by stock ``dcp.save``; read back
through cairn). Until cairn.Writer/Reader exist, ``"cairn"`` falls back to
DCP's filesystem backends so the harness itself stays tested.
"""

from __future__ import annotations

import torch.distributed.checkpoint as dcp

import cairn
from cairn._stock import StockReader

CAIRN_READY = hasattr(cairn, "Writer") and hasattr(cairn, "Reader")


def writer(kind: str, path: str):
    if kind == "stock":
        return dcp.FileSystemWriter(path)
    if kind == "cairn":
        return cairn.Writer(path) if CAIRN_READY else dcp.FileSystemWriter(path)
    raise ValueError(kind)


def reader(kind: str, path: str):
    if kind == "stock":
        # cairn.Reader delegates to StockReader for stock checkpoints.
        return cairn.Reader(path) if CAIRN_READY else StockReader(path)
    if kind == "cairn":
        return cairn.Reader(path) if CAIRN_READY else dcp.FileSystemReader(path)
    raise ValueError(kind)
