"""`ampdoctor report` as a whole, on real CPU fp16 runs of tiny models (:mod:`report_scenarios`):
the JSON contract and every output format, what it reads, and runs that are not what the report
expects (a steps-level run, one step, a killed run, damaged or older files, many ranks)."""

from __future__ import annotations

import html
import json
import math
import shutil
import subprocess

import pyarrow as pa
import pytest
from click.testing import CliRunner

import ampdoctor
from ampdoctor.read.run import read_run
from ampdoctor import render
from ampdoctor.analysis.report import report_data
from ampdoctor.analysis.run_analysis import analyse
from ampdoctor.cli.commands import main
from contract_check import REPORT_CONTRACT, SIMULATE_CONTRACT, check_contract
from models import train_recorded
from report_scenarios import SCENARIOS, STEPS, scenarios  # noqa: F401 - the fixture


# -- the JSON contract ------------------------------------------------------------------------

@pytest.mark.parametrize("name", SCENARIOS)
def test_every_format_for_every_scenario(scenarios, name, tmp_path):
    path = scenarios[name][0]
    runner = CliRunner()
    for fmt in ("text", "md", "json", "html"):
        out = tmp_path / f"report.{fmt}"
        result = runner.invoke(main, ["report", str(path), "--format", fmt, "-o", str(out)])
        assert result.exit_code == 0, result.output
        text = out.read_text()
        assert len(text) > 200
        if fmt == "json":
            data = json.loads(text)
            check_contract(data, REPORT_CONTRACT)
            assert data["recommendation"]["code"].startswith("torch.amp.GradScaler(")
        if fmt == "text":
            assert max(len(line) for line in text.splitlines()) <= 100
            assert "GradScaler(" in text
        if fmt == "html":
            assert text.lstrip().startswith("<!DOCTYPE html>") and "<svg" in text
    sim = runner.invoke(main, ["simulate", str(path), "--init-scale", "4096", "--format", "json"])
    assert sim.exit_code == 0, sim.output
    check_contract(json.loads(sim.output), SIMULATE_CONTRACT)
    for fmt in ("text", "md"):
        assert runner.invoke(main, ["simulate", str(path), "--format", fmt]).exit_code == 0
        assert runner.invoke(main, ["layers", str(path), "--format", fmt, "--top", "3"]).exit_code == 0


def test_html_opens_in_headless_chromium_without_errors(scenarios, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    page = tmp_path / "report.html"
    page.write_text(render.report(scenarios["periodic_overflow"][2], "html"))
    result = subprocess.run([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                             "--v=0", "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "<svg" in result.stdout and "GradScaler(" in result.stdout
    assert "CONSOLE" not in result.stderr and "Uncaught" not in result.stderr, result.stderr[-2000:]


def test_report_reads_only_the_columns_it_needs(scenarios, monkeypatch):
    """No full load: the report never builds the all-columns frame."""
    from ampdoctor.read.run import Run

    def forbidden(self):
        raise AssertionError("report_data loaded every column")

    monkeypatch.setattr(Run, "frame", property(forbidden))
    assert report_data(read_run(scenarios["underflow"][0]))["layers"]
    assert analyse(read_run(scenarios["underflow"][0])).level == "params"
    assert len(analyse(read_run(scenarios["underflow"][0])).series) == STEPS


def test_sampled_statistics_stand_in_for_the_steps_between(scenarios, tmp_path):
    """The same training recorded with the full statistics at every step and with the default
    sampling (every 50th step, and the steps after an anomaly): the estimates agree."""
    for name in ("underflow", "init_too_high"):
        # Estimates on both sides (measure_every=0; measured steps are test_underflow_probe.py's).
        sampled_path, dense_path = tmp_path / f"{name}-sampled.parquet", tmp_path / f"{name}.parquet"
        train_recorded(sampled_path, steps=STEPS, measure_every=0, **SCENARIOS[name])
        sampled = report_data(read_run(sampled_path))
        train_recorded(dense_path, steps=STEPS, every=1, measure_every=0, **SCENARIOS[name])
        dense = report_data(read_run(dense_path))
        a, b = dense["recommendation"], sampled["recommendation"]
        assert a["init_scale"] == b["init_scale"], name
        assert a["predicted"]["skipped_steps"] == b["predicted"]["skipped_steps"], name
        dense_rate, sampled_rate = a["current"], b["current"]
        assert math.isclose(dense_rate["underflow_rate_max"], sampled_rate["underflow_rate_max"], rel_tol=0.25,
                            abs_tol=1e-6), (name, dense_rate, sampled_rate)
        # The lower bound drifts as the gradients shrink; sampled every 50th step (interpolated in
        # between) it may miss that drift by up to a factor of 2, and each range holds the other's.
        low_dense, low_sampled = dense_rate["underflow_rate_min"], sampled_rate["underflow_rate_min"]
        assert low_sampled / 2 - 1e-6 <= low_dense <= 2 * low_sampled + 1e-6, (name, dense_rate, sampled_rate)
        assert low_dense <= sampled_rate["underflow_rate_max"] and low_sampled <= dense_rate["underflow_rate_max"]
        assert dense["scale"] == sampled["scale"]


def test_the_run_info_keeps_the_contract_types(scenarios):
    """Scales and factors as floats, the interval as an int, whatever the metadata's text."""
    scaler = report_data(read_run(scenarios["periodic_overflow"][0]))["run"]["scaler"]
    assert scaler["init_scale"] == 2.0**16 and isinstance(scaler["init_scale"], float)
    assert isinstance(scaler["growth_factor"], float) and isinstance(scaler["backoff_factor"], float)
    assert scaler["growth_interval"] == 10 and isinstance(scaler["growth_interval"], int)


# -- runs that are not what the report expects ------------------------------------------------

def test_steps_level_run_reports_what_it_has(tmp_path):
    path = tmp_path / "steps.parquet"
    train_recorded(path, steps=20, init_scale=2.0**24, level="steps", escalate_steps=0)
    data = report_data(read_run(path))
    report = render.contract(data)
    assert report["layers"] == [] and "level='steps'" in report["missing"]["layers"]
    assert report["scale"]["skipped_steps"] >= 5
    assert report["recommendation"]["init_scale"] < 2.0**24
    assert "level='full'" in report["missing"]["overflow_origins"]
    for fmt in ("text", "md", "json", "html"):
        assert "level='steps'" in html.unescape(render.report(data, fmt))


def test_a_single_step_run_says_not_enough_data(tmp_path):
    path = tmp_path / "one.parquet"
    train_recorded(path, steps=1)
    data = report_data(read_run(path))
    assert data["recommendation"] is None
    assert "not enough data" in render.contract(data)["missing"]["recommendation"]
    assert "not enough data" in render.report(data, "text")


def test_killed_run_still_reports_with_a_warning(tmp_path):
    path = tmp_path / "killed.parquet"
    train_recorded(path, steps=40, init_scale=2.0**24)
    final = [p for p in path.glob("*.parquet")
             if __import__("pyarrow.parquet").parquet.read_schema(p).metadata.get(b"ampdoctor.final") == b"true"]
    for p in final:
        p.unlink()  # as if the process died before close()
    report = render.contract(report_data(read_run(path)))
    assert any("did not end with close()" in w for w in report["warnings"])
    assert report["scale"]["skipped_steps"] >= 5


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.parquet", "no such file"),
    (lambda d: (d / "notes.txt").write_text("hi") and d / "notes.txt", "not a Parquet file"),
    (lambda d: d, "empty directory"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, make, message):
    target = make(tmp_path)
    for command in (["report"], ["simulate"], ["layers"]):
        result = CliRunner().invoke(main, command + [str(target)])
        assert result.exit_code == 2
        assert message in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1


def test_multi_rank_run_reads_as_one(tmp_path):
    """The benchmark's synthetic writer: 4 ranks, merged per step."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from report_speed import write_synthetic_run

    steps = write_synthetic_run(tmp_path / "ranks.parquet", 40_000, 4)
    report = report_data(read_run(tmp_path / "ranks.parquet"))
    assert report["run"]["ranks"] == 4 and report["run"]["steps"] == steps == 100
    assert len(report["layers"]) == 99
    check_contract(json.loads(render.to_json(report)), REPORT_CONTRACT)


@pytest.mark.parametrize("damage, message", [
    ("newer", "schema version 99"),
    ("empty", "empty run"),
    ("truncated", "no readable segments"),
])
def test_unreadable_runs_are_one_line_errors(tmp_path, damage, message):
    import pyarrow.parquet as pq
    path = tmp_path / "run.parquet"
    if damage == "empty":
        ampdoctor.GradScaler("cpu", path=path).close()
    else:
        train_recorded(path, steps=2)
        for seg in path.glob("*.parquet"):
            if damage == "newer":
                table = pq.read_table(seg)
                meta = dict(table.schema.metadata)
                meta[b"ampdoctor.schema_version"] = b"99"
                pq.write_table(table.replace_schema_metadata(meta), seg)
            else:
                seg.write_bytes(seg.read_bytes()[:100])
    for command in ("report", "simulate", "layers"):
        result = CliRunner().invoke(main, [command, str(path)])
        assert result.exit_code == 2, result.output
        assert message in result.output and len(result.output.strip().splitlines()) == 1


# -- odd but legal runs (review findings) --------------------------------------------------------

def test_scale_collapsed_to_zero_keeps_rates_finite(tmp_path):
    path = tmp_path / "zero.parquet"
    train_recorded(path, steps=160, loss_factor=1e20, init_scale=1.0)  # 150 backoffs: the scale reaches 0
    report = report_data(read_run(path))
    assert report["scale"]["min"] == 0.0
    assert all(layer["underflow_rate"] is None or math.isfinite(layer["underflow_rate"])
               for layer in report["layers"])
    check_contract(json.loads(render.to_json(report)), REPORT_CONTRACT)


def test_run_ending_on_a_skipped_step_keeps_its_step_range(tmp_path):
    """The anomaly flush leaves an empty final segment; the heatmap still spans every step."""
    path = tmp_path / "end.parquet"
    train_recorded(path, steps=30, init_scale=2.0**24, level="full")
    a = analyse(read_run(path))
    assert a.run.step_range() == (0, 29)
    heat = report_data(read_run(path))["charts"]["heatmap"]
    assert heat["steps"][0] == 0 and len(heat["steps"]) == 30
    assert all(v is None or math.isfinite(v) for row in heat["high"] for v in row)


def test_segments_missing_new_columns_still_report(scenarios, tmp_path):
    """Schema-1 segments written before the call/parent/inputs and hist columns were filled."""
    import pyarrow.parquet as pq
    src = scenarios["periodic_overflow"][0]
    dst = tmp_path / "old.parquet"
    dst.mkdir()
    for i, seg in enumerate(sorted(src.glob("*.parquet"))):
        table = pq.read_table(seg)
        drop = ["call", "parent", "inputs", "computed_inputs"] + (["hist"] if i % 2 else [])
        table = table.drop_columns(drop)
        if i == 0:  # and one segment with plain strings instead of dictionaries
            table = table.cast(pa.schema([pa.field(f.name, pa.string()) if pa.types.is_dictionary(f.type) else f
                                          for f in table.schema], metadata=table.schema.metadata))
        pq.write_table(table, dst / seg.name)
    for command in ("report", "simulate", "layers"):
        result = CliRunner().invoke(main, [command, str(dst)])
        assert result.exit_code == 0, result.output
    assert report_data(read_run(dst))["overflow_origins"]


def test_step_rows_without_a_scale_are_left_out_with_a_warning(tmp_path):
    """A damaged step row (its scale NaN) is left out of the analysis, said in the report's warnings;
    the run read stays as it was (its warnings are the reader's)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from ampdoctor.read.run import read_run

    path = tmp_path / "run.parquet"
    train_recorded(path, steps=6)
    for seg in path.glob("*.parquet"):
        table = pq.read_table(seg)
        first_step_row = pc.equal(pc.cumulative_sum(pc.cast(pc.equal(table["kind"].cast(pa.string()), "step"),
                                                            pa.int64())), 1)
        is_it = pc.and_(first_step_row, pc.equal(table["kind"].cast(pa.string()), "step"))
        scale = pc.if_else(is_it, pa.scalar(float("nan"), pa.float32()), table["scale"])
        pq.write_table(table.set_column(table.schema.get_field_index("scale"), table.schema.field("scale"), scale)
                       .replace_schema_metadata(table.schema.metadata), seg)
    run = read_run(path)
    before = list(run.warnings)
    report = render.contract(report_data(run))
    assert run.warnings == before
    assert report["run"]["steps"] == 5
    assert any(w.startswith("left out 1 step row(s) whose scale is not a number") for w in report["warnings"])
