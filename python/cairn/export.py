"""Export for serving: the model's tensors of a cairn checkpoint as safetensors.

    cairn export CKPT --safetensors OUT_DIR [--prefix model.] [--max-shard-size 5GB]
    cairn.export.to_safetensors(ckpt, out_dir, prefix=None, max_shard_size=5 << 30)

CKPT is a committed checkpoint (a ``step_<N>`` directory or URI: file://, shm://,
s3://) or a run root (its newest valid checkpoint is taken). The model's tensors are
the items below ``prefix`` (default: ``model.``, which cairn.lightning, cairn.hf and
a ``{"model": model.state_dict()}`` state use; else ``state_dict.``), named without
it, as ``from_pretrained`` expects. Output, as Hugging Face writes it:
``model.safetensors``, or, above ``max_shard_size``,
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``
(``{"metadata": {"total_size"}, "weight_map": {name: file}}``).

Protocol: tensors are grouped into output shards in checkpoint order; each shard's
tensors are read in one engine call (in parallel on the I/O pool, from every rank's
data file, each block's checksum verified as it is copied: a corrupt byte raises
cairn.CorruptionError naming file and tensor), written to a temporary file and
renamed; the index is written last. Memory held: one output shard.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from cairn import latest_valid
from cairn.dcp import Reader
from cairn.errors import CorruptionError, Error, InvalidArgumentError, NotFoundError

__all__ = ["to_safetensors"]

_DEFAULT_PREFIXES = ("model.", "state_dict.")


def _parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10,
             "MIB": 1 << 20, "GIB": 1 << 30}
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    try:
        value = int(float(num) * units[t[len(num):]])
    except (KeyError, ValueError):
        raise InvalidArgumentError(f"not a size: {text!r} (e.g. 5GB, 500MiB)") from None
    if value <= 0:
        raise InvalidArgumentError(f"size must be > 0: {text!r}")
    return value


def _open(ckpt: str) -> Reader:
    try:
        return Reader(ckpt)
    except NotFoundError:
        newest = latest_valid(ckpt)
        if newest is None:
            raise
        return Reader(newest)


def to_safetensors(ckpt: str | os.PathLike, out_dir: str | os.PathLike, *,
                   prefix: str | None = None, max_shard_size: int = 5 << 30) -> list[str]:
    """Writes the model's tensors of `ckpt` to `out_dir` as safetensors (see the
    module's docstring); returns the files written (the index last, if any)."""
    import safetensors.torch  # optional dependency: pip install cairn[hf]

    if max_shard_size <= 0:
        raise InvalidArgumentError("max_shard_size must be > 0")
    reader = _open(os.fspath(ckpt))
    meta = reader.read_metadata().state_dict_metadata
    tensors = {k: m for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}
    prefixes = (prefix,) if prefix is not None else _DEFAULT_PREFIXES
    chosen = next((p for p in prefixes if any(k.startswith(p) for k in tensors)), None)
    if chosen is None:
        tops = sorted({k.split(".", 1)[0] + "." for k in tensors})
        raise InvalidArgumentError(f"{reader.path}: no tensor below {' or '.join(prefixes)}; "
                                   f"the checkpoint's prefixes: {', '.join(tops) or 'none'} "
                                   "(pass prefix=)")
    names = [k for k in tensors if k.startswith(chosen) and len(k) > len(chosen)]

    def nbytes(k: str) -> int:
        m = tensors[k]
        return int(torch.Size(m.size).numel()) * torch.empty((), dtype=m.properties.dtype).element_size()

    shards: list[list[str]] = [[]]
    size = 0
    for k in names:
        n = nbytes(k)
        if shards[-1] and size + n > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    count = len(shards)
    files = ["model.safetensors"] if count == 1 else [
        f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    weight_map, written, total = {}, [], 0
    for keys, name in zip(shards, files):
        target = {k: torch.empty(tuple(tensors[k].size), dtype=tensors[k].properties.dtype)
                  for k in keys}
        plan = reader.plan_in_place(target)
        if plan is None:  # resharded pieces: DCP assembles them (still verified)
            import torch.distributed.checkpoint as dcp

            dcp.load(target, storage_reader=reader, no_dist=True)
        else:
            reader.load_in_place(plan)
        part = {k[len(chosen):]: v for k, v in target.items()}
        tmp = os.path.join(out, f".{name}.tmp")
        safetensors.torch.save_file(part, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(out, name))
        written.append(os.path.join(out, name))
        for k, v in part.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
        del target, part
    index = os.path.join(out, "model.safetensors.index.json")
    if count > 1:
        tmp = index + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2,
                      sort_keys=True)
        os.replace(tmp, index)
        written.append(index)
    elif os.path.exists(index):  # a stale index of an earlier, sharded export
        os.remove(index)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cairn export",
                                description="the model's tensors of a cairn checkpoint as "
                                            "safetensors files (for serving)")
    p.add_argument("ckpt", help="a checkpoint (step_<N> dir or URI) or a run root")
    p.add_argument("--safetensors", required=True, metavar="OUT_DIR")
    p.add_argument("--prefix", default=None,
                   help="the model's key prefix (default: model., else state_dict.)")
    p.add_argument("--max-shard-size", default="5GB")
    a = p.parse_args(argv)
    try:
        files = to_safetensors(a.ckpt, a.safetensors, prefix=a.prefix,
                               max_shard_size=_parse_size(a.max_shard_size))
    except CorruptionError as e:
        print(f"cairn export: {e}", file=sys.stderr)
        return 1
    except (NotFoundError, InvalidArgumentError, FileNotFoundError) as e:
        print(f"cairn export: {e}", file=sys.stderr)
        return 2
    except Error as e:
        print(f"cairn export: {e}", file=sys.stderr)
        return 1
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
