"""Replication of the memory tier to peer nodes, and restore from peers: the transfers.

The engine (``_ext.ReplicaStore``, ``include/cairn/replication.h``) owns a node's
replica state: placement, the replica files and their mappings, verification,
commits, holdings, restore plans and the assembled view. The protocol is described
at the top of ``src/tier/replication.cc``. What stays here is what must be Python:
the checkpoint group's gloo ``isend``/``irecv`` of tensors over the memory the store
maps, and the all-gathers that carry the store's messages between ranks.

Not thread-safe: used by one manager, from its persist thread or its caller's.
"""

from __future__ import annotations

import ctypes
import logging
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from cairn import _ext

log = logging.getLogger("cairn.manager")

node_id = _ext.node_id  # CAIRN_NODE_ID if set, else the hostname


def _at(address: int, size: int) -> torch.Tensor:
    """A uint8 tensor over `size` bytes at `address` (memory the caller keeps alive)."""
    if not size:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer((ctypes.c_uint8 * size).from_address(address), dtype=torch.uint8)


class Replication:
    """The replication and peer-restore half of one CheckpointManager."""

    def __init__(self, mgr: Any, replicas: int, nodes: list[str]):
        self.mgr = mgr
        self.k = replicas
        self.name = mgr.shm_name + "-replicas"
        self.store = _ext.ReplicaStore(_ext.shm_directory(self.name), mgr.shm_dir, nodes,
                                       mgr.rank, replicas, mgr.num_slots, mgr.root, mgr.run_id)
        self.multi = self.store.multi
        self.replicated: list[int] = []  # steps verified on every peer
        self.last_s = 0.0  # seconds the last replication took
        self.last_phases: dict[str, float] = {}  # and its steps (uncommit, map, ...)

    def _post(self, send: bool, peer: int, address: int, size: int) -> Any:
        op = dist.isend if send else dist.irecv
        return op(_at(address, size), dist.get_global_rank(self.mgr.pg, peer), group=self.mgr.pg)

    # ---- replication (persist thread) ----------------------------------------------

    def offer(self, slot: int) -> str | None:
        """What this rank tells the others, in the save's gather, before it receives
        the replicas of `slot` (the store's message); None if it receives nothing."""
        return self.store.offer(slot, self.mgr._budget.limit)

    def replicate(self, rec: Any) -> bool:
        """Copies this save's slot files to the peer nodes. Returns True once every
        replica verified. ``last_phases`` gets the seconds of each step."""
        mgr = self.mgr
        if not self.multi or self.k <= 0:
            return False
        t = time.perf_counter()
        phases = self.last_phases = {}

        def lap(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            phases[name] = phases.get(name, 0.0) + now - t
            t = now

        everyone = rec.everyone
        sizes = [o["capacity"] for o in everyone]
        # 1.-2. who has room (alike on every rank), then this rank's uncommit.
        refused, live = self.store.begin(rec.slot, [o.get("repl") for o in everyone], sizes)
        for d, why in refused.items():
            log.warning("cairn: step %d not replicated to rank %d: %s", rec.step, d, why)
        lap("uncommit")
        works = []
        for q, d in live:
            if q == mgr.rank:
                works.append((None, self._post(True, d, rec.writer.address, sizes[q])))
            if d == mgr.rank:
                _, _, address, size = self.store.receive_buffer(q)
                works.append((q, self._post(False, q, address, size)))
        lap("map")
        # 3. verify each file as soon as it arrived (C++, GIL released).
        bad = {}
        for q, wk in works:
            wk.wait()
            if q is None:
                continue
            lap("transfer")
            o = everyone[q]
            why = self.store.verify(q, o["offsets"], o["lengths"], o["sums"])
            if why:
                bad[q] = why
            lap("verify")
        lap("transfer")
        verdicts = mgr._gather(bad)
        lap("verdicts")
        for v in verdicts:
            for why in v.values():
                log.warning("cairn: replica of step %d not trusted: %s", rec.step, why)
        # 4. commit each (source node -> peer) whose files all verified.
        done = self.store.commit(rec.step, rec.body, {q for v in verdicts for q in v})
        lap("commit")
        if done:
            self.replicated.append(rec.step)
        return done

    # ---- restore ---------------------------------------------------------------------

    def candidates(self) -> list[tuple[int, str, str, str]]:
        """This rank's (step, "memory" | "peer", "cluster", "") candidates, collective."""
        everyone = self.mgr._gather(self.store.holdings())
        return [(step, tier, "cluster", "") for step, tier in self.store.candidates(everyone)]

    def materialize(self, step: int) -> str:
        """Collective: assembles `step` in every node's view/ (links to what the node
        holds, send/recv for the rest, the manifest last); returns its shm:// URI."""
        mgr = self.mgr
        lacks = mgr._gather(self.store.prepare_view(step))
        transfers, manifest_from = self.store.view_transfers(step, lacks)
        try:
            for wk in [self._post(*t) for t in transfers]:
                wk.wait()
        finally:
            self.store.end_view_transfers()
        # The manifest, last: nodes without one get the bytes of the first holder's.
        raw = None
        if manifest_from >= 0:
            mine = self.store.manifest_bytes(step) if mgr.rank == manifest_from else None
            raw = mgr._gather(mine)[manifest_from]
        self.store.commit_view(step, raw)
        mgr._gather(None)  # every view is complete before anyone opens one
        return f"shm://{self.name}/view"

    def drop_view(self) -> None:
        self.store.drop_view()

    def close(self, keep: bool = False) -> None:
        """Ends the replica store. `keep` (an exit without close()): the replicas this
        node holds for its peers stay, as after a crash, for the restart to restore
        from; only the lease is released."""
        if self.store is None:
            return
        try:
            if keep:
                self.store.release_lease()
            else:
                self.store.close()
        except Exception as e:  # noqa: BLE001
            log.warning("cairn: %s", e)
        self.store = None
