"""What one training iteration observed, as it crosses from the training thread to the writer.

Tensors in these records live on the device until the recorder copies them to the host
(:mod:`ampdoctor.record.transfer`); the writer reads them only after the record's fence has passed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from .call_graph import ModuleCall
from ..stats import FullStats, LightStats
from .transfer import Fence


@dataclass
class GroupRecord:
    """The observed gradients of one (device, dtype) group of one optimizer."""

    names: list[str]
    dtype: str
    numels: np.ndarray
    stats: FullStats | LightStats     # full statistics when the plan says so, else light ones
    measured: torch.Tensor | None = None  # int64 [tensors]: measured underflow (-1: not measured); None: not a measured step
    lost: FullStats | None = None  # measured steps: full statistics of what underflowed (its histogram: underflow_hist)


@dataclass
class TapObservation:
    """One tensor seen by a module tap: an ``output`` or a ``grad_output``."""

    kind: str
    call: ModuleCall
    order: int
    dtype: str
    numel: int
    stats: FullStats | tuple | None   # full statistics, or the (min, max) extremes of light ones
    measured: torch.Tensor | None = None  # 0-dim int64 on the device: measured underflow (grad_output, measured steps)
    lost: FullStats | None = None  # measured steps: full statistics of what underflowed (underflow_hist)


@dataclass
class GemmRecord:
    """The GEMM operands of one step (:mod:`ampdoctor.record.gemm_operands`): the peak of each call's
    input and output gradient and of each called layer's weight (``taps``, flat as
    :mod:`ampdoctor.record.light_taps` keeps them; gradients still scaled) and, on module-sampled steps,
    fine histograms."""

    taps: list                        # flat, light_taps.FIELDS entries per input, weight or gradient
    peaks: torch.Tensor               # float32 [taps]
    hist_keys: list[tuple]            # (kind, call, backward order or -1) of each histogram
    hists: torch.Tensor | None        # int64 [hist_keys, FINE_BINS]: nonzero elements by fine bin (gradients unscaled)
    zeros: torch.Tensor | None        # int64 [hist_keys]: exact zeros
    block_keys: list[tuple] = field(default_factory=list)  # (kind, call, order) of each block statistics
    blocks: torch.Tensor | None = None  # float64 [block_keys, BLOCK_VALUES]: packed block statistics


@dataclass
class StepRecord:
    is_step: ClassVar[bool] = True  # the writer counts these when it cannot write them at exit
    step: int
    rank: int
    per_tensor: bool
    amp_dtype: str
    scalars: torch.Tensor | None      # see pack_scalars
    groups: list[GroupRecord] = field(default_factory=list)
    taps: list[TapObservation] = field(default_factory=list)  # full module statistics only
    tap_measured: torch.Tensor | None = None  # int64 [taps], host copy: each tap's measured underflow (-1: not)
    params: "ParamCheck | None" = None  # the parameter check after optimizer.step()
    gemm: GemmRecord | None = None    # the GEMM operands (level="full")
    event: Fence | None = None        # to wait on before reading (None: nothing to wait for)


@dataclass
class ParamCheck:
    """The parameter check: the peak ``max |w|`` of each parameter after ``optimizer.step()``
    (NaN/inf when it holds one)."""

    names: list[str]
    numels: list[int]
    peaks: torch.Tensor               # float32 [len(names)], on the device until copied


@dataclass
class ParamRecord:
    """A parameter check outside an iteration (at the end of the run): ``param`` rows only,
    carrying the scale and skipped flag of ``step``, the step that left the parameters so."""

    step: int
    rank: int
    amp_dtype: str
    scalars: torch.Tensor             # host scalars of ``step`` (see StepRecord)
    params: ParamCheck
    event: Fence | None = None


@dataclass
class FlightStep:
    """One step in the flight recorder: the peaks of its light module taps, ``peaks[i]`` of the
    ``i``-th tap (gradients still scaled by the step's scale)."""

    step: int
    taps: list                        # flat, light_taps.FIELDS entries per tap (light_taps.observations)
    peaks: torch.Tensor               # float32 [taps], on the device until dumped
    scalars: torch.Tensor | None      # the step's host scalars (see StepRecord)
    event: Fence | None = None        # the step's copy fence (its scalars)


@dataclass
class FlightRecord:
    """The flight recorder's steps, written out after an anomaly."""

    rank: int
    steps: list[FlightStep]
    event: Fence | None = None


class StepScalars(NamedTuple):
    """A step's scalars, read on the host (:func:`read_scalars`)."""

    scale: float
    skipped: bool
    loss: float | None        # None: no loss was passed to scale()
    param_peak: float | None  # the largest parameter peak; None: no parameter check in the step


def pack_scalars(scale: torch.Tensor, found_inf: torch.Tensor, loss: torch.Tensor, param_peak: torch.Tensor, *,
                 has_loss: bool, has_params: bool) -> torch.Tensor:
    """A step's scalars as one float32 vector on the device of the 0-dim ``loss``, the order
    :func:`read_scalars` decodes: one copy to the host for all of them. No sync."""
    flag = functools.partial(torch.full, (), dtype=torch.float32, device=loss.device)
    return torch.stack([scale, found_inf, loss.float(), flag(float(has_loss)), param_peak, flag(float(has_params))])


def read_scalars(scalars: torch.Tensor | None) -> StepScalars:
    """The :class:`StepScalars` of a host copy of :func:`pack_scalars`' vector (None: a step
    without scalars, scale 1)."""
    if scalars is None:
        return StepScalars(1.0, False, None, None)
    scale, found_inf, loss, has_loss, peak, has_params = (float(v) for v in scalars.tolist())
    return StepScalars(scale, found_inf > 0, loss if has_loss else None, peak if has_params else None)


def merge_params(parts: list[ParamCheck]) -> ParamCheck | None:
    """One :class:`ParamCheck` for the iteration (every optimizer and device), on one device."""
    parts = [p for p in parts if p.names]
    if not parts:
        return None
    device = parts[0].peaks.device
    return ParamCheck([n for p in parts for n in p.names], [k for p in parts for k in p.numels],
                      torch.cat([p.peaks.to(device, non_blocking=True) for p in parts]))
