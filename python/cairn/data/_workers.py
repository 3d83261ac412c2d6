"""DataLoader worker processes that never outlive their trainer.

Why workers lingered. With the ``forkserver`` start method a worker is a child of
the forkserver, not of the trainer, and multiprocessing hands every such child the
forkserver's "alive" pipe (so that it could start processes of its own). When the
trainer dies by SIGKILL, the forkserver waits for EOF on that pipe, which the
workers keep open, and the workers' own watchdog (torch checks ``getppid()``) sees
their parent, the forkserver, alive: neither ever exits, and the resource tracker,
whose pipe they all hold, stays too. With ``fork``, torch's watchdog notices within
about 5 s, but only if the worker gets back to its loop (a worker hung in a lock
inherited from a threaded trainer never does).

What cairn does, in every worker, before the user's ``worker_init_fn``:
  * a watchdog thread blocks on a pidfd of the trainer process (``pidfd_open``; it
    polls ``getppid`` where pidfds are missing) and kills its own process at once
    when the trainer is gone. A pidfd refers to the whole process, so it does not
    matter which trainer thread created the workers. The forkserver then sees EOF
    and exits, and so does the resource tracker.
  * ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` when the worker's parent is the
    forkserver (single-threaded, so the "parent thread" is its only thread).
  * for ``fork`` from the trainer's main thread, the parent-death signal is also set
    right after ``fork()`` in the child (an at-fork hook, armed only while cairn's
    DataLoader creates its workers), so even a worker that hangs before reaching
    Python code dies with the trainer. Not from other threads: the signal follows
    the death of the forking *thread*, and a short-lived thread that created the
    iterator would take the persistent workers with it.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
from typing import Any, Callable

_PR_SET_PDEATHSIG = 1

# Set while cairn's DataLoader starts workers: (trainer pid, forking thread id).
_arming: tuple[int, int] | None = None
_libc: Any = None


def _set_pdeathsig() -> bool:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        return _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _after_fork_in_child() -> None:
    arming = _arming
    # In the child, the only thread is the one that forked.
    if arming is None or threading.get_ident() != arming[1]:
        return
    _set_pdeathsig()
    if os.getppid() != arming[0]:  # the trainer died before prctl: too late for it
        _die()


os.register_at_fork(after_in_child=_after_fork_in_child)


class arm_fork:
    """Context manager around the creation of workers by ``fork``."""

    def __enter__(self) -> None:
        global _arming
        if threading.current_thread() is threading.main_thread():
            _arming = (os.getpid(), threading.get_ident())

    def __exit__(self, *exc: Any) -> None:
        global _arming
        _arming = None


def _watch(trainer_pid: int) -> None:
    """Kills this process as soon as the trainer process is gone."""
    try:
        fd = os.pidfd_open(trainer_pid)
    except ProcessLookupError:
        _die()
        return
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not poller.poll():
            pass
        _die()
        return
    import time

    while True:  # no pidfds: re-parenting means the trainer died
        if os.getppid() != trainer_pid and not _alive(trainer_pid):
            _die()
        time.sleep(0.5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class WorkerInit:
    """A ``worker_init_fn`` that ties the worker's life to its trainer, then calls
    the user's ``worker_init_fn`` (if any). Picklable (for forkserver and spawn)."""

    def __init__(self, trainer_pid: int, user_fn: Callable[[int], Any] | None) -> None:
        self.trainer_pid = trainer_pid
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        if os.getppid() != self.trainer_pid:
            _set_pdeathsig()  # the parent is a forkserver: its only thread forked us
        if not _alive(self.trainer_pid):
            _die()
        threading.Thread(target=_watch, args=(self.trainer_pid,), name="cairn-trainer-watchdog",
                         daemon=True).start()
        if self.user_fn is not None:
            self.user_fn(worker_id)


def start_method(ctx: Any) -> str:
    """The start method of a ``multiprocessing_context`` argument (name or context)."""
    import multiprocessing

    if ctx is None:
        return multiprocessing.get_start_method()
    if isinstance(ctx, str):
        return ctx
    return ctx.get_start_method()


def check_picklable(what: str, obj: Any, method: str) -> None:
    """Raises ValueError when `obj` cannot be sent to a worker started by `method`."""
    from multiprocessing.reduction import ForkingPickler

    try:
        ForkingPickler.dumps(obj)
    except Exception as e:  # noqa: BLE001 - any pickling failure is the same answer
        raise ValueError(
            f"cairn.data.DataLoader: {what} cannot be pickled ({type(e).__name__}: {e}), but "
            f"workers started with the {method!r} start method receive the dataset pickled. "
            f"Define it at module level (a lambda or a nested function cannot be pickled), "
            f"or pass multiprocessing_context='fork' (only safe in a trainer without threads)."
        ) from None


__all__ = ["WorkerInit", "arm_fork", "check_picklable", "start_method"]
