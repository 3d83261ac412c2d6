"""The benchmarks' reference state: a GPT-like model + Adam, as nested state dicts.

Imports torch only (not cairn's extension), so a peer's benchmark session can load
this file by path (bench/peers/worker.py) and checkpoint exactly the state that
cairn's own benchmarks (cairn._measure) checkpoint.
"""

from __future__ import annotations

import math

import torch


def build_state(nbytes: float, layers: int = 16, seed: int = 0) -> dict:
    """A GPT-like model + Adam state of at least `nbytes`, as nested state dicts.

    Per layer: qkv (d x 3d), proj (d x d), fc1 (4d x d), fc2 (d x 4d) weights;
    plus an embedding and an output head (4d x d each). Each parameter has
    exp_avg and exp_avg_sq of its shape, so 3 x 66 = 198 tensors (+ 66 step
    scalars). float32 throughout.
    """
    per_d2 = (layers * 12 + 8) * 3 * 4
    d = max(8, math.ceil((nbytes / per_d2) ** 0.5 / 8) * 8)
    shapes = {"embed.weight": (4 * d, d), "head.weight": (4 * d, d)}
    for i in range(layers):
        shapes[f"layers.{i}.attn.qkv.weight"] = (3 * d, d)
        shapes[f"layers.{i}.attn.proj.weight"] = (d, d)
        shapes[f"layers.{i}.mlp.fc1.weight"] = (4 * d, d)
        shapes[f"layers.{i}.mlp.fc2.weight"] = (d, 4 * d)
    g = torch.Generator().manual_seed(seed)
    model, state = {}, {}
    for name, shape in shapes.items():
        model[name] = torch.randn(shape, generator=g)
        state[name] = {
            "step": torch.tensor(100.0),
            "exp_avg": torch.randn(shape, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(shape, generator=g) * 1e-6,
        }
    optim = {
        "state": state,
        "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": list(shapes)}],
    }
    return {"model": model, "optim": optim}
