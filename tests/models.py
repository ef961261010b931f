"""Tiny deterministic models and training loops shared by the tests (widths 8-64: fp16 on CPU is slow)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


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


# -- models for the module taps (tests/test_hooks.py, tests/test_origins.py) -------------------

class Amplify(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor`` (1e8 overflows fp16)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()  # not a view: in-place ops after it stay legal

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class Gain(nn.Module):
    """Multiplies by a settable gain (a learned-temperature stand-in); keeps the input dtype."""

    def __init__(self, gain: float = 1.0) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x):
        return x * self.gain


class Boom(nn.Module):
    """A named submodule whose backward multiplies its gradient by ``factor``. With ``child``,
    the amplification is applied to its own Linear's output (so the first non-finite gradient
    is that child's output gradient); without, to its input."""

    def __init__(self, d: int, child: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d) if child else None
        self.factor = 1.0

    def forward(self, x):
        return Amplify.apply(self.lin(x) if self.lin is not None else x, self.factor)


class Inner(nn.Module):
    def __init__(self, d: int, child: bool) -> None:
        super().__init__()
        self.pre = nn.Linear(d, d)
        self.gain = Gain()
        self.boom = Boom(d, child)

    def forward(self, x):
        return self.boom(self.gain(self.pre(x)))


class Block(nn.Module):
    """ResNet-style: an in-place residual add, then an in-place ReLU, on the inner output."""

    def __init__(self, d: int, child: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.inner = Inner(d, child)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.inner(self.norm(x))
        h += x
        return self.act(h)


class DeepNet(nn.Module):
    """``blocks.1.inner.boom`` sits three levels deep, followed by an in-place residual add and
    an in-place ReLU; ``blocks.{i}.inner.gain`` can make an fp16 output overflow."""

    def __init__(self, d: int = 16, depth: int = 2, child: bool = True, d_out: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d, child) for _ in range(depth))
        self.head = nn.Linear(d, d_out)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def checkpointed(reentrant: bool) -> DeepNet:
    """A DeepNet whose blocks run under activation checkpointing (reentrant or not)."""
    class Checkpointed(DeepNet):
        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=reentrant)
            return self.head(x)

    return Checkpointed()


class CallAmplifier(nn.Module):
    """Like Boom, but amplifies only on call ``fire_on`` of each forward (``calls`` is reset by
    its owner)."""

    def __init__(self, fire_on: int = 1) -> None:
        super().__init__()
        self.factor = 1.0
        self.fire_on = fire_on
        self.calls = 0

    def forward(self, x):
        factor = self.factor if self.calls == self.fire_on else 1.0
        self.calls += 1
        return Amplify.apply(x, factor)


class SharedNet(nn.Module):
    """``shared`` is called twice per forward: ``tanh(inp) → shared → mid → shared → head``."""

    def __init__(self, d: int = 16, d_out: int = 4, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.shared = shared if shared is not None else Gain()
        self.mid = Gain()
        self.head = nn.Linear(d, d_out)

    def forward(self, x):
        if isinstance(self.shared, CallAmplifier):
            self.shared.calls = 0
        x = torch.tanh(self.inp(x))
        return self.head(self.shared(self.mid(self.shared(x))))


class WithHead(nn.Module):
    """``head(body(x))``: puts a module under test inside a model with a trainable head."""

    def __init__(self, body: nn.Module, d: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(d, d_out)

    def forward(self, x):
        return self.head(self.body(x))


class QuietMLP(nn.Module):
    """An MLP with a side branch scaled by ``quiet``: the branch's parameters get gradients that
    much smaller, so they underflow first at a low loss scale."""

    def __init__(self, d_in: int = 16, width: int = 32, d_out: int = 4, quiet: float = 1e-3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, width)
        self.fc2 = nn.Linear(width, d_out)
        self.side = nn.Linear(d_in, d_out)
        self.quiet = quiet

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) + self.side(x) * self.quiet


def train_recorded(path, *, steps: int = 150, loss_factor: float = 1.0, seed: int = 0, lr: float = 0.05,
                   model_factory=QuietMLP, **scaler_options) -> int:
    """Train ``model_factory()`` from ``seed`` with an ``ampdoctor.GradScaler`` (fp16 autocast on
    the CPU) recording to ``path``; returns the number of skipped steps."""
    import ampdoctor

    torch.manual_seed(seed)
    model = model_factory()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = ampdoctor.GradScaler("cpu", model=model, path=path, amp_dtype=torch.float16, **scaler_options)
    skipped = 0
    for x, y in batches(steps, seed=seed + 1):
        scaler.scale(mse(model, x, y) * loss_factor).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        opt.zero_grad(set_to_none=True)
    scaler.close()
    return skipped


def train_with_faults(path, model, *, steps: int = 30, lr: float = 0.01, seed: int = 1, init_scale=2.0**16,
                      before_step=None, corrupt_batch=None, optimizer=None, kill_at=None, **options):
    """fp16 AMP training of ``model`` on the CPU with an ``ampdoctor.GradScaler`` and faults
    injected at known steps: ``before_step(i)``, ``corrupt_batch(i, x, y)`` (returns x, y),
    ``optimizer(params)`` (builds the optimizer: a buggy one), and ``kill_at``: SIGKILL this
    process right after that step's ``update()``."""
    import os
    import signal

    import ampdoctor

    opt = optimizer(model.parameters()) if optimizer is not None else torch.optim.SGD(model.parameters(), lr=lr)
    scaler = ampdoctor.GradScaler("cpu", init_scale=init_scale, model=model, path=path, amp_dtype=torch.float16,
                                  **options)
    first = next(model.parameters())
    d_in = first.shape[1] if first.dim() == 2 else 16
    for i, (x, y) in enumerate(batches(steps, seed=seed, d_in=d_in)):
        if before_step is not None:
            before_step(i)
        if corrupt_batch is not None:
            x, y = corrupt_batch(i, x, y)
        scaler.scale(mse(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if kill_at is not None and i == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    scaler.close()
    return model


class NaNWritingSGD(torch.optim.SGD):
    """SGD whose step ``bad_step`` writes a NaN into the first element of parameter ``index``."""

    def __init__(self, params, lr=0.01, bad_step=10, index=-2):
        super().__init__(params, lr=lr)
        self.bad_step, self.index, self.count = bad_step, index, 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        if self.count == self.bad_step:
            self.param_groups[0]["params"][self.index].view(-1)[0] = float("nan")
        self.count += 1
        return loss


def set_at(obj, attr: str, value, steps, normal=1.0):
    """A ``before_step`` callback: ``obj.attr = value`` at the given step(s), ``normal`` otherwise."""
    steps = {steps} if isinstance(steps, int) else set(steps)

    def before_step(i):
        setattr(obj, attr, value if i in steps else normal)

    return before_step


def fit(model: nn.Module, scaler, data, *, before_step=None, dtype=torch.float16, lr: float = 0.01):
    """The plain AMP loop on the CPU: forward under autocast, scaled backward, step, update."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for i, (x, y) in enumerate(data):
        if before_step is not None:
            before_step(i)
        scaler.scale(mse(model, x, y, dtype)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return model


def train_ranks(path, run_id: str, ranks=(0, 1), **options) -> None:
    """Ranks of one run (``run_id``) recorded to ``path`` one after another, as processes of a
    job would (each its own seed): :func:`train_recorded` with ``rank=``, and ``options`` for
    every rank, or a callable ``options[name](rank)`` for one that differs between them."""
    import os

    before = os.environ.get("AMPDOCTOR_RUN_ID")
    os.environ["AMPDOCTOR_RUN_ID"] = run_id
    try:
        for rank in ranks:
            own = {k: v(rank) if callable(v) else v for k, v in options.items()}
            train_recorded(path, seed=rank, rank=rank, **own)
    finally:
        if before is None:
            del os.environ["AMPDOCTOR_RUN_ID"]
        else:
            os.environ["AMPDOCTOR_RUN_ID"] = before
