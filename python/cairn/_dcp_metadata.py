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
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from cairn import _ext
from cairn.errors import InvalidArgumentError

__all__ = [
    "Location",
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
    """DCP planner data (nested dicts/lists/tuples of scalars) as a JSON value,
    dicts and tuples tagged so they decode to the same types, encoded by the engine
    (include/cairn/value_codec.h); InvalidArgumentError for anything else: cairn
    never pickles."""
    return json.loads(_ext.encode_planner_data(value))


def _decode(value: Any) -> Any:
    return _ext.decode_planner_data(json.dumps(value))


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
    written = []
    for rank_results in results:
        for wr in rank_results:
            loc = wr.storage_data
            if not isinstance(loc, Location):
                raise InvalidArgumentError(f"unexpected write result for {wr.index.fqn!r}")
            written.append((wr.index.fqn, wr.index.offset, *loc))
    tensors = []
    bytes_items = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            props = md.properties
            chunks = [_ext.TensorChunk(list(ch.offsets), list(ch.sizes)) for ch in md.chunks]
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
            bytes_items.append(_ext.ManifestBytes(fqn))
        else:
            raise InvalidArgumentError(f"unsupported DCP storage metadata for {fqn!r}: {md!r}")

    sm = metadata.storage_meta
    if sm is not None:
        sm = (None if sm.checkpoint_id is None else str(sm.checkpoint_id), sm.save_id,
              list(sm.modules))
    m = _ext.Manifest()
    m.world_size = max(1, len(results))
    m.block_size = block_size
    m.created_unix_ms = int(time.time() * 1000)
    m.tensors = tensors
    m.bytes = bytes_items
    _ext.place_written_items(m, written)  # the file table and every item's location
    m.extra = _ext.dcp_extra_json(metadata.version, metadata.planner_data, sm, json.dumps(extra))
    return m


def metadata_from_manifest(manifest: _ext.Manifest) -> Metadata:
    """Rebuilds DCP ``Metadata`` from a validated manifest (the engine's reader
    finds each item by name, so ``storage_data`` is None)."""
    state: dict[str, Any] = {}
    for t in manifest.tensors:
        props = TensorProperties(
            dtype=_dtype_from_name(t.dtype),
            layout=torch.strided,
            requires_grad=t.requires_grad,
            memory_format=_MEMORY_FORMATS.get(t.memory_format, torch.contiguous_format),
            pin_memory=t.pin_memory,
        )
        chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                  for c in t.chunks]
        state[t.fqn] = TensorStorageMetadata(
            properties=props, size=torch.Size(t.shape), chunks=chunks
        )
    for b in manifest.bytes:
        state[b.fqn] = BytesStorageMetadata()
    version, planner_data, sm = _ext.dcp_section(manifest)  # validated by the engine
    return Metadata(
        state_dict_metadata=state,
        planner_data=planner_data,
        storage_meta=None if sm is None else StorageMeta(*sm),
        version=version,
    )
