"""Replication of the memory tier to peer nodes, and restore from peers.

Nodes. A node is identified by ``CAIRN_NODE_ID`` or, without it, its hostname. The
ranks of the checkpoint group are grouped by node; nodes are ordered by their lowest
rank. Node i's replicas go to nodes i+1, ..., i+K (a ring, as Gemini and NVRx place
them); the rank with local index j of node i sends its slot to the rank with local
index j mod n of each peer node, so all ranks of a node share that node's peers.

Layout. A node's replicas live in its shared memory, in a tier of their own, kind
``replica`` in the memory-tier bookkeeping (``cairn ls --memory`` lists it):

    /dev/shm/cairn-<tag>-replicas/
      <source node>/slot<k>/data/r<rank>.bin   the source ranks' slot k, as staged
      <source node>/slot<k>/cairn.replica.json step, run id, source node, files
      <source node>/slot<k>/cairn.manifest     the memory-tier manifest of the step
      view/                                     a restore's assembled checkpoint

Replication of one save (every rank, in the background persist thread, right after
the memory-tier commit; only the checkpoint group's gloo traffic, no collective of its
own before the bytes move):
  1. the save's own all-gather (manager.py, step b) already carries each rank's item
     layout (offsets, lengths, block checksums) and, from each receiving rank
     (``offer``), the bytes its replica files hold, its free shared memory and what
     ``memory_limit`` leaves; every rank decides alike who is refused for lack of room;
  2. a receiver uncommits its replica slot k of the source node (manifest and
     sidecar first); then every pair moves the slot file with one isend/irecv: the
     sender straight from its staging slot (no copy, no new mapping), the receiver
     straight into its replica file, which stays mapped between saves (resized in
     place, allocated with posix_fallocate, pages populated: no page faults, no
     SIGBUS, no re-zeroing per save);
  3. the receiver checks every item's block checksums (the engine's XXH3 blocks, C++,
     GIL released) against the source's as soon as that file arrived; all-gather the
     verdicts;
  4. for each (source node, peer node) whose files all verified, the peer's lowest
     receiving rank writes the sidecar and commits the manifest: only now does the
     step count as replicated there. Replica slots mirror ``memory_slots``, which
     the manager requires to be >= 2 with replicas: the slot uncommitted in 2. never
     holds the previous step, so a node lost while a step replicates still has the
     previous step in every memory tier and replica.

Restore (``Replication.candidates`` and ``materialize``, collective): every rank
reports what its node holds (its memory-tier slots and its replicas, with file sizes);
a step is in "cluster memory" when every rank's data file of it is held by some node.
A rank whose own file is in its node's memory tier restores it as ``memory``, one
whose file is only in a peer's replica as ``peer``. To load, every node assembles the
step in ``view/``: files it holds are hard links, missing ones are pulled with
send/recv from the node that holds them, the manifest last. Loading then verifies
every checksum (a corrupt or missing replica fails there and restore falls back to a
slower tier or an older step, agreed by all ranks); nothing is trusted unverified.
Every node's view holds every rank's file (the reader opens a complete checkpoint), so
a multi-node restore from cluster memory moves each missing file to every node that
lacks it, not only to the node whose ranks load it: with N nodes, up to N-1 copies of
a lost node's files cross the network.

Not thread-safe: used by one manager, from its persist thread or its caller's.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import re
import shutil
import socket
import struct
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from cairn import _ext

log = logging.getLogger("cairn.manager")

_MANIFEST = "cairn.manifest"
_SIDECAR = "cairn.replica.json"
_MAGIC = b"CAIRNMF\n"


def node_id() -> str:
    """This node's identity: ``CAIRN_NODE_ID`` if set, else the hostname."""
    return os.environ.get("CAIRN_NODE_ID") or socket.gethostname()


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


def manifest_step(path: str) -> tuple[int, str] | None:
    """(step, run_id) from the manager's extra of the manifest file at `path`, after
    its envelope checksum verified; None if it is missing or damaged."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if len(raw) < 32 or raw[:8] != _MAGIC:
            return None
        (length,) = struct.unpack_from("<Q", raw, 16)
        if len(raw) != 32 + length:
            return None
        (trailer,) = struct.unpack_from("<Q", raw, 24 + length)
        if int(_ext.checksum(raw[:24 + length])) != trailer:
            return None
        extra = json.loads(raw[24:24 + length]).get("extra", {}).get("manager", {})
        step, run = extra.get("step"), extra.get("run_id")
        return (step, run) if isinstance(step, int) else None
    except (OSError, ValueError, struct.error):
        return None


def _data_files(ckpt_dir: str) -> dict[int, int]:
    """{rank: size} of the r<rank>.bin files of a checkpoint directory."""
    out = {}
    try:
        for name in os.listdir(os.path.join(ckpt_dir, "data")):
            m = re.fullmatch(r"r(\d+)\.bin", name)
            if m:
                out[int(m.group(1))] = os.stat(os.path.join(ckpt_dir, "data", name)).st_size
    except OSError:
        pass
    return out


def _at(address: int, size: int) -> torch.Tensor:
    """A uint8 tensor over `size` bytes at `address` (memory the caller keeps alive)."""
    if not size:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer((ctypes.c_uint8 * size).from_address(address), dtype=torch.uint8)


class _Mapped:
    """A file mapped in memory, as a uint8 tensor for send/recv. Written: the file is
    resized in place (pages it keeps are reused), allocated up front and mapped with
    its pages populated, so the transfer never page-faults nor SIGBUSes."""

    def __init__(self, path: str, size: int, write: bool):
        self.size = size
        self.fd = os.open(path, (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY, 0o600)
        self.ino = os.fstat(self.fd).st_ino
        if write:
            if os.fstat(self.fd).st_size != size:
                os.ftruncate(self.fd, size)
            if size:
                os.posix_fallocate(self.fd, 0, size)  # ENOSPC here, never SIGBUS later
        flags = (mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) if write else mmap.MAP_PRIVATE
        self.map = mmap.mmap(self.fd, size, flags=flags) if size else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.tensor = (torch.frombuffer(self.map, dtype=torch.uint8) if size
                           else torch.empty(0, dtype=torch.uint8))

    def address(self) -> int:
        return self.tensor.data_ptr()

    def close(self) -> None:
        self.tensor = None
        if self.map is not None:
            self.map.close()
        os.close(self.fd)


class Replication:
    """The replication and peer-restore half of one CheckpointManager."""

    def __init__(self, mgr: Any, replicas: int, nodes: list[str]):
        self.mgr = mgr
        self.k = replicas
        self.node_of = nodes  # node id of every rank of the checkpoint group
        order: list[str] = []
        for n in nodes:
            if n not in order:
                order.append(n)
        self.nodes = order
        self.ranks_of = {n: [r for r, x in enumerate(nodes) if x == n] for n in order}
        self.node = nodes[mgr.rank]
        self.multi = len(order) > 1
        self.name = mgr.shm_name + "-replicas"
        self.dir = _ext.shm_directory(self.name)
        self.lease = None
        if self.multi and (replicas > 0 or os.path.isdir(self.dir)):
            self.lease = _ext.MemoryTierLease(self.dir, run_root=mgr.root, run_id=mgr.run_id,
                                              rank=mgr.rank, kind="replica")
        self.replicated: list[int] = []  # steps verified on every peer
        self.last_s = 0.0  # seconds the last replication took
        self.last_phases: dict[str, float] = {}  # and its steps (uncommit, map, ...)
        self._maps: dict[tuple[str, int, int], _Mapped] = {}  # receiving replica files

    # ---- placement -------------------------------------------------------------

    def peers(self, node: str) -> list[str]:
        i = self.nodes.index(node)
        n = len(self.nodes)
        return [self.nodes[(i + d) % n] for d in range(1, min(self.k, n - 1) + 1)]

    def _pairs(self) -> list[tuple[int, int]]:
        """(source rank, receiving rank) of every replica of every rank."""
        out = []
        for q, node in enumerate(self.node_of):
            j = self.ranks_of[node].index(q)
            for peer in self.peers(node):
                ranks = self.ranks_of[peer]
                out.append((q, ranks[j % len(ranks)]))
        return out

    def _g(self, rank: int) -> int:
        return dist.get_global_rank(self.mgr.pg, rank)

    def _slot_dir(self, src_node: str, slot: int) -> str:
        return os.path.join(self.dir, _safe(src_node), f"slot{slot}")

    # ---- replication (persist thread) ----------------------------------------------

    def offer(self, slot: int) -> dict[str, Any] | None:
        """What this rank tells the others, in the save's gather, before it receives
        the replicas of `slot`: the bytes already held by its replica files (reused in
        place), the free shared memory and what ``memory_limit`` leaves. None if it
        receives nothing."""
        incoming = [q for q, d in self._pairs() if d == self.mgr.rank]
        if not self.multi or self.k <= 0 or not incoming:
            return None
        have = {}
        for q in incoming:
            try:
                have[q] = os.stat(self._file(self.node_of[q], slot, q)).st_size
            except FileNotFoundError:
                have[q] = 0
        free = int(_ext.shared_memory_room(os.path.dirname(self.dir))["usable"])
        left = None
        limit = self.mgr._budget.limit
        if limit is not None:
            used = int(_ext.allocated_bytes(self.mgr.shm_dir)) if os.path.isdir(
                self.mgr.shm_dir) else 0
            used += int(_ext.allocated_bytes(self.dir)) if os.path.isdir(self.dir) else 0
            left = limit - used
        return {"have": have, "free": free, "left": left}

    def _file(self, src_node: str, slot: int, q: int) -> str:
        return os.path.join(self._slot_dir(src_node, slot), "data", f"r{q}.bin")

    def _receive_map(self, src_node: str, slot: int, q: int, size: int) -> "_Mapped":
        """The mapped replica file of rank q's `slot`, kept mapped between saves (its
        pages stay allocated and faulted in: the next replication of the slot writes
        straight into them)."""
        path = self._file(src_node, slot, q)
        key = (src_node, slot, q)
        m = self._maps.get(key)
        if m is not None:
            try:
                same = os.stat(path).st_ino == m.ino
            except FileNotFoundError:
                same = False
            if same and m.size == size:
                return m
            m.close()
            del self._maps[key]
        m = _Mapped(path, size, write=True)
        self._maps[key] = m
        return m

    def replicate(self, rec: Any) -> bool:
        """Copies this save's slot files to the peer nodes (see the module docstring).
        Returns True once every replica verified. ``last_phases`` gets the seconds of
        each step."""
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

        pairs = self._pairs()
        everyone = rec.everyone
        incoming = [q for q, d in pairs if d == mgr.rank]
        sizes = {q: everyone[q]["capacity"] for q in range(mgr.world)}
        # 1. who has room for what it receives: decided alike by every rank from the
        # save's gather (no collective of its own).
        refused = {}
        for d in sorted({d for _, d in pairs}):
            o = everyone[d].get("repl")
            if o is None:
                continue
            grow = max(0, sum(sizes[q] - o["have"].get(q, 0) for q, d2 in pairs if d2 == d))
            if grow > o["free"]:
                refused[d] = f"{grow} bytes needed, {o['free']} free in shared memory"
            elif o["left"] is not None and grow > o["left"]:
                refused[d] = (f"memory_limit: the node's memory tier and replicas would grow by "
                              f"{grow} bytes, {o['left']} left")
        for d, why in refused.items():
            log.warning("cairn: step %d not replicated to rank %d: %s", rec.step, d, why)
        live = [(q, d) for q, d in pairs if d not in refused]
        # 2. uncommit, then move the bytes: the sender's straight from its staging slot,
        # the receiver's straight into its mapped replica file.
        if mgr.rank not in refused:
            for q in incoming:
                sd = self._slot_dir(self.node_of[q], rec.slot)
                for name in (_MANIFEST, _SIDECAR):
                    try:
                        os.unlink(os.path.join(sd, name))
                    except FileNotFoundError:
                        pass
                os.makedirs(os.path.join(sd, "data"), exist_ok=True)
        lap("uncommit")
        recv: dict[int, _Mapped] = {}
        works = []
        for q, d in live:
            if q == mgr.rank:
                works.append((None, dist.isend(_at(rec.writer.address, sizes[q]), self._g(d),
                                               group=mgr.pg)))
            if d == mgr.rank:
                recv[q] = self._receive_map(self.node_of[q], rec.slot, q, sizes[q])
                works.append((q, dist.irecv(recv[q].tensor, self._g(q), group=mgr.pg)))
        lap("map")
        # 3. verify each file as soon as it arrived, block by block (C++, GIL released).
        bad = {}
        block = int(_ext.DEFAULT_BLOCK_SIZE)
        for q, wk in works:
            wk.wait()
            if q is None:
                continue
            lap("transfer")
            m = recv[q]
            o = everyone[q]
            for off, length, want in zip(o["offsets"], o["lengths"], o["sums"]):
                got = _ext.block_checksums_address(m.address() + off, length, block)
                if tuple(got) != tuple(want):
                    bad[q] = f"rank {q}'s item at offset {off} arrived with a wrong checksum"
                    break
            lap("verify")
        lap("transfer")
        verdicts = mgr._gather(bad)
        lap("verdicts")
        failed = {q for v in verdicts for q in v}
        for v in verdicts:
            for q, why in v.items():
                log.warning("cairn: replica of step %d not trusted: %s", rec.step, why)
        # 4. commit each (source node -> peer) whose files all verified.
        done = True
        for src in self.nodes:
            for peer in self.peers(src):
                qs = [q for q, d in live if self.node_of[q] == src and self.node_of[d] == peer]
                if (len(qs) != len(self.ranks_of[src]) or any(q in failed for q in qs)):
                    done = False
                    continue
                committer = min(d for q, d in live if q in qs)
                if committer == mgr.rank:
                    sd = self._slot_dir(src, rec.slot)
                    side = {"step": rec.step, "run_id": mgr.run_id, "source": src,
                            "files": {str(q): sizes[q] for q in qs}}
                    with open(os.path.join(sd, _SIDECAR), "w") as f:
                        json.dump(side, f)
                    _ext.commit_manifest(f"shm://{self.name}/{_safe(src)}/slot{rec.slot}",
                                         rec.body)
        lap("commit")
        if done:
            self.replicated.append(rec.step)
        return done

    # ---- restore ---------------------------------------------------------------------

    def _holdings(self) -> dict[int, dict[str, Any]]:
        """{step: {"mem": {rank: size}, "slot": k, "reps": [(src, slot, {rank: size})]}}
        of this node's memory tier and replicas of this run."""
        mgr = self.mgr
        out: dict[int, dict[str, Any]] = {}
        for slot in range(mgr.num_slots):
            d = os.path.join(mgr.shm_dir, f"slot{slot}")
            got = manifest_step(os.path.join(d, _MANIFEST))
            if got is None or got[1] != mgr.run_id:
                continue
            e = out.setdefault(got[0], {"mem": {}, "slot": None, "reps": []})
            e["mem"], e["slot"] = _data_files(d), slot
        if os.path.isdir(self.dir):
            for src in sorted(os.listdir(self.dir)):
                if src == "view":
                    continue
                for slot in range(mgr.num_slots):
                    d = os.path.join(self.dir, src, f"slot{slot}")
                    got = manifest_step(os.path.join(d, _MANIFEST))
                    try:
                        with open(os.path.join(d, _SIDECAR)) as f:
                            side = json.load(f)
                    except (OSError, ValueError):
                        continue
                    if got is None or got[1] != mgr.run_id or side.get("step") != got[0]:
                        continue
                    files = {q: s for q, s in _data_files(d).items()
                             if side.get("files", {}).get(str(q)) == s}
                    e = out.setdefault(got[0], {"mem": {}, "slot": None, "reps": []})
                    e["reps"].append((src, slot, files))
        return out

    def candidates(self) -> list[tuple[int, str, str]]:
        """This rank's (step, "memory" | "peer", "cluster") candidates, collective."""
        mine = self._holdings()
        self._everyone = self.mgr._gather(mine)
        self._plans: dict[int, dict[int, tuple[int, str, int, int]]] = {}
        out = []
        steps = set().union(*[set(h) for h in self._everyone])
        for step in steps:
            plan = self._plan(step)
            if plan is None:
                continue
            self._plans[step] = plan
            holder = plan[self.mgr.rank][0]
            own = self.node_of[holder] == self.node and plan[self.mgr.rank][1] == "mem"
            out.append((step, "memory" if own else "peer", "cluster"))
        return out

    def _plan(self, step: int) -> dict[int, tuple[int, str, int, int]] | None:
        """{rank q: (holder rank, "mem" | source node, slot, size)} of rank q's file of
        `step`: its own node's memory tier first, then replicas; None if some rank's
        file is nowhere."""
        plan = {}
        for q in range(self.mgr.world):
            best = None
            for r, h in enumerate(self._everyone):
                e = h.get(step)
                if e is None:
                    continue
                if q in e["mem"] and self.node_of[r] == self.node_of[q]:
                    best = (r, "mem", e["slot"], e["mem"][q])
                    break
                if best is None:
                    for src, slot, files in e["reps"]:
                        if q in files:
                            best = (r, src, slot, files[q])
                            break
            if best is None:
                return None
            plan[q] = best
        return plan

    def _path(self, how: str, slot: int, q: int) -> str:
        if how == "mem":
            return os.path.join(self.mgr.shm_dir, f"slot{slot}", "data", f"r{q}.bin")
        return os.path.join(self.dir, _safe(how), f"slot{slot}", "data", f"r{q}.bin")

    def _local_source(self, step: int, q: int) -> str | None:
        e = self._everyone[self.mgr.rank].get(step)
        if e is None:
            return None
        if q in e["mem"]:
            return self._path("mem", e["slot"], q)
        for src, slot, files in e["reps"]:
            if q in files:
                return self._path(src, slot, q)
        return None

    def _local_manifest(self, step: int) -> str | None:
        e = self._everyone[self.mgr.rank].get(step)
        if e is None:
            return None
        if e["slot"] is not None:
            return os.path.join(self.mgr.shm_dir, f"slot{e['slot']}", _MANIFEST)
        src, slot, _ = e["reps"][0]
        return os.path.join(self.dir, _safe(src), f"slot{slot}", _MANIFEST)

    def materialize(self, step: int) -> str:
        """Collective: assembles `step` in every node's view/ (links to what the node
        holds, send/recv for the rest, the manifest last); returns its shm:// URI."""
        mgr = self.mgr
        plan = self._plans[step]
        leader = self.ranks_of[self.node][0]
        view = os.path.join(self.dir, "view")
        if mgr.rank == leader:
            if self.lease is None:
                self.lease = _ext.MemoryTierLease(self.dir, run_root=mgr.root,
                                                  run_id=mgr.run_id, rank=mgr.rank, kind="replica")
            shutil.rmtree(view, ignore_errors=True)
            os.makedirs(os.path.join(view, "data"))
        # Which node lacks what: each node's leader tells (collectively).
        lacks = []
        if mgr.rank == leader:
            for q in range(mgr.world):
                src = self._local_source(step, q)
                if src is not None:
                    os.link(src, os.path.join(view, "data", f"r{q}.bin"))
                else:
                    lacks.append(q)
            if self._local_manifest(step) is None:
                lacks.append(-1)
        everyone = mgr._gather((self.node, lacks))
        works, maps = [], []
        try:
            for node, missing in everyone:
                if not missing:
                    continue
                ranks = self.ranks_of[node]
                for q in missing:
                    if q < 0:
                        continue
                    holder, how, slot, size = plan[q]
                    dst = ranks[q % len(ranks)]
                    if holder == mgr.rank:
                        m = _Mapped(self._path(how, slot, q), size, write=False)
                        maps.append(m)
                        works.append(dist.isend(m.tensor, self._g(dst), group=mgr.pg))
                    if dst == mgr.rank:
                        m = _Mapped(os.path.join(view, "data", f"r{q}.bin"), size, write=True)
                        maps.append(m)
                        works.append(dist.irecv(m.tensor, self._g(holder), group=mgr.pg))
            for wk in works:
                wk.wait()
        finally:
            for m in maps:
                m.close()
        # The manifest, last: nodes without one get the bytes of the first holder's.
        need = any(-1 in missing for _, missing in everyone)
        raw = None
        if need:
            first = min(plan[q][0] for q in plan)
            if mgr.rank == first:
                with open(self._local_manifest(step), "rb") as f:
                    raw = f.read()
            raws = mgr._gather(raw)
            raw = next(x for x in raws if x is not None)
        if mgr.rank == leader:
            if raw is None:
                with open(self._local_manifest(step), "rb") as f:
                    raw = f.read()
            tmp = os.path.join(view, _MANIFEST + ".tmp")
            with open(tmp, "wb") as f:
                f.write(raw)
            os.rename(tmp, os.path.join(view, _MANIFEST))
        mgr._gather(None)  # every view is complete before anyone opens one
        return f"shm://{self.name}/view"

    def drop_view(self) -> None:
        if self.mgr.rank == self.ranks_of[self.node][0]:
            shutil.rmtree(os.path.join(self.dir, "view"), ignore_errors=True)

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()
        if self.mgr.rank == self.ranks_of[self.node][0]:
            shutil.rmtree(self.dir, ignore_errors=True)
        if self.lease is not None:
            try:
                self.lease.release(remove_if_empty=True)
            except Exception as e:  # noqa: BLE001
                log.warning("cairn: releasing the replica tier %s: %s", self.dir, e)
            self.lease = None
