"""cairn.Writer/cairn.Reader as drop-ins for DCP's FileSystemWriter/FileSystemReader:
the values DCP itself produces round-trip, and FileSystemWriter's arguments mean
what they mean there (or are refused with a clear error)."""

from __future__ import annotations

import inspect
import io
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import lr_scheduler

import cairn
from cairn.errors import PreconditionError
from gloo_harness import run_ranks
from hostile import Hostile

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _load(sd, path, **kwargs):
    try:
        dcp.load(sd, storage_reader=cairn.Reader(path, **kwargs))
    except BaseException as e:  # DCP wraps a rank's error in CheckpointException
        raise cairn.dcp.unwrap(e) from e


def _save(sd, writer):
    try:
        dcp.save(sd, storage_writer=writer)
    except BaseException as e:
        raise cairn.dcp.unwrap(e) from e


# ---- values DCP produces ------------------------------------------------------


def _blob(seed: int, n: int = 10_000) -> bytes:
    return bytes((seed * 7 + i * 31) % 256 for i in range(n))


def test_bytesio_value_round_trips_with_default_planners(tmp_path):
    path = str(tmp_path / "ckpt")
    buf = io.BytesIO(_blob(1))
    buf.seek(123)
    dcp.save({"w": torch.ones(3), "blob": buf}, storage_writer=cairn.Writer(path))
    target = {"w": torch.zeros(3), "blob": io.BytesIO()}
    _load(target, path)
    assert isinstance(target["blob"], io.BytesIO)
    assert target["blob"].getvalue() == _blob(1) and target["blob"].tell() == 123
    assert torch.equal(target["w"], torch.ones(3))


def test_bytesio_value_of_a_stock_checkpoint_loads_through_cairn_reader(tmp_path):
    path = str(tmp_path / "stock")
    dcp.save({"blob": io.BytesIO(_blob(2))}, storage_writer=dcp.FileSystemWriter(path))
    target = {"blob": io.BytesIO()}
    _load(target, path)
    assert target["blob"].getvalue() == _blob(2)


def _optimizer_and_schedulers():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.99), weight_decay=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    scheds = {
        "lambda": lr_scheduler.LambdaLR(opt, lambda e: 0.9**e),
        "onecycle": lr_scheduler.OneCycleLR(opt, 0.1, total_steps=10),
        "plateau": lr_scheduler.ReduceLROnPlateau(opt),
        "seq": lr_scheduler.SequentialLR(
            opt, [lr_scheduler.ConstantLR(opt), lr_scheduler.ExponentialLR(opt, 0.9)], [2]
        ),
        "cyclic": lr_scheduler.CyclicLR(opt, 0.01, 0.1),
    }
    return opt, scheds


def _blank(value):
    """The same structure (dicts, and lists holding dicts, as DCP flattens them)
    with None for every value DCP stores as one item."""
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return [_blank(v) for v in value]
    return None


def test_optimizer_param_groups_scheduler_state_and_plain_values_round_trip(tmp_path):
    path = str(tmp_path / "ckpt")
    opt, scheds = _optimizer_and_schedulers()
    plain = {
        "step": 7,
        "name": "run",
        "ratio": 0.25,
        "inf": float("inf"),
        "flags": {True, False},
        "frozen": frozenset({1, 2}),
        "window": range(3, 9, 2),
        "cut": slice(1, None, 2),
        "raw": b"\x00\xff",
        "nested": {"a": [1, (2, 3)], "b": None},
    }
    saved = {
        "param_groups": opt.state_dict()["param_groups"],
        "sched": {k: s.state_dict() for k, s in scheds.items()},
        "plain": plain,
    }
    dcp.save(saved, storage_writer=cairn.Writer(path))
    target = _blank(saved)
    _load(target, path)
    assert target["param_groups"] == saved["param_groups"]
    assert target["sched"] == saved["sched"]
    assert target["plain"] == plain


def test_bytesio_carrying_a_hostile_attribute_is_refused_without_running(tmp_path):
    # A BytesIO's pickled state includes its __dict__: the allowlist for BytesIO
    # must not let what rides along in it through.
    marker = tmp_path / "pwned"
    path = str(tmp_path / "ckpt")
    buf = io.BytesIO(b"fine")
    buf.payload = Hostile(marker)
    dcp.save({"blob": buf}, storage_writer=cairn.Writer(path))
    with pytest.raises(cairn.CorruptionError, match="'blob'.*allow_pickle"):
        _load({"blob": io.BytesIO()}, path)
    assert not marker.exists()


def test_allowlist_leaves_torchs_safe_globals_as_it_found_them():
    from cairn._stock_reader import check_value_is_safe

    before = set(torch.serialization.get_safe_globals())
    buf = io.BytesIO()
    torch.save(io.BytesIO(b"x"), buf)
    with torch.serialization.safe_globals([io.BytesIO]):  # the user's own registration
        check_value_is_safe(buf.getvalue(), "item")
        assert io.BytesIO in torch.serialization.get_safe_globals()
    check_value_is_safe(buf.getvalue(), "item")
    assert set(torch.serialization.get_safe_globals()) == before


# ---- a BytesIO inside a Stateful, 2 gloo ranks --------------------------------


class _App(Stateful):
    """DCP's documented AppState pattern, plus a BytesIO blob per rank and one shared."""

    def __init__(self, rank: int, seed: int):
        torch.manual_seed(seed)
        self.rank = rank
        self.model = torch.nn.Linear(8, 4)
        self.optim = torch.optim.Adam(self.model.parameters(), lr=0.01 * (seed + 1))
        self.model(torch.randn(3, 8)).sum().backward()
        self.optim.step()
        self.shared = io.BytesIO(_blob(seed))
        self.mine = io.BytesIO(_blob(seed + 100 + rank))

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "shared": self.shared,
            f"blob_rank{self.rank}": self.mine,
        }

    def load_state_dict(self, state_dict):
        set_state_dict(
            self.model,
            self.optim,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        self.shared = state_dict["shared"]
        self.mine = state_dict[f"blob_rank{self.rank}"]


def _save_app(rank, world, path):
    dcp.save({"app": _App(rank, seed=1)}, storage_writer=cairn.Writer(path))


def _load_app(rank, world, path):
    saved = _App(rank, seed=1)
    app = _App(rank, seed=2)
    dcp.load({"app": app}, storage_reader=cairn.Reader(path))
    assert isinstance(app.shared, io.BytesIO) and isinstance(app.mine, io.BytesIO)
    assert app.shared.getvalue() == _blob(1)
    assert app.mine.getvalue() == _blob(1 + 100 + rank)
    for a, b in zip(app.model.parameters(), saved.model.parameters()):
        assert torch.equal(a, b)
    assert app.optim.param_groups[0]["lr"] == saved.optim.param_groups[0]["lr"]
    exp_avg = [app.optim.state[p]["exp_avg"] for p in app.model.parameters()]
    ref = [saved.optim.state[p]["exp_avg"] for p in saved.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(exp_avg, ref))
    return app.mine.getvalue()[:4]


def test_bytesio_in_a_stateful_round_trips_on_two_gloo_ranks(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save_app, path)
    heads = run_ranks(2, _load_app, path)
    assert heads == [_blob(101)[:4], _blob(102)[:4]]


# ---- FileSystemWriter's / FileSystemReader's arguments -------------------------


def _params(fn):
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def test_writer_takes_filesystem_writers_arguments_in_its_order():
    stock = _params(dcp.FileSystemWriter.__init__)
    ours = _params(cairn.Writer.__init__)[: len(stock)]
    assert [p.name for p in ours] == [p.name for p in stock]
    assert all(p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for p in ours)
    differ = {p.name for p, q in zip(ours, stock) if p.default != q.default}
    assert differ == {"path", "thread_count"}  # optional path; cairn's own I/O thread default


def test_reader_takes_filesystem_readers_arguments_in_its_order():
    stock = _params(dcp.FileSystemReader.__init__)
    ours = _params(cairn.Reader.__init__)[: len(stock)]
    assert [p.name for p in ours] == [p.name for p in stock]
    assert all(p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for p in ours)


def test_writer_positional_arguments_mean_what_filesystem_writers_do(tmp_path):
    w = cairn.Writer(str(tmp_path / "c"), True, False, 3, 1 << 20, False, False, None,
                     SerializationFormat.TORCH_SAVE)
    assert (w.single_file_per_rank, w.sync_files, w.thread_count, w.overwrite) == (
        True, False, 3, False)
    assert cairn.Writer(str(tmp_path / "c"), sync=False).sync_files is False


def test_filesystem_writer_keywords_save_a_loadable_checkpoint(tmp_path):
    path = str(tmp_path / "c")
    sd = {"w": torch.arange(10_000.0), "b": torch.ones(7), "step": 3}
    writer = cairn.Writer(path, single_file_per_rank=False, sync_files=False, thread_count=1,
                          per_thread_copy_ahead=0, overwrite=True, _extensions=[])
    _save(sd, writer)
    assert sorted(os.listdir(os.path.join(path, "data"))) == ["r0.bin"]  # one file per rank
    out = {"w": torch.zeros(10_000), "b": torch.zeros(7), "step": 0}
    _load(out, path, _extension_registry=ExtensionRegistry())
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"]) and out["step"] == 3


def test_overwrite_false_refuses_a_committed_checkpoint_and_leaves_it_intact(tmp_path):
    path = str(tmp_path / "c")
    _save({"w": torch.ones(4)}, cairn.Writer(path))
    with pytest.raises(PreconditionError, match=f"already exists at {path}.*overwrite=False"):
        _save({"w": torch.zeros(4)}, cairn.Writer(path, overwrite=False))
    cairn.verify(path)
    out = {"w": torch.full((4,), 9.0)}
    _load(out, path)
    assert torch.equal(out["w"], torch.ones(4))


def test_overwrite_false_writes_where_nothing_is_committed(tmp_path):
    fresh = str(tmp_path / "fresh")
    _save({"w": torch.ones(2)}, cairn.Writer(fresh, overwrite=False))
    cairn.verify(fresh)
    partial = tmp_path / "partial"  # a save that died before its commit
    (partial / "data").mkdir(parents=True)
    (partial / "data" / "r0.bin").write_bytes(b"junk")
    _save({"w": torch.ones(2)}, cairn.Writer(str(partial), overwrite=False))
    cairn.verify(partial)


def test_overwrite_true_replaces_a_committed_checkpoint(tmp_path):
    path = str(tmp_path / "c")
    _save({"w": torch.ones(4)}, cairn.Writer(path))
    _save({"w": torch.full((4,), 2.0)}, cairn.Writer(path, overwrite=True))
    out = {"w": torch.zeros(4)}
    _load(out, path)
    assert torch.equal(out["w"], torch.full((4,), 2.0))


class _Reverse(StreamTransformExtension):
    """A stream transform (as DCP's ZStandard is one): reverses each item's bytes."""

    @staticmethod
    def registry_name() -> str:
        return "test.reverse"

    @staticmethod
    def from_descriptor(version: str) -> "_Reverse":
        return _Reverse()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output):
        class _W(io.RawIOBase):
            def __init__(self):
                self.parts = []

            def writable(self):
                return True

            def write(self, b):
                self.parts.append(bytes(b))
                return len(b)

            def close(self):
                if not self.closed:
                    output.write(b"".join(self.parts)[::-1])
                super().close()

        return _W()

    def transform_from(self, input):
        return io.BytesIO(input.read()[::-1])


def test_stream_extensions_are_refused_by_name(tmp_path):
    with pytest.raises(cairn.InvalidArgumentError, match="_extensions.*_Reverse"):
        cairn.Writer(str(tmp_path / "c"), _extensions=[_Reverse()])


def test_stock_checkpoint_with_stream_extensions_is_refused_by_cairn_reader(tmp_path):
    path = str(tmp_path / "stock")
    dcp.save({"w": torch.ones(3)},
             storage_writer=dcp.FileSystemWriter(path, _extensions=[_Reverse()]))
    registry = ExtensionRegistry()
    registry.register(_Reverse)
    out = {"w": torch.zeros(3)}
    dcp.load(out, storage_reader=dcp.FileSystemReader(path, _extension_registry=registry))
    assert torch.equal(out["w"], torch.ones(3))  # the stock reader decodes it
    # (dcp.load reports a failed metadata read by message, not by type.)
    with pytest.raises(Exception, match="item 'w' uses stream transforms"):
        _load({"w": torch.zeros(3)}, path, _extension_registry=registry)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"serialization_format": SerializationFormat.SAFETENSORS}, "serialization_format"),
        ({"cache_staged_state_dict": True}, "SharedMemoryStager"),
        ({"thread_count": 0}, "thread_count"),
        ({"per_thread_copy_ahead": -1}, "per_thread_copy_ahead"),
    ],
    ids=["safetensors", "cache_staged", "no_threads", "negative_copy_ahead"],
)
def test_writer_arguments_it_cannot_honour_are_refused(tmp_path, kwargs, match):
    with pytest.raises(cairn.InvalidArgumentError, match=match):
        cairn.Writer(str(tmp_path / "c"), **kwargs)
