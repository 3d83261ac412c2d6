"""Runs a function on N real torch.distributed (gloo, CPU) processes.

``run_ranks(world, fn, *args)`` starts ``world`` processes with
torch.multiprocessing (forkserver, torch preloaded), joins them into one process
group through a fresh FileStore (no TCP port that a concurrent run could take),
calls ``fn(rank, world, *args)`` in each and tears the group down, and returns
the ranks' return values (pickled through files). ``fn`` must be a module-level
function (it is pickled by reference). A failure in any rank re-raises in the
caller with that rank's traceback; ``expect_kill=True`` instead expects some rank
to die by SIGKILL (a crash test) and returns None.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import warnings

import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=120)


def _entry(rank: int, world: int, store: str, fn, args) -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )
    try:
        result = fn(rank, world, *args)
        with open(f"{store}.result{rank}", "wb") as f:
            pickle.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Success: skip interpreter teardown, where gloo's threads occasionally
    # abort ("terminate called without an active exception") on exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Ranks fork from a server that has already imported torch: starting a rank
# then costs milliseconds instead of seconds.
multiprocessing.set_forkserver_preload(
    ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor"]
)


def run_ranks(world: int, fn, *args, expect_kill: bool = False) -> list | None:
    """Runs ``fn(rank, world, *args)`` on ``world`` gloo ranks and returns their
    results; raises on failure (see the module docstring for ``expect_kill``)."""
    with tempfile.TemporaryDirectory(prefix="cairn-gloo-") as d:
        store = os.path.join(d, "store")
        try:
            mp.start_processes(_entry, args=(world, store, fn, args), nprocs=world,
                               join=True, start_method="forkserver")
        except mp.ProcessExitedException as e:
            if expect_kill and e.exit_code == -signal.SIGKILL:
                return None
            raise
        if expect_kill:
            raise AssertionError("expected a rank to be killed, but every rank finished")
        results = []
        for rank in range(world):
            with open(f"{store}.result{rank}", "rb") as f:
                results.append(pickle.load(f))
        return results
