"""The HTML report: one self-contained HTML5 file (inline CSS, charts as inline SVG, no scripts and
no external resources), so it can be attached to an issue or opened from a CI artifact offline.

Every string from the data goes through :func:`html.escape`; chart labels go through matplotlib's
SVG writer, which escapes text too. matplotlib is imported only when a report is rendered, so that
``import ampdoctor`` does not pay for it; without it the report says so where the charts would be."""

from __future__ import annotations

import html
import io
import math
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .formatting import (VERDICTS, binades, code_spans, number, origin_name, percent, scale_str, setting, shorten,
                         underflow)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LAYER_ROWS = 50
BAR_ROWS = 30
HEATMAP_ROWS = 80
SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
SECTIONS = ("scale", "layers", "overflow_origins", "recommendation")
# Beyond the format's range, the heatmap colours say what happens to the value; neither colour
# occurs in viridis, and "no data" is a neutral grey.
OVER, UNDER, BAD = "#e41a1c", "#ff00ff", "#dddddd"

CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d1d1f;margin:0;
background:#fafafa}
main{max-width:1120px;margin:0 auto;padding:1.5em 2em 4em;background:#fff}
h1{margin:.2em 0}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.8em}
code,pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:.9em}
pre{background:#f4f4f6;padding:.8em 1em;overflow-x:auto;border-radius:4px}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
th,td{border:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f0f0f3}tr:nth-child(even) td{background:#fafafc}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
td.name{word-break:break-all;max-width:32em}
dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1.2em}dt{font-weight:600}dd{margin:0}
figure{margin:1.2em 0}figure svg{max-width:100%;height:auto}figcaption{color:#555;font-size:.88em}
.missing,.nodata{background:#fff8e1;border-left:4px solid #f0b400;padding:.4em .8em}
.verdict{font-weight:600;padding:.4em .8em;border-radius:4px;display:inline-block}
.verdict.keep{background:#e6f4ea}.verdict.change{background:#e8f0fe}
.verdict.no_scale_works{background:#fce8e6}
.warnings li{color:#8a4b00}
"""


def _e(x: object) -> str:
    """Text content, escaped (``<``, ``>``, ``&``; quotes are harmless outside attributes and stay
    readable in the source)."""
    return html.escape(str(x), quote=False)


def _attr(x: object) -> str:
    """An attribute value, escaped quotes included."""
    return html.escape(str(x), quote=True)


def _finite(x: Any) -> bool:
    """A finite number, numpy scalars included (reports built from pandas may hold them)."""
    if x is None or isinstance(x, (bool, str)):
        return False
    try:
        return math.isfinite(x)
    except TypeError:
        return False


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], num: Iterable[int] = (),
           name: Iterable[int] = ()) -> str:
    """An HTML table; cells must already be escaped. ``num`` columns are right-aligned numbers,
    ``name`` columns may break anywhere (long qualified names)."""
    num, name = set(num), set(name)

    def cls(i: int) -> str:
        return ' class="num"' if i in num else ' class="name"' if i in name else ""

    head = "".join(f"<th{cls(i)}>{h}</th>" for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f"<td{cls(i)}>{c}</td>" for i, c in enumerate(row)) + "</tr>\n"
                   for row in rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"


def _missing_note(missing: dict, section: str) -> str:
    msg = missing.get(section)
    return f'<p class="missing">{_e(msg)}</p>' if msg else ""


def _bullets(items: Iterable[object], cls: str = "") -> str:
    attr = f' class="{cls}"' if cls else ""
    return f"<ul{attr}>" + "".join(f"<li>{_prose(i)}</li>" for i in items) + "</ul>"


def _prose(text: object) -> str:
    """Text from the data, escaped, with its backtick-marked code in ``<code>``."""
    return "".join(f"<code>{_e(piece)}</code>" if is_code else _e(piece) for piece, is_code in code_spans(str(text)))


def _labels(names: Sequence[str], width: int = 44) -> tuple[list[str], str]:
    """Chart labels for qualified names: the dotted prefix they all share (``model.encoder.``) is
    dropped and returned for the caption, so that the part that differs is what fits ``width``."""
    names = [str(n) for n in names]
    prefix = ""
    if len(names) > 1:
        common = names[0]
        for n in names[1:]:
            while not n.startswith(common):
                common = common[:-1]
        prefix = common[: common.rfind(".") + 1]
        if any(n == prefix for n in names):
            prefix = ""
    return [shorten(n[len(prefix):], width) for n in names], prefix


def _prefix_note(prefix: str) -> str:
    return f" Layer names omit their common prefix “{prefix}”." if prefix else ""


def _kinded(layers: Sequence[dict]) -> tuple[list[str], str]:
    """Bar labels: the names, and the kind where it is not a parameter gradient."""
    labels, prefix = _labels([layer.get("name", "") for layer in layers])
    return [lbl if layer.get("kind") in (None, "param_grad") else f"{lbl} ({layer['kind']})"
            for lbl, layer in zip(labels, layers)], prefix


def _mpl_text(s: str) -> str:
    # matplotlib treats text between two $ as mathtext; a name must render literally.
    return s.replace("$", r"\$")


# --- charts: each returns a Figure, or None when there is nothing to draw ---------------------------

def _scale_figure(charts: dict) -> Figure | None:
    from matplotlib.figure import Figure

    steps, scale = charts.get("steps") or [], charts.get("scale") or []
    skipped = list(charts.get("skipped") or []) + [False] * len(steps)
    pts = [(s, v, bool(k)) for s, v, k in zip(steps, scale, skipped) if _finite(v) and v > 0]
    if not pts:
        return None
    # The scale is piecewise constant: its change points draw the same step curve in far less SVG.
    line = [p for i, p in enumerate(pts) if i == 0 or i == len(pts) - 1 or p[1] != pts[i - 1][1]]
    fig = Figure(figsize=(10, 3.2), layout="constrained")
    ax = fig.add_subplot()
    ax.plot([p[0] for p in line], [p[1] for p in line], drawstyle="steps-post", color="#1f77b4",
            label="loss scale")
    skips = [p for p in pts if p[2]]
    if skips:
        ax.scatter([p[0] for p in skips], [p[1] for p in skips], marker="x", color="#d62728", s=22,
                   zorder=3, label=f"skipped step ({len(skips)})")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return fig


def _grid(rows: Any, n: int, m: int) -> Any:
    """An n × m float array (None → NaN), or None when the rows do not have that shape."""
    import numpy as np

    try:
        arr = np.array(rows, dtype=float)
    except (TypeError, ValueError):
        return None
    return arr if arr.shape == (n, m) else None


def _heatmap_figure(charts: dict) -> tuple[Figure | None, str]:
    """Two panels (scaled amax, scaled 10th percentile) on one colour scale clipped at the format's
    overflow and underflow levels, so cells beyond them take the over/under colours."""
    import matplotlib
    import numpy as np
    from matplotlib.colors import Normalize
    from matplotlib.ticker import MaxNLocator
    from matplotlib.figure import Figure

    hm, fmt = charts.get("heatmap") or {}, charts.get("format") or {}
    names, steps = list(hm.get("names") or []), list(hm.get("steps") or [])
    if not names or not steps:
        return None, ""
    high = _grid(hm.get("high") or [], len(names), len(steps))
    low = _grid(hm.get("low") or [], len(names), len(steps))
    if high is None or low is None:
        return None, ""
    note = ""
    if len(names) > HEATMAP_ROWS:
        note = f" The first {HEATMAP_ROWS} of {len(names)} layers are shown."
        names, high, low = names[:HEATMAP_ROWS], high[:HEATMAP_ROWS], low[:HEATMAP_ROWS]
    data = np.concatenate([high.ravel(), low.ravel()])
    data = data[np.isfinite(data)]
    if data.size == 0:
        return None, ""
    over, under = fmt.get("max_log2"), fmt.get("underflow_log2")
    lo = under if _finite(under) else math.floor(data.min()) - 1
    hi = over if _finite(over) else math.ceil(data.max()) + 1
    if hi - lo > 64:
        # bfloat16 spans ~260 binades: clip the colour range to the data (still never past the format's
        # limits) so that differences between layers stay visible.
        lo, hi = max(lo, math.floor(data.min()) - 2), min(hi, math.ceil(data.max()) + 2)
    # log2(0) = -inf is a bucket whose values all flushed to zero; Normalize would make it "bad".
    high, low = (np.clip(a, lo - 1, hi + 1) for a in (high, low))
    cmap = matplotlib.colormaps["viridis"].with_extremes(over=OVER, under=UNDER, bad=BAD)
    norm = Normalize(vmin=lo, vmax=hi)

    n = len(names)
    fig = Figure(figsize=(11, max(2.6, 0.17 * n + 1.6)), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    size = 8 if n <= 40 else 6
    xt = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), 7)).round().astype(int))
    for ax, arr, title in ((axes[0], high, "high: log2 scaled amax"),
                           (axes[1], low, "low: log2 scaled 10th percentile |g|")):
        im = ax.imshow(arr, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(xt, [str(steps[i]) for i in xt], fontsize=7)
        ax.set_xlabel("step", fontsize=8)
    labels, prefix = _labels(names, 40)
    note += _prefix_note(prefix)
    axes[0].set_yticks(range(n), [_mpl_text(lbl) for lbl in labels], fontsize=size)
    cbar = fig.colorbar(im, ax=axes, extend="both", pad=0.02, fraction=0.04)
    cbar.set_label("log2 |scaled gradient|", fontsize=8)
    # The format's levels become labelled ticks (with a line across the bar); plain ticks too close
    # to one would collide with its label.
    levels = [(lv, color, text) for lv, color, text in
              ((over, OVER, "overflow"), (fmt.get("normal_log2"), "#ffffff", "subnormal"),
               (under, UNDER, "flush to 0")) if _finite(lv) and lo <= lv <= hi]
    plain = [t for t in MaxNLocator(nbins=6, integer=True).tick_values(lo, hi)
             if lo <= t <= hi and all(abs(t - lv) > 0.06 * (hi - lo) for lv, _, _ in levels)]
    ticks = plain + [lv for lv, _, _ in levels]
    labels = [f"{t:g}" for t in plain] + [f"{text} ({lv:.0f})" for lv, _, text in levels]
    cbar.set_ticks(ticks, labels=labels)
    cbar.ax.tick_params(labelsize=7)
    for lv, color, _ in levels:
        cbar.ax.axhline(lv, color=color, lw=2, ls="--")
    return fig, note


def _bar_figure(labels: list[str], values: list[float], colors: list[str], xlabel: str,
                zero_line: bool = False) -> Figure:
    from matplotlib.figure import Figure

    n = len(labels)
    fig = Figure(figsize=(10, 0.24 * n + 1.1), layout="constrained")
    ax = fig.add_subplot()
    ax.barh(range(n), values, color=colors, height=0.7)
    ax.set_yticks(range(n), [_mpl_text(lbl) for lbl in labels], fontsize=8)
    ax.invert_yaxis()  # worst first, at the top
    ax.set_xlabel(xlabel)
    ax.grid(True, axis="x", alpha=0.3)
    if zero_line:
        ax.axvline(0, color="#333", lw=1)
    return fig


def _underflow_figure(layers: Sequence[dict]) -> tuple[Figure | None, str, str]:
    rows = sorted((layer for layer in layers if _finite(layer.get("underflow_rate"))),
                  key=lambda layer: -layer["underflow_rate"])[:BAR_ROWS]
    if not rows:
        return None, "", ""
    if all(layer["underflow_rate"] == 0 for layer in rows):
        return None, "No recorded gradient underflowed: every layer's underflow rate is 0.", ""
    labels, prefix = _kinded(rows)
    fig = _bar_figure(labels, [100 * layer["underflow_rate"] for layer in rows],
                      ["#ff7f0e"] * len(rows), "underflow rate (% of elements observed)")
    return fig, "", _prefix_note(prefix)


def _headroom_figure(layers: Sequence[dict]) -> tuple[Figure | None, str]:
    rows = sorted((layer for layer in layers if _finite(layer.get("headroom_log2"))),
                  key=lambda layer: layer["headroom_log2"])[:BAR_ROWS]
    if not rows:
        return None, ""
    values = [layer["headroom_log2"] for layer in rows]
    labels, prefix = _kinded(rows)
    fig = _bar_figure(labels, values, ["#d62728" if v < 0 else "#1f77b4" for v in values],
                      "headroom (binades below the format's max; negative = overflow)", zero_line=True)
    return fig, _prefix_note(prefix)


def _svg(fig: Figure, salt: str, label: str) -> str:
    """The figure as an ``<svg>`` element to inline: no XML declaration or DOCTYPE, no metadata,
    text kept as text (escaped by matplotlib), deterministic, and every id (and reference to one)
    prefixed per chart: matplotlib numbers its groups ``figure_1``, ``axes_1``... in every figure,
    and ids must be unique in the page that holds them all."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": f"ampdoctor-{salt}"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None,
                                                  "Type": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r'\bid="', f'id="{salt}-', svg)
    svg = re.sub(r'((?:xlink:)?href="#|url\(#)', rf"\g<1>{salt}-", svg)
    return svg.replace("<svg ", f'<svg role="img" aria-label="{_attr(label)}" ', 1)


def _figure(svg: str | None, title: str, caption: str) -> str:
    if svg is None:
        return f'<p class="nodata">Not enough data for the {_e(title)}.</p>'
    return f"<figure>\n{svg}\n<figcaption>{_e(caption)}</figcaption>\n</figure>"


def _charts(report: dict) -> dict[str, str]:
    """Each chart as inline HTML: a figure, or a paragraph saying why there is none."""
    charts = report.get("charts") or {}
    layers = report.get("layers") or []
    fmt_name = (charts.get("format") or {}).get("name") or "the AMP format"
    captions = {
        "scale": "Loss scale per step (log2 axis); red crosses are skipped steps.",
        "heatmap": f"log2 of the scaled gradient magnitude per layer and step bucket. Red: beyond "
                   f"{fmt_name}'s max (overflows to inf); magenta: below half its smallest subnormal "
                   f"(flushes to 0); grey: not recorded.",
        "underflow": f"Underflow rate per layer (the {BAR_ROWS} highest).",
        "headroom": f"Headroom per layer in binades (the {BAR_ROWS} smallest); negative overflows.",
    }
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        why = "Charts need matplotlib, which is not installed (pip install matplotlib)"
        return {k: f'<p class="nodata">{_e(why)}.</p>' for k in captions}

    def render(fig: Figure | None, salt: str, label: str, caption: str) -> str:
        return _figure(None if fig is None else _svg(fig, salt, label), label, caption)

    out = {"scale": render(_scale_figure(charts), "scale", "loss scale chart", captions["scale"])}
    fig, note = _heatmap_figure(charts)
    out["heatmap"] = render(fig, "heatmap", "gradient magnitude heatmap", captions["heatmap"] + note)
    fig, reason, note = _underflow_figure(layers)
    out["underflow"] = (f'<p class="nodata">{_e(reason)}</p>' if reason else
                        render(fig, "underflow", "underflow rate chart", captions["underflow"] + note))
    fig, note = _headroom_figure(layers)
    out["headroom"] = render(fig, "headroom", "headroom chart", captions["headroom"] + note)
    return out


# --- text sections ----------------------------------------------------------------------------------

def _dl(items: Iterable[tuple[str, str]]) -> str:
    """A definition list; values must already be escaped."""
    return "<dl>" + "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"


def _run_section(run: dict) -> str:
    sc = run.get("scaler") or {}
    args = ", ".join(f"{k}={setting(k, sc.get(k))}" for k in SCALER_KEYS if k in sc)
    ranks, ended = run.get("ranks"), run.get("ended_cleanly")
    steps = _e(run.get("steps", "—")) + (f" on {_e(ranks)} rank(s)" if ranks is not None else "")
    return _dl([
        ("path", f"<code>{_e(run.get('path', ''))}</code>"),
        ("steps", steps),
        ("AMP dtype", f"{_e(run.get('amp_dtype') or '—')} on {_e(run.get('device') or 'unknown device')}"),
        ("recording level", _e(run.get("level") or "—")),
        ("scaler", f"<code>{_e(sc.get('class', 'GradScaler'))}({_e(args)})</code>"),
        ("ended cleanly",
         "—" if ended is None else "yes" if ended else "no (killed, crashed or still running)"),
    ])


def _scale_section(scale: dict | None, missing: dict, chart: str) -> str:
    parts = []
    if scale:
        settle = scale.get("settle_step")
        parts.append(_dl([
            ("initial", _e(scale_str(scale.get("initial")))),
            ("final", _e(scale_str(scale.get("final")))),
            ("range", f"{_e(scale_str(scale.get('min')))} … {_e(scale_str(scale.get('max')))}"),
            ("skipped steps", f"{_e(scale.get('skipped_steps', '—'))} "
                              f"({_e(percent(scale.get('skipped_fraction')))})"),
            ("settled by step", "—" if settle is None else _e(settle)),
        ]))
    elif not missing.get("scale"):
        parts.append("<p>No loss-scale data.</p>")
    return "\n".join(parts + [_missing_note(missing, "scale"), chart])


def _layer_rows(layers: Sequence[dict]) -> list[list[str]]:
    return [[str(i), f"<code>{_e(layer.get('name', ''))}</code>", _e(layer.get("kind", "")),
             _e(percent(layer.get("underflow_rate"))), _e(percent(layer.get("zero_rate"))),
             _e(percent(layer.get("subnormal_rate"))), _e(binades(layer.get("headroom_log2"))),
             _e(number(layer.get("amax"))), _e(number(layer.get("amin"))),
             _e(layer.get("observations", "—"))]
            for i, layer in enumerate(layers, 1)]


def _layers_section(layers: Sequence[dict], missing: dict, charts: dict[str, str]) -> str:
    parts = [_missing_note(missing, "layers"), charts["heatmap"], charts["underflow"], charts["headroom"]]
    if layers:
        shown = layers[:LAYER_ROWS]
        if len(layers) > len(shown):
            parts.append(f"<p>The {len(shown)} worst of {len(layers)} layers by underflow rate.</p>")
        parts.append(_table(["#", "layer", "kind", "underflow", "zeros", "subnormal", "headroom (binades)",
                             "amax", "amin", "observations"], _layer_rows(shown),
                            num=(0, 3, 4, 5, 6, 7, 8, 9), name=(1,)))
    elif not missing.get("layers"):
        parts.append("<p>No per-layer statistics.</p>")
    return "\n".join(p for p in parts if p)


def _origins_section(origins: Sequence[dict], missing: dict) -> str:
    parts = [_missing_note(missing, "overflow_origins")]
    if origins:
        rows = [[f"<code>{_e(origin_name(o))}</code>", _e(o.get("kind", "")), _e(o.get("rank", "—")),
                 _e(o.get("count", "—")), _e(o.get("first_step", "—")), _e(o.get("last_step", "—"))]
                for o in origins]
        parts.append(_table(["layer", "kind", "rank", "overflows", "first step", "last step"], rows,
                            num=(2, 3, 4, 5), name=(0,)))
    elif not missing.get("overflow_origins"):
        parts.append("<p>No overflow was recorded.</p>")
    return "\n".join(p for p in parts if p)


def _recommendation_section(rec: dict | None, current: dict, missing: dict) -> str:
    parts = [_missing_note(missing, "recommendation")]
    if rec:
        verdict = rec.get("verdict")
        target = rec.get("target_dtype")
        text = VERDICTS.get(verdict, verdict or "No verdict.")
        parts.append(f'<p class="verdict {_attr(verdict or "")}">{_e(text)}'
                     + (f" (target format {_e(target)})" if target else "") + "</p>")
        rows = [[_e(k), _e(setting(k, current.get(k))), _e(setting(k, rec.get(k)))] for k in SCALER_KEYS]
        parts.append(_table(["setting", "current", "recommended"], rows, num=(1, 2)))
        cur, pred = rec.get("current") or {}, rec.get("predicted") or {}
        rows = [["skipped steps", _e(cur.get("skipped_steps", "—")), _e(pred.get("skipped_steps", "—"))],
                ["underflow rate", _e(underflow(cur)),
                 _e(underflow(pred))]]
        parts.append(_table(["on this run", "current", "predicted"], rows, num=(1, 2)))
        if rec.get("code"):
            parts.append(f'<pre><code class="language-python">{_e(rec["code"])}</code></pre>')
        for title, key in (("Reasons", "reasons"), ("Advice", "advice")):
            if rec.get(key):
                parts.append(f"<h3>{title}</h3>\n{_bullets(rec[key])}")
    elif not missing.get("recommendation"):
        parts.append("<p>No recommendation.</p>")
    return "\n".join(p for p in parts if p)


def report_html(report: dict) -> str:
    """``ampdoctor report --format html``: the report's sections and its charts (loss scale, gradient
    magnitude heatmap, underflow and headroom per layer) in one self-contained HTML5 page."""
    run = report.get("run") or {}
    missing = report.get("missing") or {}
    charts = _charts(report)
    path = run.get("path", "")
    sections = [
        ("run", "Run", _run_section(run)),
        ("scale", "Loss scale", _scale_section(report.get("scale"), missing, charts["scale"])),
        ("layers", "Layers", _layers_section(report.get("layers") or [], missing, charts)),
        ("overflow-origins", "Overflow origins",
         _origins_section(report.get("overflow_origins") or [], missing)),
        ("recommendation", "Recommendation",
         _recommendation_section(report.get("recommendation"), run.get("scaler") or {}, missing)),
        ("warnings", "Warnings", _bullets(report["warnings"], "warnings") if report.get("warnings")
         else "<p>None.</p>"),
    ]
    other = {k: v for k, v in missing.items() if k not in SECTIONS}
    if other:
        sections.append(("not-available", "Not available",
                         _dl((str(k), f'<span class="missing">{_e(v)}</span>') for k, v in other.items())))
    return _page("ampdoctor report", path, sections)


def _page(title: str, path: str, sections: Sequence[tuple[str, str, str]]) -> str:
    """One self-contained page; section contents must already be escaped."""
    body = "\n".join(f'<section id="{sid}">\n<h2>{heading}</h2>\n{content}\n</section>'
                     for sid, heading, content in sections)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{_e(title)}: {_e(path)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n<main>\n"
        f"<h1>{_e(title)}</h1>\n<p><code>{_e(path)}</code></p>\n{body}\n</main>\n</body>\n</html>\n"
    )


def _timeline_figure(timeline: Sequence[dict]) -> Figure | None:
    """Loss, gradient norm and loss scale over the steps before the event (log2 y axes)."""
    points = [r for r in timeline if isinstance(r.get("loss"), (int, float)) or isinstance(r.get("grad_norm"), (int, float))]
    if len(points) < 2:
        return None
    from matplotlib.figure import Figure as _Figure

    fig = _Figure(figsize=(8, 3.2))
    ax = fig.add_subplot()
    for key, label, color in (("loss", "loss", "#1f77b4"), ("grad_norm", "gradient norm", "#ff7f0e"),
                              ("scale", "loss scale", "#2ca02c")):
        xs = [r["step"] for r in timeline if isinstance(r.get(key), (int, float)) and r[key] > 0]
        ys = [r[key] for r in timeline if isinstance(r.get(key), (int, float)) and r[key] > 0]
        if xs:
            ax.plot(xs, ys, marker="o", label=label, color=color)
    bad = [r["step"] for r in timeline if isinstance(r.get("loss"), str)]
    skipped = [r["step"] for r in timeline if r.get("skipped")]
    for x in skipped:
        ax.axvline(x, color="#d62728", alpha=0.25)
    for x in bad:
        ax.axvline(x, color="#d62728", linewidth=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def postmortem_html(pm: dict) -> str:
    """``ampdoctor postmortem --format html``: the verdict, the timeline (table and chart), the advice."""
    run = pm.get("run") or {}
    path = run.get("path", "")
    if pm.get("status") == "healthy":
        sections = [("verdict", "Verdict", "<p><strong>healthy</strong>: no non-finite loss, parameter or run "
                                           "of skipped steps.</p>" + _bullets(pm.get("notes") or []))]
        if pm.get("advice"):
            sections.append(("advice", "Worth a look", _bullets(pm["advice"])))
        return _page("ampdoctor postmortem", path, sections)
    origin = pm.get("origin") or {}
    items = [("cause", f"<strong>{_e(pm.get('cause'))}</strong>"),
             ("event", _e(pm["event"]["description"]))]
    if origin.get("name"):
        items.append(("origin", f"<code>{_e(origin['name'])}</code> ({_e(origin.get('kind'))}), step "
                                f"{_e(origin.get('step'))}, rank {_e(origin.get('rank'))}"))
    rows = [[_e(r["step"]), _e(scale_str(r["scale"])), "yes" if r["skipped"] else "",
             _e(_value(r["loss"])), _e(_value(r["grad_norm"])), _e(_value(r["max_activation"])),
             f"<code>{_e(r['max_activation_module'])}</code>" if r["max_activation_module"] else "—"]
            for r in pm.get("timeline") or []]
    chart = ""
    try:
        fig = _timeline_figure(pm.get("timeline") or [])
        chart = _figure(None if fig is None else _svg(fig, "timeline", "timeline chart"), "timeline chart",
                        "Loss, gradient norm and loss scale before the event (log2 axis); red lines: "
                        "skipped steps, thick: a non-finite loss.")
    except ImportError:
        chart = '<p class="nodata">Charts need matplotlib, which is not installed.</p>'
    sections = [
        ("verdict", "Verdict", _dl(items)),
        ("timeline", "Steps before the event",
         (_table(["step", "scale", "skipped", "loss", "grad norm", "max activation", "module"], rows,
                 num=(0, 1, 3, 4, 5), name=(6,)) if rows else "<p>No steps recorded before it.</p>") + chart),
        ("advice", "What to change", _bullets(pm.get("advice") or []) or "<p>None.</p>"),
    ]
    if pm.get("notes"):
        sections.append(("notes", "Not determined / notes", _bullets(pm["notes"])))
    return _page("ampdoctor postmortem", path, sections)


def _value(x) -> str:
    if x is None:
        return "—"
    return x if isinstance(x, str) else number(x)
