"""cairn inside PyTorch Lightning: ``Trainer(plugins=[cairn.lightning.CheckpointIO(root)])``.

Lightning decides when to save, under which file name, and which files to delete
(``ModelCheckpoint``: ``every_n_train_steps``, ``save_top_k``, ``save_last``); this
plug-in only changes where the bytes go. Protocol of one ``save_checkpoint(ckpt, path)``:

  1. Wait for the previous save (its error is raised here), then delete the cairn
     steps that Lightning stopped tracking before it (see retention below).
  2. Stage ``ckpt`` as cairn step N (``CheckpointManager.save``: the blocking copy
     into shared memory, the memory tier; local and durable tiers in the background,
     with checksums). N is one more than the newest step the tiers hold.
  3. Write ``path`` as a small pointer file (JSON: the cairn root and N), atomically.
     ``save_checkpoint`` returns here. Lightning lists, times and deletes these files
     as it does its ``.ckpt`` files, so ``ckpt_path="last"`` finds the newest one.

``load_checkpoint(path)`` reads the pointer and loads step N from the fastest tier
that holds it (memory, local, durable), every tensor verified; when step N is
missing or corrupt in every tier (a SIGKILL before it committed, a flipped byte),
it warns and falls back to the newest older step. A ``path`` that is an ordinary
Lightning ``.ckpt`` file loads as Lightning would (migration).

Retention: the manager deletes no committed durable checkpoint by itself
(``keep=None``). A step becomes garbage when Lightning removes its pointer
(``remove_checkpoint``) or overwrites it (``last.ckpt``), and no other pointer this
process knows refers to it; garbage is deleted only once a newer save is durable,
so a crash never leaves a pointer with nothing older to fall back to.

DDP: Lightning saves on global rank 0 only, so that rank runs a manager of its own
(a world of one; ``cairn._frameworks.rank_local``). ``load_checkpoint`` runs on every
rank: rank 0 picks the step and its tiers, the others read the same step.

Thread-safety: used from the trainer's thread, as Lightning does.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import warnings
import weakref
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

from cairn import _ext, _frameworks as fw
from cairn.errors import CorruptionError, Error, InvalidArgumentError
from cairn.manager import CheckpointManager

try:  # the unified package first, then the standalone one
    from lightning.pytorch.plugins.io import CheckpointIO as _LightningCheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO as _TorchIO
    from lightning.fabric.utilities.cloud_io import get_filesystem
except ImportError:  # pragma: no cover - depends on what is installed
    from pytorch_lightning.plugins.io import CheckpointIO as _LightningCheckpointIO
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO as _TorchIO
    from lightning_fabric.utilities.cloud_io import get_filesystem

__all__ = ["CheckpointIO", "POINTER_FORMAT", "read_pointer"]

log = logging.getLogger(__name__)

POINTER_FORMAT = "cairn-lightning-pointer"
_POINTER_MAX_BYTES = 64 << 10


def read_pointer(path: Any) -> dict[str, Any] | None:
    """The pointer file at `path` ({"root", "step", ...}), or None when `path` is
    not one (e.g. an ordinary Lightning .ckpt). Raises FileNotFoundError when
    there is no file, cairn.CorruptionError for a damaged pointer."""
    fs = get_filesystem(path)
    if not fs.exists(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    with fs.open(path, "rb") as f:
        head = f.read(_POINTER_MAX_BYTES + 1)
    if not head.lstrip().startswith(b"{") or POINTER_FORMAT.encode() not in head:
        return None
    if len(head) > _POINTER_MAX_BYTES:
        raise CorruptionError(f"{path}: cairn pointer file larger than {_POINTER_MAX_BYTES} bytes")
    try:
        ptr = json.loads(head)
    except ValueError as e:
        raise CorruptionError(f"{path}: damaged cairn pointer file: {e}") from None
    step = ptr.get("step") if isinstance(ptr, dict) else None
    if (not isinstance(ptr, dict) or ptr.get("format") != POINTER_FORMAT
            or not isinstance(ptr.get("root"), str) or not isinstance(step, int)
            or isinstance(step, bool) or step < 0):
        raise CorruptionError(f"{path}: damaged cairn pointer file")
    return ptr


class CheckpointIO(_LightningCheckpointIO):
    """A Lightning ``CheckpointIO`` that checkpoints through a cairn CheckpointManager.

    Args:
        root: the durable tier (a directory, ``file://DIR`` or ``s3://BUCKET/PREFIX``).
            Default: ``<the checkpoint's directory>/cairn``, fixed at the first save
            or load.
        memory, local, memory_slots, durable_every, timeout, memory_limit, ...: as
            for ``cairn.CheckpointManager`` (every keyword but ``keep``: retention is
            ``ModelCheckpoint``'s, see the module's docstring).
        allow_pickle: unpickle the checkpoint's non-tensor values without
            restriction when Lightning asks for ``weights_only=False``.

    ``teardown()`` (Lightning calls it at the end of ``fit``) waits for the save in
    flight and closes the manager, which makes the newest save durable.
    """

    def __init__(self, root: str | os.PathLike | None = None, *, allow_pickle: bool = False,
                 **manager_kwargs: Any):
        super().__init__()
        fw.check_no_keep(manager_kwargs, "Lightning's ModelCheckpoint")
        self.root = None if root is None else os.fspath(root)
        self.allow_pickle = allow_pickle
        self.manager_kwargs = manager_kwargs
        self.manager: CheckpointManager | None = None
        self._next_step = 0
        self._refs: dict[str, int] = {}  # pointer path -> step, of pointers we know
        self._garbage: set[int] = set()
        self._last_saved: int | None = None
        self._hide = False  # rank-local manager in a distributed job

    # ---- the manager ---------------------------------------------------------------

    def _manager(self, path: Any) -> CheckpointManager:
        if self.manager is None:
            if self.root is None:
                self.root = os.path.join(os.path.dirname(os.fspath(path)) or ".", "cairn")
            # One manager per root in a process: another plug-in still holding this
            # root (a Trainer whose save_checkpoint() ran after fit ended) closes first.
            other = _OPEN.get(_key(self.root))
            other = other() if other is not None else None
            if other is not None and other is not self:
                other.teardown()
            _OPEN[_key(self.root)] = weakref.ref(self)
            rank, world = fw.world()
            self._hide = world > 1
            with fw.rank_local(self._hide):
                self.manager = CheckpointManager(self.root, keep=None, **self.manager_kwargs)
                steps = [s for s, _, _ in self.manager.candidates()]
                self.manager._open_readers.clear()  # candidates() keeps them for restore()
            self._next_step = max(steps) + 1 if steps else 0
        return self.manager

    # ---- CheckpointIO --------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Optional[Any] = None) -> None:
        """Stages `checkpoint` as the next cairn step and writes `path` as its pointer;
        returns once the state is copied (persisting goes on in the background)."""
        if storage_options is not None:
            raise TypeError("cairn.lightning.CheckpointIO takes no storage_options")
        rank, _ = fw.world()
        if rank != 0:
            raise InvalidArgumentError("cairn.lightning.CheckpointIO saves on global rank 0 "
                                       "only (strategies that save a replicated state: "
                                       "single device, DDP)")
        mgr = self._manager(path)
        with fw.rank_local(self._hide):
            mgr.wait()  # the previous save's error is raised here
            self._collect_garbage()
            state = fw.split(checkpoint, "state_dict")
            step = self._next_step
            durable = mgr.save(step, state)
        self._next_step = step + 1
        if durable:
            self._last_saved = step
        old = self._write_pointer(path, step, checkpoint)
        if old is not None and old != step:
            self._garbage.add(old)

    def load_checkpoint(self, path: Any, map_location: Optional[Callable] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The checkpoint `path` points to (or the newest older one, with a warning,
        when that step is missing or corrupt in every tier)."""
        ptr = read_pointer(path)
        if ptr is None:  # an ordinary Lightning checkpoint file
            return _TorchIO().load_checkpoint(path, map_location=map_location,
                                              weights_only=weights_only)
        rank, world = fw.world()
        uris: list[tuple[int, str, str]] | None = None
        if rank == 0:
            mgr = self._manager(path)
            self._refs[_key(path)] = ptr["step"]
            with fw.rank_local(self._hide):
                found = mgr.candidates()
                mgr._open_readers.clear()
            uris = sorted((c for c in found if c[0] <= ptr["step"]), key=lambda c: -c[0])
            self._adopt_leftovers(path, ptr["step"], {c[0] for c in found})
        allow_pickle = weights_only is False or self.allow_pickle
        flat, where = None, None
        if world > 1:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))
            box = [uris]
            dist.broadcast_object_list(box, src=0, group=group)
            uris = box[0]
        failures = []
        for step, tier, uri in uris or []:
            if step != ptr["step"] and not failures:
                failures.append(f"step {ptr['step']}: in no tier")
            if rank != 0 and tier == "memory" and not _readable(uri):
                continue  # another node's shared memory
            try:
                flat = fw.read_checkpoint(uri, allow_pickle=allow_pickle)
                where = (step, tier, uri)
                break
            except (Error, OSError) as e:
                failures.append(f"step {step} ({tier}, {uri}): {e}")
        if world > 1:  # every rank must have loaded the same step
            got = [None] * world
            dist.all_gather_object(got, None if where is None else where[0], group=group)
            dist.destroy_process_group(group)
            if len(set(got)) != 1:
                raise Error(f"{path}: the ranks restored different steps: {got}")
        if flat is None:
            raise CorruptionError(f"{path}: no cairn checkpoint could be loaded"
                                  + (": " + "; ".join(failures) if failures else
                                     f" (step {ptr['step']} and older are in no tier of "
                                     f"{self.root})"))
        if failures:
            msg = (f"cairn: {path} points to step {ptr['step']}, which could not be loaded "
                   f"({'; '.join(failures)}); loaded step {where[0]} from the {where[1]} "
                   "tier instead")
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return fw.join(flat, map_location=map_location, weights_only=weights_only,
                       where=f"{path} (step {where[0]})")

    def remove_checkpoint(self, path: Any) -> None:
        """Deletes the pointer file `path`; its step is deleted once no pointer refers
        to it and a newer save is durable."""
        try:
            ptr = read_pointer(path)
        except FileNotFoundError:
            return
        except CorruptionError:
            ptr = None
        if ptr is None:
            _TorchIO().remove_checkpoint(path)
            return
        get_filesystem(path).rm(path)
        self._refs.pop(_key(path), None)
        self._garbage.add(ptr["step"])

    def teardown(self) -> None:
        """Waits for the save in flight and closes the manager (the newest save is then
        in the durable tier)."""
        if self.manager is not None:
            with fw.rank_local(self._hide):
                try:
                    self.manager.close()
                    self._collect_garbage()  # every save is durable now
                finally:
                    self.manager = None

    # ---- helpers ----------------------------------------------------------------------

    def _write_pointer(self, path: Any, step: int, checkpoint: dict[str, Any]) -> int | None:
        """Writes the pointer to `step` at `path` (temp file, rename); returns the step
        the file pointed to before, if any."""
        key = _key(path)
        old = self._refs.get(key)
        fs = get_filesystem(path)
        if old is None:
            try:
                prev = read_pointer(path)
                old = None if prev is None else prev["step"]
            except (FileNotFoundError, CorruptionError):
                old = None
        fs.makedirs(os.path.dirname(key) or ".", exist_ok=True)
        body = json.dumps({"format": POINTER_FORMAT, "version": 1, "root": self.root,
                           "step": step, "epoch": checkpoint.get("epoch"),
                           "global_step": checkpoint.get("global_step")}).encode()
        tmp = f"{key}.cairn-tmp"
        with fs.open(tmp, "wb") as f:
            f.write(body)
        fs.mv(tmp, key)
        self._refs[key] = step
        return old

    def _adopt_leftovers(self, path: Any, step: int, steps: set[int]) -> None:
        """A crashed process's garbage: with the default root (one checkpoint
        directory per root), the steps older than `step` that no pointer file in
        that directory names."""
        folder = os.path.dirname(os.fspath(path)) or "."
        if os.path.normpath(self.root) != os.path.normpath(os.path.join(folder, "cairn")):
            return
        named = set()
        fs = get_filesystem(path)
        for p in fs.ls(folder, detail=False):
            if str(p).endswith(".ckpt"):
                try:
                    ptr = read_pointer(p)
                except (OSError, Error):
                    continue
                if ptr is not None:
                    named.add(ptr["step"])
                    self._refs.setdefault(_key(p), ptr["step"])
        self._garbage.update(s for s in steps if s < step and s not in named)

    def _collect_garbage(self) -> None:
        """Deletes the garbage steps older than the newest save that went to the
        durable tier (called after the manager's wait(): it is there, and no persist
        runs)."""
        mgr = self.manager
        if mgr is None or self._last_saved is None or not self._garbage:
            return
        live = set(self._refs.values())
        for step in sorted(self._garbage):
            if step in live:
                self._garbage.discard(step)
                continue
            if step >= self._last_saved:
                continue
            fw.delete_step(mgr, step)
            self._garbage.discard(step)


# root -> the plug-in whose manager holds it (closed at exit: the newest save durable).
_OPEN: dict[str, "weakref.ref[CheckpointIO]"] = {}


@atexit.register
def _close_all() -> None:
    for ref in list(_OPEN.values()):
        io = ref()
        if io is not None:
            try:
                io.teardown()
            except Exception as e:  # noqa: BLE001 - at exit, report only
                log.warning("cairn: closing the checkpoint manager at exit: %s", e)


def _key(path: Any) -> str:
    path = os.fspath(path)
    return path if "://" in path else os.path.normpath(path)


def _readable(uri: str) -> bool:
    try:
        return _ext.has_manifest(_ext.open_storage(uri, create=False), "")
    except Exception:  # noqa: BLE001 - not here: try the next tier
        return False
