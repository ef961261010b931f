"""The run file's ``hist`` column (schema version 2, ``ampdoctor/run_file/hist_column.py``): written and read
back through Parquet in every mix of full and light rows, and runs of schema version 1 read by the
new code. The cross-version checks with other pyarrow releases run in ``.ci/compat``."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from ampdoctor.cli.commands import main
from ampdoctor.run_file.hist_column import (HIST_TYPE, READS_V1_NULLS, BadHistogram, as_hist_column, hist_array,
                                            hist_matrix)
from ampdoctor.read.run import read_run
from ampdoctor.run_file.schema import SCHEMA_VERSION

V1_RUNS = Path(__file__).parent / "data" / "runs-v1"
PYARROW = tuple(int(p) for p in pa.__version__.split(".")[:2])


def _blocks(pattern: str, bins: int, rng: np.random.Generator) -> tuple[list[np.ndarray], np.ndarray]:
    """Writer blocks for ``pattern`` ('F': a block of full rows, 'L': a block of light rows) and the
    dense matrix they stand for (zeros on light rows)."""
    parts, dense = [], []
    for kind in pattern:
        n = int(rng.integers(1, 4))
        if kind == "F":
            block = rng.integers(0, 2**31 - 1, size=(n, bins), dtype=np.int64).astype(np.int32)
            parts.append(block)
            dense.append(block)
        else:
            parts.append(np.full(n, None, dtype=object))
            dense.append(np.zeros((n, bins), np.int32))
    return parts, np.concatenate(dense) if dense else np.zeros((0, bins), np.int32)


@pytest.mark.parametrize("pattern", ["", "F", "L", "FL", "LF", "FLF", "LFL", "LLFFLLF"])
def test_histograms_round_trip_through_parquet(tmp_path, pattern):
    rng = np.random.default_rng(len(pattern))
    bins = 64
    parts, dense = _blocks(pattern, bins, rng)
    column = hist_array(parts, bins)
    assert column.type == HIST_TYPE and len(column) == len(dense)
    path = tmp_path / "hist.parquet"
    pq.write_table(pa.table({"hist": column}), path)
    back = pq.read_table(path).column("hist")
    light = ~dense.any(axis=1)
    assert back.is_null().to_numpy(zero_copy_only=False).tolist() == light.tolist()
    np.testing.assert_array_equal(hist_matrix(as_hist_column(back, bins), bins), dense.astype(np.float32))
    # Read in small batches (sliced arrays, offsets not at 0), as the reports stream a run.
    for size in (1, 2, 3):
        rows = [hist_matrix(as_hist_column(b.column(0), bins), bins)
                for b in pq.ParquetFile(path).iter_batches(batch_size=size)]
        got = np.concatenate(rows) if rows else np.zeros((0, bins), np.float32)
        np.testing.assert_array_equal(got, dense.astype(np.float32))
    # Every histogram, as another tool sees it: a list of `bins` ints, or null.
    assert [None if v is None else len(v) for v in back.to_pylist()] == [None if e else bins for e in light]


def test_a_histogram_of_the_wrong_length_is_damage():
    column = pa.array([[1] * 64, None, [1] * 32], HIST_TYPE)
    with pytest.raises(BadHistogram, match="32 counts where hist.bins says 64"):
        as_hist_column(column, 64)
    fixed = pa.FixedSizeListArray.from_arrays(pa.array(np.ones(2 * 32, np.int32)), 32)
    with pytest.raises(BadHistogram, match="32 bins where hist.bins says 64"):
        as_hist_column(fixed, 64)


def test_version_1_columns_read_as_version_2():
    """A fixed-size list (v1) and a large list (another tool's rewrite) decode to the same matrix."""
    values = np.arange(3 * 4, dtype=np.int32)
    rows = values.reshape(3, 4).tolist()
    fixed = pa.array([rows[0], None, rows[2]], pa.list_(pa.int32(), 4))
    expected = values.reshape(3, 4).astype(np.float32)
    expected[1] = 0
    for column in (fixed, fixed.slice(1), pa.array(fixed.to_pylist(), pa.large_list(pa.int32()))):
        got = as_hist_column(column, 4)
        assert got.type == HIST_TYPE
        np.testing.assert_array_equal(hist_matrix(got, 4), expected[-len(column):])


def test_a_run_is_written_in_version_2(tmp_path):
    """A recorded run's segments say version 2 and hold a variable-length hist column whose full rows
    hold hist.bins counts and whose light rows are null."""
    result = CliRunner().invoke(main, ["demo", "--steps", "12", "--out", str(tmp_path / "run.parquet")])
    assert result.exit_code == 0, result.output
    run = read_run(tmp_path / "run.parquet")
    for segment in run.segments:
        schema = pq.read_schema(segment.path)
        assert schema.metadata[b"ampdoctor.schema_version"] == str(SCHEMA_VERSION).encode() == b"2"
        assert schema.field("hist").type == HIST_TYPE
    table = run.table(["n_zero", "hist"])
    full = table.column("n_zero").is_valid().to_numpy(zero_copy_only=False)
    lengths = [None if v is None else len(v) for v in table.column("hist").to_pylist()]
    assert full.any() and (~full).any()  # both kinds of row, at the default `every`
    assert all(n == 64 for n, f in zip(lengths, full) if f) and all(n is None for n, f in zip(lengths, full) if not f)


def _as_version_2(source: Path, target: Path) -> None:
    """``source`` (a v1 run) rewritten in v2 by plain pyarrow: the same rows and metadata, the hist
    column re-encoded from its Python values (not through ampdoctor's decoder)."""
    target.mkdir()
    for segment in sorted(source.glob("*.parquet")):
        table = pq.read_table(segment)
        hist = pa.array(table.column("hist").to_pylist(), HIST_TYPE)
        table = table.set_column(table.schema.get_field_index("hist"), "hist", hist)
        meta = {**table.schema.metadata, b"ampdoctor.schema_version": b"2"}
        pq.write_table(table.replace_schema_metadata(meta), target / segment.name)


@pytest.mark.skipif(PYARROW < READS_V1_NULLS, reason="this pyarrow cannot read v1 null histograms (next test)")
@pytest.mark.parametrize("name", ["healthy", "nan"])
def test_version_1_runs_read_as_their_version_2_rewrite(tmp_path, name):
    """Every command reads a v1 run exactly as the same rows written in v2: the two decoders agree."""
    v1 = V1_RUNS / f"{name}.parquet"
    v2 = tmp_path / f"{name}.parquet"
    _as_version_2(v1, v2)
    assert read_run(v1).metadata["ampdoctor.schema_version"] == "1"
    for command in ("report", "layers", "simulate", "postmortem", "info"):
        outputs = []
        for path in (v1, v2):
            result = CliRunner().invoke(main, [command, str(path), "--format", "json"])
            assert result.exit_code == 0, result.output
            data = json.loads(result.output)
            for key in ("path", "size_bytes", "schema_version"):
                data.pop(key, None)
            outputs.append(json.dumps(data, sort_keys=True).replace(str(v1), "RUN").replace(str(v2), "RUN"))
        assert outputs[0] == outputs[1], command
    frame = read_run(v1).frame
    full = frame["n_zero"].notna()
    assert full.any() and frame.loc[full, "hist"].map(len).eq(64).all() and frame.loc[~full, "hist"].isna().all()


@pytest.fixture
def old_pyarrow(monkeypatch):
    """The readers' view of the installed pyarrow as 25.0 (which cannot read v1 null histograms);
    its reads raise what pyarrow 14.0 to 25.0 raise on them (seen in .ci/compat, which runs the
    real ones), should a reader try."""
    from ampdoctor.run_file import hist_column

    monkeypatch.setattr(hist_column, "_pyarrow_release", lambda: (25, 0))
    monkeypatch.setattr(pa, "__version__", "25.0.1")
    error = pa.ArrowInvalid("Expected all lists to be of size=64 but index 238 had size=0")
    real_read, real_batches = pq.read_table, pq.ParquetFile.iter_batches

    def fixed(schema, rows: int) -> bool:  # an empty segment reads (the real ones do)
        return rows > 0 and "hist" in schema.names and pa.types.is_fixed_size_list(schema.field("hist").type)

    def read_table(path, *args, columns=None, **kwargs):
        if fixed(pq.read_schema(path), pq.read_metadata(path).num_rows) and (columns is None or "hist" in columns):
            raise error
        return real_read(path, *args, columns=columns, **kwargs)

    def iter_batches(self, *args, columns=None, **kwargs):
        if fixed(self.schema_arrow, self.metadata.num_rows) and (columns is None or "hist" in columns):
            raise error
        return real_batches(self, *args, columns=columns, **kwargs)

    monkeypatch.setattr(pq, "read_table", read_table)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", iter_batches)


# The fix every message names; with the install line where pyarrow 26 installs (Python >= 3.11).
FIX = "ampdoctor migrate RUN" if sys.version_info < (3, 11) else "pip install 'pyarrow>=26.0'"


def test_an_old_pyarrow_names_the_fix_for_version_1_runs(tmp_path, old_pyarrow):
    """Decided from the footers: every command says so in one line, never "damaged"."""
    run = tmp_path / "run.parquet"
    shutil.copytree(V1_RUNS / "nan.parquet", run)
    for command in ("report", "info", "postmortem", "layers", "simulate", "watch"):
        result = CliRunner().invoke(main, [command, str(run)])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, (command, result.output)
        assert "damaged" not in lines[0] and FIX in lines[0] and "`ampdoctor migrate RUN`" in lines[0]
        assert "whose histogram column pyarrow 25.0.1 cannot read" in lines[0]


def test_the_error_pyarrow_raises_is_recognised_too(tmp_path, monkeypatch):
    """Should the footer not tell (no statistics), the error pyarrow raises while reading gives
    the same line; any other error is damage, as before."""
    from ampdoctor.run_file import hist_column

    monkeypatch.setattr(hist_column, "unreadable_here", lambda *args: None)  # the footer did not say
    monkeypatch.setattr(hist_column, "_pyarrow_release", lambda: (25, 0))
    error = pa.ArrowInvalid("Expected all lists to be of size=64 but index 238 had size=0")
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", lambda *a, **k: (_ for _ in ()).throw(error))
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: (_ for _ in ()).throw(error))
    result = CliRunner().invoke(main, ["report", str(V1_RUNS / "healthy.parquet")])
    assert result.exit_code == 2 and FIX in result.output and "damaged" not in result.output
    assert hist_column.pyarrow_too_old_for(pa.ArrowInvalid("Expected all lists to be of size=64 but index 2 "
                                                           "had size=3")) is None
    assert hist_column.pyarrow_too_old_for(OSError("Permission denied")) is None


def test_the_fix_fits_the_environment(monkeypatch):
    from ampdoctor.run_file import hist_column

    import numpy
    monkeypatch.setattr(hist_column.sys, "version_info", (3, 11, 7))
    monkeypatch.setattr(numpy, "__version__", "1.26.4")
    assert "pip install 'pyarrow>=26.0' 'numpy>=2'" in hist_column._too_old_message()
    monkeypatch.setattr(numpy, "__version__", "2.1.0")
    assert "pip install 'pyarrow>=26.0', or" in hist_column._too_old_message()
    monkeypatch.setattr(hist_column.sys, "version_info", (3, 10, 13))
    message = hist_column._too_old_message()
    assert "on Python >= 3.11" in message and "pip install" not in message and "ampdoctor migrate RUN" in message


@pytest.mark.skipif(PYARROW >= READS_V1_NULLS, reason="this pyarrow reads v1 runs (previous tests)")
def test_this_pyarrow_refuses_version_1_runs_in_one_line():
    for name in ("nan", "healthy"):
        result = CliRunner().invoke(main, ["report", str(V1_RUNS / f"{name}.parquet")])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and "damaged" not in lines[0]
        assert f"whose histogram column pyarrow {pa.__version__} cannot read" in lines[0]


def _continued(tmp_path, **options) -> Path:
    """The v1 nan run (steps 0..149) continued by the current code at step 150: one run whose
    segments are of both versions (a job resumed after an upgrade)."""
    from models import train_recorded

    run = tmp_path / "run.parquet"
    shutil.copytree(V1_RUNS / "nan.parquet", run)
    train_recorded(run, steps=12, start_step=150, every=5, **options)
    return run


@pytest.mark.skipif(PYARROW < READS_V1_NULLS, reason="this pyarrow cannot read v1 null histograms")
def test_a_run_continued_after_the_upgrade_reads_as_one(tmp_path):
    run = read_run(_continued(tmp_path))
    versions = {s.metadata["ampdoctor.schema_version"] for s in run.segments}
    assert versions == {"1", "2"} and len({s.metadata["run.id"] for s in run.segments}) == 1
    steps = run.table(["step", "kind"], kinds=["step"]).column("step").to_pylist()
    assert sorted(steps) == list(range(162))
    assert run.table(["hist"]).column("hist").type == HIST_TYPE
    result = CliRunner().invoke(main, ["report", str(run.path), "--format", "json"])
    assert result.exit_code == 0 and json.loads(result.output)["run"]["steps"] == 162


def test_a_run_continued_after_the_upgrade_keeps_its_new_steps_under_an_old_pyarrow(tmp_path, old_pyarrow):
    """The v1 segments are skipped whole (no command uses part of one), each named with the fix, in
    every command's output, and the rest is reported: the postmortem does not call the run healthy
    without saying it could not see the steps where the loss went NaN."""
    path = _continued(tmp_path)
    # The v1 segments with rows (an empty one, the final segment, is read: there is nothing in it).
    v1 = sorted(p for p in (V1_RUNS / "nan.parquet").glob("*.parquet") if pq.read_metadata(p).num_rows)
    assert len(v1) == 6
    for command, where in (("report", "warnings"), ("postmortem", "notes"), ("layers", "warnings"),
                           ("simulate", "notes"), ("info", "warnings")):
        result = CliRunner().invoke(main, [command, str(path), "--format", "json"])
        assert result.exit_code == 0, (command, result.output)
        data = json.loads(result.output)
        skipped = [w for w in data[where] if w.startswith("skipped segment ")]
        assert len(skipped) == len(v1) and all(FIX in w for w in skipped), (command, data[where])
    assert json.loads(CliRunner().invoke(main, ["info", str(path), "--format", "json"]).output)["steps"] == 12
    text = CliRunner().invoke(main, ["layers", str(path)]).output
    assert f"warning: skipped segment {v1[0].name}" in text
    pytest.importorskip("tensorboard")
    exported = CliRunner().invoke(main, ["export", str(path), "--tensorboard", str(tmp_path / "tb"), "--format", "json"])
    assert exported.exit_code == 0, exported.output
    assert sum(w.startswith("skipped segment ") for w in json.loads(exported.output)["warnings"]) == len(v1)


def test_a_run_resumed_with_other_histogram_bins_skips_those_segments(tmp_path):
    """Histograms of another length cannot be added up with the run's: those segments are skipped,
    named, and the rest is read (before, every command failed on the shapes)."""
    from models import train_recorded

    run = tmp_path / "run.parquet"
    train_recorded(run, steps=10, every=2)
    time.sleep(1.05)  # the resumed process starts in a later second, as a resumed job does (run.started)
    train_recorded(run, steps=6, start_step=10, every=2, hist_bins=32)
    for command in ("report", "layers", "postmortem", "simulate"):
        result = CliRunner().invoke(main, [command, str(run), "--format", "json"])
        assert result.exit_code == 0, (command, result.output)
        data = json.loads(result.output)
        text = json.dumps(data)
        assert "histograms of 32 bins where the run has 64 (hist.bins)" in text, command
    assert json.loads(CliRunner().invoke(main, ["info", str(run), "--format", "json"]).output)["steps"] == 10


def test_the_histogram_length_is_read_from_the_footer(tmp_path):
    """Version 2's footer statistics give the length, over several row groups, all-null ones and
    none; without statistics the metadata says."""
    from ampdoctor.run_file.segment import _hist_statistics, _list_size

    column = hist_array([np.ones((3, 16), np.int64), np.full(5, None, dtype=object), np.ones((2, 16), np.int64)], 16)
    table = pa.table({"hist": column})
    for group_rows in (1, 2, 3, 100):
        path = tmp_path / f"g{group_rows}.parquet"
        pq.write_table(table, path, row_group_size=group_rows)
        footer = pq.read_metadata(path)
        assert _list_size(_hist_statistics(footer, pq.read_schema(path))) == 16
    path = tmp_path / "nostats.parquet"
    pq.write_table(table, path, write_statistics=False)
    assert _list_size(_hist_statistics(pq.read_metadata(path), pq.read_schema(path))) is None
    path = tmp_path / "light.parquet"
    pq.write_table(pa.table({"hist": hist_array([np.full(4, None, dtype=object)], 16)}), path)
    assert _list_size(_hist_statistics(pq.read_metadata(path), pq.read_schema(path))) is None


def test_a_null_count_inside_a_histogram_is_damage():
    with pytest.raises(BadHistogram, match="null count"):
        as_hist_column(pa.array([[1, None, 3]], HIST_TYPE), 3)


def _json(command: str, path: Path) -> str:
    result = CliRunner().invoke(main, [command, str(path), "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    for key in ("path", "size_bytes", "schema_version"):
        data.pop(key, None)
    return json.dumps(data, sort_keys=True).replace(str(path), "RUN")


@pytest.mark.skipif(PYARROW < READS_V1_NULLS, reason="converting needs a pyarrow that reads v1 null histograms")
def test_migrate_converts_a_version_1_run_in_place(tmp_path):
    """Every segment becomes v2, and every command reads the result exactly as the same rows
    re-encoded by plain pyarrow; a second migrate has nothing left to do."""
    run, reference = tmp_path / "run.parquet", tmp_path / "reference.parquet"
    shutil.copytree(V1_RUNS / "nan.parquet", run)
    _as_version_2(V1_RUNS / "nan.parquet", reference)
    result = CliRunner().invoke(main, ["migrate", str(run)])
    assert result.exit_code == 0 and result.output.startswith("Converted 7 segment(s) of ") and "0 already" in result.output
    for segment in run.glob("*.parquet"):
        schema = pq.read_schema(segment)
        assert schema.metadata[b"ampdoctor.schema_version"] == b"2" and schema.field("hist").type == HIST_TYPE
        original = pq.read_schema(V1_RUNS / "nan.parquet" / segment.name).metadata
        assert {k: v for k, v in schema.metadata.items() if k not in (b"ampdoctor.schema_version", b"ARROW:schema")} \
            == {k: v for k, v in original.items() if k not in (b"ampdoctor.schema_version", b"ARROW:schema")}
    assert not list(run.glob(".*"))  # no temporary file left
    for segment in run.glob("*.parquet"):  # times and modes kept: readers order writers by them
        original = (V1_RUNS / "nan.parquet" / segment.name).stat()
        assert (segment.stat().st_mtime, segment.stat().st_mode) == (original.st_mtime, original.st_mode)
    for command in ("report", "layers", "simulate", "postmortem", "info"):
        assert _json(command, run) == _json(command, reference), command
    again = CliRunner().invoke(main, ["migrate", str(run)])
    assert again.exit_code == 0 and "Converted 0 segment(s)" in again.output and "7 already were" in again.output


def test_migrate_under_an_old_pyarrow_says_where_to_run_it(tmp_path, old_pyarrow):
    run = tmp_path / "run.parquet"
    shutil.copytree(V1_RUNS / "healthy.parquet", run)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    result = CliRunner().invoke(main, ["migrate", str(run)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1
    assert "cannot convert here" in lines[0] and "where pyarrow >= 26 is installed" in lines[0]
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_counts_past_two_to_the_31_survive(tmp_path):
    """The step row's histogram sums every gradient of the step: a model with more than 2**31
    elements in one binade wrapped an int32 (version 1); version 2's int64 counts keep it."""
    from ampdoctor.stats.host_stats import HostStats

    per_tensor = HostStats.concat([HostStats.empty(4), HostStats.empty(4)])
    per_tensor.hist[:, 1] = [1_500_000_000, 1_000_000_000]
    total = per_tensor.total().hist
    assert total.dtype == np.int64 and total[0, 1] == 2_500_000_000
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"hist": hist_array([total], 4)}), path)
    back = pq.read_table(path).column("hist")
    assert back.to_pylist() == [[0, 2_500_000_000, 0, 0]]
    assert hist_matrix(as_hist_column(back, 4), 4)[0, 1] == np.float32(2.5e9)


def test_a_segment_of_more_counts_than_int32_offsets_address_is_a_large_list(tmp_path, monkeypatch):
    """Past 2**31 counts in one segment (module rows of a large model at full detail) the column is
    written as a large list, and read back as the same histograms (the threshold made small here)."""
    from ampdoctor.run_file import hist_column

    monkeypatch.setattr(hist_column, "LIST_VALUES", 100)
    rng = np.random.default_rng(3)
    parts, dense = _blocks("FLFF", 64, rng)
    column = hist_array(parts, 64)
    assert pa.types.is_large_list(column.type)
    path = tmp_path / "large.parquet"
    pq.write_table(pa.table({"hist": column}), path)
    back = as_hist_column(pq.read_table(path).column("hist"), 64)
    assert pa.types.is_large_list(back.type)  # still past the (small) threshold: kept large
    np.testing.assert_array_equal(hist_matrix(back, 64), dense.astype(np.float32))
    monkeypatch.setattr(hist_column, "LIST_VALUES", 2**31)
    assert as_hist_column(back, 64).type == HIST_TYPE  # a batch that fits: one type with the others


def test_the_footer_decides_which_version_1_segments_this_pyarrow_cannot_read(monkeypatch):
    from ampdoctor.run_file import hist_column

    fixed, listed = pa.list_(pa.int32(), 64), HIST_TYPE
    monkeypatch.setattr(hist_column, "_pyarrow_release", lambda: (25, 0))
    assert hist_column.unreadable_here(fixed, 3) and hist_column.unreadable_here(fixed, None)  # None: unknown
    assert hist_column.unreadable_here(fixed, 0) is None       # no null row: every pyarrow reads it
    assert hist_column.unreadable_here(listed, 3) is None      # version 2
    assert hist_column.unreadable_here(None, None) is None     # no hist column
    monkeypatch.setattr(hist_column, "_pyarrow_release", lambda: (26, 0))
    assert hist_column.unreadable_here(fixed, 3) is None
