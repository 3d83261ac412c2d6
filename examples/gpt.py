"""A small GPT-style language model and a synthetic corpus for the reference trainer.

The corpus is generated deterministically (no downloads): sentences from a tiny
grammar, tokenised at byte level and split into shard files of uint16 tokens, so the
data pipeline has real files to cache and the model has real structure to learn.
"""

from __future__ import annotations

import math
import os
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256  # byte-level


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, d: int = 128, layers: int = 2, heads: int = 4, seq_len: int = 64,
                 dropout: float = 0.1):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.drop = nn.Dropout(dropout)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


_SUBJECTS = ["the model", "a rank", "the optimizer", "every shard", "the cache", "a worker"]
_VERBS = ["saves", "loads", "restores", "verifies", "prefetches", "resumes"]
_OBJECTS = ["the checkpoint", "its state", "the manifest", "a tensor", "the next batch"]


def make_corpus(directory: str, num_files: int = 32, tokens_per_file: int = 16384,
                seed: int = 0) -> list[str]:
    """Writes `num_files` shard files of uint16 byte tokens into `directory` (once;
    existing complete files are kept) and returns their paths in order."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for i in range(num_files):
        path = os.path.join(directory, f"shard_{i:05d}.tok")
        paths.append(path)
        if os.path.exists(path) and os.path.getsize(path) == 2 * tokens_per_file:
            continue
        rng = random.Random(seed * 1_000_003 + i)
        text = bytearray()
        while len(text) < tokens_per_file:
            text += (f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} "
                     f"{rng.choice(_OBJECTS)} at step {rng.randrange(10000)}. ").encode()
        tmp = path + ".tmp"
        np.frombuffer(bytes(text[:tokens_per_file]), dtype=np.uint8).astype(np.uint16).tofile(tmp)
        os.replace(tmp, path)
    return paths


def load_windows(path: str, seq_len: int) -> torch.Tensor:
    """The (n, seq_len + 1) token windows of one shard file."""
    tokens = torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64))
    n = (tokens.numel() - 1) // seq_len
    return torch.stack([tokens[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)])


def cosine_lr(step: int, total: int, warmup: int = 10) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
