"""``ampdoctor postmortem``: the first non-finite event of a run, its cause, where it started, the
steps that led there, and what to change. A pure function of the run's rows.

**The event** is the earliest of:

* a step whose loss was non-finite (on any rank);
* parameters that a check (``param`` rows) saw non-finite, dated by the checks around it: the
  step whose optimizer step last changed them (skipped steps leave them as they were), or, when
  an earlier check saw them finite after that step, the first step after that check (something
  outside ``optimizer.step()`` wrote them), or the run's first step when no optimizer step had
  been applied yet (they were non-finite before training began);
* a run of :data:`SKIP_RUN` or more skipped steps after the start-up backoff, or the scale falling
  below :data:`SCALE_FLOOR` (overflow at every scale the scaler tries).

**The cause**, checked in this order:

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
   gradients overflow even unscaled), else ``backward_overflow``, with the most frequent overflow
   origin of the run;
6. ``unknown`` otherwise, saying which rows were missing.

A run with no event is ``healthy``; when it skipped :data:`NOTE_SKIPPED_FRACTION` of its steps or
lost :data:`NOTE_UNDERFLOW_RATE` of its gradient elements to underflow, its advice points at
``ampdoctor report``, which explains both.
"""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..run import Run, to_frame
from .origins import find_origins, nonfinite_rows, origin_counts, rows_at
from .simulate import actual_outcome
from .report import Analysis, analyse

SKIP_RUN = 5                 # skipped steps in a row (after start-up) that make an event
SCALE_FLOOR = 1.0            # a scale below this means overflow without any loss scaling
TIMELINE_STEPS = 10          # steps before the event in the timeline
DIVERGENCE_WINDOW = 50       # steps before the event the trend is read from
DIVERGENCE_LOSS = 2.0        # the loss grew at least this much ...
DIVERGENCE_GRAD = 10.0       # ... and the gradient norm this much
LARGE_ACTIVATION = 1 / 16    # of the format's max: activations that close are "about to overflow"
# A run with no non-finite event can still train badly. These are the fractions at which
# `ampdoctor report` recommends other scaler settings (recommend.BAD_SKIPPED, BAD_UNDERFLOW): a
# dynamic scaler that fits the model skips about one step per growth interval (2000 by default)
# after start-up, and loses far under 1% of the gradient elements below float16's smallest
# subnormal; above these the healthy verdict points at `report`.
NOTE_SKIPPED_FRACTION = 0.05
NOTE_UNDERFLOW_RATE = 0.01

MODULE_KINDS = ["output", "grad_output"]  # the rows of module taps

CAUSES = ("forward_overflow", "backward_overflow", "nonfinite_input", "scale_collapse", "divergence",
          "nonfinite_weights", "nonfinite_checkpoint", "unknown")

# How non-finite parameters got there, as far as the parameter checks prove (evidence["written_by"]).
BY_OPTIMIZER = "optimizer"                       # the step that changed them applied finite gradients
BY_OPTIMIZER_OR_OUTSIDE = "optimizer_or_outside"  # no check between that step and the next forward
BY_OUTSIDE = "outside_optimizer"                 # finite at a check after the last optimizer step
BEFORE_FIRST_STEP = "before_first_step"          # no optimizer step had been applied in this run


@dataclass
class Event:
    step: int
    rank: int
    kind: str          # "nonfinite_loss", "nonfinite_params", "skip_run", "scale_collapse"
    description: str
    checked_at: int | None = None  # nonfinite_params: the step whose check saw them (>= step)
    written_by: str | None = None  # nonfinite_params: one of BY_OPTIMIZER ... BEFORE_FIRST_STEP
    finite_at: int | None = None   # nonfinite_params: the last step whose check saw them finite


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
        evidence, advice = _health(a)
        return {"status": "healthy", "first_nonfinite_step": None, "cause": None, "origin": None,
                "event": None, "evidence": evidence, "timeline": [], "advice": advice, "notes": notes,
                "run": run_info}
    rows = _event_rows(a.run, event.step)
    cause, origin, evidence = _classify(a, steps, params, event, rows, notes)
    return {"status": "nonfinite", "first_nonfinite_step": event.step, "cause": cause, "origin": origin,
            "event": {"step": event.step, "rank": event.rank, "kind": event.kind,
                      "description": event.description},
            "evidence": evidence, "timeline": _timeline(a, steps, event),
            "advice": _advice(cause, origin, evidence, a, detailed=bool(rows["kind"].isin(MODULE_KINDS).any())),
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
    params_event = _params_event(steps, params)
    if params_event is not None:
        candidates.append(params_event)
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


def _params_event(steps: pd.DataFrame, params: pd.DataFrame) -> Event | None:
    """The first check that saw non-finite parameters, dated by the checks and steps around it."""
    totals = params[params["name"] == ""]
    bad_params = totals[~np.isfinite(totals["amax"])].sort_values(["step", "rank"], kind="stable")
    if not len(bad_params):
        return None
    checked, rank = int(bad_params["step"].iloc[0]), int(bad_params["rank"].iloc[0])
    earlier = totals[(totals["rank"] == rank) & (totals["step"] < checked) & np.isfinite(totals["amax"])]
    finite_at = int(earlier["step"].max()) if len(earlier) else None
    updated = _last_update(steps, checked, rank)
    if finite_at is not None and (updated is None or finite_at >= updated):
        # Finite at a check after the last optimizer step that changed them (steps skipped since
        # leave them as they were): the optimizer did not write them.
        mine = steps[(steps["rank"] == rank) & (steps["step"] > finite_at) & (steps["step"] <= checked)]
        bad_loss = mine[mine["loss_bad"]]
        step = int(bad_loss["step"].iloc[0]) if len(bad_loss) else finite_at + 1
        used = f"; step {step}'s loss was already non-finite" if len(bad_loss) else ""
        return Event(step, rank, "nonfinite_params",
                     f"the parameters were finite at the check after step {finite_at}'s optimizer step and "
                     f"non-finite at the check of step {checked} on rank {rank}, and no optimizer step was "
                     f"applied in between{used}", checked_at=checked, written_by=BY_OUTSIDE, finite_at=finite_at)
    if updated is None:
        first = int(steps.loc[steps["rank"] == rank, "step"].min())
        skipped_steps = "that step was" if first == checked else f"every step from {first} to it was"
        return Event(first, rank, "nonfinite_params",
                     f"the parameters held a non-finite value before the first step ({first}) on rank {rank}: "
                     f"the check at step {checked} saw them, and {skipped_steps} skipped, so no optimizer step "
                     f"had changed them", checked_at=checked, written_by=BEFORE_FIRST_STEP)
    seen = "" if updated == checked else f" (seen by the check at step {checked}; the steps between were skipped)"
    row = steps[(steps["rank"] == rank) & (steps["step"] == checked)]
    # Proven only when the checking step itself applied finite gradients: non-finite weights in
    # its forward would have made its loss, its gradients, and so the step, non-finite.
    applied = updated == checked and len(row) > 0 and not bool(row["skipped"].iloc[0])
    return Event(updated, rank, "nonfinite_params",
                 f"the parameters held a non-finite value after the optimizer step of step {updated} on rank "
                 f"{rank}{seen}", checked_at=checked, written_by=BY_OPTIMIZER if applied else BY_OPTIMIZER_OR_OUTSIDE,
                 finite_at=finite_at)


def _last_update(steps: pd.DataFrame, step: int, rank: int) -> int | None:
    """The step whose optimizer step last changed the parameters that ``step``'s check saw:
    ``step`` itself (also when that cannot be proven otherwise), the last step before it that
    was not skipped (skipped steps leave the parameters as they were; the check is sampled, so
    it may see non-finite values steps after they were written), or None when every step of the
    run up to ``step`` was skipped (no optimizer step had changed them)."""
    mine = steps[(steps["rank"] == rank) & (steps["step"] <= step)].sort_values("step")
    applied = mine[~mine["skipped"].to_numpy(bool)]
    last = int(applied["step"].iloc[-1]) if len(applied) else None
    since = mine if last is None else mine[mine["step"] > last]
    first = int(mine["step"].iloc[0]) if len(mine) else step
    between = np.unique(since["step"].to_numpy())
    # Only a gap-free run of recorded, skipped steps proves the parameters did not change.
    expected = np.arange((first if last is None else last + 1), step + 1)
    if not np.array_equal(between, expected):
        return step
    return last


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
    # Parameters beyond the format's max (non-finite ones make a parameter event of their own).
    big = params[(params["name"] != "") & (params["step"] <= event.step) & np.isfinite(params["amax"])]
    if len(big):
        evidence["large_parameters"] = [
            {"name": n, "amax": _num(v), "step": int(s)} for n, v, s in
            zip(big["name"], big["amax"], big["step"])][:10]
    # 1. and 2. Non-finite parameters: from before the run, from outside the optimizer, or from it.
    if event.kind == "nonfinite_params":
        checked = event.checked_at if event.checked_at is not None else event.step
        at = params[(params["step"] == checked) & (params["rank"] == event.rank) & (params["name"] != "")]
        bad = at[~np.isfinite(at["amax"])]
        name = bad["name"].iloc[0] if len(bad) else None
        origin = _origin(name, "param", event.rank, event.step)
        evidence.update({"parameters": bad["name"].tolist()[:10], "nonfinite_parameters": int(len(bad)),
                         "written_by": event.written_by, "checked_at": checked, "finite_at": event.finite_at})
        if event.written_by == BEFORE_FIRST_STEP:
            return "nonfinite_checkpoint", origin, evidence
        if event.written_by == BY_OUTSIDE:
            # The steps since were computed from the non-finite weights: their gradients tell nothing.
            row = steps[(steps["step"] == event.step) & (steps["rank"] == event.rank)]
            evidence["loss_nonfinite"] = bool(len(row)) and bool(row["loss_bad"].iloc[0])
            return "nonfinite_weights", origin, evidence
        step_row = steps[(steps["step"] == event.step) & (steps["rank"] == event.rank)]
        grads_finite = (not bool(step_row["grads_bad"].iloc[0])) if len(step_row) else None
        evidence["gradients_finite"] = grads_finite
        if grads_finite is None:
            notes.append(f"step {event.step} has no step row (training stopped between step() and update()), so "
                         "its gradients are unknown; the check at exit saw the parameters its optimizer left")
        if grads_finite is not False:
            return "nonfinite_weights", origin, evidence
        notes.append("the gradients of that step were not finite either; the scaler should have skipped it")
        return "unknown", origin, evidence
    # 3. An optimisation problem that ends in overflow.
    trend = _divergence(steps, event.step)
    if trend is not None:
        evidence["trend"] = trend
        origin = _overflow_or_forward_origin(rows, event)
        return "divergence", origin or _origin(None, None, event.rank, event.step), evidence
    if event.kind == "nonfinite_loss":
        return _forward_cause(a, rows, event, fmt, evidence, notes, big, params)
    # 5. Repeated overflow with a finite loss.
    run_steps = _skipped_run_steps(steps, event.step)
    origins = _run_origins(a.run, run_steps)
    evidence["skipped_steps"] = [int(s) for s in run_steps[:20]]
    evidence["min_scale"] = float(steps.loc[steps["step"].isin(run_steps), "scale"].min()) if len(run_steps) else None
    if origins:
        evidence["overflow_origins"] = origins[:5]
    else:
        notes.append("no module rows at the skipped steps, so the module where the overflow starts is unknown: "
                     f"resume from the last checkpoint and {_to_record_modules(a)} to record it")
    top = origins[0] if origins else None
    origin = (_origin(top["name"], top["kind"], top["rank"], top["first_step"]) if top
              else _origin(None, None, event.rank, event.step))
    cause = "scale_collapse" if event.kind == "scale_collapse" else "backward_overflow"
    return cause, origin, evidence


def _forward_cause(a, rows, event, fmt, evidence, notes, big, params):
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
        if not has_inf and added is not None and not _large_before(a, forward.name, event.step, fmt):
            if added:
                evidence["first_nonfinite_output"]["added_to"] = added
            if params.empty:
                notes.append(f"the run has no parameter checks (check_params=False), so a non-finite weight of "
                             f"`{forward.name}` would look the same as a NaN in the batch")
            return "nonfinite_input", origin, evidence
        return "forward_overflow", origin, evidence
    if len(outputs):
        evidence["module_outputs_finite"] = True
        return "nonfinite_input", _origin("(loss)", "loss", event.rank, event.step), evidence
    # No module rows at the event step.
    if len(big):
        owner = big["name"].iloc[0].rsplit(".", 1)[0]
        notes.append("no module rows at this step: the module is inferred from its parameters, which fp16 "
                     f"cannot hold; {_to_record_modules(a)} to see the activations")
        return "forward_overflow", _origin(owner, "param", event.rank, event.step), evidence
    if _recorded_full(a):
        notes.append("no module rows at this step (the flight recorder was off), so it cannot tell a NaN in the "
                     f"batch from an activation that overflowed: resume from the last checkpoint and "
                     f"{_to_record_modules(a)} to record them")
    else:
        notes.append("no module rows at this step (the run was recorded at level='params' and the flight recorder "
                     "had no taps), so it cannot tell a NaN in the batch from an activation that overflowed: resume "
                     "from the last checkpoint with level='full' (or level='params' with the default "
                     "escalate_steps) to record them")
    return "unknown", _origin(None, None, event.rank, event.step), evidence


def _recorded_full(a: Analysis) -> bool:
    """Whether the run was recorded at level='full' (runs written before the level was kept in the
    metadata say nothing: False)."""
    return a.run.metadata.get("record.level") == "full"


def _to_record_modules(a: Analysis) -> str:
    """How to get module rows at a step that has none, given how the run was recorded."""
    if _recorded_full(a):
        return ("keep the flight recorder on (flight_steps > 0, the default) or tap modules on every step "
                "(module_every=1)")
    return "record with level='full'"


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

def _health(a: Analysis) -> tuple[dict, list[str]]:
    """A run with no event: its skipped fraction and underflow rate, and a pointer to ``report``
    when either is high enough to cost training (the thresholds above)."""
    n = len(a.series)
    if not n:
        return {}, []
    skipped = int(np.count_nonzero(a.series.skipped))
    actual = actual_outcome(a.series, a.current)
    fields = {k: actual[k] for k in ("underflow_rate", "underflow_rate_min", "underflow_rate_max")}
    evidence = {"skipped_steps": skipped, "skipped_fraction": skipped / n, **fields}
    found = []
    if skipped / n >= NOTE_SKIPPED_FRACTION:
        found.append(f"{skipped} of its {n} steps ({skipped / n:.1%}) were skipped (no update at those steps)")
    low, high = fields["underflow_rate_min"] or 0.0, fields["underflow_rate_max"] or 0.0
    if low >= NOTE_UNDERFLOW_RATE:
        amount = f"{low:.1%}" if fields["underflow_rate"] is not None else f"at least {low:.1%} (up to {high:.1%})"
        found.append(f"{amount} of its gradient elements underflowed to zero in {a.amp.name} (no update for them)")
    elif high >= NOTE_UNDERFLOW_RATE:
        found.append(f"up to {high:.1%} of its gradient elements may have underflowed to zero in {a.amp.name} (zeros "
                     f"the record cannot call underflow or structure)")
    if not found:
        return evidence, []
    command = f"ampdoctor report {shlex.quote(str(a.run.path))}"
    return evidence, [f"{' and '.join(found)}: run `{command}` to see where, and the scaler settings that avoid it"]


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
        elif amax.notna().any():
            i = amax.idxmax()
            out[int(step)] = (str(rows.loc[i, "name"]), float(amax[i]))
    return out


def _advice(cause: str, origin: dict | None, evidence: dict, a: Analysis, detailed: bool) -> list[str]:
    """What to change, most likely first. ``detailed``: the event's step has module rows (so
    recording more would not tell more)."""
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
        added = batch.get("added_to")
        way = (f" (it reached `{name}` added to the finite output of "
               f"{', '.join(f'`{m}`' for m in added)}: a float input such as `inputs_embeds`)") if added else ""
        out += [f"inspect {what} of step {origin['step']} (rank {origin['rank']}): it held a NaN "
                f"{'before' if batch else 'after'} the model{way}; check the data pipeline "
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
        out += _weights_advice(name, origin, evidence)
    elif cause == "nonfinite_checkpoint":
        first = origin["step"]
        others = evidence.get("nonfinite_parameters", 0) - 1
        also = f" (and {others} other parameter(s))" if others > 0 else ""
        out += [f"{f'`{name}`' if name else 'the parameters'}{also} held NaN or inf before the first step of this run ({first}): the weights it "
                f"started from were non-finite, not made so by training. Check them right after loading: "
                f"`[n for n, p in model.named_parameters() if not p.isfinite().all()]`",
                "load a checkpoint saved before its weights went non-finite; if that run was recorded with "
                "ampdoctor, `ampdoctor postmortem` of it dates when they did",
                "if they come from an initialisation or a conversion (a custom `init`, a dtype cast of a "
                "checkpoint with values beyond the target format), fix that step"]
    elif detailed:
        # Module rows were recorded at the event: recording more would not tell more.
        step = origin["step"] if origin else None
        out += [f"step {step} applied non-finite gradients to `{name}`: update the weights only through "
                f"`scaler.step(optimizer)` for every optimizer, and do not change the gradients between "
                f"`scaler.unscale_(optimizer)` and `scaler.step(optimizer)`" if name else
                f"inspect the rows of step {step}: `ampdoctor.load({str(a.run.path)!r}).query('step == {step}')`",
                "resume from the last checkpoint before that step"]
    else:
        out.append(f"resume from the last checkpoint and {_to_record_modules(a)} to see where it starts")
    return out


def _weights_advice(name: str | None, origin: dict, evidence: dict) -> list[str]:
    """Advice for parameters that became non-finite during training, by what wrote them."""
    param = f"`{name}`" if name else "the parameters"
    by = evidence.get("written_by")
    step, finite_at, checked = origin["step"], evidence.get("finite_at"), evidence.get("checked_at")
    resume = "resume from the last checkpoint before that step"
    optimizer = ("check the optimizer's hyper-parameters (eps of Adam-like optimizers in low precision, a zero "
                 "division in a custom step), and keep optimizer state in float32")
    if by == BY_OUTSIDE:
        # A non-finite loss at the event step shows the weights were already non-finite in its forward.
        until = f"step {step}'s forward" if evidence.get("loss_nonfinite") else f"the check of step {checked}"
        return [f"{param} was finite at the check after step {finite_at}'s optimizer step and non-finite at the "
                f"check of step {checked}, with no optimizer step applied in between: it was written outside "
                f"`optimizer.step()`, by code that ran after step {finite_at}'s `scaler.update()` and before "
                f"{until} (a manual edit or re-initialisation, `load_state_dict`, a hook or callback that "
                f"writes into parameters)",
                f"find what writes into {param} there, and check `torch.isfinite(p).all()` right after it",
                f"resume from a checkpoint saved at step {finite_at} or before"]
    if by == BY_OPTIMIZER_OR_OUTSIDE:
        why = ("no parameter check in between tells which: record with check_params='always' to date it to the "
               "step" if checked is not None and checked > step else
               "the step's row was not written, so whether its gradients were finite is unknown")
        return [f"{param} became non-finite in step {step}'s optimizer step or in code that ran after it, before "
                f"the next forward ({why})",
                f"if the optimizer wrote it: {optimizer}",
                "if your code writes into the weights between steps (a load, a hook, a manual edit), check it",
                resume]
    return [f"the optimizer wrote non-finite values into {param} from finite gradients: {optimizer}", resume]


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
