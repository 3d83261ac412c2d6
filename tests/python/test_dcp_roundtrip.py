"""Single-process round trips of dcp.save/dcp.load through cairn.Writer/Reader."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import cairn
import cairn.dcp as cdcp
from cairn import _dcp_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def make_state() -> dict:
    torch.manual_seed(0)
    return {
        "model": {
            "w": torch.randn(64, 33),
            "bias": torch.randn(33, dtype=torch.float64),
            "emb": torch.randn(10, 8).to(torch.bfloat16),
            "half": torch.randn(7).half(),
            "mask": torch.rand(17) > 0.5,
            "q": torch.randint(-128, 127, (50,), dtype=torch.int8),
            "u": torch.randint(0, 255, (9,), dtype=torch.uint8),
            "idx": torch.arange(12, dtype=torch.int64).reshape(3, 4),
            "c": torch.randn(3, dtype=torch.complex64),
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 4),
            "noncontig": torch.randn(6, 5).t(),
        },
        "layers": [torch.ones(2), torch.zeros(3, dtype=torch.int32)],
        "step": 1234,
        "lr": 0.125,
        "name": "run-α",
        "blob": b"\x00\xffbytes",
        "nested": {"a": {"b": [1, 2, {"c": "d"}]}},
    }


def zeros_like_state(sd):
    if isinstance(sd, dict):
        return {k: zeros_like_state(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like_state(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd.contiguous())
    if isinstance(sd, (int, float)):
        return type(sd)(0)
    if isinstance(sd, str):
        return ""
    if isinstance(sd, bytes):
        return b""
    return None


def assert_same(a, b, path="sd"):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    else:
        assert a == b, path


def test_round_trip_many_dtypes_and_values(tmp_path):
    sd = make_state()
    path = tmp_path / "step_1"
    dcp.save(sd, storage_writer=cairn.Writer(path))
    assert (path / "cairn.manifest").exists()
    assert sorted(os.listdir(path / "data")) == ["r0.bin"]
    out = zeros_like_state(sd)
    dcp.load(out, storage_reader=cairn.Reader(path))
    assert_same(sd, out)
    cairn.verify(path)


def test_checkpoint_id_and_reuse_of_writer_and_reader(tmp_path):
    sd = {"a": torch.arange(10.0), "n": 1}
    writer, reader = cairn.Writer(), cairn.Reader()
    for step in (1, 2):
        sd["a"] += 1
        sd["n"] = step
        dcp.save(sd, checkpoint_id=tmp_path / f"step_{step}", storage_writer=writer)
    for step in (1, 2):
        out = {"a": torch.zeros(10), "n": 0}
        dcp.load(out, checkpoint_id=tmp_path / f"step_{step}", storage_reader=reader)
        assert out["n"] == step
        assert torch.equal(out["a"], torch.arange(10.0) + step)
    reader.close()  # releases the files; the next use reopens
    out = {"a": torch.zeros(10), "n": 0}
    dcp.load(out, storage_reader=reader)
    assert out["n"] == 2
    assert cairn.latest_valid(tmp_path) == f"{tmp_path}/step_2"


def test_file_uri_and_shm_uri(tmp_path):
    sd = {"x": torch.randn(100)}
    dcp.save(sd, storage_writer=cairn.Writer(f"file://{tmp_path}/a"))
    out = {"x": torch.zeros(100)}
    dcp.load(out, storage_reader=cairn.Reader(f"file://{tmp_path}/a"))
    assert torch.equal(out["x"], sd["x"])

    name = f"cairn-test-{os.getpid()}"
    try:
        dcp.save(sd, storage_writer=cairn.Writer(f"shm://{name}/step_3", sync=False))
        out = {"x": torch.zeros(100)}
        dcp.load(out, storage_reader=cairn.Reader(f"shm://{name}/step_3"))
        assert torch.equal(out["x"], sd["x"])
        assert cairn.latest_valid(f"shm://{name}") == f"shm://{name}/step_3"
        cairn.verify(f"shm://{name}/step_3")
    finally:
        import shutil

        shutil.rmtree(f"/dev/shm/{name}", ignore_errors=True)


def test_loading_into_other_dtype_and_views(tmp_path):
    sd = {"w": torch.randn(8, 6)}
    dcp.save(sd, storage_writer=cairn.Writer(tmp_path / "c"))
    # A non-contiguous destination and a float64 destination both work (the
    # bytes go through a scratch buffer, then copy_).
    base = torch.zeros(6, 8)
    out = {"w": base.t()}
    dcp.load(out, storage_reader=cairn.Reader(tmp_path / "c"))
    assert torch.equal(base.t(), sd["w"])
    out = {"w": torch.zeros(8, 6, dtype=torch.float64)}
    dcp.load(out, storage_reader=cairn.Reader(tmp_path / "c"))
    assert torch.equal(out["w"], sd["w"].double())


def test_user_metadata_round_trips(tmp_path):
    meta = {"step": 12, "tiers": ["memory", "disk"], "loss": 0.5}
    dcp.save({"a": torch.ones(3)}, storage_writer=cairn.Writer(tmp_path / "c", user_metadata=meta))
    assert cairn.Reader(tmp_path / "c").user_metadata == meta
    with pytest.raises(TypeError):
        cairn.Writer(tmp_path / "d", user_metadata={"x": object()})


def test_overwriting_a_checkpoint_in_place(tmp_path):
    path = tmp_path / "c"
    dcp.save({"a": torch.ones(1000)}, storage_writer=cairn.Writer(path))
    # A leftover file from an older, wider save is removed by the next save.
    (path / "data" / "r7.bin").write_bytes(b"stale")
    dcp.save({"a": torch.full((1000,), 2.0)}, storage_writer=cairn.Writer(path))
    out = {"a": torch.zeros(1000)}
    dcp.load(out, storage_reader=cairn.Reader(path))
    assert torch.equal(out["a"], torch.full((1000,), 2.0))
    assert not (path / "data" / "r7.bin").exists()
    cairn.verify(path)


def rank_error(exc: BaseException) -> BaseException:
    """The exception a rank raised inside a DCP collective step (DCP wraps
    those in a CheckpointException) or `exc` itself."""
    if isinstance(exc, CheckpointException):
        return next(iter(exc.failures.values()))[0]
    return exc


def test_writer_without_path_is_a_value_error():
    with pytest.raises(BaseException) as info:
        dcp.save({"a": torch.ones(1)}, storage_writer=cairn.Writer())
    assert isinstance(rank_error(info.value), ValueError)


def test_missing_checkpoint_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        cairn.Reader(tmp_path / "nope")
    with pytest.raises(cairn.NotFoundError):
        dcp.load(
            {"a": torch.zeros(1)}, checkpoint_id=tmp_path / "nope", storage_reader=cairn.Reader()
        )
    # A directory with data but no manifest is a partial checkpoint.
    (tmp_path / "partial" / "data").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="partial"):
        cairn.Reader(tmp_path / "partial")
    with pytest.raises(FileNotFoundError):
        cairn.verify(tmp_path / "nope")
    with pytest.raises(cairn.CorruptionError, match="partial"):
        cairn.verify(tmp_path / "partial")


def test_manifest_is_not_pickle_and_documents_the_state(tmp_path):
    sd = make_state()
    dcp.save(sd, storage_writer=cairn.Writer(tmp_path / "c"))
    raw = (tmp_path / "c" / "cairn.manifest").read_bytes()
    assert raw[:8] == b"CAIRNMF\n"
    version, flags, body_len = struct.unpack("<IIQ", raw[8:24])
    assert (version, flags) == (1, 0)
    body = json.loads(raw[24 : 24 + body_len])
    names = {t["fqn"]: t for t in body["tensors"]}
    assert names["model.emb"]["dtype"] == "bfloat16"
    assert names["model.w"]["shape"] == [64, 33]
    assert {b["fqn"] for b in body["bytes"]} >= {"step", "name", "blob"}
    for t in body["tensors"]:
        for c in t["chunks"]:
            assert c["offset"] % 4096 == 0


def test_latest_valid_and_list(tmp_path):
    assert cairn.latest_valid(tmp_path) is None
    for step in (5, 40, 300):
        writer = cairn.Writer(tmp_path / f"step_{step}")
        dcp.save({"a": torch.ones(4) * step}, storage_writer=writer)
    os.remove(tmp_path / "step_300" / "cairn.manifest")
    assert cairn.latest_valid(tmp_path) == f"{tmp_path}/step_40"
    listing = cairn.list_checkpoints(tmp_path)
    assert [(c["name"], c["committed"]) for c in listing] == [
        ("step_5", True),
        ("step_40", True),
        ("step_300", False),
    ]
    # The first run of a job has no checkpoint root yet: nothing to resume.
    assert cairn.latest_valid(tmp_path / "missing") is None
    with pytest.raises(FileNotFoundError):
        cairn.list_checkpoints(tmp_path / "missing")


def test_stock_checkpoints_are_delegated(tmp_path):
    # A directory written by stock dcp.save: cairn.Reader hands it to
    # cairn._stock_reader.StockReader, end to end.
    sd = {"w": torch.randn(5, 5), "n": 7}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "stock"))
    out = {"w": torch.zeros(5, 5), "n": 0}
    dcp.load(out, storage_reader=cairn.Reader(tmp_path / "stock"))
    assert torch.equal(out["w"], sd["w"]) and out["n"] == 7
    out = {"w": torch.zeros(5, 5), "n": 0}
    dcp.load(out, checkpoint_id=tmp_path / "stock", storage_reader=cairn.Reader())
    assert out["n"] == 7


def test_planner_data_round_trips_with_types():
    value = {"a.b": ("a", "b"), "l.0": ("l", 0), "x": [1, (2, 3)], 5: None}
    encoded = _dcp_metadata._encode(value)
    json.dumps(encoded)
    assert _dcp_metadata._decode(json.loads(json.dumps(encoded))) == value
    with pytest.raises(ValueError):
        _dcp_metadata._encode({"a": object()})


def test_byte_range_of_read_regions():
    # Whole chunk, whole rows, a row fragment, and a column block (not contiguous).
    assert cdcp._byte_range((0, 0), (4, 5), (4, 5), 4) == (0, 80)
    assert cdcp._byte_range((1, 0), (2, 5), (4, 5), 4) == (20, 40)
    assert cdcp._byte_range((2, 1), (1, 3), (4, 5), 2) == (22, 6)
    assert cdcp._byte_range((0, 1), (4, 2), (4, 5), 4) is None
    assert cdcp._byte_range((1, 0, 0), (1, 1, 3), (2, 2, 3), 1) == (6, 3)
    assert cdcp._byte_range((0, 0), (0, 5), (4, 5), 4) == (0, 0)
    assert cdcp._byte_range((), (), (), 8) == (0, 8)
    with pytest.raises(ValueError):
        cdcp._byte_range((3, 0), (2, 5), (4, 5), 4)


def test_uncoordinated_save_is_refused(tmp_path):
    with pytest.raises(ValueError, match="use_collectives"):
        dcp.save(
            {"a": torch.ones(2)},
            storage_writer=cairn.Writer(tmp_path / "c"),
            use_collectives=False,
        )
    assert cairn.latest_valid(tmp_path) is None


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_unstorable_dtype_is_refused_before_writing(tmp_path):
    # Quantized tensors are among the few that DCP plans but cairn cannot store.
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(BaseException) as info:
        dcp.save({"q": q}, storage_writer=cairn.Writer(tmp_path / "c"))
    err = rank_error(info.value)
    assert isinstance(err, ValueError) and "qint8" in str(err), err
    assert cairn.latest_valid(tmp_path) is None


def test_a_writer_opens_its_target_once_per_save_and_follows_its_path(tmp_path):
    # One Writer, several saves: each opens the target afresh, so a directory
    # removed between two saves is made again (a kept one would be gone).
    w = cairn.Writer(tmp_path / "ck")
    for value in (1.0, 2.0):
        dcp.save({"w": torch.full((8,), value)}, storage_writer=w)
        shutil.rmtree(tmp_path / "ck")
    dcp.save({"w": torch.full((8,), 3.0)}, storage_writer=w)
    out = {"w": torch.zeros(8)}
    dcp.load(out, storage_reader=cairn.Reader(tmp_path / "ck"))
    assert torch.equal(out["w"], torch.full((8,), 3.0))
    # A Writer over a path pickles (a process-based async save); one over an open
    # Storage cannot cross a process and says so.
    assert pickle.loads(pickle.dumps(w)).path == w.path
    with pytest.raises(cairn.InvalidArgumentError, match="cannot be pickled"):
        pickle.dumps(cairn.Writer(cairn._ext.open_storage(str(tmp_path / "other"))))
