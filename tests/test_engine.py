"""The reading side's query engine (ampdoctor.read.engine), its read-ahead thread
(ampdoctor.read.ahead) and the narrow reading of a postmortem (ampdoctor.analysis.event_context):
each gives exactly what the reading it replaces gives, on real runs."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest
import torch

from ampdoctor.analysis import postmortem as postmortem_module
from ampdoctor.analysis.event_context import event_context
from ampdoctor.analysis.origins import ORIGIN_COLUMNS, rows_at
from ampdoctor.read import engine
from ampdoctor.read.ahead import read_ahead
from ampdoctor.errors import RunError
from ampdoctor.read.run import Run, read_run
from ampdoctor.render import to_json
from models import MLP, train_recorded, train_with_faults


def _values(column) -> list:
    """A column's values, NaN as a marker (NaN equals nothing, not even itself)."""
    return ["NaN" if isinstance(v, float) and np.isnan(v) else v for v in column.to_pylist()]


@pytest.fixture(scope="module")
def ranks_run(tmp_path_factory):
    """Two ranks of one run at level "full" in segments of 6 steps, overflowing at first."""
    path = tmp_path_factory.mktemp("engine") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AMPDOCTOR_RUN_ID", "engine")
        for rank in (0, 1):
            train_recorded(path, steps=30, seed=rank, init_scale=2.0**24, level="full", every=4, module_every=8,
                           flush_every=6, rank=rank)
    return read_run(path)


def test_rows_in_order_are_run_table(ranks_run):
    columns = ["step", "rank", "kind", "name", "amax", "n_zero", "loss"]
    table = engine.query(ranks_run, "SELECT step, rank, kind, name, amax, n_zero, loss FROM rows "
                                    "ORDER BY segment, segment_row")
    want = ranks_run.table(columns)
    assert table.num_rows == want.num_rows > 0
    for c in columns:
        got, expected = table.column(c), want.column(c)
        if pa.types.is_dictionary(expected.type):
            expected = expected.cast(pa.string())
        assert _values(got) == _values(expected.cast(got.type)), c


def test_superseded_rows_are_not_rows(ranks_run):
    """A later process's rows stand from its first step on (Segment.until): the engine leaves the
    earlier ones out, as Run.table does."""
    longer = next(s for s in ranks_run.segments if s.steps[1] > s.steps[0])
    cut = Run(ranks_run.path, [replace(s, until=s.steps[0] + 1) if s is longer else s for s in ranks_run.segments])
    count = engine.query(cut, "SELECT count(*) AS n FROM rows").column("n")[0].as_py()
    assert count == cut.table(["step"]).num_rows < ranks_run.table(["step"]).num_rows


def test_steps_rows_are_run_table_of_steps(ranks_run):
    steps = [0, 3, 17, 29]
    got = engine.steps_rows(ranks_run, ORIGIN_COLUMNS, steps)
    want = ranks_run.table(ORIGIN_COLUMNS, steps=steps)
    assert got.schema == want.schema
    assert all(_values(got.column(c)) == _values(want.column(c)) for c in ORIGIN_COLUMNS)
    frame = rows_at(ranks_run, steps)
    assert len(frame) == want.num_rows and set(frame["step"]) == set(steps)


def test_a_version_1_run_reads_its_lists_with_pyarrow(tmp_path):
    """Version 1's fixed-size histograms stay with pyarrow: the engine says NoLists, rows_at reads
    the same rows through Run.table."""
    from pathlib import Path

    try:
        run = read_run(Path(__file__).parent / "data" / "runs-v1" / "nan.parquet")
    except RunError:  # this pyarrow cannot read version 1's histograms at all (before 26)
        pytest.skip("this pyarrow reads no version 1 run")
    assert not engine.lists_here(run)
    with pytest.raises(engine.NoLists):
        engine.steps_rows(run, ["step", "hist"], [1])
    assert engine.query(run, "SELECT count(*) AS n FROM rows").column("n")[0].as_py() == run.rows


def test_read_ahead_keeps_order_and_raises_where_it_failed():
    assert list(read_ahead(iter(range(50)), depth=2)) == list(range(50))

    def failing():
        yield 1
        yield 2
        raise ValueError("damaged")

    got = []
    with pytest.raises(ValueError, match="damaged"):
        for item in read_ahead(failing()):
            got.append(item)
    assert got == [1, 2]


def test_read_ahead_stops_its_thread_when_the_caller_stops():
    produced = []

    def endless():
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    stream = read_ahead(endless(), depth=2)
    assert next(stream) == 0
    stream.close()
    deadline = time.monotonic() + 2
    while any(t.name == "ampdoctor-read-ahead" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(t.name == "ampdoctor-read-ahead" for t in threading.enumerate())
    assert len(produced) <= 5  # bounded: the queue's depth ahead of the caller, no more


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    """A loss that turns NaN at step 20 (a weight blown up before it), at level "full"."""
    path = tmp_path_factory.mktemp("nan") / "run"
    torch.manual_seed(0)
    model = MLP()

    def blow_up(i):
        if i == 20:
            with torch.no_grad():
                next(model.parameters()).mul_(1e30)

    train_with_faults(path, model, steps=26, before_step=blow_up, level="full", every=5, flush_every=7)
    return path


def test_postmortem_read_narrowly_says_what_the_whole_analysis_says(nan_run, monkeypatch):
    narrow = postmortem_module.postmortem_data(read_run(nan_run))
    assert narrow["status"] == "nonfinite"
    assert event_context(read_run(nan_run)) is not None
    monkeypatch.setattr(postmortem_module, "event_context", lambda run: None)
    whole = postmortem_module.postmortem_data(read_run(nan_run))
    assert to_json(narrow) == to_json(whole)


def test_event_context_is_the_analysis_where_it_matters(nan_run):
    from ampdoctor.analysis.run_analysis import analyse

    run = read_run(nan_run)
    context, a = event_context(run), analyse(read_run(nan_run))
    assert context.step_rows.schema == a.scan.step_rows.schema
    assert all(_values(context.step_rows.column(c)) == _values(a.scan.step_rows.column(c))
               for c in context.step_rows.column_names)
    assert context.steps == len(a.series) and context.level == a.level
    peaks = a.activation_peak["amax"]
    assert sorted(context.activation_peak.index) == sorted(peaks.index)
    for name in peaks.index:
        got, want = context.activation_peak.loc[name, "amax"], peaks.loc[name]
        assert (np.isnan(got) and np.isnan(want)) or got == want
