"""Crash safety and recorder failures: the run survives the process, training survives the recorder."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

import ampdoctor
from ampdoctor.errors import RecorderError
from ampdoctor.run import read_run
from models import MLP, batches, mse

TESTS = Path(__file__).parent

TRAIN = textwrap.dedent("""
    import sys, time, torch, ampdoctor
    sys.path.insert(0, {tests!r})
    from models import MLP, batches, mse
    path, steps, flush_every, close = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "close"
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ampdoctor.GradScaler("cpu", model=model, path=path, flush_every=flush_every, flush_seconds=3600)
    data = batches(1)
    for i in range(steps):
        x, y = data[0]
        scaler.scale(mse(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        print("step", i, flush=True)
        time.sleep(0.02)
    if close:
        scaler.close()
""")


def _start(tmp_path, run_path, steps, flush_every, close="no"):
    script = tmp_path / "train.py"
    script.write_text(TRAIN.format(tests=str(TESTS)))
    return subprocess.Popen([sys.executable, str(script), str(run_path), str(steps), str(flush_every), close],
                            stdout=subprocess.PIPE, text=True)


def _wait_for_step(proc, step):
    for line in proc.stdout:
        if line.strip() == f"step {step}":
            return
    raise AssertionError(f"training process ended before step {step}")


def _steps(run_path):
    frame = read_run(run_path).frame
    return sorted(frame.loc[frame.kind == "step", "step"].tolist())


def test_sigkill_loses_at_most_the_unflushed_steps(tmp_path, run_path):
    proc = _start(tmp_path, run_path, steps=10_000, flush_every=5)
    _wait_for_step(proc, 30)
    proc.kill()  # at step 30 or a step later: segments of steps 0..24 are surely closed by now
    proc.wait()
    steps = _steps(run_path)
    assert steps == list(range(len(steps)))  # whole segments only, no gaps
    assert 20 <= len(steps) <= 35 and len(steps) % 5 == 0
    run = read_run(run_path)
    assert not run.ended_cleanly
    from ampdoctor.cli import main
    from click.testing import CliRunner
    result = CliRunner().invoke(main, ["info", str(run_path)])
    assert result.exit_code == 0, result.output
    assert "without close()" in result.output


def test_sigterm_flushes_the_run(tmp_path, run_path):
    proc = _start(tmp_path, run_path, steps=10_000, flush_every=10_000)
    _wait_for_step(proc, 12)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM  # the default action still happens afterwards
    steps = _steps(run_path)
    assert steps[:13] == list(range(13)) and steps == list(range(len(steps)))
    assert read_run(run_path).ended_cleanly


def test_interpreter_exit_flushes_without_close(tmp_path, run_path):
    proc = _start(tmp_path, run_path, steps=7, flush_every=10_000, close="no")
    proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert _steps(run_path) == list(range(7))
    assert read_run(run_path).ended_cleanly


def _train(scaler, model, steps, between=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(batches(steps)):
        scaler.scale(mse(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if between:
            between(i)
    return [p.detach().clone() for p in model.parameters()]


def _reference(steps):
    torch.manual_seed(0)
    model = MLP()
    return _train(torch.amp.GradScaler("cpu"), model, steps)


def _break_directory(run_path):
    shutil.rmtree(run_path)
    run_path.write_text("not a directory any more")


def test_directory_becoming_unwritable_does_not_stop_training(run_path):
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=run_path, flush_every=1)

    def between(i):
        if i == 3:
            time.sleep(0.3)  # let segments 0..3 land, then pull the directory away
            _break_directory(run_path)
        time.sleep(0.02)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params = _train(scaler, model, 12, between)
        scaler.close()
    stopped = [w for w in caught if "recording to" in str(w.message)]
    assert len(stopped) == 1 and issubclass(stopped[0].category, RuntimeWarning)  # warned once
    assert scaler.recorder is None
    for a, b in zip(params, _reference(12)):
        assert torch.equal(a, b)


def test_unwritable_path_at_start_warns_and_trains(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    torch.manual_seed(0)
    model = MLP()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = ampdoctor.GradScaler("cpu", model=model, path=blocker / "run.parquet")
        params = _train(scaler, model, 4)
        scaler.close()
    assert sum("recording to" in str(w.message) for w in caught) == 1
    for a, b in zip(params, _reference(4)):
        assert torch.equal(a, b)


def test_strict_raises_recorder_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RecorderError, match="recording failed"):
        ampdoctor.GradScaler("cpu", path=blocker / "run.parquet", strict=True)


def test_strict_raises_when_the_disk_fills(run_path, monkeypatch):
    import pyarrow.parquet as pq

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=run_path, flush_every=1, strict=True)
    monkeypatch.setattr(pq, "write_table", disk_full)
    with pytest.raises(RecorderError, match="No space left"):
        _train(scaler, model, 50, between=lambda i: time.sleep(0.02))


def test_bug_in_the_recorder_warns_once_and_training_goes_on(run_path, monkeypatch):
    from ampdoctor import recorder

    def broken(*args, **kwargs):
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(recorder, "tensor_stats", broken)
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=run_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params = _train(scaler, model, 5)
    assert sum("a bug of ours" in str(w.message) for w in caught) == 1
    for a, b in zip(params, _reference(5)):
        assert torch.equal(a, b)


def test_host_memory_stays_bounded(run_path):
    """Rows leave memory at every segment; the queue holds at most queue_size records."""
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=run_path, flush_every=4, queue_size=2)
    writer = scaler.recorder.writer
    peak = []
    _train(scaler, model, 20, between=lambda i: peak.append((writer._pending.rows, writer._queue.qsize())))
    scaler.close()
    assert max(rows for rows, _ in peak) <= 4 * 8  # 4 steps of a step row, 6 gradient rows, 1 param row
    assert max(q for _, q in peak) <= 2
    assert len(read_run(run_path).segments) >= 5
