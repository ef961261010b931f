"""Crash safety and recorder failures: the run survives the process, training survives the recorder."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import ampdoctor
from ampdoctor.errors import RecorderError
from ampdoctor.read.run import read_run
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
    from ampdoctor.cli.commands import main
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
    with pytest.raises(RecorderError, match="No space left") as raised:
        _train(scaler, model, 50, between=lambda i: time.sleep(0.02))
    assert str(raised.value).count("recording failed") == 1, str(raised.value)  # not wrapped twice


def test_bug_in_the_recorder_warns_once_and_training_goes_on(run_path, monkeypatch):
    from ampdoctor.record import recorder

    def broken(*args, **kwargs):
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(recorder, "full_stats", broken)
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
    """Rows leave memory at every segment; the queue holds at most queue_size records (a full
    queue drops the step rather than wait)."""
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=run_path, flush_every=4, queue_size=2)
    writer = scaler.recorder.writer
    peak = []
    _train(scaler, model, 20, between=lambda i: peak.append((writer._pending.rows, len(writer._queue))))
    recorder = scaler.recorder
    scaler.close()
    assert max(rows for rows, _ in peak) <= 4 * 8  # 4 steps of a step row, 6 gradient rows, 1 param row
    assert max(q for _, q in peak) <= 2
    # A full queue drops steps instead of holding training: every step is written or counted.
    dropped = recorder.dropped_steps
    assert len(_steps(run_path)) + dropped == 20
    assert len(read_run(run_path).segments) >= (20 - dropped) // 4


# -- faults that must not hold training (issue 16) ----------------------------------------------------

def _timed_train(scaler, model, steps, loss_factor=None):
    """Train ``steps`` steps; returns (final parameters, the longest step in seconds). A step
    whose loss is multiplied by ``loss_factor(i)`` (when given) overflows and skips."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    longest = 0.0
    for i, (x, y) in enumerate(batches(steps)):
        start = time.monotonic()
        loss = mse(model, x, y) * (loss_factor(i) if loss_factor else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        longest = max(longest, time.monotonic() - start)
    return [p.detach().clone() for p in model.parameters()], longest


@pytest.fixture
def hung_disk(monkeypatch):
    """pyarrow's write_table blocks until the test ends (a stalled disk or network filesystem)."""
    import threading

    import pyarrow.parquet as pq
    release = threading.Event()

    def hang(*args, **kwargs):
        release.wait()
        raise OSError(errno.EIO, "the disk came back too late")

    monkeypatch.setattr(pq, "write_table", hang)
    yield release
    release.set()


def test_a_stalled_disk_never_holds_a_step(run_path, hung_disk, monkeypatch):
    """The writer hangs inside its first segment write. The queue fills; the training thread
    drops records instead of waiting, warns once, and says in the run how many steps it lost.
    Skipped steps wait for the writer at most once per stall (the sync bound), and close() is
    bounded too."""
    from ampdoctor.record import writer
    monkeypatch.setattr(writer, "SYNC_TIMEOUT", 0.5)
    monkeypatch.setattr(writer, "CLOSE_TIMEOUT", 0.5)
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=run_path, flush_every=1, queue_size=4)
    overflow = {10, 11, 20, 30}  # skipped steps, each asking the writer to sync
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params, longest = _timed_train(scaler, model, 40, lambda i: 1e30 if i in overflow else 1.0)
        recorder = scaler.recorder
        start = time.monotonic()
        scaler.close()
        closing = time.monotonic() - start
    assert longest < 0.5 + 0.4, longest  # one bounded sync at most, never a hang
    assert closing < 0.5 + 0.4, closing
    messages = [str(w.message) for w in caught if "ampdoctor" in str(w.message)]
    assert sum("fell behind" in m for m in messages) == 1, messages
    assert sum("did not finish" in m for m in messages) == 1, messages
    assert recorder.dropped_steps >= 30
    reference = _reference_with(lambda i: 1e30 if i in overflow else 1.0, 40)
    assert all(torch.equal(a, b) for a, b in zip(params, reference))


def test_close_returns_within_its_timeout_while_a_write_hangs(tmp_path):
    """RunWriter on its own: a write that hangs (a stalled disk) does not hold close() beyond its
    timeout; the writer stays registered, so the exit handler gives it its time, and finishes the
    run once the disk comes back."""
    import pyarrow.parquet as pq

    from ampdoctor.record import writer
    from ampdoctor.run_file.schema import HIST_BINS, META_FINAL

    release, taken = threading.Event(), threading.Event()

    def hung(record):
        taken.set()
        release.wait(30)
        return [], False

    w = writer.RunWriter(tmp_path / "run.parquet", metadata=dict, materialize=hung, hist_bins=HIST_BINS)
    try:
        assert w.put("a record") and taken.wait(10)
        start = time.monotonic()
        assert w.close(timeout=0.3) is False
        assert w.close(timeout=0.3) is False  # idempotent, and as bounded the second time
        assert time.monotonic() - start < 2
        assert w.closed and w in writer._open_writers and not w.put("too late")
    finally:
        release.set()
    writer.close_all_writers(timeout=10)  # the exit handler's turn: the worker finishes now
    assert w not in writer._open_writers
    (segment,) = (tmp_path / "run.parquet").iterdir()
    assert pq.read_metadata(segment).metadata[META_FINAL.encode()] == b"true"


def _reference_with(loss_factor, steps):
    torch.manual_seed(0)
    model = MLP()
    return _timed_train(torch.amp.GradScaler("cpu"), model, steps, loss_factor)[0]


def test_dropped_steps_are_written_into_the_run_and_reported(run_path, monkeypatch):
    """A writer that is only slow: the steps it could not take are counted in the run's metadata,
    and report and info say so."""
    import pyarrow.parquet as pq
    real = pq.write_table

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(pq, "write_table", slow)
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=run_path, flush_every=1, queue_size=2)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _timed_train(scaler, model, 60)
    recorder = scaler.recorder
    scaler.close()
    dropped = recorder.dropped_steps
    assert dropped > 0
    run = read_run(run_path)
    assert run.dropped_steps == dropped  # the writer's last segment carries its count
    assert any(w.startswith(f"{dropped} step(s) were not recorded") for w in run.warnings)
    assert len(_steps(run_path)) == 60 - dropped
    assert any(f"{dropped} step(s) were not recorded" in w for w in ampdoctor.report(run_path)["warnings"])


def test_a_dead_writer_thread_is_noticed_at_the_next_step(run_path, monkeypatch):
    """The worker thread dies outside its guarded actions: the next step notices, warns once and
    stops recording; no step waits for it."""
    from ampdoctor.record import writer

    monkeypatch.setattr(writer.RunWriter, "_work", lambda self: None)  # the thread ends at once
    torch.manual_seed(0)
    model = MLP()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = ampdoctor.GradScaler("cpu", model=model, path=run_path, queue_size=4)
        recorder = scaler.recorder
        params, longest = _timed_train(scaler, model, 20)
        scaler.close()
    assert longest < 0.5
    messages = [str(w.message) for w in caught if "ampdoctor" in str(w.message)]
    assert len(messages) == 1 and "writer thread" in messages[0], messages
    assert not recorder.active
    assert all(torch.equal(a, b) for a, b in zip(params, _reference(20)))


def test_a_signal_flush_is_served_while_another_thread_keeps_training(run_path):
    """Training off the main thread keeps queueing while the main thread's signal handler asks
    for a flush: the worker serves it once the records queued when it saw the request are held,
    not only when the queue drains (which may never happen)."""
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=run_path, flush_every=10_000, flush_seconds=3600)
    writer = scaler.recorder.writer
    _train(scaler, model, 3)
    stop = threading.Event()

    real = writer._materialize

    def slow(record):  # the worker takes 2 ms a record ...
        if record == "filler":
            time.sleep(0.002)
            return [], False
        return real(record)

    writer._materialize = slow

    def keep_queueing():  # ... and gets one every millisecond: the queue never drains
        while not stop.is_set():
            writer.put("filler")
            time.sleep(0.001)

    producer = threading.Thread(target=keep_queueing, daemon=True)
    producer.start()
    try:
        start = time.monotonic()
        writer.flush_from_signal(timeout=5.0)
        took = time.monotonic() - start
    finally:
        stop.set()
        producer.join()
    assert took < 2.0 and _steps(run_path) == [0, 1, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fillers left are taken as before: no failure
        scaler.close()


def test_a_failed_segment_leaves_no_open_file(run_path, monkeypatch):
    """Disk full in the middle of a segment: the partial file is closed (and removed) at once,
    not when the scaler is garbage-collected."""
    import pyarrow.parquet as pq
    real = pq.write_table

    def half_then_full(table, where, **kwargs):
        real(table.slice(0, 1), where, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=run_path, flush_every=1)
    monkeypatch.setattr(pq, "write_table", half_then_full)
    writer = scaler.recorder.writer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(scaler, model, 5)
        writer.sync(timeout=5)  # the worker has tried its first segment
        scaler.close()  # hands the writer's failure to the training thread at the latest
    assert writer.failed and isinstance(writer.error, OSError)
    assert sum("No space left" in str(w.message) for w in caught) == 1
    open_files = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                  if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not any(str(run_path) in f for f in open_files), open_files
    assert not list(Path(run_path).glob(".*.tmp"))


HANDLES_SIGTERM = textwrap.dedent("""
    import signal, sys, time, torch, ampdoctor
    sys.path.insert(0, {tests!r})
    from models import MLP, batches, mse
    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(True))  # the script's own handler
    path = sys.argv[1]
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ampdoctor.GradScaler("cpu", model=model, path=path, flush_every=10_000, flush_seconds=3600)
    x, y = batches(1)[0]
    i, extra = 0, None
    while extra is None or extra > 0:
        scaler.scale(mse(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        print("step", i, flush=True)
        i += 1
        if stop and extra is None:
            extra = 10  # checkpoint and wind down: ten more steps
        elif extra is not None:
            extra -= 1
        time.sleep(0.02)
    scaler.close()
    print("done", i, flush=True)
""")


def test_a_script_that_handles_sigterm_itself_keeps_recording(tmp_path, run_path):
    """The script's own SIGTERM handler lets it train ten more steps: ampdoctor flushes what it
    has at the signal (on disk before the script can die of it) and keeps recording; the run ends
    cleanly at close() with every step."""
    script = tmp_path / "train.py"
    script.write_text(HANDLES_SIGTERM.format(tests=str(TESTS)))
    proc = subprocess.Popen([sys.executable, str(script), str(run_path)], stdout=subprocess.PIPE, text=True)
    _wait_for_step(proc, 8)
    proc.send_signal(signal.SIGTERM)
    _wait_for_step(proc, 10)
    flushed = _steps(run_path)  # written by the signal's flush (segments are otherwise 10,000 steps)
    assert flushed and flushed == list(range(len(flushed))) and len(flushed) >= 9
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    total = int(out.strip().splitlines()[-1].split()[1])
    assert _steps(run_path) == list(range(total)) and total >= 19
    assert read_run(run_path).ended_cleanly
