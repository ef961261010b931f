"""Live status: the ``ampdoctor`` logger's line when recording starts and its summary when it ends
(close(), unwrap(), the interpreter's exit), counted from what the recorder already read."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import torch

import ampdoctor
from models import MLP, batches, mse

LOGGER = "ampdoctor"
END = re.compile(r"ampdoctor run (\S+) ended: (\d+) step\(s\) recorded, (\d+) skipped, (\d+) anomalous(.*?), "
                 r"(\d+) dropped; (read it|find out why) with: ampdoctor (report|postmortem) (\S+)$")


def _train(scaler, model, steps=6, *, nan_at=None, seed=0):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(batches(steps, seed=seed)):
        loss = mse(model, x, y)
        if i == nan_at:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return opt


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]


def _step_rows(path):
    frame = ampdoctor.load(path)
    return frame[frame["kind"] == "step"]


def test_start_line_after_the_first_step_and_summary_at_close(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    path = tmp_path / "run.parquet"
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", init_scale=2.0**24, model=model, path=path, level="params")
    assert _messages(caplog) == []  # the run id may still change (load_state_dict): said at the first step
    _train(scaler, model, steps=1)
    run_id = scaler.recorder.run_id
    assert _messages(caplog) == [f"ampdoctor recording run {run_id} at level 'params' to {path}"]
    _train(scaler, model, steps=7, seed=1)
    scaler.close()
    scaler.close()  # idempotent: one summary
    lines = _messages(caplog)
    assert len(lines) == 2
    match = END.match(lines[1])
    assert match, lines[1]
    rows = _step_rows(path)
    skipped = int(rows["skipped"].sum())
    assert skipped > 0  # 2**24 overflows at the start
    assert match.group(1) == run_id
    assert int(match.group(2)) == len(rows) == 8
    assert int(match.group(3)) == skipped
    assert int(match.group(4)) == skipped  # every anomaly here is a skipped step
    assert int(match.group(6)) == 0
    assert (match.group(7), match.group(8), match.group(9)) == ("read it", "report", str(path))


def test_summary_after_a_nonfinite_loss_points_to_postmortem_and_unwrap_ends_the_run(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    path = tmp_path / "my run.parquet"  # the command quotes the path
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.wrap(torch.amp.GradScaler("cpu"), model=model, path=path)
    _train(scaler, model, steps=6, nan_at=3)
    ampdoctor.unwrap(scaler)
    lines = _messages(caplog)
    assert len(lines) == 2
    assert lines[1].endswith(f"find out why with: ampdoctor postmortem '{path}'")
    assert ", non-finite loss at 1 step(s)" in lines[1]
    rows = _step_rows(path)
    assert int((~np.isfinite(rows["loss"].astype(float))).sum()) == 1 and int(rows["skipped"].sum()) == 1


def test_dropped_steps_are_counted_apart_from_recorded_ones(tmp_path, caplog):
    """A writer whose queue is full drops records: the summary says how many, the recorded count
    is what the run holds."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    path = tmp_path / "run.parquet"
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=path)
    writer = scaler.recorder.writer
    put = writer.put

    def full_at_steps_2_and_3(record):
        if type(record).__name__ == "StepRecord" and record.step in (2, 3):
            return False  # as a full queue answers
        return put(record)

    writer.put = full_at_steps_2_and_3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the writer-fell-behind warning
        _train(scaler, model, steps=6)
    scaler.close()
    match = END.match(_messages(caplog)[-1])
    assert match and int(match.group(6)) == 2
    assert int(match.group(2)) == len(_step_rows(path)) == 4


def test_a_rank_that_does_not_record_logs_nothing(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=tmp_path / "run.parquet", rank=0, ranks=[1])
    assert scaler.recorder is None
    _train(scaler, model, steps=2)
    scaler.close()
    assert _messages(caplog) == []


def test_a_failing_log_handler_never_reaches_training(tmp_path):
    """A filter that raises on every record: training goes on, bit for bit as with torch's scaler."""

    class Broken(logging.Filter):
        def filter(self, record):
            raise RuntimeError("broken log filter")

    logger = logging.getLogger(LOGGER)
    broken = Broken()
    logger.addFilter(broken)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        model = MLP()
        scaler = ampdoctor.GradScaler("cpu", init_scale=2.0**20, model=model, path=tmp_path / "run.parquet")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no recorder failure either
            _train(scaler, model, steps=5)
            scaler.close()
    finally:
        logger.removeFilter(broken)
        logger.setLevel(level)
    torch.manual_seed(0)
    plain_model = MLP()
    _train(torch.amp.GradScaler("cpu", init_scale=2.0**20), plain_model, steps=5)
    for a, b in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(a, b)
    assert len(_step_rows(tmp_path / "run.parquet")) == 5


def test_summary_at_interpreter_exit(tmp_path):
    """A script that never calls close(): the exit handler finishes the run and logs its summary."""
    path = tmp_path / "run.parquet"
    script = textwrap.dedent(f"""
        import logging, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
        import torch, ampdoctor
        from models import MLP, batches, mse
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = ampdoctor.GradScaler("cpu", model=model, path={str(path)!r})
        for x, y in batches(3):
            scaler.scale(mse(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("ampdoctor INFO ")]
    assert len(lines) == 2, done.stderr
    assert lines[0].startswith("ampdoctor INFO ampdoctor recording run ")
    match = END.match(lines[1].removeprefix("ampdoctor INFO "))
    assert match and int(match.group(2)) == 3 and match.group(9) == str(path)
    assert ampdoctor.read_run(path).ended_cleanly
