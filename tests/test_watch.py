"""``ampdoctor watch RUN``: follows a run another process is writing, and stops at its end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from click.testing import CliRunner

import ampdoctor
from ampdoctor.cli.commands import main
from models import MLP, batches, mse

TESTS = Path(__file__).parent
PROGRESS = re.compile(r"^step (\d+)  scale (\S+)  skipped (\d+)  loss (\S+)  anomalies (\d+)$")
STEPS = 8


def _slow_recorder(path: Path, steps: int = STEPS, pause: float = 0.4) -> str:
    """A script that records ``steps`` steps, a segment each (flush_every=1), ``pause`` s apart;
    init_scale 2**24 skips the first steps."""
    return textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(TESTS)!r})
        import torch, ampdoctor
        from models import MLP, batches, mse
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = ampdoctor.GradScaler("cpu", init_scale=2.0**24, model=model, path={str(path)!r}, flush_every=1)
        for x, y in batches({steps}):
            scaler.scale(mse(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            time.sleep({pause})
        scaler.close()
    """)


# Runs the CLI and says on stderr, at exit, whether torch was imported.
_WATCH = textwrap.dedent("""
    import atexit, sys
    atexit.register(lambda: print("torch imported: %s" % ("torch" in sys.modules), file=sys.stderr))
    from ampdoctor.cli.commands import main
    main(sys.argv[1:], prog_name="ampdoctor")
""")


def test_watch_follows_a_run_written_by_another_process_and_stops_at_its_end(tmp_path):
    path = tmp_path / "run.parquet"
    # watch first: it waits for the run to appear
    watcher = subprocess.Popen([sys.executable, "-c", _WATCH, "watch", str(path), "--interval", "0.2",
                                "--timeout", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    recorder = subprocess.run([sys.executable, "-c", _slow_recorder(path)], capture_output=True, text=True,
                              timeout=120)
    assert recorder.returncode == 0, recorder.stderr
    out, err = watcher.communicate(timeout=60)
    assert watcher.returncode == 0, err
    assert f"Waiting for a run at {path}" in err
    assert "torch imported: False" in err
    lines = out.splitlines()
    progress = [PROGRESS.match(line) for line in lines[:-2]]
    assert all(progress), lines
    steps = [int(m.group(1)) for m in progress]
    assert len(steps) >= 2 and steps == sorted(set(steps)), lines  # intermediate progress, step after step
    assert steps[0] < STEPS - 1 and steps[-1] == STEPS - 1
    frame = ampdoctor.load(path)
    rows = frame[frame["kind"] == "step"]
    skipped = int(rows["skipped"].sum())
    assert skipped > 0
    last = progress[-1]
    assert int(last.group(3)) == skipped and int(last.group(5)) == skipped
    assert last.group(2) == f"2**{int(rows['scale'].iloc[-1]).bit_length() - 1}"
    assert float(last.group(4)) == float(f"{float(rows['loss'].iloc[-1]):.3g}")
    run_id = ampdoctor.read_run(path).metadata["run.id"]
    assert lines[-2] == f"Run {run_id} ended: {STEPS} step(s), {skipped} skipped, {skipped} anomalous. Read it with:"
    assert lines[-1] == f"  ampdoctor report {path}"


def _record(path, steps, *, close=True):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ampdoctor.GradScaler("cpu", model=model, path=path, flush_every=1)
    for x, y in batches(steps):
        scaler.scale(mse(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    if close:
        scaler.close()
    return scaler


def test_watch_times_out_on_a_run_that_does_not_end(tmp_path):
    path = tmp_path / "run.parquet"
    scaler = _record(path, 3, close=False)  # segments written, no final one yet
    try:
        result = CliRunner().invoke(main, ["watch", str(path), "--interval", "0.1", "--timeout", "0.5"])
    finally:
        scaler.close()
    assert result.exit_code == 3
    assert PROGRESS.match(result.stdout.splitlines()[0])
    error = result.stderr.splitlines()[-1]
    assert error.startswith(f"Error: {path}: run ") and "has not ended after 0.5 s (last step 2;" in error
    # closed now: the same command ends at once
    result = CliRunner().invoke(main, ["watch", str(path), "--timeout", "5"])
    assert result.exit_code == 0 and "ended before watch started (an earlier run): 3 step(s), 0 skipped" in result.stdout


def test_watch_times_out_when_no_run_appears(tmp_path):
    result = CliRunner().invoke(main, ["watch", str(tmp_path / "later.parquet"), "--interval", "0.1",
                                       "--timeout", "0.3"])
    assert result.exit_code == 3
    assert result.stderr.splitlines()[-1] == f"Error: {tmp_path / 'later.parquet'}: no run appeared within 0.3 s"


def test_watch_json_lines(tmp_path):
    path = tmp_path / "run.parquet"
    _record(path, 4)
    result = CliRunner().invoke(main, ["watch", str(path), "--format", "json"])
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert [e["event"] for e in events] == ["progress", "ended"]
    end = events[-1]
    assert end["step"] == 3 and end["steps"] == 4 and end["new_steps"] == 4 and end["ended"] is True
    assert end["ended_before_watch"] is True  # an old run: watch says so rather than pass it off as live
    assert end["skipped"] == 0 and end["anomalies"] == 0 and end["command"] == "report" and end["ranks"] == 1
    assert end["run_id"] == ampdoctor.read_run(path).metadata["run.id"] and end["scale"] == 2.0**16


def test_watch_refuses_a_path_that_is_not_a_run(tmp_path):
    foreign = tmp_path / "other.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), foreign)
    result = CliRunner().invoke(main, ["watch", str(foreign), "--timeout", "30"])
    assert result.exit_code == 2
    assert "not an ampdoctor run" in result.stderr


def test_each_poll_reads_only_the_footers_of_new_segments(tmp_path, monkeypatch):
    """A long run's watch costs the new segments, not the run: footers already read are reused
    while their files are unchanged (read_run's ``footers``); a file rewritten is read again."""
    from ampdoctor.read import run as run_module
    from ampdoctor.read.watch import RunFollower

    path = tmp_path / "run.parquet"
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ampdoctor.GradScaler("cpu", model=model, path=path, flush_every=1)

    def train(steps, total):
        for x, y in batches(steps):
            scaler.scale(mse(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        deadline = time.monotonic() + 10  # (a segment a step, written by the writer's thread)
        while len(list(path.glob("part-*.parquet"))) < total and time.monotonic() < deadline:
            time.sleep(0.02)

    read = []
    real = run_module.read_segment
    monkeypatch.setattr(run_module, "read_segment", lambda p, **kw: read.append(p.name) or real(p, **kw))
    follower = RunFollower(path)
    train(4, 4)
    first = follower.poll()
    assert first.steps == 4 and len(read) == len(list(path.glob("part-*.parquet"))) >= 4
    read.clear()
    assert follower.poll().new_steps == 0 and read == []  # nothing new: no footer read
    before = set(path.glob("part-*.parquet"))
    train(3, 7)
    scaler.close()
    progress = follower.poll()
    assert progress.steps == 7 and progress.ended
    assert sorted(read) == sorted(p.name for p in set(path.glob("part-*.parquet")) - before)
