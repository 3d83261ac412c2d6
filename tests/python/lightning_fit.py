"""A tiny Lightning fit for tests/python/test_lightning.py (run as a script, alone or
under torchrun): a 2-layer MLP over a cairn.data.DataLoader, checkpointed through
cairn.lightning.CheckpointIO (or Lightning's default with --plugin default).

Writes the sample ids of every training batch to --log (one line per step:
"global_step id id ..."), the final weights to --out, and kills itself with SIGKILL
when --kill-at is reached."""

import argparse
import os
import signal
import sys

import torch

import cairn.data
import cairn.lightning
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint


def read_sample(path: str):
    raw = torch.load(path, weights_only=True)
    return raw["x"], raw["y"], raw["id"]


def make_data(data_dir: str, n: int = 48) -> None:
    os.makedirs(data_dir, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        x = torch.randn(8, generator=g)
        torch.save({"x": x, "y": x.sum(0, keepdim=True) * 0.5, "id": i},
                   os.path.join(data_dir, f"s{i:03d}.pt"))


class Net(pl.LightningModule):
    def __init__(self, log_path: str):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 1))
        self.log_path = log_path

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(f"{self.global_step} {' '.join(str(int(i)) for i in ids)}\n")
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)]


class Kill(pl.Callback):
    def __init__(self, at: int):
        self.at = at

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == self.at and trainer.global_rank == 0:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--root", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--samples", default="")
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--plugin", default="cairn")
    p.add_argument("--memory", type=int, default=1)
    a = p.parse_args()
    if a.samples and int(os.environ.get("RANK", "0")) != 0:
        a.samples = f"{a.samples}.rank{os.environ['RANK']}"
    pl.seed_everything(0, verbose=False)
    ds = cairn.data.CachedFileDataset(a.data, cache_dir=os.path.join(a.ckpt_dir, "..", "cache"),
                                      shuffle=True, seed=3, transform=read_sample)
    loader = cairn.data.DataLoader(ds, batch_size=4)
    plugins = []
    if a.plugin == "cairn":
        plugins.append(cairn.lightning.CheckpointIO(a.root, memory=bool(a.memory)))
    ckpt = ModelCheckpoint(dirpath=a.ckpt_dir, every_n_train_steps=a.every, monitor="step",
                           mode="max", save_top_k=2, save_last=True)
    callbacks = [ckpt] + ([Kill(a.kill_at)] if a.kill_at >= 0 else [])
    trainer = pl.Trainer(max_epochs=a.epochs, accelerator="cpu", devices=a.devices,
                         strategy="ddp" if a.devices > 1 else "auto",
                         use_distributed_sampler=False, plugins=plugins, callbacks=callbacks,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         deterministic=True, num_sanity_val_steps=0)
    model = Net(a.samples)
    trainer.fit(model, train_dataloaders=loader, ckpt_path="last")
    if a.out and trainer.global_rank == 0:
        torch.save(model.state_dict(), a.out)


if __name__ == "__main__":
    main()
