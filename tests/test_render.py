"""The Markdown and HTML renderers, on report dicts built by hand to the report contract: every
section renders, names from the run are escaped, the HTML is self-contained and loads cleanly."""

from __future__ import annotations

import copy
import math
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ampdoctor import render
from ampdoctor.render import sections
from ampdoctor.render.formatting import binades, number, number_or_word, percent, scale_str, setting, shorten
from ampdoctor.render.html import report_html
from ampdoctor.render.markdown import layers_markdown, report_markdown, simulate_markdown
from ampdoctor.render.text import layers_table

XSS = "<img src=x onerror=alert(1)>"
PIPE = "a|b"
TICK = "odd`name"


def _layer(name: str, kind: str, underflow: float, headroom: float | None, amax: float | None) -> dict:
    return {"name": name, "kind": kind, "underflow_rate": underflow, "zero_rate": underflow * 1.5,
            "subnormal_rate": underflow / 3, "headroom_log2": headroom, "amax": amax,
            "amin": None if amax is None else amax * 1e-6, "observations": 40}


def make_report() -> dict:
    steps = list(range(40))
    scale, s = [], 2.0**16
    skipped = [i in (3, 4, 21) for i in steps]
    for i in steps:
        scale.append(s)
        s = s / 2 if skipped[i] else s * 2 if i == 30 else s
    names = ["fc1.weight", XSS, PIPE, "head.bias"]
    buckets = [0, 10, 20, 30]
    high = [[10.0, 11.0, 17.0, 12.0], [-3.0, None, -2.0, -1.5], [4.0, 4.5, 5.0, float("-inf")],
            [1.0, 2.0, 3.0, 4.0]]
    low = [[-12.0, -11.0, -10.0, -9.0], [-30.0, None, -26.0, -20.0], [-16.0, -15.0, -14.0, -13.0],
           [-8.0, -7.0, -6.0, -5.0]]
    return {
        "run": {"path": "runs/demo.parquet", "steps": 40, "ranks": 1, "amp_dtype": "float16",
                "device": "cuda",
                "scaler": {"class": "GradScaler", "init_scale": 65536.0, "growth_factor": 2.0,
                           "backoff_factor": 0.5, "growth_interval": 2000},
                "level": "full", "ended_cleanly": True},
        "scale": {"initial": 65536.0, "final": 32768.0, "min": 8192.0, "max": 65536.0, "skipped_steps": 3,
                  "skipped_fraction": 0.075, "settle_step": 22},
        "layers": [_layer(XSS, "param_grad", 0.123, 13.5, 2.5e-3),
                   _layer(PIPE, "grad_output", 0.0012, 9.0, 0.8),
                   _layer(TICK, "param_grad", 1.2e-4, None, None),
                   _layer("fc1.weight", "param_grad", 0.0, -1.2, 3.1)],
        "overflow_origins": [{"name": "fc1.weight", "kind": "param_grad", "rank": 0, "count": 2,
                              "first_step": 3, "last_step": 4},
                             {"name": PIPE, "kind": "grad_output", "rank": 0, "count": 1, "first_step": 21,
                              "last_step": 21}],
        "recommendation": {"init_scale": 4096.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                           "growth_interval": 500,
                           "target_dtype": "float16", "verdict": "change",
                           "code": 'torch.amp.GradScaler("cuda", init_scale=2**12, growth_interval=500)',
                           "reasons": [f"{XSS} overflows at 2**16", "growth_interval 2000 never grows back"],
                           "advice": ["keep `fc1` in float32 | or clip"],
                           "current": {"skipped_steps": 3, "underflow_rate": 0.012},
                           "predicted": {"skipped_steps": 0, "underflow_rate": 0.0031}},
        "warnings": ["rank 1 has no rows", "# not a heading"],
        "missing": {},
        "charts": {"steps": steps, "scale": scale, "skipped": skipped,
                   "format": {"name": "float16", "max_log2": 15.9991, "underflow_log2": -25.0,
                              "subnormal_log2": -24.0, "normal_log2": -14.0},
                   "heatmap": {"names": names, "steps": buckets, "high": high, "low": low}},
    }


def make_sparse_report() -> dict:
    """A ``level='steps'`` run that never skipped: no layers, no origins, no recommendation, no heatmap."""
    r = make_report()
    r["run"]["level"] = "steps"
    r["layers"], r["overflow_origins"], r["recommendation"] = [], [], None
    r["missing"] = {"layers": "not enough data: no per-parameter rows; record with level='params'",
                    "overflow_origins": "not enough data: no module taps; record with level='full'",
                    "recommendation": "not enough data: <no gradient statistics>",
                    "postmortem": "only for runs that went non-finite"}
    r["charts"] = {"steps": [], "scale": [], "skipped": [], "format": r["charts"]["format"], "heatmap": None}
    return r


def make_sim() -> dict:
    cfg = {"init_scale": 4096.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 500,
           "hysteresis": 1, "min_scale": None, "max_scale": 2.0**24}
    return {"config": cfg, "target_dtype": "float16", "steps": 40, "skipped_steps": 0,
            "skipped_fraction": 0.0, "underflow_rate": 0.0031, "uncertain_steps": 2,
            "scale": {"final": 8192.0, "min": 4096.0, "max": 8192.0},
            "actual": {"config": dict(cfg, init_scale=65536.0, growth_interval=2000), "skipped_steps": 3,
                       "skipped_fraction": 0.075, "underflow_rate": 0.012,
                       "scale": {"final": 32768.0, "min": 8192.0, "max": 65536.0}},
            "threshold": {"overflow_log2": 15.9991, "source": "float16 max"},
            "layers": [{"name": PIPE, "kind": "param_grad", "underflow_rate": 0.5},
                       {"name": XSS, "kind": "param_grad", "underflow_rate": 0.0}],
            "notes": ["replayed from amax; 2 steps within 0.01 binade of the threshold"]}


def tables(md: str) -> list[list[str]]:
    """The Markdown tables of ``md``, each as its lines."""
    out, cur = [], []
    for line in md.splitlines():
        if line.startswith("|"):
            cur.append(line)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def cells(line: str) -> list[str]:
    """A GFM table row split into cells the way GitHub does: on pipes not escaped by a backslash."""
    return re.split(r"(?<!\\)\|", line.strip())[1:-1]


def assert_tables_consistent(md: str) -> None:
    found = tables(md)
    assert found
    for table in found:
        widths = {len(cells(line)) for line in table}
        assert len(widths) == 1, table
        assert re.fullmatch(r"\|( -*-:? \|)+", table[1]), table[1]


def html_text(page: str) -> str:
    """The page with its inline SVGs removed, for checks on the text sections."""
    return re.sub(r"<svg.*?</svg>", "", page, flags=re.S)


# --- formatting ----------------------------------------------------------------------------------------

def test_formatting_helpers():
    assert [percent(x) for x in (0, 0.123, 1.2e-4, 1.0, None, math.nan, 1e-9, 0.99999)] == \
        ["0", "12.3%", "0.012%", "100%", "—", "—", "<0.001%", ">99.9%"]
    assert [scale_str(x) for x in (65536.0, 4096, 1.0, 0.25, 3.0, None)] == \
        ["2**16", "2**12", "2**0", "2**-2", "3", "—"]
    assert (number(2.5e-3), number(None), binades(-1.2), binades(None)) == ("0.0025", "—", "-1.2", "—")
    assert setting("init_scale", 4096.0) == "2**12"
    assert setting("growth_interval", 2000.0) == "2000" and setting("hysteresis", None) == "—"
    # reports built from pandas may carry numpy scalars
    assert (percent(np.float32("nan")), percent(np.float32(0.5)), scale_str(np.float64(1024.0))) == \
        ("—", "50%", "2**10")
    short = shorten("encoder.layers.11.self_attn.out_proj.weight", 30)
    assert len(short) == 30 and short.endswith("out_proj.weight") and "…" in short
    assert shorten("encoder.layers.11.self_attn.out_proj.weight", 30, keep_head=False) == \
        "….11.self_attn.out_proj.weight"
    assert [number_or_word(x) for x in (2.5e-3, "non-finite", None)] == ["0.0025", "non-finite", "—"]


def test_text_columns_cut_long_names_from_the_left():
    layer = _layer("encoder.layers.11.self_attn.out_proj.weight", "param_grad", 0.1, 2.0, 1.0)
    row = layers_table([layer])[1]
    assert row.startswith("…s.11.self_attn.out_proj.weight ")  # 31 characters, the column's width


def test_markdown_and_html_lay_out_the_same_sections_in_order():
    report = make_sparse_report()
    md, page = report_markdown(report), html_text(report_html(report))
    # The answer first (the recommendation, then its advice), then the evidence.
    expected = [s.title for s in (sections.RECOMMENDATION, sections.ADVICE, sections.SCALE, sections.LAYERS,
                                  sections.ORIGINS, sections.RUN, sections.WARNINGS, sections.NOT_AVAILABLE)]
    assert re.findall(r"^## (.+)$", md, re.M) == expected
    assert re.findall(r"<h2>(.+?)</h2>", page) == expected
    assert re.findall(r'<section id="([^"]+)">', page) == ["recommendation", "advice", "scale", "layers",
                                                           "overflow-origins", "run", "warnings", "not-available"]


# --- Markdown ------------------------------------------------------------------------------------------

def test_report_markdown_sections_and_tables():
    md = report_markdown(make_report())
    for heading in ("# ampdoctor report", "## Run details", "## Loss scale", "## Layers", "## Overflow origins",
                    "## Recommendation", "### Reasons", "## Advice", "## Warnings"):
        assert re.search(rf"^{re.escape(heading)}$", md, re.M), heading
    assert_tables_consistent(md)
    assert "2\\*\\*16 at the start, 2\\*\\*15 at the end" in md  # "**" escaped: no bold
    assert "| 12.3% |" in md and "| 0.012% |" in md and "| 0 |" in md
    assert '```python\ntorch.amp.GradScaler("cuda", init_scale=2**12, growth_interval=500)\n```' in md
    assert "| `init_scale` | 2\\*\\*16 | 2\\*\\*12 |" in md
    assert "\\# not a heading" in md  # a warning cannot become a heading


def test_markdown_escapes_names():
    md = report_markdown(make_report())
    # raw only inside code spans, backslash-escaped elsewhere
    assert re.findall(r"(?<![\\`])<img", md) == []
    assert "| `<img src=x onerror=alert(1)>` |" in md
    assert "\\<img src=x onerror=alert(1)\\> overflows" in md  # in prose: backslash-escaped
    assert "`a\\|b`" in md and "`a|b`" not in md
    assert "``odd`name``" in md  # a longer fence around a name with a backtick
    assert "keep `fc1` in float32 \\| or clip" in md  # advice's code marks are code spans


def test_report_markdown_missing_sections():
    md = report_markdown(make_sparse_report())
    assert "> not enough data: no per-parameter rows; record with level='params'" in md
    assert "> not enough data: no module taps; record with level='full'" in md
    assert "> not enough data: \\<no gradient statistics\\>" in md
    assert "## Not available" in md and "only for runs that went non-finite" in md
    no_scale = make_sparse_report()
    no_scale["scale"], no_scale["missing"]["scale"] = None, "not enough data: no step rows"
    assert "> not enough data: no step rows" in report_markdown(no_scale)


def test_report_markdown_limits_layers():
    r = make_report()
    r["layers"] = [_layer(f"l{i}.weight", "param_grad", 0.5 - i / 1000, 3.0, 1.0) for i in range(60)]
    md = report_markdown(r)
    assert "The 50 worst of 60 layers" in md and "`l49.weight`" in md and "`l50.weight`" not in md


def test_simulate_markdown():
    md = simulate_markdown(make_sim())
    assert_tables_consistent(md)
    assert "| setting | simulated | recorded run |" in md
    assert "| `init_scale` | 2\\*\\*12 | 2\\*\\*16 |" in md and "| `min_scale` | — | — |" in md
    assert "| skipped steps | 0 (0) | 3 (7.5%) |" in md
    assert "2 step(s) were too close" in md and "above 2\\*\\*15.9991 (float16 max)." in md
    assert "`a\\|b`" in md and "## Notes" in md
    alone = make_sim()
    alone["actual"], alone["layers"] = None, []
    md = simulate_markdown(alone)
    assert_tables_consistent(md)
    assert "recorded run" not in md and "No per-layer statistics." in md


def test_layers_markdown():
    r = make_report()
    md = layers_markdown({"sort": "headroom", "layers": r["layers"], "missing": None})
    assert_tables_consistent(md)
    assert "Sorted by headroom." in md and "`a\\|b`" in md
    md = layers_markdown({"sort": "underflow", "layers": [],
                          "missing": "not enough data: record with level='params'"})
    assert "> not enough data: record with level='params'" in md and "|" not in md


# --- HTML ----------------------------------------------------------------------------------------------

def test_report_html_sections():
    page = report_html(make_report())
    assert page.startswith("<!DOCTYPE html>")
    assert "<title>ampdoctor report: runs/demo.parquet</title>" in page
    for sid in ("run", "scale", "layers", "overflow-origins", "recommendation", "warnings"):
        assert f'<section id="{sid}">' in page
    text = html_text(page)
    assert '<pre class="scaler-code"><code class="language-python">torch.amp.GradScaler("cuda", init_scale=2**12, ' \
           "growth_interval=500)</code></pre>" in text
    assert "Change the scaler settings." in text and "<h3>Reasons</h3>" in text
    assert '<section id="advice">\n<h2>Advice</h2>' in text
    assert "rank 1 has no rows" in text and "12.3%" in text and "2**15" in text


def test_report_html_escapes_everything():
    page = report_html(make_report())
    assert "<img" not in page.lower()
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "onerror=alert(1)>" not in page
    assert "<script" not in page.lower()
    hostile = make_report()
    hostile["recommendation"]["verdict"] = '"><img src=x>'  # the one data value inside an attribute
    assert '<p class="verdict &quot;&gt;&lt;img src=x&gt;">' in report_html(hostile)


def test_report_html_is_self_contained():
    page = report_html(make_report())
    refs = re.findall(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.I)
    assert refs == []
    urls = set(re.findall(r"https?://[^\s\"'<>]+", page))
    assert urls <= {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}, urls
    assert "@import" not in page and "url(http" not in page


def test_report_html_charts():
    pytest.importorskip("matplotlib")
    page = report_html(make_report())
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(svgs) == 4
    assert "<?xml" not in page and "<!DOCTYPE svg" not in page and "<metadata" not in page
    ids = re.findall(r'\bid="([^"]+)"', "".join(svgs))
    assert len(ids) == len(set(ids)), "two charts share an element id"
    # svg.fonttype 'none' keeps labels as <text>, which matplotlib escapes: the hostile name is
    # a label of the heatmap and of both bar charts, and only ever as text.
    for svg in svgs[1:]:
        assert ">&lt;img src=x onerror=alert(1)&gt;<" in svg
    assert "not enough data" not in page.lower()
    assert report_html(make_report()) == page  # deterministic: salted ids, no dates


def test_report_html_missing_sections_and_charts():
    pytest.importorskip("matplotlib")
    page = report_html(make_sparse_report())
    text = html_text(page)
    assert "<svg" not in page
    for chart in ("loss scale chart", "gradient magnitude heatmap", "underflow rate chart", "headroom chart"):
        assert f"Not enough data for the {chart}." in text
    assert "not enough data: no per-parameter rows; record with level='params'" in text
    assert "not enough data: &lt;no gradient statistics&gt;" in text
    assert '<section id="not-available">' in text and "only for runs that went non-finite" in text
    no_charts = make_report()
    del no_charts["charts"]
    assert report_html(no_charts).count("Not enough data for the") == 2  # the bar charts use "layers"


def test_report_html_degenerate_inputs():
    pytest.importorskip("matplotlib")
    r = make_report()
    for layer in r["layers"]:
        layer["underflow_rate"] = 0.0
    r["charts"]["heatmap"]["high"] = [[None] * 4] * 4
    r["charts"]["heatmap"]["low"] = [[math.nan] * 4] * 4
    r["charts"]["format"]["name"] = "bfloat16"
    page = report_html(r)
    assert "every layer's underflow rate is 0" in page
    assert "Not enough data for the gradient magnitude heatmap." in page
    bf16 = make_report()
    bf16["charts"]["format"].update(max_log2=128.0, underflow_log2=-134.0, normal_log2=-126.0)
    bf16["charts"]["heatmap"]["names"].append("$x$")  # a shape mismatch: no heatmap, no crash
    assert "Not enough data for the gradient magnitude heatmap." in report_html(bf16)
    bf16["charts"]["heatmap"]["names"].pop()
    bf16["layers"][0]["name"] = "mathtext $\\frac{a}{b}$ name"
    assert report_html(bf16).count("<svg") == 4


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium")
def test_report_html_loads_in_chromium(tmp_path):
    path = tmp_path / "report.html"
    path.write_text(report_html(make_report()), encoding="utf-8")
    proc = subprocess.run(
        ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
         f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", path.as_uri()],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines()
               if "CONSOLE" in line or "Uncaught" in line or "console" in line.lower()]
    assert console == [], console
    assert "<title>ampdoctor report: runs/demo.parquet</title>" in proc.stdout
    assert "<img" not in proc.stdout.lower()


def test_report_html_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    page = report_html(make_report())
    assert "<svg" not in page and page.count("Charts need matplotlib") == 4
    assert '<section id="recommendation">' in page


def test_chart_labels_drop_common_prefix():
    pytest.importorskip("matplotlib")
    r = make_report()
    names = [f"model.encoder.layers.{i}.attn.weight" for i in range(3)]
    r["charts"]["heatmap"] = {"names": names, "steps": [0, 10], "high": [[1.0, 2.0]] * 3,
                              "low": [[-9.0, -8.0]] * 3}
    page = report_html(r)
    assert "Layer names omit their common prefix “model.encoder.layers.”." in page
    assert ">0.attn.weight<" in page


def test_report_dict_not_mutated():
    r = make_report()
    before = copy.deepcopy(r)
    report_markdown(r)
    report_html(r)
    assert repr(r) == repr(before)


def test_code_marked_in_advice_renders_as_code():
    """The analyses mark settings and calls with backticks: code spans in Markdown, <code> in
    HTML, never literal backticks; an unpaired backtick stays text."""
    report = make_report()
    report["recommendation"]["advice"] = ["keep `fc1_a` in float32 with `autocast(x, enabled=False)` or *not*",
                                          "a lone ` backtick"]
    md = render.report(report, "md")
    assert "- keep `fc1_a` in float32 with `autocast(x, enabled=False)` or \\*not\\*" in md
    assert "- a lone \\` backtick" in md
    page = render.report(report, "html")
    assert "keep <code>fc1_a</code> in float32 with <code>autocast(x, enabled=False)</code> or *not*" in page
    assert "a lone ` backtick" in page


def test_underflow_ranges_render_as_ranges():
    """Where the record cannot decide one underflow rate, every output shows the range."""
    report = make_report()
    report["recommendation"]["current"] = {"skipped_steps": 0, "underflow_rate": None,
                                           "underflow_rate_min": 0.0035, "underflow_rate_max": 0.095}
    assert "instead of 0.35%..9.5%" in render.report(report, "text")
    assert "| 0.35%..9.5% |" in render.report(report, "md")
    assert "0.35%..9.5%" in render.report(report, "html")
    sim = make_sim()
    sim.update(underflow_rate=None, underflow_rate_min=1e-5, underflow_rate_max=0.9)
    assert "0.001%..90%" in render.simulate(sim, "text") and "0.001%..90%" in render.simulate(sim, "md")


def test_an_origin_outside_the_taps_names_the_module_it_reached():
    report = make_report()
    report["overflow_origins"][0].update(name="(outside tapped modules)", after="decoder.ln_f")
    for fmt in ("text", "md", "html"):
        assert "(outside tapped modules, after decoder.ln_f)" in render.report(report, fmt), fmt
