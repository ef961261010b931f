"""``ampdoctor report``'s data: what happened to the loss scale, the layers, where overflows came
from, and the recommended scaler settings; a pure function of a run (:func:`report_data`),
returning the ``report`` JSON contract of ``docs/json-contracts.md`` (with findings for its
sentences, and a ``charts`` key for the HTML renderer).

The rows of the anomalous steps are read for the origins; the rest comes from :func:`analyse`.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pandas as pd
import pyarrow as pa

from ..read.run import Run
from ..run_file.schema import SCALER_META, META_DEVICE, META_SCALER_CLASS, META_SCALER_FRAMEWORK, meta_number
from .findings import Finding
from .layers import layer_records, module_type, module_types, sort_layers
from .origins import origin_counts
from .recommend import recommend, replayed
from .replay import actual_outcome
from .run_analysis import Analysis, analyse
from .steps import StepSeries

MAX_ORIGIN_STEPS = 2000   # anomalous steps whose rows are read for the origins (the first ones)
HEATMAP_LAYERS = 40


def report_data(run: Run | Analysis) -> dict:
    """``ampdoctor report``'s data (the contract, plus ``charts``); from a run, or from its
    :class:`Analysis` when the caller has one (``compare``)."""
    a = run if isinstance(run, Analysis) else analyse(run)
    warnings = list(a.warnings)
    missing: dict[str, Finding] = {}
    if not a.run.ended_cleanly:
        warnings.append(Finding("report_of_unclosed_run"))
    scale = scale_history(a.series)
    if scale is None:
        missing["scale"] = Finding("no_step_rows")
    layers = sort_layers(a.scan.layers) if not a.scan.empty else a.scan.layers
    if a.scan.empty:
        missing["layers"] = Finding("no_layer_rows")
    # The origins' rows are a query of the engine (its own threads, the GIL released): the scaler
    # candidates are replayed meanwhile (recommend's bulk, which needs the origins only for advice).
    found: list = []
    origins_job = _Background(rank_origins, a, found) if len(a.series) else None
    replays = replayed(a.prepared, a.current) if a.prepared is not None and len(a.series) >= 2 else None
    origins = origins_job.result() if origins_job is not None else []
    warnings.extend(found)
    disagreement = rank_disagreement(a.scan.step_rows)
    if disagreement:
        warnings.append(disagreement)
    if scale and scale["skipped_steps"] and not origins:
        missing["overflow_origins"] = Finding("skips_without_module_rows")
    recommendation = None
    actual = actual_outcome(a.series, a.current) if len(a.series) else None
    if a.prepared is None or len(a.series) < 2:
        missing["recommendation"] = Finding("too_few_steps_to_recommend", {"needed": 2})
    else:
        worst = _worst_modules(origins, layers)
        hot = _hot_activations(a)
        outside = list(dict.fromkeys(o["after"] for o in origins if o.get("after")))  # once per module, not per rank
        recommendation = recommend(a.prepared, a.current, actual, device=a.device,
                                   settle_step=_settle_count(a.series), worst_modules=worst,
                                   hot_activations=hot, outside=outside,
                                   scaler_class=a.run.metadata.get(META_SCALER_CLASS),
                                   framework=a.run.metadata.get(META_SCALER_FRAMEWORK), outcomes=replays)
        warnings.extend(a.prepared.notes)
    return {
        "run": _run_info(a),
        "scale": scale,
        "layers": layer_records(layers, module_types(a.run)),
        "overflow_origins": origins,
        "recommendation": recommendation,
        "warnings": warnings,
        "missing": missing,
        "charts": _charts(a, layers),
    }


class _Background:
    """``fn(*args)`` on a daemon thread: an interrupted caller (Ctrl-C during the replay) leaves
    without waiting for it, and so does the interpreter at exit. :meth:`result` waits for it and
    raises its error, if any."""

    def __init__(self, fn, *args) -> None:
        self._outcome: list = []
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="ampdoctor-origins", daemon=True)
        self._thread.start()

    def _run(self, fn, args) -> None:
        try:
            self._outcome.append((True, fn(*args)))
        except BaseException as exc:  # (raised again in the caller)
            self._outcome.append((False, exc))

    def result(self):
        self._thread.join()
        ok, value = self._outcome[0]
        if not ok:
            raise value
        return value


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


def rank_origins(analysis: Analysis, warnings: list) -> list[dict]:
    """Overflow origins by frequency: per anomalous step, the overflow origin, or the forward origin
    when the loss itself was non-finite."""
    s = analysis.series
    anomalous = s.steps[s.skipped | s.forced | s.nonfinite]
    if not len(anomalous):
        return []
    if len(anomalous) > MAX_ORIGIN_STEPS:
        warnings.append(Finding("origins_of_first_steps", {"read": MAX_ORIGIN_STEPS, "anomalous": len(anomalous)}))
        anomalous = anomalous[:MAX_ORIGIN_STEPS]
    origins = origin_counts(analysis.run, anomalous.tolist())
    named = sum(o["count"] for o in origins)
    if origins and named < len(anomalous):
        warnings.append(Finding("steps_without_origin", {"unnamed": len(anomalous) - named,
                                                         "anomalous": len(anomalous)}))
    return origins


def rank_disagreement(step_rows: pa.Table) -> Finding | None:
    """Whether ranks skipped different steps. Every rank's scaler must reach the same
    ``found_inf``: DDP all-reduces the gradients and ShardedGradScaler all-reduces ``found_inf``;
    a scaler that sees only its own gradients can skip a step the others take."""
    if step_rows.num_rows == 0:
        return None
    frame = step_rows.select(["step", "rank", "skipped"]).to_pandas()
    if frame["rank"].nunique() < 2:
        return None
    per_step = frame.groupby("step")["skipped"].agg(["any", "all"])
    split = per_step.index[per_step["any"] & ~per_step["all"]]
    if not len(split):
        return None
    return Finding("ranks_disagree_on_found_inf", {"steps": len(split), "first": int(split[0])})


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
    # The contract's types: the scale and factors as floats, the interval as an int where integral.
    scaler = {key: meta_number(meta.get(meta_key)) for key, meta_key in SCALER_META.items()}
    scaler = {key: float(v) if v is not None and key != "growth_interval" else v for key, v in scaler.items()}
    return {"path": str(a.run.path), "steps": int(len(a.series)), "ranks": int(a.series.ranks) if len(a.series)
            else 0, "amp_dtype": a.amp.name, "device": meta.get(META_DEVICE),
            "scaler": {"class": meta.get(META_SCALER_CLASS), **scaler},
            "level": a.level, "ended_cleanly": a.run.ended_cleanly}


def _charts(a: Analysis, layers: pd.DataFrame) -> dict:
    s = a.series
    fmt = a.amp
    heatmap = None
    names = [n for n in layers.loc[layers["kind"] == "param_grad", "name"] if n in a.scan.heatmap][:HEATMAP_LAYERS] \
        if len(layers) else []
    if names:
        types = module_types(a.run)
        heatmap = {"names": names, "types": [module_type(n, "param_grad", types) for n in names],
                   "steps": [int(x) for x in a.scan.heatmap_steps],
                   "high": [_floats(a.scan.heatmap[n][0]) for n in names],
                   "low": [_floats(a.scan.heatmap[n][1]) for n in names]}
    return {"steps": [int(x) for x in s.steps], "scale": [float(x) for x in s.scale],
            "skipped": [bool(x) for x in s.skipped],
            "format": {"name": fmt.name, "max_log2": math.log2(fmt.max), "underflow_log2": math.log2(fmt.underflow_below),
                       "subnormal_log2": math.log2(fmt.smallest_subnormal),
                       "normal_log2": math.log2(fmt.smallest_normal)},
            "heatmap": heatmap}


def _floats(values: np.ndarray) -> list[float | None]:
    """A heatmap row: None where nothing was recorded; -inf (log2 of 0) where every element was
    zero, which the chart draws as flushed to zero."""
    return [float(v) if np.isfinite(v) or v == -np.inf else None for v in values]
