"""Recommended loss-scaler settings: a search over configurations with the replay; the verdict, and
the findings behind it (reasons) and beyond it (advice).

Every candidate (init_scale 2^0..2^24, growth_interval 100..10000, growth and backoff factors) is
replayed on the recorded steps (:mod:`ampdoctor.analysis.replay`). Its cost is
``skipped + steady + uncertain / 2 + UNDERFLOW_WEIGHT · steps · underflow_rate``: an underflow rate of
0.1% over the whole run costs as much as skipping 1% of its steps. ``steady`` counts the skips of a
second pass over the recorded steps, continuing from the first pass's scaler state, so that a
setting that only looks good because the run ended before its scale grew back into overflow (a
low init_scale with a short growth_interval) is not chosen. Within the same format a candidate may not
predict more underflow than the current settings, beyond :data:`UNDERFLOW_TOLERANCE` (absolute)
or 10% of it, whichever is larger. Among candidates within half a step of the best cost (and within
that tolerance of the least underflow among them), one that
stays at least :data:`MARGIN_LOG2` binades below the overflow threshold on every applied step wins
(gradients grow and vary: a setting right at the edge of the recorded ones overflows on the next
spike), unless the current settings are among them, which the run itself showed working; then the
one that changes fewest settings; then torch's defaults; then the init_scale and then the
growth_interval closest to torch's defaults (the underflow is already within the tolerance).

Underflow is compared by its lower bound: the undecided zeros (:mod:`~ampdoctor.analysis.replay`)
add about the same to every candidate's upper bound, so they do not change the ranking; the
contract reports each range.

The verdict is ``keep`` when the current settings win, ``change`` otherwise, ``no_scale_works``
only when the winner still skips or underflows badly and no candidate avoids every avoidable skip
within the underflow cap, and ``unknown`` instead of ``keep`` when the undecided zeros at the recorded
settings are more than :data:`BAD_UNDERFLOW` of the elements: whether they underflowed (and a
higher scale would recover them) or get no gradient at all, the record cannot tell.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..run_file.schema import ROOT_NAME
from .contract_fields import underflow_fields
from .findings import Finding
from .replay import Outcome, Replay, replay, drift_share
from .scaler_config import FRAMEWORKS, TORCH_SETTINGS, ScalerConfig, scaler_constructor

UNDERFLOW_WEIGHT = 10.0
UNCERTAIN_WEIGHT = 0.5        # a step that may or may not overflow costs half a skipped one
INIT_EXPONENTS = range(0, 25)
GROWTH_INTERVALS = (100, 200, 500, 1000, 2000, 5000, 10000)
GROWTH_FACTORS = (2.0,)
BACKOFF_FACTORS = (0.5, 0.25)
UNDERFLOW_SLACK = 1.10        # "no worse" than the current settings, within this factor ...
UNDERFLOW_TOLERANCE = 1e-3    # ... or this many elements per element (0.1 percentage points), if larger
NEAR = 0.5                    # cost tolerance, in steps
MARGIN_LOG2 = 2.0             # binades a recommended scale keeps below the overflow threshold
BAD_SKIPPED = 0.05            # a fraction of skipped steps that no setting should leave
BAD_UNDERFLOW = 0.01          # an underflow rate that no setting should leave
COLLAPSE_FACTOR = 16.0        # a scale this far below where it settled, still skipping, has collapsed


@dataclass
class Candidate:
    outcome: Outcome
    cost: float
    changed: int


def candidates(current: ScalerConfig | None) -> list[ScalerConfig]:
    base = current or ScalerConfig()
    inits = sorted({2.0**k for k in INIT_EXPONENTS} | {base.init_scale})
    intervals = sorted(set(GROWTH_INTERVALS) | {base.growth_interval})
    growths = sorted(set(GROWTH_FACTORS) | {base.growth_factor})
    backoffs = sorted(set(BACKOFF_FACTORS) | {base.backoff_factor})
    return [ScalerConfig(i, g, b, gi) for i in inits for g in growths for b in backoffs for gi in intervals]


def _changed(cfg: ScalerConfig, base: ScalerConfig) -> int:
    return sum(getattr(cfg, k) != getattr(base, k) for k in TORCH_SETTINGS)


def replayed(prepared: Replay, current: ScalerConfig | None) -> tuple[list[Outcome], Outcome]:
    """The candidates' outcomes and the run's own scaler's (what :func:`recommend` weighs): the
    bulk of its work, apart so that a caller may run it beside other work."""
    return replay(prepared, candidates(current), passes=2), replay(prepared, [current or ScalerConfig()])[0]


def recommend(prepared: Replay, current: ScalerConfig | None, actual: dict, *, device: str = "cuda",
              settle_step: int | None = None, worst_modules: list[str] | None = None,
              hot_activations: list[tuple[str, float]] | None = None, outside: list[str] | None = None,
              scaler_class: str | None = None, framework: str | None = None,
              outcomes: tuple[list[Outcome], Outcome] | None = None) -> dict:
    """The recommendation section of the report contract. ``current`` is None for a run whose
    scaler was disabled (bf16/fp32): then the question is whether fp16 would work at all.
    ``outside``: for overflow origins outside the tapped modules, the module whose output gradient
    each reached first. ``scaler_class``, ``framework``: the run's (metadata ``scaler.class``,
    ``scaler.framework``), so that the line to paste constructs the run's own scaler class, or
    sets it through the framework's own arguments. ``outcomes``: :func:`replayed`'s, where the
    caller has them."""
    series = prepared.series
    n = len(series)
    base = current or ScalerConfig()
    outcomes, baseline = outcomes or replayed(prepared, current)
    same_format = series.fmt.name == prepared.target.name
    # The share of the range that is the drift between samples (not zeros of unknown nature): a
    # smaller every= narrows it; the verdict is `unknown` only for undecided zeros.
    drift = drift_share(series) if same_format and current is not None else 0.0
    known = baseline.underflow_upper - baseline.underflow_rate - drift <= BAD_UNDERFLOW
    cap = (baseline.underflow_rate + max(UNDERFLOW_TOLERANCE, baseline.underflow_rate * (UNDERFLOW_SLACK - 1))
           if same_format and current is not None else math.inf)
    scored = [Candidate(o, o.skipped_steps + o.steady_skipped + UNCERTAIN_WEIGHT * o.uncertain_steps
                        + UNDERFLOW_WEIGHT * n * o.underflow_rate, _changed(o.config, base)) for o in outcomes]
    feasible = [c for c in scored if c.outcome.underflow_rate <= cap] or scored
    best = min(c.cost for c in feasible)
    near = [c for c in feasible if c.cost <= best + NEAR]
    # Within half a step of cost, a short run's underflow term is small: less underflow beyond the
    # tolerance still decides (a run of 3 steps at 1.5% underflow is not "as good" as one at 0).
    least = min(c.outcome.underflow_rate for c in near)
    near = [c for c in near if c.outcome.underflow_rate <= least + UNDERFLOW_TOLERANCE]
    default = ScalerConfig()
    # The current settings, when they do as well as the best, are kept: the run itself showed them
    # working, and any scale drifts into its own overflow margin once it grows anyway.
    chosen = min(near, key=lambda c: (current is None or c.changed > 0,
                                      max(0.0, MARGIN_LOG2 - c.outcome.margin_log2), c.changed,
                                      _changed(c.outcome.config, default) > 0,
                                      abs(math.log2(c.outcome.config.init_scale / default.init_scale)),
                                      abs(math.log(c.outcome.config.growth_interval / default.growth_interval)),
                                      c.cost))
    pick = chosen.outcome
    cfg = pick.config
    # Steps with a non-finite loss are skipped at any scale: no setting is judged by them.
    forced = int(series.forced.sum())
    skipped_fraction = (pick.skipped_steps - forced) / n if n else 0.0
    clean_exists = any(o.skipped_steps - forced == 0 and o.underflow_rate <= cap for o in outcomes)
    if (skipped_fraction > BAD_SKIPPED or pick.underflow_rate > BAD_UNDERFLOW) and not clean_exists:
        verdict = "no_scale_works"
    elif current is not None and chosen.changed == 0:
        verdict = "keep" if known else "unknown"
    else:
        verdict = "change"
    reasons = _reasons(prepared, current, actual, baseline, pick, settle_step)
    advice = _advice(prepared, verdict, worst_modules or [], hot_activations or [], current, known, outside or [],
                     drift)
    return {
        "init_scale": cfg.init_scale, "growth_factor": cfg.growth_factor, "backoff_factor": cfg.backoff_factor,
        "growth_interval": int(cfg.growth_interval), "target_dtype": prepared.target.name, "verdict": verdict,
        "code": Finding("scaler_code", {"device": device, "settings": cfg.shown_settings(current),
                                        "scaler": scaler_constructor(scaler_class),
                                        "framework": framework if framework in FRAMEWORKS else None}),
        "reasons": reasons, "advice": advice,
        "current": {"skipped_steps": int(actual["skipped_steps"]),
                    **{k: actual[k] for k in ("underflow_rate", "underflow_rate_min", "underflow_rate_max")}},
        "predicted": {"skipped_steps": pick.skipped_steps, **_fields(pick), "uncertain_steps": pick.uncertain_steps},
        "baseline": {"config": base.to_dict(), "skipped_steps": baseline.skipped_steps, **_fields(baseline)},
    }


def _fields(outcome: Outcome) -> dict:
    return underflow_fields(outcome.underflow_rate, outcome.underflow_upper)


def _reasons(prepared: Replay, current, actual, baseline: Outcome, pick: Outcome, settle_step) -> list[Finding]:
    series = prepared.series
    predicted = _fields(pick)
    recorded = {k: actual[k] for k in ("underflow_rate", "underflow_rate_min", "underflow_rate_max")}
    out = []
    if current is None:
        out.append(Finding("replayed_without_loss_scaling", {
            "recorded": series.fmt.name, "target": prepared.target.name, "skipped": baseline.skipped_steps,
            "steps": len(series), "underflow": _fields(baseline)}))
    else:
        median = float(np.median(series.scale))
        if settle_step:
            out.append(Finding("start_up_backoff", {
                "init_scale": current.init_scale, "skipped": settle_step,
                "settled_scale": float(series.scale[min(settle_step, len(series) - 1)])}))
        after_growth = _skips_after_growth(series)
        if after_growth >= 2:
            out.append(Finding("skips_after_growth", {"after_growth": after_growth,
                                                      "skipped": int(series.skipped.sum()),
                                                      "growth_interval": current.growth_interval}))
        if actual["underflow_rate"] is None:
            spread = (actual["underflow_rate_max"] or 0.0) - (actual["underflow_rate_min"] or 0.0)
            drift = min(drift_share(series), spread)
            out.append(Finding("recorded_underflow_range", {"median_scale": median, "underflow": recorded,
                                                            "undecided": spread - drift, "drift": drift}))
        elif actual["underflow_rate"] > 1e-4:
            applied = ~series.skipped
            measured = int((series.measured & applied).sum()) if series.measured is not None else 0
            out.append(Finding("recorded_underflow", {"rate": actual["underflow_rate"], "median_scale": median,
                                                      "measured_steps": measured, "steps": int(applied.sum())}))
    out.append(Finding("overflow_threshold", {"log2": prepared.threshold.log2, "source": prepared.threshold.source}))
    if current is not None and pick.config == current:
        out.append(Finding("current_settings_best", {"skipped": pick.skipped_steps, "underflow": predicted}))
    else:
        out.append(Finding("replay_predicts", {
            "settings": pick.config.shown_settings(current), "skipped": pick.skipped_steps,
            "recorded_skipped": actual["skipped_steps"], "underflow": predicted, "recorded_underflow": recorded,
            "uncertain": pick.uncertain_steps}))
    return out


def _skips_after_growth(series) -> int:
    if len(series) < 2:
        return 0
    grew = np.concatenate([[False], series.scale[1:] > series.scale[:-1]])
    return int((grew & series.skipped & ~series.forced).sum())


def _advice(prepared: Replay, verdict: str, worst: list[str], hot: list[tuple[str, float]], current,
            known: bool, outside: list[str], drift: float = 0.0) -> list[Finding]:
    """``known``: the undecided zeros are few; ``drift``: the share of the elements the steps
    between samples may or may not have lost (calibration.DRIFT_RANGE)."""
    series = prepared.series
    target = prepared.target
    out = []
    for module, peak in hot[:3]:
        out.append(Finding("activation_beyond_format", {"module": module, "peak": peak, "dtype": target.name,
                                                        "dtype_max": target.max}))
    for after in outside[:2]:
        out.append(Finding("overflow_outside_modules", {
            "after": after, "at_model_output": after == ROOT_NAME, "dtype": target.name,
            "settings_fix_it": verdict != "no_scale_works"}))
    if not known and current is not None:
        out.append(Finding("undecided_zeros", {"median_scale": float(np.median(series.scale)),
                                               "settings_changed": verdict == "change"}))
    if drift > BAD_UNDERFLOW:
        out.append(Finding("drift_between_samples", {"drift": drift}))
    if verdict == "no_scale_works":
        good = series.amax[series.amax > 0]
        out.append(Finding("no_scale_fits", {
            "max_skipped": BAD_SKIPPED, "max_underflow": BAD_UNDERFLOW, "dtype": target.name,
            "span_log2": (float(np.log2(good.min())), float(np.log2(good.max()))) if len(good) else None,
            "modules": worst[:3]}))
    # Collapsed: after the start-up backoff the scale fell far below where it settled (or below 1)
    # and the last quarter keeps skipping. Growth that overflows again is not a collapse.
    n = len(series)
    settled = int(np.argmax(~series.skipped | series.forced)) if n and (~series.skipped | series.forced).any() else n
    tail = slice(max(settled, n - max(1, n // 4)), n)
    late = (series.skipped[tail] & ~series.forced[tail]).mean() if tail.start < n else 0.0
    fell = (tail.start < n and series.recorded_scale[tail].max() <= series.recorded_scale[settled] / COLLAPSE_FACTOR)
    if current is not None and settled < n and (series.recorded_scale[settled:].min() < 1.0 or (late > 0.2 and fell)):
        finite = series.l2[(~series.skipped) & np.isfinite(series.l2)]
        out.append(Finding("scale_collapsed", {
            "min_scale": float(series.recorded_scale.min()), "late_skipped": float(late),
            "clip": float(np.percentile(finite, 95)) if len(finite) else None}))  # the 95th percentile norm
    if series.forced.any():
        out.append(Finding("nonfinite_losses", {"steps": int(series.forced.sum()),
                                                "first": int(series.steps[np.argmax(series.forced)])}))
    if verdict == "keep" and not out:
        out.append(Finding("settings_fine"))
    return out
