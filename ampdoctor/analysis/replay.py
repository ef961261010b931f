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
the range is narrower than :data:`~ampdoctor.analysis.contract_fields.RANGE_TOLERANCE`, else None.

**The threshold.** Overflow happens wherever a value first exceeds the format, often inside a
module (an output gradient) rather than in the parameter gradients that are recorded every step,
so T is calibrated in ``amax · S`` units from what the run did:

* every step that was *not* skipped bounds T from below (``amax · S`` did not overflow);
* a skipped step's own ``amax`` is only a lower bound (its largest values became inf), so its
  magnitude is estimated from the nearest good steps around it; the smallest such ``e · S`` above
  the lower bound bounds T from above, and T is the geometric middle of the two bounds;
* with no overflow to learn from (or a bf16/fp32 run asked about fp16), T is the format's max
  divided by the largest ratio of module output gradients to parameter gradients seen on the
  sampled steps (1 without module rows, which the result says).

A skipped step that T cannot explain (its neighbours' magnitudes would not have overflowed: a
gradient spike, or a non-finite value that is not an overflow) is kept at its lower bound: it
overflows at the recorded scale and above, and below that the replay assumes it would not. Such
steps are counted as ``uncertain_steps``. A step with a non-finite loss is skipped at any scale.
Gradient magnitudes are assumed not to depend on which steps were skipped: a replay is a what-if
on the recorded trajectory, not a re-run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..float_formats import FLOAT16, FloatFormat
from .contract_fields import underflow_fields
from .findings import Finding
from .scaler_config import FLOAT32_MAX, ScalerConfig
from .steps import StepSeries

GRID = np.arange(-40, 81, dtype=np.float64)  # log2 scales at which per-step underflow is tabulated


@dataclass(frozen=True)
class Threshold:
    log2: float          # overflow when log2(amax · S) exceeds this
    source: Finding      # how it was found

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
    underflow_hi: np.ndarray    # the same at the other end of the drift's range (steps between samples)
    undecided: np.ndarray       # [steps]: zeros whose underflow is undecided at any scale
    notes: list[Finding] = field(default_factory=list)


def prepare(series: StepSeries, target: FloatFormat = FLOAT16, *, module_ratio: float | None = None) -> Replay:
    """Calibrate the overflow threshold and tabulate underflow for replays into ``target``."""
    notes: list[Finding] = []
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
                                  Finding("threshold_from_overflows", {"overflows": int(overflowed.sum())}))
        else:
            # dtype None: the run's own format's max
            threshold = Threshold(max(lower, default), Finding("threshold_at_format_max",
                                                               {"dtype": None, "module_ratio": ratio}))
    else:
        threshold = Threshold(default, Finding("threshold_at_format_max",
                                               {"dtype": target.name, "module_ratio": ratio}))
        if not same_format:
            notes.append(Finding("threshold_of_other_format", {
                "recorded": series.fmt.name, "target": target.name, "module_ratio": ratio,
                "module_rows": module_ratio is not None}))
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
        notes.append(Finding("unexplained_skips", {"steps": int(unexplained.sum())}))
    if series.forced.any():
        notes.append(Finding("nonfinite_loss_steps", {"steps": int(series.forced.sum())}))
    table = _underflow_table(series, target)
    # The upper table differs only where a drift's range or an upper tail says so.
    ranged = series.drift_hi_log2 is not None or series.tail_hi is not None
    return Replay(series, target, threshold, critical, unexplained, table,
                  _underflow_table(series, target, upper=True) if ranged else table, series.undecided(), notes)


def _neighbour_estimate(amax: np.ndarray, good: np.ndarray) -> np.ndarray:
    """Each step's magnitude as the larger of the nearest good steps' before and after it."""
    values = pd.Series(np.where(good, amax, np.nan))
    before, after = values.ffill(), values.bfill()
    return np.fmax(before.to_numpy(), after.to_numpy())


def _underflow_table(series: StepSeries, target: FloatFormat, upper: bool = False) -> np.ndarray:
    model = series.underflow_model(upper)
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
    table_hi = prepared.underflow_hi
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
            row, row_hi = table[t], table_hi[t]
            low = row[i] * (1 - w) + row[i + 1] * w
            lost += np.where(over, 0.0, low)
            # The upper bound: the drift's other end, and the undecided zeros.
            high = np.maximum(row_hi[i] * (1 - w) + row_hi[i + 1] * w, low)
            undecided_lost += np.where(over, 0.0, high - low + undecided[t])
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


def drift_share(series: StepSeries) -> float:
    """Of the applied steps' elements, the share between the two ends of the drift's range (steps
    between samples, whose small values may have drifted up to ``DRIFT_RANGE`` times their norm)."""
    applied = ~series.skipped
    kept = series.numel[applied].sum()
    if not kept:
        return 0.0
    lost = series.lost_at_recorded()[applied]
    return float(np.maximum(series.lost_at_recorded(upper=True)[applied] - lost, 0.0).sum() / kept)


def actual_outcome(series: StepSeries, config: ScalerConfig | None) -> dict:
    """What the run itself did, in the simulate contract's shape."""
    n = len(series)
    applied = ~series.skipped
    lost = series.lost_at_recorded()[applied]
    lost_hi = np.maximum(series.lost_at_recorded(upper=True)[applied], lost)
    lost = lost.sum()
    kept = series.numel[applied].sum()
    high = lost_hi.sum() + series.undecided()[applied].sum()
    low, high = (lost / kept, high / kept) if kept else (0.0, 0.0)
    return {"config": config.to_dict() if config is not None else None,
            "skipped_steps": int(series.skipped.sum()),
            "skipped_fraction": float(series.skipped.mean()) if n else 0.0,
            **underflow_fields(low, high),
            "scale": {"final": float(series.recorded_scale[-1]), "min": float(series.recorded_scale.min()),
                      "max": float(series.recorded_scale.max())} if n else None}
