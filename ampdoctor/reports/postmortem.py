"""``ampdoctor postmortem``: the first non-finite event of a run, its cause, where it started, the
steps that led there, and what to change. A pure function of the run's rows.

**The event** is the earliest of:

* a step whose loss was non-finite (on any rank);
* a step after whose ``optimizer.step()`` a parameter was non-finite (``param`` rows);
* a run of :data:`SKIP_RUN` or more skipped steps after the start-up backoff, or the scale falling
  below :data:`SCALE_FLOOR` (overflow at every scale the scaler tries).

**The cause**, checked in this order:

1. ``nonfinite_weights``: the parameters were non-finite after a step whose gradients were finite
   (the optimizer wrote them; an update that divides by a zero second moment, a bad custom step);
2. ``divergence``: over the steps before the event (at least 5 with a finite loss), the loss and
   the gradient norm both grew (by :data:`DIVERGENCE_LOSS` and :data:`DIVERGENCE_GRAD` at least,
   from the median of the window's first quarter to its last two steps) until it: an
   optimisation problem, not a precision one;
3. for a non-finite loss, the forward origin (``find_origins``): ``nonfinite_input`` when the first
   non-finite output is a NaN of a module that received no tapped module's output (the batch), or
   when every module output was finite but the loss was not (the target); ``forward_overflow``
   when it is an inf, or a NaN after large activations (a module's output exceeded the format);
4. for a run of skipped steps: ``scale_collapse`` when the scale fell below the floor (the
   gradients overflow even unscaled), else ``backward_overflow``, with the most frequent overflow
   origin of the run;
5. ``unknown`` otherwise, saying which rows were missing.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..run import Run, to_frame
from .origins import find_origins, nonfinite_rows, origin_counts, rows_at
from .summary import Analysis, analyse

SKIP_RUN = 5                 # skipped steps in a row (after start-up) that make an event
SCALE_FLOOR = 1.0            # a scale below this means overflow without any loss scaling
TIMELINE_STEPS = 10          # steps before the event in the timeline
DIVERGENCE_WINDOW = 50       # steps before the event the trend is read from
DIVERGENCE_LOSS = 2.0        # the loss grew at least this much ...
DIVERGENCE_GRAD = 10.0       # ... and the gradient norm this much
LARGE_ACTIVATION = 1 / 16    # of the format's max: activations that close are "about to overflow"

CAUSES = ("forward_overflow", "backward_overflow", "nonfinite_input", "scale_collapse", "divergence",
          "nonfinite_weights", "unknown")


@dataclass
class Event:
    step: int
    rank: int
    kind: str          # "nonfinite_loss", "nonfinite_params", "skip_run", "scale_collapse"
    description: str
    checked_at: int | None = None  # nonfinite_params: the step whose check saw them (>= step)


def postmortem(run: Run | str | os.PathLike) -> dict:
    """The postmortem of a run (the ``postmortem`` JSON contract of DESIGN.md, plus ``event``,
    ``evidence`` and ``notes``)."""
    a = analyse(run)
    steps = _per_rank_steps(a)
    params = _param_rows(a.run)
    notes: list[str] = []
    if not a.run.ended_cleanly:
        notes.append("the run did not end with close() (killed or crashed): this covers the steps on disk")
    event = _first_event(steps, params)
    run_info = {"path": str(a.run.path), "steps": int(len(a.series)), "ranks": int(steps["rank"].nunique()),
                "level": a.level, "ended_cleanly": a.run.ended_cleanly}
    if event is None:
        return {"status": "healthy", "first_nonfinite_step": None, "cause": None, "origin": None,
                "event": None, "evidence": {}, "timeline": [], "advice": [], "notes": notes, "run": run_info}
    rows = _event_rows(a.run, event.step)
    cause, origin, evidence = _classify(a, steps, params, event, rows, notes)
    return {"status": "nonfinite", "first_nonfinite_step": event.step, "cause": cause, "origin": origin,
            "event": {"step": event.step, "rank": event.rank, "kind": event.kind,
                      "description": event.description},
            "evidence": evidence, "timeline": _timeline(a, steps, event), "advice": _advice(cause, origin, evidence, a),
            "notes": notes, "run": run_info}


# -- reading -------------------------------------------------------------------------------------

def _per_rank_steps(a: Analysis) -> pd.DataFrame:
    table = a.scan.step_rows.drop_columns(["hist"])
    frame = to_frame(table)
    frame["loss_value"] = frame["loss"].astype("float64")  # NaN for null too
    frame["loss_recorded"] = frame["loss"].notna()
    frame["loss_bad"] = frame["loss_recorded"] & ~np.isfinite(frame["loss_value"])
    frame["grads_bad"] = nonfinite_rows(frame)
    return frame.sort_values(["step", "rank"]).reset_index(drop=True)


def _param_rows(run: Run) -> pd.DataFrame:
    frame = to_frame(run.table(["step", "rank", "name", "amax", "numel"], kinds=["param"]))
    frame["name"] = frame["name"].astype(str)
    frame["amax"] = frame["amax"].astype("float64")
    return frame


def _event_rows(run: Run, step: int) -> pd.DataFrame:
    return rows_at(run, [step])


# -- the event ---------------------------------------------------------------------------------------

def _first_event(steps: pd.DataFrame, params: pd.DataFrame) -> Event | None:
    candidates: list[Event] = []
    bad_loss = steps[steps["loss_bad"]]
    if len(bad_loss):
        r = bad_loss.iloc[0]
        candidates.append(Event(int(r["step"]), int(r["rank"]), "nonfinite_loss",
                                f"the loss was {r['loss_value']} at step {int(r['step'])} on rank {int(r['rank'])}"))
    totals = params[params["name"] == ""]
    bad_params = totals[~np.isfinite(totals["amax"])].sort_values(["step", "rank"], kind="stable")
    if len(bad_params):
        r = bad_params.iloc[0]
        checked, rank = int(r["step"]), int(r["rank"])
        written = _last_applied_step(steps, checked, rank)
        seen = "" if written == checked else f" (seen by the check at step {checked}; the steps between were skipped)"
        candidates.append(Event(written, rank, "nonfinite_params",
                                f"the parameters held a non-finite value after the optimizer step of step "
                                f"{written} on rank {rank}{seen}", checked_at=checked))
    merged = steps.groupby("step").agg(skipped=("skipped", "any"), scale=("scale", "min"),
                                       loss_bad=("loss_bad", "any"))
    skip_event = _skip_run(merged)
    if skip_event is not None:
        candidates.append(skip_event)
    if not candidates:
        return None
    # A non-finite parameter after step t shows before step t+1's loss does.
    order = {"nonfinite_params": 0, "nonfinite_loss": 1, "skip_run": 2, "scale_collapse": 2}
    return min(candidates, key=lambda e: (e.step + (0.5 if e.kind == "nonfinite_loss" else 0), order[e.kind]))


def _last_applied_step(steps: pd.DataFrame, step: int, rank: int) -> int:
    """The step whose optimizer step last changed the parameters that ``step``'s check saw: ``step``
    itself, or the last step before it that was not skipped (skipped steps leave them as they
    were; the parameter check is sampled, so it may see non-finite values steps after they were
    written)."""
    mine = steps[(steps["rank"] == rank) & (steps["step"] <= step)].sort_values("step")
    applied = mine[~mine["skipped"].to_numpy(bool)]
    if not len(applied):
        return step
    last = int(applied["step"].iloc[-1])
    between = np.unique(mine[mine["step"] > last]["step"].to_numpy())
    # Only a gap-free run of recorded, skipped steps proves the parameters did not change.
    return last if np.array_equal(between, np.arange(last + 1, step + 1)) else step


def _skip_run(merged: pd.DataFrame) -> Event | None:
    """The first run of SKIP_RUN skipped steps after start-up (or any below the floor)."""
    skipped = merged["skipped"].to_numpy() & ~merged["loss_bad"].to_numpy()
    scale = merged["scale"].to_numpy(dtype=np.float64)
    steps = merged.index.to_numpy()
    started = False
    run_start, length = None, 0
    for i, s in enumerate(skipped):
        if scale[i] < SCALE_FLOOR and s:
            first = run_start if run_start is not None else i
            return Event(int(steps[first]), 0, "scale_collapse",
                         f"the scale fell to {scale[i]:g} at step {int(steps[i])} and steps still overflowed")
        if not s:
            started = True
            run_start, length = None, 0
            continue
        if not started:
            continue  # start-up backoff from a too-high init_scale is not an event
        if run_start is None:
            run_start = i
        length += 1
        if length >= SKIP_RUN:
            return Event(int(steps[run_start]), 0, "skip_run",
                         f"{SKIP_RUN} or more steps in a row were skipped from step {int(steps[run_start])}")
    return None


# -- the cause ---------------------------------------------------------------------------------------

def _classify(a: Analysis, steps, params, event: Event, rows: pd.DataFrame, notes: list[str]):
    evidence: dict = {}
    fmt = a.target if a.amp.name == "float16" else a.amp
    big = params[(params["name"] != "") & (params["step"] <= event.step)]
    if len(big):
        evidence["large_parameters"] = [
            {"name": n, "amax": _num(v), "step": int(s)} for n, v, s in
            zip(big["name"], big["amax"], big["step"])][:10]
    # 1. The optimizer wrote non-finite parameters.
    if event.kind == "nonfinite_params":
        checked = event.checked_at if event.checked_at is not None else event.step
        at = params[(params["step"] == checked) & (params["rank"] == event.rank) & (params["name"] != "")]
        bad = at[~np.isfinite(at["amax"])]
        name = bad["name"].iloc[0] if len(bad) else ""
        step_row = steps[(steps["step"] == event.step) & (steps["rank"] == event.rank)]
        grads_finite = (not bool(step_row["grads_bad"].iloc[0])) if len(step_row) else None
        evidence.update({"parameters": bad["name"].tolist()[:10], "gradients_finite": grads_finite})
        if grads_finite is None:
            notes.append(f"step {event.step} has no step row (training stopped between step() and update()), so "
                         "its gradients are unknown; the check at exit saw the parameters its optimizer left")
        if grads_finite is not False:
            return "nonfinite_weights", _origin(name, "param", event.rank, event.step), evidence
        notes.append("the gradients of that step were not finite either; the scaler should have skipped it")
        return "unknown", _origin(name, "param", event.rank, event.step), evidence
    # 2. An optimisation problem that ends in overflow.
    trend = _divergence(steps, event.step)
    if trend is not None:
        evidence["trend"] = trend
        origin = _overflow_or_forward_origin(rows, event)
        return "divergence", origin or _origin(None, None, event.rank, event.step), evidence
    if event.kind == "nonfinite_loss":
        return _forward_cause(a, rows, event, fmt, evidence, notes, big)
    # 4. Repeated overflow with a finite loss.
    run_steps = _skipped_run_steps(steps, event.step)
    origins = _run_origins(a.run, run_steps)
    evidence["skipped_steps"] = [int(s) for s in run_steps[:20]]
    evidence["min_scale"] = float(steps.loc[steps["step"].isin(run_steps), "scale"].min()) if len(run_steps) else None
    if origins:
        evidence["overflow_origins"] = origins[:5]
    else:
        notes.append("no module rows at the skipped steps, so the module where the overflow starts is unknown: "
                     "resume from the last checkpoint with level='full' to record it")
    top = origins[0] if origins else None
    origin = (_origin(top["name"], top["kind"], top["rank"], top["first_step"]) if top
              else _origin(None, None, event.rank, event.step))
    cause = "scale_collapse" if event.kind == "scale_collapse" else "backward_overflow"
    return cause, origin, evidence


def _forward_cause(a, rows, event, fmt, evidence, notes, big):
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
        inputs = r["inputs"].iloc[0] if len(r) else None
        from_batch = inputs is None or len(inputs) == 0
        evidence["first_nonfinite_output"] = {"module": forward.name, "order": forward.order,
                                              "value": "inf" if has_inf else "nan",
                                              "detail": at[0].detail}
        origin = _origin(forward.name, "output", forward.rank, event.step)
        if not has_inf and from_batch and not _large_before(a, forward.name, event.step, fmt):
            return "nonfinite_input", origin, evidence
        return "forward_overflow", origin, evidence
    if len(outputs):
        evidence["module_outputs_finite"] = True
        return "nonfinite_input", _origin("(loss)", "loss", event.rank, event.step), evidence
    # No module rows at the event step.
    if len(big):
        owner = big["name"].iloc[0].rsplit(".", 1)[0]
        notes.append("no module rows at this step: the module is inferred from its parameters, which fp16 "
                     "cannot hold; record with level='full' to see the activations")
        return "forward_overflow", _origin(owner, "param", event.rank, event.step), evidence
    notes.append("no module rows at this step (the run was recorded at level='params' and the flight recorder "
                 "had no taps), so it cannot tell a NaN in the batch from an activation that overflowed: resume "
                 "from the last checkpoint with level='full' (or level='params' with the default "
                 "escalate_steps) to record them")
    return "unknown", _origin(None, None, event.rank, event.step), evidence


def _large_before(a: Analysis, module: str, step: int, fmt) -> bool:
    """Whether ``module``'s outputs came within LARGE_ACTIVATION of the format's max before."""
    peaks = a.scan.activation_peak
    if module not in peaks.index:
        return False
    value = peaks.loc[module, "amax"]
    return bool(np.isfinite(value) and value > fmt.max * LARGE_ACTIVATION)


def _overflow_or_forward_origin(rows: pd.DataFrame, event: Event):
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


def _run_origins(run: Run, run_steps: list[int]) -> list[dict]:
    return origin_counts(run, run_steps[:200])


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


# -- timeline and advice ----------------------------------------------------------------------------

def _timeline(a: Analysis, steps: pd.DataFrame, event: Event | None) -> list[dict]:
    if event is None:
        return []
    rank = event.rank
    mine = steps[steps["rank"] == rank]
    window = mine[(mine["step"] <= event.step) & (mine["step"] > event.step - TIMELINE_STEPS - 1)]
    peaks = _activation_peaks(a.run, window["step"].tolist(), rank)
    out = []
    for r in window.itertuples(index=False):
        module, value = peaks.get(int(r.step), (None, None))
        out.append({"step": int(r.step), "scale": float(r.scale), "skipped": bool(r.skipped),
                    "loss": _value(r.loss_value) if r.loss_recorded else None,
                    "grad_norm": "non-finite" if r.grads_bad else _value(r.l2),
                    "grad_amax": _num(r.amax), "max_activation": value, "max_activation_module": module})
    return out


def _activation_peaks(run: Run, steps: list[int], rank: int) -> dict[int, tuple[str, float | str]]:
    if not steps:
        return {}
    frame = to_frame(run.table(["step", "rank", "kind", "name", "amax", "n_nan", "n_inf"], kinds=["output"],
                               steps=steps))
    frame = frame[frame["rank"] == rank]
    out = {}
    for step, rows in frame.groupby("step"):
        amax = rows["amax"].astype("float64")
        bad = nonfinite_rows(rows)
        if bad.any():
            r = rows[bad].iloc[0]
            out[int(step)] = (str(r["name"]), "non-finite")
        elif len(rows):
            i = amax.idxmax()
            out[int(step)] = (str(rows.loc[i, "name"]), float(amax[i]))
    return out


def _advice(cause: str, origin: dict | None, evidence: dict, a: Analysis) -> list[str]:
    name = origin.get("name") if origin else None
    where = f"`{name}`" if name and not name.startswith("(") else "the module named above"
    fp32 = f"keep {where} in float32: `with torch.autocast(device_type, enabled=False): ...` around its call " \
           f"(and cast its input with `.float()`)"
    out: list[str] = []
    large = [p for p in evidence.get("large_parameters") or [] if p["amax"] is not None]  # finite ones
    if large and cause in ("forward_overflow", "unknown"):
        p = large[0]
        out.append(f"`{p['name']}` holds values up to {p['amax']:.3g}, beyond float16's max 65504: autocast casts "
                   f"it to inf. A checkpoint trained in bfloat16 or float32 can have weights fp16 cannot hold: "
                   f"train in bfloat16, or keep that module in float32")
    if cause == "forward_overflow":
        out += [fp32 + "; its output exceeded float16's range",
                "or train in bfloat16 (`torch.autocast(..., dtype=torch.bfloat16)`), whose range is that of float32",
                "if the activation grows over training, add a normalisation before it or lower the learning rate"]
    elif cause == "nonfinite_input":
        batch = evidence.get("first_nonfinite_output", {})
        what = "the loss's target" if name == "(loss)" else "the batch"
        out += [f"inspect {what} of step {origin['step']} (rank {origin['rank']}): it held a NaN "
                f"{'before' if batch else 'after'} the model; check the data pipeline "
                f"(`torch.isfinite(x).all()` on the batch)",
                "skip such batches in the loop, or clean them in the dataset"]
    elif cause == "backward_overflow":
        out += [fp32 + "; its backward produced gradients beyond float16's range",
                "or clip or rescale inside that module's backward; or train in bfloat16",
                "a lower init_scale does not help when one module amplifies its gradient this much"]
    elif cause == "scale_collapse":
        out += ["the gradients overflow even without loss scaling (scale < 1): they are beyond float16's range "
                "themselves; lower the learning rate or clip the gradients",
                fp32 + " if one module produces them", "or train in bfloat16"]
    elif cause == "divergence":
        trend = evidence.get("trend", {})
        clip = trend.get("grad_norm_from")
        out += [f"lower the learning rate: the loss grew from {trend.get('loss_from', 0):.3g} to "
                f"{trend.get('loss_to', 0):.3g} and the gradient norm from {trend.get('grad_norm_from', 0):.3g} to "
                f"{trend.get('grad_norm_to', 0):.3g} before the overflow",
                f"clip after unscaling: `scaler.unscale_(optimizer); torch.nn.utils.clip_grad_norm_("
                f"model.parameters(), {clip:.3g})` (the norm before the growth)" if clip else
                "clip the gradient norm after `scaler.unscale_(optimizer)`",
                "this is an optimisation problem, not a precision one: bfloat16 would fail later, not never"]
    elif cause == "nonfinite_weights":
        out += [f"the optimizer wrote non-finite values into `{name}` from finite gradients: check its "
                f"hyper-parameters (eps of Adam-like optimizers in low precision, a zero division in a custom "
                f"step), and keep optimizer state in float32",
                "resume from the last checkpoint before that step"]
    else:
        out.append("record with level='full' and resume from the last checkpoint to see where it starts")
    return out


def _origin(name, kind, rank, step) -> dict:
    return {"name": name, "kind": kind, "rank": int(rank), "step": int(step)}


def _value(value) -> float | str | None:
    """A float, or "nan" / "inf" / "-inf" for a non-finite one (JSON has no NaN)."""
    if value is None or value is pd.NA:
        return None
    value = float(value)
    return value if math.isfinite(value) else str(value)


def _num(value) -> float | None:
    if value is None or value is pd.NA:
        return None
    value = float(value)
    return value if math.isfinite(value) else None
