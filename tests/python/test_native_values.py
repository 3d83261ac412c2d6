"""Non-tensor values made of plain types and NumPy arrays (the seed's RNG dict) are
stored natively, never as pickles, and load without allow_pickle."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import cairn
from cairn.dcp import VALUE_MAGIC, decode_value, encode_value

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def rng_dict() -> dict:
    d = {"python": random.getstate(), "numpy": np.random.get_state(),
         "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        d["cuda"] = torch.cuda.get_rng_state_all()
    return d


def assert_same_rng(a: dict, b: dict) -> None:
    assert a["python"] == b["python"] and type(b["python"]) is tuple
    na, nb = a["numpy"], b["numpy"]
    assert type(nb) is tuple and na[0] == nb[0] and na[2:] == nb[2:]
    assert nb[1].dtype == na[1].dtype and np.array_equal(na[1], nb[1])
    assert torch.equal(a["torch"], b["torch"])


def test_seed_rng_dict_round_trips_through_writer_and_reader(tmp_path):
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    saved = rng_dict()
    dcp.save({"rng": saved, "step": 9}, storage_writer=cairn.Writer(tmp_path / "ck"))
    data = (tmp_path / "ck" / "data" / "r0.bin").read_bytes()
    assert VALUE_MAGIC in data  # stored natively
    random.seed(0)
    np.random.seed(0)
    out = {"rng": {"python": None, "numpy": None, "torch": torch.zeros_like(saved["torch"])},
           "step": 0}
    dcp.load(out, storage_reader=cairn.Reader(tmp_path / "ck"))  # allow_pickle=False
    assert out["step"] == 9
    assert_same_rng(saved, out["rng"])
    random.setstate(out["rng"]["python"])
    np.random.set_state(out["rng"]["numpy"])
    assert random.random() == (random.seed(3), random.random())[1]


def test_manager_restores_the_rng_dict(tmp_path):
    np.random.seed(11)
    saved = rng_dict()
    with cairn.CheckpointManager(tmp_path / "root", memory=True) as mgr:
        mgr.save(1, {"rng": saved})
        mgr.wait()
        out = {"rng": {"python": None, "numpy": None, "torch": torch.zeros_like(saved["torch"])}}
        assert mgr.restore(out) == 1 and mgr.restored == (1, "memory")
    assert_same_rng(saved, out["rng"])


@pytest.mark.parametrize("value", [
    (1, 2.5, "x", None, True), {"a": [1, (2, 3)], 4: b"\x00\xff"},
    np.arange(6, dtype=np.uint32).reshape(2, 3), np.float64(1.5), float("nan"),
    [np.zeros((0, 3), dtype=np.int8)],
])
def test_native_encoding_round_trips(value):
    data = encode_value(value)
    assert data is not None and data.startswith(VALUE_MAGIC)
    back = decode_value(data, "v")
    if isinstance(value, float) and value != value:
        assert back != back
    elif isinstance(value, list):
        assert back[0].shape == (0, 3) and back[0].dtype == np.int8
    elif isinstance(value, np.ndarray):
        assert back.dtype == value.dtype and np.array_equal(back, value)
    else:
        assert back == value and type(back) is type(value)


def test_values_outside_the_encoding_keep_pickle_bytes():
    assert encode_value(np.array([object()], dtype=object)) is None
    assert encode_value({1, 2}) is None


@pytest.mark.parametrize("body", [b"{", b'{"__ndarray__":{"dtype":"<u4","shape":[5],"data":"AA=="}}',
                                  b'{"__ndarray__":{"dtype":"|O","shape":[0],"data":""}}',
                                  b'{"__nope__":1}', b"[" * 100000])
def test_malformed_native_value_is_corruption(body):
    with pytest.raises(cairn.CorruptionError):
        decode_value(VALUE_MAGIC + body, "v")
