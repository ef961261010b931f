"""``ampdoctor fp8`` (FP8 readiness, issue 29), its presentation: the renderers on a hand-made example
of :func:`ampdoctor.analysis.fp8.fp8_data`'s data (text, Markdown, HTML, JSON), the command and
``ampdoctor.fp8()`` over a stand-in analysis, and, once the recorder writes the GEMM operand rows
and the analysis exists, the command on a recorded run."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import sys
import types

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import ampdoctor
from ampdoctor.run_file import schema
from ampdoctor.cli.commands import main
from ampdoctor.analysis.block_readiness import not_assessed
from ampdoctor.analysis.te_config import te_debug_config
from ampdoctor.errors import RunError
from ampdoctor.render.fp8 import render_fp8
from contract_check import FP8_CONTRACT, check_contract

HISTORIES = (1, 16, 1024)
E4M3 = {"dtype": "float8_e4m3fn", "max": 448.0, "flushes_at_or_below": 0.0009765625}
E5M2 = {"dtype": "float8_e5m2", "max": 57344.0, "flushes_at_or_below": 7.62939453125e-06}
SNIPPET = "convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn not in {'head'})"


def _recipe(recipe, history=None, flushed=(0.0, 0.0, 0), clipped=()):
    """One recipe of one operand: ``flushed`` (mean, max, step of the max) or None when unsampled."""
    mean, worst, step = flushed if flushed is not None else (None, None, None)
    return {"recipe": recipe, "history": history, "flushed_mean": mean, "flushed_max": worst,
            "flushed_max_step": step, "saturated_mean": None if flushed is None else 0.0,
            "saturated_max": None if flushed is None else 0.0,
            "clipped_passes": len(clipped), "clipped_steps": list(clipped)}


def _operand(operand, fmt, variant="hybrid", *, amax=1.0, passes=100, sampled=5, shortest=1, unavoidable=(),
             current=(0.0, 0.0, 0), delayed=None):
    """``delayed``: history -> (flushed (mean, max, step) or None, clipped steps); the unavoidable
    clips otherwise."""
    delayed = delayed or {}
    unsampled = sampled == 0
    recipes = [_recipe("current", None, None if unsampled else current)]
    for h in HISTORIES:
        flushed, clipped = delayed.get(h, (current, unavoidable))
        recipes.append(_recipe("delayed", h, None if unsampled else flushed, clipped))
    return {"operand": operand, "format": fmt, "variant": variant, "amax_max": amax, "passes": passes,
            "sampled_passes": sampled, "shortest_history": None if unsampled else shortest,
            "unavoidable_clip_steps": list(unavoidable), "unavoidable_clip_passes": len(unavoidable),
            "recipes": recipes}


def _operands(grad_e5m2, grad_e4m3=None, **common):
    """The four (operand, format) of a layer; ``grad_e4m3`` defaults to the E5M2 one's settings."""
    input_ = common.pop("input", {})
    weight = common.pop("weight", {})
    return [_operand("input", "e4m3", **{**common, **input_}),
            _operand("weight", "e4m3", **{**common, "passes": common.get("passes", 100) // 2, **weight}),
            _operand("grad_output", "e5m2", **{**common, **grad_e5m2}),
            _operand("grad_output", "e4m3", "all_e4m3", **{**common, **(grad_e4m3 or grad_e5m2)})]


def example_fp8_data() -> dict:
    """A realistic ``fp8_data`` result: 4 GEMM layers, a convolution (not converted), one layer to
    keep (with reasons), one unknown, one called twice per step with clipped passes."""
    ramp = [1, 3, 5, 8, 13, 17, 20, 22, 25, 29, 31, 34, 36, 38, 41, 43, 45, 47, 50, 52, 55, 57, 58, 61, 63, 66,
            68, 70, 72, 75, 77, 80, 82, 85, 88, 91, 94]
    layers = [
        {"name": "stem", "type": "Conv2d", "converted": False, "calls_per_step": 1, "verdict": "ready",
         "reasons": [], "shortest_history": 1,
         "operands": _operands({"current": (1e-4, 3e-4, 40)}, passes=50, current=(2e-5, 6e-5, 20))},
        {"name": "blocks.0.attn.qkv", "type": "Linear", "converted": True, "calls_per_step": 2,
         "verdict": "ready", "reasons": [], "shortest_history": 16,
         "operands": _operands(
             {"current": (2e-4, 8e-4, 60), "shortest": 4, "unavoidable": (2,),
              "delayed": {1: ((3e-4, 9e-4, 60), (2, 9, 14, 33, 51, 52, 70, 71, 88, 90, 95, 99)),
                          16: ((5e-4, 0.002, 60), (2,)), 1024: ((0.003, 0.0071, 80), (2,))}},
             {"current": (0.004, 0.0093, 60), "shortest": 4, "unavoidable": (2,),
              "delayed": {1: ((0.005, 0.011, 60), (2, 9, 14)), 16: ((0.006, 0.012, 60), (2,)),
                          1024: ((0.02, 0.041, 80), (2,))}},
             passes=200, input={"current": (1e-4, 4e-4, 20), "shortest": 16, "unavoidable": (1, 3),
                                "delayed": {1: ((1e-4, 5e-4, 20), ramp), 16: ((2e-4, 6e-4, 20), (1, 3)),
                                            1024: ((0.002, 0.0061, 80), (1, 3))}})},
        {"name": "blocks.0.mlp.fc2", "type": "Linear", "converted": True, "calls_per_step": 1, "verdict": "unknown",
         "reasons": [], "shortest_history": None,
         "operands": _operands({"sampled": 0}, passes=100)},
        {"name": "head", "type": "Linear", "converted": True, "calls_per_step": 1, "verdict": "keep",
         "reasons": [{"operand": "grad_output", "format": "e5m2", "recipe": "current", "flushed": 0.0342,
                      "saturated": 0.0, "step": 40},
                     {"operand": "input", "format": "e4m3", "recipe": "current", "flushed": 0.0121,
                      "saturated": 0.0, "step": 20}],
         "shortest_history": 1024,
         "operands": _operands({"current": (0.021, 0.0342, 40), "amax": math.inf, "shortest": 1024,
                                "unavoidable": (0, 7)},
                               {"current": (0.31, 0.52, 40), "amax": math.inf, "shortest": 1024,
                                "unavoidable": (0, 7)},
                               input={"current": (0.008, 0.0121, 20)})},
    ]
    return {
        "path": "/runs/gpt.parquet", "run_id": "20261127-101500-ab12", "amp_dtype": "bfloat16", "device": "cuda",
        "steps": {"first": 0, "last": 99, "passes": 100}, "sampled_steps": [0, 20, 40, 60, 80],
        "flush_limit": 0.01, "histories": list(HISTORIES), "formats": {"e4m3": dict(E4M3), "e5m2": dict(E5M2)},
        "layers": layers,
        "keep": ["head"], "ready": ["stem", "blocks.0.attn.qkv"], "unknown": ["blocks.0.mlp.fc2"], "not_called": [],
        "module_filter_fn": "lambda mod, fqn: fqn not in {'head'}", "te_debug_config": te_debug_config(["head"]),
        "shortest_history": 16,
        "block_formats": not_assessed("the run was recorded by an ampdoctor before 2026-11-28, which did not "
                                      "record block statistics"),
        "limits": ["per_block_formats", "convolutions_not_converted", "several_calls_per_step"],
    }


@pytest.fixture
def data():
    return example_fp8_data()


def _flat(text: str) -> str:
    """Text with its line breaks and Markdown escapes gone, for checking words across a wrap."""
    return " ".join(text.replace("\\", "").split())


# -- the renderers ------------------------------------------------------------------------------

def test_the_example_follows_the_contract(data):
    check_contract(json.loads(render_fp8(data, "json")), FP8_CONTRACT)


@pytest.mark.parametrize("fmt", ["text", "md", "html"])
def test_each_format_leads_with_the_verdict_and_holds_the_kept_names_snippet_and_limits(data, fmt):
    out = render_fp8(data, fmt)
    flat = _flat(out)
    if fmt == "html":
        flat = flat.replace("&#x27;", "'").replace("&quot;", '"')
    assert SNIPPET in flat
    assert "head" in flat and "blocks.0.mlp.fc2" in flat and "stem" in flat
    assert "1 to keep in bfloat16" in flat and "2 are ready" in flat and "1 unknown" in flat
    assert "te.fp8_autocast(enabled=False)" in flat and "torch.nn.Linear" in flat
    assert "amax_history_len=16" in flat and "default history of 1024" in flat
    assert "flushes up to 0.71%" in flat  # history 1024's largest excess flush (qkv's output gradient) ...
    assert "where a history of 1 flushes 0.09%" in flat  # ... against history 1's (the first pass alike in both)
    # the limits: per-block formats, convolutions, several calls, the histogram's resolution
    assert "Per-block formats (MXFP8, MXFP4, NVFP4) are not assessed: the run was recorded by an ampdoctor before" in flat
    assert "neither TransformerEngine nor torchao converts convolutions" in flat
    assert "8 bins per binade" in flat and "several times per step" in flat
    # the verdict comes before the tables and the limits
    assert flat.index(SNIPPET) < flat.index("history 1024") < flat.index("MXFP8")


def test_text_keeps_the_snippet_on_one_line_and_fits_100_columns(data):
    out = render_fp8(data, "text")
    assert any(SNIPPET in line for line in out.splitlines())
    assert all(len(line) <= 100 for line in out.splitlines() if "`" not in line), out
    assert "\x1b[" not in out and "\x1b[" in render_fp8(data, "text", color=True)


def test_text_layer_table_and_delayed_table(data):
    lines = render_fp8(data, "text").splitlines()
    head = next(line for line in lines if line.strip().startswith("head "))
    assert head.split()[:7] == ["head", "Linear", "keep", "1.21%", "0", "3.42%", "52%"]
    unknown = next(line for line in lines if line.strip().startswith("blocks.0.mlp.fc2"))
    assert unknown.split()[2:] == ["unknown", "0", "0", "—", "—", "—"]  # its output gradient never sampled
    assert any(line.split()[:2] == ["stem", "Conv2d*"] for line in lines)
    # the delayed table: qkv's input clips 37 passes at history 1, the first 5 steps listed
    assert any("history 1 " in line and "37 (steps 1, 3, 5, 8, 13 and 32 more)" in line for line in lines)
    assert any("history 16, 1024 " in line and "2 (steps 1, 3)" in line for line in lines)  # alike: one line
    assert any("unavoidable" in line and "2 (1, 3)" in line for line in lines)
    assert not any(line.strip().startswith("stem ") and "shortest" in line for line in lines)  # never clipped
    assert "Why keep" in lines
    assert any("output gradient in E5M2 flushes 3.42% of its nonzero elements at step 40" in line
               for line in lines)


def test_markdown_tables(data):
    md = render_fp8(data, "md")
    assert md.startswith("# ampdoctor fp8\n")
    assert "| `head` | Linear | keep | 1.21% | 0 | 3.42% | 52% | 1024 |" in md
    assert "| `stem` | Conv2d\\* | ready |" in md
    assert "37 (steps 1, 3, 5, 8, 13 and 32 more)" in md
    assert f"`{SNIPPET}`" in md


def test_html_is_one_self_contained_page(data):
    page = render_fp8(data, "html")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page and "http" not in page.replace("http-equiv", "")
    assert page.index('id="verdict"') < page.index('id="layers"') < page.index('id="delayed"') < page.index(
        'id="limits"')
    assert "<code>head</code>" in page and "<title>ampdoctor fp8: /runs/gpt.parquet</title>" in page


def test_json_round_trips_without_nan(data):
    text = render_fp8(data, "json")
    assert "NaN" not in text and "Infinity" not in text
    loaded = json.loads(text)
    head = loaded["layers"][3]
    assert head["operands"][2]["amax_max"] is None  # an infinite amax: null
    expected = copy.deepcopy(data)
    for op in expected["layers"][3]["operands"][2:]:
        op["amax_max"] = None
    assert loaded == expected


def test_names_from_the_run_are_escaped(data):
    data["layers"][0]["name"] = "a|<b>`c`"
    data["ready"][0] = "a|<b>`c`"
    assert "<b>" not in render_fp8(data, "html")
    md = render_fp8(data, "md")
    assert "| `` a\\|<b>`c` `` | Conv2d\\* | ready |" in md  # a code span, its | escaped for the table


def test_nothing_to_keep_and_no_history(data):
    for layer in data["layers"]:
        layer["verdict"], layer["reasons"] = "unknown", []
    data.update(keep=[], ready=[], unknown=[layer["name"] for layer in data["layers"]], module_filter_fn=None,
                te_debug_config=None,
                shortest_history=None, limits=["per_block_formats", "no_sampled_steps"])
    out = _flat(render_fp8(data, "text"))
    assert "`convert_to_float8_training(model)`" in out and "Nothing to keep out" in out
    assert "No amax history to suggest" in out and "no flushed share is known" in out
    assert "Why keep" not in out


def test_an_unknown_limit_code_is_shown_as_it_is(data):
    data["limits"].append("some_new_limit")
    assert "- some\\_new\\_limit" in render_fp8(data, "md")


def test_an_unknown_format_is_refused(data):
    with pytest.raises(ValueError, match="fp8 has no 'csv' output"):
        render_fp8(data, "csv")


# -- the command and ampdoctor.fp8() over a stand-in analysis ---------------------------------------

@pytest.fixture
def stand_in(monkeypatch, data):
    """``ampdoctor.analysis.fp8`` replaced by one whose ``fp8_data`` returns the example and
    remembers its call; ``fail`` makes it raise the analysis's error for a run without rows."""
    calls = []
    module = types.ModuleType("ampdoctor.analysis.fp8")

    def fp8_data(run, *, flush_limit=0.01):
        calls.append({"run": run, "flush_limit": flush_limit})
        if getattr(module, "fail", False):
            raise RunError(f"{run.path}: no FP8 operand statistics: the run was recorded at "
                           f"level='params'; record with GradScaler(..., level='full', model=model)")
        return copy.deepcopy(data)

    module.fp8_data = fp8_data
    module.calls = calls
    monkeypatch.setitem(sys.modules, "ampdoctor.analysis.fp8", module)
    return module


@pytest.fixture(scope="module")
def params_run(tmp_path_factory):
    """A tiny run without GEMM operand rows (level='params')."""
    return _record(tmp_path_factory.mktemp("params") / "run.parquet", level="params")


def test_cli_formats_and_options(stand_in, params_run, tmp_path):
    cli = CliRunner()
    result = cli.invoke(main, ["fp8", str(params_run)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ampdoctor fp8 ") and SNIPPET in result.output
    assert stand_in.calls[-1]["flush_limit"] == 0.01
    assert isinstance(stand_in.calls[-1]["run"], ampdoctor.Run)  # the command reads the run once
    result = cli.invoke(main, ["fp8", str(params_run), "--format", "json", "--flush-limit", "0.05"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["keep"] == ["head"] and stand_in.calls[-1]["flush_limit"] == 0.05
    out = tmp_path / "fp8.html"
    result = cli.invoke(main, ["fp8", str(params_run), "--format", "html", "-o", str(out)])
    assert result.exit_code == 0 and out.read_text().startswith("<!DOCTYPE html>")
    md = cli.invoke(main, ["fp8", str(params_run), "--format", "md"])
    assert md.exit_code == 0 and md.output.startswith("# ampdoctor fp8")


def test_cli_writes_the_transformer_engine_config(stand_in, params_run, tmp_path):
    """``--te-config FILE``: the debug API's YAML beside the output; nothing to keep, no file."""
    yaml = pytest.importorskip("yaml")
    path = tmp_path / "keep.yaml"
    result = CliRunner().invoke(main, ["fp8", str(params_run), "--format", "json", "--te-config", str(path)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["te_debug_config"] == path.read_text()
    assert f"Wrote {path}" in result.stderr
    section = yaml.safe_load(path.read_text())["ampdoctor_keep_out_of_fp8"]
    assert section["transformer_engine"] == {"DisableFP8Layer": {"enabled": True}} and section["enabled"] is True
    stand_in.fp8_data = lambda run, *, flush_limit=0.01: {**example_fp8_data(), "keep": [], "te_debug_config": None}
    other = tmp_path / "none.yaml"
    result = CliRunner().invoke(main, ["fp8", str(params_run), "--format", "json", "--te-config", str(other)])
    assert result.exit_code == 0 and not other.exists() and "Nothing to keep out of FP8" in result.stderr
    stand_in.fp8_data = lambda run, *, flush_limit=0.01: example_fp8_data()
    result = CliRunner().invoke(main, ["fp8", str(params_run), "--te-config", str(tmp_path / "no" / "dir.yaml")])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "cannot write" in result.output


@pytest.mark.parametrize("bad", ["0", "1", "-0.1", "1.5", "x"])
def test_cli_flush_limit_must_be_between_0_and_1(stand_in, params_run, bad):
    result = CliRunner().invoke(main, ["fp8", str(params_run), "--flush-limit", bad])
    assert result.exit_code == 2 and "--flush-limit" in result.output and "Traceback" not in result.output
    assert not stand_in.calls


def test_cli_error_of_the_analysis_is_one_line(stand_in, params_run):
    stand_in.fail = True
    result = CliRunner().invoke(main, ["fp8", str(params_run)])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "no FP8 operand statistics" in result.output
    assert "Traceback" not in result.output


def test_cli_bad_path_is_one_line(stand_in, tmp_path):
    result = CliRunner().invoke(main, ["fp8", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "no such file" in result.output


def test_library_function_returns_the_contract_that_renders_itself(stand_in, params_run, data):
    result = ampdoctor.fp8(params_run, flush_limit=0.02)
    assert "fp8" in ampdoctor.__all__ and "fp8" in dir(ampdoctor)
    assert stand_in.calls[-1]["flush_limit"] == 0.02
    assert result["keep"] == ["head"] and result["layers"][3]["operands"][2]["amax_max"] is None
    assert result.to_dict() == json.loads(render_fp8(data, "json"))
    assert result.html().startswith("<!DOCTYPE html>") and SNIPPET in _flat(result.text())
    assert "<iframe" in result._repr_html_()


# -- on a recorded run (needs the recorder's GEMM rows and the analysis) ------------------------------

RECORDER_READY = hasattr(schema, "GEMM_KINDS")
ANALYSIS_READY = importlib.util.find_spec("ampdoctor.analysis.fp8") is not None
needs_gemm_rows = pytest.mark.skipif(
    not (RECORDER_READY and ANALYSIS_READY),
    reason="; ".join(why for why, missing in (
        ("the recorder writes no FP8 operand rows yet (schema.GEMM_KINDS missing)", not RECORDER_READY),
        ("the analysis ampdoctor/analysis/fp8.py (fp8_data) does not exist yet", not ANALYSIS_READY)) if missing))


def _record(path, steps=4, **options):
    """A few bf16 autocast steps of a tiny nn.Sequential of Linear layers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ampdoctor.GradScaler("cpu", path=path, model=model, **options)
    try:
        for _ in range(steps):
            x, y = torch.randn(32, 8), torch.randn(32, 4)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    finally:
        scaler.close()
    return path


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return _record(tmp_path_factory.mktemp("full") / "run.parquet", level="full", module_every=2)


@needs_gemm_rows
def test_cli_on_a_recorded_run(full_run):
    cli = CliRunner()
    result = cli.invoke(main, ["fp8", str(full_run), "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    check_contract(data, FP8_CONTRACT)
    assert [layer["name"] for layer in data["layers"]] == ["0", "2", "4"]
    assert data["sampled_steps"] == [0, 2] and data["amp_dtype"] == "bfloat16"
    assert sorted(data["ready"] + data["keep"] + data["unknown"]) == ["0", "2", "4"]
    for fmt in ("text", "md", "html"):
        result = cli.invoke(main, ["fp8", str(full_run), "--format", fmt])
        assert result.exit_code == 0, result.output
        assert "convert_to_float8_training(model" in _flat(result.output).replace("&#x27;", "'")
    assert ampdoctor.fp8(full_run).to_dict() == data


@needs_gemm_rows
def test_cli_on_a_run_without_gemm_rows_is_one_line_exit_2(params_run):
    result = CliRunner().invoke(main, ["fp8", str(params_run)])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    assert "no FP8 operand statistics" in result.output and "level='params'" in result.output
    assert "level='full'" in result.output
