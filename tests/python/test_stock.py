"""cairn reads checkpoints written by stock ``dcp.save`` (filesystem writer)
without unsafe unpickling, and refuses hostile or damaged ones."""

from __future__ import annotations

import collections
import io
import os
import random
import pickle
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import cairn
import ckpt_backend
import dcp_states
from cairn._stock_reader import StockReader, _decode_tensor, is_stock_checkpoint, read_stock_metadata
from gloo_harness import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SENTINEL_NAME = "pwned"


def test_stock_checkpoint_saved_on_2_ranks_loads_on_1_and_3_ranks(tmp_path):
    path = str(tmp_path / "stock")
    run_ranks(2, dcp_states.save_worker, "stock", path)
    assert is_stock_checkpoint(path)
    run_ranks(1, dcp_states.load_worker, "stock", path, 2)
    run_ranks(3, dcp_states.load_worker, "stock", path, 2)
    dcp_states.load_full_single_process("stock", path, 2)


def _save_rank_local(rank, world, path):
    sd = {"w": torch.full((4,), float(rank)), "step": rank}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path), use_collectives=False)


def _load_rank_local(rank, world, path):
    sd = {"w": torch.zeros(4), "step": -1}
    dcp.load(sd, storage_reader=ckpt_backend.reader("stock", path))
    assert torch.equal(sd["w"], torch.full((4,), float(rank))) and sd["step"] == rank


def test_stock_checkpoint_with_rank_local_metadata_loads(tmp_path):
    """dcp.save(use_collectives=False) writes __<rank>.metadata per rank."""
    path = str(tmp_path / "stock")
    run_ranks(2, _save_rank_local, path)
    assert not os.path.exists(os.path.join(path, ".metadata"))
    assert is_stock_checkpoint(path)
    run_ranks(2, _load_rank_local, path)


# --- single-process fixtures ----------------------------------------------------


class Custom:
    """A value that only unrestricted unpickling can rebuild."""

    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Custom) and other.x == self.x


def _state():
    return {
        "w": torch.arange(1000, dtype=torch.float32) * 1.5,
        "b": torch.ones(3, 4, dtype=torch.bfloat16),
        "step": 3,
    }


def _blank():
    return {"w": torch.zeros(1000), "b": torch.zeros(3, 4, dtype=torch.bfloat16), "step": 0}


@pytest.fixture
def stock(tmp_path):
    path = tmp_path / "stock"
    dcp.save(_state(), checkpoint_id=str(path))
    return path


def _dcp_load(sd, reader):
    """dcp.load, re-raising the reader's own error instead of DCP's wrapper."""
    try:
        dcp.load(sd, storage_reader=reader)
    except CheckpointException as e:
        (exc, _), *_ = e.failures.values()
        raise exc from None


def _load(path, **kwargs):
    sd = _blank()
    _dcp_load(sd, StockReader(str(path), **kwargs))
    return sd


def _rewrite_metadata(path, edit):
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own, trusted test file
    edit(md)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _data_file(path):
    (f,) = [p for p in path.iterdir() if p.suffix == ".distcp"]
    return f


def test_loads_single_process_checkpoint_exactly(stock):
    sd = _load(stock)
    want = _state()
    assert torch.equal(sd["w"], want["w"]) and torch.equal(sd["b"], want["b"])
    assert sd["step"] == 3


def test_is_stock_checkpoint(stock, tmp_path):
    assert is_stock_checkpoint(stock)
    assert is_stock_checkpoint(f"file://{stock}")
    assert not is_stock_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert not is_stock_checkpoint(tmp_path / "empty")
    assert not is_stock_checkpoint(_data_file(stock))


def test_metadata_decodes_to_what_trusted_unpickling_gives(tmp_path):
    """The engine's restricted decoder yields the same DCP Metadata as
    pickle.load of our own (trusted) checkpoint, across dtypes, shapes,
    nested keys, lists and non-tensor values, for pickle protocols 2 to 5."""
    path = tmp_path / "stock"
    sd = {**_state(), "nested": {"x": torch.ones(2, 3, dtype=torch.float16).t(),
                                 "l": [torch.zeros(0, 2), torch.tensor(7, dtype=torch.int8)]},
          "blob": io.BytesIO(b"raw")}
    dcp.save(sd, checkpoint_id=str(path))
    want = pickle.loads((path / ".metadata").read_bytes())  # trusted: we wrote it
    for protocol in (2, 3, 4, 5):
        (path / ".metadata").write_bytes(pickle.dumps(want, protocol=protocol))
        got = read_stock_metadata(path)
        assert got.state_dict_metadata == want.state_dict_metadata
        assert got.planner_data == want.planner_data
        assert got.storage_data == want.storage_data
        assert [(k.fqn, k.offset, k.index) for k in got.storage_data] == [
            (k.fqn, k.offset, k.index) for k in want.storage_data]
        assert got.version == want.version
        for field in ("checkpoint_id", "save_id", "modules"):
            have = getattr(got.storage_meta, field)
            expected = getattr(want.storage_meta, field)
            assert have == (str(expected) if field == "checkpoint_id" else expected)


def test_missing_metadata_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_stock_metadata(tmp_path)


# --- hostile metadata -------------------------------------------------------------


class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize(
    "fn_name", ["os.system", "builtins.eval", "builtins.exec", "torch.load", "subprocess.call"]
)
def test_hostile_metadata_pickle_is_refused_without_executing(stock, fn_name):
    sentinel = stock.parent / SENTINEL_NAME
    payload = {
        "os.system": (os.system, (f"touch {sentinel}",)),
        "builtins.eval": (eval, (f"open({str(sentinel)!r}, 'w')",)),
        "builtins.exec": (exec, (f"open({str(sentinel)!r}, 'w')",)),
        "torch.load": (torch.load, (str(sentinel),)),
        "subprocess.call": (subprocess.call, (["touch", str(sentinel)],)),
    }[fn_name]
    with open(stock / ".metadata", "wb") as f:
        pickle.dump({"state_dict_metadata": _Reduce(*payload)}, f)
    with pytest.raises(cairn.CorruptionError, match="refusing to unpickle"):
        read_stock_metadata(stock)
    with pytest.raises(Exception, match="refusing to unpickle"):
        _load(stock)
    assert not sentinel.exists()


def test_metadata_that_is_not_a_pickle_is_corruption(stock):
    (stock / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(cairn.CorruptionError, match=".metadata"):
        read_stock_metadata(stock)


def test_wrong_root_object_is_corruption(stock):
    with open(stock / ".metadata", "wb") as f:
        pickle.dump({"a": [1, 2, 3]}, f)
    with pytest.raises(cairn.CorruptionError, match="not a Metadata"):
        read_stock_metadata(stock)


@pytest.mark.parametrize("name", ["../outside.distcp", "/etc/passwd", "a/b.distcp", ""])
def test_data_file_outside_the_directory_is_refused(stock, name):
    def edit(md):
        for info in md.storage_data.values():
            info.relative_path = name

    _rewrite_metadata(stock, edit)
    with pytest.raises(cairn.CorruptionError, match="plain file name"):
        read_stock_metadata(stock)


def test_chunk_outside_its_tensor_is_refused(stock):
    def edit(md):
        md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([2000])

    _rewrite_metadata(stock, edit)
    with pytest.raises(cairn.CorruptionError, match="outside the tensor"):
        read_stock_metadata(stock)


def test_absurd_offset_is_corruption_not_a_huge_read(stock):
    def edit(md):
        for idx, info in md.storage_data.items():
            if idx.fqn == "w":
                info.offset = 1 << 60

    _rewrite_metadata(stock, edit)
    with pytest.raises(cairn.CorruptionError, match="'w'.*truncated"):
        _load(stock)


def test_randomly_damaged_metadata_never_escapes_as_another_error(stock):
    """Bit flips and truncations of .metadata: success or a cairn error, never
    another exception type (and never code execution: no global is resolvable)."""
    raw = (stock / ".metadata").read_bytes()
    rng = random.Random(1234)
    outcomes = collections.Counter()
    for trial in range(300):
        damaged = bytearray(raw)
        if trial % 3 == 0:
            damaged = damaged[: rng.randrange(len(damaged))]
        else:
            for _ in range(rng.randint(1, 4)):
                damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
        (stock / ".metadata").write_bytes(bytes(damaged))
        try:
            read_stock_metadata(stock)
            outcomes["ok"] += 1
        except (cairn.CorruptionError, cairn.InvalidArgumentError) as e:
            outcomes[type(e).__name__] += 1
    assert outcomes["CorruptionError"] > 100, outcomes


# --- damaged data -----------------------------------------------------------------


def test_truncated_data_file_names_file_and_tensor(stock):
    f = _data_file(stock)
    os.truncate(f, f.stat().st_size // 2)
    with pytest.raises(cairn.CorruptionError) as e:
        _load(stock)
    assert "truncated" in str(e.value) and f.name in str(e.value)


def test_deleted_data_file_names_file_and_tensor(stock):
    f = _data_file(stock)
    f.unlink()
    with pytest.raises(cairn.CorruptionError) as e:
        _load(stock)
    assert "missing" in str(e.value) and f.name in str(e.value)


def test_flipped_byte_in_tensor_data_is_detected(stock):
    f = _data_file(stock)
    raw = bytearray(f.read_bytes())
    at = raw.find(_state()["w"].numpy().tobytes()) + 2001
    assert at > 2001
    raw[at] ^= 0x40
    f.write_bytes(bytes(raw))
    with pytest.raises(cairn.CorruptionError) as e:
        _load(stock)
    assert "checksum mismatch" in str(e.value) and "'w'" in str(e.value)
    # Without CRC checking the corruption would be silent.
    assert not torch.equal(_load(stock, verify_crc=False)["w"], _state()["w"])


def test_symlinked_data_file_is_refused(stock, tmp_path):
    f = _data_file(stock)
    target = tmp_path / "elsewhere.distcp"
    f.rename(target)
    f.symlink_to(target)
    with pytest.raises(cairn.CorruptionError, match="cannot open data file"):
        _load(stock)


def test_value_needing_unsafe_unpickling_is_refused_unless_allowed(tmp_path):
    path = tmp_path / "stock"
    dcp.save({"obj": Custom(7), "w": torch.ones(2)}, checkpoint_id=str(path))
    sd = {"obj": None, "w": torch.zeros(2)}
    with pytest.raises(cairn.CorruptionError, match="allow_pickle"):
        _dcp_load(sd, StockReader(str(path)))
    _dcp_load(sd, StockReader(str(path), allow_pickle=True))
    assert sd["obj"] == Custom(7)


def test_cairn_reader_loads_a_stock_checkpoint(stock):
    sd = _blank()
    _dcp_load(sd, ckpt_backend.reader("stock", str(stock)))
    assert torch.equal(sd["w"], _state()["w"]) and sd["step"] == 3


def test_cairn_reader_refuses_a_hostile_stock_checkpoint(stock):
    sentinel = stock.parent / SENTINEL_NAME
    with open(stock / ".metadata", "wb") as f:
        pickle.dump(_Reduce(os.system, (f"touch {sentinel}",)), f)
    with pytest.raises(Exception, match="refusing to unpickle"):
        _dcp_load(_blank(), cairn.Reader(str(stock)))
    assert not sentinel.exists()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.arange(20, dtype=torch.float64).reshape(4, 5).t(),  # strided view kept
        torch.zeros(0, 3),
        torch.tensor(2.5),
        torch.tensor([True, False, True]),
        torch.ones(2, 3, dtype=torch.bfloat16),
        torch.arange(6, dtype=torch.int64).reshape(2, 3)[:, 1:].clone(),
        torch.ones(4, dtype=torch.float8_e4m3fn),  # no legacy storage class: torch.load path
    ],
    ids=["f32", "transposed", "empty", "scalar", "bool", "bf16", "slice", "float8"],
)
def test_decoded_item_equals_the_saved_tensor(tensor):
    buf = io.BytesIO()
    torch.save(tensor, buf)
    got = _decode_tensor(bytearray(buf.getvalue()), "item", verify_crc=True)
    assert got.dtype == tensor.dtype and got.shape == tensor.shape
    assert got.stride() == tensor.stride() or tensor.numel() == 0
    assert torch.equal(got.float(), tensor.float())


def test_item_whose_view_exceeds_its_storage_is_corruption():
    buf = io.BytesIO()
    torch.save(torch.arange(6.0), buf)
    raw = bytearray(buf.getvalue())
    # data.pkl stores the size as BININT1 6 right after the storage offset 0.
    at = raw.find(b"K\x00K\x06\x85")
    assert at > 0
    raw[at + 3] = 9  # claim 9 elements of a 6-element storage
    with pytest.raises(cairn.CorruptionError, match="exceeds its storage"):
        _decode_tensor(raw, "item", verify_crc=False)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_randomly_damaged_items_decode_or_raise_corruption():
    """Damage inside data.pkl (CRC check off, so it reaches the decoder): a
    tensor whose view stays inside its storage, or CorruptionError."""
    buf = io.BytesIO()
    torch.save(torch.arange(24, dtype=torch.float32).reshape(4, 6).t(), buf)
    raw = buf.getvalue()
    start = raw.find(b"\x80\x02")  # data.pkl is the first entry
    end = raw.find(b"PK", start)
    rng = random.Random(99)
    outcomes = collections.Counter()
    for _ in range(300):
        damaged = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(start, end)] = rng.randrange(256)
        try:
            t = _decode_tensor(damaged, "item", verify_crc=False)
            t.sum()  # touches every element: must stay inside the buffer
            outcomes["ok"] += 1
        except cairn.CorruptionError:
            outcomes["corrupt"] += 1
    assert outcomes["corrupt"] > 50, outcomes


def test_check_value_is_safe_accepts_plain_values_and_refuses_code():
    from cairn._stock_reader import check_value_is_safe

    for value in (3, 0.5, "s", [1, 2], {"a": (1, 2)}, torch.ones(2), None):
        buf = io.BytesIO()
        torch.save(value, buf)
        check_value_is_safe(buf.getvalue(), "item")
    buf = io.BytesIO()
    torch.save(_Reduce(os.system, ("true",)), buf)
    with pytest.raises(cairn.CorruptionError, match="allow_pickle"):
        check_value_is_safe(buf.getvalue(), "item")


def test_engine_fills_strided_and_other_dtype_destinations_exactly(tmp_path):
    """The C++ engine writes through a destination's strides; a destination
    of another dtype takes the torch.load path and is converted by copy_."""
    path = tmp_path / "stock"
    src = {"t": torch.arange(24, dtype=torch.float32).reshape(4, 6),
           "d": torch.arange(6, dtype=torch.float32)}
    dcp.save(src, checkpoint_id=str(path))
    base = torch.zeros(6, 4)
    sd = {"t": base.t(), "d": torch.zeros(6, dtype=torch.float64)}  # t: a strided view
    _dcp_load(sd, StockReader(str(path)))
    assert torch.equal(base.t(), src["t"])
    assert sd["d"].dtype == torch.float64 and torch.equal(sd["d"], src["d"].double())
