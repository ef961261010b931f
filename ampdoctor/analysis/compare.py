"""``ampdoctor compare``'s data: two runs side by side (:func:`compare_data`), and whether the
first run's recommendation, applied in the second, did what its replay predicted.

Each run is read once by :func:`~ampdoctor.analysis.run_analysis.analyse` and reported by
:func:`~ampdoctor.analysis.report.report_data`: its skipped steps, scale range, recorded settings,
recommendation and layers are exactly the report's, so ``compare`` cannot disagree with
``report``.

**The prediction check.** It applies when run B's recorded GradScaler settings are the ones run
A's report recommended: ``init_scale``, ``growth_factor`` and ``backoff_factor`` equal within a
relative :data:`SETTING_TOLERANCE` (a float written out and parsed back), ``growth_interval``
exactly. Otherwise the settings that differ are listed and there is no verdict. The prediction
*held* when both parts hold:

* **skipped steps**: A's replay predicted ``p`` skipped steps, and ``u`` more it could not decide
  (``uncertain_steps``), over A's steps; B's skipped steps must lie in ``p - 1 .. p + u + 1``
  (:data:`SKIPPED_SLACK_STEPS`): one step more or less is noise (training takes another path once a
  step is not skipped). The slack does not grow with the run: 0 predicted and 200 got is a miss
  however long the run.
* **underflow**: B's recorded underflow range (``underflow_rate_min`` .. ``underflow_rate_max``)
  overlaps the predicted range or is within :data:`UNDERFLOW_SLACK` (0.1 percentage points) of
  it. When either range is unknown this part is null and does not decide.

There is no verdict (and the status says why) when the runs trained for different numbers of steps
(skips are not spread evenly: the start-up backoff skips a fixed number at the start, so no scaling
of the prediction is right), when either run is not float16 (the replay predicts float16 loss
scaling; a bf16 run's scaler settings mean nothing for it), or in different formats. The check
assumes run B is run A's training again with new settings; it cannot tell another model or data.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import RunError
from ..read.run import Run
from .contract_fields import finite_or_none
from .findings import Finding
from .replay import actual_outcome
from .report import report_data
from .run_analysis import Analysis, analyse
from .scaler_config import TORCH_SETTINGS

SETTINGS = TORCH_SETTINGS      # GradScaler's four keywords
SETTING_TOLERANCE = 1e-6       # relative: 65536.0 and 65536.00000001 are the same setting
SKIPPED_SLACK_STEPS = 1        # skipped steps within this many of the prediction hold
REPLAY_FORMAT = "float16"      # the format the replay predicts for (analysis/run_analysis.py's target)
UNDERFLOW_SLACK = 1e-3         # underflow ranges this close (0.1 percentage points) hold
UNDERFLOW_KEYS = ("underflow_rate", "underflow_rate_min", "underflow_rate_max")

def compare_data(run_a: Run, run_b: Run) -> dict:
    """``ampdoctor compare``'s data (the ``compare`` contract of docs/json-contracts.md, with
    findings for its sentences, and a ``charts`` key for the HTML renderer)."""
    a, report_a = _read(run_a)
    b, report_b = _read(run_b)
    side_a, side_b = _side(a, report_a), _side(b, report_b)
    warnings: list = []
    if a.amp.name == b.amp.name == REPLAY_FORMAT:
        prediction = _prediction(side_a, side_b)
    elif a.amp.name == b.amp.name:  # bf16 or fp32: no loss scaling to check
        prediction = {**_no_check("not_float16"), "finding": Finding("compare_not_float16", {"dtype": a.amp.name})}
    else:  # underflow and headroom mean other things in another format; so does the replay's prediction
        different = Finding("compare_different_formats", {"a": a.amp.name, "b": b.amp.name})
        prediction = {**_no_check("not_comparable"), "finding": different}
        warnings.append(different)
    for name, report in (("A", report_a), ("B", report_b)):
        warnings += [Finding("warning_of_run", {"run": name, "warning": w}) for w in report["warnings"]]
    change = _change(side_a, side_b)
    summary = [Finding("compare_skipped", {"a": side_a["skipped_steps"], "b": side_b["skipped_steps"],
                                           "steps_a": side_a["steps"], "steps_b": side_b["steps"]}),
               Finding("compare_underflow", {"a": _underflow(side_a), "b": _underflow(side_b)}),
               prediction["finding"]]
    return {"a": side_a, "b": side_b, "change": change, "prediction": prediction, "summary": summary,
            "layers": join_layers(report_a["layers"], report_b["layers"]), "warnings": warnings,
            "charts": {"a": _curves(a), "b": _curves(b)}}


def _read(run: Run) -> tuple[Analysis, dict]:
    a = analyse(run)
    if not len(a.series):
        raise RunError(f"{run.path}: not enough data to compare: the run has no step rows")
    return a, report_data(a)


def _side(a: Analysis, report: dict) -> dict:
    """One run's column of the comparison."""
    run, scale, rec = report["run"], report["scale"], report["recommendation"]
    actual = actual_outcome(a.series, a.current)
    finite = np.isfinite(a.series.loss)
    return {
        "path": run["path"], "steps": run["steps"], "ranks": run["ranks"], "amp_dtype": run["amp_dtype"],
        "device": run["device"], "level": run["level"], "scaler": run["scaler"],
        "loss_scaling": a.current is not None,
        "skipped_steps": scale["skipped_steps"], "skipped_fraction": scale["skipped_fraction"],
        "settle_step": scale["settle_step"],
        **{k: actual[k] for k in UNDERFLOW_KEYS},
        "scale": {k: scale[k] for k in ("initial", "final", "min", "max")},
        "final_loss": finite_or_none(a.series.loss[finite][-1]) if finite.any() else None,
        "recommendation": None if rec is None else {
            **{k: rec[k] for k in SETTINGS}, "verdict": rec["verdict"], "code": rec["code"],
            "predicted": dict(rec["predicted"])},
    }


def _underflow(side: dict) -> dict:
    return {k: side[k] for k in UNDERFLOW_KEYS}


def _change(a: dict, b: dict) -> dict:
    """B minus A."""
    def log2(x):
        return math.log2(x) if x else None

    return {"skipped_steps": b["skipped_steps"] - a["skipped_steps"],
            "skipped_fraction": b["skipped_fraction"] - a["skipped_fraction"],
            "underflow_rate_min": _b_minus_a(a["underflow_rate_min"], b["underflow_rate_min"]),
            "underflow_rate_max": _b_minus_a(a["underflow_rate_max"], b["underflow_rate_max"]),
            "final_scale_log2": _b_minus_a(log2(a["scale"]["final"]), log2(b["scale"]["final"]))}


def _b_minus_a(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


# -- the prediction check ------------------------------------------------------------------------

def recorded_settings(side: dict) -> dict:
    """The four GradScaler settings a run recorded: null where its metadata has none, and all
    null when it trained without loss scaling (a disabled scaler keeps its settings unused)."""
    return {k: side["scaler"].get(k) if side["loss_scaling"] else None for k in SETTINGS}


def setting_differences(recommended: dict, recorded: dict) -> list[dict]:
    """The settings in which ``recorded`` is not ``recommended``: ``growth_interval`` exactly,
    the others within :data:`SETTING_TOLERANCE`."""
    out = []
    for key in SETTINGS:
        want, got = recommended[key], recorded.get(key)
        same = got is not None and (want == got if key == "growth_interval"
                                    else math.isclose(want, got, rel_tol=SETTING_TOLERANCE))
        if not same:
            out.append({"setting": key, "recommended": want, "recorded": got})
    return out


def _no_check(status: str) -> dict:
    return {"status": status, "recommended": None, "recorded": None, "differences": [], "held": None,
            "skipped": None, "underflow": None}


def _prediction(a: dict, b: dict) -> dict:
    rec = a["recommendation"]
    if rec is None:
        return {**_no_check("no_recommendation"), "finding": Finding("compare_no_recommendation")}
    recommended = {k: rec[k] for k in SETTINGS}
    recorded = recorded_settings(b)
    differences = setting_differences(recommended, recorded)
    base = {"recommended": recommended, "recorded": recorded, "differences": differences}
    if differences:
        return {**_no_check("settings_differ"), **base,
                "finding": Finding("compare_settings_differ", {"differences": differences})}
    if a["steps"] != b["steps"]:
        return {**_no_check("steps_differ"), **base,
                "finding": Finding("compare_steps_differ", {"a": a["steps"], "b": b["steps"]})}
    skipped = check_skipped(rec["predicted"], b["skipped_steps"])
    underflow = check_underflow(rec["predicted"], _underflow(b))
    held = skipped["held"] and underflow["held"] is not False
    return {"status": "checked", **base, "held": held, "skipped": skipped, "underflow": underflow,
            "finding": (Finding("prediction_held", {"skipped": skipped, "underflow": underflow}) if held
                        else Finding("prediction_missed", {"skipped": skipped, "underflow": underflow}))}


def check_skipped(predicted: dict, got: int) -> dict:
    """Whether ``got`` skipped steps match the ``predicted`` ones over as many steps (the rule in
    the module's docstring)."""
    low = float(predicted["skipped_steps"])
    high = float(predicted["skipped_steps"] + predicted.get("uncertain_steps", 0))
    tolerance = float(SKIPPED_SLACK_STEPS)
    return {"predicted": int(predicted["skipped_steps"]), "uncertain": int(predicted.get("uncertain_steps", 0)),
            "expected_min": low, "expected_max": high, "tolerance": tolerance, "got": int(got),
            "held": bool(low - tolerance <= got <= high + tolerance)}


def check_underflow(predicted: dict, got: dict) -> dict:
    """Whether the recorded underflow range ``got`` overlaps the ``predicted`` one or lies within
    :data:`UNDERFLOW_SLACK` of it; ``held`` and ``gap`` are None when a range is unknown."""
    p_low, p_high = predicted.get("underflow_rate_min"), predicted.get("underflow_rate_max")
    g_low, g_high = got.get("underflow_rate_min"), got.get("underflow_rate_max")
    gap = None if None in (p_low, p_high, g_low, g_high) else max(0.0, g_low - p_high, p_low - g_high)
    return {"predicted": {k: predicted.get(k) for k in UNDERFLOW_KEYS}, "got": dict(got), "gap": gap,
            "tolerance": UNDERFLOW_SLACK, "held": None if gap is None else bool(gap <= UNDERFLOW_SLACK)}


# -- layers ----------------------------------------------------------------------------------------

LAYER_FIELDS = ("underflow_rate", "underflow_rate_max", "headroom_log2")


def join_layers(layers_a: list[dict], layers_b: list[dict]) -> list[dict]:
    """The report's layers of both runs joined by (name, kind), with B's change from A; worst
    change first (the largest rise in underflow, then the largest loss of headroom), then the
    layers only run A has, then those only run B has."""
    index_a = {(r["name"], r["kind"]): r for r in layers_a}
    index_b = {(r["name"], r["kind"]): r for r in layers_b}
    out = []
    for key in list(index_a) + [k for k in index_b if k not in index_a]:
        ra, rb = index_a.get(key), index_b.get(key)
        fa = {f: ra[f] for f in LAYER_FIELDS} if ra else None
        fb = {f: rb[f] for f in LAYER_FIELDS} if rb else None
        change = {f"{f.removesuffix('_log2')}_change": _minus(fa, fb, f) for f in LAYER_FIELDS}
        out.append({"name": key[0], "kind": key[1], "type": (ra or {}).get("module_type") or (rb or {}).get("module_type"),
                    "in": "both" if ra and rb else "a" if ra else "b",
                    "a": fa, "b": fb, "underflow_change": change["underflow_rate_change"],
                    "underflow_max_change": change["underflow_rate_max_change"],
                    "headroom_change": change["headroom_change"]})
    return sorted(out, key=_worst_first)


def _minus(a: dict | None, b: dict | None, field: str) -> float | None:
    return _b_minus_a(a[field] if a else None, b[field] if b else None)


def _worst_first(layer: dict) -> tuple:
    rise = layer["underflow_change"] if layer["underflow_change"] is not None else layer["underflow_max_change"]
    lost = layer["headroom_change"]
    return (layer["in"] != "both", layer["in"], rise is None, -(rise or 0.0), lost is None, lost or 0.0, layer["name"],
            layer["kind"])


# -- charts ----------------------------------------------------------------------------------------

def _curves(a: Analysis) -> dict:
    """The step series the HTML charts draw: scale, skipped steps, loss and gradient norm."""
    s = a.series
    return {"steps": [int(x) for x in s.steps], "scale": [float(x) for x in s.recorded_scale],
            "skipped": [bool(x) for x in s.skipped], "loss": [finite_or_none(x) for x in s.loss],
            "grad_norm": [finite_or_none(x) for x in s.l2]}
