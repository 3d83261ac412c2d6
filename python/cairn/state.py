"""Complete, exact training state: RNG streams and the model/optimizer/scheduler.

Everything here is a DCP ``Stateful`` whose ``state_dict()`` holds only tensors and
plain numbers, so it is stored by cairn without pickling and commits atomically with
the rest of a checkpoint.

RNG streams are per rank: ``RNGState`` stores rank r's generators under the key
``"rank{r}"``. On restore, each rank loads its own entry. When the world size grows,
ranks that have no entry in the checkpoint are re-seeded deterministically from the
seed given to :func:`seed_everything` (or 0) and their rank, and a warning is logged;
when it shrinks, the entries of the missing ranks are ignored. Either way the result
is a pure function of the checkpoint and the new world size.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["seed_everything", "RNGState", "TrainState", "current_rank"]

log = logging.getLogger(__name__)

_SEED: int | None = None


def current_rank() -> int:
    """This process's rank: torch.distributed's when initialized, else $RANK, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def seed_everything(seed: int, *, rank_offset: bool = False, deterministic: bool = False) -> int:
    """Seeds Python's ``random``, NumPy's global generator, torch's CPU generator and
    every CUDA device's generator.

    With ``rank_offset=True`` each rank gets ``seed + rank`` (distinct dropout masks per
    rank); by default every rank gets the same seed (identical initialisation).
    ``deterministic=True`` also asks torch for deterministic kernels
    (``torch.use_deterministic_algorithms`` and the cuBLAS workspace setting).
    Returns the seed used on this rank.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    global _SEED
    _SEED = seed
    s = seed + current_rank() if rank_offset else seed
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)  # also seeds every CUDA device
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    return s


def _python_state_to_tensor(state: tuple) -> torch.Tensor:
    version, internal, gauss = state
    has_gauss = gauss is not None
    head = [version, int(has_gauss)]
    g = torch.tensor([gauss if has_gauss else 0.0], dtype=torch.float64).view(torch.int64)
    return torch.cat([torch.tensor(head + list(internal), dtype=torch.int64), g])


def _python_state_from_tensor(t: torch.Tensor) -> tuple:
    values = t.tolist()
    version, has_gauss = values[0], values[1]
    internal = tuple(values[2:-1])
    gauss = t[-1:].view(torch.float64).item() if has_gauss else None
    return (version, internal, gauss)


def _numpy_state_to_tensors(state: tuple) -> dict[str, torch.Tensor]:
    name, keys, pos, has_gauss, cached = state
    if name != "MT19937":
        raise ValueError(f"unsupported NumPy bit generator {name!r}")
    return {
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
        "meta": torch.tensor([pos, has_gauss], dtype=torch.int64),
        "cached": torch.tensor([cached], dtype=torch.float64),
    }


def _numpy_state_from_tensors(d: dict[str, torch.Tensor]) -> tuple:
    keys = d["keys"].numpy().astype(np.uint32)
    pos, has_gauss = (int(v) for v in d["meta"].tolist())
    return ("MT19937", keys, pos, has_gauss, float(d["cached"].item()))


class RNGState:
    """A DCP ``Stateful`` capturing every RNG stream of this rank: Python ``random``,
    NumPy's global generator, torch's CPU generator and every CUDA device's generator.

    ``state_dict()`` captures the streams at call time (so put it in the state handed
    to ``CheckpointManager.save``); ``load_state_dict()`` restores them. Not
    thread-safe: generators are process-global.
    """

    def __init__(self, rank: int | None = None):
        self._rank = rank

    @property
    def rank(self) -> int:
        return current_rank() if self._rank is None else self._rank

    def _capture(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "python": _python_state_to_tensor(random.getstate()),
            "numpy": _numpy_state_to_tensors(np.random.get_state(legacy=True)),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            d["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
        return d

    def state_dict(self) -> dict[str, Any]:
        return {f"rank{self.rank}": self._capture()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = f"rank{self.rank}"
        mine = state_dict.get(key)
        if mine is None:
            seed = (_SEED or 0) + self.rank
            log.warning("RNGState: the checkpoint has no RNG state for rank %d "
                        "(world size changed); re-seeding it with %d", self.rank, seed)
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.manual_seed(seed)
            return
        random.setstate(_python_state_from_tensor(mine["python"]))
        np.random.set_state(_numpy_state_from_tensors(mine["numpy"]))
        torch.set_rng_state(mine["torch"].to(torch.uint8))
        cuda = mine.get("cuda") or {}
        if cuda and torch.cuda.is_available():
            n = min(len(cuda), torch.cuda.device_count())
            torch.cuda.set_rng_state_all([cuda[str(i)].to(torch.uint8) for i in range(n)])

    def keys_for_load(self, available: set[str]) -> dict[str, Any]:
        """The state_dict to pass to a load, given the top-level keys the checkpoint
        has: this rank's entry if present, else nothing (see the module docstring)."""
        sd = self.state_dict()
        return sd if f"rank{self.rank}" in available else {}


class TrainState:
    """A DCP ``Stateful`` bundling model, optimizer and (optionally) LR scheduler plus
    any extra Statefuls (a data loader, counters), so one checkpoint holds the whole
    run.

    Model and optimizer go through ``torch.distributed.checkpoint.state_dict``'s
    ``get_state_dict``/``set_state_dict``, which handles DDP, FSDP2 (DTensor shards)
    and plain modules alike and gives fully-qualified optimizer keys, so a checkpoint
    reshards across world sizes. The scheduler's state is plain numbers.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: Any = None, **extra: Any):
        for k, v in extra.items():
            if not (hasattr(v, "state_dict") and hasattr(v, "load_state_dict")):
                raise ValueError(f"TrainState extra {k!r} is not a Stateful "
                                 "(needs state_dict() and load_state_dict())")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.extra = extra
        self._info: tuple[tuple, Any] | None = None  # (_info_key, DCP's _StateDictInfo)

    def _info_key(self, optims: tuple) -> tuple:
        """What DCP's state-dict info (the parameters' fully-qualified names) depends on:
        the model's parameter and buffer objects and the optimizers' parameters."""
        return (tuple(map(id, self.model.parameters())), tuple(map(id, self.model.buffers())),
                tuple(id(p) for o in optims for g in o.param_groups for p in g["params"]))

    def _model_and_optim_state_dicts(self, optims: tuple) -> tuple[dict, dict]:
        """``get_state_dict(model, optims)``, with its info (_verify_options: ~1.3 ms
        for a small model, a third of the call, paid at every save) computed once
        while the model's and optimizers' parameters are the same objects. FSDP1
        models, and torch builds without these helpers, take get_state_dict."""
        from torch.distributed.checkpoint import state_dict as dsd

        helpers = ("_verify_options", "_get_model_state_dict", "_get_optim_state_dict",
                   "_verify_state_dict", "_gc_context")
        if not all(hasattr(dsd, h) for h in helpers):
            return dsd.get_state_dict(self.model, list(optims))
        key = self._info_key(optims)
        if self._info is not None and self._info[0] == key:
            info = self._info[1]
        else:
            info = dsd._verify_options(self.model, optims, optim_only=False)
            self._info = (key, info) if not getattr(info, "fsdp_modules", None) else None
        with dsd._gc_context():
            model_sd = dsd._get_model_state_dict(self.model, info)
            optim_sd = dsd._get_optim_state_dict(self.model, optims, info)
            dsd._verify_state_dict(model_sd, optim_sd, info)
        return model_sd, optim_sd

    def state_dict(self) -> dict[str, Any]:
        optims = (self.optimizer,) if self.optimizer is not None else ()
        model_sd, optim_sd = self._model_and_optim_state_dicts(optims)
        sd: dict[str, Any] = {"model": model_sd}
        if self.optimizer is not None:
            sd["optim"] = optim_sd
        if self.scheduler is not None:
            sd["scheduler"] = self.scheduler.state_dict()
        for k, v in self.extra.items():
            sd[k] = v.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        optims = [self.optimizer] if self.optimizer is not None else []
        set_state_dict(self.model, optims, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict.get("optim", {}))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])
        for k, v in self.extra.items():
            v.load_state_dict(state_dict[k])
