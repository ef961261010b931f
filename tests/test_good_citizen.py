"""ampdoctor inside other people's processes (issue 40): no thread before there is something to
write and none after the scaler is closed or dropped, set-up that torch's scaler accepts never
refused, and what a test suite's thread check (Lightning's ``thread_police``) asks of a thread."""

from __future__ import annotations

import gc
import threading
import time
import warnings
from unittest.mock import Mock

import pytest
import torch

import ampdoctor
from ampdoctor.errors import RecorderError
from ampdoctor.read.run import read_run
from ampdoctor.record import shutdown
from models import MLP, batches, mse


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ampdoctor")]


def _wait_for_no_writer_threads(seconds: float = 10.0) -> list[threading.Thread]:
    deadline = time.monotonic() + seconds
    while _writer_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return _writer_threads()


def _steps(run) -> list[int]:
    return sorted(run.frame.loc[run.frame.kind == "step", "step"].tolist())


def _train(scaler, model, steps: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x, y in batches(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mse(model, x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(autouse=True)
def no_threads_before():
    assert not _wait_for_no_writer_threads(), "a writer thread was left by an earlier test"


def test_a_scaler_that_never_steps_starts_no_thread_and_writes_no_run(tmp_path):
    """A framework's set-up or a test builds a scaler and lets it go: nothing runs, nothing is
    written, nothing is left for the exit handler."""
    import weakref

    from ampdoctor.record import writer as writer_module

    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=tmp_path / "run", level="full")
    assert scaler.recorder is not None and not _writer_threads()
    writer = weakref.ref(scaler.recorder.writer)
    assert writer() not in writer_module._open_writers  # nothing for the exit handler to finish
    model_ref = weakref.ref(model)
    del scaler, model
    gc.collect()
    assert not _writer_threads() and not list((tmp_path / "run").glob("*.parquet"))
    assert model_ref() is None and writer() is None  # nothing of it keeps the model alive
    closed = ampdoctor.GradScaler("cpu", model=MLP(), path=tmp_path / "closed")
    closed.close()  # the program's own close: the run is written, empty, and the thread that wrote it ended
    assert not _writer_threads() and len(list((tmp_path / "closed").glob("*.parquet"))) == 1
    with pytest.raises(Exception, match="empty run"):
        read_run(tmp_path / "closed")


@pytest.mark.parametrize("level", ["params", "full"])
def test_a_scaler_dropped_without_close_ends_its_thread_and_finishes_its_run(tmp_path, level):
    """Training started the writer; the scaler is then dropped without ``close()`` (a test that
    lets it go out of scope): the thread writes the last segment and ends by itself, while the
    model, whose hooks still hold the recorder, lives on."""
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=tmp_path / "run", level=level)
    _train(scaler, model, 4)
    assert _writer_threads()
    del scaler
    gc.collect()
    assert not _wait_for_no_writer_threads(), "the dropped scaler's writer thread is still alive"
    run = read_run(tmp_path / "run")
    assert run.ended_cleanly and _steps(run) == [0, 1, 2, 3]
    assert model(torch.randn(2, 16)).shape == (2, 4)  # the model trains on, its taps inert


def test_a_left_over_writer_thread_stops_when_asked(tmp_path):
    """Lightning's ``thread_police`` fixture (and others like it) calls ``stop()`` on a daemon
    thread a test left behind and then requires it to be gone: the writer's thread closes its
    run and ends."""
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=tmp_path / "run")
    _train(scaler, model, 3)
    (thread,) = _writer_threads()
    assert thread.daemon and callable(getattr(thread, "stop", None))
    thread.stop()
    assert not thread.is_alive()
    assert read_run(tmp_path / "run").ended_cleanly
    _train(scaler, model, 2)  # the scaler trains on, no longer recording: no thread comes back
    assert not _writer_threads() and not scaler.recorder.active
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())  # taps gone too
    scaler.close()


def test_a_device_torch_accepts_is_accepted(tmp_path):
    """Lightning's test builds ``MixedPrecision("16-mixed", device=Mock())``: torch's scaler keeps
    any device object. ampdoctor's does too, warns that it cannot record, and is torch's."""
    with pytest.warns(RuntimeWarning, match=r"cannot record with this set-up \(TypeError: .*\); the scaler "
                                            r"trains unrecorded, as torch's GradScaler"):
        scaler = ampdoctor.GradScaler(device=Mock(), path=tmp_path / "a")
    assert scaler.recorder is None and not _writer_threads()
    plain = torch.amp.GradScaler(device=Mock())
    with pytest.warns(RuntimeWarning, match="cannot record with this set-up"):
        assert ampdoctor.wrap(plain, path=tmp_path / "b") is plain
    assert type(plain) is torch.amp.GradScaler  # left as it was
    with pytest.raises(RecorderError, match=r"cannot record with this set-up \(TypeError"):
        ampdoctor.GradScaler(device=Mock(), path=tmp_path / "c", strict=True)
    # ampdoctor's own arguments that cannot go together are still the user's to fix
    with pytest.raises(ValueError, match="level='full' needs model="):
        ampdoctor.GradScaler("cpu", path=tmp_path / "d", level="full")
    with pytest.raises(TypeError, match="modules must be a regex"):
        ampdoctor.GradScaler("cpu", model=MLP(), path=tmp_path / "d", modules=42)
    with pytest.raises(TypeError, match="model= must be a torch.nn.Module, got SGD"):
        ampdoctor.GradScaler("cpu", model=torch.optim.SGD(MLP().parameters(), lr=0.1), path=tmp_path / "d")
    assert not list(tmp_path.glob("*/*.parquet"))


def test_a_set_up_that_fails_half_way_leaves_nothing_behind_and_trains_as_torch(tmp_path, monkeypatch):
    """Set-up fails late (here the exit handler's registration, after the writer, the module taps
    and the autocast sniffing hook were made): a warning, no hook left on any module, no thread,
    no exit entry, and training bit-identical to torch's scaler."""
    def refuse(recorder):
        raise RuntimeError("no exit handler here")

    monkeypatch.setattr(shutdown, "opened", refuse)
    torch.manual_seed(0)
    model = MLP()
    before = len(shutdown._open_recorders)
    with pytest.warns(RuntimeWarning, match=r"cannot record with this set-up \(RuntimeError: no exit handler here\)"):
        scaler = ampdoctor.GradScaler("cpu", model=model, path=tmp_path / "run", level="full", init_scale=2.0**20)
    assert scaler.recorder is None and len(shutdown._open_recorders) == before
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not list(tmp_path.rglob("*.parquet"))  # "unrecorded": no run either
    losses = _train(scaler, model, 6)
    torch.manual_seed(0)
    reference = MLP()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expected = _train(torch.amp.GradScaler("cpu", init_scale=2.0**20), reference, 6)
    assert losses == expected
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    assert not _writer_threads()


def test_a_signal_closing_the_writer_never_waits_for_a_lock_the_interrupted_thread_holds(tmp_path):
    """SIGTERM lands while the training thread holds the writers' registry lock (making or
    closing a writer): the worker, closed by the handler, must end without that lock, or the
    handler's join would spend every writer's exit budget."""
    from ampdoctor.record import writer as writer_module
    from ampdoctor.run_file.schema import HIST_BINS

    w = writer_module.RunWriter(tmp_path / "run", metadata=dict, hist_bins=HIST_BINS,
                                materialize=lambda record: ([], False))
    assert w.put("a record")
    with writer_module._open_lock:  # as the interrupted frame would
        start = time.monotonic()
        w.close_from_signal(3.0)
        took = time.monotonic() - start
    assert took < 1.0 and w._finished and not w._thread.is_alive()


def test_the_integrations_accept_a_scaler_left_plain(tmp_path):
    """``wrap()`` leaves a scaler as it is on a rank that does not record (``ranks=``) and for a
    set-up recording cannot use: the integrations go on with it."""
    from ampdoctor.integrations import CallbackRun

    class Run(CallbackRun):
        framework = "lightning"

    for run, scaler in ((Run(path=tmp_path / "a", ranks=[1]), torch.amp.GradScaler("cpu")),
                        (Run(path=tmp_path / "b"), torch.amp.GradScaler(device=Mock()))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the Mock device's: cannot record)
            run._record(scaler, MLP(), 0)
        assert run.scaler is scaler and type(scaler) is torch.amp.GradScaler
        run.close()


def test_a_close_while_the_first_record_starts_the_worker_writes_one_final_segment(tmp_path):
    """``close()`` on another thread (a failure's ``ampdoctor-close`` thread, a thread check's
    ``stop()``) while ``put()`` is starting the worker: the close waits for the start and the run
    gets one final segment, not one from each."""
    from ampdoctor.record import writer as writer_module
    from ampdoctor.run_file.schema import HIST_BINS

    w = writer_module.RunWriter(tmp_path / "run", metadata=dict, hist_bins=HIST_BINS,
                                materialize=lambda record: ([], False))
    real_start, closers = w._thread.start, []

    def slow_start():
        real_start()
        closer = threading.Thread(target=w.close)
        closer.start()
        closers.append(closer)
        time.sleep(0.2)  # the closer runs now, before the writer counts as started

    w._thread.start = slow_start
    w.put("a record")  # (refused: the close came first)
    closers[0].join(10)
    assert not closers[0].is_alive() and not w._thread.is_alive()
    assert len(list((tmp_path / "run").glob("*.parquet"))) == 1


@pytest.mark.parametrize("distributed", [True, False])
def test_the_exit_handler_lets_native_threads_finish_under_torch_distributed(monkeypatch, distributed):
    """The SIGABRT at exit of two-rank gloo runs (benchmarks/spawn_probe.py; gdb on the cores: gloo's
    pt_gloo_runloop thread ended by pthread_exit inside a work object's destructor, needing the
    GIL for a contextvars.Context once finalization began): with torch.distributed loaded the exit
    handler lets go of the GIL last, for NATIVE_RELEASE_SECONDS, inside the exit's bound."""
    import sys

    slept, bounds = [], []
    monkeypatch.setattr(shutdown.time, "sleep", slept.append)
    monkeypatch.setattr(shutdown, "close_all_writers", lambda timeout: bounds.append(timeout))
    monkeypatch.setattr(shutdown, "_open_recorders", set())
    if distributed:
        import torch.distributed  # noqa: F401
    else:
        monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    shutdown._at_exit()
    assert slept == ([shutdown.NATIVE_RELEASE_SECONDS] if distributed else [])
    assert bounds[0] <= shutdown.EXIT_TIMEOUT - (shutdown.NATIVE_RELEASE_SECONDS if distributed else 0)
