"""``ampdoctor fp8``'s data: FP8 readiness (issue 29; docs/numerics.md, FP8 readiness). Per GEMM
layer, what a tensorwise FP8 recipe would do to the three tensors its GEMMs cast (the input and the
weight in E4M3, the output gradient in E5M2, TransformerEngine's HYBRID, or in E4M3), predicted
from the run's GEMM operand rows (``schema.GEMM_KINDS``): each operand's amax at every *pass* (one
row, ordered by step and call), and on module-sampled steps its fine histogram
(:mod:`ampdoctor.stats.fine_hist`).

**Recipes** (what ``tests/fp8_truth.py`` casts; ``.scratch/fp8_contract.md``). *Current* scaling
scales each pass by ``max / a_t`` (float32); *delayed* scaling with history L by ``max / window``,
the largest finite amax of the L passes before (TransformerEngine's ``DelayedScaling``: scale 1 at
the first pass, the previous scale kept while the window holds no positive amax). A pass *clips*
when its amax exceeds the amax its scale was made from; on sampled passes the histogram gives the
share of nonzero elements the cast *flushes* to 0 (at or below the format's half-subnormal over the
scale) and the share it *saturates* (above that amax). Several ranks make one pass of the largest
amax and the summed counts, as TransformerEngine reduces the amax over ranks.

**Verdicts.** ``keep`` a layer that current scaling (the best a tensorwise recipe does) would make
lose more than ``flush_limit`` of an operand's nonzero elements at a sampled pass whose amax is
finite (a non-finite one overflowed in the AMP dtype already); ``unknown`` one with an operand
never sampled so; else ``ready``. The *shortest history* is the least L whose delayed
scaling clips only the passes that any history must clip (those whose amax exceeds every earlier
one).

The core works on a DataFrame of GEMM rows and the run's metadata (:func:`frame_data`,
:func:`frame_predictions`), so it is testable without recording; :func:`fp8_data` and
:func:`predictions` read a run. No torch is imported: reading a run needs none (the bins:
:mod:`ampdoctor.run_file.fine_bins`). The work is vectorised over every pass: windowed maxima come from a sparse table
(O(N log n) over N passes, never O(N L)), the shares only on sampled passes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Mapping

import numpy as np
import pandas as pd

from ..errors import RunError
from ..run_file.fine_bins import EDGES, NAN_ONLY_BIN, bin_of, below, count_below  # noqa: F401 - count_below: re-exported
from ..float_formats import FLOAT8_E4M3FN, FLOAT8_E5M2, FloatFormat
from ..read.run import Run, read_run, to_frame
from ..run_file.schema import (FINE_BINS, GEMM_KINDS, meta_names, META_AMP_DTYPE, META_DEVICE, META_GEMM_LAYERS, META_LEVEL, META_RUN_ID,
                      ROOT_NAME)

HISTORIES = (1, 16, 1024)       # delayed scaling's histories: 1, torchao's old 16, TransformerEngine's 1024
DEFAULT_FLUSH_LIMIT = 0.01
FORMATS: dict[str, FloatFormat] = {"e4m3": FLOAT8_E4M3FN, "e5m2": FLOAT8_E5M2}
INPUT, WEIGHT, GRAD = GEMM_KINDS
# (operand, row kind, format, variant), in the contract's order. Input and weight are E4M3 in both
# of TransformerEngine's formats; only the output gradient differs (HYBRID: E5M2, all-E4M3: E4M3).
OPERANDS = (("input", INPUT, "e4m3", "hybrid"), ("weight", WEIGHT, "e4m3", "hybrid"),
            ("grad_output", GRAD, "e5m2", "hybrid"), ("grad_output", GRAD, "e4m3", "all_e4m3"))
VERDICT_OPERANDS = OPERANDS[:3]  # what the default recipe (HYBRID) casts
CONVOLUTIONS = frozenset({"Conv1d", "Conv2d", "Conv3d"})  # neither TransformerEngine nor torchao converts them
COLUMNS = ["step", "rank", "kind", "name", "call", "amax", "fine_hist"]
RECORDED_SINCE = "2026-11-27"   # the first ampdoctor that recorded GEMM operand rows
CHUNK_PASSES = 1 << 19          # passes per sparse table: bounds it to ~80 MB whatever the run's length

_F32_MAX = float(np.finfo(np.float32).max)


# -- the passes ---------------------------------------------------------------------------------------

@dataclass
class Passes:
    """Every (layer, row kind)'s passes, concatenated: sequence ``s`` holds the passes
    ``starts[s]:starts[s + 1]`` in (step, call) order, each the rows of one (step, call) over the
    ranks (a weight: one per step). The passes ``sampled`` (ascending) have fine histograms:
    :meth:`histograms` sums their ranks' rows when asked, a chunk at a time, so that a long run's
    histograms are not all copied at once."""

    layer: list[str]          # per sequence
    kind: list[str]           # per sequence
    starts: np.ndarray        # int64 [S + 1]
    step: np.ndarray          # int64 [N]
    call: np.ndarray          # int64 [N], -1 where the row did not say
    amax: np.ndarray          # float64 [N]: NaN if a rank's tensor held a NaN, else inf if an inf, else max |x|
    sampled: np.ndarray       # int64 [M]
    ranks: int
    calls_per_step: np.ndarray  # int64 [S]: the most passes of the sequence in one step
    _hists: np.ndarray        # object: the frame's fine_hist column
    _sources: np.ndarray      # int64: rows of _hists, sampled pass by sampled pass ...
    _offsets: np.ndarray      # int64 [M + 1]: ... pass j's rows at _sources[_offsets[j]:_offsets[j + 1]]

    def sequences(self, kind: str) -> list[int]:
        return [s for s, k in enumerate(self.kind) if k == kind]

    def histograms(self, j0: int, j1: int) -> np.ndarray:
        """float64 [j1 - j0, FINE_BINS]: the rank-summed histograms of sampled passes j0..j1-1."""
        if j1 <= j0:
            return np.zeros((0, FINE_BINS))
        a, b = self._offsets[j0], self._offsets[j1]
        stacked = np.stack([np.asarray(self._hists[i], dtype=np.float64) for i in self._sources[a:b]])
        return np.add.reduceat(stacked, self._offsets[j0:j1] - a, axis=0)


def gemm_passes(frame: pd.DataFrame) -> Passes | None:
    """The passes of the GEMM rows of ``frame`` (columns :data:`COLUMNS`; ``fine_hist`` a list or
    array per row, or None), or None when it has none."""
    rows = frame[frame["kind"].isin(GEMM_KINDS)]
    if not len(rows):
        return None
    n = len(rows)
    names, name_codes = _codes(rows["name"])
    kinds, kind_codes = _codes(rows["kind"])
    kind_codes = np.array([GEMM_KINDS.index(k) for k in kinds], dtype=np.int64)[kind_codes]
    step = rows["step"].to_numpy(dtype=np.int64)
    rank = rows["rank"].to_numpy(dtype=np.int64) if "rank" in rows else np.zeros(n, np.int64)
    call = (pd.to_numeric(rows["call"]).fillna(-1).to_numpy(dtype=np.int64) if "call" in rows
            else np.full(n, -1, np.int64))
    # (a null amax reads as NaN: not clipped, never a window's maximum)
    amax = pd.to_numeric(rows["amax"]).to_numpy(dtype=np.float64, na_value=np.nan)
    hists = rows["fine_hist"].to_numpy(dtype=object) if "fine_hist" in rows else np.full(n, None, object)

    # Sequences kind-major, so that those of one kind lie together (cells() takes them in chunks).
    seq = kind_codes * len(names) + name_codes
    # A weight is one pass per step (its rows say the layer's first call, which ranks need not share).
    pass_call = np.where(kind_codes == GEMM_KINDS.index(WEIGHT), -1, call)
    order = np.lexsort((rank, pass_call, step, seq))
    seq, step, pass_call, call, amax = seq[order], step[order], pass_call[order], call[order], amax[order]
    new = np.ones(n, dtype=bool)
    new[1:] = (seq[1:] != seq[:-1]) | (step[1:] != step[:-1]) | (pass_call[1:] != pass_call[:-1])
    first = np.flatnonzero(new)
    group = np.cumsum(new) - 1
    if len(first) == n:  # one row per pass (one rank): nothing to reduce
        pass_amax, pass_call_min = amax, call
    else:
        # np.maximum propagates NaN: a pass is NaN if any rank's tensor held one, else inf if any did
        pass_amax = np.maximum.reduceat(amax, first)
        known = np.where(call >= 0, call, np.iinfo(np.int64).max)
        pass_call_min = np.minimum.reduceat(known, first)
        pass_call_min = np.where(pass_call_min == np.iinfo(np.int64).max, -1, pass_call_min)

    # The histograms: summed over the ranks that sampled the pass (all of them on module-sampled
    # steps, which every rank shares; the shares are then those of the elements counted).
    with_hist = np.flatnonzero(pd.notna(hists))
    with_hist = with_hist[[len(hists[i]) == FINE_BINS for i in with_hist]]  # (another length: not read)
    sorted_at = np.empty(n, np.int64)
    sorted_at[order] = np.arange(n)
    rows_with = np.sort(sorted_at[with_hist])    # their places in the sorted rows
    g = group[rows_with]
    offsets = np.flatnonzero(np.r_[True, g[1:] != g[:-1]]) if len(g) else np.zeros(0, np.int64)
    sampled = g[offsets]

    pass_seq = seq[first]
    seq_first = np.flatnonzero(np.r_[True, pass_seq[1:] != pass_seq[:-1]])
    starts = np.r_[seq_first, len(first)].astype(np.int64)
    pass_step = step[first]
    # The most passes of a sequence in one step: the longest run of one step within it.
    step_first = np.flatnonzero(np.r_[True, (pass_seq[1:] != pass_seq[:-1]) | (pass_step[1:] != pass_step[:-1])])
    per_step = np.diff(np.r_[step_first, len(first)])
    calls_per_step = np.maximum.reduceat(per_step, np.searchsorted(step_first, seq_first))
    codes = pass_seq[seq_first]
    return Passes(layer=[names[c % len(names)] for c in codes],
                  kind=[GEMM_KINDS[c // len(names)] for c in codes],
                  starts=starts, step=pass_step, call=pass_call_min, amax=pass_amax,
                  sampled=sampled.astype(np.int64), ranks=int(pd.Series(rank).nunique()),
                  calls_per_step=calls_per_step, _hists=hists, _sources=order[rows_with],
                  _offsets=np.r_[offsets, len(rows_with)].astype(np.int64))


def _codes(column: pd.Series) -> tuple[list[str], np.ndarray]:
    """The distinct values of a (dictionary-encoded) string column as str, and each row's index
    into them (a categorical's codes: no string per row is made)."""
    codes, uniques = pd.factorize(column, sort=False)
    return [str(u) for u in uniques], codes.astype(np.int64)


# -- the recipes over every pass ------------------------------------------------------------------------

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


# -- the data ------------------------------------------------------------------------------------------

def frame_predictions(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (layer, operand, format, recipe, history, step, call) of the GEMM rows of
    ``frame``: ``variant``, ``amax``, ``scale``, ``allowed`` (the amax the scale was made from),
    ``clipped`` (bool), ``flushed`` and ``saturated`` (shares of the nonzero elements; NaN where not
    sampled). ``history`` is NaN for current scaling; ``call`` is -1 where the row did not say."""
    p = gemm_passes(frame)
    columns = ["layer", "operand", "format", "variant", "recipe", "history", "step", "call", "amax", "scale",
               "allowed", "clipped", "flushed", "saturated"]
    if p is None:
        return pd.DataFrame({c: [] for c in columns})
    parts = []
    for c in cells(p):
        n = c.hi - c.lo
        lengths = np.diff(p.starts[c.seqs[0]:c.seqs[-1] + 2])
        layer = np.repeat(np.array([p.layer[s] for s in c.seqs], dtype=object), lengths)
        for cast in c.casts:
            parts.append(pd.DataFrame({
                "layer": layer, "operand": c.operand, "format": c.fmt, "variant": c.variant, "recipe": cast.recipe,
                "history": np.full(n, np.nan if cast.history is None else float(cast.history)),
                "step": p.step[c.lo:c.hi], "call": p.call[c.lo:c.hi], "amax": p.amax[c.lo:c.hi],
                "scale": cast.scale, "allowed": cast.allowed, "clipped": cast.clipped,
                "flushed": cast.flushed, "saturated": cast.saturated}))
    return pd.concat(parts, ignore_index=True)[columns]


def frame_data(frame: pd.DataFrame, metadata: Mapping[str, str] | None = None, *,
               flush_limit: float = DEFAULT_FLUSH_LIMIT, path: str = "") -> dict:
    """:func:`fp8_data` of the rows of ``frame`` (columns :data:`COLUMNS`) and the run's
    ``metadata``, without ``path`` and ``run_id``. Raises :class:`RunError` when ``frame`` holds
    no GEMM rows (``path`` names the run in its message)."""
    if not (0.0 <= flush_limit <= 1.0):
        raise ValueError(f"flush_limit must be between 0 and 1, not {flush_limit!r}")
    metadata = dict(metadata or {})
    p = gemm_passes(frame)
    if p is None:
        raise RunError(no_operands_message(path, metadata))
    types = _layer_types(metadata)
    operand_data: dict[tuple[int, str, str], tuple[dict, tuple]] = {}
    for c in cells(p):
        for j, s in enumerate(c.seqs):
            operand_data[(s, c.operand, c.fmt)] = _operand_data(p, c, j, s)

    by_layer: dict[str, dict[str, int]] = {}
    for s, (layer, kind) in enumerate(zip(p.layer, p.kind)):
        by_layer.setdefault(layer, {})[kind] = s
    order = _layer_order(p, types)
    # A layer of model.gemm_layers with no row at all was never called as a module (the out_proj
    # of nn.MultiheadAttention, whose forward uses its weight directly): nothing to assess.
    not_called = [name for name in order if name not in by_layer]
    layers = [_layer_data(name, types.get(name), by_layer[name], operand_data, p, flush_limit)
              for name in order if name in by_layer]

    verdicts = {v: [layer["name"] for layer in layers if layer["verdict"] == v] for v in ("keep", "ready", "unknown")}
    kept = sorted("" if layer["name"] == ROOT_NAME else layer["name"]
                  for layer in layers if layer["verdict"] == "keep" and layer["converted"])
    histories = [layer["shortest_history"] for layer in layers
                 if layer["verdict"] != "keep" and layer["shortest_history"] is not None]
    steps = p.step
    sampled_steps = np.unique(p.step[p.sampled]).tolist()
    limits = ["per_block_formats"]
    if any(not layer["converted"] for layer in layers):
        limits.append("convolutions_not_converted")
    if not sampled_steps:
        limits.append("no_sampled_steps")
    if any(layer["calls_per_step"] > 1 for layer in layers):
        limits.append("several_calls_per_step")
    if p.ranks > 1:
        limits.append("several_ranks")
    if not_called:
        limits.append("not_called")
    return {
        "amp_dtype": metadata.get(META_AMP_DTYPE), "device": metadata.get(META_DEVICE),
        "steps": {"first": int(steps.min()), "last": int(steps.max()), "passes": int(pd.Series(steps).nunique())},
        "sampled_steps": sampled_steps,
        "flush_limit": float(flush_limit),
        "histories": list(HISTORIES),
        "formats": {key: {"dtype": f.name, "max": float(f.max), "flushes_at_or_below": float(f.underflow_below)}
                    for key, f in FORMATS.items()},
        "layers": layers,
        **verdicts,
        "not_called": not_called,
        "module_filter_fn": ("lambda mod, fqn: fqn not in {" + ", ".join(repr(n) for n in kept) + "}"
                             if kept else None),
        "shortest_history": max(histories) if histories else None,
        "limits": limits,
    }


def _operand_data(p: Passes, c: Cells, j: int, s: int) -> tuple[dict, tuple]:
    """One (operand, format) of one layer (sequence ``s``, the ``j``-th of ``c``): its passes'
    facts and each recipe's summary; and its current scaling's (flushed, saturated, step) at the
    sampled passes, which the verdict reads."""
    lo, hi = int(p.starts[s]), int(p.starts[s + 1])
    a, b = lo - c.lo, hi - c.lo
    steps = p.step[lo:hi]
    i0, i1 = np.searchsorted(p.sampled, [lo, hi])
    sampled = p.sampled[i0:i1] - c.lo
    sampled_steps = p.step[sampled + c.lo]
    amax = p.amax[lo:hi]
    seen = amax[~np.isnan(amax)]
    recipes = []
    for cast in c.casts:
        clipped = cast.clipped[a:b]
        entry = {"recipe": cast.recipe, "history": cast.history}
        if len(sampled):
            flushed, saturated = cast.flushed[sampled], cast.saturated[sampled]
            worst = int(np.argmax(flushed))
            entry.update(flushed_mean=float(flushed.mean()), flushed_max=float(flushed[worst]),
                         flushed_max_step=int(sampled_steps[worst]),
                         saturated_mean=float(saturated.mean()), saturated_max=float(saturated.max()))
        else:
            entry.update(flushed_mean=None, flushed_max=None, flushed_max_step=None, saturated_mean=None,
                         saturated_max=None)
        entry.update(clipped_passes=int(clipped.sum()), clipped_steps=np.unique(steps[clipped]).tolist())
        recipes.append(entry)
    data = {
        "operand": c.operand, "format": c.fmt, "variant": c.variant,
        # the peak, inf included (JSON writes it as null); None when every pass was NaN
        "amax_max": float(seen.max()) if len(seen) else None,
        "passes": int(hi - lo), "sampled_passes": len(sampled),
        "shortest_history": int(c.shortest[j]),
        "unavoidable_clip_steps": np.unique(steps[c.unavoidable[a:b]]).tolist(),
        "unavoidable_clip_passes": int(c.unavoidable[a:b].sum()),  # (several calls a step: passes, not steps)
        "recipes": recipes,
    }
    current = c.casts[0]
    # The verdict leaves out passes whose amax is not finite: the AMP run itself overflowed there
    # (its report and postmortem say so), and no FP8 recipe makes that better or worse.
    finite = np.isfinite(p.amax[sampled + c.lo])
    return data, (current.flushed[sampled][finite], current.saturated[sampled][finite], sampled_steps[finite])


def _empty_operand(operand: str, fmt: str, variant: str) -> tuple[dict, None]:
    """An operand the run has no row of (a layer that never ran backward has no output gradient)."""
    return {"operand": operand, "format": fmt, "variant": variant, "amax_max": None, "passes": 0,
            "sampled_passes": 0, "shortest_history": None, "unavoidable_clip_steps": [], "unavoidable_clip_passes": 0,
            "recipes": [{"recipe": r, "history": h, "flushed_mean": None, "flushed_max": None,
                         "flushed_max_step": None, "saturated_mean": None, "saturated_max": None,
                         "clipped_passes": 0, "clipped_steps": []}
                        for r, h in [("current", None)] + [("delayed", h) for h in HISTORIES]]}, None


def _layer_data(name: str, kind: str | None, seqs: dict[str, int], operand_data: dict, p: Passes,
                flush_limit: float) -> dict:
    """One layer: its operands, its verdict and the reasons for it, its shortest history."""
    operands, reasons, unsampled, known = [], [], False, []
    for entry in OPERANDS:
        operand, row_kind, fmt, variant = entry
        s = seqs.get(row_kind)
        op, current = _empty_operand(operand, fmt, variant) if s is None else operand_data[(s, operand, fmt)]
        operands.append(op)
        if entry not in VERDICT_OPERANDS:
            continue
        if op["shortest_history"] is not None:
            known.append(op["shortest_history"])
        if current is None or not len(current[0]):
            unsampled = True
            continue
        flushed, saturated, steps = current
        lost = flushed + saturated
        worst = int(np.argmax(lost))
        if lost[worst] > flush_limit:  # its worst sampled pass
            reasons.append({"operand": operand, "format": fmt, "recipe": "current", "flushed": float(flushed[worst]),
                            "saturated": float(saturated[worst]), "step": int(steps[worst])})
    reasons.sort(key=lambda r: -(r["flushed"] + r["saturated"]))
    # (a known reason to keep a layer stands even where another operand was never sampled)
    verdict = "keep" if reasons else "unknown" if unsampled else "ready"
    calls = [int(p.calls_per_step[seqs[k]]) for k in (INPUT, GRAD, WEIGHT) if k in seqs]
    return {"name": name, "type": kind, "converted": kind not in CONVOLUTIONS,
            "calls_per_step": calls[0] if calls else 0, "verdict": verdict, "reasons": reasons,
            "shortest_history": max(known) if known else None, "operands": operands}


def _layer_types(metadata: Mapping[str, str]) -> dict[str, str]:
    """``model.gemm_layers``: {layer name: class name}; {} when absent (older runs) or unreadable."""
    return meta_names(metadata.get(META_GEMM_LAYERS))


def _layer_order(p: Passes, types: Mapping[str, str]) -> list[str]:
    """The recorded layers in ``model.gemm_layers``'s order, then the others in the order of
    their first pass (step, call)."""
    first: dict[str, tuple[int, int]] = {}
    for s, layer in enumerate(p.layer):
        lo = int(p.starts[s])
        key = (int(p.step[lo]), int(p.call[lo]))
        first[layer] = min(first.get(layer, key), key)
    return list(types) + sorted((n for n in first if n not in types), key=lambda n: (first[n], n))


def no_operands_message(path: str, metadata: Mapping[str, str]) -> str:
    """Why a run has no GEMM operand rows, and what to do, on one line."""
    level = metadata.get(META_LEVEL)
    why = (f"the run was recorded without them (fp8=False, or by an ampdoctor before {RECORDED_SINCE})"
           if level in (None, "full") else f"the run was recorded at level={level!r}")
    return (f"{path}: no FP8 operand statistics: {why}; record with GradScaler(..., level='full', model=model) "
            f"(fp8=True, the default)")


# -- a run ---------------------------------------------------------------------------------------------

def _run(run_or_path: Run | str | os.PathLike, run_id: str | None) -> Run:
    return run_or_path if isinstance(run_or_path, Run) else read_run(run_or_path, run_id)


def _gemm_frame(run: Run) -> pd.DataFrame:
    return to_frame(run.table(COLUMNS, kinds=GEMM_KINDS))


def fp8_data(run_or_path: Run | str | os.PathLike, *, flush_limit: float = DEFAULT_FLUSH_LIMIT,
             run_id: str | None = None) -> dict:
    """``ampdoctor fp8``'s data (the JSON contract of ``ampdoctor.fp8(path)``): per GEMM layer its
    verdict (``ready``, ``keep``, ``unknown``), the reasons to keep it, and per operand and
    format what current and delayed scaling (histories :data:`HISTORIES`) flush, saturate and
    clip; the layers to keep as torchao's ``module_filter_fn``, the shortest history. Raises
    :class:`RunError` for a run without GEMM operand rows."""
    run = _run(run_or_path, run_id)
    meta = run.metadata
    data = frame_data(_gemm_frame(run), meta, flush_limit=flush_limit, path=str(run.path))
    return {"path": str(run.path), "run_id": meta.get(META_RUN_ID, ""), **data}


def predictions(run_or_path: Run | str | os.PathLike, run_id: str | None = None) -> pd.DataFrame:
    """Every pass's prediction (:func:`frame_predictions`) of the run at ``run_or_path``, for
    tests and notebooks. Raises :class:`RunError` for a run without GEMM operand rows."""
    run = _run(run_or_path, run_id)
    frame = _gemm_frame(run)
    if not len(frame):
        raise RunError(no_operands_message(str(run.path), run.metadata))
    return frame_predictions(frame)
