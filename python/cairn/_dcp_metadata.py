"""DCP ``Metadata`` to and from the engine's typed manifest (``_ext.Manifest``).

The engine owns the manifest schema, its validation and its encoding
(include/cairn/manifest.h); this module only converts: ``manifest_from_metadata``
for a save (the DCP Writer's ``finish`` and the CheckpointManager's commits),
``metadata_from_manifest`` for a load (the DCP Reader). DCP's planner data and
storage metadata, which the engine does not interpret, travel in the
manifest's ``extra`` JSON object under ``"dcp"``, tagged so that tuples and
dicts come back as such (cairn never pickles).
"""

from __future__ import annotations

import json
import time
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from cairn import _ext
from cairn.errors import CorruptionError, InvalidArgumentError

__all__ = [
    "Location",
    "Item",
    "dtype_name",
    "manifest_from_metadata",
    "metadata_from_manifest",
    "manifest_extra",
]


class Location(NamedTuple):
    """WriteResult.storage_data: where one item went (small and picklable)."""

    file: str
    file_size: int
    offset: int
    length: int
    checksums: tuple[int, ...]


class Item(NamedTuple):
    """Reader-side storage_data: a manifest item (kind 0 tensor chunk, 1 bytes)."""

    kind: int
    index: int
    chunk: int
    length: int


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of ``dtype``; InvalidArgumentError if the engine
    cannot store it."""
    name = str(dtype).removeprefix("torch.")
    if _ext.dtype_itemsize(name) == 0:
        raise InvalidArgumentError(f"cairn cannot store tensors of dtype {dtype}")
    return name


def _dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise InvalidArgumentError(f"checkpoint uses dtype {name!r}, unknown to this torch")
    return dt


_MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
    "preserve_format": torch.preserve_format,
}


def _encode(value: Any) -> Any:
    """Encodes DCP planner data (nested dicts/lists/tuples of scalars) as JSON.

    Dicts and tuples are tagged so they decode to the same types; anything
    else is refused: cairn never pickles.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, dict):
        return {"__dict__": [[_encode(k), _encode(v)] for k, v in value.items()]}
    raise InvalidArgumentError(
        f"cannot store planner data of type {type(value).__name__} in a cairn manifest "
        "(only dicts, lists, tuples and scalars: cairn never pickles)"
    )


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"} and isinstance(value["__tuple__"], list):
            return tuple(_decode(v) for v in value["__tuple__"])
        if set(value) == {"__dict__"} and isinstance(value["__dict__"], list):
            out = {}
            for pair in value["__dict__"]:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise CorruptionError("malformed planner data in the manifest")
                key = _decode(pair[0])
                if isinstance(key, list):
                    raise CorruptionError("malformed planner data in the manifest")
                out[key] = _decode(pair[1])
            return out
        raise CorruptionError("malformed planner data in the manifest")
    return value


def manifest_extra(manifest: _ext.Manifest) -> dict[str, Any]:
    """The manifest's ``extra`` object (validated by the engine as a JSON object)."""
    extra = json.loads(manifest.extra)
    return extra if isinstance(extra, dict) else {}


def manifest_from_metadata(
    metadata: Metadata,
    results: list[list[WriteResult]],
    block_size: int,
    extra: dict[str, Any],
) -> _ext.Manifest:
    """The engine manifest of a DCP save: ``metadata`` from the planner, each
    rank's ``results`` (storage_data a :class:`Location`), and ``extra`` (merged
    into the manifest's extra object beside DCP's own ``"dcp"`` section)."""
    locations: dict[MetadataIndex, Location] = {}
    file_sizes: dict[str, int] = {}
    for rank_results in results:
        for wr in rank_results:
            loc = wr.storage_data
            if not isinstance(loc, Location):
                raise InvalidArgumentError(f"unexpected write result for {wr.index.fqn!r}")
            locations[wr.index] = loc
            file_sizes[loc.file] = loc.file_size
    file_keys = sorted(file_sizes, key=lambda k: (len(k), k))
    file_index = {k: i for i, k in enumerate(file_keys)}

    def location(index: MetadataIndex) -> _ext.ItemLocation:
        loc = locations.get(index)
        if loc is None:
            raise InvalidArgumentError(f"no data was written for {index.fqn!r} {index.offset}")
        return _ext.ItemLocation(file_index[loc.file], loc.offset, loc.length, list(loc.checksums))

    tensors = []
    bytes_items = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            props = md.properties
            chunks = [
                _ext.TensorChunk(
                    list(ch.offsets), list(ch.sizes), location(MetadataIndex(fqn, ch.offsets))
                )
                for ch in md.chunks
            ]
            tensors.append(_ext.ManifestTensor(
                fqn=fqn,
                dtype=dtype_name(props.dtype),
                shape=list(md.size),
                requires_grad=bool(props.requires_grad),
                layout=str(props.layout).removeprefix("torch."),
                memory_format=str(props.memory_format).removeprefix("torch."),
                pin_memory=bool(props.pin_memory),
                chunks=chunks,
            ))
        elif isinstance(md, BytesStorageMetadata):
            bytes_items.append(_ext.ManifestBytes(fqn, location(MetadataIndex(fqn))))
        else:
            raise InvalidArgumentError(f"unsupported DCP storage metadata for {fqn!r}: {md!r}")

    sm = metadata.storage_meta
    dcp_extra = {
        "version": metadata.version,
        "planner_data": _encode(metadata.planner_data),
        "storage_meta": None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": list(sm.modules),
        },
    }
    m = _ext.Manifest()
    m.world_size = max(1, len(results))
    m.block_size = block_size
    m.created_unix_ms = int(time.time() * 1000)
    m.files = [_ext.ManifestFile(k, file_sizes[k]) for k in file_keys]
    m.tensors = tensors
    m.bytes = bytes_items
    m.extra = json.dumps({"dcp": dcp_extra, **extra}, separators=(",", ":"))
    return m


def metadata_from_manifest(
    manifest: _ext.Manifest,
) -> tuple[Metadata, dict[MetadataIndex, Item]]:
    """Rebuilds DCP ``Metadata`` (and each item's place in the manifest) from a
    validated manifest."""
    state: dict[str, Any] = {}
    items: dict[MetadataIndex, Item] = {}
    for ti, t in enumerate(manifest.tensors):
        props = TensorProperties(
            dtype=_dtype_from_name(t.dtype),
            layout=torch.strided,
            requires_grad=t.requires_grad,
            memory_format=_MEMORY_FORMATS.get(t.memory_format, torch.contiguous_format),
            pin_memory=t.pin_memory,
        )
        chunks = []
        for ci, c in enumerate(t.chunks):
            offsets = torch.Size(c.offsets)
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(c.sizes)))
            items[MetadataIndex(t.fqn, offsets)] = Item(0, ti, ci, c.location.length)
        state[t.fqn] = TensorStorageMetadata(
            properties=props, size=torch.Size(t.shape), chunks=chunks
        )
    for bi, b in enumerate(manifest.bytes):
        state[b.fqn] = BytesStorageMetadata()
        items[MetadataIndex(b.fqn)] = Item(1, bi, 0, b.location.length)
    dcp_extra = manifest_extra(manifest).get("dcp", {}) or {}
    if not isinstance(dcp_extra, dict):
        raise CorruptionError("malformed 'extra.dcp' section in the manifest")
    sm = dcp_extra.get("storage_meta")
    storage_meta = None
    if isinstance(sm, dict):
        storage_meta = StorageMeta(
            checkpoint_id=sm.get("checkpoint_id"),
            save_id=sm.get("save_id"),
            modules=list(sm.get("modules") or []),
        )
    metadata = Metadata(
        state_dict_metadata=state,
        planner_data=_decode(dcp_extra.get("planner_data")),
        storage_data=items,
        storage_meta=storage_meta,
        version=dcp_extra.get("version"),
    )
    return metadata, items
