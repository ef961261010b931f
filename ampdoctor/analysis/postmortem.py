"""``ampdoctor postmortem``'s data (:func:`postmortem_data`): the first non-finite event of a run
(:mod:`~ampdoctor.analysis.nonfinite_event`), its cause and where it started
(:mod:`~ampdoctor.analysis.nonfinite_cause`), the steps that led there, and what to change
(:mod:`~ampdoctor.analysis.postmortem_advice`). A pure function of the run's rows.

A run with no event is ``healthy``; when it skipped :data:`NOTE_SKIPPED_FRACTION` of its steps or
lost :data:`NOTE_UNDERFLOW_RATE` of its gradient elements to underflow, its advice points at
``ampdoctor report``, which explains both.
"""

from __future__ import annotations


import numpy as np
import pandas as pd

from ..read.engine import steps_rows
from ..read.run import Run, to_frame
from ..run_file.schema import MODULE_KINDS
from .contract_fields import finite_or_none, float_or_nonfinite
from .findings import Finding
from .nonfinite_cause import classify
from .nonfinite_event import Event, first_event
from .origins import nonfinite_rows, rows_at
from .postmortem_advice import advice
from .replay import actual_outcome
from .event_context import EventContext, event_context
from .run_analysis import Analysis, analyse

TIMELINE_STEPS = 10          # steps before the event in the timeline
# A run with no non-finite event can still train badly. These are the fractions at which
# `ampdoctor report` recommends other scaler settings (recommend.BAD_SKIPPED, BAD_UNDERFLOW): a
# dynamic scaler that fits the model skips about one step per growth interval (2000 by default)
# after start-up, and loses far under 1% of the gradient elements below float16's smallest
# subnormal; above these the healthy verdict points at `report`.
NOTE_SKIPPED_FRACTION = 0.05
NOTE_UNDERFLOW_RATE = 0.01



def postmortem_data(run: Run) -> dict:
    """``ampdoctor postmortem``'s data (the ``postmortem`` contract of docs/json-contracts.md).

    A run with an event is read narrowly: its step rows, parameter checks and largest activations
    (:mod:`.event_context`), then the rows of the few steps the diagnosis names; a run without one
    is analysed whole, since its evidence is the run's underflow (:func:`.run_analysis.analyse`)."""
    context = event_context(run)
    if context is not None:
        steps, params = _per_rank_steps(context.step_rows), _param_frame(context.param_rows)
        event = first_event(steps, params)
        if event is not None:
            return _postmortem(context, steps, params, event, context.steps)
    a = analyse(run)
    steps = _per_rank_steps(a.scan.step_rows)
    params = _param_rows(a.run)
    return _postmortem(a, steps, params, first_event(steps, params), len(a.series))


def _postmortem(a: Analysis | EventContext, steps: pd.DataFrame, params: pd.DataFrame, event: Event | None,
                n_steps: int) -> dict:
    """The contract from a run's reading (the whole analysis, or the narrow one where there is an
    event: ``_health`` reads the analysis, which only a run without an event needs)."""
    notes: list[Finding | str] = list(a.warnings)  # segments skipped, values ignored: what it could not see
    if not a.run.ended_cleanly:
        notes.append(Finding("postmortem_of_unclosed_run"))
    run_info = {"path": str(a.run.path), "steps": int(n_steps), "ranks": int(steps["rank"].nunique()),
                "level": a.level, "ended_cleanly": a.run.ended_cleanly}
    if event is None:
        evidence, health = _health(a)
        return {"status": "healthy", "first_nonfinite_step": None, "cause": None, "origin": None,
                "event": None, "evidence": evidence, "timeline": [], "advice": health, "notes": notes,
                "run": run_info}
    rows = rows_at(a.run, [event.step])
    diagnosis = classify(a, steps, params, event, rows, notes)
    has_module_rows = bool(rows["kind"].isin(MODULE_KINDS).any())
    return {"status": "nonfinite", "first_nonfinite_step": event.step, "cause": diagnosis.cause,
            "origin": diagnosis.origin,
            "event": {"step": event.step, "rank": event.rank, "kind": event.kind,
                      "description": event.description},
            "evidence": diagnosis.evidence, "timeline": _timeline(a, steps, event),
            "advice": advice(diagnosis.cause, diagnosis.origin, diagnosis.evidence, has_module_rows=has_module_rows,
                             recorded_full=a.recorded_full, path=str(a.run.path)),
            "notes": notes, "run": run_info}


# What the diagnosis reads of each rank's step rows (a run of 1,024 ranks has millions of them:
# the other columns are not converted).
_PER_RANK_COLUMNS = ["step", "rank", "scale", "skipped", "loss", "amax", "l2", "n_nan", "n_inf"]


def _per_rank_steps(step_rows) -> pd.DataFrame:
    frame = to_frame(step_rows.select(_PER_RANK_COLUMNS))
    frame["loss_value"] = frame["loss"].astype("float64")  # NaN for null too
    frame["loss_recorded"] = frame["loss"].notna()
    frame["loss_bad"] = frame["loss_recorded"] & ~np.isfinite(frame["loss_value"])
    frame["grads_bad"] = nonfinite_rows(frame)
    frame = frame.drop(columns=["loss", "n_nan", "n_inf"])
    return frame.sort_values(["step", "rank"]).reset_index(drop=True)


def _param_rows(run: Run) -> pd.DataFrame:
    return _param_frame(run.table(["step", "rank", "name", "amax", "numel"], kinds=["param"]))


def _param_frame(table) -> pd.DataFrame:
    frame = to_frame(table)
    frame["name"] = frame["name"].astype(str)
    frame["amax"] = frame["amax"].astype("float64")
    return frame


def _health(a: Analysis) -> tuple[dict, list[Finding]]:
    """A run with no event: its skipped fraction and underflow rate, and a pointer to ``report``
    when either is high enough to cost training (the thresholds above)."""
    n = len(a.series)
    if not n:
        return {}, []
    skipped = int(np.count_nonzero(a.series.skipped))
    actual = actual_outcome(a.series, a.current)
    fields = {k: actual[k] for k in ("underflow_rate", "underflow_rate_min", "underflow_rate_max")}
    evidence = {"skipped_steps": skipped, "skipped_fraction": skipped / n, **fields}
    low, high = fields["underflow_rate_min"] or 0.0, fields["underflow_rate_max"] or 0.0
    underflow = "lost" if low >= NOTE_UNDERFLOW_RATE else "possible" if high >= NOTE_UNDERFLOW_RATE else None
    many_skipped = skipped / n >= NOTE_SKIPPED_FRACTION
    if not many_skipped and underflow is None:
        return evidence, []
    return evidence, [Finding("healthy_run_that_trains_badly", {
        "path": str(a.run.path), "dtype": a.amp.name, "steps": n, "skipped": skipped if many_skipped else None,
        "underflow": underflow, "underflow_min": low, "underflow_max": high,
        "underflow_decided": fields["underflow_rate"] is not None})]


def _timeline(a: Analysis | EventContext, steps: pd.DataFrame, event: Event) -> list[dict]:
    rank = event.rank
    mine = steps[steps["rank"] == rank]
    window = mine[(mine["step"] <= event.step) & (mine["step"] > event.step - TIMELINE_STEPS - 1)]
    peaks = _activation_peaks(a.run, window["step"].tolist(), rank)
    out = []
    for r in window.itertuples(index=False):
        module, value = peaks.get(int(r.step), (None, None))
        out.append({"step": int(r.step), "scale": float(r.scale), "skipped": bool(r.skipped),
                    "loss": float_or_nonfinite(r.loss_value) if r.loss_recorded else None,
                    "grad_norm": "non-finite" if r.grads_bad else float_or_nonfinite(r.l2),
                    "grad_amax": finite_or_none(r.amax), "max_activation": value, "max_activation_module": module})
    return out


def _activation_peaks(run: Run, steps: list[int], rank: int) -> dict[int, tuple[str, float | str]]:
    if not steps:
        return {}
    frame = to_frame(steps_rows(run, ["step", "rank", "kind", "name", "amax", "n_nan", "n_inf"], steps,
                                kinds=["output"]))
    frame = frame[frame["rank"] == rank]
    out = {}
    for step, rows in frame.groupby("step"):
        amax = rows["amax"].astype("float64")
        bad = nonfinite_rows(rows)
        if bad.any():
            r = rows[bad].iloc[0]
            out[int(step)] = (str(r["name"]), "non-finite")
        elif amax.notna().any():
            i = amax.idxmax()
            out[int(step)] = (str(rows.loc[i, "name"]), float(amax[i]))
    return out
