"""The HTML report: one self-contained HTML5 file (inline CSS, charts as inline SVG, no scripts and
no external resources), so it can be attached to an issue or opened from a CI artifact offline.

Every string from the data goes through :func:`html.escape`; chart labels go through matplotlib's
SVG writer, which escapes text too. matplotlib is imported only when a report is rendered, so that
``import ampdoctor`` does not pay for it; without it the report says so where the charts would be."""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from . import charts, sections
from .formatting import (VERDICTS, binades, code_spans, number, origin_name, origin_steps, percent, scale_str,
                         underflow_range)
from .sections import Section

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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
.subtitle{color:#555;margin-top:0}
pre.scaler-code{font-size:1.05em;background:#eef3fd;border-left:4px solid #4a7bd0}
.tables{display:flex;flex-wrap:wrap;gap:0 2.5em;align-items:flex-start}
"""


def escaped(x: object) -> str:
    """Text content, escaped (``<``, ``>``, ``&``; quotes are harmless outside attributes and stay
    readable in the source)."""
    return html.escape(str(x), quote=False)


def _attr(x: object) -> str:
    """An attribute value, escaped quotes included."""
    return html.escape(str(x), quote=True)


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


def _note(message: str | None) -> str:
    """A note from the data (why a section is missing), or nothing."""
    return f'<p class="missing">{escaped(message)}</p>' if message else ""


def _placeholder(section: Section, has_data: bool, missing: dict) -> str:
    empty = sections.placeholder(section, has_data, missing)
    return f"<p>{empty}</p>" if empty else ""


def _bullets(items: Iterable[object], cls: str = "") -> str:
    attr = f' class="{cls}"' if cls else ""
    return f"<ul{attr}>" + "".join(f"<li>{prose(i)}</li>" for i in items) + "</ul>"


def prose(text: object) -> str:
    """Text from the data, escaped, with its backtick-marked code in ``<code>``."""
    return "".join(f"<code>{escaped(piece)}</code>" if is_code else escaped(piece) for piece, is_code in code_spans(str(text)))


def _dl(items: Iterable[tuple[str, str]]) -> str:
    """A definition list; values must already be escaped."""
    return "<dl>" + "".join(f"<dt>{escaped(k)}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"


def page(title: str, path: str, parts: Sequence[tuple[str, str, str]], summary: str = "", *,
         subtitle: str | None = None, extra_css: str = "") -> str:
    """One self-contained page of ``(id, heading, content)`` sections; contents must already be
    escaped. Under the heading: ``path`` as code and ``summary`` (text) on the same line, or
    ``subtitle`` (HTML) instead. Also the page of ``compare`` (:mod:`.compare`)."""
    body = "\n".join(f'<section id="{sid}">\n<h2>{heading}</h2>\n{content}\n</section>'
                     for sid, heading, content in parts)
    if subtitle is None:
        subtitle = f"<code>{escaped(path)}</code>" + (f" · {escaped(summary)}" if summary else "")
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escaped(title)}: {escaped(path)}</title>\n<style>{CSS}{extra_css}</style>\n</head>\n<body>\n<main>\n"
        f"<h1>{escaped(title)}</h1>\n<p class=\"subtitle\">{subtitle}</p>\n{body}\n</main>\n</body>\n</html>\n"
    )


# --- charts ---------------------------------------------------------------------------------------

def _figure(fig: Figure | None, salt: str, label: str, caption: str) -> str:
    """A chart as an HTML figure with its caption, or a paragraph saying there was no data for it."""
    if fig is None:
        return f'<p class="nodata">Not enough data for the {escaped(label)}.</p>'
    return f"<figure>\n{charts.to_svg(fig, salt, label)}\n<figcaption>{escaped(caption)}</figcaption>\n</figure>"


def _report_charts(report: dict) -> dict[str, str]:
    """Each of the report's charts as inline HTML: a figure, or a paragraph saying why there is none."""
    series = report.get("charts") or {}
    layers = report.get("layers") or []
    fmt_name = (series.get("format") or {}).get("name") or "the AMP format"
    captions = {
        "scale": "Loss scale per step (log2 axis); red crosses are skipped steps.",
        "heatmap": f"log2 of the scaled gradient magnitude per layer and step bucket. Red: beyond "
                   f"{fmt_name}'s max (overflows to inf); magenta: below half its smallest subnormal "
                   f"(flushes to 0); black: every element was zero (flushed to zero); grey: not recorded.",
        "underflow": "Underflow rate per layer, highest first; the paler bar is the upper bound where "
                     "some zeros cannot be called underflow or structure.",
        "headroom": f"Headroom per layer in binades (the {charts.BAR_ROWS} smallest); negative overflows.",
    }
    why = charts.unavailable()
    if why is not None:
        return {k: f'<p class="nodata">{escaped(why)}.</p>' for k in captions}

    out = {"scale": _figure(charts.scale_figure(series), "scale", "loss scale chart", captions["scale"])}
    fig, note = charts.heatmap_figure(series)
    out["heatmap"] = _figure(fig, "heatmap", "gradient magnitude heatmap", captions["heatmap"] + note)
    fig, reason, note = charts.underflow_figure(layers)
    out["underflow"] = (f'<p class="nodata">{escaped(reason)}</p>' if reason else
                        _figure(fig, "underflow", "underflow rate chart", captions["underflow"] + note))
    fig, note = charts.headroom_figure(layers)
    out["headroom"] = _figure(fig, "headroom", "headroom chart", captions["headroom"] + note)
    return out


# --- the report's sections ------------------------------------------------------------------------

def _run_section(run: dict) -> str:
    ranks = run.get("ranks")
    steps = escaped(run.get("steps", "—")) + (f" on {escaped(ranks)} rank(s)" if ranks is not None else "")
    return _dl([
        ("path", f"<code>{escaped(run.get('path', ''))}</code>"),
        ("steps", steps),
        ("AMP dtype", f"{escaped(run.get('amp_dtype') or '—')} on {escaped(run.get('device') or 'unknown device')}"),
        ("recording level", escaped(run.get("level") or "—")),
        ("scaler", f"<code>{escaped(sections.scaler_call(run.get('scaler') or {}))}</code>"),
        ("ended cleanly", sections.ended_cleanly(run.get("ended_cleanly"))),
    ])


def _scale_section(scale: dict | None, missing: dict, chart: str) -> str:
    parts = []
    if scale:
        settle = scale.get("settle_step")
        parts.append(_dl([
            ("initial", escaped(scale_str(scale.get("initial")))),
            ("final", escaped(scale_str(scale.get("final")))),
            ("range", f"{escaped(scale_str(scale.get('min')))} … {escaped(scale_str(scale.get('max')))}"),
            ("skipped steps", f"{escaped(scale.get('skipped_steps', '—'))} "
                              f"({escaped(percent(scale.get('skipped_fraction')))})"),
            ("settled by step", "—" if settle is None else escaped(settle)),
        ]))
    parts.append(_placeholder(sections.SCALE, bool(scale), missing))
    return "\n".join([p for p in parts if p] + [_note(sections.missing_note(missing, sections.SCALE)), chart])


def _layer_rows(layers: Sequence[dict]) -> list[list[str]]:
    return [[str(i), _layer_name(layer), escaped(layer.get("kind", "")),
             escaped(percent(layer.get("underflow_rate")) + sections.measured_mark(layer.get("underflow_measured"))),
             escaped(underflow_range(layer)), escaped(percent(layer.get("zero_rate"))),
             escaped(percent(layer.get("subnormal_rate"))), escaped(binades(layer.get("headroom_log2"))),
             escaped(number(layer.get("amax"))), escaped(number(layer.get("amin"))),
             escaped(layer.get("observations", "—"))]
            for i, layer in enumerate(layers, 1)]


def _layer_name(layer: dict) -> str:
    """The layer's name as code, and its module's class after it where the name is only an index."""
    module_type = layer.get("module_type")
    return f"<code>{escaped(layer.get('name', ''))}</code>" + (f" ({escaped(module_type)})" if module_type else "")


def _layers_section(layers: Sequence[dict], missing: dict, chart_html: dict[str, str]) -> str:
    parts = [_note(sections.missing_note(missing, sections.LAYERS)),
             chart_html["heatmap"], chart_html["underflow"], chart_html["headroom"]]
    if layers:
        shown, note = sections.layers_shown(layers)
        if note:
            parts.append(f"<p>{note}</p>")
        parts.append(_table(["#", "layer", "kind", "underflow", "range", "zeros", "subnormal", "headroom (binades)",
                             "amax", "amin", "observations"], _layer_rows(shown),
                            num=(0, 3, 4, 5, 6, 7, 8, 9, 10), name=(1,)))
        for legend in (sections.measured_legend(shown), sections.range_legend(shown)):
            if legend:
                parts.append(f"<p>{escaped(legend)}</p>")
    parts.append(_placeholder(sections.LAYERS, bool(layers), missing))
    return "\n".join(p for p in parts if p)


def _origins_section(origins: Sequence[dict], missing: dict) -> str:
    parts = [_note(sections.missing_note(missing, sections.ORIGINS))]
    if origins:
        rows = [[f"<code>{escaped(origin_name(o))}</code>", escaped(o.get("kind", "")), escaped(o.get("rank", "—")),
                 escaped(o.get("count", "—")), escaped(o.get("first_step", "—")), escaped(o.get("last_step", "—"))]
                for o in origins]
        parts.append(_table(["layer", "kind", "rank", "overflows", "first step", "last step"], rows,
                            num=(2, 3, 4, 5), name=(0,)))
    parts.append(_placeholder(sections.ORIGINS, bool(origins), missing))
    return "\n".join(p for p in parts if p)


def _escaped(rows: Iterable[Sequence[str]]) -> list[list[str]]:
    return [[escaped(cell) for cell in row] for row in rows]


def _recommendation_section(rec: dict | None, current: dict, missing: dict) -> str:
    """The answer, first on the page: the verdict, the line to paste, what it changes on this run
    (skipped steps and underflow, current and predicted), the settings, and the reasons."""
    parts = [_note(sections.missing_note(missing, sections.RECOMMENDATION))]
    if rec:
        verdict = rec.get("verdict")
        target = rec.get("target_dtype")
        text = VERDICTS.get(verdict, verdict or "No verdict.")
        parts.append(f'<p class="verdict {_attr(verdict or "")}">{escaped(text)}'
                     + (f" (target format {escaped(target)})" if target else "") + "</p>")
        if rec.get("code"):
            parts.append(f'<pre class="scaler-code"><code class="language-python">{escaped(rec["code"])}</code></pre>')
        parts.append('<div class="tables">'
                     + _table(sections.OUTCOME_HEADERS, _escaped(sections.outcome_rows(rec)), num=(1, 2))
                     + _table(sections.SETTINGS_HEADERS, _escaped(sections.settings_rows(current, rec)), num=(1, 2))
                     + "</div>")
        if rec.get("reasons"):
            parts.append(f"<h3>Reasons</h3>\n{_bullets(rec['reasons'])}")
    parts.append(_placeholder(sections.RECOMMENDATION, bool(rec), missing))
    return "\n".join(p for p in parts if p)


def _advice_section(rec: dict | None) -> str:
    advice = (rec or {}).get("advice")
    return _bullets(advice) if advice else f"<p>{sections.ADVICE.empty}</p>"


def report_html(report: dict) -> str:
    """``ampdoctor report --format html``: the recommendation and its advice first, then the evidence
    (loss scale, layers with the heatmap and the per-layer charts, overflow origins, run details,
    warnings), in one self-contained HTML5 page."""
    run = report.get("run") or {}
    missing = report.get("missing") or {}
    chart_html = _report_charts(report)
    warnings = report.get("warnings")
    rec = report.get("recommendation")
    content = {
        sections.RECOMMENDATION: _recommendation_section(rec, run.get("scaler") or {}, missing),
        sections.ADVICE: _advice_section(rec),
        sections.SCALE: _scale_section(report.get("scale"), missing, chart_html["scale"]),
        sections.LAYERS: _layers_section(report.get("layers") or [], missing, chart_html),
        sections.ORIGINS: _origins_section(report.get("overflow_origins") or [], missing),
        sections.RUN: _run_section(run),
        sections.WARNINGS: _bullets(warnings, "warnings") if warnings else f"<p>{sections.WARNINGS.empty}</p>",
    }
    parts = [(section, content[section]) for section in sections.REPORT_ORDER]
    other = sections.unplaced_notes(missing)
    if other:
        parts.append((sections.NOT_AVAILABLE,
                      _dl((str(k), f'<span class="missing">{escaped(v)}</span>') for k, v in other.items())))
    return page("ampdoctor report", run.get("path", ""),
                 [(section.anchor, section.title, content) for section, content in parts],
                 summary=sections.run_summary(run) if run else "")


# --- the postmortem -------------------------------------------------------------------------------

def postmortem_html(pm: dict) -> str:
    """``ampdoctor postmortem --format html``: the verdict, the advice, then the timeline (table and chart)."""
    run = pm.get("run") or {}
    path = run.get("path", "")
    if pm.get("status") == "healthy":
        parts = [("verdict", "Verdict", "<p><strong>healthy</strong>: no non-finite loss, parameter or run "
                                        "of skipped steps.</p>" + _bullets(pm.get("notes") or []))]
        if pm.get("advice"):
            parts.append(("advice", "Worth a look", _bullets(pm["advice"])))
        return page("ampdoctor postmortem", path, parts)
    origin = pm.get("origin") or {}
    items = [("cause", f"<strong>{escaped(pm.get('cause'))}</strong>"),
             ("event", escaped(pm["event"]["description"]))]
    if origin.get("name"):
        items.append(("origin", f"<code>{escaped(origin['name'])}</code> ({escaped(origin.get('kind'))}), step "
                                f"{escaped(origin.get('step'))}, rank {escaped(origin.get('rank'))}"))
    later = (pm.get("evidence") or {}).get("later_origins") or []
    if later:
        items.append(("later origins", "; ".join(
            f"<code>{escaped(origin_name(o))}</code> ({escaped(o.get('kind'))}), {escaped(origin_steps(o))}"
            for o in later)))
    timeline = pm.get("timeline") or []
    rows = [[escaped(c) for c in sections.timeline_cells(r)]
            + [f"<code>{escaped(r['max_activation_module'])}</code>" if r["max_activation_module"] else "—"]
            for r in timeline]
    why = charts.unavailable()
    chart = (f'<p class="nodata">{escaped(why)}.</p>' if why is not None else
             _figure(charts.timeline_figure(timeline), "timeline", "timeline chart",
                     "Loss, gradient norm and loss scale before the event, each on its own axis; red "
                     "lines: skipped steps, thick: a non-finite loss."))
    advice = pm.get("advice") or []
    # The answer first (what happened, what to change), then the evidence: the steps before it.
    parts = [
        ("verdict", "Verdict", _dl(items)),
        ("advice", "What to change", _bullets(advice) if advice else "<p>None.</p>"),
        ("timeline", "Steps before the event",
         (_table(sections.TIMELINE_HEADERS, rows, num=(0, 1, 3, 4, 5), name=(6,)) if rows
          else "<p>No steps recorded before it.</p>") + chart),
    ]
    if pm.get("notes"):
        parts.append(("notes", "Not determined / notes", _bullets(pm["notes"])))
    return page("ampdoctor postmortem", path, parts)
