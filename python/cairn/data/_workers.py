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

Why forkserver workers were slow to start, and what ``start_forkserver`` does.
The forkserver is a fresh interpreter; multiprocessing meant it to import the
trainer's ``__main__`` once ("preload") so that the workers it forks inherit
torch, but up to Python 3.12 that preload never happens (``ensure_running``
passes the main script's path under a key its ``main`` does not read), so every
worker imported torch by itself after the fork, all of them at once: 2.7-3.3 s
to the first batch of a 2-worker loader on an idle 2-core machine, 3.8-6.6 s
under load. ``start_forkserver`` asks the forkserver to import torch itself
(``set_forkserver_preload``, before it is started; the modules already listed
stay), so the workers are forked with torch loaded, and it starts the server
when the DataLoader is *constructed*, so that this one import runs while the
trainer does whatever it does before its first ``iter()`` (building the model,
restoring a checkpoint). cairn and the user's modules are not preloaded: the
forkserver does not see the trainer's ``sys.path`` changes, and they import in
tens of milliseconds in each worker.
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


# What every worker imports before it can run: torch's DataLoader worker loop.
_PRELOAD = ("torch", "torch.utils.data")


def start_forkserver() -> None:
    """Starts the forkserver now, in the background (it imports ``_PRELOAD``
    while the caller goes on), unless it is running already. The server and the
    resource tracker it needs are started with fork+exec (``spawnv_passfds``),
    safe from a threaded trainer; both exit when the trainer does (EOF on their
    pipes), as before."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is not None and getattr(server, "_forkserver_pid", 1) is None:
        # Not started yet: add torch to what it preloads (a preload set by the
        # user is kept; once started, the list no longer matters).
        have = list(getattr(server, "_preload_modules", None) or [])
        forkserver.set_forkserver_preload(have + [m for m in _PRELOAD if m not in have])
    forkserver.ensure_running()


def single_threaded() -> bool:
    """True when the calling thread is the main thread and the process's only
    one, counting the threads of native libraries too (``/proc/self/task``):
    then no other thread can hold a lock at a ``fork()`` and forking workers is
    safe. Importing numpy starts OpenBLAS's pool and the first parallel torch
    op OpenMP's, unless ``OMP_NUM_THREADS=1``; torch.distributed, CUDA and a
    CheckpointManager start threads of their own. Where ``/proc`` cannot be
    read, False."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if threading.active_count() != 1:
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


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


__all__ = ["WorkerInit", "arm_fork", "check_picklable", "single_threaded", "start_forkserver",
           "start_method"]
