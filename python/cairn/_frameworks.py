"""What the framework adapters (cairn.lightning, cairn.hf) share.

A framework hands cairn a nested checkpoint dict (tensors inside dicts and lists,
next to ints, strings, paths and other small values). ``split`` turns it into a
cairn state: every tensor becomes an item of its own (``model.<name>`` for the
model's weights, so that ``cairn export`` finds them, ``other.<i>`` for the rest),
and the rest of the tree, with each tensor's position recorded, becomes one bytes
value (torch.save of plain containers and the framework's own small values).
``join`` rebuilds the dict from a loaded state. The structure of the state, and so
the manager's cached save plan, stays the same from one save to the next.

``read_checkpoint`` loads a committed cairn checkpoint (any tier's URI) without a
template, its tensors verified against their checksums by the engine.

``rank_local`` lets one rank of a distributed job run a CheckpointManager of its
own (a world of one): DDP strategies save on global rank 0 only, so the others
never join the manager's collectives. Inside it, ``torch.distributed.is_initialized``
answers False on the calling thread only.
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from cairn import _ext
from cairn.dcp import Reader
from cairn.errors import CorruptionError, Error, InvalidArgumentError, NotFoundError

log = logging.getLogger(__name__)

MODEL = "model"
OTHER = "other"
TREE = "tree"
_FORMAT = 1

# ---- rank-local managers -------------------------------------------------------------

_hidden = threading.local()
_original_is_initialized = None
_install_lock = threading.Lock()


def _install() -> None:
    global _original_is_initialized
    with _install_lock:
        if _original_is_initialized is not None:
            return
        original = dist.is_initialized

        def is_initialized() -> bool:
            if getattr(_hidden, "on", False):
                return False
            return original()

        is_initialized.__doc__ = original.__doc__
        _original_is_initialized = original
        dist.is_initialized = is_initialized


@contextlib.contextmanager
def rank_local(enabled: bool) -> Iterator[None]:
    """While active (and `enabled`), this thread sees no torch.distributed: a
    CheckpointManager made or used here is a world of one (rank 0's own)."""
    if not enabled:
        yield
        return
    _install()
    before = getattr(_hidden, "on", False)
    _hidden.on = True
    try:
        yield
    finally:
        _hidden.on = before


def world() -> tuple[int, int]:
    """(rank, world size) of the real job, whatever rank_local hides."""
    if dist.is_available() and (_original_is_initialized or dist.is_initialized)():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def delete_step(mgr: Any, step: int) -> None:
    """Removes `step` from every slower tier of `mgr` (the framework decided it is
    garbage: nothing names it any more), manifest first, so it is never half-valid.
    A step already gone is fine; any other failure is logged and the step stays."""
    for tier in mgr._tiers.slower_tiers():
        storage, step_dir = mgr._tiers.storage(tier), mgr._tiers.step_dir(step)
        try:
            _ext.uncommit(storage, step_dir)
            storage.delete_dir(step_dir)
        except NotFoundError:
            pass
        except Error as e:
            log.warning("cairn: deleting step %d of the %s tier: %s", step, tier, e)


# ---- splitting a checkpoint dict into a cairn state ----------------------------------


def split(checkpoint: dict[str, Any], model_key: str | None) -> dict[str, Any]:
    """The cairn state of `checkpoint`: ``{"model": {name: tensor}, "other": {"<i>":
    tensor}, "tree": bytes}``. ``checkpoint[model_key]``, a flat dict of tensors,
    is the model's weights. The tensors are the checkpoint's own (staging copies
    them)."""
    model: dict[str, torch.Tensor] = {}
    other: dict[str, torch.Tensor] = {}
    places: list[tuple[tuple, str, str]] = []  # (path, group, name)

    def walk(obj: Any, path: tuple) -> Any:
        if isinstance(obj, torch.Tensor):
            if len(path) == 2 and path[0] == model_key and isinstance(path[1], str):
                model[path[1]] = obj
                places.append((path, MODEL, path[1]))
            else:
                name = str(len(other))
                other[name] = obj
                places.append((path, OTHER, name))
            return None
        if isinstance(obj, dict):
            out = type(obj)() if type(obj) is not dict else {}
            try:
                for k, v in obj.items():
                    out[k] = walk(v, path + (k,))
            except TypeError:  # a dict subclass that cannot be rebuilt empty
                out = {k: walk(v, path + (k,)) for k, v in obj.items()}
            return out
        if isinstance(obj, list):
            return [walk(v, path + (i,)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and type(obj) is tuple:
            return tuple(walk(v, path + (i,)) for i, v in enumerate(obj))
        return obj

    tree = walk(checkpoint, ())
    buf = io.BytesIO()
    torch.save({"format": _FORMAT, "tree": tree, "places": places}, buf)
    return {MODEL: model, OTHER: other, TREE: buf.getvalue()}


def join(flat: dict[str, Any], map_location: Any = None, weights_only: bool | None = None,
         where: str = "checkpoint") -> dict[str, Any]:
    """The checkpoint dict back from a loaded flat state (``read_checkpoint``)."""
    data = flat.get(TREE)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptionError(f"{where}: not a framework checkpoint written by cairn "
                              f"(no '{TREE}' value)")
    skeleton = torch.load(io.BytesIO(bytes(data)),
                          weights_only=True if weights_only is None else weights_only)
    if not isinstance(skeleton, dict) or skeleton.get("format") != _FORMAT:
        raise CorruptionError(f"{where}: unknown framework checkpoint format")
    tree = skeleton["tree"]
    for path, group, name in skeleton["places"]:
        key = f"{group}.{name}"
        if key not in flat:
            raise CorruptionError(f"{where}: tensor {key} of the checkpoint is missing")
        t = flat[key]
        if isinstance(map_location, (str, torch.device)):
            t = t.to(map_location)  # (a callable or dict map_location: CPU tensors)
        tree = _set(tree, tuple(path), t)
    return tree


def _set(tree: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, tuple):
        items = list(tree)
        items[head] = _set(items[head], rest, value)
        return tuple(items)
    tree[head] = _set(tree[head], rest, value)
    return tree


# ---- reading ---------------------------------------------------------------------------


def read_checkpoint(uri: str, *, allow_pickle: bool = False) -> dict[str, Any]:
    """Every item of the committed cairn checkpoint at `uri`, flat: tensors (CPU)
    and values, checksums verified. Raises cairn.CorruptionError or
    cairn.NotFoundError."""
    reader = Reader(uri, allow_pickle=allow_pickle)
    md = reader.read_metadata()
    template: dict[str, Any] = {}
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            template[fqn] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        elif isinstance(meta, BytesStorageMetadata):
            template[fqn] = b""
        else:  # pragma: no cover - DCP has no other kind
            raise CorruptionError(f"{uri}: unknown item kind of {fqn}")
    plan = reader.plan_in_place(template)
    if plan is not None:
        reader.load_in_place(plan)
    else:
        dcp.load(template, storage_reader=reader, no_dist=True)
    return template


def check_no_keep(kwargs: dict[str, Any], owner: str) -> None:
    if "keep" in kwargs:
        raise InvalidArgumentError(f"keep= is not taken: {owner} owns retention, cairn "
                                   "deletes what it stops tracking")
