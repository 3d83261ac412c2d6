"""Fault points for the kill -9 chaos harness (tests/chaos/).

``CAIRN_CHAOS="PHASE:N:RANKS"`` arms one point: the N-th time this process reaches
``point(PHASE)`` it prints a line and SIGKILLs itself, if its rank is in RANKS
("0", "1", "0,1" or "all"). ``PHASE`` "timer" instead kills after N milliseconds
from ``arm()``: a random instant of whatever the run is doing. Points fire only
in the first attempt of a torchrun job (``TORCHELASTIC_RESTART_COUNT`` 0), so the
restarted run can finish. Unset, every call is a cheap no-op.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

_SPEC = os.environ.get("CAIRN_CHAOS", "")
_counts: dict[str, int] = {}
_lock = threading.Lock()


def _parse() -> tuple[str, int, set[int] | None] | None:
    if not _SPEC or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    phase, n, ranks = _SPEC.split(":")
    return phase, int(n), None if ranks == "all" else {int(r) for r in ranks.split(",")}


_ARMED = _parse()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _kill(what: str) -> None:
    sys.stderr.write(f"[chaos] rank {_rank()}: SIGKILL at {what}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def point(phase: str) -> None:
    """A place where the harness may kill this process."""
    if _ARMED is None or _ARMED[0] != phase:
        return
    if _ARMED[2] is not None and _rank() not in _ARMED[2]:
        return
    with _lock:
        _counts[phase] = _counts.get(phase, 0) + 1
        hit = _counts[phase] == _ARMED[1]
    if hit:
        _kill(f"{phase} #{_ARMED[1]}")


def arm() -> None:
    """Starts the timer of a "timer" spec (once per process)."""
    if _ARMED is None or _ARMED[0] != "timer" or "timer" in _counts:
        return
    if _ARMED[2] is not None and _rank() not in _ARMED[2]:
        return
    _counts["timer"] = 1
    t = threading.Timer(_ARMED[1] / 1000.0, _kill, args=(f"timer {_ARMED[1]}ms",))
    t.daemon = True
    t.start()
