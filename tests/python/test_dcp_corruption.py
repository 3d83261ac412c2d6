"""Damaged and hostile checkpoints: every case is detected and named."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import cairn
from hostile import Hostile

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def rank_error(exc: BaseException) -> BaseException:
    """The exception raised inside a DCP collective step (DCP wraps those in
    a CheckpointException), or `exc` itself."""
    if isinstance(exc, CheckpointException):
        return next(iter(exc.failures.values()))[0]
    return exc


def load_error(path) -> BaseException:
    out = {"model.w": torch.zeros(256, 64), "model.b": torch.zeros(64), "step": 0}
    with pytest.raises(BaseException) as info:
        dcp.load(out, storage_reader=cairn.Reader(path))
    return rank_error(info.value)


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "step_7"
    sd = {"model.w": torch.randn(256, 64), "model.b": torch.randn(64), "step": 7}
    dcp.save(sd, storage_writer=cairn.Writer(path))
    return path


def manifest_body(path):
    raw = (path / "cairn.manifest").read_bytes()
    (body_len,) = struct.unpack("<Q", raw[16:24])
    return json.loads(raw[24 : 24 + body_len])


def item_offset(path, fqn):
    for t in manifest_body(path)["tensors"]:
        if t["fqn"] == fqn:
            return t["chunks"][0]["offset"]
    raise KeyError(fqn)


def flip(file, offset):
    with open(file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_intact_checkpoint_verifies(ckpt):
    cairn.verify(ckpt)


def test_flipped_data_byte_names_file_and_tensor(ckpt):
    flip(ckpt / "data" / "r0.bin", item_offset(ckpt, "model.b") + 5)
    err = load_error(ckpt)
    assert isinstance(err, cairn.CorruptionError)
    assert "data/r0.bin" in str(err) and "tensor 'model.b'" in str(err)
    assert "checksum mismatch" in str(err)
    with pytest.raises(cairn.CorruptionError, match=r"data/r0\.bin.*tensor 'model\.b'"):
        cairn.verify(ckpt)


def test_unwrap_returns_the_rank_error(ckpt):
    flip(ckpt / "data" / "r0.bin", item_offset(ckpt, "model.w") + 100)
    with pytest.raises(BaseException) as info:
        dcp.load({"model.w": torch.zeros(256, 64)}, storage_reader=cairn.Reader(ckpt))
    err = cairn.dcp.unwrap(info.value)
    assert isinstance(err, cairn.CorruptionError) and "tensor 'model.w'" in str(err)
    plain = ValueError("x")
    assert cairn.dcp.unwrap(plain) is plain


def test_truncated_data_file_names_file_and_tensor(ckpt):
    data = ckpt / "data" / "r0.bin"
    os.truncate(data, os.path.getsize(data) - 100)
    # Detected when the reader opens the checkpoint, before DCP's collective.
    with pytest.raises(cairn.CorruptionError, match=r"data/r0\.bin: truncated.*tensor '"):
        cairn.Reader(ckpt)
    with pytest.raises(cairn.CorruptionError, match=r"data/r0\.bin"):
        cairn.verify(ckpt)


def test_deleted_data_file_names_file_and_tensor(ckpt):
    os.remove(ckpt / "data" / "r0.bin")
    with pytest.raises(cairn.CorruptionError, match=r"data/r0\.bin: data file missing.*tensor '"):
        dcp.load({"model.w": torch.zeros(256, 64)}, storage_reader=cairn.Reader(ckpt))
    with pytest.raises(cairn.CorruptionError, match=r"data/r0\.bin"):
        cairn.verify(ckpt)


@pytest.mark.parametrize("where", ["magic", "header", "body", "trailer"])
def test_damaged_manifest_is_corruption(ckpt, where):
    path = ckpt / "cairn.manifest"
    size = os.path.getsize(path)
    offset = {"magic": 2, "header": 9, "body": size // 2, "trailer": size - 3}[where]
    flip(path, offset)
    with pytest.raises(cairn.CorruptionError, match="manifest"):
        cairn.Reader(ckpt)
    with pytest.raises(cairn.CorruptionError):
        cairn.verify(ckpt)


def test_deleted_manifest_fails_verify(ckpt):
    os.remove(ckpt / "cairn.manifest")
    with pytest.raises(cairn.CorruptionError, match="partial"):
        cairn.verify(ckpt)
    with pytest.raises(FileNotFoundError):  # nothing committed to load
        cairn.Reader(ckpt)


def test_truncated_manifest_is_corruption(ckpt):
    path = ckpt / "cairn.manifest"
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(cairn.CorruptionError):
        cairn.Reader(ckpt)


def envelope(body: dict, version: int = 1) -> bytes:
    """A manifest with a *valid* envelope around `body`, so only the body's
    validation stands between a hostile body and the reader."""
    data = json.dumps(body).encode()
    head = b"CAIRNMF\n" + struct.pack("<IIQ", version, 0, len(data)) + data
    return head + struct.pack("<Q", _xxh3(head))


def _xxh3(data: bytes) -> int:
    # The extension exposes no hash function on purpose; compute XXH3-64 via
    # the C library through ctypes (libxxhash is a build dependency).
    import ctypes
    import ctypes.util

    lib = ctypes.CDLL(ctypes.util.find_library("xxhash") or "libxxhash.so.0")
    lib.XXH3_64bits.restype = ctypes.c_uint64
    lib.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return lib.XXH3_64bits(data, len(data))


def test_envelope_helper_reproduces_a_real_manifest(ckpt):
    raw = (ckpt / "cairn.manifest").read_bytes()
    (body_len,) = struct.unpack("<Q", raw[16:24])
    body = raw[24 : 24 + body_len]
    head = raw[: 24 + body_len]
    assert struct.unpack("<Q", raw[-8:])[0] == _xxh3(head)
    assert json.loads(body) == manifest_body(ckpt)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda b: b["files"][0].update(key="../../escape.bin"), "'..'"),
        (lambda b: b["files"][0].update(key="/etc/passwd"), "absolute"),
        (lambda b: b["tensors"][0]["chunks"][0].update(offset=1 << 40), "outside"),
        (lambda b: b["tensors"][0]["chunks"][0].update(length=2**64 - 1), "does not match"),
        (lambda b: b["tensors"][0].update(shape=[1, 64]), "outside the tensor"),
        (lambda b: b["tensors"][0].update(shape=[2**40, 2**40]), "overflows"),
        (lambda b: b["tensors"][0].update(dtype="object"), "unknown dtype"),
        (lambda b: b.update(tensors={"x": 1}), "not an array"),
        (lambda b: b["files"][0].update(size=-5), "non-negative"),
    ],
)
def test_hostile_manifest_gives_a_clear_error(ckpt, edit, message):
    body = manifest_body(ckpt)
    edit(body)
    (ckpt / "cairn.manifest").write_bytes(envelope(body))
    with pytest.raises(cairn.CorruptionError, match=message):
        cairn.Reader(ckpt)
    with pytest.raises(cairn.CorruptionError):
        cairn.verify(ckpt)
    # Nothing was created outside the checkpoint.
    assert not (ckpt.parent / "escape.bin").exists()


def test_unknown_version_is_a_clear_error(ckpt):
    body = manifest_body(ckpt)
    body["format_version"] = 99
    (ckpt / "cairn.manifest").write_bytes(envelope(body, version=99))
    with pytest.raises(cairn.Error, match="unsupported checkpoint format version 99"):
        cairn.Reader(ckpt)


def test_corrupt_newest_checkpoint_is_skipped_by_latest_valid(tmp_path):
    for step in (1, 2):
        dcp.save({"a": torch.ones(3)}, storage_writer=cairn.Writer(tmp_path / f"step_{step}"))
    (tmp_path / "step_2" / "cairn.manifest").write_bytes(b"garbage")
    assert cairn.latest_valid(tmp_path) == f"{tmp_path}/step_1"


def test_errors_survive_pickling_between_ranks(ckpt):
    # DCP gathers a failing rank's exception to every rank by pickling it.
    import pickle

    flip(ckpt / "data" / "r0.bin", item_offset(ckpt, "model.w"))
    with pytest.raises(cairn.CorruptionError) as info:
        cairn.verify(ckpt)
    again = pickle.loads(pickle.dumps(info.value))
    assert isinstance(again, cairn.CorruptionError) and str(again) == str(info.value)


def test_copy_checkpoint_refuses_a_corrupt_source(ckpt, tmp_path):
    cairn.copy_checkpoint(ckpt, tmp_path / "copy", verify_destination=True)
    cairn.verify(tmp_path / "copy")
    flip(ckpt / "data" / "r0.bin", item_offset(ckpt, "model.b"))
    with pytest.raises(cairn.CorruptionError, match="tensor 'model.b'"):
        cairn.copy_checkpoint(ckpt, tmp_path / "copy2")
    assert not (tmp_path / "copy2" / "cairn.manifest").exists()


def test_hostile_non_tensor_value_is_refused_without_running(tmp_path):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(3), "evil": Hostile(marker)}, storage_writer=cairn.Writer(path))
    assert not marker.exists()
    target = {"w": torch.zeros(3), "evil": None}
    with pytest.raises(BaseException) as info:
        dcp.load(target, storage_reader=cairn.Reader(path))
    err = cairn.dcp.unwrap(info.value)
    assert isinstance(err, cairn.CorruptionError), err
    assert "evil" in str(err) and "allow_pickle" in str(err)
    assert not marker.exists()


def test_plain_non_tensor_values_still_load(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    values = {"step": 7, "name": "run", "betas": (0.9, 0.999), "flag": True, "none": None}
    dcp.save(dict(values), storage_writer=cairn.Writer(path))
    target = {k: None for k in values}
    dcp.load(target, storage_reader=cairn.Reader(path))
    assert target == values
