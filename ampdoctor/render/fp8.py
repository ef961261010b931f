"""``ampdoctor fp8`` (FP8 readiness) as text, Markdown, HTML and JSON: pure functions of
:func:`~ampdoctor.analysis.fp8.fp8_data`'s data, whose codes :mod:`.wording.fp8` words. The answer
comes first (the verdict paragraph), then the per-layer table, the reasons to keep layers, the
delayed-scaling table and the limits. The HTML page is self-contained like the report's (inline CSS,
no scripts; no charts: tables are enough). The JSON is the data itself, by :func:`~ampdoctor.render.to_json`'s
rules (non-finite floats as null)."""

from __future__ import annotations

import textwrap

from . import to_json
from .formatting import code_spans, percent, shorten
from .html import _table, escaped, page, prose
from .markdown import _prose, bullet_lines, code_span, escaped_text, table_lines
from .wording import fp8 as words
from .wording import worded

WIDTH = 100
TITLE = "ampdoctor fp8"
EXTRA_CSS = ("p.answer{background:#eef3fd;border-left:4px solid #4a7bd0;padding:.6em 1em}"
             "p.legend{color:#555;font-size:.88em}")
LAYER_HEADERS = ("layer", "type", "verdict", *(words.flush_header(o, f) for o, f in words.FLUSH_COLUMNS), "history")


TOP = 6  # delayed-scaling rows the text and Markdown show by default (--top)


def render_fp8(data: dict, fmt: str, *, color: bool = False, top: int | None = TOP) -> str:
    """``ampdoctor fp8 --format FMT``: ``text``, ``md``, ``html`` or ``json``; ``top``: the
    delayed-scaling rows the text and Markdown show (the HTML and JSON hold all). (The command's
    entry point: ``render.fp8`` is this module.)"""
    if fmt == "json":
        return to_json(data)
    data = worded(data)
    if fmt == "text":
        return fp8_text(data, color=color, top=top)
    if fmt == "md":
        return fp8_markdown(data, top=top)
    if fmt == "html":
        return fp8_html(data)
    raise ValueError(f"fp8 has no {fmt!r} output")


def _more(data: dict, more: int) -> str:
    return f"… {more} more (ampdoctor fp8 {data.get('path', 'RUN')} --top N)"


# -- rows shared by the three formats ---------------------------------------------------------------

def _operand(layer: dict, operand: str, fmt: str) -> dict | None:
    for op in layer.get("operands") or []:
        if op.get("operand") == operand and op.get("format") == fmt:
            return op
    return None


def _current(op: dict | None) -> dict | None:
    for r in (op or {}).get("recipes") or []:
        if r.get("recipe") == "current":
            return r
    return None


def _flushed_cell(layer: dict, operand: str, fmt: str) -> str:
    current = _current(_operand(layer, operand, fmt))
    return percent(None if current is None else current.get("flushed_max"))


def layer_rows(data: dict) -> list[list[str]]:
    """The per-layer table: name, type, verdict, the worst flushed share per operand under current
    scaling, the shortest history."""
    return [[layer["name"], words.layer_type(layer), words.VERDICTS.get(layer.get("verdict"), str(layer.get("verdict"))),
             *(_flushed_cell(layer, o, f) for o, f in words.FLUSH_COLUMNS),
             words.history_cell(layer.get("shortest_history"))]
            for layer in data.get("layers") or []]


def _delayed(op: dict, history: int) -> dict | None:
    for r in op.get("recipes") or []:
        if r.get("recipe") == "delayed" and r.get("history") == history:
            return r
    return None


def delayed_rows(data: dict, top: int | None = None) -> tuple[list[list[str]], int]:
    """Per layer and operand (HYBRID formats) with a clipped pass under some delayed history: the
    clipped passes at each history, the passes any history must clip, the shortest history; the
    layers to keep first, then the operands that need the longest history (those that set the
    run's). The first ``top`` of them (None: all), and how many more there are."""
    histories = data.get("histories") or [1, 16, 1024]
    rows, keys = [], []
    for layer in data.get("layers") or []:
        for op in layer.get("operands") or []:
            if op.get("variant", "hybrid") != "hybrid":
                continue
            recipes = [_delayed(op, h) for h in histories]
            if not any(r and r.get("clipped_passes") for r in recipes):
                continue
            rows.append([layer["name"], words.operand_label(op["operand"], op["format"]),
                         *(words.clipped_cell(r) if r else "—" for r in recipes),
                         words.unavoidable_cell(op), words.history_cell(op.get("shortest_history"))])
            keys.append((layer.get("verdict") != "keep", -(op.get("shortest_history") or 0), len(keys)))
    order = sorted(range(len(rows)), key=keys.__getitem__)
    shown = order if top is None else order[:top]
    return [rows[i] for i in shown], len(rows) - len(shown)


def _headers(data: dict) -> tuple[str, ...]:
    histories = data.get("histories") or [1, 16, 1024]
    return ("layer", "operand", *(f"history {h}" for h in histories), "unavoidable", "shortest")


def keep_items(data: dict) -> list[str]:
    """Per layer to keep: why (its reasons, worst first)."""
    return [f"`{layer['name']}`: " + "; ".join(words.reason(r) for r in layer.get("reasons") or [])
            for layer in data.get("layers") or [] if layer.get("verdict") == "keep"]


def block_headers(data: dict) -> tuple[str, ...]:
    recipes = (data.get("block_formats") or {}).get("recipes") or []
    return ("layer", *(words.block_recipe_label(r["name"]) for r in recipes))


def block_rows(data: dict) -> list[list[str]]:
    """The block formats' table: per layer, each recipe's verdict and its worst operand's lost share."""
    rows = []
    for layer in (data.get("block_formats") or {}).get("layers") or []:
        cells = []
        for r in layer.get("recipes") or []:
            verdict, lost = r.get("verdict"), r.get("lost_max")
            cells.append(words.BLOCK_VERDICTS.get(verdict, str(verdict))
                         + ("" if lost is None or verdict == "not_converted" else f" {percent(lost)}"))
        rows.append([layer["name"], *cells])
    return rows


def _legends(data: dict) -> list[str]:
    legends = [words.TABLE_LEGEND]
    if any(not layer.get("converted", True) for layer in data.get("layers") or []):
        legends.insert(0, words.NOT_CONVERTED_LEGEND)
    return legends


# -- text ---------------------------------------------------------------------------------------------

_NBSP = "\u00a0"


def _wrap(text: str, indent: str = "  ", width: int = WIDTH, rest: str | None = None) -> list[str]:
    """``text`` wrapped, its backtick-marked code never broken across lines (so it pastes)."""
    held = "".join(f"`{piece.replace(' ', _NBSP)}`" if is_code else piece for piece, is_code in code_spans(text))
    lines = textwrap.wrap(held, width=width, initial_indent=indent, subsequent_indent=indent if rest is None else rest,
                          break_long_words=False, break_on_hyphens=False) or [indent]
    return [line.replace(_NBSP, " ") for line in lines]


def _columns(headers, rows, widths, right) -> list[str]:
    def line(cells):
        return "  " + " ".join(f"{c:>{w}}" if i in right else f"{c:<{w}}" for i, (c, w) in
                               enumerate(zip(cells, widths))).rstrip()
    return [line(headers)] + [line(row) for row in rows]


def fp8_text(data: dict, color: bool = False, top: int | None = TOP) -> str:
    """``ampdoctor fp8`` for the terminal (at most 100 columns but for code to paste)."""
    def heading(s: str) -> str:
        if not color:
            return s
        import click
        return click.style(s, bold=True)

    out = [heading(f"{TITLE}  {shorten(str(data.get('path', '')), WIDTH - 16, keep_head=False)}")]
    out += _wrap(words.summary_line(data), "")
    out += ["", heading("Verdict")] + _wrap(words.verdict(data))
    out += ["", heading("Layers")]
    rows = [[shorten(r[0], 30, keep_head=False), shorten(r[1], 10)] + r[2:] for r in layer_rows(data)]
    if rows:
        out += _columns(LAYER_HEADERS, rows, (30, 10, 7, 9, 9, 9, 9, 7), right=range(3, 8))
        for legend in _legends(data):
            out += _wrap(legend, "    ")
    else:
        out.append("  no GEMM layers")
    kept = keep_items(data)
    if kept:
        out += ["", heading("Why keep")]
        for item in kept:
            out += _wrap(item, "  - ", rest="    ")
    out += ["", heading("Delayed scaling: clipped passes (HYBRID formats)")]
    delayed, more = delayed_rows(data, top)
    if delayed:
        histories = data.get("histories") or [1, 16, 1024]
        for row in delayed:
            name, operand, *cells, must, shortest = row
            out.append(f"  {name}  {operand}  (shortest history {shortest})")
            groups: list[tuple[list[int], str]] = []  # histories that clip alike share a line
            for history, cell in zip(histories, cells):
                if groups and groups[-1][1] == cell:
                    groups[-1][0].append(history)
                else:
                    groups.append(([history], cell))
            for group, cell in groups:
                label = "history " + ", ".join(map(str, group))
                out += _wrap(cell, f"    {label:<20} ", rest=" " * 25)
            out += _wrap(must, f"    {'unavoidable':<20} ", rest=" " * 25)
        if more:
            out.append("  " + _more(data, more))
    else:
        out.append("  no layer clips under any delayed history")
    out += _block_text(data, heading)
    out += ["", heading("Limits")]
    for item in words.limits(data):
        out += _wrap(item, "  - ", rest="    ")
    return "\n".join(out)


def _block_text(data: dict, heading) -> list[str]:
    out = ["", heading("Block formats (MXFP8, MXFP4, NVFP4)")] + _wrap(words.block_verdict(data))
    rows = block_rows(data)
    if rows:
        headers = block_headers(data)
        out += [""] + _columns(headers, [[shorten(r[0], 30, keep_head=False)] + r[1:] for r in rows],
                               (30,) + (13,) * (len(headers) - 1), right=())
        out += _wrap(words.BLOCK_LEGEND, "    ")
    for item in words.block_keep_items(data):
        out += _wrap(item, "  - ", rest="    ")
    return out


# -- Markdown -------------------------------------------------------------------------------------

def fp8_markdown(data: dict, top: int | None = TOP) -> str:
    """``ampdoctor fp8 --format md``: GitHub-flavoured Markdown, the answer first."""
    out = [f"# {TITLE}", "", f"{code_span(data.get('path', ''), in_table=False)}: {escaped_text(words.summary_line(data))}",
           "", "## Verdict", "", _prose(words.verdict(data)), "", "## Layers", ""]
    rows = layer_rows(data)
    if rows:
        out += table_lines(LAYER_HEADERS, rows, right=range(3, 8), code=(0,))
        for legend in _legends(data):
            out += ["", escaped_text(legend)]
    else:
        out.append("No GEMM layers.")
    kept = keep_items(data)
    if kept:
        out += ["", "## Why keep", ""] + bullet_lines(kept)
    out += ["", "## Delayed scaling: clipped passes (HYBRID formats)", ""]
    delayed, more = delayed_rows(data, top)
    out += (table_lines(_headers(data), delayed, code=(0,)) if delayed
            else ["No layer clips under any delayed history."])
    if more:
        out += ["", escaped_text(_more(data, more))]
    out += ["", "## Block formats (MXFP8, MXFP4, NVFP4)", "", _prose(words.block_verdict(data))]
    rows = block_rows(data)
    if rows:
        out += [""] + table_lines(block_headers(data), rows, code=(0,)) + ["", escaped_text(words.BLOCK_LEGEND)]
    block_kept = words.block_keep_items(data)
    if block_kept:
        out += [""] + bullet_lines(block_kept)
    out += ["", "## Limits", ""] + bullet_lines(words.limits(data))
    return "\n".join(out) + "\n"


# -- HTML -----------------------------------------------------------------------------------------

def _code_cell(name: str) -> str:
    return f"<code>{escaped(name)}</code>"


def _block_html(data: dict) -> str:
    rows = block_rows(data)
    block = f'<p class="answer">{prose(words.block_verdict(data))}</p>'
    if rows:
        block += (_table(block_headers(data), [[_code_cell(r[0])] + [escaped(c) for c in r[1:]] for r in rows],
                         name=(0,)) + f'<p class="legend">{escaped(words.BLOCK_LEGEND)}</p>')
    block_kept = words.block_keep_items(data)
    if block_kept:
        block += "<ul>" + "".join(f"<li>{prose(k)}</li>" for k in block_kept) + "</ul>"
    return block


def fp8_html(data: dict) -> str:
    """``ampdoctor fp8 --format html``: one self-contained page, the verdict first."""
    rows = layer_rows(data)
    layers = (_table(LAYER_HEADERS, [[_code_cell(r[0])] + [escaped(c) for c in r[1:]] for r in rows],
                     num=range(3, 8), name=(0,))
              + "".join(f'<p class="legend">{escaped(legend)}</p>' for legend in _legends(data))
              if rows else "<p>No GEMM layers.</p>")
    delayed, _ = delayed_rows(data)
    parts = [("verdict", "Verdict", f'<p class="answer">{prose(words.verdict(data))}</p>'),
             ("layers", "Layers", layers)]
    kept = keep_items(data)
    if kept:
        parts.append(("keep", "Why keep", "<ul>" + "".join(f"<li>{prose(k)}</li>" for k in kept) + "</ul>"))
    parts += [("delayed", "Delayed scaling: clipped passes (HYBRID formats)",
               _table(_headers(data), [[_code_cell(r[0])] + [escaped(c) for c in r[1:]] for r in delayed],
                      name=(0,)) if delayed else "<p>No layer clips under any delayed history.</p>"),
              ("blocks", "Block formats (MXFP8, MXFP4, NVFP4)", _block_html(data)),
              ("limits", "Limits", "<ul>" + "".join(f"<li>{prose(item)}</li>" for item in words.limits(data))
               + "</ul>")]
    return page(TITLE, str(data.get("path", "")), parts, summary=words.summary_line(data), extra_css=EXTRA_CSS)
