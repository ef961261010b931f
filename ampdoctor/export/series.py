"""What an export holds, as plain numbers: a run's per-step scalars and its per-layer histograms
and underflow rates, rank by rank (:func:`step_scalars`, :func:`layer_points`). Exporters
(:mod:`.tensorboard`) write these; nothing here imports torch or knows a file format.

**Scalars** (one point per recorded step of the rank, tag → value): ``steps/scale``,
``steps/skipped`` (1 or 0), ``steps/skipped_total`` (the rank's skipped steps so far),
``steps/loss`` (only where the loss was recorded; NaN or inf when it was), ``steps/grad_norm``
(the ``l2`` of the step row: the norm of the finite unscaled gradient elements).

**Histograms** (one per layer per step with full statistics: the sampled and escalated steps),
tag ``{kind}/{name}`` for ``param_grad``, ``grad_output`` and ``output`` rows. The buckets are the
recorded binades (bin i: ``2**(min_exp + i) <= |x| < 2**(min_exp + i + 1)``, clamped at both ends,
in true-gradient units for gradients and in activation units for outputs), from the first to the
last bin that holds an element. A module called several times in a step has its calls' counts
summed. A row without any nonzero finite element has no histogram.

**Underflow rates** (the analysis's per-layer estimate, :mod:`~ampdoctor.analysis.layer_scan`, of
the layer's rows in that step): ``underflow_min/{kind}/{name}`` (the estimate, what the report
calls *underflow*) and ``underflow_max/{kind}/{name}`` (its upper bound, *at most*), for gradients
only (activations are not loss-scaled). A point the record cannot decide is left out: no
estimate for a gradient that is 0 everywhere (its upper bound, all of it, is kept), neither point
for a layer that held a NaN or inf in that step (its histogram lost the overflowed values).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa

from ..analysis.layer_scan import LAYER_COLUMNS, LAYER_KINDS, scan_step_rows
from ..analysis.run_analysis import recorded_binning
from ..float_formats import FloatFormat
from ..run_file.hist_column import hist_matrix
from ..read.run import Run

STEP_TAGS = ("steps/scale", "steps/skipped", "steps/skipped_total", "steps/loss", "steps/grad_norm")
UNDERFLOW_MIN, UNDERFLOW_MAX = "underflow_min", "underflow_max"


@dataclass(frozen=True)
class Histogram:
    """One layer's binade histogram at one step, in TensorBoard's raw form: ``limits[i]`` is the
    upper edge of bucket i (the last one ``sys.float_info.max`` when it is the clamped top bin),
    ``min``/``max`` the smallest and largest nonzero finite magnitudes, ``num`` the elements
    counted, ``sum_squares`` the squared norm. The sum of the magnitudes is not recorded."""

    tag: str
    step: int
    min: float
    max: float
    num: int
    sum_squares: float
    limits: list[float]
    counts: list[int]


@dataclass(frozen=True)
class HistogramLayout:
    """How the run's histograms bin: ``bins`` bins from ``2**min_exp``, and the AMP format the
    gradients were computed in."""

    min_exp: int
    bins: int
    amp: FloatFormat


def layout(run: Run) -> HistogramLayout:
    amp, min_exp, bins = recorded_binning(run.metadata)
    return HistogramLayout(min_exp, bins, amp)


def step_scalars(run: Run) -> dict[int, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """rank → tag → (steps, values), every recorded step of the rank in step order."""
    table = run.table(["step", "rank", "scale", "skipped", "loss", "l2"], kinds=["step"])
    out: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    if not table.num_rows:
        return out
    rank = table.column("rank").to_numpy()
    step = table.column("step").to_numpy()
    order = np.lexsort((step, rank))
    rank, step = rank[order], step[order]
    scale = _floats(table, "scale")[order]
    skipped = table.column("skipped").to_numpy(zero_copy_only=False).astype(np.float64)[order]
    loss = _floats(table, "loss")[order]
    has_loss = table.column("loss").is_valid().to_numpy(zero_copy_only=False)[order]
    norm = _floats(table, "l2")[order]
    for r in np.unique(rank):
        at = rank == r
        s, skips = step[at], skipped[at]
        out[int(r)] = {"steps/scale": (s, scale[at]), "steps/skipped": (s, skips),
                       "steps/skipped_total": (s, np.cumsum(skips)),
                       "steps/loss": (s[has_loss[at]], loss[at][has_loss[at]]),
                       "steps/grad_norm": (s, norm[at])}
    return out


def layer_points(run: Run, hist_layout: HistogramLayout | None = None) -> Iterator[
        tuple[int, list[Histogram], list[tuple[str, int, float]]]]:
    """Per (rank, step) with full layer rows, in segment order: ``(rank, histograms, underflow
    points)``, each point ``(tag, step, rate)``. Reads one segment at a time (a segment holds
    whole steps of one rank), so memory is bounded by a segment."""
    hist_layout = hist_layout or layout(run)
    for segment in run.segments:
        table = Run(run.path, [segment]).table(LAYER_COLUMNS, kinds=list(LAYER_KINDS))
        if not table.num_rows:
            continue
        full = table.column("n_zero").is_valid()
        table = table.filter(full)  # light rows (flight recorder) hold a peak only
        if not table.num_rows:
            continue
        table = table.sort_by([("rank", "ascending"), ("step", "ascending")])
        batch = pa.RecordBatch.from_arrays([table.column(c).combine_chunks() for c in LAYER_COLUMNS],
                                           names=LAYER_COLUMNS)
        keys = batch.column("rank").to_numpy().astype(np.int64) * (1 << 40) + batch.column("step").to_numpy()
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        for start, end in zip(starts, np.r_[starts[1:], len(keys)]):
            rows = batch.slice(int(start), int(end - start))
            rank, step = int(rows.column("rank")[0].as_py()), int(rows.column("step")[0].as_py())
            yield rank, _histograms(rows, step, hist_layout), _underflow(rows, step, hist_layout)


def _histograms(rows: pa.RecordBatch, step: int, hl: HistogramLayout) -> list[Histogram]:
    """One histogram per (kind, name) of one step's rows: the calls of a module summed."""
    hist = hist_matrix(rows.column("hist"), hl.bins).astype(np.int64)
    kinds = rows.column("kind").cast(pa.string()).to_pylist()
    names = rows.column("name").cast(pa.string()).to_pylist()
    amax, amin, l2 = (rows.column(c).to_numpy(zero_copy_only=False).astype(np.float64) for c in ("amax", "amin", "l2"))
    groups: dict[tuple[str, str], list[int]] = {}
    for i, key in enumerate(zip(kinds, names)):
        groups.setdefault(key, []).append(i)
    out = []
    for (kind, name), index in groups.items():
        counts = hist[index].sum(axis=0)
        nonzero = np.flatnonzero(counts)
        if not len(nonzero):
            continue
        lo, hi = int(nonzero[0]), int(nonzero[-1])
        limits = [2.0 ** (hl.min_exp + i + 1) for i in range(lo, hi + 1)]
        if hi == hl.bins - 1:  # the top bin holds everything above it
            limits[-1] = sys.float_info.max
        low, high = amin[index], amax[index]
        low, high = low[np.isfinite(low) & (low > 0)], high[np.isfinite(high)]
        out.append(Histogram(
            tag=f"{kind}/{name}", step=step,
            min=float(low.min()) if len(low) else 2.0 ** (hl.min_exp + lo),
            max=float(high.max()) if len(high) else 2.0 ** (hl.min_exp + hi + 1),
            num=int(counts.sum()), sum_squares=float(np.nansum(l2[index] ** 2)),
            limits=limits, counts=[int(c) for c in counts[lo:hi + 1]]))
    return out


def _underflow(rows: pa.RecordBatch, step: int, hl: HistogramLayout) -> list[tuple[str, int, float]]:
    """The analysis's per-layer underflow (measured, else the estimate) and upper bound over one
    step's rows."""
    layers = scan_step_rows(rows, hl.amp, min_exp=hl.min_exp, bins=hl.bins, step=step)
    out = []
    for name, kind, low, high, nonfinite in zip(layers["name"], layers["kind"], layers["underflow_rate"],
                                                layers["underflow_rate_max"], layers["nonfinite"]):
        if kind == "output" or nonfinite:  # activations are not loss-scaled; a NaN or inf is not judged
            continue
        if np.isfinite(low):
            out.append((f"{UNDERFLOW_MIN}/{kind}/{name}", step, float(low)))
        if np.isfinite(high):
            out.append((f"{UNDERFLOW_MAX}/{kind}/{name}", step, float(high)))
    return out


def _floats(table: pa.Table, column: str) -> np.ndarray:
    return table.column(column).to_numpy(zero_copy_only=False).astype(np.float64)
