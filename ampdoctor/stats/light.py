"""Light statistics (:func:`light_stats`, every step): per tensor its peak magnitude and its L2
norm, unscaled; and the peaks alone, of parameters (:func:`tensor_peaks`, the parameter check)
and of module taps (:func:`extremes`, combined at the step's end by
:class:`ampdoctor.record.light_taps.LightTaps`).

A tensor's *peak* is its ``max |x|``: NaN if it held a NaN, else inf if it held an inf, so peaks
also see every non-finite value; 0 for an empty tensor (a rank that holds no shard). A handful of
grouped reductions, no elementwise temporaries on an accelerator: cheap enough for every step.
Nothing here syncs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .algorithms import choose_algorithm, rescaled_norm
from .host_stats import HostStats

# Peaks between which a float32 dot product of a tensor with itself is exact to float32 rounding
# (squares stay normal, sums of up to 2**40 of them finite).
_DOT_SAFE_BELOW, _DOT_SAFE_ABOVE = 1e-15, 1e15
# The host algorithm: tensors below this size are copied into one buffer (groups of at most
# HOST_GROUP_ELEMENTS) and reduced per segment there, a few ops for all of them; larger ones are
# reduced one by one (reading them in place beats a copy, and their kernels dwarf a dispatch).
# Measured crossover on a CPU core: about 8k elements.
HOST_SMALL_BELOW = 1 << 12
HOST_GROUP_ELEMENTS = 1 << 20


@dataclass
class LightStats:
    """Per-tensor peak magnitude and L2 norm, unscaled, on the device until copied."""

    peaks: torch.Tensor      # float32 [tensors]
    norms: torch.Tensor      # float32 [tensors]

    @property
    def device(self) -> torch.device:
        return self.peaks.device

    def to_host(self, copy) -> "LightStats":
        """The same statistics, each tensor passed through ``copy`` (a
        :meth:`ampdoctor.record.transfer.HostCopies.to_host`)."""
        return LightStats(copy(self.peaks), copy(self.norms))

    def decode(self) -> HostStats:
        """As :class:`HostStats` (light: peak as ``amax``, norm as ``l2``). Host tensors only."""
        return HostStats.light_only(self.peaks.numpy().astype(np.float32), self.norms.numpy().astype(np.float32))


def light_stats(tensors: Sequence[torch.Tensor], *, inv_scale: torch.Tensor | None,
                algorithm: str | None = None) -> LightStats:
    """Peak magnitude and L2 norm of each tensor (one device), unscaled by ``inv_scale`` (0-dim
    float32 on that device, or None): the every-step statistics. Grouped, so the ops dispatched
    do not grow with the number of tensors, except on the host one ``aminmax`` per tensor of
    ``HOST_SMALL_BELOW`` elements or more. ``"host"``: exact to float32 rounding (see
    :func:`_host_light`). ``"accelerator"``: torch's fused float32 norms, unrescaled (rescaling
    would need a look at the values, a sync): elements beyond ~1.8e19 may make a norm inf and a
    tensor of elements all below ~1e-19 may read 0. Does not sync."""
    if not tensors:
        raise ValueError("light_stats needs at least one tensor")
    algorithm = choose_algorithm(algorithm, tensors)
    with torch.no_grad():
        if algorithm == "host":
            norms, peaks = _host_light(tensors)
        else:
            norms = _float32_norms(tensors)
            peaks = tensor_peaks(tensors, norms, algorithm=algorithm)
        if inv_scale is not None:
            peaks, norms = peaks * inv_scale, norms * inv_scale  # as torch's unscale_: fp32 products
    return LightStats(peaks, norms)


def tensor_peaks(tensors: Sequence[torch.Tensor], norms: torch.Tensor | None = None, *,
                 algorithm: str | None = None) -> torch.Tensor:
    """float32 ``[len(tensors)]``: the peak of each tensor (one device). No sync.

    ``"host"``: see :func:`light_stats`. ``"accelerator"``: one fused inf-norm, with NaN made
    certain from the L2 norms (``norms``, computed if not given), which always propagate it."""
    algorithm = choose_algorithm(algorithm, tensors)
    with torch.no_grad():
        if algorithm == "host":
            return _host_light(tensors, with_norms=False)[1]
        if norms is None:
            norms = _float32_norms(tensors)
        inf_norms = torch.stack(_each_nonempty(lambda ts: torch._foreach_norm(ts, float("inf")), tensors)).float()
        return torch.where(torch.isnan(norms), norms, inf_norms)


def extremes(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of ``tensor``, 0-dim, in one pass (NaN if any element is NaN): the light
    statistics of a module tap. No sync. ``tensor`` must not be empty. (``aminmax`` is one kernel
    on CUDA and, on the CPU, ~25x faster than an inf-norm. Autograd is switched off around it,
    not by ``detach()``, which would dispatch a second op, nor by ``torch.no_grad()``, whose
    Python context manager costs as much as the op: this runs per tapped tensor.)"""
    if not (tensor.requires_grad and torch.is_grad_enabled()):
        return torch.aminmax(tensor)
    torch._C._set_grad_enabled(False)
    try:
        return torch.aminmax(tensor)
    finally:
        torch._C._set_grad_enabled(True)


def peaks_from_extremes(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """float32 ``[len(pairs)]``: the peak of each tensor from its :func:`extremes`. A few
    launches for all pairs together; no sync."""
    return peaks_of_pairs(torch.stack([v.to(device, non_blocking=True) for pair in pairs for v in pair]))


def peaks_of_pairs(values: torch.Tensor) -> torch.Tensor:
    """float32 ``[n]`` from ``values`` ``[2n]``, :func:`extremes` pairs one after the other: the
    peak of each pair's tensor (its largest magnitude is at one end). No sync."""
    return values.to(torch.float32).view(-1, 2).abs().amax(dim=1)


def _each_nonempty(foreach, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``foreach(tensors)`` (a grouped op returning one 0-dim tensor per tensor), with a 0-dim
    zero for each empty tensor: reductions without an identity (max, inf-norm) raise on them."""
    full = [t for t in tensors if t.numel()]
    if len(full) == len(tensors):
        return list(foreach(list(tensors)))
    results = iter(foreach(full) if full else [])
    zero = tensors[0].new_zeros(())
    return [next(results) if t.numel() else zero for t in tensors]


def _host_light(tensors: Sequence[torch.Tensor], with_norms: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(norms or None, peaks), float32, of CPU tensors. Small tensors: copied into one float
    buffer per group (one ``_chunk_cat``), made absolute, and reduced per segment on the host
    (numpy ``reduceat``: the peak NaN-propagating, the sum of squares in float64, so no square
    under- or overflows). Large tensors: a grouped float32 norm and one ``aminmax`` each, then
    the rare norm whose squares leave float32's range is recomputed on rescaled values."""
    n = len(tensors)
    peaks = np.zeros(n, np.float32)
    norms = np.zeros(n, np.float32)
    small, group, size = [], [], 0
    large = []
    for i, t in enumerate(tensors):
        k = t.numel()
        if k >= HOST_SMALL_BELOW:
            large.append(i)
        elif k:
            if size + k > HOST_GROUP_ELEMENTS and group:
                small.append(group)
                group, size = [], 0
            group.append(i)
            size += k
    if group:
        small.append(group)
    for members in small:
        parts = [tensors[i] if tensors[i].dim() else tensors[i].view(1) for i in members]
        flat = torch._chunk_cat(parts, 0, 1)  # one copy of all of them, whatever their shapes
        values = (flat if flat.dtype in (torch.float32, torch.float64) else flat.float()).abs_().view(-1).numpy()
        starts = np.cumsum([0] + [p.numel() for p in parts[:-1]])
        peaks[members] = np.maximum.reduceat(values, starts)
        if with_norms:
            with np.errstate(over="ignore"):
                norms[members] = np.sqrt(np.add.reduceat(np.square(values, dtype=np.float64), starts))
    if large:
        chosen = [tensors[i] for i in large]
        peaks[large] = peaks_from_extremes([extremes(t) for t in chosen], chosen[0].device).numpy()
        if with_norms:
            big = _float32_norms(chosen)
            _rescale_risky_norms(chosen, big, torch.from_numpy(peaks[large]))
            norms[large] = big.numpy()
    return (torch.from_numpy(norms) if with_norms else None), torch.from_numpy(peaks)


def _float32_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """float32 ``[len(tensors)]``: grouped L2 norms (one device; 0 for an empty tensor). A tensor
    wider than float32 (float64) is reduced in its own precision and then cast: torch refuses a
    narrowing ``dtype=``. No sync."""
    wide = [t.element_size() > 4 for t in tensors]
    if not any(wide):
        return torch.stack(_each_nonempty(lambda ts: torch._foreach_norm(ts, 2, dtype=torch.float32), tensors))
    narrow = iter(_each_nonempty(lambda ts: torch._foreach_norm(ts, 2, dtype=torch.float32),
                                 [t for t, w in zip(tensors, wide) if not w]) if not all(wide) else [])
    widened = iter(n.float() for n in _each_nonempty(lambda ts: torch._foreach_norm(ts, 2),
                                                     [t for t, w in zip(tensors, wide) if w]))
    return torch.stack([next(widened) if w else next(narrow) for w in wide])


def _rescale_risky_norms(tensors: Sequence[torch.Tensor], norms: torch.Tensor, peaks: torch.Tensor) -> None:
    """Squares in float32 vanish below ~1e-19 and overflow beyond ~1.8e19: recompute, in place,
    the norm of the rare tensor whose peak is that far from 1 on values rescaled near 1 (host
    tensors only: this reads their peaks)."""
    values = peaks.numpy()
    with np.errstate(invalid="ignore"):
        risky = np.flatnonzero(((values > 0) & (values < _DOT_SAFE_BELOW)) | ((values > _DOT_SAFE_ABOVE) & np.isfinite(values)))
    for i in risky.tolist():
        norms[i] = rescaled_norm(tensors[i].float(), peaks[i])
