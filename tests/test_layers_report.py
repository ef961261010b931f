"""The per-layer table: the report's ``layers`` and `ampdoctor layers` (sorting, `--top`), each
layer judged in the format its values lived in."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from ampdoctor.read.run import read_run
from ampdoctor.analysis.layers import layers_data
from ampdoctor.analysis.report import report_data
from ampdoctor.cli.commands import main
from ampdoctor.render import contract
from models import train_recorded
from report_scenarios import scenarios  # noqa: F401 - the fixture


def test_underflow_scenario_names_the_underflowing_layers_first(scenarios):
    layers = scenarios["underflow"][2]["layers"]
    top = [layer["name"] for layer in layers[:2]]
    assert set(top) == {"side.weight", "side.bias"}, top
    # Their gradients are 0 everywhere: no magnitude says how far below the cut-off they were, so
    # the heuristic's estimate of a sampled step is unknown; the measured step (step 0 by
    # default) settles it (every element underflowed, none is structure) and calibrates step 100:
    # its zeros, less no structure, underflowed too, a figure 100 steps from its measurement.
    assert layers[0]["underflow_rate"] == 1.0 and layers[0]["underflow_rate_max"] == 1.0
    assert layers[0]["underflow_measured"] == 0.5 and layers[0]["measure_distance"] == 100
    assert all(layer["underflow_rate"] <= layer["zero_rate"] + 1e-12 for layer in layers
               if layer["underflow_rate"] is not None)


def test_layers_command_sorts_and_limits(scenarios):
    path = scenarios["underflow"][0]
    by_headroom = layers_data(read_run(path), "headroom")["layers"]
    headroom = [layer["headroom_log2"] for layer in by_headroom if layer["headroom_log2"] is not None]
    assert headroom == sorted(headroom)
    by_amax = layers_data(read_run(path), "amax", top=3)["layers"]
    assert len(by_amax) == 3 and by_amax[0]["amax"] >= by_amax[1]["amax"] >= by_amax[2]["amax"]
    result = CliRunner().invoke(main, ["layers", str(path), "--sort", "underflow", "--top", "2", "--format", "json"])
    assert [layer["name"] for layer in json.loads(result.output)["layers"]] in (
        ["side.weight", "side.bias"], ["side.bias", "side.weight"])


def test_a_steps_level_run_has_no_layers_to_list(tmp_path):
    path = tmp_path / "steps.parquet"
    train_recorded(path, steps=5, level="steps", escalate_steps=0)
    data = layers_data(read_run(path))
    assert data["layers"] == [] and data["missing"].code == "no_layer_rows_to_list"
    assert "level='steps'" in contract(data)["missing"]


def test_large_fp32_activations_are_not_flagged_as_fp16_overflow(tmp_path):
    from models import QuietMLP

    class Loud(torch.nn.Module):
        def forward(self, x):
            return x.float() * 1e6  # fp32 under autocast: safe, however large

    class WithLoud(QuietMLP):
        def __init__(self):
            super().__init__()
            self.loud = Loud()

        def forward(self, x):
            return super().forward(x) + self.loud(x).mean() * 0

    path = tmp_path / "loud.parquet"
    train_recorded(path, steps=10, init_scale=2.0**10, level="full", model_factory=WithLoud)
    report = contract(report_data(read_run(path)))
    loud = [layer for layer in report["layers"] if layer["name"] == "loud" and layer["kind"] == "output"]
    assert loud and loud[0]["amax"] > 65504 and loud[0]["headroom_log2"] > 100  # judged in fp32
    assert not any("`loud`" in a for a in report["recommendation"]["advice"])


class Indexed(torch.nn.Module):
    """An ``nn.Sequential`` (children named ``mlp.0``, ``mlp.1``, ``mlp.2``) and a named head."""

    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.mlp(x))


def test_layers_named_by_an_index_show_their_module_type(tmp_path):
    path = tmp_path / "indexed.parquet"
    train_recorded(path, steps=6, level="full", model_factory=Indexed)
    report = contract(report_data(read_run(path)))
    types = {(layer["name"], layer["kind"]): layer["module_type"] for layer in report["layers"]}
    assert types[("mlp.0.weight", "param_grad")] == types[("mlp.2.bias", "param_grad")] == "Linear"
    assert types[("mlp.1", "output")] == types[("mlp.1", "grad_output")] == "Tanh"
    assert types[("mlp.2", "output")] == "Linear"
    # A name that says what it is keeps no type.
    assert types[("head.weight", "param_grad")] is None and types[("head", "output")] is None
    listed = layers_data(read_run(path), "headroom")["layers"]
    assert {(layer["name"], layer["kind"]): layer["module_type"] for layer in listed} == types
    runner = CliRunner()
    text = runner.invoke(main, ["report", str(path), "--top", "100"]).output
    assert "mlp.0.weight (Linear)" in text and "mlp.1 (Tanh)" in text and "head.weight (" not in text
    md = runner.invoke(main, ["layers", str(path), "--format", "md"]).output
    assert "| `mlp.2.bias (Linear)` | `param_grad` |" in md
    html = runner.invoke(main, ["report", str(path), "--format", "html"]).output
    assert "<code>mlp.2.bias</code> (Linear)" in html


def test_runs_without_module_types_show_the_names_as_they_are(tmp_path):
    """A run whose metadata has no ``model.module_types`` (older runs; a scaler made without
    ``model=``), or one that is not a JSON object: the names alone, as before."""
    import pyarrow.parquet as pq
    from types import SimpleNamespace

    from ampdoctor.analysis.layers import module_types
    from ampdoctor.run_file.schema import META_MODULE_TYPES

    path = tmp_path / "older.parquet"
    train_recorded(path, steps=4, model_factory=Indexed)
    files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
    for segment in files:  # as a run written before the key existed
        table = pq.read_table(segment)
        meta = {k: v for k, v in table.schema.metadata.items() if k.decode() != META_MODULE_TYPES}
        pq.write_table(table.replace_schema_metadata(meta), segment)
    layers = contract(report_data(read_run(path)))["layers"]
    assert {layer["name"] for layer in layers} >= {"mlp.0.weight", "mlp.2.bias"}
    assert all(layer["module_type"] is None for layer in layers)
    text = CliRunner().invoke(main, ["layers", str(path)]).output
    assert "mlp.0.weight " in text and "(Linear)" not in text
    for bad in ("not json", "[1, 2]", '{"mlp.0": 3}'):
        assert module_types(SimpleNamespace(metadata={"model.module_types": bad})) == {}


def test_every_format_marks_measured_rates(scenarios):
    """The underflow scenario's step 0 is measured and calibrates step 100 (its rates marked ``~``,
    part measured) in the terminal, Markdown and HTML reports, each with the legend; a run
    measured nowhere shows no mark."""
    from ampdoctor import render

    data = scenarios["underflow"][2]
    for fmt, mark in (("text", "100%~"), ("md", "100%\\~"), ("html", "100%~")):
        out = render.report(data, fmt)
        assert mark in out and "underflow: " in out and "measured on some steps" in out, fmt
    unmeasured = {**data, "layers": [{**layer, "underflow_measured": None} for layer in data["layers"]]}
    assert "measured on some steps" not in render.report(unmeasured, "text")
