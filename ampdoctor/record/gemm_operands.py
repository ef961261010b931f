"""GEMM operands: what an FP8 recipe would cast, per GEMM layer, recorded at ``level="full"`` for
``ampdoctor fp8`` (docs/numerics.md, FP8 readiness).

A GEMM layer (``nn.Linear``, ``nn.Conv1d/2d/3d``, transformers' ``Conv1D``) multiplies three
tensors that FP8 training casts: its input activation and its weight (forward), and the gradient
w.r.t. its output (backward). Tensorwise recipes scale each from an amax: this step's (current
scaling) or the largest of earlier ones (delayed scaling, TransformerEngine's amax history). So
what predicts them is each operand's amax at *every* pass (the history, and whether a step's
amax exceeded it) and, on module-sampled steps, its distribution finely enough to place a flush
threshold (:mod:`ampdoctor.stats.fine_hist`).

Per step, from the module taps (:mod:`ampdoctor.record.hooks`): at each training call of a GEMM layer (its
forward pre-hook, grad enabled) its input and, at its first call in the step (training or not), its
weight, as the forward is about to use them (after the optimizer step; under FSDP the unsharded weight, which is
only materialised then); and each call's output gradient (the tap's own gradient hook hands it on).
One ``(min, max)`` each, through a :class:`~ampdoctor.record.light_taps.LightTaps` of their own that shares
the flight recorder's repeat check: an input that is the previous tapped output, and a gradient the
flight recorder has just reduced, cost no kernel. Module-sampled steps add a fine histogram of each
(at most :data:`MAX_FINE_HISTS` a step) and, on the steps of the ``module_every`` cadence (not the
escalated ones: they come in runs of 20 after every skipped step), its block statistics
(:mod:`ampdoctor.stats.block_stats`: what MXFP8, MXFP4 and NVFP4 would make of it; at most
:data:`MAX_BLOCK_STATS` a step), each with its blocks along the reduction dimension of the GEMM that
reads it first (:func:`block_view`). Nothing here syncs; the peaks ride the step's copy to the host
(:mod:`ampdoctor.record.records`).

Limits: inputs are the first positional argument (or ``input=``/``x=``; float8 and sparse ones are
not observed); inputs of a forward that began under ``torch.no_grad()`` (a validation pass: grad mode
at the outermost tapped call) are not training passes and are not observed (a reentrant checkpoint
or a frozen block under ``no_grad`` inside a training forward is; a checkpoint's recomputation in
backward is not observed again); a weight under ``torch.nn.utils.parametrize`` is not read (evaluating it outside
the forward runs its parametrization: ``spectral_norm``'s power iteration would change training);
a layer whose forward is not called as a module (``nn.MultiheadAttention``'s ``out_proj``) has no
rows; convolutions have no block statistics (no block-format recipe converts them).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from .call_graph import ModuleCall
from .light_taps import LightTaps, Repeat
from .records import GemmRecord
from ..stats.block_stats import packed_block_stats
from ..stats.fine_hist import fine_hist

INPUT, WEIGHT, GRAD = "gemm_input", "gemm_weight", "gemm_grad_output"  # schema.GEMM_KINDS
MAX_FINE_HISTS = 4096  # fine histograms kept per step (16 KiB each on the device: 64 MiB at most)
MAX_BLOCK_STATS = 2048  # block statistics kept per step (25 KiB each on the device: 51 MiB at most)

_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def is_gemm(module: nn.Module) -> bool:
    """Whether ``module`` is a layer whose forward is one GEMM (or a convolution, which FP8 recipes
    could lower to one) of its input and its ``weight``. Reads no weight (a parametrized one would
    be computed)."""
    if isinstance(module, (nn.Linear, *_CONVOLUTIONS)):
        return True
    # transformers' Conv1D (GPT-2): a linear layer with its weight stored transposed; known by its
    # output width `nf` (under FSDP1 its weight is a flat parameter's view, not a 2-D parameter)
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def layer_weight(module: nn.Module) -> torch.Tensor | None:
    """The weight a GEMM layer's forward is about to use, as this rank holds it (an FSDP2 DTensor
    shard's local tensor), or None where reading it would compute it (a parametrized weight) or
    there is none."""
    if parametrize.is_parametrized(module, "weight"):
        return None
    weight = module._parameters.get("weight")
    if weight is None:  # (FSDP1 without use_orig_params: a plain tensor attribute, a view into its flat parameter)
        weight = module.__dict__.get("weight")
    if weight is None:
        return None
    to_local = getattr(weight, "to_local", None)
    weight = to_local() if to_local is not None else weight
    return weight if weight.is_floating_point() and weight.numel() else None


def block_view(module: nn.Module, kind: str, tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` (an operand of ``module`` of row kind ``kind``) with the reduction dimension of
    the GEMM that reads it first last, as block formats block it: a Linear's input and weight
    (``[out, in]``) and its output gradient (the input gradient's GEMM reduces over the outputs) as
    they are; transformers' ``Conv1D`` stores its weight ``[in, out]``: transposed (a view). None
    for a convolution (neither torchao nor TransformerEngine converts one) or a weight of another
    shape (FSDP1's flat views)."""
    if isinstance(module, _CONVOLUTIONS):
        return None
    if kind == WEIGHT and not isinstance(module, nn.Linear):  # (Conv1D, is_gemm's other kind)
        return tensor.t() if tensor.dim() == 2 else None
    return tensor


class GemmOperands:
    """The GEMM operands of the step in progress. Training thread and autograd threads; no sync."""

    def __init__(self, layers: dict[str, nn.Module], repeat: Repeat, limit: int,
                 inv_scale: Callable[[torch.device], torch.Tensor | None]) -> None:
        self.layers = layers                                  # name -> module
        self._taps = LightTaps(limit, repeat)
        self._inv_scale = inv_scale
        self.dropped_hists = 0
        self.dropped_blocks = 0          # block statistics not kept (beyond MAX_BLOCK_STATS), over the run
        self.blocks_failed: str | None = None  # why block statistics stopped, if they did
        self.start(False)

    def start(self, sampled: bool, blocks: bool = False) -> None:
        """A new step; ``sampled``: a module-sampled step (fine histograms); ``blocks``: block
        statistics too. No sync."""
        self._sampled = sampled
        self._blocks_on = sampled and blocks and self.blocks_failed is None
        self._called: set[str] = set()                          # layers whose weight the step has
        self._hists: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (kind, call, order) -> (counts, zeros)
        self._blocks: dict[tuple, torch.Tensor] = {}            # (kind, call, order) -> packed block statistics
        self._block_slots: set[tuple] = set()                   # (kind, layer) with a pass this step

    def input(self, call: ModuleCall, module: nn.Module, x: torch.Tensor | None, training: bool) -> None:
        """A call of a GEMM layer begins with input ``x`` (its forward pre-hook): observed when
        ``training`` (grad enabled); at the layer's first call in the step, its weight too, in any
        case (the same weight: nothing steps the optimizer in between). No sync."""
        if training and x is not None:
            self._taps.add(INPUT, call, -1, x)
            if self._sampled:
                self._histogram((INPUT, call.call, -1), x, module=module, name=call.name)
        if call.name not in self._called:
            self._called.add(call.name)
            weight = layer_weight(module)
            if weight is not None:
                self._taps.add(WEIGHT, call, -1, weight)
                if self._sampled:
                    self._histogram((WEIGHT, call.call, -1), weight, module=module, name=call.name)

    def grad(self, call: ModuleCall, order: int, grad: torch.Tensor) -> None:
        """The gradient w.r.t. the output of GEMM call ``call`` (still scaled). No sync."""
        self._taps.add(GRAD, call, order, grad)
        if self._sampled:
            self._histogram((GRAD, call.call, order), grad, self._inv_scale(grad.device),
                            module=self.layers.get(call.name), name=call.name)

    @property
    def dropped(self) -> int:
        """Peaks not kept this step (beyond the per-step limit), until :meth:`finish`."""
        return self._taps.dropped

    def _histogram(self, key: tuple, tensor: torch.Tensor, inv: torch.Tensor | None = None, *,
                   module: nn.Module | None, name: str) -> None:
        """``key``: (kind, call, backward order or -1), as the row's (a gradient that arrives
        twice, under ``retain_graph``, is two rows)."""
        if len(self._hists) >= MAX_FINE_HISTS:
            self.dropped_hists += 1
            return
        self._hists[key] = fine_hist(tensor, inv)
        if self._blocks_on and module is not None:
            self._block_stats(key, name, module, tensor, inv)

    def _block_stats(self, key: tuple, name: str, module: nn.Module, tensor: torch.Tensor,
                     inv: torch.Tensor | None) -> None:
        """One pass per (layer, kind) a step (the first to arrive: an input's and a weight's at the
        first call, an output gradient's normally at the last, backward running in reverse; the
        verdicts read the worst pass, and a layer called many times would crowd others out), at most :data:`MAX_BLOCK_STATS`;
        a failure (an op the backend lacks, out of memory) stops block statistics for the run, not
        the module taps (``blocks_failed`` says why)."""
        kind = key[0]
        slot = (kind, name)
        if slot in self._block_slots:
            return
        if len(self._blocks) >= MAX_BLOCK_STATS:
            self.dropped_blocks += 1
            return
        view = block_view(module, kind, tensor)
        if view is None or not view.numel():  # (an expert without tokens leaves the slot to a later call)
            return
        try:
            self._blocks[key] = packed_block_stats(view, inv)
        except Exception as exc:  # noqa: BLE001 - block statistics are an extra; training goes on
            self.blocks_failed = f"{type(exc).__name__}: {exc}".splitlines()[0]
            self._blocks_on = False
            return
        self._block_slots.add(slot)

    def finish(self, step: int) -> GemmRecord | None:
        """The step's operands (device tensors, to be copied to the host), or None when no GEMM
        layer ran; starts nothing (call :meth:`start`). A few launches; no sync."""
        light = self._taps.flight_step(step)
        if light is None:
            return None
        device = light.peaks.device
        hists = list(self._hists.values())
        blocks = list(self._blocks.values())
        return GemmRecord(
            taps=light.taps, peaks=light.peaks, hist_keys=list(self._hists),
            hists=torch.stack([h.to(device, non_blocking=True) for h, _ in hists]) if hists else None,
            zeros=torch.stack([z.to(device, non_blocking=True) for _, z in hists]) if hists else None,
            block_keys=list(self._blocks),
            blocks=torch.stack([b.to(device, non_blocking=True) for b in blocks]) if blocks else None)
