"""What explaining one non-finite event needs of a whole run, read narrowly (``ampdoctor
postmortem``): the step rows, the parameter checks, each module's largest activation and the
run's level, each a query of the engine (:mod:`ampdoctor.read.engine`) instead of the layer scan
over every row (:func:`~ampdoctor.analysis.run_analysis.analyse`).

Everything here is what :func:`analyse` would give for the same fields, value for value: the step
rows in the run's order and types, the same validity filter and warnings, the same maxima. Where
the narrow reading cannot be sure of that, :func:`event_context` returns None and the caller
analyses the whole run: histograms the engine cannot hold (schema version 1), a histogram of
another length than the run's, or so many light rows before their tensor's first sample that the
layer scan would have dropped some (its warning, ``light_rows_without_sample``, counts them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa

from ..float_formats import FloatFormat, FLOAT16
from ..read.engine import FINITE, NONFINITE, EngineCannot, Session
from ..read.run import Run
from ..run_file.hist_column import BadHistogram, as_hist_column
from ..run_file.schema import META_LEVEL, MODULE_KINDS
from ..run_file.segment import COLUMN_TYPES, as_column_type
from .calibration import MAX_PENDING_ROWS
from .findings import Finding
from .layer_scan import LAYER_KINDS, STEP_COLUMNS
from .run_analysis import with_valid_scale, recorded_binning
from .steps import load_steps

@dataclass
class EventContext:
    """The parts of an :class:`~ampdoctor.analysis.run_analysis.Analysis` that the postmortem of a
    run with an event reads, under the same names."""

    run: Run
    amp: FloatFormat
    target: FloatFormat
    level: str
    steps: int                       # steps of the merged series (len(Analysis.series))
    step_rows: pa.Table              # every rank's step rows (LayerScan.step_rows)
    activation_peak: pd.DataFrame    # per module: largest finite output amax (LayerScan.activation_peak's amax)
    param_rows: pa.Table             # the parameter checks' rows (param_rows)
    own_warnings: list[Finding] = field(default_factory=list)

    @property
    def warnings(self) -> list:
        return [*self.run.warnings, *self.own_warnings]

    @property
    def recorded_full(self) -> bool:
        return self.run.metadata.get(META_LEVEL) == "full"


def event_context(run: Run) -> EventContext | None:
    """The narrow reading of ``run`` (see the module docstring); None where only the layer scan
    gives the same answer."""
    amp, min_exp, bins = recorded_binning(run.metadata)
    try:
        with Session(run, lists=True) as session:
            step_rows = _step_rows(session, bins)
            unanswered = _unanswered_light_rows(session)
            if unanswered is None:
                return None
            level, peaks, params = _level(session), _activation_peak(session), param_rows(session)
    except (EngineCannot, BadHistogram):
        return None
    own: list[Finding] = []
    step_rows = with_valid_scale(step_rows, own)
    if unanswered:
        own.append(Finding("light_rows_without_sample", {"rows": unanswered}))
    series = load_steps(step_rows, amp, min_exp, bins)
    target = amp if amp.name == "float16" else FLOAT16
    return EventContext(run, amp, target, level, len(series), step_rows, peaks, params, own)


def param_rows(session: Session) -> pa.Table:
    """The parameter checks' rows (kind ``param``), in the run's order and the schema's types."""
    columns = ("step", "rank", "name", "amax", "numel")
    table = session.query(f"SELECT {', '.join(columns)} FROM rows WHERE kind = 'param' ORDER BY position")
    return pa.Table.from_arrays([as_column_type(table.column(c), COLUMN_TYPES[c]) for c in columns],
                                names=list(columns))


def _step_rows(session: Session, bins: int) -> pa.Table:
    """Every step row, in the run's order and the run schema's types (as the layer scan keeps
    them); the histograms checked to hold ``bins`` counts each."""
    names = ", ".join(f'"{c}"' for c in STEP_COLUMNS)
    table = session.query(f"SELECT {names} FROM rows WHERE kind = 'step' ORDER BY position")
    schema = pa.schema([(c, COLUMN_TYPES[c]) for c in STEP_COLUMNS])
    columns = [as_hist_column(table.column(c), bins) if c in ("hist", "underflow_hist")
               else as_column_type(table.column(c), COLUMN_TYPES[c]) for c in STEP_COLUMNS]
    return pa.Table.from_arrays(columns, schema=schema)


def _activation_peak(session: Session) -> pd.DataFrame:
    """Per module with output rows: its largest finite activation over the run (NaN: none)."""
    table = session.query(f"SELECT name, max(amax) FILTER (WHERE {FINITE.format(x='amax')} AND NOT {NONFINITE}) AS amax "
                       f"FROM rows WHERE kind = 'output' GROUP BY name")
    amax = table.column("amax").to_numpy(zero_copy_only=False).astype(np.float64)
    return pd.DataFrame({"amax": amax}, index=table.column("name").to_pylist())


def _level(session: Session) -> str:
    """The level the run was recorded at; older runs without it: inferred from the rows, as
    :func:`~ampdoctor.analysis.run_analysis.analyse` does."""
    level = session.run.metadata.get(META_LEVEL)
    if level:
        return level
    modules = ", ".join(f"'{k}'" for k in MODULE_KINDS)
    layers = ", ".join(f"'{k}'" for k in LAYER_KINDS)
    found = session.query(f"SELECT coalesce(bool_or(kind IN ({modules})), false) AS modules, "
                       f"coalesce(bool_or(kind IN ({layers})), false) AS layers FROM rows").to_pylist()[0]
    return "full" if found["modules"] else "params" if found["layers"] else "steps"


def _unanswered_light_rows(session: Session) -> int | None:
    """The light parameter rows that the layer scan would count nowhere (calibration.Samples):
    those of tensors never sampled. None where some could have been dropped instead (more rows
    waiting for their tensor's first sample than it holds)."""
    keys = session.query(f"""
        SELECT name, rank,
               min(position) FILTER (WHERE n_zero IS NOT NULL) AS first_sample,
               min(position) FILTER (WHERE n_zero IS NULL) AS first_light,
               count(*) FILTER (WHERE n_zero IS NULL) AS light
        FROM rows WHERE kind = 'param_grad' AND NOT {NONFINITE} GROUP BY name, rank""").to_pylist()
    never = sum(k["light"] for k in keys if k["first_sample"] is None)
    # Light rows before their tensor's first sample wait for it (in the scan's order); usually none.
    early = [k for k in keys if k["first_sample"] is not None and k["first_light"] is not None
             and k["first_light"] < k["first_sample"]]
    waiting = never
    if early and never < MAX_PENDING_ROWS:
        firsts = pa.table({"name": [k["name"] for k in early], "rank": pa.array([k["rank"] for k in early], pa.int32()),
                           "first_sample": pa.array([k["first_sample"] for k in early], pa.int64())})
        waiting += session.query(f"""
            SELECT count(*) AS n FROM rows r JOIN early_firsts f ON r.name = f.name AND r.rank = f.rank
            WHERE r.kind = 'param_grad' AND n_zero IS NULL AND NOT {NONFINITE} AND position < f.first_sample""",
                                 tables={"early_firsts": firsts}
        ).column("n")[0].as_py()
    return None if waiting >= MAX_PENDING_ROWS else int(never)
