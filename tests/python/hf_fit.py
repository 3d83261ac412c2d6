"""A tiny Hugging Face Trainer run for tests/python/test_hf.py (run as a script): a
2-layer GPT-2 built from a local config (no download), checkpointed through
cairn.hf.Trainer (or transformers.Trainer with --plugin default).

Writes every step's sample ids to --log ("global_step id id ..."), the final
weights to --out, and kills itself with SIGKILL at the start of step --kill-at."""

import argparse
import os
import signal
import sys

import torch
import transformers

import cairn.hf


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, length: int = 16, vocab: int = 64):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i], "idx": torch.tensor(i)}


def tiny_gpt2(seed: int = 0) -> transformers.GPT2LMHeadModel:
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


class Logged:
    """compute_loss that records each batch's sample ids (and drops them)."""

    log_path = ""

    def compute_loss(self, model, inputs, *args, **kwargs):
        ids = inputs.pop("idx")
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(f"{self.state.global_step} {' '.join(str(int(i)) for i in ids)}\n")
        return super().compute_loss(model, inputs, *args, **kwargs)


class CairnRun(Logged, cairn.hf.Trainer):
    pass


class DefaultRun(Logged, transformers.Trainer):
    pass


class Kill(transformers.TrainerCallback):
    def __init__(self, at: int):
        self.at = at

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", required=True)
    p.add_argument("--out", default=None)
    p.add_argument("--log", default="")
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--plugin", default="cairn")
    p.add_argument("--memory", type=int, default=1)
    p.add_argument("--resume", type=int, default=1)
    a = p.parse_args()
    args = transformers.TrainingArguments(
        output_dir=a.out_dir, num_train_epochs=2, per_device_train_batch_size=4,
        learning_rate=1e-3, save_strategy="steps", save_steps=3, save_total_limit=2,
        logging_strategy="no", report_to=[], seed=0, use_cpu=True,
        dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True)
    kw = dict(model=tiny_gpt2(), args=args, train_dataset=Tokens(),
              callbacks=[Kill(a.kill_at)] if a.kill_at >= 0 else [])
    if a.plugin == "cairn":
        trainer = CairnRun(**kw, cairn_options={"memory": bool(a.memory)})
    else:
        trainer = DefaultRun(**kw)
    trainer.log_path = a.log
    has_ckpt = os.path.isdir(a.out_dir) and transformers.trainer_utils.get_last_checkpoint(a.out_dir)
    trainer.train(resume_from_checkpoint=True if (a.resume and has_ckpt) else None)
    if a.out:
        torch.save(trainer.model.state_dict(), a.out)


if __name__ == "__main__":
    main()
