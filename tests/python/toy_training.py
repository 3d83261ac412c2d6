"""A tiny model, optimizer and deterministic training step shared by the tests that
checkpoint training state (the manager, S3 tiers, async DCP saves)."""

from __future__ import annotations

import torch

import cairn


def make_model(seed=0, sizes=(32, 64, 4)):
    """A seeded Linear-ReLU-Linear model (in, hidden, out = sizes) and its Adam."""
    torch.manual_seed(seed)
    d_in, hidden, d_out = sizes
    model = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, d_out))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt


def make_state(seed=0):
    """make_model() and the app state dict a manager saves for it."""
    model, opt = make_model(seed)
    return model, opt, {"train": cairn.TrainState(model, opt), "rng": cairn.RNGState()}


def train_step(model, opt, seed, batch=8):
    """One optimizer step on a batch drawn from `seed` alone."""
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(batch, model[0].in_features, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def flat(model):
    """All parameters as one detached 1-D copy."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
