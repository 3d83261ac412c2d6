"""cairn._state_shape.StateShape: the one-walk check of the steady save agrees with
DCP's flatten_state_dict on every state it accepts, and refuses every change of
structure that DCP's plan depends on."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from cairn._state_shape import StateShape


def _states():
    t = torch.arange
    yield {"a": t(3.0), "b": {"c": t(4.0), "d": {"e": t(2.0)}}}
    yield {"model": {"w": torch.nn.Parameter(torch.ones(2, 2))}, "lr": 0.1, "name": "x"}
    # a list holding tensors is traversed; a list of plain values is one value
    yield {"l": [t(1.0), t(2.0), 3], "names": ["a", "b"], "tup": (1, t(2.0))}
    # a list of dicts (param_groups), nested lists, an empty dict, an OrderedDict
    yield {"opt": {"param_groups": [{"lr": 1.0, "params": [0, 1]}, {"lr": 2.0, "params": []}],
                   "state": {0: {"step": t(1.0)}, 1: {}}},
           "nested": [[t(1.0)], [[t(2.0)], "s"]], "empty": {},
           "od": collections.OrderedDict([("z", t(1.0)), ("y", 2)])}
    yield {"rng": {"torch": torch.get_rng_state(), "seed": 7}, "none": None, "by": b"\x00\x01"}


def _same_leaves(got, flat):
    vals = list(flat.values())
    return len(got) == len(vals) and all(g is v for g, v in zip(got, vals))


@pytest.mark.parametrize("i", range(5))
def test_collect_yields_dcp_flattened_leaves_in_order(i):
    state = list(_states())[i]
    flat, mappings = flatten_state_dict(state)
    shape = StateShape.of(state, mappings)
    assert shape is not None
    assert shape.num_leaves == len(flat)
    assert _same_leaves(shape.collect(state), flat)
    # a rebuilt state of the same structure (new tensor objects) is accepted too
    again = list(_states())[i]
    flat2, _ = flatten_state_dict(again)
    assert _same_leaves(shape.collect(again), flat2)


def _changed():
    """(description, mutation of state 3) pairs, each changing what DCP plans."""
    yield "new key", lambda s: s["opt"]["state"].__setitem__(2, {"step": torch.ones(())})
    yield "dropped key", lambda s: s.pop("empty")
    yield "reordered keys", lambda s: s.__setitem__("opt", s.pop("opt"))  # "opt" moves last
    yield "shape", lambda s: s["opt"]["state"][0].__setitem__("step", torch.ones(2))
    yield "dtype", lambda s: s["opt"]["state"][0].__setitem__("step", torch.ones((), dtype=torch.int64))
    yield "requires_grad", lambda s: s["opt"]["state"][0].__setitem__(
        "step", torch.ones((), requires_grad=True))
    yield "tensor became a value", lambda s: s["opt"]["state"][0].__setitem__("step", 1.0)
    yield "value became a tensor", lambda s: s["opt"]["param_groups"][0].__setitem__(
        "lr", torch.ones(()))
    yield "value list gained a tensor", lambda s: s["opt"]["param_groups"][0]["params"].append(
        torch.ones(()))
    yield "traversed list grew", lambda s: s["nested"][0].append(torch.ones(()))
    yield "empty dict gained a key", lambda s: s["empty"].__setitem__("k", 1)
    yield "dict became OrderedDict", lambda s: s.__setitem__(
        "empty", collections.OrderedDict())
    yield "value became a dict", lambda s: s["od"].__setitem__("y", {"k": torch.ones(())})
    yield "key type changed", lambda s: s["opt"]["state"].__setitem__(
        "0", s["opt"]["state"].pop(0))
    yield "sparse layout", lambda s: s["opt"]["state"][0].__setitem__(
        "step", torch.ones(()).to_sparse())


@pytest.mark.parametrize("what,mutate", list(_changed()), ids=[w for w, _ in _changed()])
def test_collect_refuses_a_changed_structure(what, mutate):
    state = list(_states())[3]
    _, mappings = flatten_state_dict(state)
    shape = StateShape.of(state, mappings)
    changed = list(_states())[3]
    mutate(changed)
    assert shape.collect(changed) is None, what


def test_values_may_change_without_changing_the_shape():
    state = list(_states())[3]
    _, mappings = flatten_state_dict(state)
    shape = StateShape.of(state, mappings)
    state["opt"]["param_groups"][0]["lr"] = 0.5
    state["od"]["y"] = "now a string"
    state["opt"]["param_groups"][1]["params"] = [4, 5, 6]  # still a list of values
    flat, _ = flatten_state_dict(state)
    assert _same_leaves(shape.collect(state), flat)


def test_no_shape_for_a_mapping_dcp_does_not_describe_or_a_tensor_subclass():
    state = {"a": torch.ones(2)}
    _, mappings = flatten_state_dict(state)
    assert StateShape.of(state, {"other": ("other",)}) is None

    class Sub(torch.Tensor):
        pass

    sub = {"a": torch.ones(2).as_subclass(Sub)}
    _, mappings = flatten_state_dict(sub)
    assert StateShape.of(sub, mappings) is None
