"""The step series: a run's step rows merged over ranks into one record per step (what every
rank's scaler saw together), with the underflow evidence each step stands on: its own full
statistics, or the nearest sampled step's (:func:`load_steps`), refined by the per-parameter
estimates of the sampled steps (:func:`attach_param_lost`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from ..formats import FloatFormat
from ..hist_column import hist_matrix
from .origins import nonfinite_rows
from .underflow import UnderflowModel, underflow_bounds


@dataclass
class StepSeries:
    """The run's step rows merged over ranks (what every rank's scaler saw together), by step."""

    steps: np.ndarray        # int64
    scale: np.ndarray        # float64, the scale each step's backward used (0 taken as 2^-149)
    recorded_scale: np.ndarray  # float64, as recorded
    skipped: np.ndarray      # bool, on any rank
    forced: np.ndarray       # bool, a non-finite loss: skipped at any scale
    nonfinite: np.ndarray    # bool, a gradient held a NaN or inf (on any rank)
    amax: np.ndarray         # float64, largest finite magnitude (unscaled)
    l2: np.ndarray           # float64, gradient norm (largest over ranks)
    loss: np.ndarray         # float64, NaN where none was recorded or it was non-finite
    loss_recorded: np.ndarray  # bool
    numel: np.ndarray        # float64, summed over ranks
    n_zero: np.ndarray       # these three from the step's own full statistics, or, on a step
    n_subnormal: np.ndarray  # without them, the nearest sampled step's (scaled to its numel)
    hist: np.ndarray         # float64 [steps, bins], summed over ranks
    ranks: int
    fmt: FloatFormat         # the format training ran in
    min_exp: int
    sample_scale: np.ndarray | None = None   # per step: the scale n_zero/hist were measured at (default: scale)
    lost_fraction: np.ndarray | None = None  # per step: of the zeros, the share estimated lost to underflow
    undecided_fraction: np.ndarray | None = None  # per step: of the zeros, the share undecided
    n_zero_lines: np.ndarray | None = None   # per step: zeros in all-zero lines (NaN where not recorded)
    measured: np.ndarray | None = None       # per step: its parameter gradients' underflow was measured
    drift_log2: np.ndarray | None = None     # per step: log2 of its gradient norm over its sample's (0 when sampled)

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def recorded_cut_log2(self) -> np.ndarray:
        """The underflow cut-off (true-gradient units) the zeros and histograms were measured at."""
        scale = self.scale if self.sample_scale is None else self.sample_scale
        return np.log2(self.fmt.underflow_below / scale)

    def underflow_model(self) -> UnderflowModel:
        """The underflow of the zeros the estimate counts (not the undecided ones). A step between
        samples takes its sample's histogram moved by the drift of the gradient norm since then
        (the norm is recorded every step): shrinking gradients lose more below the cut-off."""
        return UnderflowModel(self.hist, self.recorded_cut_log2, self._bounds()[0], self.min_exp, self.drift_log2)

    def undecided(self) -> np.ndarray:
        """Per step: zeros whose underflow is undecided at any scale (:mod:`~ampdoctor.analysis.replay`)."""
        return self._bounds()[1]

    def _bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Per step: (zeros estimated lost, undecided zeros) at the recorded scale."""
        if self.lost_fraction is not None:
            undecided = 0.0 if self.undecided_fraction is None else self.undecided_fraction
            return self.n_zero * self.lost_fraction, self.n_zero * undecided
        # A step row sums every gradient: a pile-up there says nothing about one tensor's lines.
        with np.errstate(invalid="ignore"):
            estimate, upper = underflow_bounds(self.hist, self.n_zero, self.n_subnormal, self.recorded_cut_log2,
                                               self.min_exp, self.n_zero_lines, pile_lines=False)
        lost = np.nan_to_num(estimate, nan=0.0)
        return lost, np.maximum(upper - lost, 0.0)

    def lost_at_recorded(self) -> np.ndarray:
        """Elements estimated lost to underflow at each step's recorded scale (the lower bound)."""
        return self.underflow_model().lost(np.log2(self.fmt.underflow_below / self.scale))


def load_steps(table: pa.Table, fmt: FloatFormat, min_exp: int, bins: int) -> StepSeries:
    """Merge the step rows (``layer_scan.STEP_COLUMNS``) of every rank into one series."""
    frame = table.drop_columns(["hist", "loss"]).to_pandas()
    loss = table.column("loss").to_numpy(zero_copy_only=False).astype(np.float64)  # null → NaN
    recorded = table.column("loss").is_valid().to_numpy(zero_copy_only=False)
    hist = hist_matrix(table.column("hist"), bins, np.float64)  # summed over ranks: exact
    frame["loss"] = loss
    frame["loss_recorded"] = recorded
    frame["forced"] = recorded & ~np.isfinite(loss)
    light = frame["n_zero"].isna()  # peak and norm only: a non-finite gradient shows in the peak
    frame["nonfinite"] = nonfinite_rows(frame)
    frame["sampled"] = ~light
    frame["amax"] = frame["amax"].where(~light | np.isfinite(frame["amax"]))  # a non-finite peak is no magnitude
    frame["_row"] = np.arange(len(frame))
    frame = frame.sort_values(["step", "rank"], kind="stable")
    grouped = frame.groupby("step", sort=True)
    agg = grouped.agg(scale=("scale", "first"), skipped=("skipped", "any"), forced=("forced", "any"),
                      nonfinite=("nonfinite", "any"),
                      amax=("amax", "max"), l2=("l2", "max"), loss=("loss", "mean"),
                      loss_recorded=("loss_recorded", "any"), numel=("numel", "sum"),
                      n_zero=("n_zero", "sum"), n_subnormal=("n_subnormal", "sum"), sampled=("sampled", "any"),
                      n_zero_lines=("n_zero_lines", lambda c: c.sum(min_count=1)))
    codes = grouped.ngroup().to_numpy()
    merged_hist = np.zeros((len(agg), bins))
    np.add.at(merged_hist, codes, hist[frame["_row"].to_numpy()])
    f64 = lambda c: agg[c].to_numpy(dtype=np.float64)  # noqa: E731
    # A scale that collapsed to 0 (150 backoffs in a row) is computed with as float32's smallest
    # positive; ``recorded_scale`` keeps the 0 for display.
    scale = np.maximum(f64("scale"), 2.0**-149)
    amax = f64("amax")
    numel, n_zero, n_subnormal = f64("numel"), np.nan_to_num(f64("n_zero")), np.nan_to_num(f64("n_subnormal"))
    source = _nearest_sampled(agg["sampled"].to_numpy(bool))
    ratio = np.divide(numel, numel[source], out=np.zeros(len(numel)), where=numel[source] > 0)
    l2 = f64("l2")
    with np.errstate(divide="ignore", invalid="ignore"):
        drift = np.log2(l2 / l2[source])
    drift = np.where(np.isfinite(drift), drift, 0.0)  # a non-finite or zero norm: no drift to read
    return StepSeries(
        steps=agg.index.to_numpy(dtype=np.int64), scale=scale, recorded_scale=f64("scale"), skipped=agg["skipped"].to_numpy(bool),
        forced=agg["forced"].to_numpy(bool), nonfinite=agg["nonfinite"].to_numpy(bool), amax=np.where(np.isfinite(amax), amax, 0.0), l2=l2,
        loss=f64("loss"), loss_recorded=agg["loss_recorded"].to_numpy(bool), numel=numel,
        n_zero=n_zero[source] * ratio, n_subnormal=n_subnormal[source] * ratio, hist=merged_hist[source] * ratio[:, None],
        ranks=int(frame["rank"].nunique()), fmt=fmt, min_exp=min_exp, sample_scale=scale[source],
        n_zero_lines=f64("n_zero_lines")[source] * ratio, drift_log2=drift)


def _nearest_sampled(sampled: np.ndarray) -> np.ndarray:
    """For each step, the index of the step whose full statistics stand for it: itself when
    sampled, else the nearest sampled step before it (after it, before the first sample)."""
    index = pd.Series(np.where(sampled, np.arange(len(sampled)), np.nan))
    filled = index.ffill().bfill()
    if filled.isna().all():  # nothing sampled at all: every step stands for itself (all zeros)
        return np.arange(len(sampled))
    return filled.to_numpy().astype(np.int64)


def attach_param_lost(series: StepSeries, param_lost: pd.DataFrame) -> None:
    """Use the per-parameter underflow estimates of the sampled steps (which tell structural zeros
    from underflowed ones tensor by tensor) instead of the all-gradients estimate: each step takes
    the shares of its zeros that were lost, and that were undecided, of the sampled step before it
    (the first one before any), whose histogram the drift of the gradient norm moves; without a
    drift (a series built by hand), interpolated between the sampled steps around it. A measured
    step's shares are its measured ones (no undecided zeros)."""
    if param_lost is None or param_lost.empty:
        return
    zeros = param_lost["n_zero"].where(param_lost["n_zero"] > 0)
    undecided = param_lost["undecided"] if "undecided" in param_lost else 0.0 * param_lost["lost"]
    shares = pd.DataFrame({"lost": (param_lost["lost"] / zeros).fillna(0.0),
                           "undecided": (undecided / zeros).fillna(0.0)})
    # Between two sampled steps: with the drift of the gradient norm known (every step records
    # it), a step keeps its sample's shares and the drift moves the sample's histogram
    # (underflow_model); without it, the shares move linearly (interpolating as well would count
    # the drift twice).
    steps = shares.index.union(pd.Index(series.steps))
    shares = shares.reindex(steps)
    if series.drift_log2 is None:
        shares = shares.interpolate(method="index", limit_area="inside")
    shares = shares.ffill().bfill()
    shares = shares.reindex(series.steps).fillna(0.0)
    series.lost_fraction = shares["lost"].to_numpy(dtype=np.float64)
    series.undecided_fraction = shares["undecided"].to_numpy(dtype=np.float64)
    if "measured" in param_lost:
        measured = param_lost["measured"][param_lost["measured"]]
        series.measured = np.isin(series.steps, measured.index.to_numpy())
