"""What one training iteration observed, as it crosses from the training thread to the writer.

Tensors in these records live on the device until the recorder copies them to the host
(:mod:`ampdoctor.transfer`); the writer reads them only after the record's fence has passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .hooks import ModuleCall
from .stats import DeviceStats, LightStats
from .transfer import Fence

@dataclass
class GroupRecord:
    """The observed gradients of one (device, dtype) group of one optimizer."""

    names: list[str]
    dtype: str
    numels: np.ndarray
    stats: DeviceStats | LightStats   # full statistics on detailed steps, else light ones


@dataclass
class TapObservation:
    """One tensor seen by a module tap: an ``output`` or a ``grad_output``."""

    kind: str
    call: ModuleCall
    order: int
    dtype: str
    numel: int
    stats: DeviceStats | tuple | None  # full statistics, or the (min, max) pair of a light step


@dataclass
class StepRecord:
    step: int
    rank: int
    per_tensor: bool
    amp_dtype: str
    scalars: torch.Tensor | None      # float32 [scale, found_inf, loss, has_loss, param_peak, has_params]
    groups: list[GroupRecord] = field(default_factory=list)
    taps: list[TapObservation] = field(default_factory=list)  # detailed steps only
    params: "ParamPeaks | None" = None  # parameter peaks after optimizer.step()
    event: Fence | None = None        # to wait on before reading (None: nothing to wait for)


@dataclass
class ParamPeaks:
    """``max |w|`` of each parameter after ``optimizer.step()`` (NaN/inf when it holds one)."""

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
    params: ParamPeaks
    event: Fence | None = None


@dataclass
class LightStep:
    """A step's module peaks in the flight recorder: ``peaks[i]`` belongs to ``taps[i]``
    (gradients still scaled by the step's scale)."""

    step: int
    taps: list[TapObservation]
    peaks: torch.Tensor               # float32 [len(taps)], on the device until dumped
    scalars: torch.Tensor | None      # the step's host scalars (see StepRecord)
    event: Fence | None = None        # the step's copy fence (its scalars)


@dataclass
class FlightRecord:
    """The flight recorder's steps, written out after an anomaly."""

    rank: int
    steps: list[LightStep]
    event: Fence | None = None


def read_scalars(scalars: torch.Tensor | None) -> tuple[float, bool, float | None, float | None]:
    """(scale, skipped, loss or None, largest parameter peak or None) from a host copy of
    before_update's snapshot."""
    if scalars is None:
        return 1.0, False, None, None
    scale, found_inf, loss, has_loss, peak, has_params = (float(v) for v in scalars.tolist())
    return scale, found_inf > 0, (loss if has_loss else None), (peak if has_params else None)


def merge_params(parts: list[ParamPeaks]) -> ParamPeaks | None:
    """One :class:`ParamPeaks` for the iteration (every optimizer and device), on one device."""
    parts = [p for p in parts if p.names]
    if not parts:
        return None
    device = parts[0].peaks.device
    return ParamPeaks([n for p in parts for n in p.names], [k for p in parts for k in p.numels],
                      torch.cat([p.peaks.to(device, non_blocking=True) for p in parts]))
