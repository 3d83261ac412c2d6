"""cairn's exception hierarchy.

Every error cairn raises derives from :class:`Error`. The C++ core reports a
``Status`` code; :func:`exception_for_code` is the one place that maps a code to
its class. Not-found cases are also ``FileNotFoundError``, bad arguments are
also ``ValueError``, timeouts are also ``TimeoutError``.

Retryable and permanent errors stay apart: a :class:`TransientError` (C++
``Unavailable`` or ``DeadlineExceeded``) may go away if the same call is retried
with backoff; every other error will not. A storage that is unavailable raises
:class:`UnavailableError`, which is both a ``TransientError`` and, as every
storage failure, a :class:`StorageError`::

    try:
        dcp.save(state, storage_writer=cairn.Writer(uri))
    except cairn.TransientError:
        ...  # back off and try again
    except cairn.Error:
        ...  # permanent: report it
"""

from __future__ import annotations

import builtins


class Error(Exception):
    """Base class of every cairn error."""

    code: str = "Unknown"
    sys_errno: int = 0


class CorruptionError(Error):
    """Stored data is corrupt or incomplete (checksum mismatch, truncated or
    missing file, malformed manifest). The message names the file and tensor."""


class NotFoundError(Error, FileNotFoundError):
    """A checkpoint, file or directory does not exist."""


class InvalidArgumentError(Error, ValueError):
    """An argument (or a field of a manifest) is malformed."""


class PermissionDeniedError(Error, PermissionError):
    """The operating system refused access."""


class ResourceExhaustedError(Error, OSError):
    """Out of disk space, memory or another bounded resource."""


class TransientError(Error):
    """A failure that may go away if the same call is retried with backoff
    (a storage unavailable or throttled, a deadline that expired)."""


class TimeoutError(TransientError, builtins.TimeoutError):  # noqa: A001 - deliberate
    """A wait or a collective ran past its timeout."""


class StorageError(Error, OSError):
    """An I/O failure of the storage (EIO and friends, transient or not)."""


class UnavailableError(TransientError, StorageError):
    """The storage is unavailable for now (EAGAIN, a timed-out connection, a
    throttled remote store): retry with backoff."""


class PreconditionError(Error, RuntimeError):
    """The call cannot work in the current state."""


_BY_CODE = {
    "DataLoss": CorruptionError,
    "NotFound": NotFoundError,
    "InvalidArgument": InvalidArgumentError,
    "OutOfRange": InvalidArgumentError,
    "AlreadyExists": PreconditionError,
    "PermissionDenied": PermissionDeniedError,
    "ResourceExhausted": ResourceExhaustedError,
    "DeadlineExceeded": TimeoutError,
    "Unavailable": UnavailableError,
    "IOError": StorageError,
    "FailedPrecondition": PreconditionError,
    "Cancelled": PreconditionError,
    "Unimplemented": PreconditionError,
    "Internal": Error,
}


def exception_for_code(code: str) -> type[Error]:
    """The exception class for a C++ ``StatusCode`` name."""
    return _BY_CODE.get(code, Error)
