"""The steady save's check that a state still has the structure of the cached plan.

A save staged with the cached plan (manager._PlanCache) must see exactly the state
dict DCP planned: the same keys nested the same way, and for each tensor the same
type, dtype, shape, layout, requires_grad and pinning (what DCP's plan and metadata
depend on). The plain way to check it is to flatten the state
(``flatten_state_dict``) and compare the result with the cached one, which costs
three passes over every leaf in Python (flatten, signature, source list), ~1.5 ms
for 264 tensors: most of a small save's stall.

``StateShape`` does it in one walk over the nested state instead: it is a tree of
the state's containers (the keys of each dict, in order; the length of each list
DCP traverses), built once from a state DCP flattened and checked against DCP's own
``mappings`` (so it never disagrees with ``flatten_state_dict``: when it would, no
shape is built and the save takes the plain path). ``collect(state)`` walks a new
state against it and returns its leaves in DCP's flattened order, or None as soon as
anything differs.

DCP's traversal rules, reproduced here (torch/distributed/checkpoint/_traverse.py,
``traverse_state_dict``): a Mapping is traversed, its keys str()-ed; a list is
traversed when it holds a tensor, or a container that is itself traversed; anything
else (a tuple included) is a leaf. The pre-2.4 traversal (``_version`` "2_3") is not
reproduced: no shape is built under it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import _version

__all__ = ["StateShape", "tensor_signature"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _pin_possible() -> bool:
    """Whether a host tensor can be pinned in this process: pinning needs an
    accelerator (``Tensor.is_pinned`` costs ~1 us a call, asked of every tensor)."""
    try:
        return torch.accelerator.is_available()
    except Exception:  # noqa: BLE001 - an old or odd build: ask every tensor
        return True


def tensor_signature(t: torch.Tensor, pin: bool) -> tuple:
    """What DCP's plan and metadata depend on, of a plain tensor."""
    return (type(t), t.dtype, t.shape, t.layout, t.requires_grad, pin and t.is_pinned())


def _keep_traversing(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def _is_terminal(value: Any) -> bool:
    """traverse_state_dict's _is_terminal (a value that DCP keeps whole)."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (Mapping, list)) and not _is_terminal(entry):
            return False
        if _keep_traversing(entry):
            return False
    return True


class StateShape:
    """The container tree of one state dict (see the module docstring).

    A node is ``("dict", type, keys, children)``, ``("list", length, children)``,
    ``("tensor", signature)`` or ``("value",)``."""

    def __init__(self, root: tuple, num_leaves: int, pin: bool) -> None:
        self._root = root
        self.num_leaves = num_leaves
        self._pin = pin

    @classmethod
    def of(cls, state_dict: dict[str, Any], mappings: dict[str, tuple]) -> "StateShape | None":
        """The shape of `state_dict`, if its leaves, in order, are exactly DCP's
        flattening of it (`mappings`: flatten_state_dict's fqn -> path); else None."""
        if _version._derived_version == "2_3":
            return None
        pin = _pin_possible()
        paths: list[tuple] = []

        def build(path: tuple, value: Any) -> tuple | None:
            if isinstance(value, Mapping):
                keys = list(value.keys())
                kids = []
                for k in keys:
                    kid = build(path + (str(k),), value[k])
                    if kid is None:
                        return None
                    kids.append(kid)
                return ("dict", type(value), keys, kids)
            if _is_terminal(value):
                paths.append(path)
                if type(value) in _PLAIN:
                    return ("tensor", tensor_signature(value, pin))
                if isinstance(value, torch.Tensor):
                    return None  # a subclass (DTensor, ...): planned anew each time
                return ("value",)
            if isinstance(value, list):
                kids = []
                for i, v in enumerate(value):
                    kid = build(path + (i,), v)
                    if kid is None:
                        return None
                    kids.append(kid)
                return ("list", len(value), kids)
            return None  # a traversed tuple: DCP does not reach here either

        if not isinstance(state_dict, dict):
            return None
        root = build((), state_dict)
        if root is None:
            return None
        want = list(mappings.values())
        got = [p for p in paths]
        if got != want or list(mappings) != [".".join(map(str, p)) for p in got]:
            return None
        return cls(root, len(paths), pin)

    def collect(self, state_dict: dict[str, Any]) -> list[Any] | None:
        """The leaves of `state_dict` in DCP's flattened order, if it has this shape
        (same containers and keys in the same order, tensors with the same
        signature, values still kept whole); else None."""
        out: list[Any] = []
        pin = self._pin
        stack = [(self._root, state_dict)]
        append = out.append
        # Iterative, children pushed in reverse so leaves come out in order.
        while stack:
            node, value = stack.pop()
            kind = node[0]
            if kind == "tensor":
                sig = node[1]
                if (type(value) is not sig[0] or value.dtype != sig[1] or value.shape != sig[2]
                        or value.layout != sig[3] or value.requires_grad != sig[4]
                        or (pin and value.is_pinned() != sig[5])):
                    return None
                append(value)
            elif kind == "value":
                if isinstance(value, torch.Tensor) or not _is_terminal(value):
                    return None
                append(value)
            elif kind == "dict":
                if type(value) is not node[1] or len(value) != len(node[2]):
                    return None
                keys = node[2]
                if list(value.keys()) != keys:
                    return None
                kids = node[3]
                for i in range(len(keys) - 1, -1, -1):
                    stack.append((kids[i], value[keys[i]]))
            else:  # list
                if type(value) is not list or len(value) != node[1]:
                    return None
                kids = node[2]
                for i in range(node[1] - 1, -1, -1):
                    stack.append((kids[i], value[i]))
        return out
