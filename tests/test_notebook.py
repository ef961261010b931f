"""Notebooks: ``ampdoctor.report(path)``, ``ampdoctor.postmortem(path)`` and ``ampdoctor.compare(a, b)``
are their command's JSON contract as a dict that Jupyter shows as the command's HTML page."""

from __future__ import annotations

import copy
import html
import json
import pickle
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

import ampdoctor
from ampdoctor.cli.commands import main
from ampdoctor.render.formatting import VERDICTS

STEPS = 30


def cli(*args) -> str:
    result = CliRunner().invoke(main, [*map(str, args)])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The overflow demo, the same re-trained with its recommendation, and the nan demo."""
    root = tmp_path_factory.mktemp("notebook")
    paths = {name: root / f"{name}.parquet" for name in ("overflow", "fixed", "nan")}
    cli("demo", "--device", "cpu", "--steps", STEPS, "--scenario", "overflow", "--out", paths["overflow"])
    cli("demo", "--device", "cpu", "--steps", STEPS, "--scenario", "overflow", "--out", paths["fixed"],
        "--settings-from", paths["overflow"])
    cli("demo", "--device", "cpu", "--steps", STEPS, "--scenario", "nan", "--out", paths["nan"])
    return paths


def results(runs) -> dict:
    """command → (the object, the CLI arguments of the same command, its verdict in words)."""
    report = ampdoctor.report(runs["overflow"])
    postmortem = ampdoctor.postmortem(runs["nan"])
    comparison = ampdoctor.compare(runs["overflow"], runs["fixed"])
    return {"report": (report, [runs["overflow"]], VERDICTS[report["recommendation"]["verdict"]]),
            "postmortem": (postmortem, [runs["nan"]], postmortem["cause"]),
            "compare": (comparison, [runs["overflow"], runs["fixed"]], comparison["prediction"]["finding"])}


@pytest.mark.parametrize("command", ["report", "postmortem", "compare"])
def test_the_object_is_the_json_contract_and_shows_as_the_html_page(runs, command, tmp_path):
    obj, args, verdict = results(runs)[command]
    assert verdict and isinstance(obj, dict)
    assert obj.to_dict() == json.loads(cli(command, *args, "--format", "json"))
    assert json.loads(obj.json()) == obj.to_dict()
    page = tmp_path / "page.html"
    cli(command, *args, "--format", "html", "-o", page)
    assert obj.html() == page.read_text(encoding="utf-8")
    shown = obj._repr_html_()
    assert isinstance(shown, str) and shown.startswith("<iframe ")
    # The page itself, in a frame of its own (its stylesheet would restyle the notebook inline).
    srcdoc = re.fullmatch(r'<iframe srcdoc="([^"]*)".*</iframe>', shown, re.S).group(1)
    assert html.unescape(srcdoc) == obj.html()
    assert verdict in html.unescape(srcdoc) and html.escape(verdict, quote=True) in shown
    assert obj.text() == cli(command, *args).rstrip("\n")


def test_jupyter_uses_the_html(runs):
    formatters = pytest.importorskip("IPython.core.formatters")
    report = results(runs)["report"][0]
    assert formatters.HTMLFormatter()(report) == report._repr_html_()


def test_existing_code_keeps_working_on_the_dict(runs):
    report = ampdoctor.report(runs["overflow"])
    assert report["scale"]["skipped_steps"] > 0 and "recommendation" in report and len(report) >= 7
    assert ampdoctor.postmortem(runs["nan"])["status"] == "nonfinite"
    # Copies and pickles are the plain contract, without the renderers' data.
    for copied in (copy.copy(report), copy.deepcopy(report), pickle.loads(pickle.dumps(report))):
        assert type(copied) is dict and copied == dict(report)
    assert json.loads(json.dumps(report)) == report.to_dict()  # json.dumps takes it as a dict


def test_reading_imports_no_torch_and_drawing_imports_matplotlib_only_then(runs):
    code = ("import sys, ampdoctor\n"
            f"c = ampdoctor.compare({str(runs['overflow'])!r}, {str(runs['fixed'])!r})\n"
            f"r = ampdoctor.report({str(runs['overflow'])!r})\n"
            "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules\n"
            "assert '&lt;svg' in c._repr_html_() and 'matplotlib' in sys.modules and 'torch' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_simulate_and_layers_are_their_contracts_and_show_as_text(tmp_path):
    """``ampdoctor.simulate`` and ``ampdoctor.layers`` give what ``--format json`` prints; having
    no HTML page, they show in a notebook as their terminal text. A ``run_id`` with a ``Run`` (one
    run already) is refused instead of ignored."""
    import json

    from click.testing import CliRunner

    import ampdoctor
    from ampdoctor.cli.commands import main
    from test_run import record

    path = record(tmp_path / "run.parquet", steps=6, init_scale=2.0**24)
    sim = ampdoctor.simulate(path, init_scale=2.0**10)
    cli = json.loads(CliRunner().invoke(main, ["simulate", str(path), "--init-scale", "2**10",
                                               "--format", "json"]).output)
    assert sim.to_dict() == cli and sim["config"]["init_scale"] == 1024.0
    assert sim._repr_html_().startswith("<pre>") and "skipped" in sim._repr_html_()
    layers = ampdoctor.layers(path, sort="amax", top=3)
    cli = json.loads(CliRunner().invoke(main, ["layers", str(path), "--sort", "amax", "--top", "3",
                                               "--format", "json"]).output)
    assert layers.to_dict() == cli and len(layers["layers"]) == 3
    with pytest.raises(ValueError, match="run_id"):
        ampdoctor.report(ampdoctor.read_run(path), run_id="abc")
