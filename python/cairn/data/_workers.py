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

What cairn does (in C++, ``include/cairn/worker_lifetime.h``), in every worker,
before the user's ``worker_init_fn``:
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

import os
import threading
from typing import Any, Callable

from cairn import _ext

os.register_at_fork(after_in_child=_ext.after_fork_in_child)


class arm_fork:
    """Context manager around the creation of workers by ``fork``."""

    def __enter__(self) -> None:
        if threading.current_thread() is threading.main_thread():
            _ext.arm_forked_children(os.getpid())

    def __exit__(self, *exc: Any) -> None:
        _ext.arm_forked_children(0)


class WorkerInit:
    """A ``worker_init_fn`` that ties the worker's life to its trainer, then calls
    the user's ``worker_init_fn`` (if any). Picklable (for forkserver and spawn)."""

    def __init__(self, trainer_pid: int, user_fn: Callable[[int], Any] | None) -> None:
        self.trainer_pid = trainer_pid
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        _ext.tie_worker_to_trainer(self.trainer_pid)
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
