"""Replay loss-scaler configurations against a run's recorded gradient magnitudes.

The record holds, per step, the largest finite gradient magnitude (unscaled), the binade histogram
of all gradients, and what the scaler did. A candidate configuration is replayed step by step: a
step *overflows* when ``amax · S`` exceeds the overflow threshold T, and then it is skipped and the
scale backs off; otherwise the scale grows every ``growth_interval`` good steps, as in
``torch.amp.GradScaler`` (plus Megatron/DeepSpeed-style hysteresis and min/max scale). Underflow at
each step's scale comes from :class:`~ampdoctor.analysis.underflow.UnderflowModel`, as a range:
the *undecided* zeros, between each tensor's estimate and its upper bound
(:func:`~ampdoctor.analysis.underflow.underflow_bounds`: gradients that were 0 everywhere, zero lines
of a tensor reaching the cut-off), count towards the upper bound (``underflow_rate_max``) at any
scale and not towards the lower one (``underflow_rate_min``): nothing recorded says how far below
the cut-off they were, or whether they are structure. ``underflow_rate`` is the point value when
the range is narrower than :data:`RANGE_TOLERANCE`, else None.

**The threshold.** Overflow happens wherever a value first exceeds the format, often inside a
module (an output gradient) rather than in the parameter gradients that are recorded every step,
so T is calibrated in ``amax · S`` units from what the run did:

* every step that was *not* skipped bounds T from below (``amax · S`` did not overflow);
* a skipped step's own ``amax`` is only a lower bound (its largest values became inf), so its
  magnitude is estimated from the nearest good steps around it; the smallest such ``e · S`` above
  the lower bound bounds T from above, and T is the geometric middle of the two bounds;
* with no overflow to learn from (or a bf16/fp32 run asked about fp16), T is the format's max
  divided by the largest ratio of module output gradients to parameter gradients seen on the
  detailed steps (1 without module rows, which the result says).

A skipped step that T cannot explain (its neighbours' magnitudes would not have overflowed: a
gradient spike, or a non-finite value that is not an overflow) is kept at its lower bound: it
overflows at the recorded scale and above, and below that the replay assumes it would not. Such
steps are counted as ``uncertain_steps``. A step with a non-finite loss is skipped at any scale.
Gradient magnitudes are assumed not to depend on which steps were skipped: a replay is a what-if
on the recorded trajectory, not a re-run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import pandas as pd
import pyarrow as pa

from ..formats import FLOAT16, FloatFormat
from ..render.formatting import scale_str
from .origins import nonfinite_rows
from .underflow import UnderflowModel, underflow_bounds

FLOAT32_MAX = float(np.finfo(np.float32).max)
GRID = np.arange(-40, 81, dtype=np.float64)  # log2 scales at which per-step underflow is tabulated
RANGE_TOLERANCE = 1e-4  # an underflow range narrower than this (absolute) is reported as a point



@dataclass(frozen=True)
class ScalerConfig:
    """A dynamic loss-scaler configuration (torch's four settings, plus hysteresis and bounds)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1           # overflows in a row before backing off (Megatron, DeepSpeed); 1: torch
    min_scale: float = 0.0
    max_scale: float = math.inf

    def __post_init__(self) -> None:
        # torch keeps the scale in float32 and never grows it to a non-finite value.
        for name in ("init_scale", "growth_factor", "min_scale"):
            value = getattr(self, name)
            if not math.isfinite(value) or value > FLOAT32_MAX:
                raise ValueError(f"{name} must be finite and at most float32's max, got {value}")
        if not self.init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {self.init_scale}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if int(self.growth_interval) < 1 or int(self.hysteresis) < 1:
            raise ValueError("growth_interval and hysteresis must be >= 1")
        if self.min_scale > self.max_scale:
            raise ValueError(f"min_scale {self.min_scale} > max_scale {self.max_scale}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["max_scale"] = None if math.isinf(self.max_scale) else self.max_scale
        return d

    def settings(self, current: "ScalerConfig | None" = None) -> str:
        """``init_scale=2**12, growth_interval=500``: init_scale, and the settings that differ from
        torch's defaults or from ``current``."""
        args = [f"init_scale={scale_str(self.init_scale)}"]
        default = ScalerConfig()
        for name in ("growth_factor", "backoff_factor", "growth_interval"):
            value = getattr(self, name)
            if value != getattr(default, name) or (current is not None and value != getattr(current, name)):
                args.append(f"{name}={value!r}")
        return ", ".join(args)

    def code(self, device: str = "cuda", current: "ScalerConfig | None" = None) -> str:
        """A ready-to-paste ``torch.amp.GradScaler(...)`` line."""
        return f'torch.amp.GradScaler("{device}", {self.settings(current)})'


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

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def recorded_cut_log2(self) -> np.ndarray:
        """The underflow cut-off (true-gradient units) the zeros and histograms were measured at."""
        scale = self.scale if self.sample_scale is None else self.sample_scale
        return np.log2(self.fmt.underflow_below / scale)

    def underflow_model(self) -> UnderflowModel:
        """The underflow of the zeros the estimate counts (not the undecided ones)."""
        return UnderflowModel(self.hist, self.recorded_cut_log2, self._bounds()[0], self.min_exp)

    def undecided(self) -> np.ndarray:
        """Per step: zeros whose underflow is undecided at any scale (see the module docstring)."""
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
    """Merge the step rows (``layers.STEP_COLUMNS``) of every rank into one series."""
    frame = table.drop_columns(["hist", "loss"]).to_pandas()
    loss = table.column("loss").to_numpy(zero_copy_only=False).astype(np.float64)  # null → NaN
    recorded = table.column("loss").is_valid().to_numpy(zero_copy_only=False)
    hist_col = table.column("hist").combine_chunks() if table.num_rows else None
    if hist_col is not None and hist_col.null_count < len(hist_col):
        hist = np.asarray(hist_col.fill_null([0] * bins).flatten(), dtype=np.float64).reshape(-1, bins)
    else:
        hist = np.zeros((len(frame), bins))
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
    return StepSeries(
        steps=agg.index.to_numpy(dtype=np.int64), scale=scale, recorded_scale=f64("scale"), skipped=agg["skipped"].to_numpy(bool),
        forced=agg["forced"].to_numpy(bool), nonfinite=agg["nonfinite"].to_numpy(bool), amax=np.where(np.isfinite(amax), amax, 0.0), l2=f64("l2"),
        loss=f64("loss"), loss_recorded=agg["loss_recorded"].to_numpy(bool), numel=numel,
        n_zero=n_zero[source] * ratio, n_subnormal=n_subnormal[source] * ratio, hist=merged_hist[source] * ratio[:, None],
        ranks=int(frame["rank"].nunique()), fmt=fmt, min_exp=min_exp, sample_scale=scale[source],
        n_zero_lines=f64("n_zero_lines")[source] * ratio)


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
    the shares of its zeros that were lost, and that were undecided, interpolated between the
    sampled steps around it (the nearest one before the first or after the last)."""
    if param_lost is None or param_lost.empty:
        return
    zeros = param_lost["n_zero"].where(param_lost["n_zero"] > 0)
    undecided = param_lost["undecided"] if "undecided" in param_lost else 0.0 * param_lost["lost"]
    shares = pd.DataFrame({"lost": (param_lost["lost"] / zeros).fillna(0.0),
                           "undecided": (undecided / zeros).fillna(0.0)})
    # Between two sampled steps the shares move linearly (underflow drifts as gradients shrink).
    steps = shares.index.union(pd.Index(series.steps))
    shares = shares.reindex(steps).interpolate(method="index", limit_area="inside").ffill().bfill()
    shares = shares.reindex(series.steps).fillna(0.0)
    series.lost_fraction = shares["lost"].to_numpy(dtype=np.float64)
    series.undecided_fraction = shares["undecided"].to_numpy(dtype=np.float64)


@dataclass(frozen=True)
class Threshold:
    log2: float          # overflow when log2(amax · S) exceeds this
    source: str          # how it was found (for the notes)

    def to_dict(self) -> dict:
        return {"overflow_log2": self.log2, "source": self.source}


@dataclass
class Replay:
    """The inputs of the replay, derived once per run and target format."""

    series: StepSeries
    target: FloatFormat
    threshold: Threshold
    critical_log2: np.ndarray   # per step: the step overflows when log2 S exceeds this
    lower_bound: np.ndarray     # per step: its magnitude is only a lower bound (uncertain below scale)
    underflow: np.ndarray       # [steps, len(GRID)]: elements lost at each grid scale (lower bound)
    undecided: np.ndarray       # [steps]: zeros whose underflow is undecided at any scale
    notes: list[str] = field(default_factory=list)


def prepare(series: StepSeries, target: FloatFormat = FLOAT16, *, module_ratio: float | None = None) -> Replay:
    """Calibrate the overflow threshold and tabulate underflow for replays into ``target``."""
    notes: list[str] = []
    same_format = series.fmt.name == target.name and series.fmt.max == target.max
    scaled = series.amax * series.scale
    # A step with an inf/NaN gradient overflowed even when nothing was skipped (a disabled scaler).
    overflowed = (series.skipped | series.nonfinite) & ~series.forced
    good = ~overflowed & ~series.forced & (series.amax > 0)
    estimate = np.fmax(_neighbour_estimate(series.amax, good), series.amax)
    ratio = max(1.0, module_ratio or 1.0)
    default = math.log2(target.max / ratio)
    if same_format and good.any():
        lower = float(np.log2(scaled[good].max()))
        with np.errstate(divide="ignore"):
            candidates = np.log2(estimate[overflowed] * series.scale[overflowed])
        above = candidates[candidates > lower]
        if len(above):
            threshold = Threshold((lower + float(above.min())) / 2,
                                  f"{int(overflowed.sum())} observed overflow(s)")
        else:
            threshold = Threshold(max(lower, default), "the format's max" + (
                f" / {ratio:.3g} (module output gradients)" if ratio > 1 else ""))
    else:
        threshold = Threshold(default, f"the {target.name} max" + (
            f" / {ratio:.3g} (module output gradients)" if ratio > 1 else ""))
        if not same_format:
            if ratio > 1:
                why = " over the largest module-to-parameter gradient ratio seen"
            elif module_ratio is None:
                why = " (no module rows: record with level='full' to see overflow inside modules)"
            else:
                why = " (no module output gradient was larger than the parameter gradients)"
            notes.append(f"recorded in {series.fmt.name}: nothing could overflow {target.name}'s range, so the "
                         f"threshold is {target.name}'s max{why}")
    with np.errstate(divide="ignore"):
        magnitude_log2 = np.log2(np.where(overflowed, estimate, series.amax))
    critical = threshold.log2 - magnitude_log2  # log2 S above which the step overflows
    recorded_log2 = np.log2(series.scale)
    unexplained = overflowed & (critical >= recorded_log2) if same_format else np.zeros(len(series), bool)
    # No finite magnitude to go by at all (every step overflowed): only the lower bound is known.
    unexplained |= overflowed & ~(estimate > 0)
    # A skipped step that T does not explain overflows at its recorded scale and above (lower bound).
    critical = np.where(unexplained, recorded_log2 - 1e-9, critical)
    critical = np.where(series.forced, -np.inf, critical)
    if unexplained.any():
        notes.append(f"{int(unexplained.sum())} skipped step(s) overflowed although the steps around them "
                     f"would not have: their magnitude is only a lower bound, so at lower scales the "
                     f"prediction assumes they pass (counted as uncertain)")
    if series.forced.any():
        notes.append(f"{int(series.forced.sum())} step(s) had a non-finite loss: skipped at any scale")
    return Replay(series, target, threshold, critical, unexplained, _underflow_table(series, target),
                  series.undecided(), notes)


def _neighbour_estimate(amax: np.ndarray, good: np.ndarray) -> np.ndarray:
    """Each step's magnitude as the larger of the nearest good steps' before and after it."""
    values = pd.Series(np.where(good, amax, np.nan))
    before, after = values.ffill(), values.bfill()
    return np.fmax(before.to_numpy(), after.to_numpy())


def _underflow_table(series: StepSeries, target: FloatFormat) -> np.ndarray:
    model = series.underflow_model()
    # Cut-off in the target format at each grid scale, in true-gradient units.
    cuts = np.log2(target.underflow_below) - GRID
    return model.lost(np.broadcast_to(cuts, (len(series), len(GRID))))


@dataclass
class Outcome:
    """Per configuration: what the replay predicts."""

    config: ScalerConfig
    skipped_steps: int
    uncertain_steps: int
    underflow_rate: float                  # the lower bound: undecided zeros not counted
    scale_final: float
    scale_min: float
    scale_max: float
    median_log2_scale: float
    margin_log2: float                     # the closest an applied step came to overflow, in binades
    steady_skipped: int | None = None      # skips in a second pass over the steps (replay(passes=2))
    trajectory: np.ndarray | None = None   # log2 scale per step (when asked for)
    underflow_rate_max: float | None = None  # the upper bound: every undecided zero counted (None: as the lower)

    @property
    def underflow_upper(self) -> float:
        return self.underflow_rate if self.underflow_rate_max is None else self.underflow_rate_max

    def to_dict(self, steps: int) -> dict:
        return {"config": self.config.to_dict(), "skipped_steps": self.skipped_steps,
                "skipped_fraction": self.skipped_steps / steps if steps else 0.0,
                **underflow_fields(self.underflow_rate, self.underflow_upper),
                "uncertain_steps": self.uncertain_steps,
                "scale": {"final": self.scale_final, "min": self.scale_min, "max": self.scale_max}}


def replay(prepared: Replay, configs: list[ScalerConfig], *, keep_trajectory: bool = False,
           passes: int = 1) -> list[Outcome]:
    """Run every configuration over the recorded steps at once (vectorised over configurations).
    With ``passes=2`` the recorded steps are replayed a second time, continuing from where the
    first pass left the scaler: its skips (``steady_skipped``) show what a setting does once the
    start-up is over, which a run shorter than the growth interval cannot show by itself. The
    other figures are the first pass's."""
    n, c = len(prepared.series), len(configs)
    if c == 0:
        return []
    log2s = np.log2([cfg.init_scale for cfg in configs])
    up = np.log2([cfg.growth_factor for cfg in configs])
    down = np.log2([cfg.backoff_factor for cfg in configs])
    interval = np.array([cfg.growth_interval for cfg in configs])
    hysteresis = np.array([cfg.hysteresis for cfg in configs])
    with np.errstate(divide="ignore"):
        # float32 bounds: torch's scale cannot go below its smallest subnormal or above its max.
        lo = np.maximum(np.log2([cfg.min_scale for cfg in configs]), -149.0)
        hi = np.minimum(np.log2([cfg.max_scale for cfg in configs]), math.log2(FLOAT32_MAX))
    tracker = np.zeros(c, dtype=np.int64)
    hyst = hysteresis.copy()
    skipped = np.zeros(c, dtype=np.int64)
    steady = np.zeros(c, dtype=np.int64)
    uncertain = np.zeros(c, dtype=np.int64)
    lost = np.zeros(c)
    undecided_lost = np.zeros(c)
    kept = np.zeros(c)
    smin, smax = log2s.copy(), log2s.copy()
    margin = np.full(c, np.inf)
    trajectory = np.empty((n, c)) if keep_trajectory else None
    critical, lower_bound = prepared.critical_log2, prepared.lower_bound
    recorded_log2 = np.log2(prepared.series.scale)
    numel, table, undecided = prepared.series.numel, prepared.underflow, prepared.undecided
    grid0, grid_last = GRID[0], len(GRID) - 1
    final = log2s
    for k in range(n * passes):
        t, first = k % n, k < n
        over = log2s > critical[t]
        if first:
            if trajectory is not None:
                trajectory[t] = log2s
            smin = np.minimum(smin, log2s)
            smax = np.maximum(smax, log2s)
            if lower_bound[t]:
                uncertain += ~over & (log2s < recorded_log2[t])
            skipped += over
            margin = np.where(over, margin, np.minimum(margin, critical[t] - log2s))
            # Underflow of the steps that are applied, interpolated between grid scales.
            pos = np.clip(log2s - grid0, 0, grid_last)
            i = np.minimum(pos.astype(np.int64), grid_last - 1)
            w = pos - i
            row = table[t]
            lost += np.where(over, 0.0, row[i] * (1 - w) + row[i + 1] * w)
            undecided_lost += np.where(over, 0.0, undecided[t])
            kept += np.where(over, 0.0, numel[t])
        else:
            steady += over
        # The scaler's update.
        hyst = np.where(over, hyst - 1, hyst)
        back = over & (hyst <= 0)
        log2s = np.where(back, np.maximum(log2s + down, lo), log2s)
        tracker = np.where(over, 0, tracker + 1)
        grow = ~over & (tracker >= interval)
        log2s = np.where(grow, np.minimum(log2s + up, hi), log2s)
        tracker = np.where(grow, 0, tracker)
        hyst = np.where(grow, hysteresis, hyst)  # reset on growth only (Megatron, DeepSpeed)
        if k == n - 1:
            final = log2s
    rate = np.divide(lost, kept, out=np.zeros(c), where=kept > 0)
    rate_max = np.divide(lost + undecided_lost, kept, out=np.zeros(c), where=kept > 0)
    median = (np.median(trajectory, axis=0) if trajectory is not None else (smin + smax) / 2)
    out = []
    for j, cfg in enumerate(configs):
        out.append(Outcome(cfg, int(skipped[j]), int(uncertain[j]), float(rate[j]), float(2.0 ** final[j]),
                           float(2.0 ** smin[j]), float(2.0 ** smax[j]), float(median[j]), float(margin[j]),
                           int(steady[j]) if passes > 1 else None,
                           trajectory[:, j] if trajectory is not None else None, float(rate_max[j])))
    return out


def recorded_config(metadata: dict[str, str], series: StepSeries) -> ScalerConfig | None:
    """The configuration the run was recorded with (None for a disabled scaler: scale 1, bf16/fp32)."""
    def num(key, default):
        try:
            return float(metadata[key])
        except (KeyError, ValueError):
            return default
    init = series.scale[0] if len(series) else num("scaler.init_scale", 2.0**16)
    cfg = ScalerConfig(init_scale=float(init), growth_factor=num("scaler.growth_factor", 2.0),
                       backoff_factor=num("scaler.backoff_factor", 0.5),
                       growth_interval=int(num("scaler.growth_interval", 2000)))
    return cfg


def actual_outcome(series: StepSeries, config: ScalerConfig | None) -> dict:
    """What the run itself did, in the simulate contract's shape."""
    n = len(series)
    applied = ~series.skipped
    lost = series.lost_at_recorded()[applied].sum()
    kept = series.numel[applied].sum()
    low, high = (lost / kept, (lost + series.undecided()[applied].sum()) / kept) if kept else (0.0, 0.0)
    return {"config": config.to_dict() if config is not None else None,
            "skipped_steps": int(series.skipped.sum()),
            "skipped_fraction": float(series.skipped.mean()) if n else 0.0,
            **underflow_fields(low, high),
            "scale": {"final": float(series.recorded_scale[-1]), "min": float(series.recorded_scale.min()),
                      "max": float(series.recorded_scale.max())} if n else None}


def underflow_point(low: float, high: float) -> float | None:
    """One underflow rate for a range narrower than :data:`RANGE_TOLERANCE`, else None."""
    return known_or_none(low) if high - low <= RANGE_TOLERANCE else None


def underflow_fields(low: float, high: float) -> dict:
    """The contracts' underflow fields: the point value (None when the record cannot decide) and
    the range it lies in."""
    return {"underflow_rate": underflow_point(low, high), "underflow_rate_min": known_or_none(low),
            "underflow_rate_max": known_or_none(high)}


def known_or_none(rate: float) -> float | None:
    """A rate for the JSON contracts: None where the record cannot tell (NaN)."""
    return None if rate is None or not np.isfinite(rate) else float(rate)


def with_defaults(base: ScalerConfig | None, **overrides) -> ScalerConfig:
    """``base`` (or torch's defaults) with the given non-None settings replaced."""
    cfg = base or ScalerConfig()
    changes = {k: v for k, v in overrides.items() if v is not None}
    return replace(cfg, **changes)
