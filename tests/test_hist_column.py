"""The run file's ``hist`` column (schema version 2, ``ampdoctor/hist_column.py``): written and read
back through Parquet in every mix of full and light rows, and runs of schema version 1 read by the
new code. The cross-version checks with other pyarrow releases run in ``.ci/compat``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from ampdoctor.cli import main
from ampdoctor.hist_column import (HIST_TYPE, READS_V1_NULLS, BadHistogram, as_hist_column, hist_array, hist_matrix,
                                   pyarrow_too_old_for)
from ampdoctor.run import read_run
from ampdoctor.schema import SCHEMA_VERSION

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


def test_an_old_pyarrow_names_the_fix_for_version_1_runs(tmp_path, monkeypatch):
    """What a pyarrow before 26 raises on a v1 null histogram (the exact message of 14.0 to 25.0,
    seen in .ci/compat) becomes one line naming the version that reads it, not "damaged"."""
    run = tmp_path / "run.parquet"
    shutil.copytree(V1_RUNS / "healthy.parquet", run)
    error = pa.ArrowInvalid("Expected all lists to be of size=64 but index 238 had size=0")
    real = pq.read_table

    def old_pyarrow(path, *args, columns=None, **kwargs):
        if columns is None or "hist" in columns:
            raise error
        return real(path, *args, columns=columns, **kwargs)

    real_batches = pq.ParquetFile.iter_batches

    def old_pyarrow_batches(self, *args, columns=None, **kwargs):
        if columns is None or "hist" in columns:
            raise error
        return real_batches(self, *args, columns=columns, **kwargs)

    monkeypatch.setattr(pq, "read_table", old_pyarrow)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", old_pyarrow_batches)
    for command in ("report", "info", "postmortem"):
        result = CliRunner().invoke(main, [command, str(run)])
        assert result.exit_code == 2
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "damaged" not in lines[0]
        assert f"whose histogram column pyarrow {pa.__version__} cannot read" in lines[0]
        assert "pip install 'pyarrow>=26.0'" in lines[0]
    assert pyarrow_too_old_for(pa.ArrowInvalid("Expected all lists to be of size=64 but index 2 had size=3")) is None
    assert pyarrow_too_old_for(OSError("Permission denied")) is None


@pytest.mark.skipif(PYARROW >= READS_V1_NULLS, reason="this pyarrow reads v1 runs (previous tests)")
def test_this_pyarrow_refuses_version_1_runs_in_one_line():
    result = CliRunner().invoke(main, ["report", str(V1_RUNS / "nan.parquet")])
    assert result.exit_code == 2 and "pip install 'pyarrow>=26.0'" in result.output


def _continued(tmp_path) -> Path:
    """The v1 healthy run (steps 0..39) continued by the current code at step 40: one run whose
    segments are of both versions (a job resumed after an upgrade)."""
    from models import train_recorded

    run = tmp_path / "run.parquet"
    shutil.copytree(V1_RUNS / "healthy.parquet", run)
    train_recorded(run, steps=12, start_step=40, every=5)
    return run


@pytest.mark.skipif(PYARROW < READS_V1_NULLS, reason="this pyarrow cannot read v1 null histograms")
def test_a_run_continued_after_the_upgrade_reads_as_one(tmp_path):
    run = read_run(_continued(tmp_path))
    versions = {s.metadata["ampdoctor.schema_version"] for s in run.segments}
    assert versions == {"1", "2"} and len({s.metadata["run.id"] for s in run.segments}) == 1
    steps = run.table(["step", "kind"], kinds=["step"]).column("step").to_pylist()
    assert sorted(steps) == list(range(52))
    assert run.table(["hist"]).column("hist").type == HIST_TYPE
    result = CliRunner().invoke(main, ["report", str(run.path), "--format", "json"])
    assert result.exit_code == 0 and json.loads(result.output)["run"]["steps"] == 52


def test_a_run_continued_after_the_upgrade_keeps_its_new_steps_under_an_old_pyarrow(tmp_path, monkeypatch):
    """An old pyarrow skips the v1 segments, each named with the fix, and reports the rest."""
    path = _continued(tmp_path)
    real = pq.ParquetFile.iter_batches

    def old_pyarrow(self, *args, columns=None, **kwargs):
        if "fixed_size_list" in str(self.schema_arrow.field("hist").type) and (columns is None or "hist" in columns):
            raise pa.ArrowInvalid("Expected all lists to be of size=64 but index 3 had size=0")
        return real(self, *args, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", old_pyarrow)
    result = CliRunner().invoke(main, ["report", str(path), "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["run"]["steps"] == 12
    skipped = [w for w in data["warnings"] if w.startswith("skipped segment ")]
    assert len(skipped) == 1 and "pip install 'pyarrow>=26.0'" in skipped[0]
