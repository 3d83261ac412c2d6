import random

import numpy as np
import pytest
import torch

import cairn
from cairn.state import RNGState, TrainState


def draw():
    return (random.random(), float(np.random.rand()), float(torch.rand(1)))


def test_seed_everything_is_reproducible():
    cairn.seed_everything(123)
    a = [draw() for _ in range(3)]
    cairn.seed_everything(123)
    assert [draw() for _ in range(3)] == a


def test_seed_everything_rejects_bad_seed():
    with pytest.raises(ValueError):
        cairn.seed_everything(-1)
    with pytest.raises(ValueError):
        cairn.seed_everything("7")


def test_rng_state_roundtrip_restores_every_stream():
    cairn.seed_everything(5)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's generator
    np.random.standard_normal()
    rng = RNGState()
    saved = rng.state_dict()
    expected = [draw() for _ in range(4)] + [random.gauss(0, 1), float(np.random.standard_normal())]
    cairn.seed_everything(99)
    rng.load_state_dict(saved)
    got = [draw() for _ in range(4)] + [random.gauss(0, 1), float(np.random.standard_normal())]
    assert got == expected


def test_rng_state_holds_only_tensors():
    def leaves(d):
        for v in d.values():
            if isinstance(v, dict):
                yield from leaves(v)
            else:
                yield v
    assert all(isinstance(v, torch.Tensor) for v in leaves(RNGState().state_dict()))


def test_rng_state_missing_rank_reseeds_deterministically():
    cairn.seed_everything(3)
    rng = RNGState(rank=5)
    rng.load_state_dict({"rank0": RNGState(rank=0).state_dict()["rank0"]})
    a = draw()
    rng.load_state_dict({})
    assert draw() == a


def test_train_state_roundtrip():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    ts = TrainState(model, opt, sched)
    sd = ts.state_dict()
    w = model.weight.detach().clone()
    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    TrainState(model2, opt2, sched2).load_state_dict(sd)
    assert torch.equal(model2.weight, w)
    assert sched2.state_dict()["last_epoch"] == 1
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.05)


def test_train_state_rejects_non_stateful_extra():
    with pytest.raises(ValueError, match="not a Stateful"):
        TrainState(torch.nn.Linear(1, 1), step=3)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_train_state_dict_is_get_state_dicts_while_its_info_is_reused():
    """TrainState computes DCP's state-dict info once while the parameters are the same
    objects: its state_dict stays get_state_dict's after steps, and after a parameter,
    a buffer or the optimizer's parameters are replaced."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ts = TrainState(model, opt)

    def step():
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()

    def check():
        want_m, want_o = get_state_dict(model, [opt])
        got = ts.state_dict()
        assert _same(got["model"], want_m) and _same(got["optim"], want_o)

    check()  # before the optimizer has state
    step()
    check()
    first = ts._info[1]
    step()
    check()
    assert ts._info[1] is first  # reused
    model[0].weight = torch.nn.Parameter(torch.ones(3, 4))  # a new parameter object
    opt = ts.optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    step()
    check()
    assert ts._info[1] is not first  # recomputed for the new parameter
    model[1].running_mean = torch.zeros(3)  # a new buffer object
    check()
