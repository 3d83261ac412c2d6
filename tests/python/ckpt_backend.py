"""Which DCP storage backends the multi-rank tests exercise, in one place.

``writer(kind, path)`` / ``reader(kind, path)`` with kind ``"cairn"`` (cairn's own
format) or ``"stock"`` (a checkpoint written by stock ``dcp.save`` with the
filesystem writer, read back through ``cairn.Reader``, which delegates to
``cairn._stock_reader.StockReader``).
"""

from __future__ import annotations

import torch.distributed.checkpoint as dcp

import cairn


def writer(kind: str, path: str):
    if kind == "stock":
        return dcp.FileSystemWriter(path)
    if kind == "cairn":
        return cairn.Writer(path)
    raise ValueError(kind)


def reader(kind: str, path: str):
    if kind in ("stock", "cairn"):
        return cairn.Reader(path)
    raise ValueError(kind)
