"""Stopping the process groups the benchmarks start (each launched with
``start_new_session=True``, so its pid is its group's id)."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_group(proc: subprocess.Popen, grace: float = 10.0, term_first: bool = False) -> None:
    """Stops the process group `proc` leads: SIGTERM to the group first when
    `term_first`, then up to `grace` seconds for `proc` to exit, then SIGKILL to
    whatever of the group is left; reaps `proc`."""
    if term_first:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
