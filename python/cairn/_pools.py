"""The Python package's executors, sized in one place.

Sizes come from the C++ engine's one sizing rule (``DefaultThreadCount`` in
include/cairn/thread_pool.h, bound as ``_ext.default_thread_count``): "io" pools
(reads, writes, fsyncs: threads mostly wait on the device) and "copy" pools
(memcpy and hashing: bound by memory bandwidth).

``io_pool()`` is the one process-wide C++ I/O pool, created on first use and
shared by every Writer, Reader, verify, copy and manager that is not given a
``thread_count`` of its own (those own one pool each, for their lifetime; no
call creates a pool). ``upload_pool()`` is a second process-wide I/O pool, for
staged writes only: it copies a staged file's finished ranges to the slow
target while the I/O pool is still writing the rest (on one pool the copies
would queue behind the whole local write). ``python_executor()`` is the one process-wide Python
thread pool, for the few readers that run GIL-releasing Python per item.

Fork safety: a forked child inherits the objects but not their threads, so it
forgets both pools and makes new ones on first use. The inherited C++ pool is
leaked on purpose: destroying it would join threads that do not exist there.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import threading

from cairn import _ext

__all__ = ["thread_count", "io_pool", "upload_pool", "python_executor"]


def thread_count(kind: str = "io") -> int:
    """Threads cairn gives a pool of `kind` ("io" or "copy") on this machine."""
    return int(_ext.default_thread_count(kind))


_lock = threading.Lock()
_io_pool: _ext.ThreadPool | None = None
_upload_pool: _ext.ThreadPool | None = None
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def io_pool() -> _ext.ThreadPool:
    """The process-wide I/O pool (``thread_count("io")`` threads)."""
    global _io_pool
    with _lock:
        if _io_pool is None:
            _io_pool = _ext.ThreadPool(thread_count("io"))
        return _io_pool


def upload_pool() -> _ext.ThreadPool:
    """The process-wide pool of staged uploads (``thread_count("io")`` threads)."""
    global _upload_pool
    with _lock:
        if _upload_pool is None:
            _upload_pool = _ext.ThreadPool(thread_count("io"))
        return _upload_pool


def python_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide Python thread pool (``thread_count("copy")`` threads)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(
                thread_count("copy"), thread_name_prefix="cairn-io")
        return _executor


def _forget_in_child() -> None:
    global _io_pool, _upload_pool, _executor, _lock
    for pool in (_io_pool, _upload_pool):
        if pool is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pool))  # never destroyed: see above
    _io_pool, _upload_pool, _executor, _lock = None, None, None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
