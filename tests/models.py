"""Tiny deterministic models and training loops shared by the tests (widths 8-64: fp16 on CPU is slow)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, width: int = 32, d_out: int = 4, act: type = nn.Tanh) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, width)
        self.norm = nn.LayerNorm(width)
        self.act = act()
        self.fc2 = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.norm(self.fc1(x))))


class SparseEmbeddingModel(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, sparse=True)
        self.fc = nn.Linear(d, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(idx).mean(1))


class TwoHeads(nn.Module):
    """A trunk with two heads, trained by two optimizers on two losses."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.head_a = nn.Linear(32, 4)
        self.head_b = nn.Linear(32, 2)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.head_a(h), self.head_b(h)


def batches(n: int, *, seed: int = 0, batch: int = 8, d_in: int = 16, d_out: int = 4):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=gen), torch.randn(batch, d_out, generator=gen))
            for _ in range(n)]


def mse(model, x, y, dtype=torch.float16, device="cpu"):
    with torch.autocast(device, dtype=dtype):
        out = model(x)
    return F.mse_loss(out.float(), y)
