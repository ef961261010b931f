"""The ``report``, ``simulate`` and ``layers`` data: pure functions of a run, returning plain dicts
in the JSON contracts of DESIGN.md (plus a ``charts`` key for the HTML renderer).

Reads only the columns each part needs: the step rows once, the other rows in one streaming pass
(:func:`~ampdoctor.analysis.layers.scan_layers`), and the rows of anomalous steps for the origins.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ..formats import FLOAT16, FloatFormat, float_format
from ..run import Run, read_run
from ..schema import HIST_BINS, HIST_MIN_EXP
from .layers import LayerScan, layer_records, scan_layers, sort_layers
from .origins import origin_counts
from .recommend import recommend
from .simulate import (Replay, ScalerConfig, StepSeries, actual_outcome, attach_param_lost, load_steps, prepare,
                       recorded_config, replay, underflow_fields, with_defaults)

MAX_ORIGIN_STEPS = 2000   # anomalous steps whose rows are read for the origins (the first ones)
HEATMAP_LAYERS = 40


@dataclass
class Analysis:
    """Everything the three commands share: read once."""

    run: Run
    amp: FloatFormat
    target: FloatFormat
    series: StepSeries
    scan: LayerScan
    prepared: Replay | None
    current: ScalerConfig | None
    level: str

    @property
    def device(self) -> str:
        return (self.run.metadata.get("device") or "cuda").split(":")[0]


def analyse(run: Run | str | os.PathLike) -> Analysis:
    """Read a run and derive the step series, the layer scan and the calibrated replay."""
    run = run if isinstance(run, Run) else read_run(run)
    meta = run.metadata
    amp = _format(meta.get("amp.dtype"))
    min_exp = int(meta.get("hist.min_exp", HIST_MIN_EXP))
    bins = int(meta.get("hist.bins", HIST_BINS))
    scan = scan_layers(run, amp, min_exp=min_exp, bins=bins)
    scan.step_rows = _with_valid_scale(scan.step_rows, run)
    series = load_steps(scan.step_rows, amp, min_exp, bins)
    attach_param_lost(series, scan.param_lost)
    # fp16 is the format a scaler is for: a bf16/fp32 run is asked whether fp16 would work.
    target = amp if amp.name == "float16" else FLOAT16
    enabled = meta.get("scaler.enabled", "true") == "true"
    current = recorded_config(meta, series) if len(series) and enabled and amp.name == target.name else None
    prepared = prepare(series, target, module_ratio=_module_ratio(series, scan)) if len(series) else None
    # The level the run was recorded at; older runs without it: inferred from the rows (module rows
    # of escalated steps then read as "full").
    level = meta.get("record.level") or ("full" if scan.layers["kind"].isin(["output", "grad_output"]).any() else (
        "params" if len(scan.layers) else "steps"))
    return Analysis(run, amp, target, series, scan, prepared, current, level)


def _with_valid_scale(step_rows: pa.Table, run: Run) -> pa.Table:
    """The step rows whose scale is a number (0 included: a collapsed scale); the others (a
    damaged or foreign file) are left out, with a warning."""
    if not step_rows.num_rows:
        return step_rows
    scale = step_rows.column("scale")
    valid = pc.fill_null(pc.and_(pc.is_finite(scale), pc.greater_equal(scale, 0)), False)
    bad = step_rows.num_rows - pc.sum(valid).as_py()
    if bad:
        run.warnings.append(f"left out {bad} step row(s) whose scale is not a number")
        step_rows = step_rows.filter(valid)
    return step_rows


def _format(name: str | None) -> FloatFormat:
    try:
        return float_format(name) if name else FLOAT16
    except ValueError:
        return FLOAT16


def _module_ratio(series: StepSeries, scan: LayerScan) -> float | None:
    """The largest ratio of a module output gradient to the parameter gradients on a good step."""
    if scan.module_peak.empty or not len(series):
        return None
    step_amax = pd.Series(series.amax, index=series.steps)[~series.skipped]
    ratio = (scan.module_peak / step_amax.where(step_amax > 0)).dropna()
    ratio = ratio[np.isfinite(ratio)]
    return float(ratio.max()) if len(ratio) else None


def scale_history(series: StepSeries) -> dict | None:
    n = len(series)
    if not n:
        return None
    skipped = series.skipped
    settle = int(np.argmax(~skipped)) if (~skipped).any() else None
    scale = series.recorded_scale
    return {"initial": float(scale[0]), "final": float(scale[-1]), "min": float(scale.min()),
            "max": float(scale.max()), "skipped_steps": int(skipped.sum()),
            "skipped_fraction": float(skipped.mean()),
            "settle_step": int(series.steps[settle]) if settle is not None else None}


def rank_origins(analysis: Analysis, warnings: list[str]) -> list[dict]:
    """Overflow origins by frequency: per anomalous step, the overflow origin, or the forward origin
    when the loss itself was non-finite."""
    s = analysis.series
    anomalous = s.steps[s.skipped | s.forced | s.nonfinite]
    if not len(anomalous):
        return []
    if len(anomalous) > MAX_ORIGIN_STEPS:
        warnings.append(f"origins are from the first {MAX_ORIGIN_STEPS} of {len(anomalous)} anomalous steps")
        anomalous = anomalous[:MAX_ORIGIN_STEPS]
    origins = origin_counts(analysis.run, anomalous.tolist())
    named = sum(o["count"] for o in origins)
    if origins and named < len(anomalous):
        warnings.append(f"{len(anomalous) - named} of the {len(anomalous)} anomalous steps have no origin: their "
                        f"rows do not show where the first non-finite value appeared (no module rows at those "
                        f"steps, a value received from another rank, or several non-finite parameter gradients "
                        f"with no module order to tell which came first)")
    return origins


def rank_disagreement(step_rows: pa.Table) -> str | None:
    """A warning when ranks skipped different steps, or None. Every rank's scaler must reach the
    same ``found_inf``: DDP all-reduces the gradients and ShardedGradScaler all-reduces
    ``found_inf``; a scaler that sees only its own gradients can skip a step the others take."""
    if step_rows.num_rows == 0:
        return None
    frame = step_rows.select(["step", "rank", "skipped"]).to_pandas()
    if frame["rank"].nunique() < 2:
        return None
    per_step = frame.groupby("step")["skipped"].agg(["any", "all"])
    split = per_step.index[per_step["any"] & ~per_step["all"]]
    if not len(split):
        return None
    return (f"ranks disagree on found_inf at {len(split)} step(s) (first: step {int(split[0])}): some ranks "
            f"skipped the optimizer step and others did not, so their weights and loss scales diverge, and a "
            f"collective inside step() can deadlock. Each rank's scaler saw only its own gradients: let DDP "
            f"all-reduce the gradients before step(), or use ShardedGradScaler with FSDP, which all-reduces "
            f"found_inf")


def build_report(run: Run | str | os.PathLike) -> dict:
    """``ampdoctor report``'s data (DESIGN.md contract, plus ``missing`` and ``charts``)."""
    a = analyse(run)
    warnings = list(a.run.warnings)
    missing: dict[str, str] = {}
    if not a.run.ended_cleanly:
        warnings.append("the run did not end with close() (killed, crashed or still running): "
                        "this report covers the steps on disk")
    scale = scale_history(a.series)
    if scale is None:
        missing["scale"] = "not enough data: the run has no step rows"
    layers = sort_layers(a.scan.layers) if not a.scan.empty else a.scan.layers
    if a.scan.empty:
        missing["layers"] = ("not enough data: the run was recorded at level='steps' (no per-parameter rows); "
                             "record with level='params' (the default) or level='full'")
    origins = rank_origins(a, warnings) if len(a.series) else []
    disagreement = rank_disagreement(a.scan.step_rows)
    if disagreement:
        warnings.append(disagreement)
    if scale and scale["skipped_steps"] and not origins:
        missing["overflow_origins"] = ("no origin could be named: the skipped steps have no module rows; record "
                                       "with level='full' (or keep escalate_steps > 0) to see where overflows start")
    recommendation = None
    actual = actual_outcome(a.series, a.current) if len(a.series) else None
    if a.prepared is None or len(a.series) < 2:
        missing["recommendation"] = "not enough data: a recommendation needs at least 2 recorded steps"
    else:
        worst = _worst_modules(origins, layers)
        hot = _hot_activations(a)
        outside = list(dict.fromkeys(o["after"] for o in origins if o.get("after")))  # once per module, not per rank
        recommendation = recommend(a.prepared, a.current, actual, device=a.device,
                                   settle_step=_settle_count(a.series), worst_modules=worst,
                                   hot_activations=hot, outside=outside)
        warnings.extend(a.prepared.notes)
    return {
        "run": _run_info(a),
        "scale": scale,
        "layers": layer_records(layers),
        "overflow_origins": origins,
        "recommendation": recommendation,
        "warnings": warnings,
        "missing": missing,
        "charts": _charts(a, layers),
    }


def _settle_count(series: StepSeries) -> int:
    """Steps skipped in a row from the first one (start-up backoff; non-finite losses aside)."""
    good = ~series.skipped | series.forced
    return int(np.argmax(good)) if good.any() else len(series)


def _worst_modules(origins: list[dict], layers: pd.DataFrame) -> list[str]:
    names = [o["name"] for o in origins if not o["name"].startswith("(")]
    if not names and len(layers):
        worst = layers.sort_values("headroom_log2", na_position="last").head(3)
        names = [_module_of(n) if k == "param_grad" else n for n, k in zip(worst["name"], worst["kind"])]
    return list(dict.fromkeys(names))


def _module_of(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else param


def _hot_activations(a: Analysis) -> list[tuple[str, float]]:
    """Modules whose (finite) activations exceed the target format's max."""
    peaks = a.scan.activation_peak
    if peaks.empty:
        return []
    # Only outputs that live in a 16-bit format (the run's, or fp16 itself): an fp32 output is safe.
    low_precision = peaks["dtype"].isin({a.target.name, a.amp.name} - {"float32", "float64"})
    hot = peaks[(peaks["amax"] > a.target.max) & low_precision].sort_values("amax", ascending=False)
    return [(str(n), float(v)) for n, v in zip(hot.index, hot["amax"])]


def _run_info(a: Analysis) -> dict:
    meta = a.run.metadata

    def num(key):
        try:
            v = float(meta[key])
        except (KeyError, ValueError):
            return None
        return int(v) if v.is_integer() and key.endswith("interval") else v

    return {"path": str(a.run.path), "steps": int(len(a.series)), "ranks": int(a.series.ranks) if len(a.series)
            else 0, "amp_dtype": a.amp.name, "device": meta.get("device"),
            "scaler": {"class": meta.get("scaler.class"), "init_scale": num("scaler.init_scale"),
                       "growth_factor": num("scaler.growth_factor"), "backoff_factor": num("scaler.backoff_factor"),
                       "growth_interval": num("scaler.growth_interval")},
            "level": a.level, "ended_cleanly": a.run.ended_cleanly}


def _charts(a: Analysis, layers: pd.DataFrame) -> dict:
    s = a.series
    fmt = a.amp
    heatmap = None
    names = [n for n in layers.loc[layers["kind"] == "param_grad", "name"] if n in a.scan.heatmap][:HEATMAP_LAYERS] \
        if len(layers) else []
    if names:
        heatmap = {"names": names, "steps": [int(x) for x in a.scan.heatmap_steps],
                   "high": [_floats(a.scan.heatmap[n][0]) for n in names],
                   "low": [_floats(a.scan.heatmap[n][1]) for n in names]}
    return {"steps": [int(x) for x in s.steps], "scale": [float(x) for x in s.scale],
            "skipped": [bool(x) for x in s.skipped],
            "format": {"name": fmt.name, "max_log2": math.log2(fmt.max), "underflow_log2": math.log2(fmt.underflow_below),
                       "subnormal_log2": math.log2(fmt.smallest_subnormal),
                       "normal_log2": math.log2(fmt.smallest_normal)},
            "heatmap": heatmap}


def _floats(values: np.ndarray) -> list[float | None]:
    return [float(v) if np.isfinite(v) else None for v in values]


def simulate_run(run: Run | str | os.PathLike, **settings) -> dict:
    """``ampdoctor simulate``'s data: the replay of one configuration next to what the run did.
    ``settings``: init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
    max_scale; the ones not given are the run's own (torch's defaults for a run without scaling)."""
    a = analyse(run)
    if a.prepared is None or not len(a.series):
        from ..errors import RunError
        raise RunError(f"{a.run.path}: not enough data to simulate: the run has no step rows")
    config = with_defaults(a.current, **settings)
    outcome = replay(a.prepared, [config], keep_trajectory=True)[0]
    n = len(a.series)
    result = {"config": config.to_dict(), "target_dtype": a.target.name, "steps": n}
    result.update({k: v for k, v in outcome.to_dict(n).items() if k != "config"})
    result["actual"] = actual_outcome(a.series, a.current)
    result["threshold"] = a.prepared.threshold.to_dict()
    result["layers"] = _predicted_layers(a, outcome)
    result["notes"] = list(a.prepared.notes) + list(a.run.warnings)
    return result


def _predicted_layers(a: Analysis, outcome) -> list[dict]:
    """Per parameter: the underflow predicted at the simulated scale of its sampled steps, as a
    range where the record leaves zeros undecided (see :mod:`~ampdoctor.analysis.simulate`)."""
    from .layers import _hist_matrix
    from .underflow import UnderflowModel, underflow_bounds

    columns = ["step", "kind", "name", "scale", "numel", "n_zero", "n_subnormal", "n_nan", "n_inf", "hist",
               "n_zero_lines"]
    table = a.run.table(columns, kinds=["param_grad"])
    if not table.num_rows:
        return []
    table = table.filter(table.column("n_zero").is_valid())
    bins = a.series.hist.shape[1] if len(a.series) else HIST_BINS
    hist = _hist_matrix(table.column("hist").combine_chunks(), bins)
    frame = table.drop_columns(["hist"]).to_pandas()
    frame["name"] = frame["name"].astype(str)
    finite = (frame["n_nan"].fillna(0) + frame["n_inf"].fillna(0)).to_numpy() == 0  # overflowed rows: not judged
    scale = frame["scale"].to_numpy(dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        cut = np.log2(a.amp.underflow_below / np.where(scale > 0, scale, np.nan))
        estimate, upper = underflow_bounds(hist, frame["n_zero"].to_numpy(dtype=np.float64),
                                           frame["n_subnormal"].to_numpy(dtype=np.float64), cut, a.series.min_exp,
                                           frame["n_zero_lines"].to_numpy(dtype=np.float64, na_value=np.nan))
        model = UnderflowModel(hist, np.nan_to_num(cut, nan=0.0), np.nan_to_num(estimate, nan=0.0), a.series.min_exp)
        log2s = pd.Series(outcome.trajectory, index=a.series.steps).reindex(frame["step"]).to_numpy()
        lost = model.lost(np.log2(a.target.underflow_below) - log2s)
    frame["lost"] = np.where(finite, np.where(np.isnan(estimate), np.nan, lost), 0.0)  # NaN: 0 everywhere
    frame["upper"] = np.where(finite, np.nan_to_num(lost) + upper - np.nan_to_num(estimate), 0.0)
    frame["numel"] = np.where(finite, frame["numel"], 0)
    by = frame.groupby("name").agg(lost=("lost", lambda c: c.sum(min_count=len(c))), upper=("upper", "sum"),
                                   numel=("numel", "sum"))
    numel = by["numel"].clip(lower=1)
    by["underflow_rate"] = by["lost"] / numel
    by["underflow_rate_max"] = by["upper"] / numel
    by = by.sort_values(["underflow_rate_max", "underflow_rate"], ascending=False, na_position="first")
    return [{"name": n, "kind": "param_grad", **underflow_fields(r["underflow_rate"], r["underflow_rate_max"])}
            for n, r in by.iterrows()]


def layers_report(run: Run | str | os.PathLike, sort: str = "underflow", top: int | None = None) -> dict:
    """``ampdoctor layers``'s data."""
    a = analyse(run)
    if a.scan.empty:
        return {"sort": sort, "layers": [], "missing": "not enough data: the run was recorded at level='steps'; "
                                                       "record with level='params' or level='full'"}
    layers = sort_layers(a.scan.layers, sort)
    if top is not None:
        layers = layers.head(top)
    return {"sort": sort, "layers": layer_records(layers), "missing": None}
