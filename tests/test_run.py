"""Loading runs: every kind of bad input is a one-line RunError; damaged segments are skipped."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import ampdoctor
from ampdoctor.errors import RunError
from ampdoctor.read.run import describe, read_run
from ampdoctor.run_file.schema import COLUMNS, META_SCHEMA_VERSION
from models import MLP, batches, mse


def record(path, steps=6, flush_every=2, **options):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampdoctor.GradScaler("cpu", model=model, path=path, flush_every=flush_every, **options) as scaler:
        for x, y in batches(steps):
            scaler.scale(mse(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return path


def test_run_reads_with_plain_pandas_and_pyarrow(run_path):
    record(run_path)
    df = pd.read_parquet(run_path)  # the run is a public format: no ampdoctor needed to read it
    assert list(df.columns) == list(COLUMNS)
    # Per step: the step row and 6 parameter gradients; the parameter check at step 0 (sampled)
    # and at the end of the run.
    assert len(df) == 6 * 7 + 2 and sorted(df[df.kind == "param"].step) == [0, 5]
    meta = pq.read_schema(next(run_path.glob("*.parquet"))).metadata
    for key in ("ampdoctor.schema_version", "scaler.init_scale", "amp.dtype", "hist.bins", "run.id",
                "world_size", "torch.version", "device", "run.started", "hist.min_exp"):
        assert key.encode() in meta, key


def test_load_returns_frame_with_metadata(run_path):
    record(run_path)
    df = ampdoctor.load(run_path)
    assert df.attrs["metadata"]["amp.dtype"] == "float16"
    assert df.attrs["metadata"]["scaler.init_scale"] == "65536.0"
    steps = df[df.kind == "step"]
    assert steps.numel.iloc[0] == sum(p.numel() for p in MLP().parameters())
    detailed = steps[steps.n_zero.notna()]  # every 50th step by default, and step 0
    assert list(detailed.step) == [0] and detailed["hist"].map(len).eq(64).all()
    assert steps[steps.n_zero.isna()]["hist"].isna().all() and steps.l2.notna().all()


def test_describe(run_path):
    record(run_path)
    info = describe(read_run(run_path))
    assert info["steps"] == 6 and info["first_step"] == 0 and info["last_step"] == 5
    assert info["tensors"] == 6 and info["ranks"] == [0] and info["ended_cleanly"]
    assert info["kinds"] == {"step": 6, "param_grad": 36, "param": 2}
    assert info["segments"] == 4  # three of two steps, and the empty final one written by close()


def test_missing_path():
    with pytest.raises(RunError, match="no such file"):
        read_run("/nonexistent/run.parquet")


def test_not_parquet(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    with pytest.raises(RunError, match="not a Parquet file"):
        read_run(f)


def test_parquet_from_another_tool(tmp_path):
    f = tmp_path / "other.parquet"
    pd.DataFrame({"a": [1, 2]}).to_parquet(f)
    with pytest.raises(RunError, match="another tool"):
        read_run(f)
    d = tmp_path / "dataset"
    d.mkdir()
    shutil.copy(f, d / "part-0.parquet")
    with pytest.raises(RunError, match="another tool"):
        read_run(d)


def test_newer_schema_version(run_path):
    record(run_path)
    seg = sorted(run_path.glob("*.parquet"))[0]
    table = pq.read_table(seg)
    meta = dict(table.schema.metadata)
    meta[META_SCHEMA_VERSION.encode()] = b"99"
    pq.write_table(table.replace_schema_metadata(meta), seg)
    with pytest.raises(RunError, match="schema version 99.*upgrade"):
        read_run(run_path)


def test_empty_directory(tmp_path):
    with pytest.raises(RunError, match="empty directory"):
        read_run(tmp_path)


def test_empty_run(run_path):
    ampdoctor.GradScaler("cpu", path=run_path).close()
    with pytest.raises(RunError, match="empty run"):
        read_run(run_path)


def test_truncated_segment_is_skipped_and_the_rest_is_read(run_path):
    record(run_path)
    first = sorted(run_path.glob("*.parquet"))[0]
    first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
    run = read_run(run_path)
    assert len(run.warnings) == 1 and "truncated" in run.warnings[0] and first.name in run.warnings[0]
    assert sorted(run.frame.query("kind == 'step'").step) == [2, 3, 4, 5]


def test_segment_in_progress_is_invisible(run_path):
    record(run_path)
    (run_path / ".part-r00000-x-000009.parquet.tmp").write_bytes(b"PAR1 half written")
    assert len(read_run(run_path).frame.query("kind == 'step'")) == 6
    assert len(pd.read_parquet(run_path).query("kind == 'step'")) == 6


def test_single_segment_file(run_path):
    record(run_path)
    seg = sorted(run_path.glob("*.parquet"))[0]
    assert len(read_run(seg).frame.query("kind == 'step'")) == 2
    truncated = run_path.parent / "cut.parquet"
    truncated.write_bytes(seg.read_bytes()[:-10])
    with pytest.raises(RunError, match="truncated"):
        read_run(truncated)


# -- one run per run id (issue 16) --------------------------------------------------------------------

def _train_scaler(scaler, model, steps, seed=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in batches(steps, seed=seed):
        scaler.scale(mse(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_a_new_run_on_a_reused_path_is_kept_apart(run_path):
    """A script run twice with the same path: two runs in one directory, never mixed. Readers
    take the latest and say so; --run (a run id or its prefix) picks the other."""
    import time as _time

    from click.testing import CliRunner

    from ampdoctor.cli.commands import main
    from ampdoctor.analysis.report import report_data

    record(run_path, steps=6, init_scale=2.0**24)  # skips its first steps
    first = read_run(run_path).metadata["run.id"]
    _time.sleep(1.1)  # run.started has a resolution of one second
    record(run_path, steps=4)
    run = read_run(run_path)
    second = run.metadata["run.id"]
    assert second != first
    assert sorted(run.frame.loc[run.frame.kind == "step", "step"]) == [0, 1, 2, 3]
    assert any("holds 2 runs; reading the latest" in w and first in w for w in run.warnings)
    report = report_data(run)
    assert report["scale"]["skipped_steps"] == 0 and report["run"]["scaler"]["init_scale"] == 2.0**16
    older = read_run(run_path, first[:8])
    assert older.metadata["run.id"] == first and older.warnings == []
    assert report_data(older)["scale"]["skipped_steps"] > 0
    cli = CliRunner()
    result = cli.invoke(main, ["info", str(run_path), "--run", first[:8], "--format", "json"])
    assert result.exit_code == 0 and json.loads(result.output)["run_ids"] == [first]
    result = cli.invoke(main, ["report", str(run_path), "--run", "nope"])
    assert result.exit_code == 2 and "no run matches 'nope'" in result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output


def test_a_resumed_run_continues_the_same_run(run_path):
    """The scaler's state_dict carries the run id and the step: loading it in a new scaler
    (a restart from a checkpoint) appends to the same run, steps continuing."""
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=run_path)
    _train_scaler(scaler, model, 5)
    checkpoint = scaler.state_dict()
    scaler.close()
    resumed = ampdoctor.GradScaler("cpu", model=model, path=run_path)
    resumed.load_state_dict(checkpoint)
    _train_scaler(resumed, model, 3, seed=2)
    resumed.close()
    run = read_run(run_path)
    assert run.warnings == []
    assert len({s.metadata["run.id"] for s in run.segments}) == 1
    assert sorted(run.frame.loc[run.frame.kind == "step", "step"]) == list(range(8))


def test_a_restart_from_step_0_in_the_same_run_supersedes_the_first(run_path, monkeypatch):
    """Two processes with the same run id (AMPDOCTOR_RUN_ID) both recording from step 0: the later
    one's steps are read, never both, and the reader says so."""
    monkeypatch.setenv("AMPDOCTOR_RUN_ID", "shared")
    record(run_path, steps=4)
    record(run_path, steps=3)
    run = read_run(run_path)
    assert any("rank 0: steps 0..3 were recorded again by a later process" in w for w in run.warnings), run.warnings
    steps = run.frame.loc[run.frame.kind == "step", "step"]
    assert sorted(steps) == [0, 1, 2]


def test_resuming_from_an_older_checkpoint_reads_each_step_once(run_path):
    """Checkpoint at step 5, crash at step 9, resume from the checkpoint: steps 5..9 of the crashed
    process were rolled back; the resumed process's are the ones read (10 step rows for 10 steps)."""
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=run_path, flush_every=1)
    _train_scaler(scaler, model, 5)
    checkpoint = scaler.state_dict()
    _train_scaler(scaler, model, 5, seed=3)  # steps 5..9, then the process dies
    scaler.recorder.writer.close()  # what reached the disk before the crash
    resumed = ampdoctor.GradScaler("cpu", model=model, path=run_path)
    resumed.load_state_dict(checkpoint)
    _train_scaler(resumed, model, 5, seed=2)
    resumed.close()
    run = read_run(run_path)
    frame = run.frame
    assert sorted(frame.loc[frame.kind == "step", "step"]) == list(range(10))
    assert any("rank 0: steps 5..9 were recorded again by a later process" in w for w in run.warnings)
    from ampdoctor.analysis.report import report_data
    assert report_data(run)["run"]["steps"] == 10


def test_ranks_that_cannot_share_a_run_id_are_warned_about(run_path, monkeypatch):
    """WORLD_SIZE=2 but no process group yet and no AMPDOCTOR_RUN_ID: each rank would make its own
    run id; the scaler says so at construction."""
    import warnings as _warnings

    for key in ("AMPDOCTOR_RUN_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        scaler = ampdoctor.GradScaler("cpu", path=run_path)
    scaler.close()
    assert any("cannot agree on one run id" in str(w.message) for w in caught)


# -- one segment's footer (ampdoctor.run_file.segment), without recording ----------------------------------------

def _segment_file(path, metadata, steps=(3, 4, 5), version=2):
    """A hand-written segment of step rows, with ``metadata`` (strings) in its footer."""
    from ampdoctor.read.run import empty_table

    empty = empty_table()
    columns = {name: pa.array([None] * len(steps), empty.schema.field(name).type) for name in empty.column_names}
    columns.update(step=pa.array(steps, pa.int64()), rank=pa.array([0] * len(steps), pa.int32()),
                   kind=pa.array(["step"] * len(steps)).dictionary_encode(),
                   name=pa.array([""] * len(steps)).dictionary_encode(),
                   dtype=pa.array([""] * len(steps)).dictionary_encode(),
                   numel=pa.array([0] * len(steps), pa.int64()), scale=pa.array([1.0] * len(steps), pa.float32()),
                   skipped=pa.array([False] * len(steps)))
    schema = empty.schema
    if version == 1:  # version 1's histogram column: a fixed-size list
        schema = schema.set(schema.get_field_index("hist"), pa.field("hist", pa.list_(pa.int32(), 64)))
    table = pa.table(columns).cast(schema)
    meta = {META_SCHEMA_VERSION: str(version), **metadata}
    pq.write_table(table.replace_schema_metadata({k.encode(): v.encode() for k, v in meta.items()}), path)
    return path


def test_a_segment_is_read_from_its_footer_and_its_bad_metadata_ignored(tmp_path):
    from ampdoctor.run_file.schema import META_AMP_DTYPE, META_GROWTH_INTERVAL, META_HIST_BINS, META_INIT_SCALE
    from ampdoctor.run_file.segment import read_segment

    bad = {META_INIT_SCALE: "-1", META_GROWTH_INTERVAL: "2000", META_AMP_DTYPE: "float8", META_HIST_BINS: "32"}
    path = _segment_file(tmp_path / "part.parquet", bad)
    segment, ignored = read_segment(path, single=True)
    assert (segment.rows, segment.steps, segment.size) == (3, (3, 5), path.stat().st_size)
    assert segment.metadata[META_GROWTH_INTERVAL] == "2000"
    assert META_INIT_SCALE not in segment.metadata and META_AMP_DTYPE not in segment.metadata
    # Version 2 without a histogram in the segment: the metadata says how many bins.
    assert segment.metadata[META_HIST_BINS] == "32" and segment.hist_bins == 32
    assert len(ignored) == 2 and ignored[0] == "ignored metadata scaler.init_scale='-1' (not a positive float32)"
    assert ignored[1].startswith("ignored metadata amp.dtype='float8' (not one of float16, bfloat16, ")
    # Version 1: the fixed-size column's own size wins over the metadata.
    segment, ignored = read_segment(_segment_file(tmp_path / "v1.parquet", bad, version=1), single=True)
    assert segment.metadata[META_HIST_BINS] == "64" and segment.hist_bins == 64
    assert len(ignored) == 3 and ignored[2] == "ignored metadata hist.bins='32' (the hist column has 64 bins)"


def test_a_damaged_segment_is_a_run_error_alone_and_skippable_in_a_directory(tmp_path):
    from ampdoctor.run_file.segment import BadSegment, ForeignParquet, read_segment

    path = _segment_file(tmp_path / "part.parquet", {})
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(RunError, match="truncated Parquet file"):
        read_segment(path, single=True)
    with pytest.raises(BadSegment, match="truncated"):
        read_segment(path, single=False)
    other = tmp_path / "other.parquet"
    pd.DataFrame({"a": [1]}).to_parquet(other)
    with pytest.raises(ForeignParquet):
        read_segment(other, single=False)


def test_a_resumed_recording_continues_the_run_the_reader_reads(run_path):
    """The run a recording resumes (``start_step`` > 0) is the one ``read_run`` reads by default:
    both take the latest run by one rule (``run_file.names``), from the footers the reader accepts.
    A later-started segment the reader skips (a column of another type) is no run to continue."""
    from pathlib import Path

    from ampdoctor.run_file.names import latest_run_id

    record(run_path, steps=4)
    first = read_run(run_path).metadata["run.id"]
    table = pq.read_table(sorted(Path(run_path).glob("*.parquet"))[0])
    meta = dict(table.schema.metadata)
    meta.update({b"run.id": b"skipped-run", b"run.started": b"2099-01-01T00:00:00+0000"})
    step = table.schema.get_field_index("step")
    bad = table.set_column(step, "step", pa.array([str(s) for s in table["step"].to_pylist()]))
    pq.write_table(bad.replace_schema_metadata(meta), Path(run_path) / "part-r00000-later-000000.parquet")
    assert read_run(run_path).metadata["run.id"] == first
    assert latest_run_id(run_path) == first
    record(run_path, steps=2, start_step=4)  # resumed: the same run, its step numbers continued
    run = read_run(run_path)
    assert run.metadata["run.id"] == first
    assert sorted(run.frame.loc[run.frame.kind == "step", "step"]) == [0, 1, 2, 3, 4, 5]
    # a newer schema version than this ampdoctor reads: the reader refuses it, a resume starts anew
    newer = {**meta, META_SCHEMA_VERSION.encode(): b"99", b"run.id": b"newer-run"}
    for f in Path(run_path).glob("*.parquet"):
        f.unlink()
    pq.write_table(table.replace_schema_metadata(newer), Path(run_path) / "part-r00000-newer-000000.parquet")
    assert latest_run_id(run_path) is None
