"""cairn inside the Hugging Face Trainer: async, tiered, verified checkpoints that
``Trainer.train(resume_from_checkpoint=True)`` resumes exactly.

The callback API cannot take over saving (``TrainerCallback.on_save`` runs after
the Trainer wrote its files), so the form is a mixin over ``transformers.Trainer``:

    class MyTrainer(cairn.hf.CairnTrainerMixin, transformers.Trainer): ...
    trainer = MyTrainer(model, args, train_dataset=..., cairn_root="/ckpt/cairn")
    # or simply cairn.hf.Trainer(...), the mixin over transformers.Trainer

Everything else about training stays the same (``save_strategy``, ``save_steps``,
``save_total_limit``, ``resume_from_checkpoint=True``).

Protocol of one save (``_save_checkpoint``, at global step N):
  1. Wait for the previous save (its error is raised here); delete the cairn steps
     whose ``checkpoint-*`` directory the Trainer has rotated away, once older
     than that durable save.
  2. Stage one cairn step N (``CheckpointManager.save``): the model's
     ``state_dict``, optimizer, LR scheduler, RNG states (Python, NumPy, torch CPU,
     CUDA), the trainer state (``trainer_state.json``'s content) and the data
     position (epoch, batches of the epoch done; the train DataLoader's own
     ``state_dict()`` when it has one). Returns after the copy; local and durable
     tiers are written in the background, with checksums.
  3. Write ``<output_dir>/checkpoint-N/``: ``cairn.json`` (the root and step) and
     ``trainer_state.json``, so the Trainer's own ``get_last_checkpoint`` and
     ``save_total_limit`` rotation see it as a checkpoint.

Resume (``train(resume_from_checkpoint=True or a checkpoint dir)``): the step is
loaded from the fastest tier holding it, every tensor verified; a step missing or
corrupt in every tier falls back to the newest older one, with a warning (its
``checkpoint-M/`` is written again from the checkpoint itself). The model,
optimizer, scheduler and RNG states come from the cairn checkpoint; the Trainer
skips the epoch's first batches as it always does, which with its default (seeded)
sampler reproduces the sample order exactly.

Single process (one rank); ``load_best_model_at_end`` is not supported.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import warnings
from typing import Any

import numpy as np
import torch

import transformers

from cairn import _frameworks as fw
from cairn.errors import CorruptionError, Error, InvalidArgumentError
from cairn.manager import CheckpointManager

__all__ = ["CairnTrainerMixin", "Trainer", "POINTER_NAME"]

log = logging.getLogger(__name__)

POINTER_NAME = "cairn.json"
POINTER_FORMAT = "cairn-hf-pointer"
_TRAINER_STATE = "trainer_state.json"


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out = {"python": random.getstate(),
           "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                     float(gauss)],
           "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(s: dict[str, Any]) -> None:
    random.setstate(_as_tuples(s["python"]))
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.random.set_rng_state(s["cpu"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _as_tuples(v: Any) -> Any:
    return tuple(_as_tuples(x) for x in v) if isinstance(v, (list, tuple)) else v


def read_pointer(checkpoint_dir: str) -> dict[str, Any] | None:
    """The cairn pointer of a ``checkpoint-N`` directory, or None when it is an
    ordinary Trainer checkpoint."""
    path = os.path.join(checkpoint_dir, POINTER_NAME)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(1 << 16)
    try:
        ptr = json.loads(raw)
    except ValueError as e:
        raise CorruptionError(f"{path}: damaged cairn pointer: {e}") from None
    step = ptr.get("step") if isinstance(ptr, dict) else None
    if (not isinstance(ptr, dict) or ptr.get("format") != POINTER_FORMAT
            or not isinstance(ptr.get("root"), str) or not isinstance(step, int)
            or isinstance(step, bool) or step < 0):
        raise CorruptionError(f"{path}: damaged cairn pointer")
    return ptr


class CairnTrainerMixin:
    """Makes a ``transformers.Trainer`` checkpoint through a cairn CheckpointManager.

    Keyword arguments (taken out before the Trainer's own):
        cairn_root: the durable tier (directory or ``s3://BUCKET/PREFIX``); default
            ``<output_dir>/cairn``.
        cairn_options: a dict of ``CheckpointManager`` keywords (``memory``, ``local``,
            ``durable_every``, ...; not ``keep``: retention is ``save_total_limit``).

    Thread-safety: the Trainer's thread only. ``train()`` closes the manager at its
    end (the newest save is then durable).
    """

    def __init__(self, *args: Any, cairn_root: str | os.PathLike | None = None,
                 cairn_options: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        opts = dict(cairn_options or {})
        fw.check_no_keep(opts, "save_total_limit")
        if getattr(self.args, "load_best_model_at_end", False):
            raise InvalidArgumentError("cairn.hf: load_best_model_at_end is not supported")
        self.cairn_root = os.fspath(cairn_root) if cairn_root is not None else os.path.join(
            self.args.output_dir, "cairn")
        self.cairn_options = opts
        self.cairn_manager: CheckpointManager | None = None
        self._cairn_loaded: dict[str, Any] | None = None  # the checkpoint being resumed
        self._cairn_loaded_dir: str | None = None
        self._cairn_last_saved: int | None = None
        self._cairn_saved: set[int] = set()

    # ---- the manager ---------------------------------------------------------------

    def _cairn(self) -> CheckpointManager:
        if self.cairn_manager is None:
            if fw.world()[1] > 1:
                raise InvalidArgumentError("cairn.hf supports single-process training only")
            self.cairn_manager = CheckpointManager(self.cairn_root, keep=None,
                                                   **self.cairn_options)
        return self.cairn_manager

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any):
        if resume_from_checkpoint is True or isinstance(resume_from_checkpoint, (str, os.PathLike)):
            resume_from_checkpoint = self._cairn_resolve(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._cairn_loaded = None
            if self.cairn_manager is not None:
                mgr, self.cairn_manager = self.cairn_manager, None
                mgr.close()
                self._cairn_collect(mgr, final=True)

    # ---- save ----------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if trial is not None or getattr(self, "hp_search_backend", None) is not None:
            return super()._save_checkpoint(model, trial)
        mgr = self._cairn()
        step = int(self.state.global_step)
        self.store_flos()
        mgr.wait()  # the previous save's error is raised here
        self._cairn_collect(mgr)
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{step}")
        # What the Trainer's _save_checkpoint puts into trainer_state.json.
        for cb in [cb for cb in self.callback_handler.callbacks + [self.control]
                   if isinstance(cb, transformers.trainer_callback.ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb.state())
            else:
                self.state.stateful_callbacks[name] = cb.state()
        trainer_state = json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"
        checkpoint = {
            "model": self.accelerator.unwrap_model(model).state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "rng": _rng_state(),
            "trainer_state": trainer_state,
            "data": self._cairn_data_position(),
        }
        if mgr.save(step, fw.split(checkpoint, "model")):  # goes to the durable tier
            self._cairn_last_saved = step
        self._cairn_saved.add(step)
        self._cairn_write_dir(folder, step, trainer_state)
        transformers.trainer_utils.rotate_checkpoints(
            output_dir=run_dir, save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _cairn_data_position(self) -> dict[str, Any]:
        """Where the data stands: the Trainer derives the batches done in the epoch
        from the global step (and skips them on resume); a train DataLoader with a
        state_dict() (cairn.data.DataLoader) adds its own position."""
        pos: dict[str, Any] = {"global_step": int(self.state.global_step),
                               "epoch": float(self.state.epoch or 0)}
        loader = getattr(self.callback_handler, "train_dataloader", None)
        if hasattr(loader, "state_dict") and callable(loader.state_dict):
            try:
                pos["loader"] = loader.state_dict()
            except Exception as e:  # noqa: BLE001 - a wrapper without a position
                log.debug("cairn.hf: train dataloader state not saved: %s", e)
        return pos

    def _cairn_write_dir(self, folder: str, step: int, trainer_state: str) -> None:
        os.makedirs(folder, exist_ok=True)
        for name, body in ((_TRAINER_STATE, trainer_state),
                           (POINTER_NAME, json.dumps({"format": POINTER_FORMAT, "version": 1,
                                                      "root": self.cairn_root, "step": step}))):
            tmp = os.path.join(folder, name + ".cairn-tmp")
            with open(tmp, "w") as f:
                f.write(body)
            os.replace(tmp, os.path.join(folder, name))

    def _cairn_collect(self, mgr: CheckpointManager, final: bool = False) -> None:
        """Deletes the durable/local steps this process saved whose checkpoint-N
        directory is gone (save_total_limit), once older than the last save that went
        to the durable tier (called after the manager's wait(): it is there)."""
        last = self._cairn_last_saved
        if last is None:
            return
        run_dir = self.args.output_dir
        prefix = transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
        for step in sorted(self._cairn_saved):
            if step >= last or os.path.isdir(os.path.join(run_dir, f"{prefix}-{step}")):
                continue
            fw.delete_step(mgr, step)
            self._cairn_saved.discard(step)

    # ---- resume --------------------------------------------------------------------

    def _cairn_resolve(self, resume: Any) -> Any:
        """Loads the checkpoint to resume (with fallback) and returns its directory."""
        if resume is True:
            resume = transformers.trainer_utils.get_last_checkpoint(self.args.output_dir)
            if resume is None:
                raise ValueError(f"No valid checkpoint found in output directory "
                                 f"({self.args.output_dir})")
        resume = os.fspath(resume)
        ptr = read_pointer(resume)
        if ptr is None:
            return resume  # an ordinary Trainer checkpoint
        mgr = self._cairn()
        found = sorted((c for c in mgr.candidates() if c[0] <= ptr["step"]), key=lambda c: -c[0])
        mgr._open_readers.clear()  # candidates() keeps them for restore()
        if os.path.normpath(self.cairn_root) == os.path.normpath(
                os.path.join(self.args.output_dir, "cairn")):
            # The default root is this output_dir's alone: steps of a crashed run
            # whose checkpoint-N directory is gone are deleted like this run's own.
            self._cairn_saved.update(c[0] for c in found)
        failures = [] if any(c[0] == ptr["step"] for c in found) else [
            f"step {ptr['step']}: in no tier"]
        for step, tier, uri in found:
            try:
                flat = fw.read_checkpoint(uri)
                ckpt = fw.join(flat, weights_only=True, where=uri)
            except (Error, OSError) as e:
                failures.append(f"step {step} ({tier}): {e}")
                continue
            folder = os.path.join(os.path.dirname(resume),
                                  f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{step}")
            if failures:
                msg = (f"cairn: {resume} (step {ptr['step']}) could not be loaded "
                       f"({'; '.join(failures)}); resuming from step {step} ({tier} tier)")
                log.warning(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
            self._cairn_write_dir(folder, step, ckpt["trainer_state"])
            self._cairn_loaded, self._cairn_loaded_dir = ckpt, folder
            self._cairn_saved.add(step)
            return folder
        raise CorruptionError(f"{resume}: no cairn checkpoint could be loaded: "
                              + "; ".join(failures))

    def _cairn_of(self, checkpoint: Any) -> dict[str, Any] | None:
        if (self._cairn_loaded is not None and checkpoint is not None
                and os.path.abspath(os.fspath(checkpoint)) == os.path.abspath(self._cairn_loaded_dir)):
            return self._cairn_loaded
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        ckpt = self._cairn_of(resume_from_checkpoint)
        if ckpt is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        target = self.accelerator.unwrap_model(model if model is not None else self.model)
        target.load_state_dict(ckpt["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        ckpt = self._cairn_of(checkpoint)
        if ckpt is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if ckpt["optimizer"] is not None:
            self.optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt["scheduler"] is not None:
            self.lr_scheduler.load_state_dict(ckpt["scheduler"])

    def _load_scaler(self, checkpoint: Any) -> None:
        if self._cairn_of(checkpoint) is None:
            return super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: Any) -> None:
        ckpt = self._cairn_of(checkpoint)
        if ckpt is None:
            return super()._load_rng_state(checkpoint)
        _set_rng_state(ckpt["rng"])


class Trainer(CairnTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` checkpointing through cairn (see CairnTrainerMixin)."""
