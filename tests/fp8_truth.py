"""Ground truth for FP8 readiness (issue 29), measured independently of ampdoctor: the operands of
every GEMM layer captured with this module's own hooks, cast to ``torch.float8_e4m3fn`` /
``torch.float8_e5m2`` under each scaling recipe, and their flushed and saturated elements counted.

Operands (what TransformerEngine and torchao's float8 convert, per GEMM layer): the input activation
and the weight in E4M3, the output gradient in E5M2 (``HYBRID``) or E4M3 (all-E4M3). GEMM layers:
``nn.Linear`` and, for GPT-2, transformers' ``Conv1D`` (a linear layer stored transposed); ``nn.Conv2d``
where a recipe would cover it (neither library converts convolutions today).

The cast is the libraries' (TE, torchao): ``(x.float() * scale).clamp(-max, max).to(dtype)``, never a
plain ``.to()`` (torch before 2.12 gives NaN above 464 in e4m3fn; e5m2 gives inf on every version).
An element is *flushed* when it is nonzero and its cast is 0; *saturated* when ``|x|`` exceeds the
amax the scale was made from (``|x| * scale`` beyond the maximum: the clamp cuts it; counted on ``|x|``,
since the amax element itself may land one float32 step above the maximum once scaled, which the
cast rounds back to it).

Recipes, with ``a_t`` the operand's amax at step ``t`` (one forward/backward pass):
* current (tensorwise dynamic): ``scale_t = max / a_t`` (1 when ``a_t`` is 0 or not finite): never saturates;
* delayed with history ``L`` (TransformerEngine's ``DelayedScaling``, margin 0, ``"max"``):
  ``scale_t = max / max(a_{t-L} .. a_{t-1})`` for ``t >= 1`` and ``scale_0 = 1``; a history whose
  maximum is 0 keeps the previous scale. Step ``t`` clips iff ``a_t`` exceeds the amax its scale
  was made from.

A step whose amax is not finite (the AMP run overflowed there: an fp16 step the scaler skipped) is
left out of every history and never clips: ampdoctor's rule (docs/numerics.md), which
TransformerEngine does not share (it keeps its scale while such an amax is in the history).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}
OPERANDS = ("input", "weight", "grad_output")


@dataclass
class Cast:
    """One operand of one layer at one step under one recipe: ``flushed`` and ``saturated`` of
    ``nonzero`` elements; ``clipped``: the step's amax exceeded what its scale allowed."""

    flushed: int
    saturated: int
    nonzero: int
    clipped: bool

    @property
    def flushed_share(self) -> float:
        return self.flushed / self.nonzero if self.nonzero else 0.0

    @property
    def saturated_share(self) -> float:
        return self.saturated / self.nonzero if self.nonzero else 0.0


def gemm_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers an FP8 recipe would convert, by qualified name."""
    kinds: tuple[type, ...] = (nn.Linear, nn.Conv2d)
    try:
        from transformers.pytorch_utils import Conv1D
        kinds += (Conv1D,)
    except ImportError:  # pragma: no cover
        pass
    return {name: m for name, m in model.named_modules() if isinstance(m, kinds)}


class OperandCapture:
    """Captures, per GEMM layer, the input activation, the weight and the output gradient of each
    call (float32 copies, detached), with hooks of its own; ``remove()`` in ``finally``."""

    def __init__(self, model: nn.Module) -> None:
        self.operands: dict[str, dict[str, list[torch.Tensor]]] = {}
        self._handles = []
        for name, layer in gemm_layers(model).items():
            slots = self.operands.setdefault(name, {k: [] for k in OPERANDS})
            self._handles.append(layer.register_forward_hook(self._hook(slots)))

    @staticmethod
    def _hook(slots):
        def hook(module, args, output):
            slots["input"].append(args[0].detach().float().clone())
            slots["weight"].append(module.weight.detach().float().clone())
            if output.requires_grad:
                output.register_hook(lambda g: slots["grad_output"].append(g.detach().float().clone()))
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def amax(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def cast(x: torch.Tensor, dtype: torch.dtype, scale: float, allowed: float) -> Cast:
    """``x`` cast to ``dtype`` with ``scale`` as the libraries cast it; ``allowed``: the amax the
    scale was made from (the format's maximum for a scale of 1)."""
    fmax = MAX[dtype]
    x = x.float()
    y = (x * torch.tensor(scale, dtype=torch.float32)).clamp(-fmax, fmax).to(dtype).float()
    nonzero = x != 0
    a = amax(x)
    return Cast(flushed=int((nonzero & (y == 0)).sum()), saturated=int((x.abs() > allowed).sum()),
                nonzero=int(nonzero.sum()), clipped=math.isfinite(a) and a > allowed)


def current_scaling(steps: list[torch.Tensor], dtype: torch.dtype) -> list[Cast]:
    """Each step's cast with the scale made from its own amax (torchao's dynamic scaling, TE's
    ``Float8CurrentScaling``)."""
    fmax = MAX[dtype]
    out = []
    for x in steps:
        a = amax(x)
        # (a zero or non-finite amax casts at scale 1, as TransformerEngine's compute_scale_from_amax)
        out.append(cast(x, dtype, _scale(fmax, a), a) if a > 0 and math.isfinite(a) else cast(x, dtype, 1.0, fmax))
    return out


def delayed_scaling(steps: list[torch.Tensor], dtype: torch.dtype, history: int) -> list[Cast]:
    """Each step's cast with TransformerEngine's delayed scale: from the maximum of the previous
    ``history`` steps' amaxes (1 at the first step; kept when that maximum is 0; non-finite amaxes left out)."""
    fmax = MAX[dtype]
    amaxes: list[float] = []
    scale, allowed = 1.0, fmax
    out = []
    for x in steps:
        finite = [a for a in amaxes[-history:] if math.isfinite(a)]
        if finite and max(finite) > 0:
            scale, allowed = _scale(fmax, max(finite)), max(finite)
        out.append(cast(x, dtype, scale, allowed))
        amaxes.append(amax(x))
    return out


def _scale(fmax: float, a: float) -> float:
    """``fmax / a`` in float32, as both libraries compute it (float32 overflow: its maximum)."""
    s = torch.tensor(fmax, dtype=torch.float32) / torch.tensor(a, dtype=torch.float32)
    return float(s) if math.isfinite(float(s)) else float(torch.finfo(torch.float32).max)


def run_steps(scaler, opt, loss_of, steps: int, *, dtype: torch.dtype = torch.float16, before=None,
              inject_inf_at: int | None = None) -> None:
    """``steps`` training steps of ``loss_of(step)`` under ``dtype`` autocast through ``scaler``
    (closed after, whatever happens): ``before(step)`` first; the loss times inf at
    ``inject_inf_at`` (a step the scaler skips)."""
    try:
        for step in range(steps):
            if before is not None:
                before(step)
            with torch.autocast("cpu", dtype=dtype):
                loss = loss_of(step)
            if step == inject_inf_at:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    finally:
        scaler.close()


def train_captured(arch, dtype: torch.dtype, path, steps: int, *, module_every: int, inject=None, lr: float = 3e-3,
                   init_scale: float = 2.0 ** 12, **options):
    """Train ``arch`` (tests/architectures.py) ``steps`` steps with AdamW in ``dtype`` autocast
    (float16: a real GradScaler; bfloat16: the scaler disabled), recorded by ampdoctor at
    ``level="full"`` (``module_every``, ``options``) while :class:`OperandCapture` captures every
    GEMM operand; ``inject(model, step)`` before a step. Returns the capture and each step's loss
    scale (1 for bf16)."""
    import ampdoctor

    model = arch.model
    fp16 = dtype == torch.float16
    scaler = ampdoctor.GradScaler("cpu", enabled=fp16, path=path, level="full", model=model,
                                  module_every=module_every, init_scale=init_scale, **options)
    capture = OperandCapture(model)
    scales = []

    def before(step):
        if inject is not None:
            inject(model, step)
        scales.append(float(scaler.get_scale()) if fp16 else 1.0)

    try:
        run_steps(scaler, torch.optim.AdamW(model.parameters(), lr=lr), lambda step: arch.loss(model, step), steps,
                  dtype=dtype, before=before)
    finally:
        capture.remove()
    return capture, scales


def plant_outliers(model: nn.Module) -> None:
    """Outliers as real models have them: one large weight (the first GEMM layer's that is not a
    convolution, x1000) and a massive activation channel (channel 3 of the input embedding, x100,
    carried by the residual stream; ViT: its patch embedding's bias)."""
    first = next(m for m in gemm_layers(model).values() if not isinstance(m, nn.Conv2d))
    with torch.no_grad():
        first.weight.view(-1)[0] *= 1000.0
        embedding = model.get_input_embeddings()
        if isinstance(embedding, nn.Embedding):
            embedding.weight[:, 3] *= 100.0
        else:
            embedding.projection.bias[3] += 100.0


def one_step_operands(arch, dtype: torch.dtype, planted: bool) -> list[tuple[str, torch.Tensor]]:
    """Every finite, not all-zero GEMM operand of one ``dtype`` autocast step of ``arch``
    (tests/architectures.py), captured by :class:`OperandCapture`: ``(layer.kind, float32 copy)``."""
    if planted:
        plant_outliers(arch.model)
    capture = OperandCapture(arch.model)
    try:
        with torch.autocast("cpu", dtype=dtype):
            loss = arch.loss(arch.model, 0)
        loss.float().backward()
    finally:
        capture.remove()
    return [(f"{layer}.{kind}", x) for layer, ops in capture.operands.items() for kind, xs in ops.items()
            for x in xs if x.numel() and bool(torch.isfinite(x).all()) and bool((x != 0).any())]
