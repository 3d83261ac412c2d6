#!/usr/bin/env python
"""The Hugging Face Trainer on cairn: async, tiered, verified checkpoints and an exact
resume of a (tiny, locally built) GPT-2.

The only change to a Trainer script is the class (a mixin over transformers.Trainer):

    trainer = cairn.hf.Trainer(model, args, train_dataset=ds, cairn_root=root)
    trainer.train(resume_from_checkpoint=True)      # as before

save_steps / save_total_limit keep their meaning; checkpoint-N/ directories hold a
pointer and trainer_state.json, the tensors live in cairn's tiers. Kill it while it
trains and run it again: it resumes bit-for-bit. Export the result for serving with
    cairn export /tmp/cairn_hf/cairn --safetensors /tmp/cairn_hf/model
    python examples/hf_train.py [--dir /tmp/cairn_hf] [--root s3://bucket/prefix]
"""

import argparse
import os

import torch
import transformers

import cairn.export
import cairn.hf


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=512, length=64, vocab=256):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="/tmp/cairn_hf")
    p.add_argument("--root", default=None, help="durable tier (default: <dir>/cairn)")
    a = p.parse_args()
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2,
                                  n_head=2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(
        output_dir=a.dir, num_train_epochs=2, per_device_train_batch_size=16,
        learning_rate=1e-3, save_steps=10, save_total_limit=2, report_to=[], use_cpu=True,
        logging_steps=10, seed=0)
    trainer = cairn.hf.Trainer(model=model, args=args, train_dataset=Tokens(),
                               cairn_root=a.root, cairn_options={"memory": True})
    resume = transformers.trainer_utils.get_last_checkpoint(a.dir) if os.path.isdir(a.dir) else None
    trainer.train(resume_from_checkpoint=True if resume else None)
    root = a.root or os.path.join(a.dir, "cairn")
    files = cairn.export.to_safetensors(root, os.path.join(a.dir, "model"))
    cfg.save_pretrained(os.path.join(a.dir, "model"))
    print("exported", files)


if __name__ == "__main__":
    main()
