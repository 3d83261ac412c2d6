"""Ray Train (V2) integration: cairn checkpoints reported to Ray with asynchronous upload.

Inside a Ray Train worker (``TorchTrainer``'s train function)::

    mgr = cairn.ray.checkpoint_manager(memory=True, replicas=1)
    state = {"train": cairn.TrainState(model, opt, sched, data=loader), "rng": cairn.RNGState()}
    start = mgr.restore(state) or 0
    for step in range(start + 1, steps + 1):
        ...
        cairn.ray.report(mgr, step, state, {"loss": loss.item()})
    mgr.close()

Layout: the manager's durable root is this run's experiment directory,
``RunConfig(storage_path, name)`` as Ray resolves it
(``get_context().get_storage().experiment_fs_path``), and each durable checkpoint is
``<experiment dir>/step_<N>/``: a cairn checkpoint directly below the experiment
directory, where Ray requires reported checkpoints to lie. ``Result.checkpoint.path``
is such a directory (``cairn.verify`` and ``cairn.Reader`` accept it).

Protocol of one ``report()`` (every rank; Ray needs every rank to report):
  1. ``mgr.save(step, state)``: blocks for staging only; the manager persists in the
     background and calls back when the durable commit has landed (or failed).
  2. A save that goes to the durable tier is reported with
     ``ray.train.report(metrics, Checkpoint(step_<N>), checkpoint_dir_name="step_<N>",
     checkpoint_upload_mode=ASYNC, checkpoint_upload_fn=<waits for the commit>,
     delete_local_checkpoint_after_upload=False)``. Nothing is copied: the upload
     function only waits, in Ray's upload thread, so training goes on. Ray's
     controller registers the checkpoint once every rank's upload function has
     returned, i.e. after the manifest is committed. A save that stays in memory
     (``durable_every`` > 1) is reported with its metrics and no checkpoint.
  3. A failed persist makes the upload function raise: Ray fails the worker group
     (``FailureConfig`` restarts it). The same error is raised by the next
     ``report()``/``mgr.save()``/``mgr.wait()`` on that rank, as for ``mgr.save``.

Retention (durable tier) is Ray's, so the two never disagree:
  - The manager deletes no committed durable checkpoint (``keep=None``); Ray's
    controller deletes the ones ``CheckpointConfig.num_to_keep`` drops. Ray's delete
    fails the run ("Path not found") if the directory is already gone, so cairn must
    never delete a checkpoint Ray tracks, and Ray registers a checkpoint only after
    the upload function returned, so cairn must not prune before that either.
  - A durable checkpoint that Ray never registered (its commit landed, but the
    worker group died before the controller received every rank's report; Ray's
    controller polls every 2 s, so at a failure the newest one or two commits are
    usually unregistered) is one Ray will never return or delete. After a restart,
    ``checkpoint_manager()`` has rank 0 ask Ray which checkpoints it tracks
    (``get_all_reported_checkpoints``), and ``restore()`` then settles the untracked
    ``step_<N>`` directories: the one it restored from, if committed, is *adopted*
    (reported to Ray with ``CheckpointUploadMode.NO_UPLOAD`` and metrics
    ``{"step": N, "cairn_adopted": True}``, so Ray tracks it and its ``num_to_keep``
    applies); every other one, committed or partial, is removed, manifest first.
    This happens before any report of the new worker group, while nothing else
    writes there. (Without ``restore()``, the first ``report()`` removes them all.)
  - ``close()`` does not flush a memory-only save to the durable tier (Ray would not
    track it): report the last step with ``durable=True``.

Restore after a ``FailureConfig`` restart: ``mgr.restore(state)`` takes the newest
step every rank can load, from the memory tier (or a peer replica) on nodes that
survived, otherwise from the durable tier: Ray's checkpoints (the newest is
``ray.train.get_checkpoint()``) and any newer committed one Ray had not registered
yet, which is then adopted. Either way it is never older than Ray's latest
(unless that one is corrupt: then restore falls back to an older one), and
restoring any of them is exact.

Storage: a local (or shared) directory today. ``s3://`` storage paths are mapped to
``s3://<bucket>/<prefix>`` roots, which the manager accepts once cairn's S3 backend
does; its endpoint and credentials come from the ``AWS_*`` variables, which must
point where Ray's own ``pyarrow`` S3 filesystem does.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Any

from cairn.errors import Error, InvalidArgumentError
from cairn.manager import CheckpointManager

__all__ = ["RayCheckpointManager", "checkpoint_manager", "report", "storage_root"]

log = logging.getLogger(__name__)


def _ray_train():
    try:
        import ray.train
    except ImportError as e:  # pragma: no cover - ray is an optional dependency
        raise Error("cairn.ray needs Ray Train: pip install 'ray[train]'") from e
    return ray.train


def _step_name(step: int) -> str:
    # The manager's durable directory name, which is also the Ray checkpoint's name.
    return f"step_{step:010d}"


class RayCheckpointManager(CheckpointManager):
    """A CheckpointManager whose durable tier is a Ray Train run's experiment
    directory and whose durable retention is Ray's (see the module docstring).
    Made by :func:`checkpoint_manager`; thread-safety as for CheckpointManager."""

    flush_on_close = False  # Ray tracks every durable checkpoint; see close()

    def __init__(self, root: str, storage: Any, **kwargs: Any):
        super().__init__(root, keep=None, **kwargs)
        self.storage = storage  # Ray's StorageContext of this run
        # step_<N> names Ray tracked when this worker group started (every rank).
        self.ray_tracked: frozenset[str] = frozenset()
        # Untracked step_<N> directories removed / reported to Ray at start-up.
        self.removed_orphans: list[str] = []
        self.adopted: str | None = None
        self._reconciled = False

    def restore(self, state: dict[str, Any]) -> int | None:
        """CheckpointManager.restore, then the checkpoints Ray does not track are
        settled (see the module docstring): the restored one is reported to Ray,
        the others removed."""
        step = super().restore(state)
        if not self._reconciled:
            self._reconcile(step)
        return step

    def _reconcile(self, restored: int | None) -> None:
        """Adopts the untracked durable checkpoint of step `restored` (if any) and
        removes every other untracked step_<N> directory; collective."""
        self._reconciled = True
        adopt, removed = None, []
        if self.is_coordinator:
            adopt, removed = _settle_untracked(self, restored)
        adopt, removed = self._agree((adopt, removed))
        self.removed_orphans = list(removed)
        if adopt is not None:
            train = _ray_train()
            ckpt = train.Checkpoint(path=self.checkpoint_path(adopt),
                                    filesystem=self.storage.storage_filesystem)
            train.report({"step": restored, "cairn_adopted": True}, checkpoint=ckpt,
                         checkpoint_dir_name=adopt,
                         checkpoint_upload_mode=train.CheckpointUploadMode.NO_UPLOAD)
            self.adopted = adopt
            self.ray_tracked = self.ray_tracked | {adopt}

    def checkpoint_path(self, name: str) -> str:
        """The path of checkpoint `name` on Ray's storage filesystem."""
        return self.storage.experiment_fs_path.rstrip("/") + "/" + name


def storage_root(storage: Any) -> str:
    """The cairn root of a Ray StorageContext's experiment directory: a local path,
    or ``s3://<bucket>/<prefix>`` for Ray's S3 filesystem."""
    import pyarrow.fs as pafs

    fs, path = storage.storage_filesystem, storage.experiment_fs_path
    if isinstance(fs, pafs.LocalFileSystem):
        return os.path.abspath(path)
    if isinstance(fs, pafs.S3FileSystem):
        return "s3://" + path.lstrip("/")
    raise InvalidArgumentError(
        f"cairn.ray: Ray storage filesystem {type(fs).__name__} is not supported "
        "(a local directory or s3:// storage_path is)")


def _tracked_names(mgr: RayCheckpointManager) -> set[str]:
    """The checkpoint directory names Ray tracks for this run (call on one rank)."""
    train = _ray_train()
    names = set()
    reported = train.get_all_reported_checkpoints(
        consistency_mode=train.CheckpointConsistencyMode.COMMITTED)
    latest = train.get_checkpoint()
    exp = mgr.storage.experiment_fs_path.rstrip("/") + "/"
    for ckpt in [r.checkpoint for r in reported] + ([latest] if latest else []):
        path = ckpt.path
        if path.startswith(exp):
            names.add(path[len(exp):].strip("/"))
    return names


def _settle_untracked(mgr: RayCheckpointManager,
                      restored: int | None) -> tuple[str | None, list[str]]:
    """Of the step_<N> directories below the root that Ray does not track: the one
    of step `restored`, if committed, is to be adopted; the others are removed,
    manifest first. Returns (name to adopt or None, names removed)."""
    adopt, removed, failed = mgr._tiers.settle_untracked(sorted(mgr.ray_tracked), restored)
    for uri, err in failed:
        log.warning("cairn.ray: removing untracked checkpoint %s: %s", uri, err)
    if removed:
        log.info("cairn.ray: removed %d checkpoint(s) Ray does not track: %s",
                 len(removed), ", ".join(removed))
    return adopt, removed


def checkpoint_manager(**kwargs: Any) -> RayCheckpointManager:
    """A CheckpointManager for this Ray Train run; call it in every worker, after
    Ray has set up torch.distributed (TorchTrainer does), before ``restore()``.

    The durable root is the run's experiment directory (``RunConfig.storage_path`` /
    ``name``); durable retention is ``CheckpointConfig.num_to_keep``, applied by Ray
    (so ``root`` and ``keep`` are not arguments). Every other keyword argument
    (``memory``, ``local``, ``keep_local``, ``memory_slots``, ``durable_every``,
    ``replicas``, ``timeout``, ...) goes to :class:`cairn.CheckpointManager`.
    Asks Ray which durable checkpoints it tracks; ``restore()`` settles the others
    (leftovers of a failed worker group).
    """
    for bad in ("root", "keep"):
        if bad in kwargs:
            raise InvalidArgumentError(
                f"cairn.ray.checkpoint_manager: {bad!r} is Ray's "
                "(RunConfig.storage_path/name, CheckpointConfig.num_to_keep)")
    train = _ray_train()
    try:
        storage = train.get_context().get_storage()
    except Exception as e:  # noqa: BLE001 - Ray raises its own types outside a worker
        raise Error("cairn.ray.checkpoint_manager() must be called inside a Ray Train "
                    f"worker: {e}") from e
    mgr = RayCheckpointManager(storage_root(storage), storage, **kwargs)
    tracked = _tracked_names(mgr) if mgr.is_coordinator else None
    tracked = mgr._agree(tracked)
    mgr.ray_tracked = frozenset(tracked)
    return mgr


def report(mgr: RayCheckpointManager, step: int, state: dict[str, Any],
           metrics: dict[str, Any], *, durable: bool | None = None) -> None:
    """Saves `state` as `step` through `mgr` and reports it to Ray Train.

    Blocks for staging (and Ray's report barrier) only. A save that goes to the
    durable tier is reported as a checkpoint with asynchronous upload: Ray registers
    it once its durable commit has landed. A memory-only save reports `metrics`
    alone. `durable` forces or skips the durable tier, as for ``mgr.save``. Raises a
    previous save's background error, as ``mgr.save`` does.
    """
    if not isinstance(mgr, RayCheckpointManager):
        raise InvalidArgumentError("cairn.ray.report needs a manager from "
                                   "cairn.ray.checkpoint_manager()")
    train = _ray_train()
    if not mgr._reconciled:
        mgr._reconcile(None)
    committed: concurrent.futures.Future = concurrent.futures.Future()

    def on_durable(error: BaseException | None) -> None:
        if error is None:
            committed.set_result(None)
        else:
            committed.set_exception(error)

    goes_durable = mgr.save(step, state, durable=durable, on_durable=on_durable)
    name = _step_name(step)
    if not goes_durable or name in mgr.ray_tracked:
        # A step Ray already tracks (re-run after its checkpoint failed to restore)
        # is not reported twice: Ray would delete the directory twice.
        train.report(metrics)
        return
    timeout = mgr.timeout

    def wait_for_commit(checkpoint: Any, dir_name: str) -> Any:
        try:
            committed.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise Error(f"cairn.ray: step {step} not durable after {timeout:.0f}s") from None
        return checkpoint

    ckpt = train.Checkpoint(path=mgr.checkpoint_path(name),
                            filesystem=mgr.storage.storage_filesystem)
    train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=name,
                 checkpoint_upload_mode=train.CheckpointUploadMode.ASYNC,
                 checkpoint_upload_fn=wait_for_commit,
                 delete_local_checkpoint_after_upload=False)
