"""The recipes that :mod:`ampdoctor.analysis.fp8` replays over every pass (:mod:`.fp8_passes`),
per (operand, format): each pass's scale, whether it clips, and on sampled passes what the cast
flushes and saturates.

**Recipes** (what ``tests/fp8_truth.py`` casts; ``.scratch/fp8_contract.md``). *Current* scaling
scales each pass by ``max / a_t`` (float32); *delayed* scaling with history L by ``max / window``,
the largest finite amax of the L passes before (TransformerEngine's ``DelayedScaling``: scale 1 at
the first pass, the previous scale kept while the window holds no positive amax). A pass *clips*
when its amax exceeds the amax its scale was made from; on sampled passes the histogram gives the
share of nonzero elements the cast *flushes* to 0 (at or below the format's half-subnormal over the
scale) and the share it *saturates* (above that amax).

The work is vectorised over every pass: windowed maxima come from a sparse table
(O(N log n) over N passes, never O(N L)), the shares only on sampled passes. No torch is imported
(the bins: :mod:`ampdoctor.run_file.fine_bins`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..run_file.fine_bins import EDGES, NAN_ONLY_BIN, bin_of, below
from ..float_formats import FLOAT8_E4M3FN, FLOAT8_E5M2, FloatFormat
from ..run_file.schema import FINE_BINS, GEMM_KINDS
from .fp8_passes import GRAD, INPUT, WEIGHT, Passes

HISTORIES = (1, 16, 1024)       # delayed scaling's histories: 1, torchao's old 16, TransformerEngine's 1024
FORMATS: dict[str, FloatFormat] = {"e4m3": FLOAT8_E4M3FN, "e5m2": FLOAT8_E5M2}
# (operand, row kind, format, variant), in the contract's order. Input and weight are E4M3 in both
# of TransformerEngine's formats; only the output gradient differs (HYBRID: E5M2, all-E4M3: E4M3).
OPERANDS = (("input", INPUT, "e4m3", "hybrid"), ("weight", WEIGHT, "e4m3", "hybrid"),
            ("grad_output", GRAD, "e5m2", "hybrid"), ("grad_output", GRAD, "e4m3", "all_e4m3"))
CHUNK_PASSES = 1 << 19          # passes per sparse table: bounds it to ~80 MB whatever the run's length

_F32_MAX = float(np.finfo(np.float32).max)


@dataclass
class Cast:
    """One recipe in one format over the passes of a chunk of sequences (:class:`Cells`): per
    pass its scale, the amax the scale was made from (``allowed``), whether it clipped, and
    the flushed and saturated shares (NaN where not sampled)."""

    recipe: str
    history: int | None
    scale: np.ndarray
    allowed: np.ndarray
    clipped: np.ndarray
    flushed: np.ndarray
    saturated: np.ndarray


@dataclass
class Cells:
    """Every recipe of one (operand, format) over one chunk of its sequences."""

    operand: str
    fmt: str
    variant: str
    seqs: list[int]             # the sequences, whose passes are lo:hi
    lo: int
    hi: int
    casts: list[Cast]           # current, then delayed per HISTORIES
    unavoidable: np.ndarray     # bool [hi - lo]: clipped under an unbounded history
    shortest: np.ndarray        # int64 [len(seqs)]: the least history that clips only those


def cells(p: Passes) -> Iterator[Cells]:
    """The recipes of every (operand, format) over all passes, a chunk of sequences at a time
    (:data:`CHUNK_PASSES`), so that memory stays bounded on long runs."""
    for kind in GEMM_KINDS:
        entries = [e for e in OPERANDS if e[1] == kind]
        for chunk in _chunks(p, p.sequences(kind)):
            lo, hi = int(p.starts[chunk[0]]), int(p.starts[chunk[-1] + 1])
            windows = _Windows(p.amax[lo:hi], p.starts[chunk[0]:chunk[-1] + 2] - lo)
            j0, j1 = np.searchsorted(p.sampled, [lo, hi])
            sampled, hist = p.sampled[j0:j1] - lo, p.histograms(j0, j1)
            cum = np.concatenate([np.zeros((len(hist), 1)), np.cumsum(hist, axis=1)], axis=1)
            shortest = windows.shortest_history()
            for operand, _, fmt, variant in entries:
                f = FORMATS[fmt]
                casts = [_current(windows.amax, f)] + [windows.delayed(f, h) for h in HISTORIES]
                for cast in casts:
                    _shares(cast, f, windows.amax, sampled, hist, cum)
                yield Cells(operand, fmt, variant, chunk, lo, hi, casts, windows.unavoidable(f), shortest)


def _chunks(p: Passes, seqs: list[int]) -> Iterator[list[int]]:
    """Adjacent sequences (of one kind) of up to :data:`CHUNK_PASSES` passes together (a longer
    one alone)."""
    chunk: list[int] = []
    size = 0
    for s in seqs:
        n = int(p.starts[s + 1] - p.starts[s])
        if chunk and (size + n > CHUNK_PASSES or s != chunk[-1] + 1):
            yield chunk
            chunk, size = [], 0
        chunk.append(s)
        size += n
    if chunk:
        yield chunk


def _current(amax: np.ndarray, f: FloatFormat) -> Cast:
    """Current scaling: each pass scaled from its own amax; a zero or non-finite one casts at 1
    (TransformerEngine's ``compute_scale_from_amax``)."""
    usable = np.isfinite(amax) & (amax > 0)
    scale = np.where(usable, _scale(f, np.where(usable, amax, 1.0)), 1.0)
    allowed = np.where(usable, amax, f.max)
    return _cast("current", None, amax, scale, allowed)


def _scale(f: FloatFormat, amax: np.ndarray) -> np.ndarray:
    """``max / amax`` in float32 as both libraries divide; an overflow is float32's maximum."""
    with np.errstate(divide="ignore", over="ignore"):
        s = (np.float32(f.max) / amax.astype(np.float32)).astype(np.float64)
    return np.where(np.isfinite(s), s, _F32_MAX)


def _cast(recipe: str, history: int | None, amax: np.ndarray, scale: np.ndarray, allowed: np.ndarray) -> Cast:
    """A pass whose amax is not finite overflowed in the AMP dtype itself (an fp16 step the scaler
    skipped: the loss scale's doing, which an FP8 run without one would not have): it is left out,
    neither clipped nor in any window. (TransformerEngine, given such an amax, would keep its scale
    for as long as the amax stays in its history.)"""
    nan = np.full(len(amax), np.nan)
    with np.errstate(invalid="ignore"):
        clipped = np.isfinite(amax) & (amax > allowed)
    return Cast(recipe, history, scale, allowed, clipped, nan, nan.copy())


class _Windows:
    """Range maxima of the finite amaxes of a chunk of sequences (``starts`` local, with the end):
    a sparse table, level k holding the maximum of 2^k passes from each one (non-finite amaxes
    are -inf: no window is made from them)."""

    def __init__(self, amax: np.ndarray, starts: np.ndarray) -> None:
        self.amax = amax
        n = len(amax)
        lengths = np.diff(starts)
        self.seq_start = np.repeat(starts[:-1], lengths)              # each pass's sequence start
        self.index = np.arange(n) - self.seq_start                     # each pass's place in it
        finite = np.where(np.isfinite(amax), amax, -np.inf)
        levels = max(1, int(lengths.max()).bit_length())
        table = np.full((levels, n), -np.inf)
        table[0] = finite
        for k in range(1, levels):
            m = n - (1 << k) + 1
            if m <= 0:
                break
            table[k, :m] = np.maximum(table[k - 1, :m], table[k - 1, (1 << (k - 1)):(1 << (k - 1)) + m])
        self.table = table
        self._windows: dict[int, np.ndarray] = {}
        self.later = self.index >= 1
        t = np.flatnonzero(self.later)
        self._t = t
        # Every history's window over an unbounded one: the largest finite amax before each pass.
        self.before = np.full(n, -np.inf)
        self.before[t] = self._range_max(self.seq_start[t], t - 1)

    def _range_max(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The largest finite amax of passes lo..hi (inclusive, lo <= hi)."""
        k = np.frexp((hi - lo + 1).astype(np.float64))[1] - 1  # floor(log2(length)), exact
        return np.maximum(self.table[k, lo], self.table[k, hi - (1 << k) + 1])

    def window(self, history: int) -> np.ndarray:
        """Per pass, the largest finite amax of the ``history`` passes before it in its sequence
        (-inf where there is none: the first pass, or only non-finite ones)."""
        if history not in self._windows:
            out = np.full(len(self.amax), -np.inf)
            t = self._t
            out[t] = self._range_max(np.maximum(self.seq_start[t], t - history), t - 1)
            self._windows[history] = out
        return self._windows[history]

    def delayed(self, f: FloatFormat, history: int) -> Cast:
        """Delayed scaling: the first pass at scale 1; later ones from the window when it holds a
        positive amax, else with the scale before (forward-filled from the last pass that set one).
        Non-finite amaxes are left out of every window (see :func:`_cast`)."""
        w = self.window(history)
        sets = ~self.later | (w > 0)
        last = np.maximum.accumulate(np.where(sets, np.arange(len(w)), 0))  # every sequence's first pass sets one
        first = ~self.later[last]
        made_from = np.where(first, 1.0, w[last])
        scale = np.where(first, 1.0, _scale(f, made_from))
        allowed = np.where(first, f.max, made_from)
        return _cast("delayed", history, self.amax, scale, allowed)

    def unavoidable(self, f: FloatFormat) -> np.ndarray:
        """The passes every history clips: the first pass beyond the format's maximum, and each
        later one beyond every earlier finite amax (beyond the maximum while none was positive)."""
        allowed = np.where(self.before > 0, self.before, f.max)
        with np.errstate(invalid="ignore"):
            return np.isfinite(self.amax) & (self.amax > allowed)

    def shortest_history(self) -> np.ndarray:
        """Per sequence, the least history L >= 1 whose delayed scaling clips exactly the
        unavoidable passes.

        Why this is a maximum of distances: a history-L scale at pass t is made from the largest
        finite amax of passes min(t - L, p)..t-1, p the last pass before t with a positive finite
        amax (a window without one keeps the scale that p's last window made), which grows with L.
        So t needs L = 1 when a_t <= a_p, it is unavoidable when a_t exceeds every earlier amax,
        and otherwise needs L = t - q, q the last pass before it with an amax >= a_t (found by
        binary lifting over the sparse table). L is the largest need; the format does not enter."""
        a, n = self.amax, len(self.amax)
        need = np.ones(n, dtype=np.int64)
        positive = np.isfinite(a) & (a > 0)
        last_positive = np.maximum.accumulate(np.where(positive, np.arange(n), -1))
        t = self._t
        p = last_positive[t - 1]
        has_p = p >= self.seq_start[t]
        with np.errstate(invalid="ignore"):
            masked = positive[t] & has_p & (a[t] <= self.before[t])
            masked[masked] &= a[t[masked]] > a[p[masked]]
        t = t[masked]
        if len(t):
            value, start, pos = a[t], self.seq_start[t], t.copy()
            for k in range(self.table.shape[0] - 1, -1, -1):
                cand = pos - (1 << k)
                ok = cand >= start
                move = ok & (self.table[k, np.where(ok, cand, 0)] < value)  # all of cand..pos-1 below a_t
                pos = np.where(move, cand, pos)
            need[t] = t - (pos - 1)
        starts = np.flatnonzero(self.index == 0)
        return np.maximum.reduceat(need, starts)


# -- the shares on sampled passes -----------------------------------------------------------------------

def _below_amax(hist: np.ndarray, cum: np.ndarray, threshold: np.ndarray, amax: np.ndarray) -> np.ndarray:
    """:func:`~ampdoctor.run_file.fine_bins.count_below`, knowing that no element exceeds the pass's finite amax: the bin that holds
    it spreads its count over [its lower edge, amax] instead of its whole width (so a threshold
    at or above the amax has every element below it, and current scaling saturates nothing)."""
    lower = below(hist, cum, threshold)
    finite = np.isfinite(amax) & (amax > 0)
    if not finite.any():
        return lower
    rows = np.flatnonzero(finite)
    a = amax[rows]
    b = bin_of(a)
    lo = EDGES[b]
    x = threshold[rows]
    total = cum[rows, FINE_BINS]
    with np.errstate(invalid="ignore", divide="ignore"):
        in_top = cum[rows, b] + hist[rows, b] * (x - lo) / (a - lo)
        lower[rows] = np.where(x >= a, total, np.where(x >= lo, in_top, lower[rows]))
    return lower


def _shares(cast: Cast, f: FloatFormat, amax: np.ndarray, sampled: np.ndarray, hist: np.ndarray,
            cum: np.ndarray) -> None:
    """The flushed and saturated shares of ``cast`` at the ``sampled`` passes (local indices;
    ``hist`` their histograms, ``cum`` its cumulative sums with a leading 0)."""
    if not len(sampled):
        return
    total = cum[:, FINE_BINS]
    a = amax[sampled]
    flushed = _below_amax(hist, cum, f.underflow_below / cast.scale[sampled], a)
    allowed = cast.allowed[sampled]
    # Above the allowed amax, NaN aside (it stays NaN at any scale; inf saturates).
    above = total - _below_amax(hist, cum, allowed, a) - hist[:, NAN_ONLY_BIN:].sum(axis=1)
    with np.errstate(invalid="ignore"):
        clipped_finite = np.isfinite(a) & (a > allowed)
    above = np.where(clipped_finite, np.maximum(above, 1.0), above)  # the amax element itself is beyond
    with np.errstate(invalid="ignore", divide="ignore"):
        cast.flushed[sampled] = np.where(total > 0, np.clip(flushed / total, 0.0, 1.0), 0.0)
        cast.saturated[sampled] = np.where(total > 0, np.clip(above / total, 0.0, 1.0), 0.0)

