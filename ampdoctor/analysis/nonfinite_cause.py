"""The cause of a run's first non-finite event (:mod:`~ampdoctor.analysis.nonfinite_event`), for
``ampdoctor postmortem``; checked in this order:

1. ``nonfinite_checkpoint``: the parameters were non-finite before the run's first optimizer step
   (a bad checkpoint or initialisation);
2. ``nonfinite_weights``: the parameters became non-finite during training while the gradients
   were finite: written by the optimizer (an update that divides by a zero second moment, a bad
   custom step), or, when a check saw them finite after the last optimizer step, by code outside
   ``optimizer.step()`` (a manual write, a hook, a load); ``evidence["written_by"]`` says which
   the checks prove;
3. ``divergence``: over the steps before the event (at least 5 with a finite loss), the loss and
   the gradient norm both grew (by :data:`DIVERGENCE_LOSS` and :data:`DIVERGENCE_GRAD` at least,
   from the median of the window's first quarter to its last two steps) until it: an
   optimisation problem, not a precision one;
4. for a non-finite loss, the forward origin (``find_origins``): ``nonfinite_input`` when the first
   non-finite output is a NaN of a module whose input came from the batch: it received no tapped
   module's output, or only finite outputs of modules that themselves received none (the batch
   added to position or token-type embeddings, as GPT-2 and BERT do with ``inputs_embeds``); or
   when every module output was finite but the loss was not (the target). ``forward_overflow``
   when it is an inf, a NaN made from other modules' finite outputs, or a NaN after large
   activations (a module's output exceeded the format);
5. for a run of skipped steps: ``scale_collapse`` when the scale fell below the floor (the
   gradients overflow even unscaled), else ``backward_overflow``, with the overflow origin of the
   run's first skipped step (of its first step that has one: the one that explains the event), and
   the run's other origins, which later steps had (``evidence["later_origins"]``);
6. ``unknown`` otherwise, saying which rows were missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .contract_fields import finite_or_none
from .findings import Finding
from .nonfinite_event import BEFORE_FIRST_STEP, BY_OUTSIDE, Event
from .origins import count_origins, entry_key, find_origins, named_origin, nonfinite_rows, origin_key, rows_at
from .run_analysis import Analysis

CAUSES = ("forward_overflow", "backward_overflow", "nonfinite_input", "scale_collapse", "divergence",
          "nonfinite_weights", "nonfinite_checkpoint", "unknown")

DIVERGENCE_WINDOW = 50       # steps before the event the trend is read from
DIVERGENCE_LOSS = 2.0        # the loss grew at least this much ...
DIVERGENCE_GRAD = 10.0       # ... and the gradient norm this much
LARGE_ACTIVATION = 1 / 16    # of the format's max: activations that close are "about to overflow"
NAMED_PARAMETERS = 10        # parameters named in the evidence, at most
RUN_ORIGIN_STEPS = 200       # skipped steps of a run whose rows are read for its origins
SKIPPED_STEPS_SHOWN = 20     # of a run of skipped steps, the first ones in the evidence
ORIGINS_SHOWN = 5


@dataclass
class Diagnosis:
    cause: str                 # one of CAUSES
    origin: dict               # {name, kind, rank, step}: name and kind None where nothing names it
    evidence: dict = field(default_factory=dict)


def classify(a: Analysis, steps: pd.DataFrame, params: pd.DataFrame, event: Event, rows: pd.DataFrame,
             notes: list[Finding]) -> Diagnosis:
    """The event's cause, origin and evidence; what the rows could not tell goes to ``notes``.
    ``rows``: every row of the event's step (``origins.rows_at``)."""
    evidence: dict = {}
    fmt = a.target if a.amp.name == "float16" else a.amp
    # Parameters beyond the format's max (non-finite ones make a parameter event of their own).
    big = params[(params["name"] != "") & (params["step"] <= event.step) & np.isfinite(params["amax"])]
    if len(big):
        evidence["large_parameters"] = [
            {"name": n, "amax": finite_or_none(v), "step": int(s)} for n, v, s in
            zip(big["name"], big["amax"], big["step"])][:NAMED_PARAMETERS]
    # 1. and 2. Non-finite parameters: from before the run, from outside the optimizer, or from it.
    if event.kind == "nonfinite_params":
        return _parameter_cause(steps, params, event, evidence, notes)
    # 3. An optimisation problem that ends in overflow.
    trend = _divergence(steps, event.step)
    if trend is not None:
        evidence["trend"] = trend
        origin = _overflow_or_forward_origin(rows, event)
        return Diagnosis("divergence", origin or _origin(None, None, event.rank, event.step), evidence)
    if event.kind == "nonfinite_loss":
        return _forward_cause(a, rows, event, fmt, evidence, notes, big, params)
    # 5. Repeated overflow with a finite loss: the first skipped step's origin explains the event
    # (the scale falls step by step, and later steps may overflow elsewhere, more often).
    run_steps = _skipped_run_steps(steps, event.step)
    read = run_steps[:RUN_ORIGIN_STEPS]
    per_step = find_origins(rows_at(a.run, read)) if read else []
    origins = count_origins(per_step)
    evidence["skipped_steps"] = [int(s) for s in run_steps[:SKIPPED_STEPS_SHOWN]]
    evidence["min_scale"] = float(steps.loc[steps["step"].isin(run_steps), "scale"].min()) if len(run_steps) else None
    first = next((o for o in map(named_origin, per_step) if o is not None), None)
    if origins:
        evidence["overflow_origins"] = origins[:ORIGINS_SHOWN]
    else:
        notes.append(Finding("skips_without_module_rows_to_name", {"recorded_full": a.recorded_full}))
    if first is not None:
        later = sorted((e for e in origins if entry_key(e) != origin_key(first)),
                       key=lambda e: (e["first_step"], -e["count"], e["name"]))
        if later:
            evidence["later_origins"] = later[:ORIGINS_SHOWN]
        if first.step != event.step:
            notes.append(Finding("origin_from_a_later_skipped_step", {
                "first": event.step, "step": first.step, "recorded_full": a.recorded_full}))
    origin = (_origin(first.name, first.kind, first.rank, first.step) if first is not None
              else _origin(None, None, event.rank, event.step))
    cause = "scale_collapse" if event.kind == "scale_collapse" else "backward_overflow"
    return Diagnosis(cause, origin, evidence)


def _parameter_cause(steps: pd.DataFrame, params: pd.DataFrame, event: Event, evidence: dict,
                     notes: list[Finding]) -> Diagnosis:
    checked = event.checked_at if event.checked_at is not None else event.step
    at = params[(params["step"] == checked) & (params["rank"] == event.rank) & (params["name"] != "")]
    bad = at[~np.isfinite(at["amax"])]
    name = bad["name"].iloc[0] if len(bad) else None
    origin = _origin(name, "param", event.rank, event.step)
    evidence.update({"parameters": bad["name"].tolist()[:NAMED_PARAMETERS], "nonfinite_parameters": int(len(bad)),
                     "written_by": event.written_by, "checked_at": checked, "finite_at": event.finite_at})
    if event.written_by == BEFORE_FIRST_STEP:
        return Diagnosis("nonfinite_checkpoint", origin, evidence)
    step_row = steps[(steps["step"] == event.step) & (steps["rank"] == event.rank)]
    if event.written_by == BY_OUTSIDE:
        # The steps since were computed from the non-finite weights: their gradients tell nothing.
        evidence["loss_nonfinite"] = bool(len(step_row)) and bool(step_row["loss_bad"].iloc[0])
        return Diagnosis("nonfinite_weights", origin, evidence)
    grads_finite = (not bool(step_row["grads_bad"].iloc[0])) if len(step_row) else None
    evidence["gradients_finite"] = grads_finite
    if grads_finite is None:
        notes.append(Finding("no_step_row_at_event", {"step": event.step}))
    if grads_finite is not False:
        return Diagnosis("nonfinite_weights", origin, evidence)
    notes.append(Finding("gradients_nonfinite_too"))
    return Diagnosis("unknown", origin, evidence)


def _forward_cause(a: Analysis, rows, event, fmt, evidence, notes, big, params) -> Diagnosis:
    outputs = rows[rows["kind"] == "output"]
    origins = find_origins(rows) if len(rows) else []
    at = [o for o in origins if o.step == event.step and o.rank == event.rank] or \
         [o for o in origins if o.step == event.step]
    forward = at[0].forward if at else None
    if forward is not None:
        r = outputs[(outputs["name"] == forward.name) & (outputs["order"] == forward.order)
                    & (outputs["rank"] == forward.rank)]
        value = float(r["amax"].iloc[0]) if len(r) else math.nan
        has_inf = bool(len(r)) and (bool(pd.notna(r["n_inf"].iloc[0]) and r["n_inf"].iloc[0] > 0)
                                    or (pd.isna(r["n_nan"].iloc[0]) and math.isinf(value)))
        added = _batch_companions(outputs, r.iloc[0]) if len(r) else []
        evidence["first_nonfinite_output"] = {"module": forward.name, "order": forward.order,
                                              "value": "inf" if has_inf else "nan",
                                              "detail": at[0].detail}
        origin = _origin(forward.name, "output", forward.rank, event.step)
        if not has_inf and added is not None and not _large_before(a, forward.name, fmt):
            if added:
                evidence["first_nonfinite_output"]["added_to"] = added
            if params.empty:
                notes.append(Finding("no_parameter_checks", {"module": forward.name}))
            return Diagnosis("nonfinite_input", origin, evidence)
        return Diagnosis("forward_overflow", origin, evidence)
    if len(outputs):
        evidence["module_outputs_finite"] = True
        return Diagnosis("nonfinite_input", _origin("(loss)", "loss", event.rank, event.step), evidence)
    # No module rows at the event step.
    if len(big):
        owner = big["name"].iloc[0].rsplit(".", 1)[0]
        notes.append(Finding("module_inferred_from_parameters", {"recorded_full": a.recorded_full}))
        return Diagnosis("forward_overflow", _origin(owner, "param", event.rank, event.step), evidence)
    notes.append(Finding("no_module_rows_at_event", {"recorded_full": a.recorded_full}))
    return Diagnosis("unknown", _origin(None, None, event.rank, event.step), evidence)


def _batch_companions(outputs: pd.DataFrame, row: pd.Series) -> list[str] | None:
    """Whether the input of ``row``'s module call came from the batch: the names of the tapped
    modules whose (finite) outputs were added to the batch on its way in ([] when it received
    none), or None when it did not come from the batch.

    A module whose input reaches back to no tapped call read the batch. GPT-2 and BERT fed
    ``inputs_embeds`` add position (and token-type) embeddings to it before their first tapped
    module: those embedding lookups read only the batch's token positions, so a module that received
    nothing but their finite outputs still got its NaN from the batch. A NaN made from the finite
    outputs of deeper modules was made by untapped code in between (an overflow in a matmul,
    ``inf - inf`` in a softmax): not the batch."""
    inputs = row["inputs"]
    calls = [] if inputs is None else [int(c) for c in inputs]
    if not calls:
        return []
    same_rank = outputs[outputs["rank"] == row["rank"]]
    names = []
    for call in calls:
        source = same_rank[same_rank["call"] == call]
        if source.empty or nonfinite_rows(source).any():
            return None
        if any(upstream is not None and len(upstream) for upstream in source["inputs"]):
            return None
        names.append(str(source["name"].iloc[0]))
    return sorted(set(names))


def _large_before(a: Analysis, module: str, fmt) -> bool:
    """Whether ``module``'s outputs came within LARGE_ACTIVATION of the format's max."""
    peaks = a.activation_peak
    if module not in peaks.index:
        return False
    value = peaks.loc[module, "amax"]
    return bool(np.isfinite(value) and value > fmt.max * LARGE_ACTIVATION)


def _overflow_or_forward_origin(rows: pd.DataFrame, event: Event) -> dict | None:
    origins = [o for o in find_origins(rows) if o.step == event.step] if len(rows) else []
    for o in origins:
        chosen = o.forward or o.overflow
        if chosen is not None:
            return _origin(chosen.name, chosen.kind, chosen.rank, event.step)
    return None


def _skipped_run_steps(steps: pd.DataFrame, start: int) -> list[int]:
    merged = steps.groupby("step")["skipped"].any()
    out = []
    for s, skipped in merged[merged.index >= start].items():
        if not skipped:
            break
        out.append(int(s))
    return out


def _divergence(steps: pd.DataFrame, event_step: int) -> dict | None:
    """Loss and gradient norm growth over the steps before the event, or None. Skipped steps
    count too (their loss is finite; their norm, of the finite gradients, is a lower bound): a
    diverging run skips more and more steps on its way."""
    merged = steps.groupby("step").agg(loss=("loss_value", "mean"), norm=("l2", "max"))
    window = merged[(merged.index < event_step) & (merged.index >= event_step - DIVERGENCE_WINDOW)]
    window = window[np.isfinite(window["loss"]) & np.isfinite(window["norm"])]
    if len(window) < 5:
        return None
    quarter = max(2, len(window) // 4)
    loss0, norm0 = window["loss"].iloc[:quarter].median(), window["norm"].iloc[:quarter].median()
    loss1, norm1 = window["loss"].iloc[-2:].max(), window["norm"].iloc[-2:].max()
    if not (loss0 > 0 and norm0 > 0):
        return None
    if loss1 / loss0 >= DIVERGENCE_LOSS and norm1 / norm0 >= DIVERGENCE_GRAD:
        return {"from_step": int(window.index[0]), "loss_from": float(loss0), "loss_to": float(loss1),
                "grad_norm_from": float(norm0), "grad_norm_to": float(norm1)}
    return None


def _origin(name, kind, rank, step) -> dict:
    return {"name": name, "kind": kind, "rank": int(rank), "step": int(step)}
