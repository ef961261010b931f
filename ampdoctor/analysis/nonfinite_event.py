"""The first non-finite event of a run, for ``ampdoctor postmortem``: the earliest of

* a step whose loss was non-finite (on any rank);
* parameters that a check (``param`` rows) saw non-finite, dated by the checks around it: the
  step whose optimizer step last changed them (skipped steps leave them as they were), or, when
  an earlier check saw them finite after that step, the first step after that check (something
  outside ``optimizer.step()`` wrote them), or the run's first step when no optimizer step had
  been applied yet (they were non-finite before training began);
* a run of :data:`SKIP_RUN` or more skipped steps after the start-up backoff, or the scale falling
  below :data:`SCALE_FLOOR` (overflow at every scale the scaler tries).

Pure functions of the per-rank step rows and the parameter rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .findings import Finding

SKIP_RUN = 5                 # skipped steps in a row (after start-up) that make an event
SCALE_FLOOR = 1.0            # a scale below this means overflow without any loss scaling

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
    description: Finding
    checked_at: int | None = None  # nonfinite_params: the step whose check saw them (>= step)
    written_by: str | None = None  # nonfinite_params: one of BY_OPTIMIZER ... BEFORE_FIRST_STEP
    finite_at: int | None = None   # nonfinite_params: the last step whose check saw them finite


def first_event(steps: pd.DataFrame, params: pd.DataFrame) -> Event | None:
    """The run's first event, or None for a run without one. ``steps``: the step rows per rank
    (with ``loss_value``, ``loss_bad``); ``params``: the ``param`` rows."""
    candidates: list[Event] = []
    bad_loss = steps[steps["loss_bad"]]
    if len(bad_loss):
        r = bad_loss.iloc[0]
        candidates.append(Event(int(r["step"]), int(r["rank"]), "nonfinite_loss", Finding(
            "loss_nonfinite", {"loss": float(r["loss_value"]), "step": int(r["step"]), "rank": int(r["rank"])})))
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
        return Event(step, rank, "nonfinite_params", Finding("params_written_outside_optimizer", {
            "finite_at": finite_at, "checked": checked, "rank": rank,
            "nonfinite_loss_at": step if len(bad_loss) else None}),
            checked_at=checked, written_by=BY_OUTSIDE, finite_at=finite_at)
    if updated is None:
        first = int(steps.loc[steps["rank"] == rank, "step"].min())
        return Event(first, rank, "nonfinite_params", Finding("params_nonfinite_from_start", {
            "first": first, "checked": checked, "rank": rank}), checked_at=checked, written_by=BEFORE_FIRST_STEP)
    row = steps[(steps["rank"] == rank) & (steps["step"] == checked)]
    # Proven only when the checking step itself applied finite gradients: non-finite weights in
    # its forward would have made its loss, its gradients, and so the step, non-finite.
    applied = updated == checked and len(row) > 0 and not bool(row["skipped"].iloc[0])
    return Event(updated, rank, "nonfinite_params", Finding("params_nonfinite_after_step", {
        "step": updated, "checked": checked, "rank": rank}),
        checked_at=checked, written_by=BY_OPTIMIZER if applied else BY_OPTIMIZER_OR_OUTSIDE, finite_at=finite_at)


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
            return Event(int(steps[first]), 0, "scale_collapse", Finding(
                "scale_fell_below_floor", {"scale": float(scale[i]), "step": int(steps[i])}))
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
            return Event(int(steps[run_start]), 0, "skip_run", Finding(
                "skip_run", {"length": SKIP_RUN, "first": int(steps[run_start])}))
    return None
