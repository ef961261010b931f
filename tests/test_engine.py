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
from ampdoctor.read.run import to_frame
from ampdoctor.analysis.origins import ORIGIN_COLUMNS, rows_at
from ampdoctor.read import engine
from ampdoctor.read.ahead import read_ahead
from ampdoctor.errors import RunError
from ampdoctor.read.run import Run, read_run
from ampdoctor.render import to_json
from models import MLP, train_ranks, train_with_faults


def _values(column) -> list:
    """A column's values, NaN as a marker (NaN equals nothing, not even itself)."""
    return ["NaN" if isinstance(v, float) and np.isnan(v) else v for v in column.to_pylist()]


@pytest.fixture(scope="module")
def ranks_run(tmp_path_factory):
    """Two ranks of one run at level "full" in segments of 6 steps, overflowing at first."""
    path = tmp_path_factory.mktemp("engine") / "run"
    train_ranks(path, "engine", steps=30, init_scale=2.0**24, level="full", every=4, module_every=8, flush_every=6)
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


def test_the_view_by_file_index_is_the_view_by_file_name(ranks_run):
    """``rows`` numbers each row's segment by its file's index in the listing (DuckDB 1.3's
    file_index) or, before 1.3, by a join on its file name: the same rows, segments and positions,
    also over a subset of the segments (those holding a column) with a superseded one among them."""
    import duckdb

    longer = next(s for s in ranks_run.segments if s.steps[1] > s.steps[0] and s.present["n_underflow"])
    cut = Run(ranks_run.path, [replace(s, until=s.steps[0] + 1) if s is longer else s for s in ranks_run.segments])
    held = [i for i, s in enumerate(cut.segments) if s.present["n_underflow"]]
    assert 0 < len(held) < len(cut.segments)
    sql = "SELECT segment, segment_row, position, step, kind, name, n_underflow FROM rows ORDER BY position"
    answers = []
    with engine.Session(cut, present="n_underflow") as session:
        for by_index in (True, False):
            try:
                engine._register(session._connection, cut, False, "n_underflow", by_index=by_index)
            except duckdb.BinderException:
                assert by_index and tuple(map(int, duckdb.__version__.split(".")[:2])) < (1, 3)
                continue
            session._registered = True
            answers.append(session.query(sql).to_pydict())
    want = Run(cut.path, [cut.segments[i] for i in held]).table(["step", "kind", "name", "n_underflow"])
    for answer in answers:
        assert set(answer["segment"]) == set(held)
        assert answer["position"] == [s * 2**32 + r for s, r in zip(answer["segment"], answer["segment_row"])]
        assert {c: answer[c] for c in want.column_names} == want.to_pydict()
    assert answers and all(a == answers[0] for a in answers)


def test_steps_rows_are_run_table_of_steps(ranks_run):
    steps = [0, 3, 17, 29]
    got = engine.steps_rows(ranks_run, ORIGIN_COLUMNS, steps)
    want = ranks_run.table(ORIGIN_COLUMNS, steps=steps)
    assert got.schema == want.schema
    assert all(_values(got.column(c)) == _values(want.column(c)) for c in ORIGIN_COLUMNS)
    frame = rows_at(ranks_run, steps)
    assert len(frame) == want.num_rows and set(frame["step"]) == set(steps)


def test_a_version_1_run_reads_its_lists_with_pyarrow(tmp_path):
    """Version 1's fixed-size histograms stay with pyarrow: the engine says NoLists, steps_rows
    reads the same rows through Run.table."""
    from pathlib import Path

    try:
        run = read_run(Path(__file__).parent / "data" / "runs-v1" / "nan.parquet")
    except RunError:  # this pyarrow cannot read version 1's histograms at all (before 26)
        pytest.skip("this pyarrow reads no version 1 run")
    assert not engine.lists_here(run)
    with pytest.raises(engine.NoLists):
        engine.Session(run, lists=True)
    got, want = engine.steps_rows(run, ["step", "hist"], [1, 2]), run.table(["step", "hist"], steps=[1, 2])
    assert got.num_rows == want.num_rows > 0 and got.equals(want)
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


def test_fp8_passes_reduced_by_the_engine_are_the_rows_passes(ranks_run):
    """fp8 reduces the GEMM rows over ranks in the engine (run_passes): the same passes, amaxes,
    calls and summed histograms as reading every row (gemm_passes), so the same data."""
    from ampdoctor.analysis.fp8 import _gemm_frame, fp8_data, passes_data
    from ampdoctor.analysis.fp8_passes import gemm_passes, run_passes

    rows, reduced = gemm_passes(_gemm_frame(ranks_run)), run_passes(ranks_run)
    assert rows.ranks == reduced.ranks == 2 and len(rows.sampled) == len(reduced.sampled) > 0
    assert rows.layer == reduced.layer and rows.kind == reduced.kind
    for field in ("starts", "step", "call", "sampled", "calls_per_step"):
        assert np.array_equal(getattr(rows, field), getattr(reduced, field)), field
    assert np.array_equal(rows.amax, reduced.amax, equal_nan=True)
    assert np.array_equal(rows.histograms(0, len(rows.sampled)), reduced.histograms(0, len(reduced.sampled)))
    from ampdoctor.analysis.block_readiness import passes_of
    blocks = passes_of(to_frame(ranks_run.table(["step", "rank", "kind", "name", "call", "amax", "block_stats"])))
    whole = passes_data(rows, ranks_run.metadata, path=str(ranks_run.path), blocks=blocks)
    assert to_json(fp8_data(ranks_run)) == to_json({"path": str(ranks_run.path), "run_id": "engine", **whole})


def test_footers_say_which_segments_hold_values(ranks_run):
    """Segment.present (footer statistics) counts the rows that hold a value; a pass that wants
    only such rows skips the segments with none and returns exactly those rows."""
    total = 0
    for s in ranks_run.segments:
        table = Run(ranks_run.path, [s]).table(["n_underflow", "n_zero"])
        assert s.present == {c: table.num_rows - table.column(c).null_count for c in ("n_underflow", "n_zero")}
        total += s.present["n_underflow"]
    assert 0 < total and any(s.present["n_underflow"] == 0 for s in ranks_run.segments)
    rows = sum(b.num_rows for b in ranks_run.batches(["step", "n_underflow"], present="n_underflow"))
    assert rows == total


def test_grouping_the_batches_changes_no_bit_of_the_scan(ranks_run):
    """The layer scan reads batches in groups (batch_groups): the groups' size changes nothing,
    float sums included (they add up read batch by read batch)."""
    from ampdoctor.analysis.layer_scan import scan_layers
    from ampdoctor.float_formats import FLOAT16

    groups = list(ranks_run.batch_groups(["step", "kind"], batch_rows=64, group_rows=300))
    assert all(sum(sizes) >= 300 for _, sizes in groups[:-1]) and len(groups) > 2
    assert all(batch.num_rows == sum(sizes) for batch, sizes in groups)
    flat = [n for _, sizes in groups for n in sizes]
    batches = list(ranks_run.batches(["step", "kind"], batch_rows=64))
    assert flat == [b.num_rows for b in batches]
    assert pa.Table.from_batches([b for b, _ in groups]).to_pydict() == pa.Table.from_batches(batches).to_pydict()
    scans = [scan_layers(ranks_run, FLOAT16, min_exp=-56, bins=64, batch_rows=64, group_rows=g)
             for g in (1, 500, 10**6)]
    for other in scans[1:]:
        assert other.layers.equals(scans[0].layers)
        assert other.param_lost.equals(scans[0].param_lost)


def test_grouping_changes_no_bit_where_ranks_sample_different_steps(tmp_path):
    """Ranks that sample at different steps (a rank-local escalation does that): the per-step
    sums of light and full rows interleave across ranks, and still add up as read batch by read
    batch, whatever the grouping."""
    from ampdoctor.analysis.layer_scan import scan_layers
    from ampdoctor.float_formats import FLOAT16

    path = tmp_path / "run"
    train_ranks(path, "shifted", steps=40, loss_factor=1e-3, every=lambda rank: 4 + rank, flush_every=9)
    run = read_run(path)
    scans = [scan_layers(run, FLOAT16, min_exp=-56, bins=64, batch_rows=50, group_rows=g) for g in (1, 300, 10**6)]
    for other in scans[1:]:
        assert other.param_lost.equals(scans[0].param_lost)
        assert other.layers.equals(scans[0].layers)


def test_a_segment_damaged_in_a_list_column_is_skipped_by_every_command(nan_run, tmp_path):
    """Damage in a histogram's pages (a column only some queries read): the engine's commands
    skip that segment with the one warning the others give, and say what they say without it."""
    import json
    import shutil

    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from ampdoctor.cli import main

    damaged = tmp_path / "damaged"
    shutil.copytree(nan_run, damaged)
    target = sorted(damaged.glob("part-*.parquet"))[1]
    meta = pq.ParquetFile(target).metadata
    hist = next(i for i in range(meta.num_columns) if meta.row_group(0).column(i).path_in_schema.startswith("hist"))
    chunk = meta.row_group(0).column(hist)
    data = bytearray(target.read_bytes())
    start = chunk.data_page_offset + 8
    data[start:start + 64] = bytes(64)  # (zeros over the page's header and data: it cannot be decoded)
    target.write_bytes(bytes(data))
    without = tmp_path / "without"
    shutil.copytree(nan_run, without)
    (without / target.name).unlink()
    warning = f"skipped unreadable segment {target.name}"
    for command in ("info", "postmortem", "report"):  # (fp8 reads no histogram of these rows)
        got = CliRunner().invoke(main, [command, str(damaged), "--format", "json"])
        want = CliRunner().invoke(main, [command, str(without), "--format", "json"])
        assert got.exit_code == want.exit_code == 0, (command, got.output[-300:])
        text = got.output
        assert text.count(warning) == 1, (command, text[-500:])
        if command == "info":
            assert json.loads(text)["rows"] == json.loads(want.output)["rows"]


def test_light_rows_before_their_first_sample_count_as_the_scan_counts_them(nan_run, tmp_path):
    """A run whose first segment is gone (its sampled step with it): light rows wait for the
    next sample. The narrow reading finds them and counts what the scan leaves unanswered."""
    import shutil

    from ampdoctor.analysis import event_context as context_module
    from ampdoctor.analysis.run_analysis import analyse
    from ampdoctor.read.engine import Session

    cut = tmp_path / "cut"
    shutil.copytree(nan_run, cut)
    sorted(cut.glob("part-*.parquet"))[0].unlink()
    run = read_run(cut)
    with Session(run, lists=True) as session:
        firsts = session.query("SELECT min(step) FILTER (WHERE n_zero IS NULL) AS light, "
                               "min(step) FILTER (WHERE n_zero IS NOT NULL) AS full FROM rows "
                               "WHERE kind = 'param_grad'").to_pylist()[0]
        assert firsts["light"] < firsts["full"]  # (the case: light rows before the first sample)
        assert context_module._unanswered_light_rows(session) == analyse(read_run(cut)).scan.unanswered_light_rows


def test_out_of_memory_is_no_damage(ranks_run, monkeypatch):
    """The engine out of memory (its buffers are capped): the caller reads with pyarrow, and no
    segment is probed for damage (at a thousand ranks that probe reads every column of the run)."""
    import duckdb

    def out_of_memory(self, sql, params):
        raise duckdb.OutOfMemoryException("failed to pin block")

    probed = []
    monkeypatch.setattr(engine.Session, "_answer", out_of_memory)
    monkeypatch.setattr(engine.Session, "_skip_unreadable", lambda self: probed.append(1) or False)
    with pytest.raises(engine.EngineCannot):
        engine.query(ranks_run, "SELECT count(*) FROM rows")
    assert probed == [] and not ranks_run.unreadable_segments
