#!/usr/bin/env python
"""Blocking time of one checkpoint save inside Lightning and the Hugging Face
Trainer: cairn's plug-ins against each framework's default, same model, same state.

    PYTHONPATH=python .venv/bin/python bench/frameworks.py [--runs 5] [--dir /tmp/x]

Lightning: ``trainer.save_checkpoint(path)`` of an MLP (``--mlp-mb`` of fp32 weights,
Adam state on top) after one fit step, with TorchCheckpointIO (torch.save, the
default) and with cairn.lightning.CheckpointIO (staged to shared memory; the
background persist is waited for between saves, outside the timing).
HF: ``Trainer._save_checkpoint`` (what ``save_steps`` runs) of a GPT-2 built
locally (``--gpt-layers`` x ``--gpt-embd``), transformers.Trainer (safetensors +
torch.save of optimizer, scheduler, RNG, trainer_state.json) against cairn.hf.Trainer.
Prints the median of ``--runs`` saves (after one warm-up save) for each."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch


def _median(xs):
    return statistics.median(xs)


def bench_lightning(root: str, runs: int, mlp_mb: int) -> dict[str, float]:
    import pytorch_lightning as pl

    import cairn.lightning

    width = int((mlp_mb * (1 << 20) / 4 / 2) ** 0.5)

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(width, width)
            self.b = torch.nn.Linear(width, width)

        def training_step(self, batch, _):
            return self.b(self.a(batch[0])).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    out = {}
    for name in ("default", "cairn"):
        d = os.path.join(root, f"pl_{name}")
        io = cairn.lightning.CheckpointIO(os.path.join(d, "cairn")) if name == "cairn" else None
        trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, plugins=[io] if io else [])
        data = torch.utils.data.TensorDataset(torch.randn(4, width))
        trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=4))
        times = []
        for i in range(runs + 1):
            t = time.perf_counter()
            trainer.save_checkpoint(os.path.join(d, f"s{i}.ckpt"))
            times.append(time.perf_counter() - t)
            if io is not None:
                io.manager.wait()  # persist outside the timing
        if io is not None:
            io.teardown()
        out[name] = _median(times[1:])
    return out


def bench_hf(root: str, runs: int, layers: int, embd: int) -> dict[str, float]:
    import transformers

    import cairn.hf

    out = {}
    for name in ("default", "cairn"):
        cfg = transformers.GPT2Config(vocab_size=8192, n_positions=128, n_embd=embd,
                                      n_layer=layers, n_head=8, bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, 8192, (8, 32))
        ds = [{"input_ids": x, "labels": x} for x in ids]
        args = transformers.TrainingArguments(
            output_dir=os.path.join(root, f"hf_{name}"), max_steps=1, save_strategy="no",
            report_to=[], use_cpu=True, per_device_train_batch_size=4, disable_tqdm=True,
            logging_strategy="no")
        cls = cairn.hf.Trainer if name == "cairn" else transformers.Trainer
        trainer = cls(model=model, args=args, train_dataset=ds)
        trainer.train()  # one step: the optimizer has its state
        times = []
        for i in range(runs + 1):
            trainer.state.global_step = 100 + i
            t = time.perf_counter()
            trainer._save_checkpoint(trainer.model, None)
            times.append(time.perf_counter() - t)
            if name == "cairn":
                trainer.cairn_manager.wait()
        if name == "cairn":
            trainer.cairn_manager.close()
        out[name] = _median(times[1:])
        nbytes = sum(p.numel() * 4 for p in model.parameters())
        out["state_mb"] = round(3 * nbytes / 2**20, 1)  # weights + Adam's two moments
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--dir", default=None)
    p.add_argument("--mlp-mb", type=int, default=64)
    p.add_argument("--gpt-layers", type=int, default=4)
    p.add_argument("--gpt-embd", type=int, default=512)
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    root = a.dir or tempfile.mkdtemp(prefix="cairn_bench_fw_")
    try:
        pl = bench_lightning(root, a.runs, a.mlp_mb)
        print(f"lightning  state {a.mlp_mb * 3} MB  save_checkpoint blocking, median of {a.runs}: "
              f"default {pl['default'] * 1e3:.1f} ms, cairn {pl['cairn'] * 1e3:.1f} ms "
              f"({pl['default'] / pl['cairn']:.1f}x less)")
        hf = bench_hf(root, a.runs, a.gpt_layers, a.gpt_embd)
        print(f"hf trainer state {hf['state_mb']} MB  _save_checkpoint blocking, median of "
              f"{a.runs}: default {hf['default'] * 1e3:.1f} ms, cairn {hf['cairn'] * 1e3:.1f} ms "
              f"({hf['default'] / hf['cairn']:.1f}x less)")
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
