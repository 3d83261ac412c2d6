"""Checkpoint-level helpers that need no torch: find and verify checkpoints."""

from __future__ import annotations

import errno
import os
import warnings

from cairn import _ext, _pools
from cairn.errors import NotFoundError

__all__ = ["latest_valid", "verify", "list_checkpoints", "copy_checkpoint", "remove_checkpoint"]


def _root_uri(path: str | os.PathLike) -> str:
    s = os.fspath(path)
    if not isinstance(s, str) or not s:
        raise ValueError(f"invalid path {path!r}")
    return s


def open_path(path: "str | os.PathLike | _ext.Storage", what: str = "",
              create: bool = False) -> _ext.Storage:
    """The storage at `path`, opened once by the engine's registry (an open storage
    as it is). Without `create`, a missing `path` is NotFoundError, "no such
    <what>: <path>" when `what` is given ("not a <what>" for a file); with
    `create`, the engine's error as it is (e.g. S3's NoSuchBucket)."""
    if isinstance(path, _ext.Storage):
        return path
    uri = _root_uri(path)
    try:
        return _ext.open_storage(uri, create=create)
    except NotFoundError as e:
        if not what or create:
            raise  # creating: the engine names what is missing (e.g. S3's NoSuchBucket)
        if getattr(e, "sys_errno", 0) == errno.ENOTDIR:  # e.g. a file, not a directory
            raise NotFoundError(f"not a {what} (a directory): {e}") from e
        raise NotFoundError(f"no such {what}: {uri}") from e


def latest_valid(root: str | os.PathLike) -> str | None:
    """Path of the newest committed checkpoint directly below ``root``, or None.

    Partial checkpoints (no manifest, or a damaged one) are skipped; data files
    are not read (use :func:`verify`). A newer directory whose manifest is
    damaged or unusable (e.g. a FIFO where the manifest belongs) is skipped
    with a ``RuntimeWarning`` naming it; one without a manifest (a save in
    flight, or that crashed) silently. Directories named ``step_<N>`` order by
    N and count as newer than any other name; others order by the manifest's
    creation time. A ``root`` that does not exist (yet) has none: None.
    """
    try:
        storage = open_path(root)
    except NotFoundError:
        return None
    uri, skipped = _ext.latest_valid_uri(storage)
    warn_skipped(skipped, stacklevel=3)
    return uri


def warn_skipped(skipped: list[tuple[str, str]], stacklevel: int = 3) -> None:
    """A RuntimeWarning for each damaged checkpoint (uri, status) discovery skipped."""
    for uri, status in skipped:
        warnings.warn(f"cairn: skipping {uri}: {status}", RuntimeWarning, stacklevel=stacklevel)


def list_checkpoints(root: str | os.PathLike) -> list[dict]:
    """Every directory below ``root``, oldest first: name, step, committed,
    status, bytes, created_unix_ms, world_size."""
    return _ext.list_checkpoints(open_path(root))


def verify(path: str | os.PathLike) -> None:
    """Checks every byte of the checkpoint at ``path``.

    Returns None when it is intact. Raises :class:`cairn.CorruptionError`
    naming the file and tensor on any damage (flipped byte, truncated or
    missing file, damaged or missing manifest) and :class:`cairn.NotFoundError`
    when ``path`` does not exist.
    """
    _ext.verify(open_path(path, "checkpoint"), _pools.io_pool())


def copy_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    sync: bool = True,
    direct_io: bool = True,
    verify_destination: bool = False,
    thread_count: int | None = None,
) -> None:
    """Copies the committed checkpoint ``src`` to ``dst`` (directories or
    ``shm://`` URIs), in parallel.

    Every block is checked against its checksum as it is copied; the data
    files are synced (unless ``sync=False``, e.g. for a shared-memory
    destination), optionally re-read and verified, and the manifest is
    committed at ``dst`` last, so ``dst`` is either a complete checkpoint or
    uncommitted. Raises :class:`cairn.CorruptionError` if ``src`` is damaged
    and :class:`cairn.NotFoundError` if it does not exist.
    """
    pool = _ext.ThreadPool(thread_count) if thread_count else _pools.io_pool()
    _ext.copy_checkpoint(
        open_path(src, "checkpoint"),
        _root_uri(dst),
        pool,
        direct_io=direct_io,
        sync=sync,
        verify_destination=verify_destination,
    )


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Removes the one checkpoint at ``path`` (committed or partial), manifest first.

    ``path`` is any URI cairn takes; this is how a checkpoint saved to
    ``shm://NAME`` (``/dev/shm/NAME``, which outlives the process) is freed: the
    directory goes too. Raises :class:`cairn.errors.PreconditionError` before removing
    anything when ``path`` is not a cairn checkpoint (a root holding checkpoints:
    name one, or use ``cairn prune``; a stock DCP checkpoint; another directory)
    and :class:`cairn.NotFoundError` when it does not exist. The same as
    ``cairn rm PATH``. A ``CheckpointManager``'s memory tier is not removed this
    way: ``close()`` frees it, ``cairn gc`` reclaims a crashed run's.
    """
    _ext.remove_checkpoint(_root_uri(path))
