"""One trainer process of bench/recovery.py's live-recovery scenario.

    recovery_worker.py torchft EVENTS REPLICA_ID LIGHTHOUSE_ADDR STOP_FILE [CKPT_ROOT]
    recovery_worker.py cairn  EVENTS CKPT_ROOT STOP_FILE          (under torchrun)

Both modes train the same model (an MLP, 8.4 M float32 parameters + AdamW's two
moments: ~100 MB of state) on the same synthetic data (batch i of a replica is drawn
from a generator seeded with (i, replica)), one step after another, until STOP_FILE
exists. Every milestone is appended to EVENTS as one JSON line
``{"ev", "t" (time.time()), "pid", "who", "step", ...}``, flushed at once, so a killed
process's last line survives:

  start     first statement of the script (before any import but time/os/json/sys)
  imported  torch and the system under test imported
  pg        torchft: TCPStore + ProcessGroupGloo + Manager + wrappers built;
            cairn: cairn.init_distributed('gloo') returned (torchrun's rendezvous env)
  model     model, DDP and optimizer (torchft: its wrappers) built
  ready     cairn: CheckpointManager built (torchft: = model; its Manager is in pg)
  restored  cairn: mgr.restore() returned (with the tier); torchft: the heal's
            load_state_dict callback returned (the state from the live peer applied)
  step      a training step finished (torchft: committed or not; cairn: after its save)

torchft follows torchft's train_ddp.py (Manager, ProcessGroupGloo, PGTransport for the
heal, DistributedDataParallel and Optimizer wrappers, min_replica_size=1); each replica
group is one process, which hosts its own TCPStore (the role torchrun plays in the
example). cairn follows examples/train.py: DDP over gloo, a CheckpointManager with the
memory tier saving every step (durable tier every 50th), restore at start.
"""

import json
import os
import sys
import time

T_START = time.time()

MODE = sys.argv[1]
EVENTS = sys.argv[2]
_fd = os.open(EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
WHO = sys.argv[3] if MODE == "torchft" else f"rank{os.environ.get('RANK', '0')}"
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def ev(name: str, **kw) -> None:
    rec = {"ev": name, "t": kw.pop("t_override", None) or time.time(), "pid": os.getpid(),
           "who": WHO, "attempt": ATTEMPT}
    rec.update(kw)
    os.write(_fd, (json.dumps(rec) + "\n").encode())


ev("start", t_override=T_START)

import warnings  # noqa: E402

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from torch import nn  # noqa: E402

torch.set_num_threads(1)
D_IN, HIDDEN, BATCH = 1024, 2048, 32


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
                         nn.ReLU(), nn.Linear(HIDDEN, D_IN))


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + replica)
    return torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_IN, generator=g)


def stop_requested(path: str) -> bool:
    return os.path.exists(path)


def patch_torchft_ddp_hook() -> None:
    """torchft 0.2.0's DDP comm hook does `work.wait(); assert fut._fut`; when the
    allreduce fails (the peer was killed during it), `_ManagedWork.wait` reports the
    error to the manager and returns False before it sets `_fut`, so the assert kills
    the *surviving* replica (seen in the first run of this benchmark). The patch: on
    that path, return a completed future holding the (to be discarded) bucket; the
    manager has recorded the error, so `should_commit()` is False and the step is
    skipped, which is what torchft's `allreduce` documents for errors. Nothing else
    changes."""
    import torchft.ddp

    orig = torchft.ddp.DistributedDataParallel._comm_hook

    def _comm_hook(state, bucket):
        work = state.allreduce(bucket.buffer())
        work.wait()
        fut = work.get_future()
        inner = getattr(fut, "_fut", fut)
        if inner is None:
            ev("hook_error_patched", step=state.current_step())
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        return inner

    _comm_hook.__wrapped__ = orig
    torchft.ddp.DistributedDataParallel._comm_hook = staticmethod(_comm_hook)


def run_torchft() -> None:
    from datetime import timedelta

    import torchft
    from torch.distributed import TCPStore
    from torchft.checkpointing.pg_transport import PGTransport

    ev("imported", version=torchft.__version__ if hasattr(torchft, "__version__") else "")
    patch_torchft_ddp_hook()
    replica, lighthouse, stop = int(sys.argv[3]), sys.argv[4], sys.argv[5]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    opt_holder: list = []

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt_holder[0].load_state_dict(sd["optim"])
        ev("restored", tier="live peer", step=manager.current_step())

    def state_dict():
        return {"model": model.state_dict(), "optim": opt_holder[0].state_dict()}

    pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=5))
    transport = PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu"))
    manager = torchft.Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict,
                              state_dict=state_dict, replica_id=f"rg{replica}",
                              timeout=timedelta(seconds=30), checkpoint_transport=transport,
                              store_addr="127.0.0.1", store_port=store.port, rank=0,
                              world_size=1, lighthouse_addr=lighthouse, hostname="127.0.0.1")
    ev("pg")
    model = make_model()
    ddp = torchft.DistributedDataParallel(manager, model)
    optimizer = torchft.Optimizer(manager, torch.optim.AdamW(ddp.parameters(), lr=1e-4))
    opt_holder.append(optimizer)
    ev("model")
    mgr = None
    data = _Position()
    if len(sys.argv) > 6:  # torchft + cairn: this group's own tiers and data position
        import cairn

        mgr = cairn.CheckpointManager(sys.argv[6], memory=True, keep=1, memory_slots=2,
                                      durable_every=50)
        ev("shm", path=str(mgr.shm_dir))
        cstate = {"train": cairn.TrainState(model, optimizer.optim, data=data), "ft": manager}
        t0 = time.time()
        got = mgr.restore(cstate)
        ev("cairn_restored", tier=mgr.restored[1] if mgr.restored else None,
           step=-1 if got is None else got, seconds=time.time() - t0)
    ev("ready")  # the Manager was built before the model (its "pg" milestone)
    try:
        while not stop_requested(stop):
            optimizer.zero_grad()  # starts the quorum (and, when behind, the heal)
            # torchft alone: the batch follows the (healed) step, as in its example;
            # with cairn: this group's own data position, restored from its tier.
            x, y = batch(manager.current_step() if mgr is None else data.step, replica)
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            committed = manager.should_commit()
            if committed:
                optimizer.optim.step()
                data.step += 1
                if mgr is not None:
                    mgr.save(manager.current_step(), cstate)
            ev("step", step=manager.current_step(), committed=bool(committed),
               participants=manager.num_participants())
    finally:
        manager.shutdown(wait=False)
        ev("closed")
    if mgr is not None:  # the clean stop only (see run_cairn)
        mgr.close()


def run_cairn() -> None:
    import torch.distributed as dist

    import cairn

    if os.environ.get("RECOVERY_DEBUG"):
        import logging
        logging.basicConfig(level=logging.INFO)
    ev("imported", version=getattr(cairn, "__version__", ""))
    root, stop = sys.argv[3], sys.argv[4]
    # cairn.init_distributed, not dist.init_process_group("gloo"): the plain call
    # reads the killed attempt's gloo addresses from torchrun's store on the restart
    # and fails in connectFullMesh (seen in this benchmark's first run).
    rank, _ = cairn.init_distributed("gloo")
    ev("pg")
    # RECOVERY_DDP_INIT_SYNC=0: skip DDP's broadcast of rank 0's initial weights, which
    # the restore overwrites anyway (every rank restores the same step); torchft's DDP
    # wrapper skips it too (a dummy process group soaks it up).
    model = nn.parallel.DistributedDataParallel(
        make_model(), init_sync=os.environ.get("RECOVERY_DDP_INIT_SYNC", "1") != "0")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = _Position()
    ev("model")
    mgr = cairn.CheckpointManager(root, memory=True, keep=1, memory_slots=2, durable_every=50)
    ev("shm", path=str(mgr.shm_dir))
    state = {"train": cairn.TrainState(model, opt, data=data)}
    ev("ready")
    start = mgr.restore(state)
    ev("restored", tier=mgr.restored[1] if mgr.restored else None,
       step=-1 if start is None else start)
    step = 0 if start is None else start
    while not stop_requested(stop):
        step += 1
        x, y = batch(data.step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        data.step += 1
        mgr.save(step, state)
        ev("step", step=step, committed=True, participants=dist.get_world_size())
    # Closed on the clean stop only: close() ends the memory tier (it removes the
    # node's slots), so a close on the way out of an exception (a `finally`, a `with`
    # block) after the peer's death would erase what the restart restores from
    # (seen in this benchmark's first runs: the restart then found nothing).
    mgr.close()
    dist.destroy_process_group()
    ev("closed")


class _Position:
    """The data position (next batch index), checkpointed with the model."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


if __name__ == "__main__":
    {"torchft": run_torchft, "cairn": run_cairn}[MODE]()
