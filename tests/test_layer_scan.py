"""The layer scan's ways through a run (ampdoctor.analysis.layer_scan): full rows through the
histogram work, light rows through what they count for, on two threads, the measured rows found
by the query engine; each way gives what the plain one gives, bit for bit, on real runs."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ampdoctor.analysis import layer_scan
from ampdoctor.analysis.layer_scan import scan_layers
from ampdoctor.float_formats import FLOAT16
from ampdoctor.read import engine
from ampdoctor.read.run import read_run
from models import train_ranks


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory):
    """Two ranks, sampled every 4 steps and measured every 8 (light rows between), underflowing."""
    path = tmp_path_factory.mktemp("scan") / "run"
    train_ranks(path, "scan", steps=40, loss_factor=1e-6, init_scale=1.0, growth_interval=1000, every=4,
                measure_every=8, flush_every=9)
    return path


def _scan(path, **options):
    return scan_layers(read_run(path), FLOAT16, min_exp=-56, bins=64, batch_rows=50, **options)


def _same(a, b) -> None:
    assert a.layers.equals(b.layers)
    assert a.param_lost.equals(b.param_lost)
    assert a.module_peak.equals(b.module_peak)
    assert a.activation_peak.equals(b.activation_peak)
    for name, (high, low) in a.heatmap.items():
        np.testing.assert_array_equal(high, b.heatmap[name][0])
        np.testing.assert_array_equal(low, b.heatmap[name][1])


def test_light_rows_read_apart_give_what_reading_every_column_gives(sampled_run, monkeypatch):
    """The counts of light rows (null as the recorder writes them) are read for the full rows
    alone; reading every column of every row (the way for another writer's files) gives the same
    bits."""
    scan = _scan(sampled_run)
    assert scan.layers["observations"].sum() > 0 and scan.param_lost["lost"].sum() > 0
    monkeypatch.setattr(layer_scan, "_full_only", lambda *args: None)
    _same(scan, _scan(sampled_run))


def test_a_light_row_holding_counts_counts_them(sampled_run, tmp_path):
    """Another writer's light row (no zeros recorded) that says it held NaNs and subnormals: the
    non-finite row counts once and its subnormals count, as a full row's would."""
    path = tmp_path / "run"
    shutil.copytree(sampled_run, path)
    segment = sorted(path.glob("*.parquet"))[0]
    table = pq.read_table(segment)
    kind, n_zero = table.column("kind").to_pylist(), table.column("n_zero").to_pylist()
    row = next(i for i, (k, z) in enumerate(zip(kind, n_zero)) if k == "param_grad" and z is None)
    name = table.column("name")[row].as_py()

    def with_value(column: str, value: int) -> None:
        nonlocal table
        values = table.column(column).to_pylist()
        values[row] = value
        at = table.schema.get_field_index(column)
        table = table.set_column(at, table.schema.field(at), pa.array(values, table.schema.field(at).type))

    with_value("n_nan", 2)
    with_value("n_inf", 0)
    with_value("n_subnormal", 3)
    pq.write_table(table.replace_schema_metadata(pq.read_schema(segment).metadata), segment)
    before, after = _scan(sampled_run), _scan(path)
    pick = lambda scan: scan.layers.set_index(["name", "kind"]).loc[(name, "param_grad")]  # noqa: E731
    assert pick(after)["nonfinite"] == pick(before)["nonfinite"] + 1
    assert pick(after)["observations"] == pick(before)["observations"]
    # (the rate is over the full rows' elements, which the light row does not change)
    full = pa.concat_tables(pq.read_table(p, columns=["name", "kind", "n_zero", "numel"]) for p in path.glob("*.parquet"))
    elements = sum(n for nm, k, z, n in zip(*(full.column(c).to_pylist() for c in ("name", "kind", "n_zero", "numel")))
                   if nm == name and k == "param_grad" and z is not None)
    assert (pick(after)["subnormal_rate"] - pick(before)["subnormal_rate"]) * elements == pytest.approx(3.0)


def test_the_two_threads_give_what_one_gives(sampled_run, monkeypatch):
    """The light rows' carry runs on a thread of its own while the next group is prepared; run
    in line, the bits are the same."""
    from concurrent.futures import Future

    class InLine:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, call, *args):
            done = Future()
            done.set_result(call(*args))
            return done

    threaded = _scan(sampled_run, group_rows=100)
    monkeypatch.setattr(layer_scan, "ThreadPoolExecutor", InLine)
    _same(threaded, _scan(sampled_run, group_rows=100))


def test_an_error_on_the_carrying_thread_is_raised_by_the_scan(sampled_run, monkeypatch):
    """A failure while carrying light rows reaches the caller, and the scan does not hang."""
    def broken(self, rows):
        raise RuntimeError("carry failed")

    monkeypatch.setattr(layer_scan._Accumulator, "carry", broken)
    with pytest.raises(RuntimeError, match="carry failed"):
        _scan(sampled_run, group_rows=100)


def test_the_measured_rows_read_by_pyarrow_give_what_the_engine_gives(sampled_run, monkeypatch):
    """The first pass reads the measured rows with the query engine; where the engine fails, even
    part way through (some rows already added), pyarrow reads them again from the start."""
    scan = _scan(sampled_run)
    assert scan.measurements
    streamed = engine.present_batches

    def failing_part_way(*args, **kwargs):
        for i, batch in enumerate(streamed(*args, **kwargs)):
            if i == 1:
                raise engine.EngineCannot("gone")
            yield batch

    monkeypatch.setattr(engine, "present_batches", failing_part_way)
    _same(scan, _scan(sampled_run))
    monkeypatch.setattr(engine, "present_batches", lambda *a, **k: (_ for _ in ()).throw(engine.EngineCannot("no")))
    _same(scan, _scan(sampled_run))


def test_the_engine_finds_the_measured_rows_pyarrow_finds(sampled_run):
    run = read_run(sampled_run)
    columns = ["step", "rank", "kind", "name", "n_underflow", "underflow_hist"]
    kinds = ["param_grad", "grad_output"]
    found = pa.Table.from_batches(list(engine.present_batches(run, columns, "n_underflow", kinds, rows=7)))
    want = pa.Table.from_batches(list(run.batches(columns, kinds=kinds, present="n_underflow")))
    assert found.num_rows == want.num_rows > 0
    for c in columns:
        got, expected = found.column(c), want.column(c)
        if pa.types.is_dictionary(expected.type):
            got, expected = got.cast(pa.string()), expected.cast(pa.string())
        assert got.to_pylist() == expected.to_pylist(), c


def test_layer_ids_come_in_the_order_of_the_codes(sampled_run):
    """Layers get ids as first met, in dictionary-code order within a batch (what np.unique gives):
    the table over the codes and the sorted way agree, ids and new layers alike."""
    batch = next(iter(read_run(sampled_run).batches(["name", "kind", "dtype"], batch_rows=200)))
    fast, slow = {}, {}
    ids = layer_scan._pair_ids(batch, fast, lambda key, row: len(fast))
    names, name_idx = layer_scan._dictionary(batch.column("name"))
    kinds, kind_idx = layer_scan._dictionary(batch.column("kind"))
    pair = name_idx.astype(np.int64) * len(kinds) + kind_idx
    again = layer_scan._pair_ids_sorted(pair, names, kinds, slow, lambda key, row: len(slow))
    assert list(fast) == list(slow) and fast == slow
    np.testing.assert_array_equal(ids, again)


def test_step_rows_kept_in_chunks_read_as_the_table(sampled_run):
    """The scan keeps the step rows in chunks without their all-null counts and histograms (light
    steps); every column, selection and filter reads as the table of the same rows."""
    from ampdoctor.analysis.layer_scan import STEP_COLUMNS
    from ampdoctor.analysis.step_rows import StepRows

    run = read_run(sampled_run)
    table = run.table(STEP_COLUMNS, kinds=["step"])
    rows = StepRows(STEP_COLUMNS)
    whole = table.combine_chunks().to_batches()[0]
    for start in range(0, table.num_rows, 3):  # (chunks of 3: some all light, some with a full row)
        rows.append(whole.slice(start, 3))
    assert any("hist" not in c.schema.names for c in rows._chunks)
    assert any("hist" in c.schema.names for c in rows._chunks)
    assert rows.num_rows == table.num_rows and rows.column_names == STEP_COLUMNS
    for name in STEP_COLUMNS:
        assert rows.column(name).equals(table.column(name).combine_chunks()), name
    assert rows.select(["step", "hist", "n_zero"]).equals(table.select(["step", "hist", "n_zero"]))
    mask = np.arange(table.num_rows) % 4 != 1
    assert rows.filter(pa.array(mask)).select(STEP_COLUMNS).equals(table.filter(pa.array(mask)))
    scan = _scan(sampled_run)
    assert isinstance(scan.step_rows, StepRows)
    assert scan.step_rows.select(STEP_COLUMNS).equals(table)
