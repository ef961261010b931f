"""``ampdoctor compare`` as text, Markdown and HTML: pure functions of the comparison's data
(:func:`~ampdoctor.analysis.compare.compare_data`, its findings already worded). The HTML page is
self-contained like the report's (inline CSS and SVG charts, no scripts); matplotlib is imported
only when its charts are drawn."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from . import charts
from .formatting import MISSING, binades, number, percent, scale_str, setting, shorten, underflow
from .html import escaped, page, prose
from .markdown import bullet_lines, code_span, escaped_text, table_lines
from .sections import LAYER_ROWS, SCALER_KEYS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WIDTH = 100
TOP = 15
COLORS = {"a": "#1f77b4", "b": "#ff7f0e"}
# What the prediction's status says in a heading, and the style of its box in the HTML page.
STATUS = {"checked": "checked", "settings_differ": "not checked: other settings",
          "no_recommendation": "not checked: no recommendation", "not_comparable": "not checked: other format",
          "not_float16": "not checked: no loss scaling", "steps_differ": "not checked: other length"}
EXTRA_CSS = (".verdict.held{background:#e6f4ea}.verdict.missed{background:#fce8e6}"
             ".verdict.unchecked{background:#f0f0f3}.summary li{margin:.2em 0}")


# -- cells shared by the three formats --------------------------------------------------------------

def signed_percent(x: float | None) -> str:
    """A change of a rate in percentage points: ``+0.5%``, ``-12%``, ``0``."""
    if x is None:
        return MISSING
    if x == 0:
        return "0"
    return ("+" if x > 0 else "-") + percent(abs(x))


def signed_binades(x: float | None) -> str:
    return MISSING if x is None else f"{x:+.1f}"


def layer_underflow(fields: dict | None) -> str:
    """A layer's underflow: the estimate, or ``≤`` its upper bound when the record cannot decide."""
    if fields is None:
        return MISSING
    if fields["underflow_rate"] is None and fields["underflow_rate_max"] is not None:
        return "≤" + percent(fields["underflow_rate_max"])
    return percent(fields["underflow_rate"])


def _skipped(side: dict) -> str:
    return f"{side['skipped_steps']} ({percent(side['skipped_fraction'])})"


def run_rows(data: dict) -> list[tuple[str, str, str, str]]:
    """The runs side by side: (what, run A, run B, change)."""
    a, b, change = data["a"], data["b"], data["change"]
    rows = [("steps", str(a["steps"]), str(b["steps"]), ""),
            ("AMP dtype", f"{a['amp_dtype']} on {a['device'] or '?'}", f"{b['amp_dtype']} on {b['device'] or '?'}",
             "")]
    for key in SCALER_KEYS:
        va, vb = a["scaler"].get(key), b["scaler"].get(key)
        rows.append((key, setting(key, va), setting(key, vb), "" if va == vb else "changed"))
    rows += [("skipped steps", _skipped(a), _skipped(b), f"{change['skipped_steps']:+d}"),
             ("underflow rate", underflow(a), underflow(b), _underflow_change(change)),
             ("initial scale", scale_str(a["scale"]["initial"]), scale_str(b["scale"]["initial"]), ""),
             ("final scale", scale_str(a["scale"]["final"]), scale_str(b["scale"]["final"]),
              "" if change["final_scale_log2"] is None else f"{change['final_scale_log2']:+.1f} binades"),
             ("scale range", f"{scale_str(a['scale']['min'])}..{scale_str(a['scale']['max'])}",
              f"{scale_str(b['scale']['min'])}..{scale_str(b['scale']['max'])}", ""),
             ("final loss", number(a["final_loss"]), number(b["final_loss"]), ""),
             ("verdict", _verdict(a), _verdict(b), "")]
    return rows


def _verdict(side: dict) -> str:
    rec = side["recommendation"]
    return MISSING if rec is None else rec["verdict"]


def _underflow_change(change: dict) -> str:
    low, high = change["underflow_rate_min"], change["underflow_rate_max"]
    if low is None or high is None or abs(high - low) < 1e-12:
        return signed_percent(low)
    # Two changes, of the lower and of the upper bound: not a range (the first can exceed the second).
    return f"min {signed_percent(low)}, max {signed_percent(high)}"


def prediction_rows(prediction: dict) -> list[tuple[str, str, str, str]]:
    """The prediction check: (what, predicted or recommended, run B, held)."""
    rows = []
    if prediction["recommended"] is not None:
        for key in SCALER_KEYS:
            want, got = prediction["recommended"][key], prediction["recorded"][key]
            differs = any(d["setting"] == key for d in prediction["differences"])
            rows.append((key, setting(key, want), setting(key, got), "differs" if differs else "same"))
    skipped, flow = prediction["skipped"], prediction["underflow"]
    if skipped is not None:
        low, high = skipped["expected_min"], skipped["expected_max"]
        expected = f"{low:.3g}" if low == high else f"{low:.3g}..{high:.3g}"
        rows.append(("skipped steps", f"{expected} ± {skipped['tolerance']:g}", str(skipped["got"]),
                     _held(skipped["held"])))
    if flow is not None:
        rows.append(("underflow rate", f"{underflow(flow['predicted'])} ± {percent(flow['tolerance'])}",
                     underflow(flow["got"]), _held(flow["held"])))
    return rows


def _held(held: bool | None) -> str:
    return "unknown" if held is None else "held" if held else "missed"


def verdict_class(prediction: dict) -> str:
    return "unchecked" if prediction["held"] is None else "held" if prediction["held"] else "missed"


LAYER_HEADERS = ("layer", "kind", "in", "underflow A", "underflow B", "change", "headroom A", "headroom B",
                 "change")


def layer_cells(layer: dict) -> list[str]:
    a, b = layer["a"], layer["b"]
    change = (layer["underflow_change"] if layer["underflow_change"] is not None
              else layer["underflow_max_change"])
    name = f"{layer['name']} ({layer['type']})" if layer.get("type") else layer["name"]
    return [name, layer["kind"], {"both": "both", "a": "only A", "b": "only B"}[layer["in"]],
            layer_underflow(a), layer_underflow(b), signed_percent(change),
            binades(a["headroom_log2"]) if a else MISSING, binades(b["headroom_log2"]) if b else MISSING,
            signed_binades(layer["headroom_change"])]


# -- text ---------------------------------------------------------------------------------------------

def _wrap(text: str, indent: str = "  ", width: int = WIDTH) -> list[str]:
    """``text`` wrapped to ``width``, its first line after ``indent`` and the rest under it."""
    import textwrap
    return textwrap.wrap(text, width=width, initial_indent=indent,
                         subsequent_indent=" " * len(indent)) or [indent]


def compare_text(data: dict, color: bool = False, top: int = TOP) -> str:
    """``ampdoctor compare`` for the terminal (at most 100 columns)."""
    def bold(s: str) -> str:
        if not color:
            return s
        import click
        return click.style(s, bold=True)

    prediction = data["prediction"]
    out = [bold(f"ampdoctor compare  A: {shorten(data['a']['path'], WIDTH - 22, keep_head=False)}"),
           f"                   B: {shorten(data['b']['path'], WIDTH - 22, keep_head=False)}", ""]
    for sentence in data["summary"]:
        out += _wrap(sentence, "- ", WIDTH)
    out += ["", bold("Runs"), f"  {'':<17} {'run A':<24} {'run B':<24} change"]
    out += [f"  {what:<17} {shorten(x, 24):<24} {shorten(y, 24):<24} {c}".rstrip()
            for what, x, y, c in run_rows(data)]
    out += ["", bold(f"Prediction ({STATUS[prediction['status']]})")]
    out += _wrap(prediction["finding"])
    rows = prediction_rows(prediction)
    if rows:
        out.append(f"  {'':<17} {'recommended, predicted':<24} run B")
        out += [f"  {what:<17} {x:<24} {y:<24} {c}".rstrip() for what, x, y, c in rows]
    out += ["", bold("Layers (worst change first)")]
    out += ["  " + line for line in _layer_table(data["layers"], top)]
    if data["warnings"]:
        out += ["", bold("Warnings")]
        for w in data["warnings"]:
            out += _wrap(w, "  - ")
    return "\n".join(out)


def _layer_table(layers: list[dict], top: int) -> list[str]:
    if not layers:
        return ["no per-layer rows in either run (recorded at level='steps')"]
    lines = [f"{'layer':<26} {'kind':<11} {'in':<6} {'uflow A':>8} {'uflow B':>8} {'change':>8} "
             f"{'head A':>6} {'head B':>6} {'change':>6}"]
    for layer in layers[:top]:
        name, kind, where, ua, ub, du, ha, hb, dh = layer_cells(layer)
        lines.append(f"{shorten(name, 26, keep_head=False):<26} {kind:<11} {where:<6} {ua:>8} {ub:>8} {du:>8} "
                     f"{ha:>6} {hb:>6} {dh:>6}")
    if len(layers) > top:
        lines.append(f"… {len(layers) - top} more (--top N shows more; --format md or html shows the "
                     f"{min(len(layers), LAYER_ROWS)} worst)")
    return lines


# -- Markdown -------------------------------------------------------------------------------------

def compare_markdown(data: dict) -> str:
    """``ampdoctor compare --format md``: GitHub-flavoured Markdown."""
    prediction = data["prediction"]
    out = ["# ampdoctor compare", "", f"- **run A**: {code_span(data['a']['path'], in_table=False)}",
           f"- **run B**: {code_span(data['b']['path'], in_table=False)}", "", "## Summary", ""]
    out += bullet_lines(data["summary"])
    out += ["", "## Runs", ""]
    out += table_lines(["", "run A", "run B", "change"], run_rows(data))
    out += ["", f"## Prediction ({escaped_text(STATUS[prediction['status']])})", "", escaped_text(prediction["finding"])]
    rows = prediction_rows(prediction)
    if rows:
        out += [""] + table_lines(["", "recommended, predicted", "run B", ""], rows)
    out += ["", "## Layers (worst change first)", ""]
    layers = data["layers"]
    if layers:
        shown = layers[:LAYER_ROWS]
        if len(layers) > len(shown):
            out += [f"The {len(shown)} worst of {len(layers)} layers.", ""]
        out += table_lines(LAYER_HEADERS, [layer_cells(layer) for layer in shown], right=range(3, 9), code=(0,))
    else:
        out.append("No per-layer rows in either run.")
    if data["warnings"]:
        out += ["", "## Warnings", ""] + bullet_lines(data["warnings"])
    return "\n".join(out) + "\n"


# -- HTML -----------------------------------------------------------------------------------------

def _html_table(headers: Sequence[str], rows: Iterable[Sequence[str]], num: Iterable[int] = (),
                code: Iterable[int] = ()) -> str:
    num, code = set(num), set(code)

    def cell(i: int, value: str) -> str:
        cls = ' class="num"' if i in num else ' class="name"' if i in code else ""
        return f"<td{cls}>" + (f"<code>{escaped(value)}</code>" if i in code else escaped(value)) + "</td>"

    head = "".join(f"<th>{escaped(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(cell(i, c) for i, c in enumerate(row)) + "</tr>\n" for row in rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"


def compare_html(data: dict) -> str:
    """``ampdoctor compare --format html``: one self-contained page, the verdict first."""
    prediction = data["prediction"]
    a, b = data["a"], data["b"]
    summary = (f'<p class="verdict {verdict_class(prediction)}">{prose(prediction["finding"])}</p>\n'
               '<ul class="summary">' + "".join(f"<li>{prose(s)}</li>" for s in data["summary"][:-1]) + "</ul>")
    rows = prediction_rows(prediction)
    layers = data["layers"][:LAYER_ROWS]
    layer_note = (f"<p>The {len(layers)} worst of {len(data['layers'])} layers.</p>"
                  if len(data["layers"]) > len(layers) else "")
    parts = [
        ("summary", "Summary", summary),
        ("runs", "Runs", _html_table(["", "run A", "run B", "change"], run_rows(data))),
        ("prediction", f"Prediction ({STATUS[prediction['status']]})",
         f"<p>{prose(prediction['finding'])}</p>"
         + (_html_table(["", "recommended, predicted", "run B", ""], rows) if rows else "")),
        ("curves", "Scale, loss and gradient norm", _curves_html(data.get("charts") or {})),
        ("layers", "Layers (worst change first)",
         layer_note + (_html_table(LAYER_HEADERS, [layer_cells(layer) for layer in layers], num=range(3, 9), code=(0,))
                       if layers else "<p>No per-layer rows in either run.</p>")),
    ]
    if data["warnings"]:
        parts.append(("warnings", "Warnings", '<ul class="warnings">'
                      + "".join(f"<li>{prose(w)}</li>" for w in data["warnings"]) + "</ul>"))
    return page("ampdoctor compare", f"{a['path']} vs {b['path']}", parts, extra_css=EXTRA_CSS,
                subtitle=f"A: <code>{escaped(a['path'])}</code><br>B: <code>{escaped(b['path'])}</code>")


def _curves_html(series: dict) -> str:
    why = charts.unavailable()
    if why is not None:
        return f'<p class="nodata">{escaped(why)}.</p>'
    fig = curves_figure(series)
    if fig is None:
        return '<p class="nodata">Not enough data for the charts.</p>'
    caption = ("Run A (blue) and run B (orange) per step: the loss scale (log2 axis; crosses are skipped "
               "steps), the loss, and the gradient norm (log2 axis), each on its own axis.")
    return f"<figure>\n{charts.to_svg(fig, 'compare', 'scale, loss and gradient norm of both runs')}\n" \
           f"<figcaption>{escaped(caption)}</figcaption>\n</figure>"


def curves_figure(series: dict) -> Figure | None:
    """Three panels sharing the step axis (the scale, the loss, the gradient norm), both runs on
    each: three quantities of different units on one axis would flatten two of them."""
    from matplotlib.figure import Figure

    runs = [(key, series[key]) for key in ("a", "b") if series.get(key) and series[key].get("steps")]
    if not runs:
        return None
    fig = Figure(figsize=(10, 7), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True)
    panels = (("scale", "loss scale", True), ("loss", "loss", False), ("grad_norm", "gradient norm", True))
    for ax, (key, label, log) in zip(axes, panels):
        for run, s in runs:
            points = [(x, y) for x, y in zip(s["steps"], s[key]) if y is not None and (y > 0 or not log)]
            if not points:
                continue
            drawstyle = "steps-post" if key == "scale" else "default"
            ax.plot([p[0] for p in points], [p[1] for p in points], color=COLORS[run], drawstyle=drawstyle,
                    label=f"run {run.upper()}", linewidth=1.2)
            if key == "scale":
                skips = [(x, y) for x, y, k in zip(s["steps"], s["scale"], s["skipped"]) if k and y and y > 0]
                if skips:
                    ax.scatter([p[0] for p in skips], [p[1] for p in skips], marker="x", color=COLORS[run],
                               s=22, zorder=3, label=f"run {run.upper()} skipped ({len(skips)})")
        if log and ax.lines:
            ax.set_yscale("log", base=2)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(loc="best", fontsize=8)
    axes[-1].set_xlabel("step")
    return fig
