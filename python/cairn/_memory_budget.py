"""The memory tier's budget and reclaim hooks of CheckpointManager.

Budget. Before a save changes a byte of a staging slot, each rank works out how much
its slot file must grow (nothing in the steady state: slots are reused). Without a
``memory_limit`` it checks that /dev/shm and the node's memory have that much free
(a full tmpfs would otherwise deliver SIGBUS on first touch; growing uses fallocate
as well, so a race still ends in an error, not a signal). With a ``memory_limit``
the ranks all-gather (node, growth, and, from each node's leader, the tier's
current footprint, free room and limit), and every rank reaches the same verdict
for every node; a save that would take any node's memory tier past its limit fails
on every rank alike, with :class:`cairn.errors.ResourceExhaustedError`, leaving the
memory-tier checkpoint already in the slot intact.

The growth, the room check and the verdict are C++ (``cairn/memory_tier.h``:
``SlotGrowth``, ``CheckSharedMemoryRoom``, ``CheckMemoryBudget``); this module
gathers the reports on the manager's group.

Reclaim. The listing and the orphan decision are in C++ (``cairn/memory_tier.h``),
shared with ``cairn gc``; the node leader of a new manager calls it once.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from cairn import _ext
from cairn.errors import Error, ResourceExhaustedError

log = logging.getLogger("cairn.manager")

def reclaim_orphans(grace: float) -> None:
    """Deletes the node's orphaned memory tiers; a failure only warns."""
    try:
        for t in _ext.reclaim_memory_tiers(grace=grace):
            log.warning("cairn: reclaimed orphaned memory tier %s (%s, run root %s): %s",
                        t["path"], _ext.human_bytes(t["bytes"]), t["run_root"] or "?", t["reason"])
    except Error as e:
        log.warning("cairn: reclaiming orphaned memory tiers: %s", e)


def mark_restored(lease: Any) -> None:
    try:
        lease.mark_restored()
    except Error as e:
        log.warning("cairn: recording the restore in the memory tier: %s", e)


def raise_budget_error(e: BaseException) -> None:
    """Re-raises a budget error that DCP wrapped in its CheckpointException."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict):
        return
    for exc, _ in failures.values():
        if isinstance(exc, ResourceExhaustedError):
            raise exc from None


class Budget:
    """The memory budget of one manager (see the module docstring)."""

    def __init__(self, mgr: Any, limit: int | float | None, limit_bytes: int | None) -> None:
        """`limit` as the user gave it (checked and converted to `limit_bytes` by
        _ext.memory_limit_bytes)."""
        self.mgr = mgr
        self.shm_root = os.path.dirname(mgr.shm_dir)
        self.limit = limit_bytes
        self.limit_arg = limit
        if limit is not None:
            from cairn._replication import node_id
            self.host = node_id()

    def check(self, slot: int, used: int) -> None:
        grow = int(_ext.slot_growth(self.mgr._tiers.slot_data_path(slot, self.mgr.rank), used))
        if self.limit is None:
            _ext.check_shared_memory_room(self.shm_root, grow)
            return
        mgr = self.mgr
        mine = _ext.memory_budget_report(self.host, grow, mgr._node_leader, mgr.shm_dir,
                                         self.limit)
        _ext.check_memory_budget(mgr._gather(mine), repr(self.limit_arg))
