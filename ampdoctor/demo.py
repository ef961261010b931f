"""The built-in demo: a small GPT-like transformer trained with fp16 AMP on synthetic data."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

DEFAULT_PATH = "ampdoctor-demo.parquet"


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 64, layers: int = 2, heads: int = 4, context: int = 32):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def synthetic_batch(gen: torch.Generator, batch: int, context: int, vocab: int, device) -> tuple:
    """Sequences that count upward modulo ``vocab`` from a random start: learnable, so the loss falls."""
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    step = torch.randint(1, 4, (batch, 1), generator=gen)
    seq = (start + step * torch.arange(context + 1)) % vocab
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


@dataclass
class DemoResult:
    path: str
    steps: int
    device: str
    final_loss: float
    final_scale: float


def run_demo(path: str | os.PathLike = DEFAULT_PATH, *, steps: int | None = None, device: str | None = None,
             seed: int = 0, progress: Callable[[int], None] | None = None) -> DemoResult:
    """Train the demo model with ``ampdoctor.GradScaler`` and write a run to ``path``.

    CUDA when available (fp16 autocast, a larger model), else the CPU (fp16 autocast, tiny model
    so that it finishes in well under a minute). ``progress(n)`` is called after every step."""
    from .scaler import GradScaler

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = device == "cpu"
    steps = steps or (150 if cpu else 500)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab, context = 64, (16 if cpu else 128)
    model = TinyGPT(vocab=vocab, d=32 if cpu else 256, layers=2 if cpu else 4, heads=4,
                    context=context).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    batch = 16 if cpu else 32
    loss_value = math.nan
    with GradScaler(device, model=model, path=path, amp_dtype=torch.float16) as scaler:
        for i in range(steps):
            x, y = synthetic_batch(gen, batch, context, vocab, device)
            with torch.autocast(device, dtype=torch.float16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, vocab), y.reshape(-1))
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            if progress is not None:
                progress(1)
        loss_value = float(loss.detach())
        final_scale = scaler.get_scale()
    return DemoResult(os.fspath(path), steps, device, loss_value, final_scale)
