"""Seeded mutation fuzzing of a cairn manifest (run by test_manifest_fuzz.py).

    python manifest_fuzz.py SEED MUTATIONS FULL_LOADS WORKDIR

Saves a small checkpoint, then mutates its manifest body MUTATIONS times
(bytes flipped, inserted, deleted, digits changed; JSON values replaced by
boundary values, other nodes, wrong types; keys dropped; list entries
dropped, duplicated, swapped) and wraps each in a valid envelope (trailer
recomputed), so every mutation reaches the validator. Each one is decoded and
converted the way cairn.Reader does (C++ decode + validation, then the Python
conversion to DCP metadata); every FULL_LOADS-th is also written out and
loaded with dcp.load. The address space is capped, so an allocation beyond the
declared limits fails as MemoryError.

Checked: only cairn.Error-family exceptions (or DCP's own "this checkpoint is
not the state you asked for" errors, when a mutation produced a valid manifest
of a different state: a renamed key, a changed shape); and a load that
succeeds yields exactly the original values. Prints a JSON summary; exits 1
with the failures listed.
"""

from __future__ import annotations

import copy
import json
import os
import random
import resource
import struct
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import cairn
from cairn import _ext
from cairn._dcp_metadata import metadata_from_manifest

warnings.filterwarnings("ignore")

BOUNDARY = [0, 1, -1, 4095, 4096, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
            10**30, 1.5, -0.0, 1e308, "", "x", "float32", "data/r0.bin", "../x", "/etc/passwd",
            None, True, False, [], {}, [0, 0], [2**64 - 1], {"__dict__": []},
            {"__tuple__": [[1]]}, {"__dict__": [[{"__dict__": []}, 1]]}]


def original_state():
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(2, 2048, generator=g), "b": torch.arange(10, dtype=torch.int64),
            "e": torch.zeros(0, 3), "step": 5}


def blank_state():
    return {"w": torch.zeros(2, 2048), "b": torch.zeros(10, dtype=torch.int64),
            "e": torch.zeros(0, 3), "step": 0}


def envelope(body: bytes) -> bytes:
    head = b"CAIRNMF\n" + struct.pack("<IIQ", 1, 0, len(body)) + body
    return head + struct.pack("<Q", _ext.checksum(head))


def nodes(value, path=()):
    """Every (path, value) of a JSON document."""
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from nodes(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from nodes(v, path + (i,))


def at(doc, path):
    for p in path:
        doc = doc[p]
    return doc


def mutate_json(rng: random.Random, body: dict) -> bytes:
    doc = copy.deepcopy(body)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        all_nodes = list(nodes(doc))
        path, value = rng.choice(all_nodes[1:])
        parent = at(doc, path[:-1])
        key = path[-1]
        op = rng.randrange(7)
        if op == 0:
            parent[key] = copy.deepcopy(rng.choice(BOUNDARY))
        elif op == 1:  # another node's value (a plausible but wrong value)
            parent[key] = copy.deepcopy(rng.choice(all_nodes)[1])
        elif op == 2 and isinstance(value, int) and not isinstance(value, bool):
            parent[key] = value + rng.choice((-4096, -1, 1, 4096, value, -value))
        elif op == 3:
            del parent[key]
        elif op == 4 and isinstance(value, list) and value:
            value.append(copy.deepcopy(rng.choice(value)))
        elif op == 5 and isinstance(value, list) and len(value) > 1:
            i, j = rng.sample(range(len(value)), 2)
            value[i], value[j] = value[j], value[i]
        elif op == 6 and isinstance(value, str) and value:
            i = rng.randrange(len(value))
            parent[key] = value[:i] + chr(rng.randrange(32, 127)) + value[i + 1 :]
    return json.dumps(doc, separators=(",", ":")).encode()


def mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw)
    for _ in range(rng.choice((1, 1, 2, 4))):
        i = rng.randrange(len(b))
        op = rng.randrange(5)
        if op == 0:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            b.insert(i, rng.randrange(256))
        elif op == 2:
            del b[i]
        elif op == 3:
            digits = [k for k, c in enumerate(b) if 48 <= c <= 57]
            b[rng.choice(digits)] = rng.randrange(48, 58)
        else:
            j = min(len(b), i + rng.randrange(1, 64))
            b[i:i] = b[i:j]
    return bytes(b)


def allowed(e: BaseException) -> bool:
    if isinstance(e, cairn.Error):
        return True
    # DCP's planner refusing a valid manifest of another state.
    msg = str(e)
    return isinstance(e, (RuntimeError, ValueError)) and (
        "Missing key" in msg or "Size mismatch" in msg or "size mismatch" in msg
    )


def main() -> int:
    seed, n, full_every, work = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    ck = os.path.join(work, "ck")
    dcp.save(original_state(), storage_writer=cairn.Writer(ck, thread_count=2))
    raw = open(os.path.join(ck, "cairn.manifest"), "rb").read()
    (blen,) = struct.unpack_from("<Q", raw, 16)
    body_bytes = raw[24 : 24 + blen]
    body = json.loads(body_bytes)
    want = original_state()

    # Cap the address space: whatever a mutated manifest declares, nothing may
    # allocate more than the limits (1 GiB per non-tensor item; tensors are
    # bounded by the real size of their ~100 KiB data file).
    vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1])
    cap = vm * 1024 + (3 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))

    rng = random.Random(seed)
    failures: list[str] = []
    counts = {"refused": 0, "decoded": 0, "loaded_equal": 0, "load_refused": 0, "mismatch": 0}
    for i in range(n):
        mutated = mutate_json(rng, body) if rng.random() < 0.6 else mutate_bytes(rng, body_bytes)
        data = envelope(mutated)
        try:
            metadata_from_manifest(_ext.decode_manifest(data))
            counts["decoded"] += 1
        except BaseException as e:  # noqa: BLE001
            if not isinstance(e, cairn.Error):
                failures.append(f"#{i} decode: {type(e).__name__}: {e} <- {mutated[:300]!r}")
            counts["refused"] += 1
            if i % full_every:
                continue
        if i % full_every:
            continue
        with open(os.path.join(ck, "cairn.manifest"), "wb") as f:
            f.write(data)
        out = blank_state()
        try:
            dcp.load(out, storage_reader=cairn.Reader(ck, thread_count=2))
        except BaseException as e:  # noqa: BLE001
            err = cairn.dcp.unwrap(e) if isinstance(e, CheckpointException) else e
            if not allowed(err):
                failures.append(f"#{i} load: {type(err).__name__}: {err} <- {mutated[:300]!r}")
            counts["mismatch" if not isinstance(err, cairn.Error) else "load_refused"] += 1
            continue
        same = all(
            torch.equal(out[k], want[k]) if isinstance(want[k], torch.Tensor) else out[k] == want[k]
            for k in want
        )
        if not same:
            failures.append(f"#{i} loaded different values <- {mutated[:300]!r}")
        counts["loaded_equal"] += same
    print(json.dumps({"counts": counts, "failures": failures[:20], "n_failures": len(failures)}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
