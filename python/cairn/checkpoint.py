"""Checkpoint-level helpers that need no torch: find and verify checkpoints."""

from __future__ import annotations

import os

from cairn import _ext

__all__ = ["latest_valid", "verify", "list_checkpoints"]


def _root_uri(path: str | os.PathLike) -> str:
    s = os.fspath(path)
    if not isinstance(s, str) or not s:
        raise ValueError(f"invalid path {path!r}")
    return s


def _default_pool() -> _ext.ThreadPool:
    return _ext.ThreadPool(max(4, min(16, os.cpu_count() or 4)))


def latest_valid(root: str | os.PathLike) -> str | None:
    """Path of the newest committed checkpoint directly below ``root``, or None.

    Partial checkpoints (no manifest, or a damaged one) are skipped; data files
    are not read (use :func:`verify`). Directories named ``step_<N>`` order by
    N and count as newer than any other name; others order by the manifest's
    creation time. Raises :class:`cairn.NotFoundError` if ``root`` does not exist.
    """
    uri = _root_uri(root)
    name = _ext.latest_valid(uri)
    if name is None:
        return None
    return uri.rstrip("/") + "/" + name


def list_checkpoints(root: str | os.PathLike) -> list[dict]:
    """Every directory below ``root``, oldest first: name, step, committed,
    status, bytes, created_unix_ms, world_size."""
    return _ext.list_checkpoints(_root_uri(root))


def verify(path: str | os.PathLike) -> None:
    """Checks every byte of the checkpoint at ``path``.

    Returns None when it is intact. Raises :class:`cairn.CorruptionError`
    naming the file and tensor on any damage (flipped byte, truncated or
    missing file, damaged manifest) and :class:`cairn.NotFoundError` when
    there is no committed checkpoint at ``path``.
    """
    _ext.verify(_root_uri(path), _default_pool())
