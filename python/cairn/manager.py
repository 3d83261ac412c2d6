"""CheckpointManager: async, tiered checkpointing and recovery of a whole run.

Tiers, fastest first:
  memory   this node's shared memory (/dev/shm/cairn-<tag>/slot<k>/). The staging
           buffers *are* the memory tier: a staged save is a complete cairn checkpoint
           there once its manifest is written, and it survives a crash of the
           training process (not of the node).
  local    an optional fast local directory (NVMe), ``<local>/step_<N>/``.
  durable  ``<root>/step_<N>/``: a directory or ``s3://BUCKET/PREFIX`` (every access
           goes through the engine's storage, so a URI root works as a directory
           does; the commit is one conditional PUT on S3).

Protocol of one save (every rank; the coordinator is rank 0 of the checkpoint group):
  1. Wait for the previous save; if it failed, raise its error now (training may go on).
  2. Stage (blocking): ``dcp.save`` with a staging writer. DCP plans on the dedicated
     gloo group. That plan is kept (``_PlanCache``): while the flattened state dict
     keeps its structure (keys, and each tensor's dtype, shape and properties; plain
     tensors only) on every rank (one all-reduce agrees on it), a save skips
     ``dcp.save`` and stages with the kept plan, so its stall is the copy; a changed
     structure on any rank plans anew on all. restore() plans the first save ahead
     (``_plan_ahead``, on the background thread, overlapping the trainer's next
     steps), so it too is staged like a steady one. Each rank uncommits
     the memory-tier checkpoint held by the slot it is about to reuse (the last one
     used, unless it holds the newest step and no slower tier has it: then the
     other, ``_save_slot``) and stages its items into that slot (a file in shared
     memory, mapped once and pre-faulted, reused across saves) with the staging
     engine (``cairn._staging.SlotStager`` over the C++ ``StagingPool``): the data-file
     layout, one parallel memcpy, GPU tensors device-to-host on a side stream into the
     slot registered as pinned memory, padding zeroed. ``save()`` returns here.
  3. Persist (the manager's one background thread, whose I/O runs in C++ with the GIL
     released; never in the stall):
     a. checksum this rank's items in the slot (one C++ call);
     b. all-gather (checksums, offsets, lengths, sizes, error) on the checkpoint group;
        the coordinator builds the manifest from every rank's plan and these;
     c. commit the manifest into the slot directory (local rank 0 of every node):
        the memory tier now holds step N;
     d. for each slower tier this save goes to (local, then durable): every rank
        uncommits ``step_N`` there (a leftover from an older attempt), writes its slot
        out as ``step_N/data/r<rank>.bin`` (same layout) and fsyncs it; all-gather the
        outcome; the coordinator commits the manifest (temp file, fsync, rename, fsync
        directory) only if every rank succeeded, then prunes the tier to its newest
        ``keep`` committed checkpoints and removes partial leftovers of crashed saves.
  4. An error in 3 is kept and raised by the next ``save()``/``wait()``/``close()``.

Restore: every rank lists the (step, tier) pairs it can see; the ranks agree on the
newest step that every rank has in some tier; each rank opens it from its fastest tier
(which validates the manifest and data file sizes); if any rank fails, that tier is
dropped for that step and the next tier or older step is tried; otherwise ``dcp.load``
reads it (checksums verified) and a failure there also falls back.

Every collective runs on a dedicated gloo group with a timeout; ``wait()`` has one too.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import shutil
import queue
import threading
import warnings
import time
import uuid
import weakref
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from cairn import _chaos, _ext, _memory_budget, _pools, _replication
from cairn._staging import SlotStager, byte_source, staged_nbytes
from cairn._state_shape import StateShape
from cairn._dcp_metadata import Location, manifest_from_metadata
from cairn.dcp import VALUE_MAGIC, Reader, unwrap, value_bytes
from cairn.errors import CorruptionError, Error, InvalidArgumentError, TimeoutError
from cairn._stock_reader import check_value_is_safe
from cairn.state import RNGState

__all__ = ["CheckpointManager", "memory_tier_name"]

log = logging.getLogger(__name__)

def _state_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a state (Statefuls through their state_dict())."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if hasattr(obj, "state_dict") and callable(obj.state_dict) and not isinstance(obj, dict):
        try:
            obj = obj.state_dict()
        except Exception:  # noqa: BLE001 - sizing is a hint only
            return []
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _state_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _state_tensors(v)]
    return []


def _as_cairn_error(e: BaseException, what: str) -> BaseException:
    """`e` as the cairn.Error to raise: DCP's CheckpointException unwrapped to the
    lowest failing rank's exception (cairn.dcp.unwrap); one that is not a cairn.Error
    wrapped (a value DCP cannot pickle: InvalidArgumentError), so ``except Exception``
    and ``except cairn.Error`` catch it. KeyboardInterrupt and friends pass as they are.
    The caller raises the result ``from e``."""
    inner = unwrap(e)
    if isinstance(inner, Error) or not isinstance(inner, Exception):
        return inner
    if isinstance(inner, (TypeError, AttributeError, ValueError, pickle.PicklingError)):
        return InvalidArgumentError(f"{what}: {type(inner).__name__}: {inner}")
    return Error(f"{what}: {type(inner).__name__}: {inner}")


class _Mismatch(InvalidArgumentError):
    """A checkpoint that does not fit the state restore() loads it into."""


def _mismatches(state: dict[str, Any], metadata: Metadata) -> list[str]:
    """What keeps a checkpoint with `metadata` from loading into `state` as
    dcp.load would: keys of the state the checkpoint lacks, tensors of another shape
    or dtype, a tensor stored where the state has another value. One line each."""
    sd = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
    stored = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(sd)
    if any(k not in stored for k in flat):
        # DCP re-flattens the old (torch <= 2.3) way when that explains the
        # missing keys (DefaultLoadPlanner.create_local_plan).
        from torch.distributed.checkpoint import _version
        _version._derived_version = "2_3"
        try:
            old, _ = flatten_state_dict(sd)
        finally:
            _version._derived_version = None
        if all(k in stored for k in old):
            flat = old
    out = []
    for fqn, v in flat.items():
        md = stored.get(fqn)
        if md is None:
            out.append(f"{fqn!r} is not in the checkpoint")
        elif isinstance(v, torch.Tensor) and isinstance(md, TensorStorageMetadata):
            have, want = tuple(md.size), tuple(v.shape)
            if have != want or md.properties.dtype != v.dtype:
                out.append(f"{fqn!r}: the checkpoint has shape {have} "
                           f"{str(md.properties.dtype).removeprefix('torch.')}, the state "
                           f"{want} {str(v.dtype).removeprefix('torch.')}")
        elif isinstance(md, TensorStorageMetadata):
            out.append(f"{fqn!r}: the checkpoint has a tensor of shape {tuple(md.size)}, "
                       f"the state a {type(v).__name__}")
    return out


# Managers not closed yet: the interpreter's exit ends them (_end_at_exit).
_live_managers: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()


@atexit.register
def _end_managers_at_exit() -> None:
    for mgr in list(_live_managers):
        try:
            mgr._end_at_exit()
        except BaseException as e:  # noqa: BLE001 - the other managers still end
            log.warning("cairn: ending a CheckpointManager at exit: %s", e)


def _tier_arg(path: Any) -> Any:
    """A tier as the engine's TierSet takes it: a path or URI, or an open Storage."""
    return path if isinstance(path, _ext.Storage) else os.fspath(path)


def memory_tier_name(root: str) -> str:
    """The shm:// name of the memory tier of the run checkpointing to `root` on this
    node: derived from the root's real path (a URI root such as s3://: from the URI),
    so a restarted process finds it."""
    return _ext.memory_tier_name(root)


class _StagingWriter(StorageWriter):
    """The blocking half of a save: a DCP ``StorageWriter`` that copies each rank's
    items into its shared-memory staging slot and writes nothing else. The
    manager's background thread turns the slot into committed checkpoints."""

    def __init__(self, mgr: "CheckpointManager", slot: int):
        super().__init__()
        self.mgr = mgr
        self.slot = slot
        self.is_coordinator = False
        self.metadata: Metadata | None = None
        self.plans: list[SavePlan] | None = None  # every rank's plan (the coordinator)
        self.plan: SavePlan | None = None  # this rank's plan
        self.planner: SavePlanner | None = None
        self.local_results: list[WriteResult] = []
        self.staged: Any = None  # the _ext.StagedSave of this rank's items
        # (Work, tensor) of the all-reduce agreeing on a save staged with the cached
        # plan, which the background job checks (CheckpointManager._check_agreement)
        self.agreement: Any = None
        self.failed: BaseException | None = None  # this rank's staging error, raised later
        self.used = 0
        self.capacity = 0
        self.address = 0

    def reset(self, checkpoint_id=None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.plans = plans
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.plan, self.planner = plan, planner
        sources = []  # tensors, or uint8 arrays over BYTE_IO values
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:  # native encoding where it has one
                sources.append(self.mgr._value_source(item.index.fqn, value_bytes(planner, item)))
            else:
                sources.append(planner.resolve_data(item).detach())
        self.stage(sources)
        key = _ext.data_file_key(self.mgr.rank)
        staged = self.staged
        self.local_results = [
            WriteResult(index=item.index, size_in_bytes=length,
                        storage_data=Location(key, self.capacity, off, length, ()))
            for item, off, length in zip(plan.items, staged.offsets, staged.lengths)
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(self.local_results)
        return fut

    def stage(self, sources: list[Any], lengths: list[int] | None = None) -> None:
        """Stages this rank's items (`sources`, in plan order; `lengths` their
        staged_nbytes, when known) into the slot."""
        mgr = self.mgr
        if lengths is None:
            lengths = [staged_nbytes(s) for s in sources]
        # Room for the slot on this node, checked before anything in it changes.
        mgr._budget.check(self.slot, int(_ext.staged_bytes(lengths)))
        # The slot may still hold an older memory-tier checkpoint: uncommit it before
        # a single byte of it changes.
        _ext.uncommit(mgr._memory_storage, _ext.TierSet.slot_dir(self.slot))
        staged, _ = mgr._stager.stage(self.slot, sources, lengths=lengths,
                                      midway=lambda: _chaos.point("stage"))  # half written
        mgr._slot_held = self.slot
        self.staged = staged
        self.used = int(staged.bytes)
        self.capacity = int(staged.capacity)
        self.address = int(staged.address)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # The results are rebuilt by the coordinator from every rank's plan and the
        # (offsets, lengths) each rank gathers in the background (_Save.everyone),
        # as they are for a save staged without DCP (_PlanCache).
        self.metadata = metadata

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def storage_meta(self):
        return None


class _PlanningWriter(_StagingWriter):
    """A ``_StagingWriter`` that keeps DCP's plan and stages nothing (planning a save
    ahead: CheckpointManager._plan_ahead)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.plan, self.planner = plan, planner
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([])
        return fut


class _Skipped(Error):
    """A save that every rank skips, not an error of the run: the state's structure
    changed since the previous save on some ranks but not on others (see _stage).
    Logged at WARNING; on_durable gets it; wait() does not raise it."""


def _skip_message(step: int, rank: int, why: str) -> str:
    return (f"step {step} was not checkpointed (rank {rank}: {why} since the previous save, "
            "on some ranks but not on all, which the ranks learn only once each has staged; "
            "every rank skips this step and the next save() plans anew)")


def _state_dict_of(state: dict[str, Any]) -> dict[str, Any]:
    """What dcp.save saves of `state`: each Stateful replaced by its state_dict()."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def _plan_signature(flat: dict[str, Any]) -> tuple | None:
    """What DCP's plan and metadata of a flattened state dict depend on: every key,
    and for a tensor its dtype, shape, layout, requires_grad and pinning (the
    metadata's TensorProperties; DCP's dedup balances by dtype and shape). None when
    the plan cannot be reused: a tensor subclass (DTensor, ShardedTensor, ...),
    whose shards and placement are planned anew each time."""
    sig = []
    plain = (torch.Tensor, torch.nn.Parameter)
    for fqn, v in flat.items():
        if type(v) in plain:
            sig.append((fqn, v.dtype, v.shape, v.layout, v.requires_grad, v.is_pinned()))
        elif isinstance(v, torch.Tensor):
            return None
        else:
            sig.append((fqn,))  # a BYTE_IO item, whatever its value
    return tuple(sig)


@dataclasses.dataclass
class _PlanCache:
    """The plan of the last save that went through dcp.save, reused while the state
    dict's structure is unchanged (what DCP's own plan caching does, but skipping
    its planning and collectives altogether: the stall is then the copy).

    Valid for a state whose flattened dict has the same ``signature``
    (_plan_signature) and ``mappings`` (DCP's planner_data); with several ranks,
    every rank must agree it holds (one all-reduce). ``plans`` is every rank's plan
    (the coordinator only), ``plan`` this rank's, ``metadata`` DCP's global
    metadata: none of them depends on the values saved, only on the structure."""

    signature: tuple
    mappings: Any
    plan: SavePlan
    plans: list[SavePlan] | None
    metadata: Metadata | None
    # The state's container tree (one walk checks a new state and yields its leaves),
    # None when it could not be built: then the state is flattened and compared.
    shape: StateShape | None = None
    # this rank's items in plan order: (fqn, whether a BYTE_IO value)
    items: list[tuple[str, bool]] = dataclasses.field(default_factory=list)
    # per plan item, its leaf's index in the flattened state (StateShape.collect's order)
    order: list[int] = dataclasses.field(default_factory=list)
    # per plan item, the bytes a tensor item takes in a slot (None for a BYTE_IO value)
    lengths: list[int | None] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.items = [(it.index.fqn, it.type == WriteItemType.BYTE_IO) for it in self.plan.items]

    @classmethod
    def of(cls, writer: "_StagingWriter", state_dict: dict[str, Any]) -> "_PlanCache | None":
        """The cache of the save `writer` planned, of `state_dict` (what dcp.save was
        given: _state_dict_of(state))."""
        planner = writer.planner
        flat = getattr(planner, "state_dict", None)
        # Only the coordinator gets DCP's metadata and every rank's plan (it alone
        # builds the manifests).
        if (not isinstance(planner, DefaultSavePlanner) or not isinstance(flat, dict)
                or writer.plan is None
                or (writer.is_coordinator and (writer.plans is None or writer.metadata is None))):
            return None
        sig = _plan_signature(flat)
        if sig is None:
            return None
        mappings = getattr(planner, "mappings", None)
        cache = cls(sig, mappings, writer.plan, writer.plans, writer.metadata)
        # Every item must be a whole leaf (no chunk of a tensor): the steady path
        # stages each leaf as one item.
        index = {fqn: i for i, fqn in enumerate(flat)}
        if (isinstance(mappings, dict) and list(mappings) == list(flat)
                and all(it.index.offset is None or not any(it.index.offset)
                        for it in writer.plan.items)
                and len({fqn for fqn, _ in cache.items}) == len(cache.items)):
            cache.shape = StateShape.of(state_dict, mappings)
            cache.order = [index[fqn] for fqn, _ in cache.items]
            cache.lengths = [None if is_bytes else staged_nbytes(flat[fqn])
                             for fqn, is_bytes in cache.items]
        return cache

    def matches(self, flat: dict[str, Any], mappings: Any) -> bool:
        return mappings == self.mappings and _plan_signature(flat) == self.signature


class _Background:
    """One long-lived thread that runs the manager's background jobs (persisting a
    save) one after another. Handing it a job does not block: starting a fresh
    thread per save would (``Thread.start`` waits until the new thread holds the
    GIL, milliseconds under load), and that wait would be part of the stall.

    Used from the manager's thread only; a forked child (a DataLoader worker)
    inherits no thread and starts its own on its first job."""

    def __init__(self, name: str):
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, args=(self._jobs,),
                                            name=self._name, daemon=True)
            self._thread.start()

    def submit(self, fn: Any, *args: Any) -> threading.Event:
        """Queues ``fn(*args)``; the returned event is set once it has returned (fn
        keeps its own errors: one that escapes is logged)."""
        self.start()
        done = threading.Event()
        self._jobs.put((fn, args, done))
        return done

    @staticmethod
    def _run(jobs: queue.SimpleQueue) -> None:
        while True:
            fn, args, done = jobs.get()
            if fn is None:
                return
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - the job records its own errors
                log.exception("cairn: background job failed")
            finally:
                done.set()
                # An idle thread holds no reference to the manager or its save, so
                # an unclosed manager is still freed (a daemon thread's frame never is).
                del fn, args, done

    def is_current(self) -> bool:
        """Whether the caller is this thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def close(self) -> None:
        """Stops the thread once the jobs queued so far have run (does not wait)."""
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put((None, (), None))
        self._thread = None


@dataclasses.dataclass
class _Save:
    step: int
    slot: int
    durable: bool
    writer: _StagingWriter
    stall_s: float
    started: float
    done: threading.Event | None = None  # set once the background job has returned
    error: BaseException | None = None
    persist_s: float = 0.0
    everyone: list[dict] | None = None  # per-rank checksums and sizes, once gathered
    tiers_done: list[str] = dataclasses.field(default_factory=list)
    on_durable: Any = None  # save()'s callback, for a save that goes durable
    body: Any = None  # the memory-tier manifest (_ext.Manifest)
    skipped: BaseException | None = None  # a _Skipped: nothing committed, no error raised


class CheckpointManager:
    """Owns checkpointing and recovery of a training run.

    Args:
        root: the durable tier: a directory (or ``file://DIR``), created if missing, or
            ``s3://BUCKET/PREFIX`` (configured as the AWS tools are, see cairn.Writer).
        memory: keep checkpoints in this node's shared memory (the staging buffers)
            and restore from there first.
        local: an optional fast local directory (NVMe) tier.
        keep: committed checkpoints kept in the durable tier (>= 1). The newest valid
            one is never deleted. ``None``: the manager deletes no committed durable
            checkpoint, because another owner applies retention there (Ray Train's
            ``num_to_keep``, see ``cairn.ray``); partial leftovers are still removed.
        keep_local: checkpoints kept in the local tier (default: ``keep``, or 3).
        memory_slots: the most checkpoints held in shared memory (>= 1; default 2 with
            ``memory``, else 1). A save never overwrites the slot holding the newest
            committed step while no slower tier holds it (a memory-only step, or the
            one restore() read from memory), before a newer step has committed, so a
            crash at any instant leaves the newest step whole (docs/memory.md, "The
            restore contract"). A second slot is created only for that: with every
            save durable (``durable_every=1``, the default) one slot exists and the
            footprint is 1 × the state; from the first memory-only step on it is 2 ×.
            ``memory_slots=1`` never creates the second one and gives that up: each
            save overwrites the previous memory-tier checkpoint while it stages, so a
            crash then (or of a restarted process during its first save) loses every
            step that was in memory only and restore() falls back to the newest step
            of a slower tier. Replication needs >= 2 and alternates them (see
            ``replicas``).
        durable_every: every Nth save reaches the slower tiers (default 1: every save);
            ``save(..., durable=True)`` forces one.
        process_group: the group whose ranks checkpoint together (default: the world).
            The manager creates its own gloo group over those ranks.
        timeout: seconds for every collective and wait (default 600).
        thread_count: I/O threads of this manager's own pool (default: the process-wide
            pool, cairn._pools.io_pool(), 16 to 32 threads: enough for an s3:// root, where
            each thread keeps one part upload in flight).
        direct_io: O_DIRECT writes to the local and durable tiers where possible.
        memory_limit: the most node shared memory this run's memory tier may hold on
            each node (every local rank's slots together): bytes (int), or a fraction
            of /dev/shm's size (float in (0, 1]). A save that would exceed it, or that
            needs more than /dev/shm (or the node's memory) has free, fails before it
            changes a byte of shared memory, with cairn.errors.ResourceExhaustedError
            (a cairn.Error): the memory-tier checkpoint already there stays, and
            training can go on (save less often or with a smaller state, or raise the
            limit). Default: no limit beyond the free space, which is always checked.
        orphan_grace: seconds a crashed run's memory tier is kept for its restart
            before the next manager on the node reclaims it (see ``cairn gc``).
        replicas: copies of each node's memory tier kept in the shared memory of
            that many peer nodes (default 0; docs/memory.md). Needs ``memory_slots``
            >= 2 (the default then): with one slot, every node overwrites its previous
            step while the new one replicates, and a node lost in that window leaves
            no step in cluster memory; ``memory_slots=1`` with ``replicas`` is refused
            with InvalidArgumentError.
        allow_pickle: restore() loads non-tensor values that need unrestricted
            unpickling (a custom class), as ``cairn.Reader(allow_pickle=True)`` does;
            only for checkpoints you trust. Without it such a value warns when it is
            saved, and restore() refuses it.

    Thread-safety: one manager per process, used from one thread. ``save()`` returns
    after staging; ``wait()`` blocks until the save is durable; ``close()`` waits,
    flushes the newest save to the durable tier if it was not there yet, and frees
    the shared memory.

    Attributes:
        restored: ``(step, tier)`` of the last successful ``restore()``, tier one of
            ``"memory"``, ``"peer"`` (a replica on another node), ``"local"``,
            ``"durable"``; None before any, or when there was nothing to restore.
        flush_on_close: whether ``close()`` writes the newest save to the durable
            tier when it was memory-only (``durable=False`` or ``durable_every``);
            True. A subclass (or instance) whose durable tier another owner manages
            sets it False: ``cairn.ray``'s manager, where Ray tracks every durable
            checkpoint.
    """

    def __init__(self, root: str | os.PathLike, memory: bool = True,
                 local: str | os.PathLike | None = None, keep: int = 3, *,
                 keep_local: int | None = None, memory_slots: int | None = None,
                 durable_every: int = 1,
                 process_group: Any = None, timeout: float = 600.0,
                 thread_count: int | None = None, direct_io: bool = True,
                 memory_limit: int | float | None = None,
                 orphan_grace: float = float(_ext.DEFAULT_ORPHAN_GRACE_S),
                 replicas: int = 0, allow_pickle: bool = False):
        memory_slots = _ext.check_manager_options(replicas, bool(memory), keep, memory_slots,
                                                  durable_every, keep_local, timeout)
        limit_bytes = _ext.memory_limit_bytes(memory_limit)
        self.keep = keep
        self.allow_pickle = bool(allow_pickle)
        self._values_checked: set[str] = set()  # keys _value_source checked
        self._warm_slots: set[int] = set()  # slots this process has mapped and faulted
        self._prefault_job: threading.Event | None = None  # _prefault_next's
        self.keep_local = keep_local or keep or 3
        self.memory = bool(memory)
        # The tiers' URIs (checked apart), discovery, slot choice, retention (C++).
        # Each tier's storage is opened once there (a Storage given as root or local,
        # e.g. a fault-injecting wrapper, is used as it is).
        self._tiers = _ext.TierSet(_tier_arg(root), None if local is None else _tier_arg(local),
                                   memory=self.memory, num_slots=memory_slots, keep=keep,
                                   keep_local=self.keep_local)
        self.root, self.local = self._tiers.root, self._tiers.local
        self._memory_storage = self._tiers.storage("memory")
        self.durable_every = durable_every
        self.timeout = float(timeout)
        self.direct_io = direct_io
        # Writes to the slower tiers: this manager's own pool when thread_count is
        # given, else the process-wide one.
        self._io_pool = _ext.ThreadPool(thread_count) if thread_count else _pools.io_pool()
        self._closed = False
        self._inflight: _Save | None = None
        self._last: _Save | None = None
        self._pending_error: BaseException | None = None
        self._saves = 0
        self._history: list[dict[str, Any]] = []
        self._slot_held: int | None = None
        # The plan of the last save through dcp.save, reused while the state's
        # structure is unchanged (_PlanCache).
        self._plan_cache: _PlanCache | None = None
        # restore()'s planning of the next save, on the background thread (_plan_ahead).
        self._plan_job: threading.Event | None = None
        # Creates and pre-faults the next save's slot in the background (prepare()).
        self._prefault_thread: threading.Thread | None = None
        # Persists saves in the background (one thread for the manager's life).
        self._background = _Background("cairn-persist")
        # (step, tier) of the last successful restore(), e.g. (20, "memory").
        self.restored: tuple[int, str] | None = None

        # The checkpoint group: its own gloo group, so checkpoint collectives never
        # interleave with training collectives, each bounded by `timeout`.
        self._dist = dist.is_available() and dist.is_initialized()
        if self._dist:
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            self.pg = dist.new_group(ranks=ranks, backend="gloo",
                                     timeout=timedelta(seconds=self.timeout))
            self.rank = dist.get_rank(self.pg)
            self.world = dist.get_world_size(self.pg)
        else:
            self.pg = None
            self.rank, self.world = 0, 1
        self.is_coordinator = self.rank == 0
        # The lowest rank of each node writes that node's memory-tier manifests
        # (every node's shared memory holds its own ranks' slot files).
        hosts = self._gather(_replication.node_id())
        self._hosts = hosts
        self._node_leader = self.rank == hosts.index(hosts[self.rank])
        self._single_node = len(set(hosts)) == 1
        _chaos.arm()

        # The run's identity, in the durable root (cairn.run), so that a memory-tier
        # checkpoint left by another run on the same path is never restored.
        if self.is_coordinator:
            self._tiers.create_tiers()
        self.run_id = self._agree(self._tiers.read_or_create_run_id() if self.is_coordinator
                                  else None)
        self._tiers.run_id = self.run_id
        self.shm_name, self.shm_dir = self._tiers.shm_name, self._tiers.shm_dir
        self.num_slots = memory_slots
        # Engine readers of memory-tier slots that candidates() opened, by uri,
        # reused by the restore() that asked (and dropped when it returns).
        self._open_readers: dict[str, Any] = {}
        # This process owns the tier from now on (a lock, an owner record and a
        # heartbeat, in C++); then the node's orphaned tiers of crashed runs go.
        self._lease = _ext.MemoryTierLease(self.shm_dir, run_root=self.root,
                                           run_id=self.run_id, rank=self.rank)
        if self._node_leader:
            _memory_budget.reclaim_orphans(float(orphan_grace))
        self._budget = _memory_budget.Budget(self, memory_limit, limit_bytes)
        # Replicas of the memory tier on peer nodes, and restore from them
        # (cairn/_replication.py).
        self._repl = _replication.Replication(self, replicas if self.memory else 0, hosts)
        # The staging pool is opened at the first save, not here: a DataLoader
        # forked before that would otherwise inherit the slot files' locks and
        # could keep a restarted process out of its own slots.
        self._pool_obj: Any = None
        self._stager_obj: SlotStager | None = None
        # Tests route CPU tensors through the device staging path (its CPU fallback).
        self._device_path_for_tests = False
        # The slot the next save stages into, and the slot no save may overwrite
        # (None: any), the same on every rank (_save_slot). restore() sets both from
        # what it restored; until then the oldest slot (a fresh run: slot 0).
        self._next_slot = self._agree(self._tiers.oldest_slot() if self.is_coordinator else 0)
        self._keep_slot: int | None = None
        self._background.start()
        # An interpreter that exits without close() ends the manager safely
        # (_end_at_exit): the memory tier stays if it holds the newest step.
        self._pid = os.getpid()
        _live_managers.add(self)

    # ---- small helpers -----------------------------------------------------------

    @property
    def _pool(self) -> Any:
        if self._pool_obj is None:
            # The slot files are the memory tier: they outlive the pool, and only
            # close() (or the exit hook) removes them, and not while they hold the
            # newest step (_end).
            self._pool_obj = _ext.StagingPool(self.shm_dir, rank=self.rank,
                                              num_slots=self.num_slots,
                                              threads=_pools.thread_count("copy"),
                                              remove_on_close=False)
        return self._pool_obj

    @property
    def _stager(self) -> SlotStager:
        """The staging engine's Python side (device copies, pinning) over the pool."""
        if self._stager_obj is None:
            self._stager_obj = SlotStager(self._pool)
        self._stager_obj.device_path_for_tests = self._device_path_for_tests
        return self._stager_obj

    def _collective(self) -> None:
        """Before a collective on the checkpoint group from any thread but the
        background one: restore()'s planning there, which runs collectives on that
        group too, must be done (the same order on every rank)."""
        if self._plan_job is not None and not self._background.is_current():
            if not self._join_plan_job():
                raise TimeoutError(
                    f"the next save still being planned after {self.timeout:.0f}s")

    def _agree(self, value: Any) -> Any:
        """The coordinator's `value`, on every rank."""
        if not self._dist:
            return value
        self._collective()
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, 0), group=self.pg)
        return box[0]

    def _gather(self, value: Any) -> list[Any]:
        if not self._dist:
            return [value]
        self._collective()
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.pg)
        return out

    def _memory_checkpoints(self) -> dict[int, tuple[int, str]]:
        """{slot: (step, uri)} of this node's committed memory-tier checkpoints of this run."""
        return self._tiers.memory_checkpoints()

    # ---- save ----------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], *, durable: bool | None = None,
             on_durable: Any = None) -> bool:
        """Checkpoints `state` (a dict of tensors and DCP Statefuls) as `step`.

        Blocks only while the state is copied into shared memory; persistence runs in
        the background. Waits for the previous save first and raises its error, if any.
        `durable` forces (True) or skips (False) the slower tiers for this save;
        by default every `durable_every`-th save goes there. Returns whether this save
        goes to the durable tier.

        `on_durable(error)`, for a save that goes to the durable tier, is called once
        from the background thread: with None once the save is in the durable tier
        (on rank 0, the coordinator, right after its manifest is committed; on the
        other ranks once every rank's data file is durable, which may be just before
        that commit), or with the exception that stopped persistence (which
        ``wait()`` raises too). It must not call into the manager; an exception it
        raises is logged.
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidArgumentError(f"step must be an int >= 0, got {step!r}")
        if not isinstance(state, dict):
            raise InvalidArgumentError("state must be a dict of tensors and Statefuls")
        self.wait()  # the save in flight, and prepare()'s pre-faulting
        if not self._join_prefault_job():
            raise TimeoutError(f"staging slot still being pre-faulted after {self.timeout:.0f}s")
        self._saves += 1
        goes_durable = durable if durable is not None else (self._saves % self.durable_every == 0)
        slot = self._save_slot()
        t0 = time.perf_counter()
        # A failed save leaves `slot` uncommitted (before a byte of it changed): a
        # retry stages there again, never into the kept slot.
        try:
            writer = self._stage(step, slot, state)
        except _Skipped as e:
            log.warning("cairn: %s", e)
            if goes_durable and on_durable is not None:
                try:
                    on_durable(e)
                except Exception:  # noqa: BLE001 - as for a save that ran
                    log.exception("cairn: on_durable callback of step %d failed", step)
            return False
        stall = time.perf_counter() - t0
        rec = _Save(step=step, slot=slot, durable=goes_durable, writer=writer, stall_s=stall,
                    started=time.perf_counter(), on_durable=on_durable if goes_durable else None)
        self._inflight = rec
        rec.done = self._background.submit(self._persist, rec)
        self._warm_slots.add(slot)
        self._prefault_next(rec)
        return goes_durable

    def _save_slot(self) -> int:
        """The slot the next save stages into, the same on every rank (derived from
        what every rank shares: the outcomes of the saves, what restore() agreed).

        A slot may be overwritten unless it is the kept slot (``_keep_slot``): the one
        holding the newest committed step while no slower tier holds that step (a
        memory-only save, one whose persistence failed, a memory-only step restore()
        read). The save reuses ``_next_slot`` (the slot this process staged into or
        pre-faulted last) unless it is the kept one; then it takes another, which
        is created then, or was pre-faulted once the kept step committed. So with
        every save durable only one slot ever exists."""
        slot = self._next_slot
        if slot == self._keep_slot and self.num_slots > 1:
            slot = self._other_slot(slot)
        self._next_slot = slot
        return slot

    def _other_slot(self, slot: int) -> int:
        """A slot other than `slot` (with two slots, the other one)."""
        return (slot + 1) % self.num_slots

    def _keeps(self, rec: _Save) -> bool:
        """Whether save `rec`, finished, leaves its slot kept: committed in the memory
        tier and in no slower tier (or replication is on: the previous step stays in
        cluster memory while the next one replicates, so every save's slot is kept
        until a newer one committed). Every rank has the same `rec.tiers_done`."""
        if "memory" not in rec.tiers_done:
            return False
        if self._repl.k:
            return True
        return not any(t in rec.tiers_done for t in ("local", "durable"))

    def _stage(self, step: int, slot: int, state: dict[str, Any]) -> _StagingWriter:
        """The blocking half of save(): stages `state` into `slot`. Raises a
        cairn.Error (DCP's CheckpointException unwrapped, kept as __cause__)."""
        sd = _state_dict_of(state)
        cache = self._plan_cache
        # The steady case: one walk checks the state against the cached plan's and
        # yields its leaves (StateShape); else flatten it and compare.
        leaves = cache.shape.collect(sd) if cache is not None and cache.shape is not None else None
        if leaves is not None:
            hit = True
            writer, err = self._stage_planned(cache, slot, leaves, None)
        else:
            flat, mappings = flatten_state_dict(sd)
            hit = cache is not None and cache.matches(flat, mappings)
            writer, err = self._stage_planned(cache, slot, flat, mappings) if hit else (None, None)
        if self._dist:
            # One all-reduce agrees on both: every rank staged with the cached plan, and
            # every rank's staging succeeded. A rank that did both does not wait for it
            # (a collective in the stall costs the other ranks' scheduling latency):
            # the background job checks the outcome before anything is committed
            # (_check_agreement). A rank that missed or failed waits for it here.
            if hit and err is None:
                writer.agreement = self._sum_async(1, 1)
                return writer
            hits, _ = self._sum(hit, err is None)
            if hits < self.world:
                self._plan_cache = None  # on every rank: the next save plans anew
            if err is not None and hits < self.world:
                self._release_slot()  # skipped on every rank (some rank missed the plan)
                raise _Skipped(_skip_message(step, self.rank, f"staging failed ({err}), and a "
                                             "state's structure changed"))
            if err is not None:
                # This rank's staging failed: the save fails on every rank, each raising
                # from the same call (wait() or the next save()), as the others learn it
                # only in the background (_check_agreement).
                self._release_slot()
                writer.failed = err
                return writer
            if hits:
                # This rank missed the cached plan; the others staged with it and went
                # on training: this step cannot be saved consistently. Every rank
                # skips it (the others in _check_agreement).
                raise _Skipped(_skip_message(step, self.rank, "its state's structure changed"))
        else:
            ok = err is None
            if hit and not ok:
                self._release_slot()
                assert err is not None
                raise err
        if not hit:
            if writer is not None:
                self._release_slot()  # staged with the old plan: staged again below
            self._plan_cache = None
            writer = _StagingWriter(self, slot)
            try:
                with warnings.catch_warnings():
                    # Single-process runs are fine: DCP's warning about it is noise here.
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp.save(sd, storage_writer=writer, process_group=self.pg)
            except BaseException as e:
                self._release_slot()
                _memory_budget.raise_budget_error(e)
                err = _as_cairn_error(e, f"saving step {step}")
                if err is e:
                    raise
                raise err from e
            self._plan_cache = _PlanCache.of(writer, sd)
            writer.planner = None  # it holds the state's tensors
        return writer

    def _value_source(self, fqn: str, data: Any) -> np.ndarray:
        """The staging source of the non-tensor value `fqn` (its stored bytes). Warns,
        once per key, when the value is pickled and restore() would refuse it without
        ``allow_pickle=True`` (cairn._stock_reader.check_value_is_safe)."""
        if not self.allow_pickle and fqn not in self._values_checked:
            self._values_checked.add(fqn)
            if bytes(memoryview(data)[:len(VALUE_MAGIC)]) != VALUE_MAGIC:
                try:
                    check_value_is_safe(bytes(data), f"value {fqn!r}")
                except CorruptionError as e:
                    warnings.warn(
                        f"cairn: the value {fqn!r} is saved pickled and restore() will refuse "
                        f"it unless the manager is created with allow_pickle=True ({e})",
                        UserWarning, stacklevel=4)
        return byte_source(data)

    def _stage_planned(self, cache: _PlanCache, slot: int, flat: dict[str, Any] | list[Any],
                       mappings: Any) -> tuple[_StagingWriter, BaseException | None]:
        """Stages a state with the cached plan: what dcp.save would do for a state of
        this structure, without its planning. `flat` is the flattened state (and
        `mappings` DCP's), or the list of its leaves StateShape.collect gave. Returns
        (writer, the staging error or None); save() agrees on the outcome with the
        other ranks."""
        writer = _StagingWriter(self, slot)
        writer.is_coordinator = self.is_coordinator
        planner = DefaultSavePlanner()
        planner.is_coordinator = self.is_coordinator
        err: BaseException | None = None
        try:
            # The cached plan holds whole plain tensors only (_plan_signature), so each
            # tensor item is its flattened value, as DCP's resolve_data would find it.
            if isinstance(flat, list):
                values = [flat[i] for i in cache.order]
                planner.state_dict = {fqn: v for (fqn, is_bytes), v in zip(cache.items, values)
                                      if is_bytes}
                lengths = cache.lengths
            else:
                values = [flat[fqn] for fqn, _ in cache.items]
                planner.state_dict, planner.mappings = flat, mappings
                lengths = None
            sources = [self._value_source(fqn, value_bytes(planner, item)) if is_bytes else v
                       for item, (fqn, is_bytes), v in zip(cache.plan.items, cache.items, values)]
            if lengths is not None:
                lengths = [staged_nbytes(src) if n is None else n
                           for src, n in zip(sources, lengths)]
            writer.plan = cache.plan
            writer.stage(sources, lengths)
            del sources, values
        except BaseException as e:  # noqa: BLE001 - agreed on in save()
            err = e
        writer.plans, writer.metadata = cache.plans, cache.metadata
        return writer, err

    @staticmethod
    def _flags(flags: tuple[bool, ...]) -> torch.Tensor:
        return torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)

    def _sum(self, *flags: bool) -> tuple[int, ...]:
        """For each of `flags`, on how many ranks of the checkpoint group it holds
        (one all-reduce, matching a _sum_async of as many flags on the other ranks)."""
        work, t = self._sum_async(*flags)
        work.wait()
        return tuple(int(x) for x in t.tolist())

    def _sum_async(self, *flags: bool) -> tuple[Any, torch.Tensor]:
        """_sum without waiting: (the collective's Work, the tensor it sums into)."""
        self._collective()
        t = self._flags(flags)
        return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.pg, async_op=True), t

    def _check_agreement(self, rec: _Save) -> None:
        """Background: the outcome of the all-reduce a save staged with the cached
        plan did not wait for (_stage). Raises when another rank failed staging
        (an Error: the save failed on every rank) or missed the cached plan
        (_Skipped); either way nothing of this save is committed."""
        work, t = rec.writer.agreement
        rec.writer.agreement = None
        work.wait(timeout=timedelta(seconds=self.timeout))
        hits, oks = (int(x) for x in t.tolist())
        if hits < self.world:
            self._plan_cache = None  # read by the next save(), which waits for this job
            raise _Skipped(_skip_message(rec.step, self.rank,
                                         "another rank's state changed its structure"))
        if oks < self.world:
            raise Error(f"staging of step {rec.step} failed on another rank; "
                        "this save was not committed")

    def _all(self, *flags: bool) -> Any:
        """Whether each of `flags` holds on every rank of the checkpoint group (one
        all-reduce): a bool for one flag, a tuple for several."""
        self._collective()
        t = self._flags(flags)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.pg)
        out = tuple(bool(x) for x in t.tolist())
        return out[0] if len(out) == 1 else out

    def _release_slot(self) -> None:
        if self._slot_held is not None:
            try:
                self._pool.release(self._slot_held)
            except Error:
                pass
            self._slot_held = None

    def _persist(self, rec: _Save) -> None:
        try:
            self._persist_inner(rec)
        except _Skipped as e:  # not an error of the run: logged, the next save plans
            log.warning("cairn: %s", e)
            rec.skipped = e
        except BaseException as e:  # kept for the next save()/wait()/close()
            rec.error = e
        finally:
            self._release_slot()
            rec.persist_s = time.perf_counter() - rec.started
            if rec.on_durable is not None:
                try:
                    rec.on_durable(rec.error if rec.skipped is None else rec.skipped)
                except Exception:  # noqa: BLE001 - the save's outcome stands
                    log.exception("cairn: on_durable callback of step %d failed", rec.step)

    def _persist_inner(self, rec: _Save) -> None:
        w = rec.writer
        slot = rec.slot
        if w.failed is not None:
            raise w.failed
        if w.agreement is not None:
            self._check_agreement(rec)
        # a. checksums of this rank's items, from the slot (C++, GIL released).
        err = None
        sums: list[tuple[int, ...]] = []
        try:
            sums = [tuple(c) for c in self._pool.item_checksums(w.staged,
                                                                 int(_ext.DEFAULT_BLOCK_SIZE))]
        except BaseException as e:
            err = f"rank {self.rank}: checksumming staged data: {e}"
        # b. everyone learns everyone's outcome.
        mine = {"err": err, "sums": sums, "used": w.used, "capacity": w.capacity,
                "offsets": list(w.staged.offsets), "lengths": list(w.staged.lengths)}
        if self._repl.k and self._repl.multi:  # what replication needs, in the same gather
            mine.update(repl=self._repl.offer(slot))
        everyone = self._gather(mine)
        errors = [o["err"] for o in everyone if o["err"]]
        if errors:
            raise Error("staging of step %d failed: %s" % (rec.step, "; ".join(errors)))
        # c. the memory tier: the slot with its manifest.
        body = None
        if self.is_coordinator:
            body = self._body(rec, everyone, size_key="capacity")
        body = self._agree(body)
        if self._node_leader:
            _ext.commit_manifest(self._memory_storage, body, dir=_ext.TierSet.slot_dir(slot))
        rec.everyone = everyone
        rec.body = body
        rec.tiers_done.append("memory")
        if self._repl.k:
            _chaos.point("replicate")
            t = time.perf_counter()
            if self._repl.replicate(rec):
                rec.tiers_done.append("peer")
            self._repl.last_s = time.perf_counter() - t
        if rec.durable:
            self._persist_slower_tiers(rec)

    def _persist_slower_tiers(self, rec: _Save) -> None:
        """d. the local tier, then the durable one."""
        for tier in self._tiers.slower_tiers():
            self._persist_to(rec, tier, rec.everyone)
            rec.tiers_done.append(tier)

    def _persist_to(self, rec: _Save, tier: str, everyone: list[dict]) -> None:
        uri = self._tiers.step_uri(tier, rec.step)  # for messages
        storage, step_dir = self._tiers.storage(tier), _ext.TierSet.step_dir(rec.step)
        err, size = None, 0
        try:
            _ext.uncommit(storage, step_dir)
            size = self._pool.write_data_file(rec.writer.staged, storage,
                                              _ext.join_key(step_dir,
                                                            _ext.data_file_key(self.rank)),
                                              self._io_pool, direct_io=self.direct_io, sync=True,
                                              block_size=int(_ext.DEFAULT_BLOCK_SIZE))
        except BaseException as e:
            err = f"rank {self.rank}: writing {uri}: {e}"
        _chaos.point("persist")  # data files written, manifest not yet
        outcome = self._gather({"err": err, "size": size})
        errors = [o["err"] for o in outcome if o["err"]]
        if errors:
            raise Error("persisting step %d failed, checkpoint not committed: %s"
                        % (rec.step, "; ".join(errors)))
        if self.is_coordinator:
            sized = [dict(o, tier_size=x["size"]) for o, x in zip(everyone, outcome)]
            body = self._body(rec, sized, size_key="tier_size")
            _chaos.point("commit")  # every data file durable, no manifest yet
            _ext.commit_manifest(storage, body, dir=step_dir)
            self._prune(tier)

    def _body(self, rec: _Save, everyone: list[dict], size_key: str) -> _ext.Manifest:
        """The manifest of this save, with the per-rank file sizes of one tier: every
        rank's plan items at the offsets and lengths that rank staged them."""
        w = rec.writer
        assert w.metadata is not None and w.plans is not None
        results = []
        for rank, plan in enumerate(w.plans):
            info = everyone[rank]
            key = _ext.data_file_key(rank)
            if len(plan.items) != len(info["offsets"]):
                raise Error(f"rank {rank} staged {len(info['offsets'])} items of a plan of "
                            f"{len(plan.items)}")
            results.append([
                WriteResult(index=item.index, size_in_bytes=length,
                            storage_data=Location(key, info[size_key], off, length, sums))
                for item, off, length, sums in zip(plan.items, info["offsets"],
                                                    info["lengths"], info["sums"])])
        extra = {"save_id": uuid.uuid4().hex, "path": None,
                 "manager": {"step": rec.step, "run_id": self.run_id}}
        return manifest_from_metadata(w.metadata, results, int(_ext.DEFAULT_BLOCK_SIZE), extra)

    def _prune(self, tier: str) -> None:
        """Retention of `tier` ("local" or "durable", TierSet::Prune: its newest
        ``keep_local``/``keep`` committed checkpoints stay, older ones and partial
        leftovers go, manifest first). A failure here loses nothing: it is logged."""
        err = self._tiers.prune(tier)  # with the chaos harness's "prune" point
        if err:
            log.warning("cairn: pruning %s: %s", self._tiers.tier_uri(tier), err)

    # ---- waiting and closing ---------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the save in flight is persisted; raises its error, if any, or
        cairn.TimeoutError after `timeout` seconds (default: the manager's). Also
        waits for the shared memory that prepare() is pre-faulting, and for restore()'s
        planning of the next save."""
        if not self._join_plan_job(timeout):
            raise TimeoutError("the next save still being planned after "
                               f"{self.timeout if timeout is None else timeout:.0f}s")
        if self._prefault_thread is not None:
            self._prefault_thread.join(self.timeout if timeout is None else timeout)
            if self._prefault_thread.is_alive():
                raise TimeoutError("shared memory still being pre-faulted after "
                                   f"{self.timeout if timeout is None else timeout:.0f}s")
            self._prefault_thread = None
        rec = self._inflight
        if rec is not None:
            assert rec.done is not None
            if not rec.done.wait(self.timeout if timeout is None else timeout):
                raise TimeoutError(f"checkpoint of step {rec.step} still persisting after "
                                   f"{self.timeout if timeout is None else timeout:.0f}s")
            self._inflight = None
            self._last = rec
            self._history.append({"step": rec.step, "stall_s": rec.stall_s,
                                  "persist_s": rec.persist_s, "tiers": list(rec.tiers_done),
                                  "bytes": rec.writer.used,
                                  "ok": rec.error is None and rec.skipped is None})
            if "memory" in rec.tiers_done:
                # Its slot holds the newest committed step: kept while no slower tier
                # has it; else no slot needs keeping (the older ones hold older steps).
                self._keep_slot = rec.slot if self._keeps(rec) else None
            if rec.error is not None:
                self._release_slot()
                self._pending_error = rec.error
        if self._pending_error is not None:
            e, self._pending_error = self._pending_error, None
            if isinstance(e, Error):
                raise e
            raise Error(f"background checkpoint failed: {e}") from e

    def stats(self) -> dict[str, Any]:
        """Figures of this manager's successful saves so far, for logging:
        ``{"saves": N, "median_stall_s", "median_persist_s", "last": {...}}``
        (``{"saves": 0}`` before the first). ``stall_s`` is the time ``save()``
        blocked (staging), ``persist_s`` the background time until the save's last
        tier committed; ``last`` is the newest save's ``step``, ``stall_s``,
        ``persist_s``, ``tiers`` (those it reached, e.g. ``["memory", "durable"]``),
        ``bytes`` (this rank's staged bytes) and ``ok``."""
        h = [x for x in self._history if x["ok"]]
        if not h:
            return {"saves": 0}
        med = lambda k: float(np.median([x[k] for x in h]))  # noqa: E731
        return {"saves": len(h), "median_stall_s": round(med("stall_s"), 4),
                "median_persist_s": round(med("persist_s"), 4), "last": h[-1]}

    # close() writes the newest save to the durable tier if it was not there yet.
    # A subclass whose durable tier is owned by someone else (cairn.ray: Ray Train
    # tracks every durable checkpoint) turns that off.
    flush_on_close = True

    def close(self) -> None:
        """Waits for the save in flight, makes sure the newest step reached the durable
        tier (unless ``flush_on_close`` is False), and frees the shared memory (the
        memory tier ends with the manager).

        The newest step is the last save or, when this manager saved nothing (or its
        last save failed), a memory-tier step newer than every slower tier's: the
        one restore() read from memory, which may be the only copy of the run's
        progress. Should the memory tier still hold a step no slower tier has (the
        flush failed), it is kept in shared memory, as after a crash, for the restart
        to restore (logged at WARNING; ``cairn gc`` or the next manager on the node
        reclaims it after ``orphan_grace``). With ``flush_on_close`` False the memory
        tier ends with the manager, memory-only steps included."""
        if self._closed:
            return
        try:
            self.wait()
            last = self._last
            if (self.flush_on_close and last is not None and last.error is None
                    and not last.durable):
                last.durable = True
                last.started = time.perf_counter()
                self._inflight = last
                last.done = self._background.submit(self._flush, last)
                self.wait()
            elif self.flush_on_close and (last is None or last.error is not None):
                self._flush_memory_only()
        finally:
            self._closed = True
            _live_managers.discard(self)
            # flush_on_close=False (cairn.ray): the durable tier is someone else's
            # and a memory-only step ends with the manager, as documented there.
            self._end(collective=True, keep_newest=self.flush_on_close)

    def _end(self, collective: bool, keep_newest: bool = True, keep_tier: bool = False) -> None:
        """Frees what the manager holds: its threads, the staging pool's mappings, the
        memory tier (unless `keep_tier`, or `keep_newest` and it holds the newest step,
        _memory_holds_newest) and the lease. `collective`: the ranks meet once first
        (close()), not at exit."""
        self._join_prefault_job()  # it maps a slot: before the pool closes
        self._background.close()
        if self._stager_obj is not None:
            try:
                self._stager_obj.unpin_all()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        if self._pool_obj is not None:
            self._pool_obj.close()
        if collective and self._dist:
            try:
                dist.barrier(group=self.pg)
            except Exception:  # noqa: BLE001 - peers may be gone at shutdown
                pass
        self._repl.close(keep=keep_tier)
        keep = keep_tier or (keep_newest and self._node_leader and self._memory_holds_newest())
        if keep_tier:
            log.info("cairn: exiting without close(): the memory tier %s stays for the "
                     "restart (reclaimed after orphan_grace, or by `cairn gc`)", self.shm_dir)
        elif keep:
            log.warning("cairn: keeping the memory tier %s: it holds a step that no slower "
                        "tier has (a restart restores it; `cairn gc` reclaims it after "
                        "orphan_grace)", self.shm_dir)
        elif self._node_leader:
            # The memory tier ends with the manager: slot manifests and any
            # leftovers of crashed processes go with it.
            shutil.rmtree(self.shm_dir, ignore_errors=True)
        try:  # the last owner out removes a tier left empty (a rank's own root)
            self._lease.release(remove_if_empty=not keep)
        except Error as e:
            log.warning("cairn: releasing the memory tier %s: %s", self.shm_dir, e)

    def _memory_holds_newest(self) -> bool:
        """Whether this node's memory tier holds a committed step newer than every
        slower tier's newest (then it is the only copy of that step). True when
        that cannot be told (a slower tier unreadable): keeping loses nothing."""
        if not self.memory:
            return False
        try:
            held = self._memory_checkpoints()
            if not held:
                return False
            found, _, _ = self._tiers.candidates(False)
            return max(s for s, _ in held.values()) > max((c[0] for c in found), default=-1)
        except Exception as e:  # noqa: BLE001 - keep it rather than guess
            log.warning("cairn: listing the tiers at close: %s", e)
            return True

    def _flush_memory_only(self) -> None:
        """close() of a manager with no successful save of its own: copies the newest
        memory-tier step that every rank holds to the slower tiers, when no slower
        tier holds it or a newer step (the step restore() read from memory, or one a
        crashed process left there). Collective. A failure is logged: the memory
        tier then stays (_end)."""
        if not self.memory:
            return
        held = {step: slot for slot, (step, _) in self._memory_checkpoints().items()}
        everyone = self._gather(sorted(held))
        common = set(everyone[0]).intersection(*map(set, everyone[1:]))
        if not common:
            return
        step = max(common)
        todo: list[str] = []
        if self.is_coordinator:
            found, _, _ = self._tiers.candidates(False)
            if step > max((c[0] for c in found), default=-1):
                todo = list(self._tiers.slower_tiers())
        todo = self._agree(todo)
        if not todo:
            return
        if not self._single_node:
            # Each node holds its own ranks' data files only: a save copies them rank
            # by rank, close() does not. The memory tier stays for the restart.
            log.warning("cairn: step %d is in the memory tier only; not flushed at close "
                        "across nodes", step)
            return
        ok = True
        if self.is_coordinator:
            try:
                for tier in todo:
                    _ext.copy_checkpoint_dir(self._memory_storage,
                                             _ext.TierSet.slot_dir(held[step]),
                                             self._tiers.storage(tier),
                                             _ext.TierSet.step_dir(step), self._io_pool,
                                             direct_io=self.direct_io, sync=True)
                    self._prune(tier)
                log.info("cairn: close() flushed step %d from the memory tier to the %s "
                         "tier(s)", step, ", ".join(todo))
            except Exception as e:  # noqa: BLE001 - the memory tier stays
                ok = False
                log.warning("cairn: flushing step %d from the memory tier at close: %s",
                            step, e)
        self._gather(ok)  # every rank waits for the copy

    def _end_at_exit(self) -> None:
        """The interpreter exits with this manager still open (no close()): no
        collective (the peers may be gone), nothing flushed; the save in flight is
        waited for (bounded), then the manager's threads and mappings end; the memory
        tier stays, as after a crash (an exit without close() usually is one: a peer
        died, user code raised), so the restart restores from memory and from the
        replicas this node holds. Called by the atexit hook."""
        if self._closed or os.getpid() != self._pid:
            return  # closed, or a forked child: the manager is its parent's
        self._closed = True
        bound = min(self.timeout, 60.0)
        rec = self._inflight
        busy = rec is not None and rec.done is not None and not rec.done.wait(bound)
        busy = busy or not self._join_prefault_job(bound) or not self._join_plan_job(bound)
        if self._prefault_thread is not None:
            self._prefault_thread.join(bound)
            busy = busy or self._prefault_thread.is_alive()
        if busy:
            # The background thread still uses the slots: unmapping them under it
            # would crash it. Leave everything, as a crash would.
            log.warning("cairn: exiting with a save still persisting; the memory tier %s "
                        "stays", self.shm_dir)
            self._background.close()
            return
        self._end(collective=False, keep_tier=True)

    def _flush(self, rec: _Save) -> None:
        """Persists a save that stayed in memory only (close() of a run whose newest
        save was not durable)."""
        try:
            self._pool.acquire_slot(rec.slot, 0)
            self._slot_held = rec.slot
            self._persist_slower_tiers(rec)
        except BaseException as e:  # noqa: BLE001 - raised by wait()
            rec.error = e
        finally:
            self._release_slot()
            rec.persist_s = time.perf_counter() - rec.started

    def _check_open(self) -> None:
        if self._closed:
            raise Error("CheckpointManager is closed")

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- restore ---------------------------------------------------------------------

    def candidates(self) -> list[tuple[int, str, str]]:
        """This rank's committed checkpoints, as (step, tier, uri), fastest tier first."""
        self._check_open()
        if not self._join_plan_job():  # its collectives come first, on every rank
            raise TimeoutError(f"the next save still being planned after {self.timeout:.0f}s")
        return [c[:3] for c in self._candidates()]

    def _candidates(self) -> list[tuple[int, str, str, str]]:
        """candidates() with each one's name: its directory in the tier's storage
        ("" for the cluster view)."""
        out = []
        if self.memory and self._repl.multi:
            out.extend(self._repl.candidates())  # collective: memory and peer tiers
        # The memory tier's engine readers opened on the way are kept for restore().
        found, skipped, readers = self._tiers.candidates(self.memory and not self._repl.multi)
        for uri, status in skipped:  # damaged or unusable: restore moves on
            log.warning("cairn: skipping %s: %s", uri, status)
        self._open_readers.update(readers)
        return out + found

    def restore(self, state: dict[str, Any], *, skip_mismatched: bool = False) -> int | None:
        """Loads into `state` the newest step that every rank can load, from the
        fastest tier holding it: what ``dcp.load(state,
        storage_reader=cairn.Reader(<that checkpoint>))`` loads (tensors in place,
        nested containers, top-level plain values replaced, Statefuls through
        ``load_state_dict``), from any tier. A checkpoint that is missing, damaged or
        unreadable is skipped, logged at WARNING with the reason, for the next tier
        or an older step. Returns the step, or None when there is nothing to restore.

        A checkpoint that loads but does not match `state` (a key of `state` it lacks,
        a tensor of another shape or dtype) is the caller's mistake, not damage: it
        raises cairn.InvalidArgumentError (a ValueError) naming each key and both
        shapes/dtypes, and no older step is tried. ``skip_mismatched=True`` restores
        the newest step that fits instead (each skipped one logged at WARNING).
        Raises cairn.CorruptionError when checkpoints exist but none of them loads."""
        self._check_open()
        self.wait()
        try:
            return self._restore(state, skip_mismatched)
        finally:
            self._open_readers.clear()

    def _restore(self, state: dict[str, Any], skip_mismatched: bool = False) -> int | None:
        mine = self._candidates()
        # The steps every rank holds, newest first, and each rank's fastest source
        # of one not failed yet (C++).
        held = self._gather(sorted({(s, t) for s, t, _, _ in mine}))  # every rank's
        plan = _ext.RestorePlanner(mine, held)
        if not plan.steps:
            self._plan_ahead(state, background=True)
            self.prepare(state)
            return None
        for step in plan.steps:
            while True:
                choice = plan.next(step)  # (tier, uri, name) or None
                ok, reader, err, lent = choice is not None, None, None, False
                uri = None if choice is None else choice[1]
                if self._repl.multi and any(self._gather(uri == "cluster")):
                    try:  # collective: every node assembles the step from its peers
                        view = self._repl.materialize(step)
                        if uri == "cluster":
                            uri = view
                    except BaseException as e:  # noqa: BLE001 - agreed on below
                        ok, err = False, e
                if choice is not None and ok:
                    try:
                        engine = self._open_readers.pop(uri, None)
                        if engine is not None:  # opened by candidates()
                            reader = Reader._of_engine_reader(uri, engine)
                        elif choice[0] in ("local", "durable"):  # in the tier's storage
                            reader = Reader._in(self._tiers.storage(choice[0]), choice[2], uri)
                        else:  # the replication view the engine just assembled
                            reader = Reader(uri)
                        reader.allow_pickle = self.allow_pickle
                        if choice[0] in ("memory", "peer"):
                            # Node memory: copying and hashing, a thread per core.
                            reader._pool = _pools.copy_pool()
                        if choice[0] == "memory":
                            lent = self._read_through_slot(reader, choice[2])
                    except BaseException as e:  # noqa: BLE001 - agreed on below
                        ok, err = False, e
                verdicts = self._gather((ok, None if choice is None else choice[0]))
                if not all(v[0] for v in verdicts):
                    if lent:  # another rank cannot read this step: give the slot back
                        reader._reader.close_files()
                    if choice is None:
                        break  # some rank has no tier left for this step
                    if not ok:
                        log.warning("cairn: skipping step %d in the %s tier (%s): %s", step,
                                    choice[0], uri, unwrap(err))
                        plan.fail(step, choice[0], str(err))
                    if any(v[1] is None for v in verdicts):
                        break
                    continue
                try:
                    self._load(state, reader, on_disk=choice[0] in ("local", "durable"))
                    ok, err = True, None
                except BaseException as e:  # noqa: BLE001
                    ok, err = False, e
                finally:
                    if lent:  # gives the slot back, for the next save
                        reader._reader.close_files()
                verdicts = self._gather(ok)
                if self._repl.multi:
                    self._repl.drop_view()
                if isinstance(err, _Mismatch) and not skip_mismatched:
                    # Every rank raised it (_load agrees on it): the caller's state
                    # does not fit, and an older step that happens to fit is not it.
                    raise InvalidArgumentError(
                        f"step {step} ({uri}) does not match the state to restore into: "
                        f"{err} (pass skip_mismatched=True to restore the newest step "
                        "that fits instead)") from None
                if all(verdicts):
                    log.info("cairn: restored step %d from the %s tier", step, choice[0])
                    self.restored = (step, choice[0])
                    if choice[0] == "memory":
                        _memory_budget.mark_restored(self._lease)
                    self._keep_restored_slot(choice[2] if choice[0] == "memory" else None,
                                             step, held)
                    self._plan_ahead(state, background=True)
                    self.prepare(state, nbytes=self._restored_bytes(reader))
                    return step
                why = unwrap(err) if err is not None else "failed on another rank"
                log.warning("cairn: skipping step %d in the %s tier (%s): %s", step, choice[0],
                            uri, why)
                plan.fail(step, choice[0], str(why))
        raise CorruptionError("no checkpoint could be restored: " + plan.failures())

    def _keep_restored_slot(self, name: str | None, step: int,
                            held: list[list[tuple[int, str]]]) -> None:
        """Chooses the next save's slot after restoring `step` (from the memory-tier
        directory `name` on this rank, or None): the restored slot is kept, so that
        no save overwrites it before a newer step has committed, when some rank's
        slower tiers (`held`, every rank's (step, tier) list, gathered by restore())
        lack the step: it may be the only copy of the newest one. Otherwise the next
        save reuses the restored slot (no second slot is created). Collective. With
        one slot there is no other (memory_slots documents it)."""
        restored = self._gather(name)
        names = {_ext.TierSet.slot_dir(k): k for k in range(self.num_slots)}
        # The slot(s) the ranks that read the step from their memory tier read (the
        # others read it from a faster source they lacked: another tier or a peer).
        slots = {names[n] for n in restored if n in names}
        if len(slots) != 1:
            # No rank read its memory tier (it holds older or unreadable steps only),
            # or ranks read different slots (then the step is in the other tiers they
            # read too): nothing to keep. Reuse a slot file that exists already (the
            # coordinator's), else slot 0.
            self._keep_slot = None
            choice = 0
            if self.is_coordinator:
                choice = next((k for k in range(self.num_slots)
                               if os.path.exists(self._tiers.slot_data_path(k, self.rank))), 0)
            self._next_slot = self._agree(choice)
            return
        (slot,) = slots
        slower = [any(s == step and t in ("local", "durable") for s, t in mine)
                  for mine in held]
        self._keep_slot = None if all(slower) and not self._repl.k else slot
        self._next_slot = slot
        if self._keep_slot is not None and self.num_slots > 1:
            self._next_slot = self._other_slot(slot)

    def _read_through_slot(self, reader: Reader, name: str) -> bool:
        """Whether `reader` (of memory-tier checkpoint `name`) now reads the staging
        slot this process holds mapped for it, when it has one: a restore of what this
        process staged (a rollback) then copies out of memory already mapped, with
        no system call or page fault per piece, at about the copy floor."""
        if self._pool_obj is None or reader._reader is None:
            return False  # a fresh process has mapped nothing: it reads the files
        for slot in range(self.num_slots):
            if _ext.TierSet.slot_dir(slot) == name:
                return bool(self._pool_obj.read_through(reader._reader, slot))
        return False

    def _restored_bytes(self, reader: Reader) -> int | None:
        """This rank's data-file size in the checkpoint just restored (what its next
        save stages, if the state did not change), or None."""
        try:
            key = _ext.data_file_key(self.rank)
            return next((int(f.size) for f in reader._reader.manifest().files if f.key == key),
                        None)
        except Exception:  # noqa: BLE001 - a sizing hint only
            return None

    def prepare(self, state: dict[str, Any], nbytes: int | None = None) -> None:
        """Creates and pre-faults the shared memory of the next save of `state` in the
        background, so that the first save stalls no longer than a steady one.

        restore() calls it (whatever it restored, or when there was nothing); call it
        yourself after building the state when you do not restore. The slot is sized
        `nbytes`, by default this rank's data file in the checkpoint restore() just
        loaded, else (one rank) the state's tensors; with several ranks and nothing
        restored it does nothing, since which replicated tensors a rank stages is only
        known at the save. A save whose state grew grows the slot then. The
        next save(), wait() or close() waits for it; a failure (e.g. not enough shared
        memory, or over ``memory_limit``) is only logged: the save then reports it.
        This opens the staging pool, so a DataLoader forked after it inherits the slot
        files (its workers exit with the trainer, see docs/memory.md)."""
        self._check_open()
        if self.world == 1 and self._plan_cache is None and self._plan_job is None:
            self._plan_ahead(state)  # restore() does it on every rank (a collective)
        if not self.memory or self._prefault_thread is not None:
            return
        if nbytes is None:
            if self.world > 1:
                return
            lengths = [t.numel() * t.element_size() for t in _state_tensors(state)]
            nbytes = int(_ext.staged_bytes(lengths)) if lengths else 0
        if nbytes <= 0:
            return
        self._start_prefault(self._next_slot, nbytes)

    def _start_prefault(self, slot: int, nbytes: int) -> None:
        """Creates and pre-faults `slot` (>= `nbytes`) on a thread that the next
        save(), wait() or close() joins, and the exit hook too (a daemon thread still
        in C++ when the interpreter finalizes aborts it)."""
        def run() -> None:
            try:
                self._budget.check(slot, nbytes)
                self._pool.acquire_slot(slot, nbytes)
                self._pool.release(slot)
                self._warm_slots.add(slot)
            except BaseException as e:  # noqa: BLE001 - the save reports it
                log.info("cairn: pre-faulting staging slot %d: %s", slot, e)

        self._prefault_thread = threading.Thread(target=run, name="cairn-prefault", daemon=True)
        self._prefault_thread.start()

    def _prefault_next(self, rec: _Save) -> None:
        """After save `rec`: when it will leave its slot kept (_keeps: a memory-only
        step), pre-faults the slot the next save then stages into, if this process
        has not mapped it yet (creating the second slot), so that the next save
        stalls no longer than a steady one. Nothing when every save is durable: the
        next save reuses `rec`'s slot. Queued on the background thread behind `rec`'s
        persistence, which it does not delay; the next save() waits for it. It runs
        only once `rec` is committed in the memory tier: until then the other slot
        may hold the newest step, and growing its file would damage it."""
        if not self.memory or self.num_slots < 2:
            return
        slot = self._other_slot(rec.slot)
        if slot in self._warm_slots:
            return

        def job() -> None:
            if not self._keeps(rec):  # a failed persist keeps the slot too
                return
            try:
                self._budget.check(slot, int(rec.writer.capacity))
                self._pool.acquire_slot(slot, int(rec.writer.capacity))
                self._pool.release(slot)
                self._warm_slots.add(slot)
            except BaseException as e:  # noqa: BLE001 - the save reports it
                log.info("cairn: pre-faulting staging slot %d: %s", slot, e)

        self._prefault_job = self._background.submit(job)

    def _join_prefault_job(self, timeout: float | None = None) -> bool:
        """Waits for _prefault_next's job; whether it is done."""
        job = self._prefault_job
        if job is not None:
            if not job.wait(self.timeout if timeout is None else timeout):
                return False
            self._prefault_job = None
        return True

    def _plan_ahead(self, state: dict[str, Any], background: bool = False) -> None:
        """Plans a save of `state` (DCP's planning, nothing staged), so the first
        save() stages with that plan like a steady one (_PlanCache). Collective: every
        rank calls it (restore() does). A failure only means the first save plans.
        Nothing to do when the last save's plan still fits `state` (a restore by the
        process that saved: a rollback).

        `background` (restore()): the state's Statefuls are asked for their
        state_dict() here, on the caller's thread (some gather from every rank on the
        training's process group), and DCP's planning, whose collectives run on the
        checkpoint group, runs on the background thread, overlapping what the trainer
        does next (it was ~40% of a 100 MB restore); every call that could start a
        collective of its own first waits for it (wait(): save(), restore(),
        candidates(), close()). A state changed before the first save (e.g. an
        optimizer's state created by its first step) then misses the plan, as it
        would have anyway: that save plans."""
        sd = _state_dict_of(state)
        cache = self._plan_cache
        if cache is not None:
            hit = cache.matches(*flatten_state_dict(sd))
            if self._all(hit) if self._dist else hit:
                return
        self._plan_cache = None
        if background:
            self._plan_job = self._background.submit(self._plan, sd, self._next_slot)
        else:
            self._plan(sd, self._next_slot)

    def _plan(self, sd: dict[str, Any], slot: int) -> None:
        writer = _PlanningWriter(self, slot)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(sd, storage_writer=writer, process_group=self.pg)
            self._plan_cache = _PlanCache.of(writer, sd)
        except Exception as e:  # noqa: BLE001 - the first save plans instead
            log.info("cairn: planning the first save ahead: %s", e)
            self._plan_cache = None
        writer.planner = None

    def _join_plan_job(self, timeout: float | None = None) -> bool:
        """Waits for restore()'s planning of the next save; whether it is done."""
        job = self._plan_job
        if job is not None:
            if not job.wait(self.timeout if timeout is None else timeout):
                return False
            self._plan_job = None
        return True

    def _load(self, state: dict[str, Any], reader: Reader, on_disk: bool = False) -> None:
        keys = reader.stored_keys()
        to_load = {}
        for k, v in state.items():
            if isinstance(v, RNGState) and not any(x.startswith(f"{k}.rank{v.rank}.")
                                                   for x in keys):
                v.load_state_dict({})  # documented: re-seeded deterministically
                continue
            to_load[k] = v
        # The common case (plain CPU tensors, no resharding) skips DCP's planner: one
        # verified engine read straight into the state's tensors. Every rank must
        # take the same path, since dcp.load is collective.
        try:
            plan = reader.plan_in_place(to_load)
        except Exception:  # noqa: BLE001 - dcp.load below reports it, collectively
            plan = None
        # A local disk's chunks that other ranks of this node read too (a replicated
        # state: every rank loads the same bytes) are read through the page cache, so
        # the disk delivers them once for the node; direct reads, a copy per rank.
        items = None
        if (plan is not None and on_disk and self._hosts.count(self._hosts[self.rank]) > 1
                and reader._storage is not None and reader._storage.local_path()):
            items = plan.engine.tensor_items()
        verdicts = self._gather((plan is not None, items))
        if all(ok for ok, _ in verdicts):
            if items:
                host = self._hosts[self.rank]
                others = {k for r, (_, ks) in enumerate(verdicts)
                          if r != self.rank and ks and self._hosts[r] == host for k in ks}
                plan.engine.share([k for k in items if k in others])
            reader.load_in_place(plan)
        else:
            # Not loadable in place: a resharded or non-plain tensor, or a state that
            # does not match. A mismatch on any rank is raised on every rank.
            try:
                bad = _mismatches(to_load, reader.read_metadata())
            except Exception:  # noqa: BLE001 - unreadable: dcp.load reports it
                bad = []
            everyone = self._gather(bad)
            if any(everyone):
                lines = [(f"rank {r}: " if self.world > 1 else "") + m
                         for r, ms in enumerate(everyone) for m in ms]
                more = f" (and {len(lines) - 8} more)" if len(lines) > 8 else ""
                raise _Mismatch("; ".join(lines[:8]) + more)
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp.load(to_load, storage_reader=reader, process_group=self.pg)
            except BaseException as e:
                err = _as_cairn_error(e, f"loading {reader.path}")
                if err is e:
                    raise
                raise err from e
        # As dcp.load does: a Stateful was loaded through load_state_dict, every
        # other top-level value is replaced by what was loaded.
        for k, v in to_load.items():
            if not isinstance(state[k], Stateful):
                state[k] = v


