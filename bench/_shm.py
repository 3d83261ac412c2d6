"""Named POSIX semaphores (``/dev/shm/sem.mp-*``) that multiprocessing leaves behind.

A forkserver or spawn context creates its queues' and locks' semaphores by name and
registers them with its resource tracker, which unlinks them when the processes that
used them are gone. When the whole process group of a run is SIGKILLed (the
benchmarks' resume and restart checks kill the group), the tracker dies with it and
the names stay in /dev/shm. The benchmarks count them and remove those that no live
process has open, as a restarted node's cleanup would."""

from __future__ import annotations

import os
import time

SHM = "/dev/shm"


def sem_names() -> set[str]:
    try:
        return {n for n in os.listdir(SHM) if n.startswith("sem.mp-")}
    except OSError:
        return set()


def open_sems() -> set[str]:
    """The sem.mp-* names some live process has mapped (an open named semaphore is
    a mapping of its /dev/shm file)."""
    out = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find("/dev/shm/sem.mp-")
                    if i >= 0:
                        out.add(line[i + len("/dev/shm/"):].split()[0])
        except OSError:
            pass
    return out


def remove_leaked_sems(before: set[str], settle: float = 0.5) -> list[str]:
    """Removes the sem.mp-* names created since `before` that no live process has
    open, in two looks `settle` s apart (a name is between its creation and its
    users' mappings only for an instant; other programs on the machine, a test run
    say, make names of their own); returns them."""
    new = sem_names() - before
    if not new:
        return []
    unused = new - open_sems()
    if unused:
        time.sleep(settle)
        unused -= open_sems()
    leaked = sorted(n for n in unused if os.path.exists(os.path.join(SHM, n)))
    for n in leaked:
        try:
            os.unlink(os.path.join(SHM, n))
        except FileNotFoundError:
            pass
    return leaked
