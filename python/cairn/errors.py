"""cairn's exception hierarchy.

Every error cairn raises derives from :class:`Error`. The C++ core reports a
``Status`` code; :func:`exception_for_code` is the one place that maps a code to
its class. Not-found cases are also ``FileNotFoundError``, bad arguments are
also ``ValueError``, timeouts are also ``TimeoutError``.
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


class TimeoutError(Error, builtins.TimeoutError):  # noqa: A001 - deliberate
    """A wait or a collective ran past its timeout."""


class StorageError(Error, OSError):
    """An I/O failure of the storage (EIO and friends, transient or not)."""


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
    "Unavailable": StorageError,
    "IOError": StorageError,
    "FailedPrecondition": PreconditionError,
    "Cancelled": PreconditionError,
    "Unimplemented": PreconditionError,
    "Internal": Error,
}


def exception_for_code(code: str) -> type[Error]:
    """The exception class for a C++ ``StatusCode`` name."""
    return _BY_CODE.get(code, Error)
