"""Where the non-finite values of an anomalous step came from (docs/numerics.md, Origins).

* The **forward origin** of a step is the first module, in forward execution order, with a
  non-finite output. A module's output row is written when it returns, so a child comes before
  the block that contains it and the first module that *sees* a NaN input is named, not the
  modules after it.
* The **overflow origin** is the first place in backward order where a non-finite gradient
  appears while everything before it was finite, named as the module whose backward produced it.
  The first non-finite ``grad_output`` row is the gradient w.r.t. some call P's output; it was
  produced by the backward of P's consumer: the innermost tapped call that received P's returned
  tensor as an argument, or, when only P's enclosing module's own code used it, that enclosing
  module. A consumer that received it only through untapped code that computes (an autograd
  Function called inline, ``x * s``; not a view, a reshape, ``x + y`` or a ReLU:
  :data:`ampdoctor.record.call_graph.PASSES`) is not named alone: that code's backward may have made
  the value, and it ran in an enclosing call, which is named instead (the innermost call
  enclosing the consumer that encloses P or received P's output unchanged); the record cannot
  tell the two apart, and that call contains both. A non-finite parameter gradient whose
  module's output gradients were all finite, in every call (a weight gradient that overflowed in
  its own reduction), is produced by its module's backward, just after that module's first
  output gradient arrived; whichever of the two came first wins. Without module rows
  (``level="params"``) that order is unknown, so only a single non-finite parameter gradient is
  named. A step with a non-finite loss gets no overflow origin: every gradient after it is a
  consequence (its forward origin says where it came from).

A step is *anomalous* when it was skipped, its loss was non-finite, or a gradient (parameter or
module output) was non-finite; a non-finite activation alone (a masked ``-inf`` that never
reaches the loss) is not an anomaly, but it is named as the forward origin of an anomalous step.

Pure functions of a run's DataFrame; rows with null counts are light (flight-recorder) rows,
whose ``amax`` is the peak magnitude (NaN or inf when the tensor held one).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from ..run_file.schema import MODULE_KINDS, ROOT_NAME
from ..read.engine import steps_rows
from ..read.run import Run, to_frame

OUTSIDE = "(outside tapped modules)"  # a gradient produced by code no tapped module encloses


@dataclass(frozen=True)
class Origin:
    name: str              # the module (or OUTSIDE)
    kind: str              # "output" (forward), "grad_output" or "param_grad" (backward)
    rank: int
    step: int
    call: int | None       # the module call's number in the step
    occurrence: int | None  # which call of this module in the step: 0 for the first
    order: int | None      # forward or backward order of the first non-finite row
    tensor: str            # that row: a module name (its output or output gradient) or a parameter


@dataclass(frozen=True)
class StepOrigins:
    rank: int
    step: int
    skipped: bool
    loss: float | None
    detail: str | None     # module rows at this step: "full", "light" (flight recorder) or None
    forward: Origin | None
    overflow: Origin | None
    received: bool = False  # its non-finite gradients came from another rank (all-reduce): no origin here

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def nonfinite_rows(frame: pd.DataFrame) -> pd.Series:
    """Whether each row saw a NaN or an inf (light rows: a non-finite peak magnitude)."""
    counts = frame["n_nan"].fillna(0) + frame["n_inf"].fillna(0)
    light = frame["n_nan"].isna()
    return (counts > 0) | (light & ~np.isfinite(frame["amax"].astype(float)))


def find_origins(frame: pd.DataFrame) -> list[StepOrigins]:
    """Origins of every anomalous step (skipped, non-finite loss, or a non-finite observation),
    per rank, in (step, rank) order."""
    if frame.empty:
        return []
    bad = nonfinite_rows(frame)
    steps = frame[frame["kind"] == "step"]
    loss_recorded = steps["loss"].notna()  # null: no loss was recorded; NaN: a NaN loss
    loss = steps["loss"].astype("float64")
    flagged = steps[steps["skipped"] | (loss_recorded & ~np.isfinite(loss))]
    keys = set(zip(flagged["step"], flagged["rank"]))
    bad_grads = bad & frame["kind"].isin(["param_grad", "grad_output"])
    keys |= set(zip(frame.loc[bad_grads, "step"], frame.loc[bad_grads, "rank"]))
    if not keys:
        return []
    marked = frame.assign(_bad=bad)
    chosen = marked[marked.set_index(["step", "rank"]).index.isin(list(keys))]
    # Steps without module rows (level "params", or a rank that recorded none) have no call
    # structure to follow: their origins are read for all of them at once (_param_only_origins).
    with_modules = chosen["kind"].isin(MODULE_KINDS)
    module_keys = set(zip(chosen.loc[with_modules, "step"], chosen.loc[with_modules, "rank"]))
    in_modules = chosen.set_index(["step", "rank"]).index.isin(list(module_keys))
    found = {(int(step), int(rank)): _step_origins(int(step), int(rank), rows)
             for (step, rank), rows in chosen[in_modules].groupby(["step", "rank"])}
    found.update(_param_only_origins(chosen[~in_modules]))
    return _across_ranks([found[key] for key in sorted(found)])


def _param_only_origins(rows: pd.DataFrame) -> dict[tuple[int, int], StepOrigins]:
    """:func:`_step_origins` of steps without module rows, all at once: the origin is the one
    non-finite parameter gradient's module where exactly one was (with several, which came first
    is unknown), unless the loss itself was non-finite."""
    if rows.empty:
        return {}
    keys = rows[["step", "rank"]].drop_duplicates()
    step_rows = rows[rows["kind"] == "step"].drop_duplicates(["step", "rank"], keep="first").set_index(["step", "rank"])
    bad = rows[(rows["kind"] == "param_grad") & rows["_bad"]].groupby(["step", "rank"])["name"].agg(["count", "first"])
    out = {}
    for step, rank in zip(keys["step"], keys["rank"]):
        step, rank = int(step), int(rank)
        if (step, rank) in step_rows.index:
            row = step_rows.loc[(step, rank)]
            skipped, loss = bool(row["skipped"]), _float(row["loss"])
        else:
            skipped, loss = False, None
        overflow = None
        if not (loss is not None and not math.isfinite(loss)) and (step, rank) in bad.index:
            count, name = bad.loc[(step, rank)]
            if count == 1:
                overflow = Origin(_owner_module(name, set()), "param_grad", rank, step, None, None, None, name)
        out[(step, rank)] = StepOrigins(rank, step, skipped, loss, None, None, overflow)
    return out


def _across_ranks(origins: list[StepOrigins]) -> list[StepOrigins]:
    """Module rows are local to a rank, parameter gradients are not: DDP all-reduces them in
    backward, so an inf that starts on one rank reaches every rank's ``.grad``. Where at a step
    some rank has a local origin (a module's output or output gradient), the ranks that only saw
    non-finite parameter gradients received them: they are marked and name no origin."""
    local_steps = {o.step for o in origins if o.forward is not None
                   or (o.overflow is not None and o.overflow.kind != "param_grad")}
    return [replace(o, received=True, overflow=None)
            if (o.step in local_steps and o.forward is None
                and (o.overflow is None or o.overflow.kind == "param_grad")) else o
            for o in origins]


def _step_origins(step: int, rank: int, rows: pd.DataFrame) -> StepOrigins:
    step_row = rows[rows["kind"] == "step"]
    skipped = bool(step_row["skipped"].iloc[0]) if len(step_row) else False
    loss = _float(step_row["loss"].iloc[0]) if len(step_row) else None
    modules = rows[rows["kind"].isin(MODULE_KINDS)]
    detail = None
    if len(modules):
        detail = "light" if modules["n_nan"].isna().all() else "full"
    calls = _CallTable(modules)
    forward = _forward_origin(step, rank, modules, calls)
    loss_failed = loss is not None and not math.isfinite(loss)
    consequence = loss_failed or (loss is None and forward is not None)
    overflow = None if consequence else _overflow_origin(step, rank, rows, modules, calls)
    return StepOrigins(rank, step, skipped, loss, detail, forward, overflow)


def _forward_origin(step, rank, modules, calls) -> Origin | None:
    outputs = modules[(modules["kind"] == "output") & modules["_bad"]].sort_values("order")
    if outputs.empty:
        return None
    r = outputs.iloc[0]
    call = _int(r["call"])  # null in runs written before the call columns existed
    return Origin(r["name"], "output", rank, step, call, calls.occurrence(call), _int(r["order"]), r["name"])


def _overflow_origin(step, rank, rows, modules, calls) -> Origin | None:
    candidates: list[tuple[float, Origin]] = []
    grads = modules[modules["kind"] == "grad_output"].sort_values("order")
    bad_grads = grads[grads["_bad"]]
    if len(bad_grads):
        r = bad_grads.iloc[0]
        call = _int(r["call"])
        if call is None:  # no call structure recorded: name the module whose output gradient it is
            producer, name = None, r["name"]
        else:
            producer = calls.producer_of(call, r["order"], grads)
            name = calls.name(producer) if producer is not None else OUTSIDE
        candidates.append((r["order"] - 0.5, Origin(
            name, "grad_output", rank, step, producer,
            calls.occurrence(producer) if producer is not None else None, int(r["order"]), r["name"])))
    params = rows[(rows["kind"] == "param_grad") & rows["_bad"]]
    if len(params) > 1 and not len(grads):
        params = params.iloc[:0]  # no module rows to order them by: which came first is unknown
    if len(params):
        first_grad = grads.groupby("name")["order"].min() if len(grads) else pd.Series(dtype=float)
        module_names = set(modules["name"])
        # A module with a non-finite output gradient (in any of its calls) got a non-finite
        # parameter gradient from it: not an overflow of its own reduction.
        received = set(bad_grads["name"])
        for pname in params["name"]:
            owner = _owner_module(pname, module_names)
            if owner in received:
                continue
            when = first_grad.get(owner, math.inf) + 0.5
            owner_call = calls.first_call(owner)
            candidates.append((when, Origin(
                owner, "param_grad", rank, step, owner_call,
                calls.occurrence(owner_call) if owner_call is not None else None, None, pname)))
    if not candidates:
        return None
    return min(candidates, key=lambda c: c[0])[1]


def _owner_module(param: str, module_names: set[str]) -> str:
    """The longest tapped module name that is a prefix of ``param``; else the parameter's own
    module path (``a.b.weight`` → ``a.b``)."""
    parts = param.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in module_names:
            return prefix
    return ".".join(parts[:-1]) or ROOT_NAME  # a parameter of the model itself (a pos_embed)


class _CallTable:
    """The calls of one step: name, parent and inputs, from the module rows."""

    def __init__(self, modules: pd.DataFrame) -> None:
        self._name: dict[int, str] = {}
        self._parent: dict[int, int | None] = {}
        self._inputs: dict[int, tuple[int, ...]] = {}
        self._through_code: dict[int, frozenset[int]] = {}  # inputs received through untapped code
        for call, name, parent, inputs, computed in zip(modules["call"], modules["name"], modules["parent"],
                                                        modules["inputs"], modules["computed_inputs"]):
            if call is None or pd.isna(call):
                continue
            call = int(call)
            self._name[call] = name
            self._parent[call] = None if parent is None or pd.isna(parent) else int(parent)
            self._inputs[call] = tuple(int(i) for i in inputs) if inputs is not None else ()
            # (null in runs before the column: every input counts as passed on, as they were read)
            self._through_code[call] = frozenset(int(i) for i in computed) if computed is not None else frozenset()
        forward_calls = modules.loc[modules["kind"] == "output", ["name", "call"]].dropna()
        # Occurrences count the calls that ran forward (a reentrant checkpoint's recomputation
        # adds calls with gradient rows only).
        source = forward_calls if len(forward_calls) else modules[["name", "call"]].dropna()
        self._occurrence: dict[int, int] = {}
        for _, calls in source.groupby("name"):
            for k, c in enumerate(sorted({int(c) for c in calls["call"]})):
                self._occurrence[c] = k

    def name(self, call: int) -> str:
        return self._name[call]

    def occurrence(self, call: int | None) -> int | None:
        return None if call is None else self._occurrence.get(call)

    def first_call(self, name: str) -> int | None:
        calls = [c for c, n in self._name.items() if n == name]
        return min(calls) if calls else None

    def _is_ancestor(self, a: int, b: int) -> bool:
        p, seen = self._parent.get(b), set()
        while p is not None and p not in seen:  # seen: never loop on inconsistent input
            if p == a:
                return True
            seen.add(p)
            p = self._parent.get(p)
        return False

    def producer_of(self, call: int, order: float, grads: pd.DataFrame) -> int | None:
        """The call whose backward produced the gradient w.r.t. ``call``'s output, which arrived
        at backward position ``order``; None when no tapped module's code did."""
        first_seen = grads.groupby("call")["order"].min() if len(grads) else pd.Series(dtype=float)
        current, visited = call, set()
        while current not in visited:
            visited.add(current)
            consumers = [c for c, inputs in self._inputs.items() if current in inputs]
            innermost = [c for c in consumers
                         if not any(self._is_ancestor(c, o) for o in consumers if o != c)]
            # A consumer whose own output gradient arrived only after this one returned the very
            # tensor it received (nn.Identity, dropout in eval): look past it.
            ran = [c for c in innermost if first_seen.get(c, -math.inf) < order]
            if ran:
                # Several unrelated consumers (a tensor used twice): the one whose backward
                # began last, i.e. whose output gradient arrived latest.
                consumer = max(ran, key=lambda c: (first_seen.get(c, -math.inf), -c))
                if current in self._through_code.get(consumer, ()):
                    return self._code_between(current, consumer)
                return consumer
            if innermost:
                current = min(innermost)
                continue
            parent = self._parent.get(current)
            if parent is None:
                return None
            if first_seen.get(parent, -math.inf) < order:
                return parent  # the enclosing module's own code used it, in its backward
            # The parent's output gradient came later: it returned this very tensor as its own,
            # so whoever consumed the parent's output produced the gradient.
            current = parent
        return None

    def _code_between(self, call: int, consumer: int) -> int | None:
        """The call whose own code computed ``consumer``'s argument from ``call``'s output (an
        inline Function, ``x * s``): that code's backward or ``consumer``'s made the gradient,
        and the record cannot tell which. The innermost call enclosing ``consumer`` that also
        encloses ``call`` or received its output unchanged encloses both; None when no tapped
        call does (code outside every tapped module)."""
        enclosing, seen = self._parent.get(consumer), set()
        while enclosing is not None and enclosing not in seen:
            seen.add(enclosing)
            if self._is_ancestor(enclosing, call) or (
                    call in self._inputs.get(enclosing, ()) and call not in self._through_code.get(enclosing, ())):
                return enclosing
            enclosing = self._parent.get(enclosing)
        return None


def _int(value) -> int | None:
    return None if value is None or pd.isna(value) else int(value)


def _float(value) -> float | None:
    """A recorded float (NaN stays NaN), or None when null."""
    if value is None or value is pd.NA:
        return None
    return float(value)


ORIGIN_COLUMNS = ["step", "rank", "kind", "name", "order", "dtype", "skipped", "loss", "amax", "n_nan", "n_inf",
                  "call", "parent", "inputs", "computed_inputs"]


def rows_at(run: Run, steps) -> pd.DataFrame:
    """Every row of ``steps`` with the columns the origins need (names as plain strings), in the
    run's order. Found by the query engine (a few steps of a long run: the footers' statistics
    skip most row groups; engine.steps_rows)."""
    frame = to_frame(steps_rows(run, ORIGIN_COLUMNS, sorted({int(s) for s in steps})))
    for c in ("kind", "name", "dtype"):
        frame[c] = frame[c].astype(str)
    return frame


def named_origin(step: StepOrigins) -> Origin | None:
    """What an anomalous step's origin counts as: its overflow origin, or its forward origin when
    the loss was non-finite (or it has no overflow origin); None when neither is known."""
    return step.overflow or step.forward


def after_of(origin: Origin) -> str | None:
    """For an origin outside the tapped modules, the module whose output gradient it reached
    first (the code that consumed that output produced it); else None."""
    return origin.tensor if origin.name == OUTSIDE else None


def origin_key(origin: Origin) -> tuple:
    """What makes two steps' origins the same entry of :func:`count_origins`."""
    return origin.name, after_of(origin), origin.kind, origin.rank


def entry_key(entry: dict) -> tuple:
    """The :func:`origin_key` of an entry of :func:`count_origins`."""
    return entry["name"], entry["after"], entry["kind"], entry["rank"]


def count_origins(steps: list[StepOrigins]) -> list[dict]:
    """The origins of anomalous steps counted per (module, ``after``, kind, rank), most frequent
    first (then earliest, then name): each step counts its :func:`named_origin`."""
    counts: dict[tuple, dict] = {}
    for step in steps:
        origin = named_origin(step)
        if origin is None:
            continue
        entry = counts.setdefault(origin_key(origin), {
            "name": origin.name, "after": after_of(origin), "kind": origin.kind, "rank": origin.rank, "count": 0,
            "first_step": origin.step, "last_step": origin.step})
        entry["count"] += 1
        entry["first_step"] = min(entry["first_step"], origin.step)
        entry["last_step"] = max(entry["last_step"], origin.step)
    return sorted(counts.values(), key=lambda e: (-e["count"], e["first_step"], e["name"]))


def origin_counts(run: Run, steps) -> list[dict]:
    """The origins of the anomalous steps among ``steps`` (:func:`count_origins`), read from the
    run: the overflow origin, or the forward origin when the loss was non-finite. ``after``: for
    an origin outside the tapped modules, the module whose output gradient it reached first;
    else None."""
    return count_origins(find_origins(rows_at(run, steps)) if len(steps) else [])
