"""Every exit is bounded by one figure (``writer.EXIT_SECONDS``, 5 s), whatever the training
thread or the disk was doing: a signal that lands anywhere inside the hand-off to the writer, an
interpreter exit, SIGTERM, SIGINT or ``close()`` with a stalled disk, and an exit that runs out of
time with records left (counted in the run)."""

from __future__ import annotations

import contextlib
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
from ampdoctor.record import writer as writer_module
from ampdoctor.read.run import read_run
from models import MLP, batches, mse

TESTS = Path(__file__).parent


def _train(scaler, model, steps, loss_factor=lambda i: 1.0):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(batches(steps)):
        scaler.scale(mse(model, x, y) * loss_factor(i)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def _steps(path):
    frame = read_run(path).frame
    return sorted(frame.loc[frame.kind == "step", "step"].tolist())


class _InterruptAt:
    """Calls ``handler`` at the ``target``-th line executed inside ``function`` or anything it
    calls (as a signal landing there would: the handler runs on that thread, with that frame and
    any lock it holds on the stack). Counts the lines in ``seen``."""

    def __init__(self, function, target: int, handler) -> None:
        self.code, self.target, self.handler = function.__code__, target, handler
        self.seen, self.fired = 0, False

    def _inside(self, frame) -> bool:
        while frame is not None:
            if frame.f_code is self.code:
                return True
            frame = frame.f_back
        return False

    def __call__(self, frame, event, arg):
        if event == "call":
            return self._line if self._inside(frame) else None
        return None

    def _line(self, frame, event, arg):
        if event == "line":
            if self.seen == self.target and not self.fired:  # (target -1: never)
                self.fired = True
                self.handler()
            self.seen += 1
        return self._line


@pytest.mark.parametrize("method", ["put", "sync"])
def test_a_signal_anywhere_in_the_hand_off_never_waits_for_its_lock(tmp_path, method):
    """SIGTERM's handler (``close_all_writers(from_signal=True)``: each writer's
    ``close_from_signal``) run at every line of
    ``RunWriter.put`` and ``sync`` and of whatever they call: it returns as soon as the worker
    has written the run, never after its timeout (with ``queue.Queue`` it waited for the full
    timeout when the signal landed inside ``put_nowait``, which held the queue's mutex), and the
    run ends cleanly with every step queued before the signal."""
    function = getattr(writer_module.RunWriter, method)
    target = 0
    while target < 24:  # (sync's wait loop repeats its lines: the first 24 reach into it)
        path = tmp_path / f"run-{method}-{target}"
        torch.manual_seed(0)
        model = MLP()
        scaler = ampdoctor.GradScaler("cpu", model=model, path=path, flush_every=1000, flush_seconds=3600)
        _train(scaler, model, 3)
        writer = scaler.recorder.writer
        took, queued = [], []
        put = writer.put
        writer.put = lambda record: queued.append(put(record)) or queued[-1]

        def handler(writer=writer, took=took):  # what SIGTERM's handler does for each writer
            start = time.monotonic()
            writer.close_from_signal(3.0)
            took.append(time.monotonic() - start)

        tracer = _InterruptAt(function, target, handler)
        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            if method == "put":
                _train(scaler, model, 1)  # the step's record goes through put()
            else:
                writer.sync(timeout=3.0)
        finally:
            sys.settrace(previous)
        if not tracer.fired:  # past the last line this call ran
            scaler.close()
            break
        assert len(took) == 1 and took[0] < 1.5, (method, target, took)  # done when the worker is, not at the timeout
        assert not writer._thread.is_alive()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the worker finished: not taken for a dead one
            scaler.close()
        steps = _steps(path)
        assert steps[:3] == [0, 1, 2] and read_run(path).ended_cleanly
        if method == "put" and 3 in steps:  # (a put that resumes after the handler closed the
            assert queued and queued[-1]     # writer queues for nobody: the default action kills first)
        target += 1
    assert target >= 5  # the walk went through the method's body and what it calls


def test_a_record_queued_as_close_is_asked_is_written(tmp_path):
    """The worker finds the queue empty; before it looks whether a close was asked, the training
    thread queues a record and asks for the close (put(), then close()): the record is still
    written, not left behind in the queue (the close is read before the queue, not after)."""
    from ampdoctor.run_file.schema import HIST_BINS

    seen, injected = [], threading.Event()
    w = writer_module.RunWriter(tmp_path / "run.parquet", metadata=dict, hist_bins=HIST_BINS,
                                materialize=lambda record: (seen.append(record), ([], False))[1])
    serve = w._serve_flush_request

    def racing(*, drained):
        serve(drained=drained)
        if drained and not injected.is_set():  # between the worker's two reads, as a thread switch may fall
            w._queue.append("the last record")
            w._closing = True
            injected.set()

    w._serve_flush_request = racing
    w._start()  # (a first put() would: the worker starts when there is something to write)
    assert injected.wait(10)
    assert w.close(timeout=5)
    assert seen == ["the last record"]
    # the doorbell's two sockets are closed with it (not left to the collector: a descriptor each)
    assert w._wake._sender.fileno() == -1 and w._wake._receiver.fileno() == -1


EXIT = textwrap.dedent("""
    import atexit, os, signal, sys, threading, time
    # Registered before ampdoctor's exit handler, so it runs after it (last in, first out).
    atexit.register(lambda: print("handlers-done", time.monotonic(), flush=True))
    sys.path.insert(0, {tests!r})
    import torch, pyarrow.parquet as pq, ampdoctor
    from ampdoctor.record import shutdown, writer
    from models import MLP, batches, mse
    path, how, queued, bound = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    if bound != writer.EXIT_SECONDS:  # a shorter bound for speed: the same code paths
        writer.EXIT_SECONDS = writer.CLOSE_TIMEOUT = writer.SYNC_TIMEOUT = shutdown.EXIT_TIMEOUT = bound
    pq.write_table = lambda *a, **k: threading.Event().wait()  # a disk that never answers
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    full = queued == "full"
    scaler = ampdoctor.GradScaler("cpu", model=model, path=path, flush_every=1 if full else 10_000,
                                  flush_seconds=3600, queue_size=4 if full else 256)
    step = 0
    def train(n):
        global step
        for x, y in batches(n):
            scaler.scale(mse(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            step += 1
    train(14)
    print("ready", time.monotonic(), flush=True)
    if how == "close":
        scaler.close()
        print("closed", time.monotonic(), flush=True)
    elif how == "sigterm-at-exit":
        pass  # the test sends SIGTERM while the exit handler waits for the hung writer
    elif how in ("sigterm", "sigint"):
        try:
            while True:  # training goes on until the signal
                train(1)
        except KeyboardInterrupt:
            print("interrupted", time.monotonic(), flush=True)
            raise
    print("exiting", time.monotonic(), flush=True)
""")


def _exit_case(tmp_path, how, queued, bound):
    script = tmp_path / "train.py"
    script.write_text(EXIT.format(tests=str(TESTS)))
    path = tmp_path / f"run-{how}-{queued}"
    proc = subprocess.Popen([sys.executable, str(script), str(path), how, queued, str(bound)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, path


def _exit_times(proc, how):
    """(seconds from the exit's start to the end of the exit handlers, as the process measured
    them, or None where none ran (SIGTERM's default action); seconds close() took, or None;
    seconds from the signal, or the last line, to the process's end as seen from here; stderr)."""
    line = proc.stdout.readline()
    assert line.startswith("ready"), (line, proc.stderr.read() if proc.poll() is not None else "")
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    elif how == "sigint":
        proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    try:
        proc.wait(timeout=60)  # (it writes a few lines only: no pipe fills meanwhile)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"{how}: the process did not exit within 60 s")
    wall = time.monotonic() - start
    out, err = proc.stdout.read(), proc.stderr.read()  # (readline may have buffered lines: same reader)
    stamps = {ln.split()[0]: float(ln.split()[1]) for ln in (line + out).splitlines() if len(ln.split()) == 2}
    began = stamps.get("interrupted") or stamps.get("exiting") or stamps["ready"]
    handlers = stamps["handlers-done"] - began if "handlers-done" in stamps else None
    closing = stamps["closed"] - stamps["ready"] if "closed" in stamps else None
    return handlers, closing, wall, err


def test_every_exit_is_bounded_with_a_stalled_disk(tmp_path):
    """pyarrow's write never returns. Interpreter exit, close() then exit, SIGTERM and SIGINT,
    with 14 records queued and with the queue full: the exit handlers end within the bound (1 s
    here; after close(), which had its own, the writer still registered gets the exit's), not
    30 s per wait or never, and the process exits."""
    bound = 1.0
    cases = [(how, queued) for how in ("exit", "close", "sigterm", "sigint") for queued in ("some", "full")]
    for pair in (cases[i:i + 2] for i in range(0, len(cases), 2)):  # two at a time: 2 cores
        procs = {}
        for how, queued in pair:
            (tmp_path / f"{how}-{queued}").mkdir()
            procs[(how, queued)] = _exit_case(tmp_path / f"{how}-{queued}", how, queued, bound=bound)[0]
        with _killed_at_the_end(procs.values()):
            _check_exits(procs, bound)


@contextlib.contextmanager
def _killed_at_the_end(procs):
    """A failed check must not leave a process training forever (the signal cases do until signalled)."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _check_exits(procs, bound):
    for (how, queued), proc in procs.items():
        handlers, closing, wall, err = _exit_times(proc, how)
        # (an unhandled KeyboardInterrupt ends the interpreter with SIGINT, or with 1 where
        # it cannot re-raise it)
        expected = {"sigterm": (-signal.SIGTERM,), "sigint": (-signal.SIGINT, 1)}.get(how, (0,))
        assert proc.returncode in expected, (how, queued, proc.returncode, err)
        assert how != "sigint" or "KeyboardInterrupt" in err
        if how == "sigterm":
            assert handlers is None  # (the default action ends it)
        else:
            assert handlers is not None and handlers < bound + 0.5, (how, queued, handlers)
        if how == "close":  # the writer made no progress: close() returned after the bound
            assert closing is not None and closing < bound + 0.5, (how, queued, closing)
        # Seen from outside, the interpreter's own teardown of torch (a second or two on a
        # loaded 2-core machine) comes on top.
        assert wall < bound + 4.0, (how, queued, wall)


def test_a_sigterm_during_the_exit_handler_gets_what_is_left_of_its_bound(tmp_path):
    """The interpreter is exiting, its handler waits for a hung writer, and SIGTERM arrives (a
    cluster's grace period): the signal's handler takes what is left of the exit's bound, not a
    second one, then the default action ends the process."""
    bound = 4.0
    proc, _ = _exit_case(tmp_path, "sigterm-at-exit", "full", bound=bound)
    with _killed_at_the_end([proc]):
        assert proc.stdout.readline().startswith("ready")
        assert proc.stdout.readline().startswith("exiting")
        time.sleep(3.0)  # inside the exit handler now (it waits up to the bound)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        after_signal = time.monotonic() - start
    assert proc.returncode == -signal.SIGTERM, proc.stderr.read()
    # what was left of the bound (about 1 s), plus the teardown: not a fresh 4 s on top
    assert after_signal < bound - 3.0 + 1.5, after_signal


def test_the_documented_exit_bound_holds_with_a_stalled_disk(tmp_path):
    """The same with the real figure, 5 s: a process whose disk hangs with the queue full ends
    its exit handlers within it."""
    proc, _ = _exit_case(tmp_path, "exit", "full", bound=writer_module.EXIT_SECONDS)
    with _killed_at_the_end([proc]):
        handlers, _, wall, err = _exit_times(proc, "exit")
    assert proc.returncode == 0, err
    assert handlers < writer_module.EXIT_SECONDS + 0.5, handlers
    assert wall < writer_module.EXIT_SECONDS + 8.0, wall


def test_an_exit_short_of_time_counts_what_it_could_not_write(run_path):
    """A slow writer (not a stalled one) at exit with 20 steps queued: past its share of the bound
    it stops turning records into rows, writes what it holds, and the run counts the steps left:
    present plus counted is every step, and readers say how many."""
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=run_path, flush_every=10_000, flush_seconds=3600)
    recorder = scaler.recorder
    real = recorder.writer._materialize
    closing = threading.Event()

    def slow(record):  # nothing is written before the exit begins; then 0.1 s a record
        closing.wait(30)
        time.sleep(0.1)
        return real(record)

    recorder.writer._materialize = slow
    _train(scaler, model, 20)
    start = time.monotonic()
    closing.set()
    recorder.close(1.0, at_exit=True)
    assert time.monotonic() - start < 1.0 + 0.5
    run = read_run(run_path)
    steps = _steps(run_path)
    assert 0 < len(steps) < 20 and steps == list(range(len(steps)))
    assert run.unwritten_at_exit == recorder.writer.unwritten > 0 and run.dropped_steps == 0
    assert len(steps) + run.unwritten_at_exit == 20  # steps counted, not the parameter check's record
    assert any(w.startswith(f"{run.unwritten_at_exit} step(s) at the end were not written") for w in run.warnings)
    assert run.ended_cleanly  # (its writer wrote its final segment: without those steps)
    from click.testing import CliRunner

    from ampdoctor.cli.commands import main
    result = CliRunner().invoke(main, ["info", str(run_path)])
    assert result.exit_code == 0, result.output
    assert f"at exit, without {run.unwritten_at_exit} step(s)" in result.output
