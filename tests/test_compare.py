"""`ampdoctor compare`: the acceptance of issue 19 (the overflow demo, then the same scenario
re-trained with its own recommendation: the change and whether the prediction held, in every
format), settings that differ, runs of other formats, bad paths, and the rules of the check."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import ampdoctor
from ampdoctor.read.run import read_run
from ampdoctor import render
from ampdoctor.analysis.compare import (SETTINGS, UNDERFLOW_SLACK, check_skipped, check_underflow, compare_data,
                                        join_layers, setting_differences)
from ampdoctor.cli.commands import main
from ampdoctor.render.formatting import scale_str
from contract_check import UNDERFLOW_FIELDS, check_contract
from models import batches, fit, QuietMLP

STEPS = 60
SIDE = {"path": str, "steps": int, "ranks": int, "amp_dtype": str, "level": str,
        "scaler": {"class": str, "init_scale": float, "growth_factor": float, "backoff_factor": float,
                   "growth_interval": int},
        "skipped_steps": int, "skipped_fraction": float, "settle_step": (int, type(None)), **UNDERFLOW_FIELDS,
        "scale": {"initial": float, "final": float, "min": float, "max": float},
        "final_loss": (float, type(None)),
        "recommendation": {"init_scale": float, "growth_factor": float, "backoff_factor": float,
                           "growth_interval": int, "verdict": str, "code": str,
                           "predicted": {"skipped_steps": int, "uncertain_steps": int, **UNDERFLOW_FIELDS}}}
LAYER_SIDE = {"underflow_rate": (float, type(None)), "underflow_rate_max": (float, type(None)),
              "headroom_log2": (float, type(None))}
COMPARE_CONTRACT = {
    "a": SIDE, "b": SIDE,
    "change": {"skipped_steps": int, "skipped_fraction": float, "underflow_rate_min": (float, type(None)),
               "underflow_rate_max": (float, type(None)), "final_scale_log2": (float, type(None))},
    # check_contract rejects every bool (a bool is an int): the `held` keys are checked by check_held
    "prediction": {"status": str, "finding": str,
                   "recommended": {k: float for k in SETTINGS}, "recorded": {k: (float, type(None)) for k in SETTINGS},
                   "differences": [{"setting": str, "recommended": float, "recorded": (float, type(None))}],
                   "skipped": {"predicted": int, "uncertain": int, "expected_min": float, "expected_max": float,
                               "tolerance": float, "got": int},
                   "underflow": {"predicted": UNDERFLOW_FIELDS, "got": UNDERFLOW_FIELDS, "gap": (float, type(None)),
                                 "tolerance": float}},
    "summary": [str],
    "layers": [{"name": str, "kind": str, "type": (str, type(None)), "in": str,
                "underflow_change": (float, type(None)), "underflow_max_change": (float, type(None)),
                "headroom_change": (float, type(None))}],
    "warnings": [str],
}


NULLABLE = {"prediction": ("recommended", "recorded", "skipped", "underflow"), "a": ("recommendation",),
            "b": ("recommendation",)}


def check_compare_contract(data: dict) -> None:
    """check_contract, with the objects the contract allows to be null left out where they are."""
    spec = {key: ({k: v for k, v in sub.items() if not (k in NULLABLE.get(key, ()) and data[key][k] is None)}
                  if isinstance(sub, dict) else sub) for key, sub in COMPARE_CONTRACT.items()}
    check_contract(data, spec)
    prediction = data["prediction"]
    for part in (prediction, prediction["skipped"], prediction["underflow"]):
        assert part is None or part["held"] is None or isinstance(part["held"], bool), part
    assert prediction["skipped"] is None or isinstance(prediction["skipped"]["held"], bool)


def cli(*args: str):
    return CliRunner().invoke(main, [*map(str, args)])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The overflow demo (A), the same scenario re-trained with A's recommendation (B), and with
    A's recommendation but another growth_interval (C)."""
    root = tmp_path_factory.mktemp("compare")
    paths = {name: root / f"{name}.parquet" for name in "ABC"}
    common = ["demo", "--scenario", "overflow", "--device", "cpu", "--steps", STEPS]
    for name, extra in (("A", []), ("B", ["--settings-from", paths["A"]]),
                        ("C", ["--settings-from", paths["A"], "--growth-interval", 20])):
        result = cli(*common, "--out", paths[name], *extra)
        assert result.exit_code == 0, result.output
    return paths


def test_the_overflow_fix_holds_its_prediction(runs):
    result = cli("compare", runs["A"], runs["B"], "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    check_compare_contract(data)
    a, b, prediction = data["a"], data["b"], data["prediction"]
    # Each side is the report's own numbers.
    report_a = ampdoctor.report(runs["A"])
    assert a["skipped_steps"] == report_a["scale"]["skipped_steps"] >= 0.1 * STEPS
    assert {k: a["recommendation"][k] for k in SETTINGS} == {k: report_a["recommendation"][k] for k in SETTINGS}
    assert a["recommendation"]["predicted"] == report_a["recommendation"]["predicted"]
    assert {k: b["scaler"][k] for k in SETTINGS} == prediction["recommended"] == prediction["recorded"]
    assert data["change"]["skipped_steps"] == b["skipped_steps"] - a["skipped_steps"] < 0
    assert prediction["status"] == "checked" and prediction["held"] is True
    predicted, got = a["recommendation"]["predicted"]["skipped_steps"], b["skipped_steps"]
    assert prediction["skipped"]["predicted"] == predicted and prediction["skipped"]["got"] == got
    assert abs(got - predicted) <= max(1, 0.02 * STEPS)
    assert f"the prediction held: predicted {predicted} skipped, got {got}" in prediction["finding"]
    assert data["summary"][0] == (f"skipped steps: {a['skipped_steps']} of {STEPS} in run A, {got} of {STEPS} "
                                  f"in run B ({a['skipped_steps'] - got} fewer)")
    assert data["summary"][-1] == prediction["finding"]
    # Every layer of both runs, in both.
    assert {(x["name"], x["kind"]) for x in data["layers"]} == {(x["name"], x["kind"]) for x in report_a["layers"]}
    assert all(x["in"] == "both" for x in data["layers"])


def test_every_format_says_the_change_and_the_verdict(runs, tmp_path):
    from ampdoctor.render.html import prose
    from ampdoctor.render.markdown import escaped_text

    data = compare_data(read_run(runs["A"]), read_run(runs["B"]))
    # The verdict as data, not as one CPU's wording: the replay predicts run B's underflow from A's
    # fp16 gradients, whose last bits differ from one CPU to the next (5.5e-7 with AVX-512 kernels,
    # "<0.001%"; exactly 0 with ATen's AVX2 ones, "no underflow"). Either is a negligible prediction.
    prediction = data["prediction"]
    assert prediction["status"] == "checked" and prediction["finding"].code == "prediction_held"
    for side in ("predicted", "got"):
        assert prediction["underflow"][side]["underflow_rate_max"] < UNDERFLOW_SLACK, prediction
    finding = render.contract(data)["prediction"]["finding"]
    assert finding.startswith("the prediction held: ")
    skipped = render.contract(data)["summary"][0]
    for fmt in ("text", "md", "html"):
        out = tmp_path / f"compare.{fmt}"
        result = cli("compare", runs["A"], runs["B"], "--format", fmt, "-o", out)
        assert result.exit_code == 0, result.output
        text = out.read_text()
        assert text == render.comparison(data, fmt).rstrip("\n") + "\n"
        if fmt == "text":
            assert max(len(line) for line in text.splitlines()) <= 100
            assert "Prediction (checked)" in text and "skipped steps" in text
            flat = " ".join(text.split())
            assert finding in flat and skipped in flat
        if fmt == "md":
            # Markdown escapes what it would read as markup: "<0.001%" is written "\<0.001%".
            assert "## Prediction (checked)" in text and escaped_text(finding) in text
            tables = [line for line in text.splitlines() if line.startswith("|")]
            assert tables and all(line.count(" | ") >= 3 for line in tables)
            assert "| skipped steps |" in text
        if fmt == "html":
            assert text.startswith("<!DOCTYPE html>") and text.count("<svg") == 1
            assert f'<p class="verdict held">{prose(finding)}</p>' in text
    # Text to the terminal cuts the layer table; the other formats show up to 50 layers.
    short = cli("compare", runs["A"], runs["B"], "--top", "3").output
    assert "more (--top N shows more" in short
    assert len(re.findall(r"^  blocks\.|^  head\.|^  tok\.|^  pos\.|^  ln_f\.", short, re.M)) == 3


def test_the_html_page_loads_in_headless_chromium(runs, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    page = tmp_path / "compare.html"
    assert cli("compare", runs["A"], runs["B"], "--format", "html", "-o", page).exit_code == 0
    result = subprocess.run([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                             "--v=0", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
                            capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "CONSOLE" not in result.stderr and "Uncaught" not in result.stderr, result.stderr[-2000:]
    dom = result.stdout
    assert "the prediction held" in dom and "<svg" in dom and "Layers (worst change first)" in dom
    assert dom.index('id="summary"') < dom.index('id="runs"') < dom.index('id="layers"')  # the verdict first


def test_other_settings_get_no_verdict_and_are_named(runs):
    data = json.loads(cli("compare", runs["A"], runs["C"], "--format", "json").output)
    check_compare_contract(data)
    prediction = data["prediction"]
    assert prediction["status"] == "settings_differ" and prediction["held"] is None
    assert prediction["differences"] == [{"setting": "growth_interval",
                                          "recommended": data["a"]["recommendation"]["growth_interval"],
                                          "recorded": 20}]
    assert prediction["skipped"] is None and prediction["underflow"] is None
    interval = data["a"]["recommendation"]["growth_interval"]
    assert f"growth_interval recommended {interval}, recorded 20" in prediction["finding"]
    assert "no verdict on the prediction" in prediction["finding"]
    text = cli("compare", runs["A"], runs["C"]).output
    assert "Prediction (not checked: other settings)" in text and "differs" in text
    # The same comparison the other way round: C's own recommendation is not A's settings.
    back = json.loads(cli("compare", runs["C"], runs["A"], "--format", "json").output)["prediction"]
    assert back["status"] == "settings_differ"
    assert any(d["setting"] == "init_scale" and d["recorded"] == 2.0**24 for d in back["differences"])


def test_a_run_b_that_skips_more_than_predicted_is_a_miss_and_other_lengths_get_no_verdict(runs, tmp_path):
    """Run B takes A's recommended settings but a weight blows up near its end (the nan scenario):
    it skips steps the replay of A's gradients could not foresee, so the prediction did not hold.
    Trained for another number of steps, there is no verdict at all: skips do not scale with the
    length of a run."""
    missed = tmp_path / "missed.parquet"
    assert cli("demo", "--scenario", "nan", "--device", "cpu", "--steps", STEPS, "--out", missed,
               "--settings-from", runs["A"]).exit_code == 0
    data = json.loads(cli("compare", runs["A"], missed, "--format", "json").output)
    prediction = data["prediction"]
    assert prediction["status"] == "checked" and prediction["held"] is False
    got = ampdoctor.load(missed).query("kind == 'step'").groupby("step").skipped.any().sum()
    assert prediction["skipped"]["got"] == got > prediction["skipped"]["expected_max"] + prediction["skipped"]["tolerance"]
    assert prediction["finding"].startswith("the prediction did not hold")
    shorter = tmp_path / "shorter.parquet"
    assert cli("demo", "--scenario", "overflow", "--device", "cpu", "--steps", STEPS // 2, "--out", shorter,
               "--settings-from", runs["A"]).exit_code == 0
    data = json.loads(cli("compare", runs["A"], shorter, "--format", "json").output)
    assert data["prediction"]["status"] == "steps_differ" and data["prediction"]["held"] is None
    assert f"different numbers of steps ({STEPS} and {STEPS // 2})" in data["prediction"]["finding"]


def test_two_bf16_runs_are_not_checked_against_a_float16_prediction(tmp_path):
    paths = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.parquet"
        model = QuietMLP()
        with ampdoctor.GradScaler("cpu", model=model, path=path, amp_dtype=torch.bfloat16) as scaler:
            fit(model, scaler, batches(12), dtype=torch.bfloat16)
        paths.append(path)
    data = json.loads(cli("compare", *paths, "--format", "json").output)
    assert data["prediction"]["status"] == "not_float16" and data["prediction"]["held"] is None
    assert "both runs trained in bfloat16" in data["prediction"]["finding"]


def test_compare_names_the_module_type_of_indexed_layers(runs):
    """The demo's MLP is an nn.Sequential: its children's layers carry their module type."""
    layers = json.loads(cli("compare", runs["A"], runs["B"], "--format", "json").output)["layers"]
    typed = {x["name"]: x["type"] for x in layers if x["type"]}
    report = ampdoctor.report(runs["A"])["layers"]
    assert typed and typed == {x["name"]: x["module_type"] for x in report if x["module_type"]}


def test_a_run_of_another_format_is_a_finding_not_a_crash(runs, tmp_path):
    path = tmp_path / "bf16.parquet"
    model = QuietMLP()
    with ampdoctor.GradScaler("cpu", enabled=False, model=model, path=path, amp_dtype=torch.bfloat16) as scaler:
        fit(model, scaler, batches(12), dtype=torch.bfloat16)
    result = cli("compare", runs["A"], path, "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["b"]["amp_dtype"] == "bfloat16" and data["prediction"]["status"] == "not_comparable"
    assert data["prediction"]["held"] is None
    assert "different formats (run A float16, run B bfloat16)" in data["prediction"]["finding"]
    assert data["warnings"][0] == data["prediction"]["finding"]
    assert {x["in"] for x in data["layers"]} == {"a", "b"}  # no layer in common: each marked as such
    assert [x["in"] for x in data["layers"]][-1] == "b"
    for fmt in ("text", "md", "html"):
        assert cli("compare", runs["A"], path, "--format", fmt).exit_code == 0


def test_a_run_without_loss_scaling_did_not_apply_the_recommendation(runs, tmp_path):
    path = tmp_path / "unscaled.parquet"
    model = QuietMLP()
    with ampdoctor.GradScaler("cpu", enabled=False, model=model, path=path, amp_dtype=torch.float16) as scaler:
        fit(model, scaler, batches(12))
    data = json.loads(cli("compare", runs["A"], path, "--format", "json").output)
    assert data["a"]["loss_scaling"] is True and data["b"]["loss_scaling"] is False
    prediction = data["prediction"]
    assert prediction["status"] == "settings_differ" and prediction["held"] is None
    assert prediction["recorded"] == dict.fromkeys(SETTINGS)
    assert [d["setting"] for d in prediction["differences"]] == list(SETTINGS)
    init = scale_str(data["a"]["recommendation"]["init_scale"])
    assert f"init_scale recommended {init}, recorded —" in prediction["finding"]


def test_a_bad_path_is_one_line_and_exit_2(runs, tmp_path):
    result = cli("compare", runs["A"], tmp_path / "missing.parquet")
    assert result.exit_code == 2
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1
    assert "missing.parquet" in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    result = cli("compare", empty, runs["A"], "--format", "html")
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "Traceback" not in result.output
    result = cli("compare", runs["A"], runs["B"], "--run-b", "no-such-id")
    assert result.exit_code == 2 and result.output.count("\n") == 1


def test_compare_reads_runs_without_torch(runs):
    code = ("import sys; from ampdoctor.cli.commands import main\n"
            f"try: main(['compare', {str(runs['A'])!r}, {str(runs['B'])!r}, '--format', 'json'])\n"
            "except SystemExit as e: assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules, 'imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["prediction"]["held"] is True


# -- the rules of the check -------------------------------------------------------------------------

def test_skipped_steps_hold_within_one_step_of_the_prediction_however_long_the_run():
    predicted = {"skipped_steps": 10, "uncertain_steps": 0}
    same = check_skipped(predicted, 11)
    assert same["held"] and same["tolerance"] == 1.0 and same["expected_min"] == same["expected_max"] == 10
    assert not check_skipped(predicted, 12)["held"] and not check_skipped(predicted, 8)["held"]
    assert check_skipped({"skipped_steps": 0, "uncertain_steps": 0}, 1)["held"]  # one step is noise
    assert not check_skipped({"skipped_steps": 0, "uncertain_steps": 0}, 200)["held"]  # no slack from length
    uncertain = check_skipped({"skipped_steps": 2, "uncertain_steps": 5}, 8)  # 2..7, ± 1
    assert uncertain["held"] and not check_skipped({"skipped_steps": 2, "uncertain_steps": 5}, 9)["held"]


def test_underflow_holds_when_the_ranges_overlap_or_are_a_tenth_of_a_point_apart():
    def fields(low, high):
        return {"underflow_rate": low if high - low < 1e-4 else None, "underflow_rate_min": low,
                "underflow_rate_max": high}

    assert check_underflow(fields(0.0, 0.02), fields(0.01, 0.05))["held"]  # overlap
    near = check_underflow(fields(0.0, 0.0), fields(0.0009, 0.0009))
    assert near["held"] and near["gap"] == pytest.approx(0.0009) and near["tolerance"] == UNDERFLOW_SLACK
    far = check_underflow(fields(0.0, 0.0), fields(0.002, 0.003))
    assert far["held"] is False and far["gap"] == pytest.approx(0.002)
    unknown = check_underflow(fields(0.0, 0.0), {"underflow_rate": None, "underflow_rate_min": None,
                                                 "underflow_rate_max": 0.5})
    assert unknown["held"] is None and unknown["gap"] is None


def test_a_missed_prediction_says_by_how_much():
    from ampdoctor.analysis.findings import Finding
    from ampdoctor.render.wording import word

    skipped = check_skipped({"skipped_steps": 3, "uncertain_steps": 0}, 11)
    flow = check_underflow({"underflow_rate": 0.0, "underflow_rate_min": 0.0, "underflow_rate_max": 0.0},
                           {"underflow_rate": 0.05, "underflow_rate_min": 0.05, "underflow_rate_max": 0.05})
    assert word(Finding("prediction_missed", {"skipped": skipped, "underflow": flow})) == (
        "the prediction did not hold: predicted 3 skipped, got 11 (more than 1 off); "
        "predicted no underflow, got 5% underflow (5% apart)")


def test_settings_match_within_float_formatting():
    recommended = {"init_scale": 2.0**17, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
    assert setting_differences(recommended, {**recommended, "init_scale": 131072.0000001}) == []
    assert setting_differences(recommended, {**recommended, "backoff_factor": 0.25}) == [
        {"setting": "backoff_factor", "recommended": 0.5, "recorded": 0.25}]
    assert [d["setting"] for d in setting_differences(recommended, {**recommended, "growth_interval": None})] == [
        "growth_interval"]


def test_layers_join_by_name_and_kind_worst_change_first():
    def layer(name, kind, rate, headroom, rate_max=None):
        return {"name": name, "kind": kind, "underflow_rate": rate,
                "underflow_rate_max": rate if rate_max is None else rate_max, "headroom_log2": headroom}

    a = [layer("w", "param_grad", 0.0, 5.0), layer("v", "param_grad", 0.1, 2.0),
         layer("u", "param_grad", 0.0, 6.0), layer("gone", "param_grad", 0.0, 1.0), layer("w", "grad_output", 0, 3.0)]
    b = [layer("w", "param_grad", 0.02, 4.0), layer("v", "param_grad", 0.0, 3.0),
         layer("u", "param_grad", 0.0, 1.0), layer("new", "param_grad", 0.0, 1.0),
         layer("w", "grad_output", None, 3.0, rate_max=0.5)]
    joined = join_layers(a, b)
    assert [(x["name"], x["kind"], x["in"]) for x in joined] == [
        ("w", "grad_output", "both"),  # its upper bound rose by 50 points
        ("w", "param_grad", "both"), ("u", "param_grad", "both"), ("v", "param_grad", "both"),
        ("gone", "param_grad", "a"), ("new", "param_grad", "b")]
    w = joined[1]
    assert w["underflow_change"] == pytest.approx(0.02) and w["headroom_change"] == -1.0
    assert joined[0]["underflow_change"] is None and joined[0]["underflow_max_change"] == 0.5
    assert joined[-1]["a"] is None and joined[-1]["headroom_change"] is None
