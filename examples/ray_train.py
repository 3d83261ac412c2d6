#!/usr/bin/env python
"""Ray Train on cairn: tiered, asynchronous checkpoints reported to Ray, a simulated
failure, and an automatic, exact resume.

The seed's Ray Train example (``dcp.async_save`` to tiered storage, then
``ray.train.report(..., checkpoint_upload_mode=ASYNC)``), on cairn:

- a ``TorchTrainer`` with ``ScalingConfig`` (CPU workers over gloo here),
  ``RunConfig(storage_path, name, checkpoint_config=CheckpointConfig(num_to_keep),
  failure_config=FailureConfig(max_failures))``;
- in each worker, ``cairn.ray.checkpoint_manager(memory=True, ...)``: the memory tier
  (node shared memory, plus peer replicas with ``--replicas`` where the manager has
  them) in front of the durable tier, which is the run's storage (a directory, or
  ``s3://`` once cairn's S3 backend is in);
- ``cairn.ray.report(mgr, step, state, metrics)`` every ``--ckpt-every`` steps:
  blocks for staging only, Ray registers the checkpoint when it is durable;
- rank ``--crash-rank`` SIGKILLs itself at ``--crash-at-step`` (once): Ray's
  ``FailureConfig`` restarts the worker group and ``mgr.restore`` resumes from the
  newest step every rank can load (the memory tier on this node).

Run:  python examples/ray_train.py [--storage-path DIR] [--steps 40 --crash-at-step 23]
The train function is also what tests/python/test_ray.py runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _synthetic_shard(args: tuple[int, int, int]):
    """Shard `shard` of a synthetic regression set: (sample id, x, y), the same
    every time it is read."""
    import torch

    shard, n, dim = args
    g = torch.Generator().manual_seed(1000 + shard)
    x = torch.randn(n, dim, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    for i in range(n):
        yield shard * 1_000_000 + i, x[i], y[i]


def train_func(config: dict) -> None:
    """The per-worker training loop (runs inside each Ray Train worker)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ray.train

    import cairn
    import cairn.ray

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(1)
    cairn.seed_everything(config["seed"], deterministic=True)

    dim = config.get("dim", 16)
    shards = [(s, config.get("shard_size", 24), dim) for s in range(config.get("shards", 8))]
    dataset = cairn.data.ShardDataset(shards, _synthetic_shard, shuffle=True, seed=config["seed"])
    loader = cairn.data.DataLoader(dataset, batch_size=config.get("batch_size", 4))

    model = torch.nn.Sequential(torch.nn.Linear(dim, config.get("hidden", 64)), torch.nn.GELU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(config.get("hidden", 64), 1))
    model = DDP(model) if world > 1 and dist.is_initialized() else model
    # DDP's first backward pass reduces in another bucket layout than later ones: spend
    # it on a dummy batch on every attempt (bit-exact resume from 3 workers on).
    probe = torch.zeros(1, dim)
    cairn.settle_ddp_buckets(model, lambda m: m(probe).sum().backward())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)

    mgr = cairn.ray.checkpoint_manager(**{"memory": True, **config.get("cairn", {})})
    state = {"train": cairn.TrainState(model, opt, sched, data=loader), "rng": cairn.RNGState()}
    start = mgr.restore(state)
    step = start or 0
    restored = f"{mgr.restored[0]}/{mgr.restored[1]}" if mgr.restored else "none"
    if rank == 0:
        latest = ray.train.get_checkpoint()
        print(f"[ray_train] world={world} " + (
            f"resuming from step {start} ({mgr.restored[1]} tier); Ray's latest checkpoint: "
            f"{os.path.basename(latest.path) if latest else None}; untracked by Ray: "
            f"adopted {mgr.adopted}, removed {mgr.removed_orphans}" if start is not None
            else "starting fresh"), flush=True)

    steps, every = config["steps"], config["ckpt_every"]
    crash_at, crash_rank = config.get("crash_at_step"), config.get("crash_rank", 1)
    marker = config.get("crash_marker")
    sample_log = open(config["sample_log"] + f".r{rank}", "a") if config.get("sample_log") else None
    loss_fn = torch.nn.MSELoss()
    epoch = loader.epoch
    it = iter(loader)
    while step < steps:
        try:
            ids, x, y = next(it)
        except StopIteration:
            epoch += 1
            loader.set_epoch(epoch)
            it = iter(loader)
            continue
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if sample_log:
            sample_log.write(f"{rank} {step} {' '.join(map(str, ids.tolist()))}\n")
            sample_log.flush()
        if step % every == 0 or step == steps:
            metrics = {"loss": float(loss.item()), "step": step, "restored": restored,
                       "adopted": mgr.adopted or "", "removed": len(mgr.removed_orphans)}
            # The last step goes durable whatever durable_every says, so Ray's
            # Result.checkpoint is the final state.
            cairn.ray.report(mgr, step, state, metrics, durable=True if step == steps else None)
        if crash_at is not None and step == crash_at and marker and not os.path.exists(marker):
            if config.get("orphan_at_crash"):
                # Every rank: a durable commit that Ray never hears of (as when a
                # worker dies between the commit and the controller's registration).
                mgr.save(step, state, durable=True)
                mgr.wait()
            if rank != crash_rank:
                continue  # the next collective fails when the crash rank dies
            open(marker, "w").close()
            print(f"[ray_train] rank {rank}: simulated crash (SIGKILL) at step {step}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    if sample_log:
        sample_log.close()
    if config.get("out") and rank == 0:
        inner = model.module if isinstance(model, DDP) else model
        torch.save({"model": {k: v.detach().clone() for k, v in inner.state_dict().items()},
                    "optim": opt.state_dict()}, config["out"])


def make_trainer(config: dict, storage_path: str, name: str, num_to_keep: int | None = 2,
                 max_failures: int = 1, workers: int = 2, cpus_per_worker: float = 0.5,
                 timeout_s: int = 300):
    """The TorchTrainer of this example (CPU workers, gloo; `timeout_s` bounds
    torch.distributed's collectives)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(
        train_func,
        train_loop_config=config,
        torch_config=TorchConfig(backend="gloo", timeout_s=timeout_s),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False,
                                     resources_per_worker={"CPU": cpus_per_worker}),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            checkpoint_config=CheckpointConfig(num_to_keep=num_to_keep),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--storage-path", default=None,
                   help="RunConfig.storage_path (default: a temporary directory)")
    p.add_argument("--name", default="cairn-ray-example")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--num-to-keep", type=int, default=2)
    p.add_argument("--crash-at-step", type=int, default=23)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--durable-every", type=int, default=1)
    p.add_argument("--replicas", type=int, default=0,
                   help="memory-tier replicas on peer nodes (needs a manager with replicas)")
    a = p.parse_args()

    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")  # the default since Ray 2.5x
    import ray

    import cairn

    work = tempfile.mkdtemp(prefix="cairn-ray-")
    storage = a.storage_path or os.path.join(work, "results")
    cairn_kwargs = {"durable_every": a.durable_every}
    if a.replicas:
        cairn_kwargs["replicas"] = a.replicas
    config = {"seed": 0, "steps": a.steps, "ckpt_every": a.ckpt_every,
              "crash_at_step": a.crash_at_step, "crash_rank": a.crash_rank,
              "crash_marker": os.path.join(work, "crashed"), "cairn": cairn_kwargs}
    os.environ.setdefault("PYTHONPATH", os.path.join(REPO, "python"))
    os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ["PYTHONPATH"]
    ray.init(num_cpus=max(2, a.workers), include_dashboard=False,
             _temp_dir=os.path.join(work, "ray"))
    try:
        result = make_trainer(config, storage, a.name, num_to_keep=a.num_to_keep,
                              workers=a.workers).fit()
    finally:
        ray.shutdown()
    if result.error:
        print(f"ray_train: the run failed: {result.error} (files in {work})")
        return 1
    ckpt = result.checkpoint
    print(f"ray_train: final metrics {json.dumps(result.metrics)}")
    print(f"ray_train: Result.checkpoint {ckpt.path}")
    cairn.verify(ckpt.path)
    print("ray_train: cairn.verify OK; checkpoints Ray kept: "
          + ", ".join(os.path.basename(c.path) for c, _ in result.best_checkpoints))
    import shutil

    shutil.rmtree(work, ignore_errors=True)  # Ray's temp dir (and results, by default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
