#!/usr/bin/env python
"""PyTorch Lightning on cairn: async, tiered, verified checkpoints and an exact resume.

The only change to a Lightning script is the plug-in (and a cairn.data.DataLoader
for a mid-epoch exact resume; under DDP also use_distributed_sampler=False):

    trainer = pl.Trainer(..., plugins=[cairn.lightning.CheckpointIO(root)])
    trainer.fit(model, loader, ckpt_path="last")

Run it, kill it (Ctrl-C or kill -9) while it trains, run it again: it resumes from
the newest checkpoint (from shared memory if the node survived), as if never stopped.
    python examples/lightning_train.py [--dir /tmp/cairn_lightning] [--root s3://b/p]
"""

import argparse
import os

import torch

import cairn.data
import cairn.lightning
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint


def read_sample(path):
    return torch.load(path, weights_only=True)


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 1))

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="/tmp/cairn_lightning")
    p.add_argument("--root", default=None, help="durable tier (default: <dir>/ckpt/cairn)")
    p.add_argument("--epochs", type=int, default=3)
    a = p.parse_args()
    data = os.path.join(a.dir, "data")
    if not os.path.isdir(data):  # a small synthetic data set, one file per sample
        os.makedirs(data)
        g = torch.Generator().manual_seed(0)
        for i in range(512):
            x = torch.randn(32, generator=g)
            torch.save({"x": x, "y": x[:4].sum(0, keepdim=True)}, f"{data}/{i:05d}.pt")
    pl.seed_everything(0)
    ds = cairn.data.CachedFileDataset(data, cache_dir=os.path.join(a.dir, "cache"),
                                      shuffle=True, seed=0, transform=read_sample)
    loader = cairn.data.DataLoader(ds, batch_size=16, num_workers=2)
    trainer = pl.Trainer(
        max_epochs=a.epochs, accelerator="cpu", devices=1, logger=False,
        plugins=[cairn.lightning.CheckpointIO(a.root, memory=True)],
        callbacks=[ModelCheckpoint(dirpath=os.path.join(a.dir, "ckpt"), every_n_train_steps=10,
                                   save_top_k=2, monitor="step", mode="max", save_last=True)])
    trainer.fit(Regressor(), train_dataloaders=loader, ckpt_path="last")
    print("done at step", trainer.global_step)


if __name__ == "__main__":
    main()
