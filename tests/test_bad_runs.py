"""Bad runs get clear answers: every command, on every kind of damaged or foreign run, exits with
one line and code 2, or reports what is readable (code 0) with a warning; never an internal error,
a traceback or a hang (issue 16)."""

from __future__ import annotations

import builtins
import errno
import json
import os
import re
import shutil
import signal
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from ampdoctor.read import engine
from ampdoctor.read import run as run_module
from ampdoctor.run_file import segment as segment_module
from ampdoctor.cli.commands import main
from ampdoctor.errors import RunError
from ampdoctor.read.run import read_run
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


def _answers(path, commands=COMMANDS) -> list[tuple[list[str], int, str]]:
    """Each command's exit code and output; a hang fails the test (20 s alarm per command)."""
    def hang(signum, frame):
        raise TimeoutError("the command hung")

    out = []
    previous = signal.signal(signal.SIGALRM, hang)
    try:
        for command in commands:
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


# Segments this process cannot open or read (issue 28): skipped with a warning each, like damaged ones.
# Root ignores permissions, so besides a real chmod 000 the failures are simulated where the reader
# opens the file; "removed" really removes it.
def _denied(file):
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))


def _io_error(file):
    raise OSError(errno.EIO, os.strerror(errno.EIO), str(file))


def _removed(file):
    file.unlink()  # gone between the listing and the open: the real error follows


OPEN_FAILURES = {"permission denied": (_denied, "Permission denied"), "I/O error": (_io_error, "Input/output error"),
                 "removed": (_removed, "No such file or directory")}


def _fail_open(monkeypatch, failure: str) -> tuple[set, str]:
    """Opening any file of the returned set (filled by the test) to read its footer fails as
    ``OPEN_FAILURES[failure]`` makes it; also returns the reason the reader should give."""
    fail, reason = OPEN_FAILURES[failure]
    files: set = set()

    def opened(file, *args, **kwargs):
        if Path(file) in files:
            fail(Path(file))
        return builtins.open(file, *args, **kwargs)

    monkeypatch.setattr(segment_module, "open", opened, raising=False)
    return files, reason


def _each_on_a_copy(good, tmp_path, ready, commands=COMMANDS):
    """``_answers`` with each command on its own copy of ``good``, readied by ``ready(path)``: a
    removed segment is gone for the next command."""
    answers = []
    for i, command in enumerate(commands):
        path = _copy(good, tmp_path / f"copy{i}")
        ready(path)
        answers += _answers(path, [command])
    return answers


def _without(good, tmp_path, name):
    """A copy of ``good`` without the segment ``name``: what the readable segments hold."""
    path = _copy(good, tmp_path / "without")
    (path / name).unlink()
    return path


def _json(command, path):
    result = CliRunner().invoke(main, [command, str(path), "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _same_content(got, expected) -> tuple[dict, dict]:
    """``info`` and ``report`` of ``got`` say what they say of ``expected`` (the run without the skipped segment)."""
    info, want = _json("info", got), _json("info", expected)
    assert {k: info[k] for k in ("rows", "steps", "first_step", "last_step", "kinds")} == \
           {k: want[k] for k in ("rows", "steps", "first_step", "last_step", "kinds")}
    report, want = _json("report", got), _json("report", expected)
    assert (report["run"]["steps"], report["scale"]) == (want["run"]["steps"], want["scale"])
    return info, report


@pytest.mark.parametrize("failure", OPEN_FAILURES)
def test_a_segment_that_cannot_be_opened_is_skipped_with_a_warning(good, tmp_path, monkeypatch, failure):
    chosen, reason = _fail_open(monkeypatch, failure)  # (chosen: the segment of every copy)
    name = sorted(good.glob("*.parquet"))[1].name
    expected = _without(good, tmp_path, name)
    warning = f"skipped unreadable segment {name} (cannot read: {reason})"

    def ready(path):
        chosen.add(path / name)

    path = _copy(good, tmp_path / "library")
    ready(path)
    run = read_run(path)
    assert warning in run.warnings and name not in {s.path.name for s in run.segments}
    assert len(run.frame) == len(read_run(expected).frame) < len(read_run(good).frame)

    answers = _each_on_a_copy(good, tmp_path, ready)
    _check(answers, {0})
    path = _copy(good, tmp_path / "json")
    ready(path)
    info, _ = _same_content(path, expected)
    assert info["warnings"] == [warning]
    path = _copy(good, tmp_path / "json2")
    ready(path)
    assert _json("report", path)["warnings"].count(warning) == 1


@pytest.mark.parametrize("failure", OPEN_FAILURES)
def test_a_run_whose_segments_all_cannot_be_opened_gets_one_line(good, tmp_path, monkeypatch, failure):
    chosen, reason = _fail_open(monkeypatch, failure)

    def ready(path):
        chosen.update(path.glob("*.parquet"))

    path = _copy(good, tmp_path / "library")
    ready(path)
    with pytest.raises(RunError) as caught:
        read_run(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: no readable segments (skipped unreadable segment ")
    more = len(list(good.glob("*.parquet"))) - 3  # three named, however many there are
    assert f"(cannot read: {reason})" in message and message.endswith(f"; and {more} more)") and "\n" not in message
    answers = _each_on_a_copy(good, tmp_path, ready)
    _check(answers, {2})
    assert all("no readable segments" in output and reason in output for _, _, output in answers)


@pytest.mark.parametrize("failure", OPEN_FAILURES)
def test_a_single_segment_file_that_cannot_be_opened_is_the_runs_error(good, tmp_path, monkeypatch, failure):
    """The path given is the segment: failing to open it is the run's error, not a skip."""
    chosen, reason = _fail_open(monkeypatch, failure)

    def alone(i):
        file = tmp_path / f"alone{i}.parquet"
        shutil.copyfile(sorted(good.glob("*.parquet"))[1], file)
        chosen.add(file)
        return file

    file = alone("")
    with pytest.raises(RunError, match=f"^{re.escape(str(file))}: cannot read: {reason}$"):
        read_run(file)
    answers = [answer for i, command in enumerate(COMMANDS) for answer in _answers(alone(i), [command])]
    _check(answers, {2})
    assert all(output.endswith(f"cannot read: {reason}") for _, _, output in answers)


def _permissions_apply(tmp_path) -> bool:
    """Whether this process is kept out of a file by its mode: root is not (os.geteuid() == 0),
    unless its CAP_DAC_OVERRIDE was dropped (``setpriv --bounding-set -dac_override,-dac_read_search``)."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    probe.chmod(0)
    try:
        probe.open("rb").close()
        return False
    except PermissionError:
        return True


def test_segments_without_read_permission_are_skipped(good, tmp_path):
    if not _permissions_apply(tmp_path):
        pytest.skip("this process reads a file whatever its permissions, as root does (simulated above)")
    path = _copy(good, tmp_path)
    files = sorted(path.glob("*.parquet"))
    try:
        files[1].chmod(0)
        _check(_answers(path), {0})
        _same_content(path, _without(good, tmp_path, files[1].name))
        assert f"skipped unreadable segment {files[1].name} (cannot read: Permission denied)" in read_run(path).warnings
        for file in files:
            file.chmod(0)
        answers = _answers(path)
        _check(answers, {2})
        assert all("no readable segments" in output and "Permission denied" in output for _, _, output in answers)
    finally:
        for file in files:
            file.chmod(0o644)


def _data_io_error(monkeypatch, files) -> None:
    """Reading the data of any of ``files`` fails with an I/O error (simulated: the footer read fine)."""
    def failing(real):
        def read(source, *args, **kwargs):
            if Path(source) in files:
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(source))
            return real(source, *args, **kwargs)
        return read

    for name in ("read_table", "read_schema", "ParquetFile"):
        monkeypatch.setattr(run_module.pq, name, failing(getattr(pq, name)))

    # The query engine reads the files itself: it fails as DuckDB does on such a file, while one
    # of them is still among the segments it reads.
    answer = engine.Session._answer

    def failing_answer(self, sql, params):
        if any(s.path in files and s.path not in self.run.unreadable_segments for s in self.run.segments):
            raise duckdb.IOException(f"IO Error: {os.strerror(errno.EIO)}")
        return answer(self, sql, params)

    monkeypatch.setattr(engine.Session, "_answer", failing_answer)


DATA_FAILURES = {"removed": (lambda monkeypatch, files: [f.unlink() for f in files], "No such file or directory"),
                 "I/O error": (_data_io_error, "Input/output error")}


@pytest.mark.parametrize("failure", DATA_FAILURES)
def test_a_segment_that_fails_after_its_footer_was_read_is_skipped_once(good, tmp_path, monkeypatch, failure):
    """Footers validated, then a segment removed or failing to read: skipped with one warning
    however often the data is read; every segment so: one line naming the cause."""
    fail, reason = DATA_FAILURES[failure]
    name = sorted(good.glob("*.parquet"))[1].name
    expected = _without(good, tmp_path, name)
    warning = f"skipped unreadable segment {name} (cannot read: {reason})"

    path = _copy(good, tmp_path / "library")
    run = read_run(path)
    fail(monkeypatch, {path / name})
    assert len(run.frame) == len(read_run(expected).frame)
    run.table(["step", "scale"], kinds=["step"])
    assert sum(1 for _ in run.batches(["step", "kind"])) and run.warnings.count(warning) == 1
    assert [w for w in run.warnings if w.startswith("skipped")] == [warning]

    path = _copy(good, tmp_path / "all")
    run = read_run(path)
    fail(monkeypatch, set(path.glob("*.parquet")))
    with pytest.raises(RunError, match=f"^{re.escape(str(path))}: no readable segments \\(the data of no segment "
                                       f"could be read: skipped unreadable segment .*\\(cannot read: {reason}\\)\\)$"):
        run.table()

    # The CLI: each segment fails once read_run has validated the footers, before any data is read.
    located, chosen = run_module._located, set()

    def then_fail(*args, **kwargs):
        out = located(*args, **kwargs)
        fail(monkeypatch, {f for f in chosen if f.exists()})
        return out

    monkeypatch.setattr(run_module, "_located", then_fail)
    answers = _each_on_a_copy(good, tmp_path / "one", lambda path: chosen.add(path / name))
    _check(answers, {0})
    path = _copy(good, tmp_path / "json")
    chosen.add(path / name)
    info = _json("info", path)
    assert info["rows"] == _json("info", expected)["rows"] and info["warnings"] == [warning]
    path = _copy(good, tmp_path / "json2")
    chosen.add(path / name)
    assert _json("report", path)["warnings"].count(warning) == 1

    answers = _each_on_a_copy(good, tmp_path / "every", lambda path: chosen.update(path.glob("*.parquet")))
    _check(answers, {2})
    assert all("no readable segments" in output and reason in output for _, _, output in answers)
