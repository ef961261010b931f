"""The light module observations of one step, the flight recorder's: per tapped tensor one
``aminmax`` on the device and what its row needs, and at the step's end the peak of each.

Every tapped module's output and output gradient pass through here on the steps between module
samples, so what is done per tensor is kept to the least: one ``aminmax`` (one kernel; no other
device work per tensor), and one ``list.extend`` of its facts and extremes, in a flat list per
dtype. A flat list makes no Python object per tensor that lives until the step ends: such
objects are what sets off Python's garbage collector (docs/benchmarks.md). Per dtype, because
``torch.stack`` of 0-dim tensors of mixed dtypes is about four times slower than of one dtype
(autocast mixes them: bf16 linears, fp32 norms). The :class:`~ampdoctor.record.records.TapObservation`
of each tensor is made only if its step is written, on the writer thread (:func:`observations`).

A tensor seen twice in a row is reduced once (:class:`Repeat`): a model that returns its head's
output (the logits, the largest tensor of a language model, forward and backward), a block that
returns its last child's output, a gradient that an addition hands unchanged to a tapped branch.

The one ``extend`` per tensor is atomic under the GIL: taps on two autograd threads never
interleave their entries. Nothing here syncs.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from .call_graph import ModuleCall
from ..float_formats import dtype_name
from .records import FlightStep, TapObservation
from ..stats import extremes, peaks_of_pairs

FIELDS = 7          # entries per tensor in a flat list: kind, call, order, torch dtype, numel, min, max
_LOW, _HIGH = 5, 6  # the extremes' places; None once the step's peaks are made from them


class Repeat:
    """The statistics of the last tensor the taps saw, for the same tensor seen next: the repeats
    above come one right after the other (a module returns, then its parent returns the same
    tensor; two node pre-hooks on one node, or the consumer of an addition run next in
    backward). Only the last one is kept: no lookup table, nothing that outlives the step but
    one small tuple. The tensor is recognised by a weak reference and its version counter (an
    id is reused once a tensor is freed; an in-place op bumps the version); none is held. A
    race between two autograd threads can only miss a repeat. Limit: a write that does not move
    the version counter (through ``.data``, a numpy view, a kernel writing by ``data_ptr``)
    between the two observations goes unseen, as it does for autograd. No sync."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple | None = None

    def of(self, tensor: torch.Tensor, compute: Callable[[torch.Tensor], Any]) -> Any:
        """``compute(tensor)``, or what it returned for this tensor, unchanged, just before."""
        last = self._last
        if last is not None and last[0]() is tensor and last[1] == tensor._version:
            return last[2]
        value = compute(tensor)
        self._last = (weakref.ref(tensor), tensor._version, value)
        return value

    def clear(self) -> None:
        """Forget the last tensor (a new step). No sync."""
        self._last = None


class LightTaps:
    """The light observations of the step in progress."""

    def __init__(self, limit: int, repeat: Repeat | None = None) -> None:
        self._limit = limit  # tensors kept per step; more are counted in ``dropped``
        self._groups: dict[torch.dtype, list] = {}  # dtype -> flat list (FIELDS entries per tensor)
        self._count = 0
        self.repeat = repeat or Repeat()  # (shared with the GEMM operands': gemm_operands.py)
        self.dropped = 0

    def add(self, kind: str, call: ModuleCall, order: int, tensor: torch.Tensor) -> None:
        """Keep ``tensor``'s extremes (one ``aminmax``, none for a repeat) and facts. No sync."""
        if self._count >= self._limit:
            self.dropped += 1
            return
        self._count += 1  # (two autograd threads may race here: the limit is a bound, not exact)
        dtype = tensor.dtype
        group = self._groups.get(dtype)
        if group is None:
            group = self._groups.setdefault(dtype, [])
        group.extend((kind, call, order, dtype, tensor.numel(), *self.repeat.of(tensor, extremes)))

    def flight_step(self, step: int) -> FlightStep | None:
        """The step's observations with their peaks, for the flight recorder, or None if there
        were none; starts the next step. A stack per dtype, then one of each op for all of them
        (no sync)."""
        groups, self._groups, self._count, self.dropped = self._groups, {}, 0, 0
        self.repeat.clear()
        if not groups:
            return None
        flat: list = []
        stacked = []
        device = None
        for group in groups.values():
            lows = group[_LOW::FIELDS]
            device = device or lows[0].device
            pairs = [None] * (2 * len(lows))
            pairs[0::2], pairs[1::2] = lows, group[_HIGH::FIELDS]
            stacked.append(_stack(pairs, device))
            group[_LOW::FIELDS] = group[_HIGH::FIELDS] = [None] * len(lows)  # the step does not keep them
            flat += group
        # (cat promotes to the widest dtype)
        values = stacked[0] if len(stacked) == 1 else torch.cat([v.to(device, non_blocking=True) for v in stacked])
        return FlightStep(step, flat, peaks_of_pairs(values), None)


def _stack(values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``values`` (0-dim) stacked; on ``device`` if they are on several (a model split over
    devices: ``torch.stack`` refuses them). No sync."""
    try:
        return torch.stack(values)
    except RuntimeError:
        return torch.stack([v.to(device, non_blocking=True) for v in values])


def observations(flat: list) -> list[TapObservation]:
    """The observations of a flight step's flat list (writer thread; statistics None). Reads
    no tensor."""
    facts = [flat[i::FIELDS] for i in range(_LOW)]
    return [TapObservation(kind, call, order, dtype_name(dtype), numel, None)
            for kind, call, order, dtype, numel in zip(*facts)]
