"""Per-layer statistics over a whole run, in one streaming pass (bounded memory at any length).

One *layer* is one (name, kind): a parameter's gradient (``param_grad``), a module's output
gradient (``grad_output``) or a module's output (``output``). The rates come from full rows
(sampled steps); light rows (the peak and norm of the other steps, and the flight recorder's
peaks) count for magnitudes, headroom and non-finite values; a layer seen only in light rows has
no rates (NaN). Each row is judged in the format its values
lived in during training: parameter gradients in the run's AMP format at the step's loss scale,
module rows in their own dtype, gradients at the loss scale and activations unscaled; a wider
output gradient whose values all sit on the AMP format's grid (an fp16 gradient cast up to float32
on its way into a LayerNorm) in the AMP format.

* ``underflow_rate``: elements lost to underflow over elements observed: measured on measured
  steps (:mod:`ampdoctor.record.underflow_probe`), else estimated (see :mod:`ampdoctor.analysis.underflow`
  for the definition and the estimate); ``underflow_measured``: the share of those elements whose
  underflow was measured;
* ``zero_rate``, ``subnormal_rate``: recorded zeros and subnormals over elements observed;
* ``headroom_log2``: the smallest headroom seen, ``log2(format max / (amax · S))`` over the
  observations that were finite (negative: it overflowed the format);
* ``amax``, ``amin``: the largest and smallest nonzero finite magnitudes over the run.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ..float_formats import FloatFormat, float_format
from ..run_file.hist_column import hist_matrix
from ..read import engine
from ..read.run import Run, empty_table, kind_mask
from .calibration import Measurements, Samples, Tails, calibrated, calibrated_low, keys, lost_below, still_lost
from .step_rows import StepRows
from .underflow import UPPER_SHARE, cumulative_below, underflow_bounds, with_measured

LAYER_KINDS = ("param_grad", "grad_output", "output")
HEATMAP_BUCKETS = 200  # step columns of the heatmap at most
LOW_QUANTILE = 0.10    # the heatmap's "low" magnitude: this quantile of the nonzero elements
# A heatmap cell whose rows were all zeros (amax 0: every element flushed): below the log2 of any
# magnitude, so any nonzero row of the bucket wins the max, and above "no row" (-inf); -inf in the
# LayerScan's heatmap. The low panel is min-reduced: there the sentinel is -_ALL_ZERO.
_ALL_ZERO = -1e300

STEP_COLUMNS = ["step", "rank", "scale", "skipped", "loss", "amax", "l2", "numel", "n_zero", "n_subnormal",
                "n_nan", "n_inf", "hist", "n_zero_lines", "n_underflow", "underflow_hist"]
# What the main pass reads of the layer rows (and scan_step_rows needs).
LAYER_COLUMNS = ["step", "rank", "kind", "name", "dtype", "scale", "numel", "amax", "amin", "l2", "n_zero",
                 "n_subnormal", "n_nan", "n_inf", "hist", "n_zero_lines", "n_underflow", "underflow_hist"]
# What the first pass reads: the measured rows' counts (calibration.Measurements).
_MEASURED_COLUMNS = ["step", "rank", "kind", "name", "dtype", "scale", "numel", "amax", "l2", "n_zero", "n_nan",
                     "n_inf", "n_zero_lines", "n_underflow", "underflow_hist"]
_GRADIENT_KINDS = ["param_grad", "grad_output"]
# Rows of _Accumulator.sums.
_NUMEL, _ZERO, _SUBNORMAL, _LOST, _OBSERVED, _NONFINITE, _UPPER, _JUDGED, _MEASURED, _LOW = range(10)


@dataclass
class LayerScan:
    """What the streaming pass over a run's non-step rows found."""

    layers: pd.DataFrame                       # one row per (name, kind), see the module docstring
    param_lost: pd.DataFrame                   # per step: lost, undecided and all zeros over parameter gradients,
                                               # and whether they were measured (light steps: carried
                                               # from their samples, calibration.Samples)
    module_peak: pd.Series                     # per step: largest finite output-gradient amax
    activation_peak: pd.DataFrame              # per module: largest finite output amax (unscaled)
    heatmap_steps: np.ndarray                  # first step of each heatmap column
    heatmap: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # name → (high, low)
    step_rows: pa.Table | StepRows | None = None  # the run's step rows (STEP_COLUMNS), met during the pass
    tails: Tails | None = None                 # what underflowed on measured steps, by magnitude (calibration.Tails)
    measurements: Measurements | None = None   # the measured steps' structure (calibration.Measurements) ...
    measure_ids: dict | None = None            # ... keyed by these ids of (name, kind) and the rank
    unanswered_light_rows: int = 0             # light parameter rows counted nowhere (calibration.Samples.unanswered)

    def calibrate(self, names, kind: str, rank: np.ndarray, step: np.ndarray, n_zero: np.ndarray,
                  numel: np.ndarray, estimate: np.ndarray, upper: np.ndarray, n_zero_lines: np.ndarray) -> np.ndarray:
        """Estimated rows of ``kind`` calibrated by the run's measurements, as the layers are
        (calibration.calibrated): for a consumer that reads the rows again (simulate)."""
        if not self.measurements:
            return estimate
        ids = np.array([self.measure_ids.get((str(n), kind), -1) for n in names], dtype=np.int64)
        found = self.measurements.nearest(keys(ids, rank), step)
        return calibrated(n_zero, numel, found.share, estimate, upper, found.scattered, n_zero_lines)

    @property
    def empty(self) -> bool:
        return self.layers.empty


def scan_layers(run: Run, amp: FloatFormat, *, min_exp: int, bins: int,
                batch_rows: int = 1 << 16, group_rows: int = 1 << 18) -> LayerScan:
    """Aggregate every full module and parameter row of ``run``, batch by batch with numpy
    reductions keyed by layer (memory: one batch plus O(layers x heatmap columns) plus the
    measured steps' structural shares). Two passes: a narrow one over the gradient rows for the
    measured steps' counts, which calibrate the estimates around them (:mod:`.calibration`), then
    every row; the step rows met on the way are kept (``LayerScan.step_rows``)."""
    first_step, last_step = run.step_range() or _step_range_from_data(run)
    span = max(1, last_step - first_step + 1)
    width = max(1, math.ceil(span / HEATMAP_BUCKETS))
    columns = math.ceil(span / width)
    acc = _Accumulator(span, columns, bins=bins, min_exp=min_exp)
    _measured_pass(acc, run, amp, batch_rows)
    step_rows = StepRows(STEP_COLUMNS)
    read = LAYER_COLUMNS + [c for c in STEP_COLUMNS if c not in LAYER_COLUMNS]
    acc.measurements.points  # (computed once, before the threads read it)
    # Two stages on two threads, each in the groups' order: while one group's light rows are
    # carried from their samples, the next is prepared (the stages share no state: _Accumulator).
    with ThreadPoolExecutor(1, thread_name_prefix="ampdoctor-scan") as carrier:
        carried = None
        for batch, sizes in run.batch_groups(read, batch_rows=batch_rows, group_rows=group_rows):
            is_step = kind_mask(batch.column("kind"), ["step"])
            steps = batch.filter(is_step)
            if steps.num_rows:
                step_rows.append(steps)
            layer = kind_mask(batch.column("kind"), list(LAYER_KINDS)).to_numpy(zero_copy_only=False)
            if layer.any():
                # (each read batch's rows among them: the sums per layer add up batch by batch)
                ends = np.cumsum(layer)[np.cumsum(sizes) - 1]
                prepared = acc.prepare(batch, amp, min_exp, bins, first_step, width, ends=ends,
                                       rows=np.flatnonzero(layer))
                if carried is not None:
                    carried.result()  # (raises the carrier's error here)
                carried = carrier.submit(acc.carry, prepared)
        if carried is not None:
            carried.result()
    scan = acc.result(first_step, width)
    scan.tails, scan.measurements, scan.measure_ids = acc.tails, acc.measurements, acc.measure_ids
    scan.unanswered_light_rows = acc.samples.unanswered
    scan.step_rows = step_rows if step_rows.num_rows else empty_table(STEP_COLUMNS)
    return scan


_DENSE = ("step", "rank", "scale", "numel", "amax", "l2")  # what every layer row holds
_SPARSE = ("amin", "n_zero", "n_subnormal", "n_nan", "n_inf", "n_zero_lines", "n_underflow")  # full rows' only


def _full_only(batch: pa.RecordBatch, rows: np.ndarray, at: np.ndarray) -> dict | None:
    """The :data:`_SPARSE` columns of the full rows (``at`` among ``rows``), as the whole column's
    numpy conversion would give them there (a column with nulls as float64); None where a light
    row holds one of them (another writer's file: the caller reads them whole)."""
    out = {}
    taken = pa.array(rows[at])
    counted = pc.is_valid(batch.column("n_zero"))
    for c in _SPARSE:
        column = batch.column(c)
        # (over every row of the batch, step rows too: bitmaps, not a numpy array per column)
        if column.null_count < len(column) and pc.any(pc.and_not(pc.is_valid(column), counted)).as_py():
            return None
        values = column.take(taken).to_numpy(zero_copy_only=False)
        out[c] = values.astype(np.float64) if column.null_count and values.dtype.kind in "iub" else values
    return out


def _measured_pass(acc: "_Accumulator", run: Run, amp: FloatFormat, batch_rows: int) -> None:
    """The first pass: the measured gradient rows (a few in a thousand at the default cadence),
    found by the query engine on the one column, or, where it cannot read the run, by pyarrow
    reading the segments that hold any (the same rows in the same order)."""
    try:
        for batch in engine.present_batches(run, _MEASURED_COLUMNS, "n_underflow", _GRADIENT_KINDS, batch_rows):
            acc.add_measured(batch, amp)
        return
    except engine.EngineCannot:
        acc.forget_measured()
    for batch in run.batches(_MEASURED_COLUMNS, kinds=_GRADIENT_KINDS, batch_rows=batch_rows, present="n_underflow"):
        acc.add_measured(batch, amp)


def _pair_ids(batch: pa.RecordBatch, ids: dict[tuple[str, str], int], new=None,
              rows: np.ndarray | None = None) -> np.ndarray:
    """Per row (``rows``: of these, by index), the id in ``ids`` of its (name, kind), from the
    small per-batch dictionaries (not the strings); a pair not in ``ids`` gets ``new(pair, its
    first row)`` there, or -1 without ``new``."""
    (names, name_idx), (kinds, kind_idx) = (_dictionary(batch.column(c), rows) for c in ("name", "kind"))
    pair = name_idx.astype(np.int64) * len(kinds) + kind_idx
    size = len(names) * len(kinds)
    if not len(pair) or pair.min() < 0 or pair.max() >= size:  # (null codes: no pair to look up)
        return _pair_ids_sorted(pair, names, kinds, ids, new)
    # (the pairs present, by a table over the few codes: no sort of the rows; in code order, as
    # np.unique gives them)
    present = np.zeros(size, dtype=bool)
    present[pair] = True
    local = np.full(size, -1, dtype=np.int64)
    for code in np.flatnonzero(present):
        key = (names[code // len(kinds)], kinds[code % len(kinds)])
        if key not in ids and new is not None:
            ids[key] = new(key, int(np.argmax(pair == code)))
        local[code] = ids.get(key, -1)
    return local[pair]


def _pair_ids_sorted(pair, names, kinds, ids, new) -> np.ndarray:
    unique, first, inverse = np.unique(pair, return_index=True, return_inverse=True)
    local = np.empty(len(unique), dtype=np.int64)
    for i, code in enumerate(unique):
        key = (names[code // len(kinds)], kinds[code % len(kinds)])
        if key not in ids and new is not None:
            ids[key] = new(key, first[i])
        local[i] = ids.get(key, -1)
    return local[inverse.ravel()]


def _dictionary(column: pa.Array, rows: np.ndarray | None = None) -> tuple[list[str], np.ndarray]:
    """A string column as (its distinct values, each row's index into them; ``rows``: of these)."""
    if not isinstance(column, pa.DictionaryArray):
        column = column.dictionary_encode()
    index = column.indices.to_numpy(zero_copy_only=False)
    return [str(v) for v in column.dictionary.to_pylist()], index if rows is None else index[rows]


def scan_step_rows(rows: pa.RecordBatch, amp: FloatFormat, *, min_exp: int, bins: int, step: int) -> pd.DataFrame:
    """The per-layer aggregates (the ``layers`` of :class:`LayerScan`) of one step's rows alone,
    for a consumer that wants them step by step (the TensorBoard export): the heuristic's
    estimates of that step, or its measurement, not calibrated by the run's other steps."""
    acc = _Accumulator(1, 1, bins=bins, min_exp=min_exp)
    acc.add(rows, amp, min_exp, bins, step, 1)
    return acc.result(step, 1).layers


class _Accumulator:
    """Running per-layer sums, minima and maxima; layers get ids as they are first seen."""

    def __init__(self, span: int, columns: int, *, bins: int, min_exp: int) -> None:
        self.measurements = Measurements(bins)
        self.measure_ids: dict[tuple[str, str], int] = {}  # (name, kind) -> key of its measurements
        self.tails = Tails(bins, min_exp)
        self.samples = Samples(bins, min_exp)
        self.ids: dict[tuple[str, str], int] = {}
        self.dtypes: list[str] = []
        self.columns = columns
        self.sums = np.zeros((10, 16))         # indexed by _NUMEL .. _LOW
        self.amax = np.full(16, -np.inf)
        self.amin = np.full(16, np.inf)
        self.headroom = np.full(16, np.inf)
        self.distance = np.full(16, -np.inf)     # the farthest an estimate is from its calibrating measurement
        self.output_peak = np.full(16, -np.inf)  # output rows: the largest finite activation
        self.high = np.full((16, columns), -np.inf)
        self.low = np.full((16, columns), np.inf)
        self.param_lost = np.zeros(span)
        self.param_lost_hi = np.zeros(span)       # light steps: lost at the other end of the drift's range
        self.param_zero = np.zeros(span)
        self.param_undecided = np.zeros(span)     # undecided zeros: the upper bound minus the estimate
        self.param_seen = np.zeros(span, dtype=bool)
        self.param_judged = np.zeros(span)        # elements of the judged parameter gradients ...
        self.param_measured = np.zeros(span)      # ... and of those whose underflow was measured
        self.module_peak = np.full(span, -np.inf)

    def _layer_ids(self, batch: pa.RecordBatch, rows: np.ndarray | None = None) -> np.ndarray:
        """Global layer ids of the rows (``rows``: of these), from the small per-batch dictionaries
        (not the strings)."""
        dtypes, dtype_idx = _dictionary(batch.column("dtype"), rows)

        def new(key: tuple[str, str], first_row: int) -> int:
            self.dtypes.append(dtypes[dtype_idx[first_row]])
            return len(self.ids)

        ids = _pair_ids(batch, self.ids, new, rows)
        self._grow(len(self.ids))
        return ids

    def _grow(self, n: int) -> None:
        size = self.amax.shape[0]
        if n <= size:
            return
        pad = max(n, 2 * size) - size
        self.sums = np.pad(self.sums, ((0, 0), (0, pad)))
        self.amax = np.pad(self.amax, (0, pad), constant_values=-np.inf)
        self.amin = np.pad(self.amin, (0, pad), constant_values=np.inf)
        self.headroom = np.pad(self.headroom, (0, pad), constant_values=np.inf)
        self.distance = np.pad(self.distance, (0, pad), constant_values=-np.inf)
        self.output_peak = np.pad(self.output_peak, (0, pad), constant_values=-np.inf)
        self.high = np.pad(self.high, ((0, pad), (0, 0)), constant_values=-np.inf)
        self.low = np.pad(self.low, ((0, pad), (0, 0)), constant_values=np.inf)

    def forget_measured(self) -> None:
        """The first pass's state as new (its reading failed part way: read again)."""
        self.measurements = Measurements(self.tails.bins)
        self.measure_ids = {}
        self.tails = Tails(self.tails.bins, self.tails.min_exp)

    def add_measured(self, batch: pa.RecordBatch, amp: FloatFormat) -> None:
        """The first pass: the measured gradient rows' zeros and underflow (their structure), and
        what underflowed in the parameter gradients by magnitude (calibration.Tails)."""
        col = {c: batch.column(c).to_numpy(zero_copy_only=False).astype(np.float64) for c in
               ("n_zero", "n_underflow", "n_nan", "n_inf", "numel", "n_zero_lines", "amax", "scale", "l2")}
        keep = ~np.isnan(col["n_zero"]) & ~np.isnan(col["n_underflow"]) & (np.nan_to_num(col["n_nan"] + col["n_inf"]) == 0)
        if not keep.any():
            return
        rows = batch.filter(pa.array(keep))
        col = {c: v[keep] for c, v in col.items()}
        key = keys(self._measure_ids(rows, register=True), rows.column("rank").to_numpy(zero_copy_only=False))
        step = rows.column("step").to_numpy(zero_copy_only=False)
        has_hist = rows.column("underflow_hist").is_valid().to_numpy(zero_copy_only=False)
        hist = hist_matrix(rows.column("underflow_hist"), self.tails.bins, np.float64)
        self.measurements.add(key, step, col["n_zero"], col["n_underflow"], col["numel"], col["n_zero_lines"],
                              np.where(has_hist[:, None], hist, np.nan), col["l2"])
        param = (rows.column("kind").to_numpy(zero_copy_only=False) == "param_grad") & has_hist
        if param.any():
            cut = np.log2(amp.underflow_below / np.maximum(np.nan_to_num(col["scale"], nan=1.0), 2.0**-149))
            self.tails.add(step[param], hist[param], col["amax"][param], cut[param])

    def _measure_ids(self, batch: pa.RecordBatch, register: bool = False) -> np.ndarray:
        """Per row, the id of its (name, kind) among the measured layers (-1: never measured). Apart
        from the layer ids, which keep the order layers are met in the main pass."""
        return _pair_ids(batch, self.measure_ids, (lambda key, row: len(self.measure_ids)) if register else None)

    def add(self, batch: pa.RecordBatch, amp: FloatFormat, min_exp: int, bins: int, first_step: int,
            width: int, ends: np.ndarray | None = None, rows: np.ndarray | None = None) -> None:
        """Reduce ``batch``'s rows (:meth:`prepare`, then :meth:`carry`)."""
        self.carry(self.prepare(batch, amp, min_exp, bins, first_step, width, ends, rows))

    def prepare(self, batch: pa.RecordBatch, amp: FloatFormat, min_exp: int, bins: int, first_step: int,
                width: int, ends: np.ndarray | None = None, rows: np.ndarray | None = None) -> "_Carried":
        """Reduce ``batch``'s rows (``rows``: those of them, by index; default all), all but what
        :meth:`carry` does with them. ``ends``: where each batch as read ends among them (rows read
        in a group): the float sums per layer and per step add up read batch by read batch, so that
        they are the same however the batches were grouped.

        Full rows (one in ``every`` at the default cadence) go through the histogram work; light
        rows (peak and norm) only through what they count for: magnitudes, non-finite values and
        the carry from their samples. A light row adds nothing to the float sums but integer
        counts (exact in any order), so leaving it out of them changes no bit."""
        rows = np.arange(batch.num_rows) if rows is None else rows
        layer = self._layer_ids(batch, rows)
        kinds, kind_idx = _dictionary(batch.column("kind"), rows)
        # (which rows are of a kind, from the dictionary's codes: no string per row)
        of_kind = {k: kind_idx == kinds.index(k) if k in kinds else np.zeros(len(kind_idx), dtype=bool)
                   for k in LAYER_KINDS}
        dtypes, dtype_idx = _dictionary(batch.column("dtype"), rows)
        formats = [_format_or_none(d) or amp for d in dtypes]
        col = {c: batch.column(c).to_numpy(zero_copy_only=False)[rows] for c in _DENSE}
        # Light rows (counts null) carry the peak magnitude, non-finite when the tensor was: they
        # count for magnitudes and non-finite values; the rates come from full rows only.
        full = batch.column("n_zero").is_valid().to_numpy(zero_copy_only=False)[rows]
        at = np.flatnonzero(full)
        # The counts are read for the full rows alone where light rows hold none (as written).
        sparse = _full_only(batch, rows, at)
        if sparse is None:
            col.update({c: batch.column(c).to_numpy(zero_copy_only=False)[rows] for c in _SPARSE})
        param = of_kind["param_grad"]
        output = of_kind["output"]
        # Each row is judged in the format its values lived in (see the module docstring).
        fmax = np.where(param, amp.max, np.array([f.max for f in formats])[dtype_idx])
        below = np.where(param, amp.underflow_below, np.array([f.underflow_below for f in formats])[dtype_idx])
        scale = np.where(output, 1.0, col["scale"].astype(np.float64))
        scale = np.where(scale > 0, scale, np.nan)  # a collapsed scale of 0 judges nothing
        amax = col["amax"].astype(np.float64)
        nonfinite = ~full & ~np.isfinite(amax)
        if sparse is None:
            nonfinite |= (col["n_nan"] + col["n_inf"]) > 0
            full_col = {c: v[at] for c, v in col.items()}
        else:
            nonfinite[at] = (sparse["n_nan"] + sparse["n_inf"]) > 0
            full_col = {**{c: v[at] for c, v in col.items()}, **sparse}
        usable = ~nonfinite & np.isfinite(amax)
        seen = usable & (amax > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            headroom = np.where(seen, np.log2(fmax / (amax * scale)), np.inf)
            high = np.where(seen, np.log2(np.where(seen, amax, 1.0) * scale),
                            np.where(usable & (amax == 0), _ALL_ZERO, -np.inf))
        # A gradient that overflowed is drawn one binade above the format's max.
        high = np.where(nonfinite, np.log2(fmax) + 1.0, high)
        finite_amax = np.where(usable, amax, -np.inf)
        np.maximum.at(self.amax, layer, finite_amax)
        amin = full_col["amin"].astype(np.float64) if sparse is not None else col["amin"].astype(np.float64)
        np.minimum.at(self.amin, layer[at] if sparse is not None else layer, np.where(np.isnan(amin), np.inf, amin))
        np.minimum.at(self.headroom, layer, np.where(np.isnan(headroom), np.inf, headroom))
        np.maximum.at(self.output_peak, layer[output], finite_amax[output])
        offset = col["step"] - first_step
        inside = (offset >= 0) & (offset < len(self.param_lost))
        p = param & inside
        # The overflow threshold learns from output gradients the loss scale multiplies in the AMP
        # format itself: a float32 one (the loss's own gradient, a LayerNorm's) cannot overflow it.
        in_amp = np.array([d == amp.name for d in dtypes])[dtype_idx]
        g = of_kind["grad_output"] & inside & in_amp
        np.maximum.at(self.module_peak, offset[g], finite_amax[g])
        column = np.clip(offset // width, 0, self.columns - 1)
        cell = layer[p] * self.columns + column[p]  # (one flat index: ufunc.at's fast path)
        np.maximum.at(self.high.reshape(-1), cell, np.where(np.isnan(high[p]), -np.inf, high[p]))
        # The counts light rows add (integers: exact whatever the order).
        light = np.flatnonzero(~full)
        n = len(self.ids)
        self.sums[_NONFINITE, :n] += np.bincount(layer[light], weights=nonfinite[light].astype(np.float64), minlength=n)
        if sparse is None:
            values = np.nan_to_num(col["n_subnormal"][light].astype(np.float64))
            self.sums[_SUBNORMAL, :n] += np.bincount(layer[light], weights=values, minlength=n)
        bounds = np.concatenate([[0], np.unique(ends if ends is not None else [len(layer)])])
        f = self._add_full(batch, rows[at], layer[at], full_col, amp, min_exp, bins,
                           param[at], output[at], of_kind["grad_output"][at], nonfinite[at], usable[at],
                           amax[at], scale[at], below[at],
                           first_step, width, np.searchsorted(at, bounds))
        carry = np.flatnonzero(param & ~nonfinite & ~full)
        # (a collapsed scale of 0 is computed with as float32's smallest positive, as steps.py does)
        cut = np.log2(amp.underflow_below / np.maximum(np.nan_to_num(col["scale"][carry].astype(np.float64), nan=1.0),
                                                       2.0**-149))
        return _Carried(f, np.searchsorted(carry, bounds), keys(layer[carry], col["rank"][carry]), col["step"][carry],
                        col["l2"][carry].astype(np.float64), col["numel"][carry].astype(np.float64), cut, first_step)

    def carry(self, rows: "_Carried") -> None:
        """The second half of :meth:`add` (what :meth:`prepare` left): per read batch (the per-step
        sums' order), its full rows' sums, then its samples, then its light rows carried from their
        samples (calibration.Samples). Touches only the per-step sums and the samples, none of
        :meth:`prepare`'s state: the two may run on two threads, each in the batches' order."""
        f = rows.full
        for (fa, fb), (ca, cb) in zip(_pairs(f.bounds), _pairs(rows.bounds)):
            f.add_steps(self, fa, fb)
            self.samples.add_samples(*f.samples(fa, fb))
            if cb > ca:
                self._add_light(self.samples.carry(rows.key[ca:cb], rows.step[ca:cb], rows.l2[ca:cb],
                                                   rows.numel[ca:cb], rows.cut[ca:cb]), rows.first_step)

    def _add_full(self, batch, at, layer, col, amp, min_exp, bins, param, output, grad_output, nonfinite, usable,
                  amax, scale, below, first_step, width, bounds) -> "_FullRows":
        """The full rows' histogram work (``at``: their indices in ``batch``, in order; ``col`` and
        the masks theirs): the underflow estimates, calibrated by the measurements; their per-layer
        sums (read batch by read batch: ``bounds`` among them), heatmap lows and measurement
        distances. Returns what the per-step sums and the samples read of them."""
        hist = hist_matrix(batch.column("hist").take(pa.array(at)), bins)
        n_underflow = col["n_underflow"].astype(np.float64)
        measured = ~output & ~nonfinite & ~np.isnan(n_underflow)
        zeros = np.nan_to_num(col["n_zero"].astype(np.float64))
        wider = grad_output & (below < amp.underflow_below)
        with np.errstate(divide="ignore", invalid="ignore"):
            # A float32 output gradient whose nonzero values all sit on the AMP format's grid
            # (none below its smallest subnormal) was computed in the AMP format and cast up (the
            # input gradient of an fp16 Linear reaching a LayerNorm): its zeros underflowed there.
            # Otherwise such a gradient mixes paths (a residual's float32 one too): judged in its own
            # format, with every zero in the upper bound if it reaches the AMP subnormals in numbers.
            cumsum = np.concatenate([np.zeros((len(hist), 1)), np.cumsum(hist, axis=1)], axis=1)
            amp_subnormal = cumulative_below(cumsum, np.log2(amp.smallest_normal / scale), min_exp)
            amp_grid = wider & (cumulative_below(cumsum, np.log2(amp.smallest_subnormal / scale), min_exp) == 0)
            below = np.where(amp_grid, amp.underflow_below, below)
            subnormal = np.where(amp_grid, amp_subnormal, np.nan_to_num(col["n_subnormal"].astype(np.float64)))
            cut = np.log2(below / scale)
            estimate, upper = underflow_bounds(hist, zeros, subnormal, cut, min_exp,
                                               col["n_zero_lines"].astype(np.float64), pile_lines=param)
            upper = np.where(wider & (amp_subnormal >= UPPER_SHARE * hist.sum(axis=1)) & (amp_subnormal > 0),
                             np.maximum(upper, zeros), upper)
            # Activations are not loss-scaled: no underflow estimate for output rows. A row whose
            # estimate is unknown (every element 0) counts only towards the upper bound.
            # A row that held a NaN or inf is not judged: its histogram lost the overflowed values.
            # Measured steps (underflow_probe.py): the count itself, estimate and bound alike.
            estimate, upper = with_measured(estimate, upper, n_underflow, measured)
            # Estimated rows of a measured tensor: its structure, measured, calibrates them.
            distance = np.where(measured, 0.0, np.nan)
            low_est = np.array(estimate, dtype=np.float64)
            # A measured count's lower end leaves out what may be rounding noise: below the step's
            # largest peak x 2^-24 for a parameter gradient (calibration.Tails), below its own for
            # a module output gradient (calibration.lost_below).
            lost_column = batch.column("underflow_hist")
            noisy = np.flatnonzero(measured & lost_column.is_valid().to_numpy(zero_copy_only=False)[at])
            if len(noisy):
                lost_hist = hist_matrix(lost_column.take(pa.array(at[noisy])), bins, np.float64)
                of_param = param[noisy]
                noise = np.where(of_param, 0.0, lost_below(lost_hist, amax[noisy], min_exp))
                noise[of_param] = self.tails.maybe_noise(col["step"][noisy][of_param], lost_hist[of_param])
                low_est[noisy] = np.maximum(low_est[noisy] - noise, 0.0)
            rows = np.nonzero(~output & ~nonfinite & ~measured)[0]
            if len(rows) and self.measurements:
                names = batch.select(["name", "kind"]).take(pa.array(at[rows]))
                measured_key = keys(self._measure_ids(names), col["rank"][rows])
                found = self.measurements.nearest(measured_key, col["step"][rows])
                distance[rows] = found.distance
                heuristic, numel = estimate[rows], col["numel"][rows].astype(np.float64)
                estimate[rows] = calibrated(zeros[rows], numel, found.share, heuristic, upper[rows],
                                            found.scattered, col["n_zero_lines"][rows].astype(np.float64))
                # (the drift since the measurement, of the root mean square: NaN where either is unknown)
                rms = col["l2"][rows].astype(np.float64) / np.sqrt(np.maximum(numel, 1.0))
                drift = np.log2(np.where((rms > 0) & (found.rms > 0), rms, np.nan) / found.rms)
                still = still_lost(found.hist * numel[:, None], min_exp, cut[rows], drift)
                low_est[rows] = np.where(np.isnan(found.share), heuristic,
                                         calibrated_low(numel, estimate[rows], heuristic, found.lost, still))
            judged = ~output & ~nonfinite & ~np.isnan(estimate)
            lost = np.where(judged, estimate, 0.0)
            lost_low = np.where(judged, np.fmin(low_est, estimate), 0.0)
            upper = np.where(~output & ~nonfinite, upper, 0.0)
            low = _quantile_log2(hist, LOW_QUANTILE, min_exp) + np.log2(scale)
            low = np.where(usable & (amax == 0), -_ALL_ZERO, low)
        n = len(self.ids)
        for i, values in ((_NUMEL, col["numel"]), (_ZERO, col["n_zero"]), (_SUBNORMAL, col["n_subnormal"]),
                          (_LOST, lost), (_OBSERVED, np.ones(len(at))), (_NONFINITE, nonfinite), (_UPPER, upper),
                          (_JUDGED, np.where(judged, col["numel"], 0)),
                          (_MEASURED, np.where(measured, col["numel"], 0)), (_LOW, lost_low)):
            values = np.nan_to_num(np.asarray(values, dtype=np.float64))
            for a, b in _pairs(bounds):
                self.sums[i, :n] += np.bincount(layer[a:b], weights=values[a:b], minlength=n)
        np.maximum.at(self.distance, layer[judged], np.nan_to_num(distance[judged], nan=-np.inf))
        offset = col["step"] - first_step
        p = param & (offset >= 0) & (offset < len(self.param_lost))
        cell = layer[p] * self.columns + np.clip(offset[p] // width, 0, self.columns - 1)
        np.minimum.at(self.low.reshape(-1), cell, np.where(np.isnan(low[p]), np.inf, low[p]))
        sample = param & ~nonfinite
        return _FullRows(bounds, offset, p & ~nonfinite, judged, measured, lost, upper, col, sample,
                         keys(layer, col["rank"]), cumsum,
                         np.log2(amp.underflow_below / np.maximum(np.nan_to_num(col["scale"].astype(np.float64),
                                                                               nan=1.0), 2.0**-149)))

    def _add_light(self, carried: tuple[np.ndarray, ...], first_step: int) -> None:
        step, lost, lost_hi, zeros, undecided = carried
        offset = step - first_step
        ok = (offset >= 0) & (offset < len(self.param_lost))
        np.add.at(self.param_lost, offset[ok], lost[ok])
        np.add.at(self.param_lost_hi, offset[ok], lost_hi[ok])
        np.add.at(self.param_zero, offset[ok], zeros[ok])
        np.add.at(self.param_undecided, offset[ok], undecided[ok])
        self.param_seen[offset[ok]] = True

    def result(self, first_step: int, width: int) -> LayerScan:
        self._add_light(self.samples.finish(), first_step)  # light rows still waiting for a sample
        n = len(self.ids)
        keys = list(self.ids)
        sums = self.sums[:, :n]
        numel = np.where(sums[_OBSERVED] > 0, np.maximum(sums[_NUMEL], 1), np.nan)  # no full row: rates unknown
        judged = np.where(sums[_JUDGED] > 0, sums[_JUDGED], np.nan)  # no row with a known estimate: unknown
        is_output = np.array([k[1] == "output" for k in keys], dtype=bool)
        layers = pd.DataFrame({
            "name": pd.Series([k[0] for k in keys], dtype=object),
            "kind": pd.Series([k[1] for k in keys], dtype=object),
            "underflow_rate": sums[_LOST] / judged,
            "underflow_rate_min": sums[_LOW] / judged,
            "underflow_rate_max": np.where(is_output, np.nan, sums[_UPPER] / numel),
            # The share of the judged elements whose underflow was measured, not estimated.
            "underflow_measured": sums[_MEASURED] / judged,
            # The farthest step of a figure from the measurement that calibrated it (0: all
            # measured; NaN: none calibrated).
            "measure_distance": _inf_to_nan(self.distance[:n]),
            "zero_rate": sums[_ZERO] / numel, "subnormal_rate": sums[_SUBNORMAL] / numel,
            "headroom_log2": _inf_to_nan(self.headroom[:n]), "amax": _inf_to_nan(self.amax[:n]),
            "amin": _inf_to_nan(self.amin[:n]), "observations": sums[_OBSERVED].astype(int),
            "nonfinite": sums[_NONFINITE].astype(int)})
        steps = first_step + np.arange(len(self.param_lost))
        seen = self.param_seen
        param_lost = pd.DataFrame({"lost": self.param_lost[seen], "lost_hi": self.param_lost_hi[seen],
                                   "n_zero": self.param_zero[seen],
                                   "undecided": self.param_undecided[seen],
                                   # every judged parameter gradient of the step (all ranks) measured
                                   "measured": (self.param_measured[seen] >= self.param_judged[seen])
                                   & (self.param_judged[seen] > 0)},
                                  index=steps[seen])
        peak = self.module_peak > -np.inf
        module_peak = pd.Series(self.module_peak[peak], index=steps[peak])
        outputs = [i for i, k in enumerate(keys) if k[1] == "output"]
        activation_peak = pd.DataFrame({"amax": _inf_to_nan(self.output_peak[outputs]),
                                        "nonfinite": sums[_NONFINITE][outputs].astype(int),
                                        "dtype": [self.dtypes[i] for i in outputs]},
                                       index=[keys[i][0] for i in outputs])
        heat = {name: (_heat(self.high[i], _ALL_ZERO), _heat(self.low[i], -_ALL_ZERO))
                for i, (name, kind) in enumerate(keys) if kind == "param_grad"}
        return LayerScan(layers, param_lost, module_peak, activation_peak,
                         first_step + width * np.arange(self.columns), heat)


def _pairs(bounds: np.ndarray):
    """(start, end) of each consecutive part that ``bounds`` delimit."""
    return zip(bounds[:-1], bounds[1:])


@dataclass
class _Carried:
    """What :meth:`_Accumulator.carry` reads of one group: its full rows, and its light parameter
    rows to carry (``bounds``: each read batch's among them)."""

    full: "_FullRows"
    bounds: np.ndarray
    key: np.ndarray
    step: np.ndarray
    l2: np.ndarray
    numel: np.ndarray
    cut: np.ndarray
    first_step: int


@dataclass
class _FullRows:
    """What the per-step sums and the samples read of one group's full rows (in row order)."""

    bounds: np.ndarray        # each read batch's bounds among them
    offset: np.ndarray        # step - the run's first step
    stepped: np.ndarray       # parameter gradients within the step range, finite: the per-step sums'
    judged: np.ndarray
    measured: np.ndarray
    lost: np.ndarray
    upper: np.ndarray
    col: dict
    sample: np.ndarray        # finite parameter gradients: the samples light rows are carried from
    key: np.ndarray
    cumsum: np.ndarray
    cut: np.ndarray           # log2 of the AMP format's cut-off at the recorded scale

    def add_steps(self, acc: "_Accumulator", a: int, b: int) -> None:
        """Rows ``a:b``' per-step sums (lost, zeros, undecided, judged and measured elements)."""
        at = np.flatnonzero(self.stepped[a:b]) + a
        offset, lost, numel = self.offset[at], self.lost[at], self.col["numel"]
        np.add.at(acc.param_lost, offset, lost)
        np.add.at(acc.param_lost_hi, offset, lost)
        np.add.at(acc.param_zero, offset, self.col["n_zero"][at])
        np.add.at(acc.param_undecided, offset, np.maximum(self.upper[at] - lost, 0.0))
        acc.param_seen[offset] = True
        judged, measured = at[self.judged[at]], at[self.measured[at]]
        np.add.at(acc.param_judged, self.offset[judged], numel[judged])
        np.add.at(acc.param_measured, self.offset[measured], numel[measured])

    def samples(self, a: int, b: int) -> tuple:
        """Rows ``a:b``' samples, as calibration.Samples.add_samples takes them."""
        at = np.flatnonzero(self.sample[a:b]) + a
        col, lost = self.col, self.lost[at]
        return (self.key[at], col["step"][at], self.cumsum[at], self.cut[at], lost,
                np.nan_to_num(col["n_zero"][at].astype(np.float64)), np.maximum(self.upper[at] - lost, 0.0),
                col["l2"][at].astype(np.float64), col["numel"][at].astype(np.float64))


def _step_range_from_data(run: Run) -> tuple[int, int]:
    """The step range read from the ``step`` column (footers without statistics)."""
    steps = run.table(["step"]).column("step")
    if not len(steps):
        return 0, 0
    lo_hi = pc.min_max(steps)
    return int(lo_hi["min"].as_py()), int(lo_hi["max"].as_py())


def _heat(values: np.ndarray, all_zero: float) -> np.ndarray:
    """A heatmap row: NaN where no row was seen, -inf where every row seen was all zeros (the
    ``all_zero`` sentinel), else the value."""
    return np.where(values == all_zero, -np.inf, _inf_to_nan(values))


def _inf_to_nan(values: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(values), values, np.nan)


def _format_or_none(dtype: str) -> FloatFormat | None:
    try:
        return float_format(dtype)
    except ValueError:
        return None


def _quantile_log2(hist: np.ndarray, q: float, min_exp: int) -> np.ndarray:
    """log2 of the lower edge of the binade holding the q-quantile of each row's nonzero elements."""
    total = hist.sum(axis=1)
    cum = np.cumsum(hist, axis=1)
    index = (cum < (q * total)[:, None]).sum(axis=1)
    return np.where(total > 0, min_exp + index, np.nan).astype(np.float64)
