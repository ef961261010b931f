"""How the report reads, on real CPU fp16 runs: the HTML page leads with its answer (measured in
headless Chromium at 1400×900), and its charts stay readable with hundreds of layers (the worst
underflowing layers only, round step ticks, the "low" panel at the sampled steps, buckets flushed to
zero in their own colour); the postmortem's chart on separate axes."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from torch import nn

from ampdoctor.read.run import read_run
from ampdoctor import render
from ampdoctor.analysis.report import report_data
from ampdoctor.render import charts
from models import train_recorded
from report_scenarios import scenarios  # noqa: F401 - the fixture

matplotlib = pytest.importorskip("matplotlib")

LAYERS, TINY = 100, 40  # Linear layers side by side; the first TINY get gradients fp16 cannot hold


class ManyLayers(nn.Module):
    """``LAYERS`` small Linear layers side by side, in an ``nn.ModuleList`` (names ``layers.0`` ...):
    the outputs of the first ``TINY`` are multiplied by 1e-14, so their gradients are 0 in fp16
    (every element flushed), the others train normally."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 4) for _ in range(LAYERS))
        self.gains = [1e-14 if i < TINY else 1.0 for i in range(LAYERS)]

    def forward(self, x):
        return sum(g * layer(x) for g, layer in zip(self.gains, self.layers)) / LAYERS


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """The report data of a 12-step run of :class:`ManyLayers` (200 parameter gradients)."""
    path = tmp_path_factory.mktemp("many") / "many.parquet"
    train_recorded(path, steps=12, model_factory=ManyLayers)
    return report_data(read_run(path))


# -- the answer first -------------------------------------------------------------------------------

PROBE = """<script>
window.addEventListener("load", () => {
  const out = {viewport: [window.innerWidth, window.innerHeight]};
  for (const [key, selector] of Object.entries(%s)) {
    const el = document.querySelector(selector);
    if (el) { const r = el.getBoundingClientRect(); out[key] = [r.top, r.bottom]; }
  }
  const pre = document.createElement("pre");
  pre.id = "measured";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""
# What must be in the first screen: the verdict, the GradScaler(...) line, and the table of skipped
# steps and underflow (current vs predicted).
ANSWER = {"verdict": "#recommendation .verdict", "code": "#recommendation pre.scaler-code",
          "outcome": "#recommendation table", "layers": "#layers"}


def measure(page: str, tmp_path, selectors: dict[str, str]) -> dict:
    """Where each selector's element lies on the page's first screen in headless Chromium at
    1400×900: a copy of the page with a script that writes the elements' positions into the DOM,
    read back with --dump-dom."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", PROBE % json.dumps(selectors) + "</body>"), encoding="utf-8")
    result = subprocess.run([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                             "--window-size=1400,900", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
                             probe.as_uri()], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr[-2000:]
    found = re.search(r'<pre id="measured">(.*?)</pre>', result.stdout)
    assert found, result.stdout[-2000:]
    return json.loads(found.group(1).replace("&quot;", '"'))


@pytest.mark.parametrize("name", ["periodic_overflow", "underflow"])
def test_the_recommendation_is_in_the_first_screen(scenarios, name, tmp_path):
    page = render.report(scenarios[name][2], "html")
    where = measure(page, tmp_path, ANSWER)
    width, height = where["viewport"]
    assert width == 1400 and 700 < height <= 900, where
    for key in ("verdict", "code", "outcome"):
        top, bottom = where[key]
        assert 0 < top < bottom <= height, (key, where)
    assert where["layers"][0] > where["outcome"][1]  # the evidence comes after the answer


# -- the underflow chart --------------------------------------------------------------------------

def test_the_underflow_chart_shows_only_the_layers_that_underflowed(many):
    layers = many["layers"]
    assert len(layers) == 2 * LAYERS
    fig, reason, note = charts.underflow_figure(layers)
    assert fig is not None and reason == ""
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    underflowed = [layer for layer in layers
                   if (layer["underflow_rate"] or 0) > 0 or (layer["underflow_rate_max"] or 0) > 0]
    quiet = len(layers) - len(underflowed)
    # The TINY layers' weights and biases are 0 everywhere: each underflowed, with no magnitude to
    # estimate from (rate unknown, at most 100%); they come first, and fill the chart's rows.
    assert len(underflowed) >= 2 * TINY > charts.BAR_ROWS and quiet >= LAYERS
    assert len(labels) == charts.BAR_ROWS
    tiny = {f"layers.{i}.{p}" for i in range(TINY) for p in ("weight", "bias")}
    assert all(label.split(" ")[0].removeprefix("layers.") in {n.removeprefix("layers.") for n in tiny}
               for label in labels), labels
    assert f"The {charts.BAR_ROWS} highest of the {len(underflowed)} layers that underflowed." in note
    assert f"And {quiet} more with no underflow." in note
    page = render.report(many, "html")
    assert f"And {quiet} more with no underflow." in page


def test_no_underflow_chart_when_nothing_underflowed(scenarios):
    layers = scenarios["periodic_overflow"][2]["layers"]
    fig, reason, _ = charts.underflow_figure(
        [dict(layer, underflow_rate=0.0, underflow_rate_max=0.0) for layer in layers])
    assert fig is None and "every layer's underflow rate is 0" in reason


# -- the heatmap ----------------------------------------------------------------------------------

def _xticks(ax) -> list[str]:
    return [t.get_text() for t in ax.get_xticklabels()]


def test_heatmap_ticks_at_round_steps_and_the_low_panel_at_the_sampled_steps(scenarios):
    data = scenarios["underflow"][2]  # 150 steps, full statistics every 50th step (the default)
    hm = data["charts"]["heatmap"]
    assert hm["steps"] == list(range(150))
    fig, note = charts.heatmap_figure(data["charts"])
    high, low = fig.axes[0], fig.axes[1]
    ticks = [int(t) for t in _xticks(high)]
    assert ticks[0] == 0 and len(ticks) >= 4 and all(t % 25 == 0 for t in ticks), ticks
    # The low panel draws only the step buckets with full statistics, each labelled by its step.
    sampled = [s for s, column in zip(hm["steps"], zip(*hm["low"])) if any(v is not None for v in column)]
    assert 2 <= len(sampled) <= 5 and all(s % 50 == 0 for s in sampled), sampled
    image = low.get_images()[0].get_array()
    assert image.shape == (len(hm["names"]), len(sampled))
    assert _xticks(low) == [str(s) for s in sampled]
    assert f"only the {len(sampled)} step bucket(s) with full statistics" in note
    assert "with full statistics" in low.get_title()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [text for _, text in charts.HEATMAP_LEGEND]
    assert "flushed to zero (every element 0)" in legend and "not recorded" in legend


def test_every_step_sampled_draws_the_low_panel_on_the_step_axis(tmp_path):
    path = tmp_path / "dense.parquet"
    train_recorded(path, steps=30, every=1, init_scale=2.0**8)
    fig, note = charts.heatmap_figure(report_data(read_run(path))["charts"])
    assert _xticks(fig.axes[0]) == _xticks(fig.axes[1]) and "only the" not in note
    assert all(int(t) % 5 == 0 for t in _xticks(fig.axes[1]))


def _flushed_cells(ax) -> int:
    """Cells drawn in the flushed-to-zero colour: the overlay image over the panel's values."""
    images = ax.get_images()
    return 0 if len(images) < 2 else int(np.isfinite(images[1].get_array().filled(np.nan)).sum())


def test_buckets_flushed_to_zero_get_their_own_colour(many):
    """A bucket whose gradients were all zero is -inf in the chart series; it is drawn over in
    :data:`charts.FLUSHED`, never as "not recorded"."""
    series = dict(many["charts"])
    hm = dict(series["heatmap"])
    # Each TINY layer's gradient is 0 at every step: mark its cells as the scan marks a bucket of
    # all-zero rows (see test_the_scan_marks_fully_underflowed_buckets).
    tiny = [i for i, name in enumerate(hm["names"]) if int(name.split(".")[1]) < TINY]
    assert tiny
    hm["high"] = [[-math.inf] * len(row) if i in tiny else row for i, row in enumerate(hm["high"])]
    series["heatmap"] = hm
    fig, _ = charts.heatmap_figure(series)
    assert _flushed_cells(fig.axes[0]) == len(tiny) * len(hm["steps"])
    values = fig.axes[0].get_images()[0].get_array()
    assert np.ma.getmaskarray(values)[tiny].all() or np.isnan(values.filled(np.nan)[tiny]).all()
    assert matplotlib.colors.to_hex(fig.axes[0].get_images()[1].get_cmap()(0.0)) == charts.FLUSHED
    assert all(t.get_text().endswith(" (Linear)") for t in fig.axes[0].get_yticklabels())  # layers.3.weight


def test_the_scan_marks_fully_underflowed_buckets(many):
    hm = many["charts"]["heatmap"]
    tiny = [i for i, name in enumerate(hm["names"]) if int(name.split(".")[1]) < TINY]
    assert tiny and all(v == -math.inf for i in tiny for v in hm["high"][i])
    others = [i for i in range(len(hm["names"])) if i not in tiny]
    assert all(v is not None and math.isfinite(v) for i in others for v in hm["high"][i])
    fig, _ = charts.heatmap_figure(many["charts"])
    assert _flushed_cells(fig.axes[0]) == len(tiny) * len(hm["steps"])


def test_indexed_layers_show_their_type_in_the_charts(many):
    fig, _, _ = charts.underflow_figure(many["layers"])
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert all(label.endswith(" (Linear)") for label in labels), labels
    assert many["charts"]["heatmap"]["types"] == ["Linear"] * len(many["charts"]["heatmap"]["names"])


# -- the postmortem's chart -----------------------------------------------------------------------

def test_the_postmortem_chart_puts_each_series_on_its_own_axis(tmp_path):
    from ampdoctor.analysis.postmortem import postmortem_data
    from models import MLP, train_with_faults

    torch.manual_seed(0)
    path = tmp_path / "nan.parquet"
    train_with_faults(path, MLP(), steps=20, corrupt_batch=lambda i, x, y: (x * float("nan"), y) if i == 15
                      else (x, y))
    pm = render.contract(postmortem_data(read_run(path)))
    assert pm["status"] == "nonfinite" and pm["first_nonfinite_step"] == 15
    fig = charts.timeline_figure(pm["timeline"])
    axes = fig.axes
    assert [ax.get_ylabel() for ax in axes] == ["loss", "gradient norm", "loss scale"]
    assert all(ax.get_shared_x_axes().joined(axes[0], ax) for ax in axes)
    assert axes[2].get_yscale() == "log" and axes[2].yaxis.get_transform().base == 2
    for ax, key in zip(axes[:2], ("loss", "grad_norm")):
        finite = [r[key] for r in pm["timeline"] if isinstance(r[key], float)]
        drawn = list(ax.get_lines()[0].get_ydata())
        assert drawn == finite  # on its own scale: the values themselves
    # The event step (non-finite loss) is marked on every axis.
    assert all(any(list(line.get_xdata()) == [15, 15] for line in ax.get_lines()) for ax in axes)
    assert "each on its own axis" in render.postmortem(postmortem_data(read_run(path)), "html")


def test_the_postmortem_page_leads_with_what_to_change(tmp_path):
    """The postmortem's answer (verdict and what to change) is on the first screen at 1400×900,
    above the timeline and its chart."""
    from ampdoctor.analysis.postmortem import postmortem_data
    from models import MLP, train_with_faults

    torch.manual_seed(0)
    path = tmp_path / "nan.parquet"
    train_with_faults(path, MLP(), steps=20, corrupt_batch=lambda i, x, y: (x * float("nan"), y) if i == 15
                      else (x, y))
    data = postmortem_data(read_run(path))
    assert render.contract(data)["advice"]
    where = measure(render.postmortem(data, "html"), tmp_path,
                    {"verdict": "#verdict", "advice": "#advice li", "timeline": "#timeline"})
    height = where["viewport"][1]
    assert 0 < where["verdict"][0] < where["advice"][0] < where["advice"][1] <= height, where
    assert where["timeline"][0] > where["advice"][1], where

