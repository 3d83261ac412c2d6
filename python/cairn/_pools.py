"""The Python package's executors, sized in one place.

Sizes come from the C++ engine's one sizing rule (``DefaultThreadCount`` in
include/cairn/thread_pool.h, bound as ``_ext.default_thread_count``): "io" pools
(reads, writes, fsyncs: threads mostly wait on the device) and "copy" pools
(memcpy and hashing: bound by memory bandwidth).

``io_pool()`` is the one process-wide C++ I/O pool, created on first use and
shared by every Writer, Reader, verify, copy and manager that is not given a
``thread_count`` of its own (those own one pool each, for their lifetime; no
call creates a pool). ``copy_pool()`` is the process-wide pool for reads from
node memory (the manager's memory tier and peers' replicas: memcpy and hashing,
so one thread per core; the I/O pool's 16-32 threads would only contend for the
cores and evict each other's pieces before they are hashed). ``upload_pool()`` is a second process-wide I/O pool, for
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

__all__ = ["thread_count", "io_pool", "copy_pool", "upload_pool", "python_executor"]


def thread_count(kind: str = "io") -> int:
    """Threads cairn gives a pool of `kind` ("io" or "copy") on this machine."""
    return int(_ext.default_thread_count(kind))


_lock = threading.Lock()
_shared: dict[str, object] = {}  # name -> the process-wide pool of that name


def _get(name: str, make):
    with _lock:
        pool = _shared.get(name)
        if pool is None:
            pool = _shared[name] = make()
        return pool


def io_pool() -> _ext.ThreadPool:
    """The process-wide I/O pool (``thread_count("io")`` threads)."""
    return _get("io", lambda: _ext.ThreadPool(thread_count("io")))


def copy_pool() -> _ext.ThreadPool:
    """The process-wide pool of reads from node memory (``thread_count("copy")``)."""
    return _get("copy", lambda: _ext.ThreadPool(thread_count("copy")))


def upload_pool() -> _ext.ThreadPool:
    """The process-wide pool of staged uploads (``thread_count("io")`` threads)."""
    return _get("upload", lambda: _ext.ThreadPool(thread_count("io")))


def python_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide Python thread pool (``thread_count("copy")`` threads)."""
    return _get("python", lambda: concurrent.futures.ThreadPoolExecutor(
        thread_count("copy"), thread_name_prefix="cairn-io"))


def _forget_in_child() -> None:
    global _shared, _lock
    for pool in _shared.values():
        if isinstance(pool, _ext.ThreadPool):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pool))  # never destroyed: see above
    _shared, _lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
