"""Bad runs get clear answers: every command, on every kind of damaged or foreign run, exits with
one line and code 2, or reports what is readable (code 0) with a warning; never an internal error,
a traceback or a hang (issue 16)."""

from __future__ import annotations

import json
import os
import shutil
import signal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from ampdoctor.cli import main
from test_run import record

COMMANDS = (["info"], ["report"], ["report", "--format", "html"], ["postmortem"], ["simulate"], ["layers"])


def _drop(column):
    return lambda table, meta: (table.drop_columns([column]), meta)


def _column(column, values):
    def change(table, meta):
        i = table.schema.get_field_index(column)
        return table.set_column(i, column, values(table.column(column))), meta
    return change


def _meta(key, value: bytes):
    return lambda table, meta: (table, {**meta, key.encode(): value})


def _nan(column):
    return _column(column, lambda c: pa.array(np.full(len(c), np.nan), c.type))


# name -> (how each segment is changed, what the commands may answer: 2, or 0 with a warning)
MUTATIONS = {
    **{f"no {c} column": (_drop(c), {2}) for c in ("step", "rank", "kind", "name", "skipped", "scale")},
    **{f"no {c} column": (_drop(c), {0}) for c in ("amax", "hist", "numel", "loss", "n_zero")},
    "step as text": (_column("step", lambda c: pc.cast(c, pa.string())), {2}),
    "scale as text": (_column("scale", lambda c: pc.cast(c, pa.string())), {2}),
    "skipped as int": (_column("skipped", lambda c: pc.cast(c, pa.int64())), {2}),
    # No step row left to replay: simulate says so (2); the other commands report the rest (0).
    "NaN scale": (_nan("scale"), {0, 2}),
    "NaN amax": (_nan("amax"), {0}),
    "NaN l2": (_nan("l2"), {0}),
    "non-UTF-8 metadata": (_meta("scaler.init_scale", b"\xff\xfe"), {0}),
    **{f"{key}={value.decode()}": (_meta(key, value), {0}) for key, value in [
        ("hist.bins", b"100000"), ("hist.bins", b"-3"), ("hist.bins", b"abc"), ("hist.min_exp", b"9999"),
        ("scaler.growth_interval", b"0"), ("scaler.growth_interval", b"abc"), ("scaler.backoff_factor", b"2"),
        ("scaler.growth_factor", b"0.5"), ("scaler.init_scale", b"-1"), ("scaler.init_scale", b"inf"),
        ("world_size", b"-1"), ("world_size", b"abc"), ("amp.dtype", b"float7"), ("record.level", b"weird"),
        ("record.dropped_steps", b"x")]},
}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return record(tmp_path_factory.mktemp("good") / "run.parquet", steps=6, level="full", init_scale=2.0**24)


def _copy(good, tmp_path):
    dst = tmp_path / "run.parquet"
    shutil.copytree(good, dst)
    return dst


def _answers(path) -> list[tuple[list[str], int, str]]:
    """Each command's exit code and output; a hang fails the test (20 s alarm per command)."""
    def hang(signum, frame):
        raise TimeoutError("the command hung")

    out = []
    previous = signal.signal(signal.SIGALRM, hang)
    try:
        for command in COMMANDS:
            signal.alarm(20)
            try:
                result = CliRunner().invoke(main, command + [str(path)])
            finally:
                signal.alarm(0)
            assert not isinstance(result.exception, TimeoutError), (command, "hung")
            out.append((command, result.exit_code, result.output.strip()))
    finally:
        signal.signal(signal.SIGALRM, previous)
    return out


def _check(answers, expected: set[int]) -> None:
    for command, code, output in answers:
        assert "internal error" not in output and "Traceback" not in output, (command, output)
        assert code in expected, (command, code, output)
        if code == 2:
            assert output.count("\n") == 0 and output.startswith("Error: "), (command, output)


@pytest.mark.parametrize("name", MUTATIONS)
def test_a_damaged_run_gets_a_clear_answer(good, tmp_path, name):
    change, expected = MUTATIONS[name]
    path = _copy(good, tmp_path)
    for segment in path.glob("*.parquet"):
        table = pq.read_table(segment)
        changed, meta = change(table.replace_schema_metadata(None), dict(table.schema.metadata))
        pq.write_table(changed.replace_schema_metadata(meta), segment)
    answers = _answers(path)
    _check(answers, expected)
    if "metadata" in name or "=" in name:
        report = json.loads(CliRunner().invoke(main, ["report", str(path), "--format", "json"]).output)
        assert any("ignored metadata" in w for w in report["warnings"]), report["warnings"]


def _damage(segment, start, length=300):
    data = bytearray(segment.read_bytes())
    data[start:start + length] = os.urandom(length)
    segment.write_bytes(bytes(data))


def test_segments_with_damaged_data_pages_are_no_run(good, tmp_path):
    """Every footer intact, every data page damaged: no readable segment (exit 2), not a report of
    0 steps that blames level='steps'."""
    path = _copy(good, tmp_path)
    for segment in path.glob("*.parquet"):
        _damage(segment, 8)
    answers = _answers(path)
    _check(answers, {2})
    assert all("no readable segments" in output for _, _, output in answers[1:])


def test_one_damaged_segment_is_skipped_with_a_warning(good, tmp_path):
    path = _copy(good, tmp_path)
    _damage(sorted(path.glob("*.parquet"))[0], 8)
    _check(_answers(path), {0})
    report = json.loads(CliRunner().invoke(main, ["report", str(path), "--format", "json"]).output)
    assert any(w.startswith("skipped unreadable segment") for w in report["warnings"])


def test_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "run.parquet"
    os.mkfifo(fifo)
    answers = _answers(fifo)
    _check(answers, {2})
    assert all("not a regular file" in output for _, _, output in answers)


def test_histogram_bins_that_do_not_match_the_column_are_ignored(good, tmp_path):
    """``hist.bins`` in range but not the hist column's own size: the column's is used, once warned."""
    path = _copy(good, tmp_path)
    for segment in path.glob("*.parquet"):
        table = pq.read_table(segment)
        meta = {**table.schema.metadata, b"hist.bins": b"32"}
        pq.write_table(table.replace_schema_metadata(meta), segment)
    _check(_answers(path), {0})
    report = json.loads(CliRunner().invoke(main, ["report", str(path), "--format", "json"]).output)
    assert sum("hist.bins='32'" in w for w in report["warnings"]) == 1, report["warnings"]


def test_a_directory_that_cannot_be_listed_gets_one_line(good, tmp_path, monkeypatch):
    """Permission denied on the run directory (simulated: the tests may run as root): one line from
    us, not click's usage message."""
    from pathlib import Path

    path = _copy(good, tmp_path)
    real = Path.iterdir

    def denied(self):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", denied)
    answers = _answers(path)
    _check(answers, {2})
    assert all("cannot list the directory (Permission denied)" in output for _, _, output in answers)
