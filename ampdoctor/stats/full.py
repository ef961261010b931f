"""Full statistics (:func:`full_stats`, on sampled and escalated steps), for each *slot* (one
tensor, or all tensors together when ``per_tensor=False``):

* ``amax``  largest finite magnitude, unscaled (0 when there is none);
* ``amin``  smallest nonzero finite magnitude, unscaled (NaN when there is none);
* ``l2``    L2 norm of the finite elements, unscaled (float64 sum of float32 partial sums);
* ``n_zero, n_subnormal`` judged on the *scaled* value, as backward produced it (subnormal: below
  the smallest normal of the AMP format); ``n_nan, n_inf`` judged on the unscaled value (a finite
  value that a scale below 1 overflows on unscaling reaches the optimizer as inf);
* ``hist``  counts of nonzero finite elements per binade of the unscaled magnitude; magnitudes
  below ``2**hist_min_exp`` (even those that flush to 0 when unscaled in fp32) go to bin 0;
* ``n_zero_lines`` zeros lying in an all-zero row or column (:func:`zero_line_elements`).

``FullStats`` (:mod:`.full_results`) holds them as counts per slot and *code*, which it decodes on
the host.

Three algorithms compute the same numbers: *host* reduces the slices of each chunk of the tensors
one by one; *accelerator* (pure torch) runs a fixed number of launches per chunk whatever the
number of tensors in it; *triton* (:mod:`.full_triton`, CUDA) two fused kernels for the whole
call. None uses float atomics or atomics into a few addresses (results are the same run to run;
``use_deterministic_algorithms`` is respected). Nothing here calls ``.item()``, boolean indexing
or any other op whose output size depends on data, so on an accelerator it queues kernels and
returns.
"""

from __future__ import annotations

import collections
import warnings
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

import torch

from ..run_file.schema import HIST_BINS, HIST_MIN_EXP
from .algorithms import choose_algorithm, rescaled_norm
from .full_results import _ABOVE, _ABS_MASK, _BELOW, _CODES, _ZERO, SLOT_STRIDE, FullStats

CHUNK_ELEMENTS = 1 << 21  # bounds the accelerator algorithm's temporaries: ~28 bytes per element, ~56 MiB
# On the CPU, chunks whose temporaries stay in cache: fresh multi-MB temporaries cost a page fault
# per 4 KiB, which made the pass 2-4x slower than its arithmetic.
CPU_CHUNK_ELEMENTS = 1 << 18

Chunks = Iterator[tuple[list[torch.Tensor], list[tuple[int, int, int]]]]  # (views, (slot, start, length) segments)


class SlotLayout(NamedTuple):
    """The small index tensors of one chunk layout, on the device (see :class:`SlotLayouts`)."""

    starts: torch.Tensor      # int64 [segments]: where each segment starts in the chunk
    lasts: torch.Tensor       # int64 [segments]: its last element
    steps: torch.Tensor       # key dtype [segments]: (slot - previous segment's slot) * SLOT_STRIDE, 0 first
    slot_bases: torch.Tensor  # int64 [segments]: slot * SLOT_STRIDE
    edges: torch.Tensor       # key dtype: 0 .. (last slot - first slot + 1) * SLOT_STRIDE, the keys' bounds


class SlotLayouts:
    """Caches, per chunk layout, the small index tensors of the accelerator algorithm on the
    device (:class:`SlotLayout`).

    Built from Python lists they are a host-to-device copy; the layouts of a model's gradients
    rarely change, so each is built once. Least recently used layouts go first when the cache is
    full, and a miss copies from pinned memory without blocking (no sync): a model with more chunk
    layouts than the cache holds (GPT-2-XL has 193) costs an asynchronous copy per miss, no stall."""

    def __init__(self, max_entries: int = 1024) -> None:
        self._cache: collections.OrderedDict[tuple, SlotLayout] = collections.OrderedDict()
        self._max_entries = max_entries
        self.misses = 0

    def get(self, device: torch.device, segments: tuple[tuple[int, int, int], ...], dtype=torch.int32) -> SlotLayout:
        """The :class:`SlotLayout` of the chunk's ``(slot, start, length)`` segments, keys of ``dtype``."""
        key = (device, segments, dtype)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        self.misses += 1
        if len(self._cache) >= self._max_entries:
            self._cache.popitem(last=False)
        slots = [slot for slot, _, _ in segments]
        n_edges = (slots[-1] - slots[0] + 1) * SLOT_STRIDE + 1
        host = torch.tensor([[start for _, start, _ in segments],
                             [start + length - 1 for _, start, length in segments],
                             [(b - a) * SLOT_STRIDE for a, b in zip(slots[:1] + slots, slots)],
                             [slot * SLOT_STRIDE for slot in slots]], dtype=torch.int64)
        if device.type != "cpu" and torch.accelerator.is_available():
            host = host.pin_memory()  # pageable memory would make the copy synchronous
        starts, lasts, steps, bases = host.to(device, non_blocking=True).unbind(0)
        edges = torch.arange(n_edges, dtype=dtype, device=device)
        hit = self._cache[key] = SlotLayout(starts, lasts, steps.to(dtype), bases, edges)
        return hit

    def __len__(self) -> int:
        return len(self._cache)


_DEFAULT_LAYOUTS = SlotLayouts()


def full_stats(
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
) -> FullStats:
    """Full statistics of ``tensors`` (one device, one dtype; they hold *scaled* values).

    ``inv_scale`` is the 0-dim float32 reciprocal of the loss scale on the same device (None when
    scaling is off); ``subnormal_below`` is the AMP format's smallest normal; ``lines`` how the
    zero lines are counted (:func:`zero_line_elements`); ``algorithm`` ``"host"``,
    ``"accelerator"`` or ``"triton"`` (default: :func:`~ampdoctor.stats.algorithm_for` the
    device). Does not sync.
    """
    if not tensors:
        raise ValueError("full_stats needs at least one tensor")
    algorithm = choose_algorithm(algorithm, tensors, full=True)
    with torch.no_grad():
        if algorithm == "triton":  # (clamps the scale in its kernel: one launch fewer per call)
            fields = _triton(tensors, inv_scale, _threshold(subnormal_below, tensors[0].dtype), per_tensor,
                             hist_min_exp, hist_bins, lines)
            if fields is not None:
                return FullStats.of_packed(*fields, hist_min_exp, hist_bins)
            algorithm = "accelerator"
        job = _Job.of(tensors, per_tensor, inv_scale, subnormal_below)
        line_zeros = _line_zeros(tensors, per_tensor, lines)
        if algorithm == "host":
            totals = _host_algorithm(job, _chunks(tensors, per_tensor, CPU_CHUNK_ELEMENTS))
        else:
            totals = _accelerator_algorithm(job, _chunks(tensors, per_tensor, CHUNK_ELEMENTS),
                                            _DEFAULT_LAYOUTS if layouts is None else layouts)
    return FullStats(totals.counts, totals.amax, totals.amin_code, totals.sumsq, line_zeros, hist_min_exp, hist_bins)


_TRITON_FAILED: list[str] = []  # why the triton algorithm stopped being used in this process, if it did


def _triton(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor | None, threshold: float, per_tensor: bool,
            hist_min_exp: int, hist_bins: int, lines: str) -> tuple | None:
    """The triton algorithm's ``(buffer, slots)``: its results packed in one buffer (:mod:`.packed`), or None where it
    cannot run here (a Triton too old or broken to compile the kernels): then this process uses
    the accelerator algorithm from here on, after one warning, rather than stop recording.
    Compilation comes before any launch, so a failure leaves nothing half done."""
    if _TRITON_FAILED:
        return None
    try:
        from .full_triton import triton_full_stats  # imports Triton: only where it runs

        return triton_full_stats(tensors, per_tensor=per_tensor, inv_scale=inv_scale, threshold=threshold,
                                 hist_min_exp=hist_min_exp, hist_bins=hist_bins, lines=lines,
                                 slot_stride=SLOT_STRIDE, above_at=_ABOVE)
    except Exception as exc:  # noqa: BLE001 - the torch algorithm computes the same numbers
        _TRITON_FAILED.append(f"{type(exc).__name__}: {exc}".splitlines()[0])
        warnings.warn(f"ampdoctor: the Triton statistics kernels failed here ({_TRITON_FAILED[0]}); "
                      "using the slower torch algorithm instead", RuntimeWarning, stacklevel=4)
        return None


@dataclass
class _Job:
    """One call of :func:`full_stats`: its slots, their device, and how each element is judged."""

    n_slots: int
    device: torch.device
    inv_scale: torch.Tensor | None  # unscales (None: not scaled)
    threshold: float                # a scaled magnitude below it is subnormal (zeros included)

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], per_tensor: bool, inv_scale: torch.Tensor | None,
           subnormal_below: float) -> "_Job":
        if inv_scale is not None:
            # A scale of 0 (collapsed) would make 0 * inf = NaN of every zero.
            inv_scale = inv_scale.clamp(max=torch.finfo(torch.float32).max)
        return cls(len(tensors) if per_tensor else 1, tensors[0].device, inv_scale,
                   _threshold(subnormal_below, tensors[0].dtype))

    def zero_counts(self) -> torch.Tensor:
        """int64 ``[n_slots * SLOT_STRIDE]``: the counts either algorithm adds to."""
        return torch.zeros(self.n_slots * SLOT_STRIDE, dtype=torch.int64, device=self.device)


@dataclass
class _Totals:
    """Per-slot results of either algorithm, on the tensors' device."""

    counts: torch.Tensor     # see FullStats
    amax: torch.Tensor
    amin_code: torch.Tensor
    sumsq: torch.Tensor


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


def _chunks(tensors: Sequence[torch.Tensor], per_tensor: bool, limit: int) -> Chunks:
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


# -- the host algorithm --------------------------------------------------------------------------
def _host_algorithm(job: _Job, chunks: Chunks) -> _Totals:
    """Reductions over the slices of each chunk (no launch overhead to amortise on the CPU),
    accumulated into the per-slot totals."""
    totals = _Totals(job.zero_counts(), torch.zeros(job.n_slots, dtype=torch.float32, device=job.device),
                     torch.full((job.n_slots,), _ABS_MASK, dtype=torch.int32, device=job.device),
                     torch.zeros(job.n_slots, dtype=torch.float64, device=job.device))
    for views, segments in chunks:
        flat = views[0] if len(views) == 1 else torch.cat(views)
        _host_chunk(job, totals, flat, segments)
    return totals


def _host_chunk(job: _Job, totals: _Totals, flat: torch.Tensor, segments: list[tuple[int, int, int]]) -> None:
    scaled_abs = flat.abs()
    # float32 from here on: exact for fp16/bf16 values, and compares on float32 are twice as fast.
    scaled32 = scaled_abs.float() if scaled_abs.dtype != torch.float32 else scaled_abs
    unscaled = scaled32 * job.inv_scale if job.inv_scale is not None else scaled32  # torch's unscale_ product
    bits = unscaled.view(torch.int32) & _ABS_MASK  # abs() may keep the sign of -NaN
    code = bits >> 22
    finite_values = torch.nan_to_num(bits.view(torch.float32), nan=0.0, posinf=0.0)
    # (bits - 1) & mask: zero wraps to the top, non-finite stays above every finite nonzero.
    nonzero_code = (bits - 1) & _ABS_MASK
    below = scaled32 < job.threshold
    counts, amax, amin_code = totals.counts, totals.amax, totals.amin_code
    for slot, start, length in segments:
        part = slice(start, start + length)
        base = slot * SLOT_STRIDE
        zeros = length - torch.count_nonzero(scaled_abs[part])
        counts[base:base + _CODES] += torch.bincount(code[part], minlength=_CODES)
        counts[base + _ZERO] += zeros
        counts[base + _BELOW] += torch.count_nonzero(below[part]) - zeros
        values = finite_values[part]
        top = values.max()
        amax[slot] = torch.maximum(amax[slot], top)
        amin_code[slot] = torch.minimum(amin_code[slot], nonzero_code[part].min())
        totals.sumsq[slot] += rescaled_norm(values, top).square()


# -- the accelerator algorithm -------------------------------------------------------------------
class _SegmentResult(NamedTuple):
    """The reductions of one segment of a chunk, 0-dim on the device."""

    slot: int
    amax: torch.Tensor
    flipped_amin: torch.Tensor  # _ABS_MASK - amin_code: the smallest nonzero as a maximum
    norm: torch.Tensor          # float64


def _accelerator_algorithm(job: _Job, chunks: Chunks, layouts: SlotLayouts) -> _Totals:
    """A fixed number of launches per chunk whatever its number of tensors, and no atomics
    into a few addresses (which serialise on a GPU): the codes' counts come from sorting the
    chunk's keys (``slot * SLOT_STRIDE + code``) and finding where each key's run begins
    (``searchsorted``), the zeros and subnormals per segment from integer prefix sums; maxima,
    minima and sums of squares through grouped reductions over the chunk's segments, combined
    per slot afterwards. No float atomics and no ``scatter_reduce``: results are the same run to
    run, also under ``torch.use_deterministic_algorithms``. Temporaries peak at about 28 bytes
    per element of a chunk (the float32 work buffer, the keys, the sort's values and int64
    indices; ``CHUNK_ELEMENTS``; the test measures it)."""
    device, counts = job.device, job.zero_counts()
    # int32 keys (half the memory) unless slot * SLOT_STRIDE could pass 2**31 (over 4 million tensors)
    index_dtype = torch.int32 if job.n_slots * SLOT_STRIDE < 2**31 else torch.int64
    results: list[_SegmentResult] = []
    for views, segments in chunks:
        # One float32 work buffer, changed in place: |scaled|, then |unscaled|, then its finite part.
        if len(views) == 1:
            work = views[0].abs() if views[0].dtype == torch.float32 else views[0].float().abs_()
        else:
            flat = torch.cat(views)
            work = flat.abs_() if flat.dtype == torch.float32 else flat.float().abs_()
            del flat
        layout = layouts.get(device, tuple(segments), index_dtype)
        # Zeros and nonzero subnormals per segment: differences of prefix sums at its ends.
        # (1-D scans: CUDA scans a [2, n] tensor along its rows with one block per row, 30x slower.)
        zeros = _segment_sums(work == 0, layout)
        below = _segment_sums(work < job.threshold, layout)  # zeros too
        counts.index_add_(0, layout.slot_bases + _ZERO, zeros)  # one entry per segment: distinct
        counts.index_add_(0, layout.slot_bases + _BELOW, below - zeros)
        del zeros, below
        if job.inv_scale is not None:
            work.mul_(job.inv_scale)  # torch's unscale_ product
        # The codes' counts: each key's run in the sorted keys, over the keys of this chunk's slots.
        first_key = segments[0][0] * SLOT_STRIDE
        key = (work.view(torch.int32) & _ABS_MASK).bitwise_right_shift_(22).to(index_dtype)  # abs() may keep -NaN's sign
        if len(segments) > 1:
            key += torch.zeros(work.numel(), dtype=index_dtype, device=device).scatter_(
                0, layout.starts, layout.steps).cumsum_(0)  # slot offset from the chunk's first slot
        ordered = torch.sort(key).values
        del key
        bounds = torch.searchsorted(ordered, layout.edges)
        del ordered
        counts.narrow(0, first_key, len(layout.edges) - 1).add_(bounds.diff())  # (narrow: fake CUDA refuses slices)
        del bounds
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
        results.extend(_SegmentResult(slot, top, low, norm)
                       for (slot, _, _), top, low, norm in zip(segments, maxima, minima, norms))
    return _per_slot(job, counts, results)


def _segment_sums(flags: torch.Tensor, layout: SlotLayout) -> torch.Tensor:
    """int64 [segments]: the true elements of bool ``flags`` in each segment of the chunk, as
    differences of an int32 prefix sum (exact: a chunk holds fewer than 2**31 elements)."""
    flags = flags.to(torch.int32)
    sums = flags.cumsum(0)  # inclusive: a segment's is its last sum less its first plus its first flag
    return (sums.index_select(0, layout.lasts) - sums.index_select(0, layout.starts)
            + flags.index_select(0, layout.starts)).long()


def _per_slot(job: _Job, counts: torch.Tensor, results: list[_SegmentResult]) -> _Totals:
    """The totals per slot from the segments' results, combining the segments of a tensor split
    over chunks; a slot with no segment (an empty tensor) has no nonzero element."""
    by_slot: list[list[_SegmentResult]] = [[] for _ in range(job.n_slots)]
    for result in results:
        by_slot[result.slot].append(result)

    def combine(field: str, empty: torch.Tensor, reduce) -> torch.Tensor:
        out = []
        for members in by_slot:
            values = [getattr(r, field) for r in members]
            out.append(empty if not values else values[0] if len(values) == 1 else reduce(torch.stack(values)))
        return torch.stack(out)

    device = job.device
    amax = combine("amax", torch.zeros((), dtype=torch.float32, device=device), torch.amax)
    amin_code = _ABS_MASK - combine("flipped_amin", torch.zeros((), dtype=torch.int32, device=device), torch.amax)
    norms = combine("norm", torch.zeros((), dtype=torch.float64, device=device), lambda n: n.square().sum().sqrt())
    return _Totals(counts, amax, amin_code, norms.square())


def _threshold(value: float, dtype: torch.dtype) -> float:
    """``value`` for a comparison with a ``dtype`` tensor (which casts it to ``dtype``): at least
    the smallest subnormal, so that a threshold below the format's range cannot round to 0 and
    stop zeros from counting as below it."""
    info = torch.finfo(dtype)
    return max(value, info.tiny * info.eps)
