"""On-device statistics of a list of tensors: one grouped pass, no host-device sync.

For each *slot* (one tensor, or all tensors together when ``per_tensor=False``) it computes, in
the units of DESIGN.md:

* ``amax``  largest finite magnitude, unscaled (0 when there is none);
* ``amin``  smallest nonzero finite magnitude, unscaled (NaN when there is none);
* ``l2``    L2 norm of the finite elements, unscaled (accumulated in float64);
* ``n_zero, n_subnormal, n_nan, n_inf``; zero and subnormal are judged on the *scaled* value
  (subnormal: below the smallest normal of the AMP format), i.e. as backward produced it;
* ``hist``  counts of nonzero finite elements per binade of the unscaled magnitude; magnitudes
  below ``2**hist_min_exp`` (even those that flush to 0 when unscaled in fp32) go to bin 0.

How: tensors of one (device, dtype) group are flattened into chunks of at most ``CHUNK_ELEMENTS``
elements. Every element gets one integer *code* (its binade, shifted by ``bins`` when subnormal,
or one of three codes for zero / NaN / inf) and a single scatter-add counts codes per slot, so all
the counts and the histogram cost one launch per chunk. Magnitudes are compared as IEEE bit
patterns (order-preserving for non-negative floats), which makes max/min exact and gives the
binade from the exponent field without a log. Nothing here calls ``.item()``, boolean indexing or any other
op whose output size depends on data, so on CUDA it queues kernels and returns (no sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .schema import HIST_BINS, HIST_MIN_EXP

CHUNK_ELEMENTS = 1 << 22  # bounds the temporaries: ~20 bytes per element of the chunk

_ABS_MASK = 0x7FFFFFFF
_NONE_BITS = 0x7FFFFFFF  # "no nonzero element" for amin: a NaN pattern, above every magnitude


@dataclass
class DeviceStats:
    """Raw per-slot results, still on the device (or the host buffers they were copied into)."""

    counts: torch.Tensor     # int64 [slots * (2 * bins + 3)]: binade codes, see _codes()
    amax_bits: torch.Tensor  # int32 [slots]: float32 bit pattern of the largest finite magnitude
    amin_bits: torch.Tensor  # int32 [slots]: bit pattern of the smallest nonzero (NaN: none)
    sumsq: torch.Tensor      # float64 [slots]: sum of squares of finite unscaled values
    bins: int

    def to_host(self, non_blocking: bool) -> "DeviceStats":
        """Copy into (pinned, when the source is on an accelerator) host buffers. Does not sync
        when ``non_blocking``; the caller must wait on an event before reading the result."""
        if self.counts.device.type == "cpu":
            return self
        return DeviceStats(*(to_host(t, non_blocking) for t in
                             (self.counts, self.amax_bits, self.amin_bits, self.sumsq)), self.bins)


def to_host(t: torch.Tensor, non_blocking: bool = True) -> torch.Tensor:
    """``t`` itself if on the CPU, else a copy into pinned host memory (no sync when
    ``non_blocking``: read it only after an event recorded after this call has completed)."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    return host.copy_(t, non_blocking=non_blocking)


@dataclass
class HostStats:
    """Per-slot statistics as numpy arrays, ready to become run-file columns. Reading a
    DeviceStats that lives on an accelerator syncs, so only the writer thread builds these."""

    amax: np.ndarray         # float32 [slots]
    amin: np.ndarray         # float32 [slots], NaN where no nonzero finite element
    l2: np.ndarray           # float32 [slots]
    n_zero: np.ndarray       # int64 [slots]
    n_subnormal: np.ndarray  # int64 [slots]
    n_nan: np.ndarray        # int64 [slots]
    n_inf: np.ndarray        # int64 [slots]
    hist: np.ndarray         # int32 [slots, bins]

    @classmethod
    def from_device(cls, raw: DeviceStats) -> "HostStats":
        bins = raw.bins
        counts = raw.counts.numpy().reshape(-1, 2 * bins + 3)
        amax = raw.amax_bits.numpy().view(np.float32).copy()
        amin = raw.amin_bits.numpy().view(np.float32).copy()  # _NONE_BITS reads as NaN
        return cls(
            amax=amax,
            amin=amin,
            l2=_to_float32(np.sqrt(raw.sumsq.numpy())),
            n_zero=counts[:, 2 * bins].copy(),
            n_subnormal=counts[:, bins:2 * bins].sum(axis=1),
            n_nan=counts[:, 2 * bins + 1].copy(),
            n_inf=counts[:, 2 * bins + 2].copy(),
            hist=(counts[:, :bins] + counts[:, bins:2 * bins]).astype(np.int32),
        )

    def total(self) -> "HostStats":
        """All slots combined into one (for step rows)."""
        finite_min = self.amin[~np.isnan(self.amin)]
        return HostStats(
            amax=np.array([self.amax.max(initial=0.0)], dtype=np.float32),
            amin=np.array([finite_min.min() if finite_min.size else np.nan], dtype=np.float32),
            l2=_to_float32(np.sqrt(np.square(self.l2.astype(np.float64)).sum(keepdims=True))),
            n_zero=np.array([self.n_zero.sum()]), n_subnormal=np.array([self.n_subnormal.sum()]),
            n_nan=np.array([self.n_nan.sum()]), n_inf=np.array([self.n_inf.sum()]),
            hist=self.hist.sum(axis=0, keepdims=True, dtype=np.int64).astype(np.int32),
        )

    @staticmethod
    def concat(parts: Sequence["HostStats"]) -> "HostStats":
        return HostStats(*(np.concatenate([getattr(p, f) for p in parts])
                           for f in HostStats.__dataclass_fields__))


def _to_float32(values: np.ndarray) -> np.ndarray:
    """float64 → float32; a norm beyond float32's range honestly becomes inf."""
    with np.errstate(over="ignore"):
        return values.astype(np.float32)


class SlotLayouts:
    """Caches the small per-chunk index tensors (slot ids and lengths) on the device.

    Building them from Python lists every step would be a pageable host-to-device copy, which
    synchronises; the layout of a model's gradients rarely changes, so they are built once."""

    def __init__(self, max_entries: int = 64) -> None:
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._max_entries = max_entries

    def get(self, device: torch.device, slots: tuple[int, ...], lengths: tuple[int, ...]):
        key = (device, slots, lengths)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= self._max_entries:
                self._cache.clear()
            hit = (torch.tensor(slots, dtype=torch.int64, device=device),
                   torch.tensor(lengths, dtype=torch.int64, device=device))
            self._cache[key] = hit
        return hit


_DEFAULT_LAYOUTS = SlotLayouts()


def tensor_stats(
    tensors: Sequence[torch.Tensor],
    *,
    inv_scale: torch.Tensor | None,
    subnormal_below: float,
    per_tensor: bool = True,
    hist_min_exp: int = HIST_MIN_EXP,
    hist_bins: int = HIST_BINS,
    layouts: SlotLayouts | None = None,
) -> DeviceStats:
    """Statistics of ``tensors`` (one device, one dtype; they hold *scaled* values).

    ``inv_scale`` is the 0-dim float32 reciprocal of the loss scale on the same device (None when
    scaling is off); ``subnormal_below`` is the AMP format's smallest normal. Does not sync.
    """
    if not tensors:
        raise ValueError("tensor_stats needs at least one tensor")
    device = tensors[0].device
    layouts = layouts or _DEFAULT_LAYOUTS
    n_slots = len(tensors) if per_tensor else 1
    stride = 2 * hist_bins + 3
    counts = torch.zeros(n_slots * stride, dtype=torch.int64, device=device)
    amax_bits = torch.zeros(n_slots, dtype=torch.int32, device=device)
    amin_bits = torch.full((n_slots,), _NONE_BITS, dtype=torch.int32, device=device)
    sumsq = torch.zeros(n_slots, dtype=torch.float64, device=device)

    for views, segments in _chunks(tensors, per_tensor):
        flat = views[0] if len(views) == 1 else torch.cat(views)
        seg = None
        if device.type != "cpu" and len(segments) > 1:
            # On an accelerator, one grouped scatter per statistic instead of a launch per tensor.
            slot_ids, lengths = layouts.get(device, tuple(s for s, _, _ in segments),
                                            tuple(n for _, _, n in segments))
            seg = torch.repeat_interleave(slot_ids, lengths, output_size=flat.numel())
        _accumulate(flat, seg, segments, inv_scale, subnormal_below, hist_min_exp, hist_bins,
                    counts, amax_bits, amin_bits, sumsq)
    return DeviceStats(counts, amax_bits, amin_bits, sumsq, hist_bins)


def _chunks(tensors: Sequence[torch.Tensor], per_tensor: bool):
    """Yield ``(views, segments)``: 1-D views adding up to at most CHUNK_ELEMENTS elements, and
    the ``(slot, start, length)`` runs they form once concatenated (adjacent views of one slot
    make one run). A tensor larger than a chunk is split into views of the same slot."""
    views: list[torch.Tensor] = []
    segments: list[tuple[int, int, int]] = []
    size = 0
    for i, t in enumerate(tensors):
        flat = t.detach().reshape(-1)
        slot = i if per_tensor else 0
        for start in range(0, flat.numel(), CHUNK_ELEMENTS):
            piece = flat[start:start + CHUNK_ELEMENTS]
            if size + piece.numel() > CHUNK_ELEMENTS and views:
                yield views, segments
                views, segments, size = [], [], 0
            views.append(piece)
            if segments and segments[-1][0] == slot:
                segments[-1] = (slot, segments[-1][1], segments[-1][2] + piece.numel())
            else:
                segments.append((slot, size, piece.numel()))
            size += piece.numel()
    if views:
        yield views, segments


def _accumulate(flat, seg, segments, inv_scale, subnormal_below, min_exp, bins,
                counts, amax_bits, amin_bits, sumsq) -> None:
    stride = 2 * bins + 3
    scaled_abs = flat.abs()
    unscaled = scaled_abs.float() if scaled_abs.dtype != torch.float32 else scaled_abs
    if inv_scale is not None:
        unscaled = unscaled * inv_scale  # the same fp32 product torch's unscale_ computes
    bits = unscaled.view(torch.int32) & _ABS_MASK  # abs() may keep the sign of -NaN
    # Classified as backward produced it (that is what makes torch skip a step); a finite scaled
    # value can still overflow when unscaled by a scale below 1, and then its magnitude is inf.
    finite = torch.isfinite(scaled_abs)

    # Binade of the unscaled value from its exponent field. float32 subnormals (exponent field
    # 0) land in bin 0 with the other tiny values, which the clamp puts there anyway.
    code = ((bits >> 23) - (127 + min_exp)).clamp_(0, bins - 1)
    code += (scaled_abs < subnormal_below).to(torch.int32) * bins
    code = torch.where(finite, code, (2 * bins + 1) + torch.isinf(scaled_abs).to(torch.int32))
    code = torch.where(scaled_abs == 0, 2 * bins, code)  # zero as backward produced it

    finite_bits = torch.where(finite, bits, 0)
    nonzero_bits = torch.where(finite & (bits != 0), bits, _NONE_BITS)
    finite_values = torch.where(finite, unscaled, 0)

    if seg is not None:
        counts += _bincount(seg * stride + code, counts.numel())
        amax_bits.scatter_reduce_(0, seg, finite_bits, "amax")
        amin_bits.scatter_reduce_(0, seg, nonzero_bits, "amin")
        sumsq.index_add_(0, seg, finite_values.double().square())
        return
    # On the CPU (or a chunk of one slot) reductions over slices of the flat buffers are cheaper
    # than scatters: there is no launch overhead to amortise.
    for slot, start, length in segments:
        part = slice(start, start + length)
        counts[slot * stride:(slot + 1) * stride] += _bincount(code[part], stride)
        amax_bits[slot] = torch.maximum(amax_bits[slot], finite_bits[part].max())
        amin_bits[slot] = torch.minimum(amin_bits[slot], nonzero_bits[part].min())
        # float64 accumulation without materialising a float64 copy
        sumsq[slot] += torch.linalg.vector_norm(finite_values[part], dtype=torch.float64).square()


def extremes(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of ``tensor``, 0-dim, in one pass (NaN if any element is NaN): the
    every-step non-finite check of module taps. No sync. ``tensor`` must not be empty.
    (``aminmax`` is one kernel on CUDA and, on the CPU, ~25x faster than an inf-norm.)"""
    return torch.aminmax(tensor.detach())


def peak_magnitudes(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """float32 ``[len(pairs)]``: ``max |x|`` of each tensor from its :func:`extremes` (NaN if it
    held a NaN, else inf if it held an inf). A few launches for all pairs together; no sync."""
    values = torch.stack([v.to(device, non_blocking=True) for pair in pairs for v in pair])
    return values.to(torch.float32).view(-1, 2).abs().amax(dim=1)


def _bincount(index: torch.Tensor, length: int) -> torch.Tensor:
    if index.device.type == "cpu":
        return torch.bincount(index, minlength=length)  # int32 codes are fine here
    # torch.bincount sizes its output from the data (a sync); a fixed-size scatter does not.
    out = torch.zeros(length, dtype=torch.int64, device=index.device)
    return out.index_add_(0, index, torch.ones(1, dtype=torch.int64, device=index.device).expand_as(index))
