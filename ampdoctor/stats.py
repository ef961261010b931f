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

How: two algorithms compute the same numbers (tests hold them to it on the same tensors), chosen
by :func:`algorithm_for` the device or explicitly (``algorithm=``), so the accelerator one also
runs on CPU tensors. *host*: per-tensor kernels where a tensor is large, grouped ``foreach``
ops otherwise; full statistics reduce slices of a flat buffer. *accelerator*: a fixed number of
launches per chunk of ``CHUNK_ELEMENTS`` elements, whatever the number of tensors in it, with no
float atomics (results are the same run to run; ``use_deterministic_algorithms`` is respected).

Full statistics: each element's unscaled float32 bit pattern gives, shifted right by 22, one
integer *code*: its exponent field and the top mantissa bit (which tells a quiet NaN from inf),
so one count per slot and code yields the histogram and the NaN and inf counts; the binades are
mapped onto histogram bins on the host. The smallest nonzero magnitude and the largest finite
one are exact. Nothing here calls ``.item()``, boolean indexing or any other op whose output
size depends on data, so on an accelerator it queues kernels and returns.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .schema import HIST_BINS, HIST_MIN_EXP

CHUNK_ELEMENTS = 1 << 22  # bounds the accelerator algorithm's temporaries: ~16 bytes per element
# On the CPU, chunks whose temporaries stay in cache: fresh multi-MB temporaries cost a page fault
# per 4 KiB, which made the pass 2-4x slower than its arithmetic.
CPU_CHUNK_ELEMENTS = 1 << 18
# Peaks between which a float32 dot product of a tensor with itself is exact to float32 rounding
# (squares stay normal, sums of up to 2**40 of them finite).
_DOT_SAFE_BELOW, _DOT_SAFE_ABOVE = 1e-15, 1e15
# The host algorithm's light statistics: tensors below this size are copied into one buffer
# (groups of at most HOST_GROUP_ELEMENTS) and reduced per segment there, a few ops for all of them;
# larger ones are reduced one by one (reading them in place beats a copy, and their kernels
# dwarf a dispatch). Measured crossover on a CPU core: about 8k elements.
HOST_SMALL_BELOW = 1 << 12
HOST_GROUP_ELEMENTS = 1 << 20

ALGORITHMS = ("host", "accelerator")


def algorithm_for(device: torch.device) -> str:
    """``"host"`` for CPU tensors, ``"accelerator"`` for every other device (cuda, xpu, mps, meta)."""
    return "host" if torch.device(device).type == "cpu" else "accelerator"


_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_CODES = 512              # float32 bits >> 22: exponent field (256) x top mantissa bit (2)
# Per slot after the codes: elements at or above the smallest normal (unused), nonzero ones below
# it (subnormal), zeros; so that base + _ABOVE + below + zero lands in the right one.
_ABOVE, _BELOW, _ZERO = _CODES, _CODES + 1, _CODES + 2
_STRIDE = _CODES + 3
_NO_AMIN = 0x7F7FFFFF     # amin is kept as (bits - 1) & _ABS_MASK: zero and non-finite land at or above this


@dataclass
class DeviceStats:
    """Raw per-slot results of :func:`tensor_stats`, still on the device (or the host buffers
    they were copied into)."""

    counts: torch.Tensor     # int64 [slots * _STRIDE]: codes, n_zero, n_below_normal
    amax: torch.Tensor       # float32 [slots]: the largest finite magnitude
    amin_code: torch.Tensor  # int32 [slots]: smallest (bits - 1) & _ABS_MASK (see _NO_AMIN)
    sumsq: torch.Tensor      # float64 [slots]: sum of squares of finite unscaled values (host: float32
                             # partial sums rescaled by a power of two; accelerator: float64 sums)
    line_zeros: torch.Tensor  # int64 [slots]: zeros lying in an all-zero row or column (zero_line_elements)
    hist_min_exp: int
    bins: int

    @property
    def device(self) -> torch.device:
        return self.counts.device

    def to_host(self, copy) -> "DeviceStats":
        """The same statistics, each tensor passed through ``copy`` (a
        :meth:`ampdoctor.transfer.HostCopies.to_host`)."""
        return DeviceStats(copy(self.counts), copy(self.amax), copy(self.amin_code), copy(self.sumsq),
                           copy(self.line_zeros), self.hist_min_exp, self.bins)


@dataclass
class LightStats:
    """Per-tensor peak magnitude and L2 norm, unscaled (NaN/inf when the tensor held one), on
    the device until copied."""

    peaks: torch.Tensor      # float32 [tensors]
    norms: torch.Tensor      # float32 [tensors]

    @property
    def device(self) -> torch.device:
        return self.peaks.device

    def to_host(self, copy) -> "LightStats":
        return LightStats(copy(self.peaks), copy(self.norms))


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
        n_zero = counts[:, _ZERO].copy()
        finite = codes[:, :255].sum(axis=2)                        # per exponent field
        finite[:, 0] -= n_zero                                     # zeros are exponent 0, not a binade
        amin_code = raw.amin_code.numpy()
        amin = np.where(amin_code >= _NO_AMIN, np.int32(0x7FC00000), amin_code + 1).astype(np.int32)
        return cls(
            amax=raw.amax.numpy().copy(),
            amin=amin.view(np.float32),
            l2=_to_float32(np.sqrt(raw.sumsq.numpy())),
            n_zero=n_zero,
            n_subnormal=counts[:, _BELOW].copy(),
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
    """Caches, per chunk layout, the small index tensors of the accelerator algorithm on the
    device: where each segment starts, and the step in ``slot * _STRIDE`` there.

    Built from Python lists they are a host-to-device copy; the layouts of a model's gradients
    rarely change, so each is built once. Least recently used layouts go first when the cache is
    full, and a miss copies from pinned memory without blocking (no sync): a model with more chunk
    layouts than the cache holds (GPT-2-XL has 193) costs an asynchronous copy per miss, no stall."""

    def __init__(self, max_entries: int = 1024) -> None:
        self._cache: collections.OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = collections.OrderedDict()
        self._max_entries = max_entries
        self.misses = 0

    def get(self, device: torch.device, segments: tuple[tuple[int, int, int], ...], dtype=torch.int32):
        """``(starts, steps)`` of the chunk's ``(slot, start, length)`` segments: int64 and ``dtype``."""
        key = (device, segments, dtype)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        self.misses += 1
        if len(self._cache) >= self._max_entries:
            self._cache.popitem(last=False)
        slots = [slot for slot, _, _ in segments]
        host = torch.tensor([[start for _, start, _ in segments],
                             [(b - a) * _STRIDE for a, b in zip([0] + slots, slots)]], dtype=torch.int64)
        if device.type != "cpu" and torch.accelerator.is_available():
            host = host.pin_memory()  # pageable memory would make the copy synchronous
        starts, steps = host.to(device, non_blocking=True).unbind(0)
        hit = self._cache[key] = (starts, steps.to(dtype))
        return hit

    def __len__(self) -> int:
        return len(self._cache)


_DEFAULT_LAYOUTS = SlotLayouts()


def peaks(tensors: Sequence[torch.Tensor], norms: torch.Tensor | None = None, *,
          algorithm: str | None = None) -> torch.Tensor:
    """float32 ``[len(tensors)]``: ``max |x|`` of each tensor (one device), NaN if it held a NaN,
    else inf if it held an inf; 0 for an empty tensor (a rank that holds no shard). No sync.

    ``"host"``: see :func:`light_stats`. ``"accelerator"``: one fused inf-norm, with NaN made
    certain from the L2 norms (``norms``, computed if not given), which always propagate it."""
    algorithm = _algorithm(algorithm, tensors)
    with torch.no_grad():
        if algorithm == "host":
            return _host_light(tensors, with_norms=False)[1]
        if norms is None:
            norms = _float32_norms(tensors)
        top = torch.stack(_each_nonempty(lambda ts: torch._foreach_norm(ts, float("inf")), tensors)).float()
        return torch.where(torch.isnan(norms), norms, top)


def _algorithm(algorithm: str | None, tensors: Sequence[torch.Tensor]) -> str:
    if algorithm is None:
        return algorithm_for(tensors[0].device)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    return algorithm


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
    top = np.zeros(n, np.float32)
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
        top[members] = np.maximum.reduceat(values, starts)
        if with_norms:
            with np.errstate(over="ignore"):
                norms[members] = np.sqrt(np.add.reduceat(np.square(values, dtype=np.float64), starts))
    if large:
        chosen = [tensors[i] for i in large]
        top[large] = peak_magnitudes([extremes(t) for t in chosen], chosen[0].device).numpy()
        if with_norms:
            big = _float32_norms(chosen)
            _rescale_risky_norms(chosen, big, torch.from_numpy(top[large]))
            norms[large] = big.numpy()
    return (torch.from_numpy(norms) if with_norms else None), torch.from_numpy(top)


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
    algorithm = _algorithm(algorithm, tensors)
    with torch.no_grad():
        if algorithm == "host":
            norms, top = _host_light(tensors)
        else:
            norms = _float32_norms(tensors)
            top = peaks(tensors, norms, algorithm=algorithm)
        if inv_scale is not None:
            top, norms = top * inv_scale, norms * inv_scale  # as torch's unscale_: fp32 products
    return LightStats(top, norms)


def _rescale_risky_norms(tensors: Sequence[torch.Tensor], norms: torch.Tensor, top: torch.Tensor) -> None:
    """Squares in float32 vanish below ~1e-19 and overflow beyond ~1.8e19: recompute, in place,
    the norm of the rare tensor whose peak is that far from 1 on values rescaled near 1 (host
    tensors only: this reads their peaks)."""
    values = top.numpy()
    with np.errstate(invalid="ignore"):
        risky = np.flatnonzero(((values > 0) & (values < _DOT_SAFE_BELOW)) | ((values > _DOT_SAFE_ABOVE) & np.isfinite(values)))
    for i in risky.tolist():
        norms[i] = _rescaled_norm(tensors[i].float(), top[i])


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
    algorithm: str | None = None,
) -> DeviceStats:
    """Full statistics of ``tensors`` (one device, one dtype; they hold *scaled* values).

    ``inv_scale`` is the 0-dim float32 reciprocal of the loss scale on the same device (None when
    scaling is off); ``subnormal_below`` is the AMP format's smallest normal; ``lines`` how the
    zero lines are counted (:func:`zero_line_elements`); ``algorithm`` ``"host"`` or
    ``"accelerator"`` (default: :func:`algorithm_for` the device). Does not sync.
    """
    if not tensors:
        raise ValueError("tensor_stats needs at least one tensor")
    algorithm = _algorithm(algorithm, tensors)
    device = tensors[0].device
    n_slots = len(tensors) if per_tensor else 1
    counts = torch.zeros(n_slots * _STRIDE, dtype=torch.int64, device=device)
    line_zeros = _line_zeros(tensors, per_tensor, lines)
    if inv_scale is not None:
        # A scale of 0 (collapsed) would make 0 * inf = NaN of every zero.
        inv_scale = inv_scale.clamp(max=torch.finfo(torch.float32).max)
    threshold = _threshold(subnormal_below, tensors[0].dtype)
    with torch.no_grad():
        if algorithm == "host":
            amax = torch.zeros(n_slots, dtype=torch.float32, device=device)
            amin_code = torch.full((n_slots,), _ABS_MASK, dtype=torch.int32, device=device)
            sumsq = torch.zeros(n_slots, dtype=torch.float64, device=device)
            for views, segments in _chunks(tensors, per_tensor, CPU_CHUNK_ELEMENTS):
                flat = views[0] if len(views) == 1 else torch.cat(views)
                _host_accumulate(flat, segments, inv_scale, threshold, counts, amax, amin_code, sumsq)
        else:
            amax, amin_code, sumsq = _grouped_stats(tensors, per_tensor, n_slots, inv_scale, threshold, counts,
                                                    _DEFAULT_LAYOUTS if layouts is None else layouts)
    return DeviceStats(counts, amax, amin_code, sumsq, line_zeros, hist_min_exp, hist_bins)


def zero_line_elements(tensor: torch.Tensor, lines: str = "rows") -> torch.Tensor:
    """0-dim int64: the elements of ``tensor`` that lie in an all-zero row or column of its 2-D
    view (0 for a tensor of fewer than 2 dimensions). ``lines="rows"``: the view is
    ``[shape[0], -1]`` (a weight's output units against its inputs, an embedding's rows);
    ``"features"``: ``[-1, shape[-1]]`` (a module output's positions against its features).

    Why: zeros that fill a whole line come from structure that does not depend on the loss scale
    (an unused embedding row, a dead ReLU unit, a masked or ignored position), while an element
    that underflows in its own rounding is a scattered zero; reports tell the two apart with this
    count (:mod:`ampdoctor.analysis.underflow`). A handful of reductions; does not sync."""
    if tensor.dim() < 2 or tensor.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=tensor.device)
    view = tensor.reshape(tensor.shape[0], -1) if lines == "rows" else tensor.reshape(-1, tensor.shape[-1])
    zero = view == 0
    rows = zero.all(dim=1).sum()
    cols = zero.all(dim=0).sum()
    return rows * view.shape[1] + cols * view.shape[0] - rows * cols


def _line_zeros(tensors: Sequence[torch.Tensor], per_tensor: bool, lines: str) -> torch.Tensor:
    """int64 [slots]: :func:`zero_line_elements` per tensor, or summed into one slot."""
    with torch.no_grad():
        none = torch.zeros((), dtype=torch.int64, device=tensors[0].device)  # shared: a launch, not one per tensor
        stacked = torch.stack([zero_line_elements(t, lines) if t.dim() >= 2 and t.numel() else none for t in tensors])
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
            piece = flat.narrow(0, start, min(limit, flat.numel() - start))
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


def _host_accumulate(flat, segments, inv_scale, threshold, counts, amax, amin_code, sumsq) -> None:
    """The host algorithm: reductions over the slices of one chunk (no launch overhead to
    amortise on the CPU), accumulated into the per-slot results."""
    scaled_abs = flat.abs()
    # float32 from here on: exact for fp16/bf16 values, and compares on float32 are twice as fast.
    scaled32 = scaled_abs.float() if scaled_abs.dtype != torch.float32 else scaled_abs
    unscaled = scaled32 * inv_scale if inv_scale is not None else scaled32  # torch's unscale_ product
    bits = unscaled.view(torch.int32) & _ABS_MASK  # abs() may keep the sign of -NaN
    code = bits >> 22
    finite_values = torch.nan_to_num(bits.view(torch.float32), nan=0.0, posinf=0.0)
    # (bits - 1) & mask: zero wraps to the top, non-finite stays above every finite nonzero.
    nonzero_code = (bits - 1) & _ABS_MASK
    below = scaled32 < threshold
    for slot, start, length in segments:
        part = slice(start, start + length)
        base = slot * _STRIDE
        zeros = length - torch.count_nonzero(scaled_abs[part])
        counts[base:base + _CODES] += torch.bincount(code[part], minlength=_CODES)
        counts[base + _ZERO] += zeros
        counts[base + _BELOW] += torch.count_nonzero(below[part]) - zeros
        values = finite_values[part]
        top = values.max()
        amax[slot] = torch.maximum(amax[slot], top)
        amin_code[slot] = torch.minimum(amin_code[slot], nonzero_code[part].min())
        sumsq[slot] += _rescaled_norm(values, top).square()


def _grouped_stats(tensors, per_tensor, n_slots, inv_scale, threshold, counts, layouts):
    """The accelerator algorithm: per chunk a fixed number of launches whatever its number of
    tensors. Counts go through ``index_add_`` on integers (exact in any order; deterministic
    under ``torch.use_deterministic_algorithms``); maxima, minima and sums of squares through
    grouped reductions over the chunk's segments, combined per slot afterwards: no float atomics
    and no ``scatter_reduce``, so results are the same run to run. Temporaries peak at about 16
    bytes per element of a chunk (``CHUNK_ELEMENTS``; the test measures it). Returns (amax,
    amin_code, sumsq)."""
    device = tensors[0].device
    # int32 keys (half the memory) unless slot * _STRIDE could pass 2**31 (over 4 million tensors)
    index_dtype = torch.int32 if n_slots * _STRIDE < 2**31 else torch.int64
    per_segment: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (slot, max, -min, norm)
    for views, segments in _chunks(tensors, per_tensor, CHUNK_ELEMENTS):
        # One float32 work buffer, changed in place: |scaled|, then |unscaled|, then its finite part.
        if len(views) == 1:
            work = views[0].abs() if views[0].dtype == torch.float32 else views[0].float().abs_()
        else:
            flat = torch.cat(views)
            work = flat.abs_() if flat.dtype == torch.float32 else flat.float().abs_()
            del flat
        zero, below = work == 0, work < threshold
        if inv_scale is not None:
            work.mul_(inv_scale)  # torch's unscale_ product
        # Each element's slot * _STRIDE: a step function over the chunk, from its segments.
        if len(segments) == 1:
            base: torch.Tensor | int = segments[0][0] * _STRIDE
        else:
            starts, steps = layouts.get(device, tuple(segments), index_dtype)
            base = torch.zeros(work.numel(), dtype=index_dtype, device=device).scatter_(0, starts, steps).cumsum_(0)
        key = (work.view(torch.int32) & _ABS_MASK).bitwise_right_shift_(22).to(index_dtype)  # abs() may keep -NaN's sign
        ones = torch.ones((), dtype=torch.int64, device=device).expand(work.numel())
        counts.index_add_(0, key.add_(base), ones)
        if isinstance(base, int):
            key.fill_(base + _ABOVE)
        else:
            torch.add(base, _ABOVE, out=key)
        counts.index_add_(0, key.add_(below).add_(zero), ones)
        del key, base, zero, below
        torch.nan_to_num_(work, nan=0.0, posinf=0.0)
        lengths = [n for _, _, n in segments]
        parts = torch.split(work, lengths)
        maxima = torch._foreach_max(parts)
        norms = torch._foreach_norm(parts, 2, dtype=torch.float64)
        # The smallest nonzero as a maximum of non-negative integers (CUDA's _foreach_max before
        # torch 2.11 padded its partial maxima with 0, wrong for negative values): on the bits,
        # _ABS_MASK - ((bits - 1) & _ABS_MASK) is largest for the smallest nonzero, 0 for zeros.
        bits = work.view(torch.int32)
        bits.sub_(1).bitwise_and_(_ABS_MASK).neg_().add_(_ABS_MASK)
        minima = torch._foreach_max(torch.split(bits, lengths))
        per_segment.extend((slot, top, low, norm) for (slot, _, _), top, low, norm in zip(segments, maxima, minima, norms))
    return _per_slot(per_segment, n_slots, device)


def _per_slot(per_segment, n_slots: int, device: torch.device):
    """(amax, amin_code, sumsq) per slot from the segments' (max, _ABS_MASK - amin_code, norm),
    combining the segments of a tensor split over chunks; a slot with no segment (an empty
    tensor) has no nonzero element."""
    by_slot: list[list[int]] = [[] for _ in range(n_slots)]
    for i, (slot, _, _, _) in enumerate(per_segment):
        by_slot[slot].append(i)

    def combine(column: int, empty: torch.Tensor, reduce):
        out = []
        for members in by_slot:
            values = [per_segment[i][column] for i in members]
            out.append(empty if not values else values[0] if len(values) == 1 else reduce(torch.stack(values)))
        return torch.stack(out)

    amax = combine(1, torch.zeros((), dtype=torch.float32, device=device), torch.amax)
    amin_code = _ABS_MASK - combine(2, torch.zeros((), dtype=torch.int32, device=device), torch.amax)
    norms = combine(3, torch.zeros((), dtype=torch.float64, device=device), lambda n: n.square().sum().sqrt())
    return amax, amin_code, norms.square()


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
    (``aminmax`` is one kernel on CUDA and, on the CPU, ~25x faster than an inf-norm; no_grad,
    not ``detach()``, keeps it out of the graph: one dispatched op, not two.)"""
    with torch.no_grad():
        return torch.aminmax(tensor)


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
