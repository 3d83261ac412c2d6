"""The control block: how the main process tells (persistent) workers what to
iterate next.

A :class:`cairn.data.DataLoader` creates one ``Control`` before its workers
start and attaches it to its dataset. It lives in shared memory (a
``multiprocessing.RawArray`` inherited by, or handed to, the workers at their
start), so values the main process writes at the start of an iteration
(epoch, position, rank, world size, batch size) are what a persistent worker
reads when ``torch.utils.data.DataLoader`` makes it call ``iter(dataset)``
again for the next epoch. Only the main process writes, and only between
iterations, so no lock is needed.
"""

from __future__ import annotations

import multiprocessing

_FIELDS = (
    "epoch",
    "start",
    "rank",
    "world_size",
    "batch_size",
    "pin_window",
    "consumers",
    "num_workers",
)


class Control:
    """Shared integers read by datasets at the start of each iteration."""

    def __init__(self) -> None:
        self._arr = multiprocessing.RawArray("q", len(_FIELDS))

    def __getattr__(self, name: str) -> int:
        if name in _FIELDS:
            return int(self._arr[_FIELDS.index(name)])
        raise AttributeError(name)

    def set(self, **values: int) -> None:
        for k, v in values.items():
            self._arr[_FIELDS.index(k)] = int(v)

    def snapshot(self) -> dict:
        return {k: int(self._arr[i]) for i, k in enumerate(_FIELDS)}
