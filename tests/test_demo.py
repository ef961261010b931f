"""`ampdoctor demo --scenario ...`: each scenario, trained for real on the CPU (fp16 autocast), shows
the one problem it is meant to show, and the report or the postmortem explains it."""

from __future__ import annotations

import errno
import math
import re

import pytest
import torch
from click.testing import CliRunner

import ampdoctor
from ampdoctor.cli.commands import main
from ampdoctor.cli.demo import SCENARIOS, DemoError, fault_step, run_demo
from ampdoctor.run_file.schema import META_INIT_SCALE

STEPS = 60  # fewer than the CPU default of 150: every scenario already shows its problem by then
FAULT = fault_step("nan", STEPS)


def demo(*args: str):
    return CliRunner().invoke(main, ["demo", "--device", "cpu", *args])


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    """scenario → (run path, standard output of `ampdoctor demo --report`): each trained once."""
    root = tmp_path_factory.mktemp("demo")
    out = {}
    for name in SCENARIOS:
        path = root / f"{name}.parquet"
        result = demo("--scenario", name, "--out", str(path), "--steps", str(STEPS), "--report")
        assert result.exit_code == 0, result.output
        out[name] = (path, result.stdout)
    return out


def test_healthy_skips_nothing_and_has_no_event(demos):
    path, _ = demos["healthy"]
    report = ampdoctor.report(path)
    assert report["scale"]["skipped_steps"] == 0
    assert report["recommendation"]["verdict"] == "keep"
    assert report["recommendation"]["current"]["underflow_rate"] < 1e-3
    assert ampdoctor.postmortem(path)["status"] == "healthy"


def test_underflow_is_high_and_a_larger_init_scale_is_recommended(demos):
    path, _ = demos["underflow"]
    report = ampdoctor.report(path)
    rec = report["recommendation"]
    assert report["scale"]["max"] == 1.0  # the scale never grew out of it
    # Zeros filling whole lines count as structure in the estimate and only in its upper bound.
    assert rec["current"]["underflow_rate_min"] > 0.05, rec["current"]
    top = report["layers"][0]
    assert max(top["underflow_rate"] or 0.0, top["underflow_rate_max"]) > 0.5
    assert rec["verdict"] == "change" and rec["init_scale"] >= 2.0**10
    # What underflowed for sure is recovered; the zeros the record cannot call stay in the upper bound.
    assert rec["predicted"]["underflow_rate_min"] < rec["current"]["underflow_rate_min"] / 100
    assert rec["predicted"]["underflow_rate_max"] <= rec["current"]["underflow_rate_max"]
    # Silent: nothing went non-finite, so only the report sees it.
    assert ampdoctor.postmortem(path)["status"] == "healthy"


def test_overflow_skips_many_steps_and_the_recommendation_skips_fewer(demos):
    path, _ = demos["overflow"]
    report = ampdoctor.report(path)
    rec = report["recommendation"]
    skipped = report["scale"]["skipped_steps"]
    assert skipped >= 0.1 * STEPS, report["scale"]
    assert report["scale"]["settle_step"] >= 3  # the start-up backoff from 2**24 ...
    assert any("right after the scale grew" in r for r in rec["reasons"])  # ... then periodic overflow
    assert rec["verdict"] == "change" and rec["current"]["skipped_steps"] == skipped
    assert rec["predicted"]["skipped_steps"] <= skipped // 4, rec["predicted"]
    assert rec["init_scale"] < 2.0**24 or rec["growth_interval"] > 10
    assert sum(o["count"] for o in report["overflow_origins"]) == skipped  # level="full": every one named


def test_nan_postmortem_names_the_step_and_the_module(demos):
    path, _ = demos["nan"]
    pm = ampdoctor.postmortem(path)
    assert pm["status"] == "nonfinite"
    assert pm["first_nonfinite_step"] == FAULT == STEPS - 5
    assert pm["cause"] == "forward_overflow", pm
    assert pm["origin"] == {"name": "blocks.1.mlp.0", "kind": "output", "rank": 0, "step": FAULT}
    assert "large_parameters" not in pm["evidence"]  # the weight itself stayed within fp16's range
    assert any("blocks.1.mlp.0" in a and "float32" in a for a in pm["advice"])
    assert pm["run"]["steps"] == STEPS  # the run went on after the event
    losses = ampdoctor.load(path).query("kind == 'step'").set_index("step")["loss"].astype(float)
    assert losses.loc[:FAULT - 1].map(math.isfinite).all() and losses.loc[FAULT:].isna().all()


REPORT_LINES = {
    "healthy": ["Scenario healthy:", f"Trained {STEPS} steps on cpu:", "0 skipped (0)",
                "Keep the current scaler settings.", "none: no step overflowed"],
    "underflow": ["Scenario underflow:", "range 2**0..2**0; 0 skipped", "Change the scaler settings.",
                  "depend on how far the smallest values drifted", "; underflow rate "],
    "overflow": ["Scenario overflow:", "Change the scaler settings.", "Overflow origins",
                 "right after the scale grew", "skipped step(s) instead of"],
    "nan": [f"Trained {STEPS} steps on cpu (weight blown up at step {FAULT}): final loss nan",
            "forward_overflow: an activation exceeded the format's range",
            f"event: the loss was nan at step {FAULT} on rank 0",
            f"origin: blocks.1.mlp.0 (output), step {FAULT}, rank 0", "keep `blocks.1.mlp.0` in float32"],
    "fp8": [f"Trained {STEPS} steps on cpu (weight blown up at step {STEPS // 2})",
            "Keep `blocks.1.mlp.0`, `blocks.1.mlp.2`", "module_filter_fn=lambda mod, fqn: fqn not in",
            "Block formats, from the block statistics of", "MXFP8 RCEIL: "],
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_report_flag_prints_the_explanation(demos, name):
    path, output = demos[name]
    command = SCENARIOS[name].explained_by
    assert f"ampdoctor {command}  {path}" in output  # the rendered report's (or postmortem's) title
    for line in REPORT_LINES[name]:
        assert line in output, (line, output)
    assert "Read it with" not in output
    if command == "report":
        rec = ampdoctor.report(path)["recommendation"]
        assert rec["code"] in output
        assert (f"predicted: {rec['predicted']['skipped_steps']} skipped step(s) instead of "
                f"{rec['current']['skipped_steps']}") in output
        if name == "underflow":  # (the measured step's lost magnitudes say how little is left at 2**16)
            assert rec["init_scale"] >= 2**12 and rec["predicted"]["underflow_rate_max"] < 1e-3


@pytest.mark.parametrize("name", ["underflow", "nan"])
def test_without_report_it_names_the_command_to_run(tmp_path, name):
    path = tmp_path / "run.parquet"
    result = demo("--scenario", name, "--out", str(path), "--steps", "2")
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith(f"Read it with:\n  ampdoctor {SCENARIOS[name].explained_by} {path}\n")


def test_default_scenario_and_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = demo("--steps", "2")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("Scenario healthy:")
    assert "ampdoctor report ampdoctor-demo.parquet" in result.stdout
    assert float(ampdoctor.read_run(tmp_path / "ampdoctor-demo.parquet").metadata[META_INIT_SCALE]) == 2.0**16


def test_unknown_scenario_is_a_usage_error():
    result = demo("--scenario", "bogus")
    assert result.exit_code == 2
    assert "Invalid value for '--scenario'" in result.output and "Traceback" not in result.output


def test_cuda_without_a_gpu_is_a_one_line_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = CliRunner().invoke(main, ["demo", "--device", "cuda", "--scenario", "nan", "--report",
                                       "--out", str(tmp_path / "x")])
    assert result.exit_code != 0
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1
    assert "CUDA is not available" in result.output
    assert not (tmp_path / "x").exists()


def test_the_demo_replaces_its_own_run_and_nothing_else(tmp_path):
    path = tmp_path / "run.parquet"
    run_demo(path, steps=3, device="cpu")
    result = run_demo(path, scenario="nan", steps=2, device="cpu")  # not appended: a fresh run
    assert result.fault_step == 0 and math.isnan(result.final_loss)
    assert ampdoctor.load(path).query("kind == 'step'")["step"].tolist() == [0, 1]
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(DemoError, match="not an ampdoctor run"):
        run_demo(other, steps=1, device="cpu")
    assert (other / "notes.txt").read_text() == "keep me"
    result = demo("--out", str(other), "--steps", "1")
    assert result.exit_code == 2 and "not an ampdoctor run" in result.output
    with pytest.raises(DemoError, match="unknown scenario"):
        run_demo(tmp_path / "y", scenario="bogus")


# -- a recording that stops is an error, not a run to read -------------------------------------------

@pytest.fixture
def disk_full_after_one_segment(monkeypatch):
    """pyarrow writes the run's first segment, then fails as a full disk does."""
    import pyarrow.parquet as pq

    real, written = pq.write_table, []

    def write_table(*args, **kwargs):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(pq, "write_table", write_table)
    return monkeypatch


@pytest.mark.parametrize("report", [[], ["--report"]])
def test_a_recording_that_stops_is_an_error_naming_its_cause_and_what_the_run_holds(
        tmp_path, disk_full_after_one_segment, report):
    """The overflow scenario writes a segment at its first skipped step (step 0); the next write
    fails. The demo stops there, exit 2, and neither says "Wrote ..." nor reports the partial run."""
    path = tmp_path / "run.parquet"
    args = ["--scenario", "overflow", "--out", str(path), "--steps", "30", *report]
    result = demo(*args)
    assert result.exit_code == 2, result.output
    error = result.output.splitlines()[-1]
    assert re.fullmatch(r"Error: recording stopped (at step \d+ of 30|when the run was closed, after step 29): "
                        r"OSError: \[Errno 28\] No space left on device; "
                        rf"the run at {re.escape(str(path))} holds only step 0 \(of 0-29\)", error), error
    assert "Wrote" not in result.output and "Read it with" not in result.output
    assert "ampdoctor report" not in result.output and "Recommendation" not in result.output
    assert ampdoctor.read_run(path).step_range() == (0, 0)  # what the message says the run holds
    disk_full_after_one_segment.undo()  # the same demo on a disk that works
    result = demo(*args)
    assert result.exit_code == 0, result.output
    assert "Error" not in result.output and f"Wrote {path}." in result.output
    assert ampdoctor.read_run(path).step_range() == (0, 29)


def test_a_recording_that_cannot_start_is_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = demo("--out", str(blocker / "run.parquet"), "--steps", "2")
    assert result.exit_code == 2, result.output
    assert re.fullmatch(r"Error: recording could not start: NotADirectoryError: .*; nothing was written to "
                        + re.escape(str(blocker / "run.parquet")), result.output.splitlines()[-1])
    assert "Trained" not in result.output and "Wrote" not in result.output


def test_a_writer_that_does_not_finish_is_an_error(tmp_path, monkeypatch):
    """A stalled disk: the writer is still inside its only segment when the close's wait ends. The
    recorder only warns then (training must not wait); the demo must not call that run written."""
    import threading

    import pyarrow.parquet as pq

    from ampdoctor.record import writer

    release = threading.Event()

    def hang(*args, **kwargs):
        release.wait()
        raise OSError(errno.EIO, "the disk came back too late")

    monkeypatch.setattr(pq, "write_table", hang)
    monkeypatch.setattr(writer, "CLOSE_TIMEOUT", 0.5)
    path = tmp_path / "run.parquet"
    try:
        with pytest.warns(RuntimeWarning, match="did not finish"):
            result = demo("--out", str(path), "--steps", "2")
    finally:
        release.set()
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[-1] == (f"Error: recording did not finish: the writer had not written the "
                                              f"whole run when training ended; nothing was written to {path}")
    assert "Wrote" not in result.output


# -- other scaler settings (to check a recommendation with `ampdoctor compare`) ----------------------

def test_other_scaler_settings_replace_the_scenarios(tmp_path):
    from ampdoctor.run_file.schema import META_GROWTH_INTERVAL

    path = tmp_path / "run.parquet"
    result = run_demo(path, scenario="overflow", steps=3, device="cpu", init_scale=2.0**8, growth_interval=50)
    assert result.settings == {"init_scale": 256.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                               "growth_interval": 50}
    metadata = ampdoctor.read_run(path).metadata
    assert float(metadata[META_INIT_SCALE]) == 256.0 and int(float(metadata[META_GROWTH_INTERVAL])) == 50
    with pytest.raises(DemoError, match="backoff_factor"):
        run_demo(tmp_path / "x", steps=1, device="cpu", backoff_factor=2.0)
    with pytest.raises(DemoError, match="not a GradScaler setting: hysteresis"):
        run_demo(tmp_path / "x", steps=1, device="cpu", hysteresis=2)
    assert not (tmp_path / "x").exists()
    result = demo("--backoff-factor", "2", "--out", str(tmp_path / "y"))
    assert result.exit_code == 2 and "Invalid value for '--backoff-factor'" in result.output


def test_settings_from_a_run_train_its_recommendation(demos, tmp_path):
    source, _ = demos["overflow"]
    rec = ampdoctor.report(source)["recommendation"]
    path = tmp_path / "fixed.parquet"
    result = demo("--scenario", "overflow", "--out", str(path), "--steps", "2", "--settings-from", str(source),
                  "--backoff-factor", "0.25")
    assert result.exit_code == 0, result.output
    scaler = ampdoctor.report(path)["run"]["scaler"]
    assert {k: scaler[k] for k in ("init_scale", "growth_factor", "growth_interval")} == {
        k: rec[k] for k in ("init_scale", "growth_factor", "growth_interval")}
    assert scaler["backoff_factor"] == 0.25  # an option given overrides the recommendation's setting
    assert f"(recommended by {source})." in result.stdout
    assert result.stdout.endswith(f"Check the recommendation with:\n  ampdoctor compare {source} {path}\n")
    bad = demo("--out", str(tmp_path / "z"), "--settings-from", str(tmp_path / "nothing"))
    assert bad.exit_code == 2 and bad.output.startswith("Error: ") and bad.output.count("\n") == 1


def test_the_eta_comes_from_recent_steps_not_the_warm_up():
    from ampdoctor.cli.demo import StepTimer

    now = [0.0]
    timer = StepTimer(150, clock=lambda: now[0])
    now[0] = 3.0  # model building and the first step's warm-up
    timer.advance()
    assert timer.seconds_left() is None and timer.eta() == ""
    for _ in range(19):
        now[0] += 0.03
        timer.advance()
    # 130 steps left at 0.03 s: about 4 s (an average since the start, warm-up included, says 23 s)
    assert timer.seconds_left() == pytest.approx(3.9) and timer.eta() == "eta 00:00:04"
    for _ in range(130):
        now[0] += 0.5  # slower steps: the estimate follows within its window
        timer.advance()
        if timer.done == 140:
            assert timer.seconds_left() == pytest.approx(5.0)
    assert timer.seconds_left() == 0 and timer.eta() == "eta 00:00:00"


def test_fp8_keeps_the_layer_with_the_outlier_weight_and_the_layer_its_channel_feeds(demos):
    """The weight of blocks.1.mlp.0 gets one element of 2**12 midway: its recorded amax jumps there,
    every delayed history clips that step, and current scaling flushes the rest of the weight (kept);
    the outlier's channel reaches blocks.1.mlp.2's input (kept too); fp16 itself trains on."""
    path, _ = demos["fp8"]
    fault = STEPS // 2
    frame = ampdoctor.load(path)
    weight = frame[(frame["kind"] == "gemm_weight") & (frame["name"] == "blocks.1.mlp.0")].set_index("step")["amax"]
    assert weight.loc[:fault - 1].max() < 1 and weight.loc[fault] == 2.0**12  # the very outlier
    data = ampdoctor.fp8(path)
    assert data["keep"] == ["blocks.1.mlp.0", "blocks.1.mlp.2"]
    layer = next(l for l in data["layers"] if l["name"] == "blocks.1.mlp.0")
    assert [r["operand"] for r in layer["reasons"]] == ["weight"] and layer["reasons"][0]["step"] >= fault
    op = next(o for o in layer["operands"] if o["operand"] == "weight")
    assert all(fault in r["clipped_steps"] for r in op["recipes"] if r["recipe"] == "delayed")
    assert fault in op["unavoidable_clip_steps"]
    mlp2 = next(l for l in data["layers"] if l["name"] == "blocks.1.mlp.2")
    assert [r["operand"] for r in mlp2["reasons"]] == ["input"] and mlp2["reasons"][0]["step"] >= fault
    assert math.isfinite(ampdoctor.load(path).query("kind == 'step'")["loss"].astype(float).iloc[-1])
