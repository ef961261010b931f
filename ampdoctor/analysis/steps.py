"""The step series: a run's step rows merged over ranks into one record per step (what every
rank's scaler saw together), with the underflow evidence each step stands on: its own full
statistics, or the nearest sampled step's (:func:`load_steps`), refined by the per-parameter
estimates of the sampled steps (:func:`attach_param_lost`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from ..float_formats import FloatFormat
from ..run_file.hist_column import hist_matrix
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
    source: np.ndarray | None = None         # per step: the index of the sampled step whose histogram it holds
    tail: np.ndarray | None = None           # per step: what underflowed at the nearest measured step, by binade
    tail_cut_log2: np.ndarray | None = None  # per step: that measured step's cut-off
    tail_noise: np.ndarray | None = None     # per step: of those, the elements that were rounding noise
    tail_hi: np.ndarray | None = None        # the same, as the upper figures read them (calibration.Tails)
    tail_noise_hi: np.ndarray | None = None
    drift_hi_log2: np.ndarray | None = None  # per step: the other end of the drift's range (light steps)
    ref_lost: np.ndarray | None = None       # per step: elements lost at its sample's cut-off, which the drift
                                             # moves (default: its own, n_zero x lost_fraction)

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def recorded_cut_log2(self) -> np.ndarray:
        """The underflow cut-off (true-gradient units) the zeros and histograms were measured at."""
        scale = self.scale if self.sample_scale is None else self.sample_scale
        return np.log2(self.fmt.underflow_below / scale)

    def underflow_model(self, upper: bool = False) -> UnderflowModel:
        """The underflow of the zeros the estimate counts (not the undecided ones). A step between
        samples takes its sample's histogram moved by the drift since then (shrinking gradients
        lose more below the cut-off): the drift of the gradient norm, or, with parameter rows, the
        drift that gives the step the loss its tensors' own drifts give it (attach_param_lost).
        ``upper``: at the end of the drift's range that loses more (calibration.DRIFT_RANGE)."""
        at_cut = self._bounds()[0] if self.ref_lost is None else self.ref_lost
        drift = self.drift_hi_log2 if upper and self.drift_hi_log2 is not None else self.drift_log2
        tail, noise = (self.tail_hi, self.tail_noise_hi) if upper and self.tail_hi is not None else (
            self.tail, self.tail_noise)
        return UnderflowModel(self.hist, self.recorded_cut_log2, at_cut, self.min_exp, drift, tail,
                              self.tail_cut_log2, tail_noise=noise)

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

    def lost_at_recorded(self, upper: bool = False) -> np.ndarray:
        """Elements estimated lost to underflow at each step's recorded scale (the lower bound;
        ``upper``: at the other end of the drift's range, undecided zeros not counted)."""
        return self.underflow_model(upper).lost(np.log2(self.fmt.underflow_below / self.scale))


def load_steps(table: pa.Table, fmt: FloatFormat, min_exp: int, bins: int) -> StepSeries:
    """Merge the step rows (``layer_scan.STEP_COLUMNS``) of every rank into one series.

    Each column is reduced on its own (pandas' group kernels, the rows sorted by step and rank)
    and let go before the next: memory of a few columns, not a frame of them all (a run of 1,024
    ranks has millions of step rows)."""
    n = table.num_rows
    step = table.column("step").to_numpy(zero_copy_only=False)
    rank = table.column("rank").to_numpy(zero_copy_only=False)
    ranks = int(pd.Series(rank).nunique())
    order = np.lexsort((rank, step))  # (stable: as sorting by step and rank, ties in the rows' order)
    del rank
    sorted_step = step[order]
    starts = np.flatnonzero(np.concatenate([[True], sorted_step[1:] != sorted_step[:-1]])) if n else np.zeros(0, int)
    steps = sorted_step[starts]  # each group's step, ascending
    del sorted_step
    # Each row's group in sorted order: as groupby("step").ngroup() of the sorted rows.
    codes = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, n)))

    def column(name: str) -> pd.Series:
        """A column as the frame would hold it (Arrow's pandas conversion), in sorted order."""
        return table.column(name).to_pandas().iloc[order].reset_index(drop=True)

    def reduce(values, how: str, **options) -> pd.Series:
        grouped = pd.Series(values).reset_index(drop=True).groupby(codes, sort=True)
        return getattr(grouped, how)(**options)

    agg = {}
    loss = table.column("loss").to_numpy(zero_copy_only=False).astype(np.float64)[order]  # null → NaN
    recorded = table.column("loss").is_valid().to_numpy(zero_copy_only=False)[order]
    agg["forced"], agg["loss"] = reduce(recorded & ~np.isfinite(loss), "any"), reduce(loss, "mean")
    agg["loss_recorded"] = reduce(recorded, "any")
    del loss, recorded
    frame = pd.DataFrame({c: column(c) for c in ("n_nan", "n_inf", "amax")})
    agg["nonfinite"] = reduce(nonfinite_rows(frame), "any")
    light = column("n_zero").isna().to_numpy()  # peak and norm only: a non-finite gradient shows in the peak
    amax = frame["amax"]
    del frame
    agg["amax"] = reduce(amax.where(~light | np.isfinite(amax)), "max")  # (a non-finite peak is no magnitude)
    agg["sampled"] = reduce(~light, "any")
    del amax, light
    for name, how in (("scale", "first"), ("skipped", "any"), ("l2", "max"), ("numel", "sum"), ("n_zero", "sum"),
                      ("n_subnormal", "sum")):
        agg[name] = reduce(column(name), how)
    # (null where no rank recorded its lines; counts as floats: exact sums)
    agg["n_zero_lines"] = reduce(column("n_zero_lines"), "sum", min_count=1)
    agg = pd.DataFrame(agg, columns=["scale", "skipped", "forced", "nonfinite", "amax", "l2", "loss", "loss_recorded",
                                     "numel", "n_zero", "n_subnormal", "sampled", "n_zero_lines"])
    agg.index = pd.Index(steps, name="step")
    # The histograms of the full rows alone (light rows have none: they would add zeros), summed
    # over ranks in sorted order: exact.
    has_hist = table.column("hist").is_valid().to_numpy(zero_copy_only=False)
    hist = hist_matrix(table.column("hist").filter(pa.array(has_hist)), bins, np.float64)
    hist_row = np.full(n, -1)
    hist_row[has_hist] = np.arange(len(hist))
    at = np.flatnonzero(has_hist[order])  # (sorted positions of the rows with one)
    merged_hist = np.zeros((len(agg), bins))
    np.add.at(merged_hist, codes[at], hist[hist_row[order[at]]])
    del hist_row
    # What underflowed on measured steps (every rank's step row measured), by magnitude: the tail
    # below the cut-off that predictions at higher scales read (UnderflowModel(tail=)); on
    # measured steps' rows only (null elsewhere).
    tail = tail_cut = None
    if "underflow_hist" in table.column_names and table.column("underflow_hist").null_count < n:
        valid = table.column("underflow_hist").is_valid().to_numpy(zero_copy_only=False)
        rows_at = np.nonzero(valid)[0]
        all_measured = pd.Series(valid[order]).groupby(codes).all().to_numpy()
        if all_measured.any():
            lost_rows = hist_matrix(table.filter(pa.array(valid)).column("underflow_hist"), bins, np.float64)
            merged_lost = np.zeros((len(agg), bins))
            np.add.at(merged_lost, np.searchsorted(steps, step[rows_at]), lost_rows)
            at = _nearest_sampled(all_measured)
            scale_at = np.maximum(agg["scale"].to_numpy(dtype=np.float64), 2.0**-149)
            tail, tail_cut = merged_lost[at], np.log2(fmt.underflow_below / scale_at)[at]
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
        ranks=ranks, fmt=fmt, min_exp=min_exp, sample_scale=scale[source],
        n_zero_lines=f64("n_zero_lines")[source] * ratio, drift_log2=drift, source=source, tail=tail,
        tail_cut_log2=tail_cut)


def _nearest_sampled(sampled: np.ndarray) -> np.ndarray:
    """For each step, the index of the step whose full statistics stand for it: itself when
    sampled, else the nearest sampled step before it (after it, before the first sample)."""
    index = pd.Series(np.where(sampled, np.arange(len(sampled)), np.nan))
    filled = index.ffill().bfill()
    if filled.isna().all():  # nothing sampled at all: every step stands for itself (all zeros)
        return np.arange(len(sampled))
    return filled.to_numpy().astype(np.int64)


def attach_param_lost(series: StepSeries, param_lost: pd.DataFrame) -> None:
    """Use the per-parameter underflow (measured, calibrated by measurements, or estimated, on
    sampled steps; carried by each tensor's own drift to the light steps: layer_scan, calibration)
    instead of the all-gradients estimate of the step rows. Where ``param_lost`` has a step, its
    zeros, lost and undecided shares are the tensors' sums; elsewhere a step keeps the shares of
    the sampled step before it (the first one before any), whose histogram the drift of the
    gradient norm moves; without a drift (a series built by hand), interpolated between the sampled
    steps around it. A measured step's shares are its measured ones (no undecided zeros)."""
    if param_lost is None or param_lost.empty:
        return
    zeros = param_lost["n_zero"].where(param_lost["n_zero"] > 0)
    undecided = param_lost["undecided"] if "undecided" in param_lost else 0.0 * param_lost["lost"]
    shares = pd.DataFrame({"lost": (param_lost["lost"] / zeros).fillna(0.0),
                           "undecided": (undecided / zeros).fillna(0.0)})
    own = pd.Series(param_lost["n_zero"]).reindex(series.steps).to_numpy(dtype=np.float64)
    has_own = ~np.isnan(own)
    # Steps the parameter rows do not cover: with the drift of the gradient norm known (every step
    # records it), a step keeps its sample's shares and the drift moves the sample's histogram
    # (underflow_model); without it, the shares move linearly (interpolating as well would count
    # the drift twice).
    steps = shares.index.union(pd.Index(series.steps))
    shares = shares.reindex(steps)
    if series.drift_log2 is None:
        shares = shares.interpolate(method="index", limit_area="inside")
    shares = shares.ffill().bfill()
    shares = shares.reindex(series.steps).fillna(0.0)
    lost_fraction = shares["lost"].to_numpy(dtype=np.float64)
    if has_own.any() and series.drift_log2 is not None:
        # The loss at each sample (whose histogram its light steps hold), before the zeros become
        # each step's own.
        ref = series.n_zero * lost_fraction
        series.n_zero = np.where(has_own, own, series.n_zero)
        lost = series.n_zero * lost_fraction
        source = series.source if series.source is not None else np.arange(len(series))
        series.ref_lost = ref[source] * np.divide(series.numel, series.numel[source], out=np.zeros(len(series)),
                                                  where=series.numel[source] > 0)
        sampled = source == np.arange(len(series))
        series.ref_lost = np.where(sampled, lost, series.ref_lost)
        # A light step with parameter rows: the drift that gives it its tensors' loss. Without
        # them: its sample's figures, moved by the norm's drift.
        carried = has_own & ~sampled
        if carried.any():
            lost_hi = np.where(has_own, pd.Series(param_lost.get("lost_hi", param_lost["lost"]))
                               .reindex(series.steps).to_numpy(dtype=np.float64), lost)
            norm = series.drift_log2
            series.drift_log2 = np.where(carried, _drift_for(series, lost, norm, carried), norm)
            series.drift_hi_log2 = np.where(carried, _drift_for(series, np.maximum(lost_hi, lost), norm, carried,
                                                                upper=True), series.drift_log2)
    series.lost_fraction = lost_fraction
    series.undecided_fraction = shares["undecided"].to_numpy(dtype=np.float64)
    if "measured" in param_lost:
        measured = param_lost["measured"][param_lost["measured"]]
        series.measured = np.isin(series.steps, measured.index.to_numpy())


def _drift_for(series: StepSeries, lost: np.ndarray, start: np.ndarray, rows: np.ndarray, *, upper: bool = False,
               iterations: int = 60) -> np.ndarray:
    """Per step (``rows``: the ones to solve), the drift (binades) by which its sample's histogram
    must move for the step to lose ``lost`` elements at its own cut-off: its tensors' drifts in
    one figure, for the replay at other scales (``upper``: with the upper tail). Starts from the
    norm's drift, kept where it already gives ``lost``."""
    drift = np.asarray(start, dtype=np.float64).copy()
    idx = np.nonzero(rows)[0]
    if not len(idx):
        return drift
    tail, noise = (series.tail_hi, series.tail_noise_hi) if upper and series.tail_hi is not None else (
        series.tail, series.tail_noise)
    pick = lambda a: None if a is None else a[idx]  # noqa: E731
    model = UnderflowModel(series.hist[idx], series.recorded_cut_log2[idx], series.ref_lost[idx], series.min_exp,
                           drift[idx], pick(tail), pick(series.tail_cut_log2), tail_noise=pick(noise))
    cut = np.log2(series.fmt.underflow_below / series.scale[idx])
    target = lost[idx]

    def at(d: np.ndarray) -> np.ndarray:
        model.drift_log2 = d
        return model.lost(cut)

    off = np.abs(at(drift[idx]) - target) > 1e-6 * np.maximum(target, 1.0)
    if not off.any():
        return drift
    # lost(drift) falls as the drift grows (larger magnitudes lose less): bisect on [-128, 128].
    lo, hi = np.full(len(idx), -128.0), np.full(len(idx), 128.0)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        more = at(mid) > target
        lo, hi = np.where(more, mid, lo), np.where(more, hi, mid)
    solved = (lo + hi) / 2
    # A loss the sample's histogram cannot give at any drift (more than it holds): the norm's drift.
    reached = np.abs(at(solved) - target) <= 1e-3 * np.maximum(target, 1.0)
    drift[idx] = np.where(off & reached, solved, drift[idx])
    return drift


def attach_tails(series: StepSeries, tails) -> None:
    """Each step's tail below the cut-off (UnderflowModel(tail=)) from the nearest measured step's
    parameter gradients, their rounding noise apart (calibration.Tails); a run without measured
    parameter rows keeps its step rows' (load_steps)."""
    if tails is None or not len(series):
        return
    steps, parts = tails.frame()
    if not len(steps):
        return
    where = pd.Series(np.arange(len(steps)), index=steps).reindex(series.steps)
    at = _nearest_sampled(where.notna().to_numpy())
    if not where.notna().any():  # no measured step among the series' own: the next one (else the last)
        index = np.clip(np.searchsorted(steps, series.steps), 0, len(steps) - 1)
    else:
        index = where.to_numpy()[at].astype(np.int64)
    series.tail, series.tail_noise = parts["tail"][index], parts["noise"][index]
    series.tail_hi, series.tail_noise_hi = parts["tail_hi"][index], parts["noise_hi"][index]
    series.tail_cut_log2 = parts["cut"][index]
