"""On-device statistics of a list of tensors, with no host-device sync.

Two kinds, in the units of DESIGN.md:

*Light* statistics (:func:`light_stats`, every step): per tensor its peak magnitude and its L2
norm, unscaled. A NaN or inf element makes the peak NaN or inf, so they also see every non-finite
gradient. A handful of fused reductions (no elementwise temporaries): cheap enough for every step.

*Full* statistics (:func:`tensor_stats`, on sampled steps), for each *slot* (one tensor, or all
tensors together when ``per_tensor=False``):

* ``amax``  largest finite magnitude, unscaled (0 when there is none);
* ``amin``  smallest nonzero finite magnitude, unscaled (NaN when there is none);
* ``l2``    L2 norm of the finite elements, unscaled (float64 sum of float32 partial sums);
* ``n_zero, n_subnormal`` judged on the *scaled* value, as backward produced it (subnormal: below
  the smallest normal of the AMP format); ``n_nan, n_inf`` judged on the unscaled value (a finite
  value that a scale below 1 overflows on unscaling reaches the optimizer as inf);
* ``hist``  counts of nonzero finite elements per binade of the unscaled magnitude; magnitudes
  below ``2**hist_min_exp`` (even those that flush to 0 when unscaled in fp32) go to bin 0.

How: tensors of one (device, dtype) group are flattened into chunks of at most ``CHUNK_ELEMENTS``
elements. Each element's unscaled float32 bit pattern gives, shifted right by 22, one integer
*code*: its exponent field and the top mantissa bit (which tells a quiet NaN from inf), so a single
bincount per slot yields the histogram and the NaN and inf counts; the binades are mapped onto
histogram bins on the host. The smallest nonzero magnitude is found on bit patterns (order-
preserving for non-negative floats; zero and non-finite values are shifted out of the way), the
largest after non-finite values are replaced by 0: both exact. Nothing here calls ``.item()``, boolean indexing
or any other op whose output size depends on data, so on CUDA it queues kernels and returns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .schema import HIST_BINS, HIST_MIN_EXP

CHUNK_ELEMENTS = 1 << 22  # bounds the temporaries: ~16 bytes per element of the chunk
# On the CPU, chunks whose temporaries stay in cache: fresh multi-MB temporaries cost a page fault
# per 4 KiB, which made the pass 2-4x slower than its arithmetic.
CPU_CHUNK_ELEMENTS = 1 << 18
# Peaks between which a float32 dot product of a tensor with itself is exact to float32 rounding
# (squares stay normal, sums of up to 2**40 of them finite).
_DOT_SAFE_BELOW, _DOT_SAFE_ABOVE = 1e-15, 1e15

_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_CODES = 512              # float32 bits >> 22: exponent field (256) x top mantissa bit (2)
_STRIDE = _CODES + 2      # per slot: the codes, then n_zero, then n_below_normal (zeros included)
_NO_AMIN = 0x7F7FFFFF     # amin is kept as (bits - 1) & _ABS_MASK: zero and non-finite land at or above this


@dataclass
class DeviceStats:
    """Raw per-slot results of :func:`tensor_stats`, still on the device (or the host buffers
    they were copied into)."""

    counts: torch.Tensor     # int64 [slots * _STRIDE]: codes, n_zero, n_below_normal
    amax: torch.Tensor       # float32 [slots]: the largest finite magnitude
    amin_code: torch.Tensor  # int32 [slots]: smallest (bits - 1) & _ABS_MASK (see _NO_AMIN)
    sumsq: torch.Tensor      # float64 [slots]: sum of squares of finite unscaled values
    line_zeros: torch.Tensor  # int64 [slots]: zeros lying in an all-zero row or column (zero_line_elements)
    hist_min_exp: int
    bins: int

    @property
    def device(self) -> torch.device:
        return self.counts.device

    def to_host(self, non_blocking: bool) -> "DeviceStats":
        """Copy into (pinned, when the source is on an accelerator) host buffers. Does not sync
        when ``non_blocking``; the caller must wait on an event before reading the result."""
        if self.counts.device.type == "cpu":
            return self
        return DeviceStats(*(to_host(t, non_blocking) for t in
                             (self.counts, self.amax, self.amin_code, self.sumsq, self.line_zeros)),
                           self.hist_min_exp, self.bins)


@dataclass
class LightStats:
    """Per-tensor peak magnitude and L2 norm, unscaled (NaN/inf when the tensor held one), on
    the device until copied."""

    peaks: torch.Tensor      # float32 [tensors]
    norms: torch.Tensor      # float32 [tensors]

    @property
    def device(self) -> torch.device:
        return self.peaks.device

    def to_host(self, non_blocking: bool) -> "LightStats":
        return LightStats(to_host(self.peaks, non_blocking), to_host(self.norms, non_blocking))


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
    # zeros in all-zero rows or columns (float: NaN where unknown, light rows and old runs)
    n_zero_lines: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.n_zero_lines is None:
            self.n_zero_lines = np.full(len(self.amax), np.nan)

    @classmethod
    def of(cls, raw: "DeviceStats | LightStats") -> "HostStats":
        return cls.from_light(raw) if isinstance(raw, LightStats) else cls.from_device(raw)

    @classmethod
    def from_device(cls, raw: DeviceStats) -> "HostStats":
        counts = raw.counts.numpy().reshape(-1, _STRIDE)
        codes = counts[:, :_CODES].reshape(-1, 256, 2)            # [slot, exponent field, mantissa bit]
        n_zero = counts[:, _CODES].copy()
        finite = codes[:, :255].sum(axis=2)                        # per exponent field
        finite[:, 0] -= n_zero                                     # zeros are exponent 0, not a binade
        amin_code = raw.amin_code.numpy()
        amin = np.where(amin_code >= _NO_AMIN, np.int32(0x7FC00000), amin_code + 1).astype(np.int32)
        return cls(
            amax=raw.amax.numpy().copy(),
            amin=amin.view(np.float32),
            l2=_to_float32(np.sqrt(raw.sumsq.numpy())),
            n_zero=n_zero,
            n_subnormal=counts[:, _CODES + 1] - n_zero,
            n_nan=codes[:, 255, 1].copy(),
            n_inf=codes[:, 255, 0].copy(),
            hist=(finite @ _binade_to_bin(raw.hist_min_exp, raw.bins)).astype(np.int32),
            n_zero_lines=raw.line_zeros.numpy().astype(np.float64),
        )

    @classmethod
    def from_light(cls, raw: LightStats) -> "HostStats":
        """Light statistics as rows: ``amax`` is the peak (NaN/inf when the tensor held one),
        ``l2`` the norm; the rest is unknown (NaN here, null in the run file)."""
        peaks = raw.peaks.numpy().astype(np.float32)
        n = len(peaks)
        unknown = np.full(n, np.nan)
        return cls(amax=peaks, amin=np.full(n, np.nan, np.float32), l2=raw.norms.numpy().astype(np.float32),
                   n_zero=unknown, n_subnormal=unknown, n_nan=unknown, n_inf=unknown,
                   hist=np.zeros((n, 0), np.int32))

    @property
    def light(self) -> bool:
        return self.hist.shape[1] == 0

    def total(self) -> "HostStats":
        """All slots combined into one (for step rows). Light: the peak over all slots (non-finite
        if any slot was) and the norm over the slots that were finite (so a skipped step keeps a
        lower bound of its gradient norm, as full statistics keep the norm of the finite elements)."""
        if self.light:
            with np.errstate(invalid="ignore"):  # a NaN peak makes the total NaN, as it should
                peak = self.amax.max(initial=0.0)
            norms = self.l2.astype(np.float64)
            norm = np.sqrt(np.square(norms[np.isfinite(norms)]).sum(keepdims=True))
            unknown = np.full(1, np.nan)
            return HostStats(np.array([peak], np.float32), np.full(1, np.nan, np.float32), _to_float32(norm),
                             unknown, unknown, unknown, unknown, np.zeros((1, 0), np.int32))
        finite_min = self.amin[~np.isnan(self.amin)]
        return HostStats(
            amax=np.array([self.amax.max(initial=0.0)], dtype=np.float32),
            amin=np.array([finite_min.min() if finite_min.size else np.nan], dtype=np.float32),
            l2=_to_float32(np.sqrt(np.square(self.l2.astype(np.float64)).sum(keepdims=True))),
            n_zero=np.array([self.n_zero.sum()]), n_subnormal=np.array([self.n_subnormal.sum()]),
            n_nan=np.array([self.n_nan.sum()]), n_inf=np.array([self.n_inf.sum()]),
            hist=self.hist.sum(axis=0, keepdims=True, dtype=np.int64).astype(np.int32),
            n_zero_lines=np.array([self.n_zero_lines.sum()]),
        )

    @staticmethod
    def concat(parts: Sequence["HostStats"]) -> "HostStats":
        return HostStats(*(np.concatenate([getattr(p, f) for p in parts])
                           for f in HostStats.__dataclass_fields__))


@functools.lru_cache(maxsize=16)
def _binade_to_bin(min_exp: int, bins: int) -> np.ndarray:
    """int64 [255, bins]: exponent field e (binade e - 127; e = 0 holds the float32 subnormals)
    onto its histogram bin, clamped at both ends."""
    index = np.clip(np.arange(255) - 127 - min_exp, 0, bins - 1)
    index[0] = 0
    out = np.zeros((255, bins), dtype=np.int64)
    out[np.arange(255), index] = 1
    return out


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


def peaks(tensors: Sequence[torch.Tensor], norms: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[len(tensors)]``: ``max |x|`` of each tensor (one device), NaN if it held a NaN,
    else inf if it held an inf. No sync. On the CPU one ``aminmax`` per tensor (vectorised, and
    NaN-propagating; the inf-norm kernel there is ~15x slower). On an accelerator one fused
    inf-norm, with NaN made certain from the L2 norms (``norms``, computed if not given), which
    always propagate it."""
    with torch.no_grad():
        if tensors[0].device.type == "cpu":
            # An empty tensor (a rank holding no shard of a parameter) has peak 0.
            return peak_magnitudes([extremes(t) if t.numel() else (t.new_zeros(()),) * 2 for t in tensors],
                                   tensors[0].device)
        top = torch.stack(torch._foreach_norm(tensors, float("inf"))).float()
        if norms is None:
            norms = _float32_norms(tensors)
        return torch.where(torch.isnan(norms), norms, top)


def _float32_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """float32 ``[len(tensors)]``: fused L2 norms (one device). A tensor wider than float32
    (float64) is reduced in its own precision and then cast: torch refuses a narrowing ``dtype=``.
    No sync."""
    wide = [t.element_size() > 4 for t in tensors]
    if not any(wide):
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    narrow = iter(torch._foreach_norm([t for t, w in zip(tensors, wide) if not w], 2, dtype=torch.float32)
                  if not all(wide) else [])
    widened = iter(n.float() for n in torch._foreach_norm([t for t, w in zip(tensors, wide) if w], 2))
    return torch.stack([next(widened) if w else next(narrow) for w in wide])


def light_stats(tensors: Sequence[torch.Tensor], *, inv_scale: torch.Tensor | None) -> LightStats:
    """Peak magnitude and L2 norm of each tensor (one device), unscaled by ``inv_scale`` (0-dim
    float32 on that device, or None). Fused reductions and no temporaries the size of the data:
    the every-step statistics. The norm is accumulated in float32 (float64 costs 6x on the CPU).
    On the CPU a tensor whose peak is below 1e-15 or above 1e15 is rescaled first, so its norm is
    exact to float32 rounding; on an accelerator (torch's fused norm, no rescaling: that would
    need a look at the values, a sync) elements beyond ~1.8e19 may make it inf and a tensor of
    elements all below ~1e-19 may read 0. Does not sync."""
    if not tensors:
        raise ValueError("light_stats needs at least one tensor")
    with torch.no_grad():
        if tensors[0].device.type == "cpu":
            norms, top = _cpu_light_stats(tensors)
        else:
            norms = _float32_norms(tensors)
            top = peaks(tensors, norms)
        if inv_scale is not None:
            top, norms = top * inv_scale, norms * inv_scale  # as torch's unscale_: fp32 products
    return LightStats(top, norms)


def _cpu_light_stats(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(norms, peaks) on the CPU, one tensor at a time: its sum of squares, then its min/max,
    so that the second read of a gradient (a few MB at most) comes from cache, not memory. A
    float32 dot product is ~2.5x cheaper than ``vector_norm`` here; inf and NaN propagate."""
    norms, pairs = [], []
    for t in tensors:
        if not t.numel():
            zero = t.new_zeros((), dtype=torch.float32)
            norms.append(zero)
            pairs.append((zero, zero))
            continue
        if t.dtype == torch.float32 and t.is_contiguous():
            flat = t.view(-1)
            norms.append(torch.dot(flat, flat).sqrt())
        elif t.element_size() > 4:  # float64: torch refuses a narrowing dtype=; reduce, then cast
            norms.append(torch.linalg.vector_norm(t).float())
        else:  # a half-precision dot would overflow at 65504
            norms.append(torch.linalg.vector_norm(t, dtype=torch.float32))
        pairs.append(extremes(t))
    norms, top = torch.stack(norms), peak_magnitudes(pairs, tensors[0].device)
    # Squares in float32 (here and in torch's own norms) vanish below ~1e-19 and overflow beyond
    # ~1.8e19. The rare tensor whose peak is that far from 1 is rescaled first (reading CPU
    # values is no device sync), so its norm is right unless the norm itself is out of range.
    risky = ((top > 0) & (top < _DOT_SAFE_BELOW)) | ((top > _DOT_SAFE_ABOVE) & torch.isfinite(top))
    if risky.any():
        for i in risky.nonzero().flatten().tolist():
            norms[i] = _rescaled_norm(tensors[i].float(), top[i])
    return norms, top


def tensor_stats(
    tensors: Sequence[torch.Tensor],
    *,
    inv_scale: torch.Tensor | None,
    subnormal_below: float,
    per_tensor: bool = True,
    hist_min_exp: int = HIST_MIN_EXP,
    hist_bins: int = HIST_BINS,
    layouts: SlotLayouts | None = None,
    lines: str = "rows",
) -> DeviceStats:
    """Full statistics of ``tensors`` (one device, one dtype; they hold *scaled* values).

    ``inv_scale`` is the 0-dim float32 reciprocal of the loss scale on the same device (None when
    scaling is off); ``subnormal_below`` is the AMP format's smallest normal; ``lines`` how the
    zero lines are counted (:func:`zero_line_elements`). Does not sync.
    """
    if not tensors:
        raise ValueError("tensor_stats needs at least one tensor")
    device = tensors[0].device
    layouts = layouts or _DEFAULT_LAYOUTS
    n_slots = len(tensors) if per_tensor else 1
    counts = torch.zeros(n_slots * _STRIDE, dtype=torch.int64, device=device)
    amax = torch.zeros(n_slots, dtype=torch.float32, device=device)
    amin_code = torch.full((n_slots,), _ABS_MASK, dtype=torch.int32, device=device)
    sumsq = torch.zeros(n_slots, dtype=torch.float64, device=device)
    line_zeros = _line_zeros(tensors, per_tensor, lines)
    if inv_scale is not None:
        # A scale of 0 (collapsed) would make 0 * inf = NaN of every zero.
        inv_scale = inv_scale.clamp(max=torch.finfo(torch.float32).max)

    with torch.no_grad():
        limit = min(CHUNK_ELEMENTS, CPU_CHUNK_ELEMENTS) if device.type == "cpu" else CHUNK_ELEMENTS
        for views, segments in _chunks(tensors, per_tensor, limit):
            flat = views[0] if len(views) == 1 else torch.cat(views)
            seg = None
            if device.type != "cpu" and len(segments) > 1:
                # On an accelerator, one grouped scatter per statistic instead of a launch per tensor.
                slot_ids, lengths = layouts.get(device, tuple(s for s, _, _ in segments),
                                                tuple(n for _, _, n in segments))
                seg = torch.repeat_interleave(slot_ids, lengths, output_size=flat.numel())
            _accumulate(flat, seg, segments, inv_scale, subnormal_below, counts, amax, amin_code, sumsq)
    return DeviceStats(counts, amax, amin_code, sumsq, line_zeros, hist_min_exp, hist_bins)


def zero_line_elements(tensor: torch.Tensor, lines: str = "rows") -> torch.Tensor:
    """0-dim int64: the elements of ``tensor`` that lie in an all-zero row or column of its 2-D
    view (0 for a tensor of fewer than 2 dimensions). ``lines="rows"``: the view is
    ``[shape[0], -1]`` (a weight's output units against its inputs, an embedding's rows);
    ``"features"``: ``[-1, shape[-1]]`` (a module output's positions against its features).

    Why: zeros that fill a whole line come from structure that does not depend on the loss scale
    (an unused embedding row, a dead ReLU unit, a masked or ignored position), while an element
    that underflows in its own rounding is a scattered zero; reports tell the two apart with this
    count (:mod:`ampdoctor.reports.underflow`). A handful of reductions; does not sync."""
    if tensor.dim() < 2 or tensor.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=tensor.device)
    view = tensor.reshape(tensor.shape[0], -1) if lines == "rows" else tensor.reshape(-1, tensor.shape[-1])
    zero = view == 0
    rows = zero.all(dim=1).sum()
    cols = zero.all(dim=0).sum()
    return rows * view.shape[1] + cols * view.shape[0] - rows * cols


def _line_zeros(tensors: Sequence[torch.Tensor], per_tensor: bool, lines: str) -> torch.Tensor:
    """int64 [slots]: :func:`zero_line_elements` per tensor, or summed into one slot."""
    device = tensors[0].device
    with torch.no_grad():
        values = [zero_line_elements(t, lines) for t in tensors]
    stacked = torch.stack(values) if values else torch.zeros(0, dtype=torch.int64, device=device)
    return stacked if per_tensor else stacked.sum(dim=0, keepdim=True)


def _chunks(tensors: Sequence[torch.Tensor], per_tensor: bool, limit: int):
    """Yield ``(views, segments)``: 1-D views adding up to at most ``limit`` elements, and
    the ``(slot, start, length)`` runs they form once concatenated (adjacent views of one slot
    make one run). A tensor larger than a chunk is split into views of the same slot."""
    views: list[torch.Tensor] = []
    segments: list[tuple[int, int, int]] = []
    size = 0
    for i, t in enumerate(tensors):
        flat = t.detach().reshape(-1)
        slot = i if per_tensor else 0
        for start in range(0, flat.numel(), limit):
            piece = flat[start:start + limit]
            if size + piece.numel() > limit and views:
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


def _accumulate(flat, seg, segments, inv_scale, subnormal_below, counts, amax, amin_code, sumsq) -> None:
    scaled_abs = flat.abs()
    # float32 from here on: exact for fp16/bf16 values, and compares on float32 are twice as fast.
    scaled32 = scaled_abs.float() if scaled_abs.dtype != torch.float32 else scaled_abs
    unscaled = scaled32 * inv_scale if inv_scale is not None else scaled32  # torch's unscale_ product
    bits = unscaled.view(torch.int32) & _ABS_MASK  # abs() may keep the sign of -NaN
    code = bits >> 22
    finite_values = torch.nan_to_num(bits.view(torch.float32), nan=0.0, posinf=0.0)
    # (bits - 1) & mask: zero wraps to the top, non-finite stays above every finite nonzero.
    nonzero_code = (bits - 1) & _ABS_MASK
    below = scaled32 < _threshold(subnormal_below, scaled_abs.dtype)

    if seg is not None:
        base = seg * _STRIDE
        ones = torch.ones(1, dtype=torch.int64, device=flat.device).expand_as(seg)
        counts.index_add_(0, base + code, ones)
        counts.index_add_(0, base + _CODES, (scaled_abs == 0).long())
        counts.index_add_(0, base + (_CODES + 1), below.long())
        amax.scatter_reduce_(0, seg, finite_values, "amax")
        amin_code.scatter_reduce_(0, seg, nonzero_code, "amin")
        sumsq.index_add_(0, seg, finite_values.double().square())
        return
    # On the CPU (or a chunk of one slot) reductions over slices of the flat buffers are cheaper
    # than scatters: there is no launch overhead to amortise.
    for slot, start, length in segments:
        part = slice(start, start + length)
        base = slot * _STRIDE
        counts[base:base + _CODES] += _bincount(code[part], _CODES)
        counts[base + _CODES] += length - torch.count_nonzero(scaled_abs[part])
        counts[base + _CODES + 1] += torch.count_nonzero(below[part])
        values = finite_values[part]
        top = values.max()
        amax[slot] = torch.maximum(amax[slot], top)
        amin_code[slot] = torch.minimum(amin_code[slot], nonzero_code[part].min())
        sumsq[slot] += _rescaled_norm(values, top).square()


def _rescaled_norm(values: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """float64 L2 norm of finite float32 ``values`` whose largest magnitude is ``top``. Squares
    in float32 overflow beyond 1.8e19 and vanish below 1e-19, and a float64 reduction copies the
    data to float64 first (6x the cost on the CPU); so the values are brought near 1 by a power of
    two (exact), summed in float32, and scaled back in float64."""
    exponent = torch.frexp(top).exponent.clamp(-125, 126)  # top < 2**exponent; 2**-exponent stays normal
    norm = torch.linalg.vector_norm(values * torch.exp2(-exponent.float()))
    return norm.double() * torch.exp2(exponent.double())


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


def _threshold(value: float, dtype: torch.dtype) -> float:
    """``value`` for a comparison with a ``dtype`` tensor (which casts it to ``dtype``): at least
    the smallest subnormal, so that a threshold below the format's range cannot round to 0 and
    stop zeros from counting as below it."""
    info = torch.finfo(dtype)
    return max(value, info.tiny * info.eps)


def _bincount(index: torch.Tensor, length: int) -> torch.Tensor:
    if index.device.type == "cpu":
        return torch.bincount(index, minlength=length)  # int32 codes are fine here
    # torch.bincount sizes its output from the data (a sync); a fixed-size scatter does not.
    out = torch.zeros(length, dtype=torch.int64, device=index.device)
    return out.index_add_(0, index, torch.ones(1, dtype=torch.int64, device=index.device).expand_as(index))
