"""Hostile and unlucky input (issue 8), tried the way a hostile user would:
FIFOs where files belong, copies onto their own source (directly or through a
symlink), crafted chunk maps and ``extra`` sections inside a valid envelope,
sparse files that declare huge items, hostile stock ``.metadata``.

Every check that could block (the FIFO ones) runs in a subprocess under a
timeout, so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cairn
from cairn import _ext

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PYTHONPATH = os.path.join(os.path.dirname(__file__), "..", "..", "python")


def state():
    g = torch.Generator().manual_seed(8)
    return {
        "w": torch.randn(2, 2048, generator=g),  # rows of 8 KiB: easy to re-chunk
        "b": torch.arange(10, dtype=torch.int64),
        "step": 5,
    }


def empty_like_state():
    return {"w": torch.zeros(2, 2048), "b": torch.zeros(10, dtype=torch.int64), "step": 0}


def save(path):
    dcp.save(state(), storage_writer=cairn.Writer(path))
    return path


def read_body(path):
    raw = open(os.path.join(path, "cairn.manifest"), "rb").read()
    (n,) = struct.unpack_from("<Q", raw, 16)
    return json.loads(raw[24 : 24 + n])


def envelope(body: dict | bytes) -> bytes:
    """A valid manifest envelope (magic, version, flags, length, trailer) around
    any body: what a hostile user crafting a manifest would write."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = b"CAIRNMF\n" + struct.pack("<IIQ", 1, 0, len(data)) + data
    return head + struct.pack("<Q", _ext.checksum(head))


def write_body(path, body):
    with open(os.path.join(path, "cairn.manifest"), "wb") as f:
        f.write(envelope(body))


def tensor(body, fqn):
    return next(t for t in body["tensors"] if t["fqn"] == fqn)


def run_isolated(code: str, timeout: float = 120) -> dict:
    """Runs `code` in a fresh interpreter (PYTHONPATH = this checkout) under a
    timeout; the code prints one JSON object as its last line."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(PYTHONPATH))
    try:
        p = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"blocked for {timeout} s (a FIFO was opened?): {e.stdout} {e.stderr}")
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


# A preamble for isolated checks: `outcome(fn)` is the exception class name
# and message of fn(), or "ok".
PREAMBLE = """
import json, sys, warnings
import torch, torch.distributed.checkpoint as dcp
import cairn
from cairn import _ext
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
def outcome(fn):
    try:
        fn()
        return ["ok", ""]
    except BaseException as e:
        e = cairn.dcp.unwrap(e)
        return [type(e).__name__, str(e)]
"""


# ---- 2. FIFOs and other non-regular files -----------------------------------------


def test_fifo_manifest_never_blocks_and_discovery_moves_on(tmp_path):
    save(tmp_path / "step_1")
    save(tmp_path / "step_2")
    os.unlink(tmp_path / "step_2" / "cairn.manifest")
    os.mkfifo(tmp_path / "step_2" / "cairn.manifest")
    r = run_isolated(
        PREAMBLE
        + f"""
root = {str(tmp_path)!r}; ck = root + "/step_2"
out = {{}}
out["verify"] = outcome(lambda: cairn.verify(ck))
out["reader"] = outcome(lambda: cairn.Reader(ck))
out["ext_reader"] = outcome(lambda: _ext.CheckpointReader(_ext.open_storage(ck, create=False)))
out["list"] = [(e["name"], e["committed"], e["status"]) for e in cairn.list_checkpoints(root)]
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    out["latest"] = cairn.latest_valid(root)
    out["warned"] = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
mgr = cairn.CheckpointManager(root, memory=False)
st = {{"w": torch.zeros(2, 2048), "b": torch.zeros(10, dtype=torch.int64), "step": 0}}
out["restored"] = mgr.restore(st)
out["restored_w"] = float(st["w"].abs().sum())
mgr.close()
print(json.dumps(out))
"""
    )
    for what in ("verify", "reader", "ext_reader"):
        assert r[what][0] == "CorruptionError", (what, r[what])
        assert "FIFO" in r[what][1] and "cairn.manifest" in r[what][1], r[what]
    assert r["list"][0][:2] == ["step_1", True]
    assert r["list"][1][:2] == ["step_2", False] and "FIFO" in r["list"][1][2]
    assert r["latest"] == str(tmp_path / "step_1")
    assert any("step_2" in m and "FIFO" in m for m in r["warned"]), r["warned"]
    assert r["restored"] == 1
    assert r["restored_w"] == pytest.approx(float(state()["w"].abs().sum()))


def test_fifo_data_file_never_blocks_verify_or_load(tmp_path):
    ck = save(tmp_path / "ck")
    os.unlink(ck / "data" / "r0.bin")
    os.mkfifo(ck / "data" / "r0.bin")
    r = run_isolated(
        PREAMBLE
        + f"""
ck = {str(ck)!r}
out = {{}}
out["verify"] = outcome(lambda: cairn.verify(ck))
out["reader"] = outcome(lambda: cairn.Reader(ck))
st = {{"w": torch.zeros(2, 2048)}}
out["load"] = outcome(lambda: dcp.load(st, storage_reader=cairn.Reader(ck)))
out["copy"] = outcome(lambda: cairn.copy_checkpoint(ck, ck + "_copy"))
print(json.dumps(out))
"""
    )
    for what in ("verify", "reader", "load", "copy"):
        assert r[what][0] == "CorruptionError", (what, r[what])
        assert "data/r0.bin" in r[what][1] and "FIFO" in r[what][1], r[what]
    assert not (tmp_path / "ck_copy" / "cairn.manifest").exists()


def test_fifo_in_a_stock_checkpoint_never_blocks(tmp_path):
    stock = tmp_path / "stock"
    dcp.save(state(), storage_writer=dcp.FileSystemWriter(str(stock)))
    data = sorted(p for p in os.listdir(stock) if p.endswith(".distcp"))[0]
    os.unlink(stock / data)
    os.mkfifo(stock / data)
    meta_fifo = tmp_path / "stock_meta"
    meta_fifo.mkdir()
    os.mkfifo(meta_fifo / ".metadata")
    r = run_isolated(
        PREAMBLE
        + f"""
out = {{}}
st = {{"w": torch.zeros(2, 2048), "b": torch.zeros(10, dtype=torch.int64), "step": 0}}
out["load"] = outcome(lambda: dcp.load(st, storage_reader=cairn.Reader({str(stock)!r})))
out["meta"] = outcome(lambda: cairn.Reader({str(meta_fifo)!r}))
from cairn import _stock_reader as _stock
out["meta_direct"] = outcome(lambda: _stock.read_stock_metadata({str(meta_fifo)!r}))
print(json.dumps(out))
"""
    )
    assert r["load"][0] == "CorruptionError" and "regular file" in r["load"][1], r["load"]
    assert r["meta"][0] == "NotFoundError", r["meta"]  # not a stock checkpoint at all
    assert r["meta_direct"][0] == "CorruptionError", r["meta_direct"]


# ---- 1. copies onto their own source ----------------------------------------------


def _fingerprint(ck):
    return [open(os.path.join(ck, f), "rb").read() for f in ("cairn.manifest", "data/r0.bin")]


@pytest.mark.parametrize("kind", ["itself", "symlink", "inside", "around", "link_inside"])
def test_copy_onto_into_or_around_the_source_is_refused(tmp_path, kind):
    ck = save(tmp_path / "ck")
    before = _fingerprint(ck)
    os.symlink(ck, tmp_path / "l")
    dst = {
        "itself": ck,
        "symlink": tmp_path / "l",
        "inside": ck / "sub" / "deeper",
        "around": tmp_path,
        "link_inside": tmp_path / "l" / "data" / "x",
    }[kind]
    with pytest.raises(cairn.InvalidArgumentError, match="refusing"):
        cairn.copy_checkpoint(ck, dst)
    assert _fingerprint(ck) == before
    cairn.verify(ck)
    assert not (ck / "sub").exists() and not (ck / "data" / "x").exists()
    out = empty_like_state()
    dcp.load(out, storage_reader=cairn.Reader(ck))
    assert torch.equal(out["w"], state()["w"])


def test_manager_tiers_must_be_apart(tmp_path):
    root = tmp_path / "durable"
    root.mkdir()
    os.symlink(root, tmp_path / "alias")
    for local in (root, tmp_path / "alias", root / "local", tmp_path):
        with pytest.raises(cairn.InvalidArgumentError, match="tier"):
            cairn.CheckpointManager(root, memory=False, local=local)
    mgr = cairn.CheckpointManager(root, memory=False, local=tmp_path / "local")
    mgr.close()


# ---- 3. chunk coverage --------------------------------------------------------------


def _split_w(body, path):
    """Re-chunks 'w' [2, 2048] (stored as one chunk) into three boxes of the
    same bytes: row 0 left half, row 0 right half, row 1, with fresh checksums."""
    w = tensor(body, "w")
    (c,) = w["chunks"]
    data = open(os.path.join(path, body["files"][c["file"]]["key"]), "rb").read()
    base = c["offset"]

    def chunk(offsets, sizes, start, length):
        piece = data[base + start : base + start + length]
        return {
            "file": c["file"], "offset": base + start, "length": length,
            "checksums": [f"{_ext.checksum(piece):016x}"],
            "offsets": offsets, "sizes": sizes,
        }

    w["chunks"] = [
        chunk([0, 0], [1, 1024], 0, 4096),
        chunk([0, 1024], [1, 1024], 4096, 4096),
        chunk([1, 0], [1, 2048], 8192, 8192),
    ]
    return w


def test_a_correct_rechunking_loads(tmp_path):
    ck = save(tmp_path / "ck")
    body = read_body(ck)
    _split_w(body, ck)
    write_body(ck, body)
    cairn.verify(ck)
    out = empty_like_state()
    dcp.load(out, storage_reader=cairn.Reader(ck))
    assert torch.equal(out["w"], state()["w"])


@pytest.mark.parametrize(
    "edit, what",
    [
        (lambda w: w["chunks"].pop(1), "3072 of its 4096"),  # a missing chunk
        (lambda w: w.update(chunks=[]), "has no chunks"),
        (lambda w: w["chunks"][1].update(offsets=[0, 512]), "overlap at element [0, 512]"),
        (lambda w: w["chunks"][1].update(offsets=[0, 0], sizes=[1, 1024]), "both start at"),
    ],
    ids=["missing", "none", "overlap", "repeat"],
)
def test_incomplete_or_overlapping_chunk_maps_are_corruption(tmp_path, edit, what):
    ck = save(tmp_path / "ck")
    body = read_body(ck)
    edit(_split_w(body, ck))
    write_body(ck, body)
    for check in (lambda: cairn.verify(ck), lambda: cairn.Reader(ck)):
        with pytest.raises(cairn.CorruptionError, match="tensor 'w'") as info:
            check()
        assert what in str(info.value)
    out = {"w": torch.full((2, 2048), 7.0)}  # never silently keeps old values
    with pytest.raises(cairn.CorruptionError):
        dcp.load(out, storage_reader=cairn.Reader(ck))
    assert torch.all(out["w"] == 7.0)


def test_stock_metadata_with_an_incomplete_chunk_map_is_refused_at_construction(tmp_path):
    stock = tmp_path / "stock"
    dcp.save(state(), storage_writer=dcp.FileSystemWriter(str(stock)))
    md = pickle.loads((stock / ".metadata").read_bytes())  # trusted: we wrote it
    md.state_dict_metadata["w"].chunks.clear()
    (stock / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(cairn.CorruptionError, match="'w'.*has no chunks"):
        cairn.Reader(stock)


# ---- 4. huge allocations from a tiny checkpoint -------------------------------------


def test_sparse_file_declaring_a_huge_bytes_item_is_refused_before_allocating(tmp_path):
    ck = save(tmp_path / "ck")
    body = read_body(ck)
    f = body["files"][0]
    size = 1 << 40
    start = (f["size"] + 4095) // 4096 * 4096
    item = next(b for b in body["bytes"] if b["fqn"] == "step")
    item.update(offset=start, length=size, checksums=["0" * 16] * (size // body["block_size"]))
    f["size"] = start + size
    os.truncate(ck / f["key"], start + size)  # sparse: costs nothing on disk
    write_body(ck, body)
    for check in (lambda: cairn.verify(ck), lambda: cairn.Reader(ck)):
        with pytest.raises(cairn.CorruptionError, match="limit for a non-tensor item"):
            check()


def test_stock_item_larger_than_it_can_hold_is_refused_at_construction(tmp_path):
    stock = tmp_path / "stock"
    dcp.save(state(), storage_writer=dcp.FileSystemWriter(str(stock)))
    md = pickle.loads((stock / ".metadata").read_bytes())
    for idx, info in md.storage_data.items():
        if idx.fqn == "step":
            info.length = 1 << 40
            os.truncate(stock / info.relative_path, info.offset + info.length)
    (stock / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(cairn.CorruptionError, match="more than it can hold"):
        cairn.Reader(stock)


# ---- 5. errors of the right type, at construction -----------------------------------


@pytest.mark.parametrize(
    "edit",
    [
        lambda e: e["dcp"].update(planner_data={"__dict__": [[{"__dict__": []}, 1]]}),
        lambda e: e["dcp"].update(planner_data={"__dict__": [[[1, 2], 1]]}),
        lambda e: e["dcp"].update(planner_data={"__dict__": 5}),
        lambda e: e["dcp"].update(planner_data={"__tuple__": [[1]], "x": 1}),
        lambda e: e["dcp"].update(storage_meta={"modules": 5}),
        lambda e: e["dcp"].update(version=[1]),
        lambda e: e.update(dcp=[1, 2]),
        lambda e: e.update(manager="x"),
        lambda e: e.update(user=[1]),
    ],
    ids=["dict-key", "list-key", "int-for-list", "bad-tag", "modules", "version", "dcp-list",
         "manager", "user"],
)
def test_malformed_extra_is_corruption_at_construction_and_in_verify(tmp_path, edit):
    ck = save(tmp_path / "ck")
    body = read_body(ck)
    edit(body["extra"])
    write_body(ck, body)
    with pytest.raises(cairn.CorruptionError, match="extra") as info:
        cairn.Reader(ck)
    assert str(ck) in str(info.value)
    with pytest.raises(cairn.CorruptionError, match="extra"):
        cairn.verify(ck)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("hostile", ["global", "bad-chunk", "not-metadata"])
def test_hostile_stock_metadata_is_corruption_at_construction(tmp_path, hostile):
    stock = tmp_path / "stock"
    dcp.save(state(), storage_writer=dcp.FileSystemWriter(str(stock)))
    md = pickle.loads((stock / ".metadata").read_bytes())
    if hostile == "global":
        md.planner_data = _Evil()
    elif hostile == "bad-chunk":
        md.state_dict_metadata["w"].chunks[0].offsets = torch.Size([5, 0])
    else:
        md = {"not": "metadata"}
    (stock / ".metadata").write_bytes(pickle.dumps(md, protocol=2))
    with pytest.raises(cairn.CorruptionError, match=r"\.metadata"):
        cairn.Reader(stock)
    # And dcp.load with a reset Reader raises the same, never a bare AssertionError.
    reader = cairn.Reader()
    with pytest.raises(BaseException) as info:
        dcp.load(empty_like_state(), storage_reader=reader, checkpoint_id=str(stock))
    err = cairn.dcp.unwrap(info.value)
    assert isinstance(err, cairn.CorruptionError), repr(info.value)
    assert not isinstance(info.value, AssertionError)
