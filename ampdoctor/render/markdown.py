"""GitHub-flavoured Markdown renderers: pure functions from report data to a string.

Everything that comes from the run (layer names, paths, messages) is escaped, so a name such as
``a|b`` cannot break a table and ``<img ...>`` cannot become HTML where the Markdown is rendered."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from . import sections
from .formatting import (VERDICTS, binades, code_spans, number, origin_name, origin_steps, percent, scale_str,
                         setting, underflow, underflow_range)
from .sections import REPLAY_KEYS, SCALER_KEYS, Section

# CommonMark lets a backslash escape any ASCII punctuation; these are the ones that can start
# emphasis, links, code, HTML, entities or table cells in the middle of a line.
_INLINE_SPECIAL = re.compile(r"([\\`*_\[\]<>|&~])")
# ... and these only at the start of a line (headings, lists, quotes, ordered lists).
_LINE_START = re.compile(r"^([#+\-=]|\d+(?=[.)]))")


def _inline(s: object) -> str:
    """Text from the data, escaped to render literally inside a line (a table cell, after a label)."""
    return _INLINE_SPECIAL.sub(r"\\\1", " ".join(str(s).split()))


def escaped_text(s: object) -> str:
    """Text from the data that starts a block (a list item, a quote), escaped to render literally."""
    return _LINE_START.sub(_escape_line_start, _inline(s))


def _escape_line_start(m: re.Match) -> str:
    # "1." must become "1\." (a backslash before a digit is no escape); "#" becomes "\#".
    s = m.group(1)
    return s + "\\" if s[0].isdigit() else "\\" + s


def code_span(s: object, *, in_table: bool = True) -> str:
    """``s`` as an inline code span: a fence longer than any backtick run inside it, and ``|``
    escaped in tables (GFM splits cells before it parses code spans)."""
    flat = " ".join(str(s).split())
    if not flat:
        return ""
    ticks = "`" * (max((len(r) for r in re.findall(r"`+", flat)), default=0) + 1)
    pad = " " if flat.startswith("`") or flat.endswith("`") else ""
    if in_table:
        flat = flat.replace("|", r"\|")
    return f"{ticks}{pad}{flat}{pad}{ticks}"


def _fence(code: str, lang: str = "") -> list[str]:
    """A fenced code block that the code itself cannot close."""
    fence = "`" * max(3, max((len(r) for r in re.findall(r"`+", code)), default=0) + 1)
    return [f"{fence}{lang}", code.rstrip("\n"), fence]


def table_lines(headers: Sequence[str], rows: Iterable[Sequence[object]], right: Iterable[int] = (),
           code: Iterable[int] = ()) -> list[str]:
    """A GFM table of raw values, escaped here: ``code`` columns (names) as code spans, the others
    as text (``2**16`` twice in a cell would otherwise turn bold). ``right``: numeric columns."""
    right, code = set(right), set(code)
    sep = ["---:" if i in right else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"table row has {len(row)} cells, header has {len(headers)}")
        cells = [code_span(c) if i in code else _inline(c) for i, c in enumerate(row)]
        lines.append("| " + " | ".join(c or " " for c in cells) + " |")
    return lines


def bullet_lines(items: Iterable[object]) -> list[str]:
    return [f"- {_prose(item)}" for item in items]


def _prose(s: object) -> str:
    """Text from the data, escaped, with its backtick-marked code as code spans."""
    out = []
    for i, (piece, is_code) in enumerate(code_spans(" ".join(str(s).split()))):
        if is_code:
            out.append(code_span(piece, in_table=False))
        else:  # escaped as _inline does, keeping the spaces next to the code spans
            escaped = _INLINE_SPECIAL.sub(r"\\\1", piece)
            out.append(_LINE_START.sub(_escape_line_start, escaped) if i == 0 else escaped)
    return "".join(out)


def _field(label: str, value: object) -> str:
    """A ``- **label**: value`` line; the value is escaped."""
    return f"- **{label}**: {_inline(value)}"


def _note(message: str | None) -> list[str]:
    """A note from the data (why a section is missing) as a quote."""
    return ["", f"> {escaped_text(message)}"] if message else []


def _unless_data(section: Section, has_data: bool, missing: dict) -> list[str]:
    """The section's placeholder when it has no data, and its ``missing`` note."""
    empty = sections.placeholder(section, has_data, missing)
    return ([empty] if empty else []) + _note(sections.missing_note(missing, section))




def _layer_table(layers: Sequence[dict]) -> list[str]:
    headers = ["#", "layer", "kind", "underflow", "range", "zeros", "subnormal", "headroom (binades)",
               "amax", "amin", "observations"]
    rows = [[i, sections.layer_label(layer), layer.get("kind", ""),
             percent(layer.get("underflow_rate")) + sections.measured_mark(layer.get("underflow_measured")),
             underflow_range(layer),
             percent(layer.get("zero_rate")), percent(layer.get("subnormal_rate")),
             binades(layer.get("headroom_log2")),
             number(layer.get("amax")), number(layer.get("amin")), layer.get("observations", "—")]
            for i, layer in enumerate(layers, 1)]
    notes = [n for n in (sections.measured_legend(layers), sections.range_legend(layers)) if n]
    legend = ["\n" + "; ".join(notes).replace("*", "\\*")] if notes else []
    return table_lines(headers, rows, right=(0, 3, 4, 5, 6, 7, 8, 9, 10), code=(1, 2)) + legend


def _run_section(run: dict) -> list[str]:
    ranks = run.get("ranks")
    return [
        f"- **path**: {code_span(run.get('path', ''), in_table=False)}",
        _field("steps", f"{run.get('steps', '—')}" + (f" on {ranks} rank(s)" if ranks is not None else "")),
        _field("AMP dtype", f"{run.get('amp_dtype') or '—'} on {run.get('device') or 'unknown device'}"),
        _field("recording level", run.get("level") or "—"),
        f"- **scaler**: {code_span(sections.scaler_call(run.get('scaler') or {}), in_table=False)}",
        _field("ended cleanly", sections.ended_cleanly(run.get("ended_cleanly"))),
    ]


def _scale_section(scale: dict | None, missing: dict) -> list[str]:
    lines = []
    if scale:
        settle = scale.get("settle_step")
        lines += [
            _field("scale", f"{scale_str(scale.get('initial'))} at the start, "
                            f"{scale_str(scale.get('final'))} at the end "
                            f"(min {scale_str(scale.get('min'))}, max {scale_str(scale.get('max'))})"),
            _field("skipped steps",
                   f"{scale.get('skipped_steps', '—')} ({percent(scale.get('skipped_fraction'))})"),
            _field("settled by step", "—" if settle is None else settle),
        ]
    return lines + _unless_data(sections.SCALE, bool(scale), missing)


def _layers_section(layers: Sequence[dict], missing: dict) -> list[str]:
    lines = []
    if layers:
        shown, note = sections.layers_shown(layers)
        lines += ([note, ""] if note else []) + _layer_table(shown)
    return lines + _unless_data(sections.LAYERS, bool(layers), missing)


def _origins_section(origins: Sequence[dict], missing: dict) -> list[str]:
    lines = []
    if origins:
        rows = [[origin_name(o), o.get("kind", ""), o.get("rank", "—"), o.get("count", "—"),
                 o.get("first_step", "—"), o.get("last_step", "—")] for o in origins]
        lines += table_lines(["layer", "kind", "rank", "overflows", "first step", "last step"], rows,
                        right=(2, 3, 4, 5), code=(0, 1))
    return lines + _unless_data(sections.ORIGINS, bool(origins), missing)


def _recommendation_section(rec: dict | None, current: dict, missing: dict) -> list[str]:
    """The answer, first: the verdict, the line to paste, what it changes on this run, the settings,
    the reasons (the advice follows in a section of its own)."""
    lines = []
    if rec:
        verdict, target = rec.get("verdict"), rec.get("target_dtype")
        lines += [f"**{_inline(VERDICTS.get(verdict, verdict or 'No verdict.'))}**"
                  + (f" (target format {_inline(target)})" if target else ""), ""]
        if rec.get("code"):
            lines += _fence(rec["code"], "python") + [""]
        lines += table_lines(sections.OUTCOME_HEADERS, sections.outcome_rows(rec), right=(1, 2))
        lines += [""] + table_lines(sections.SETTINGS_HEADERS, sections.settings_rows(current, rec), right=(1, 2),
                               code=(0,))
        if rec.get("reasons"):
            lines += ["", "### Reasons", ""] + bullet_lines(rec["reasons"])
    return lines + _unless_data(sections.RECOMMENDATION, bool(rec), missing)


def report_markdown(report: dict) -> str:
    """``ampdoctor report --format md``: the recommendation and its advice first, then the evidence:
    loss scale, layers (the first 50), overflow origins, run details, warnings, and why any section
    is missing."""
    run = report.get("run") or {}
    missing = report.get("missing") or {}
    rec = report.get("recommendation")
    content = {
        sections.RECOMMENDATION: _recommendation_section(rec, run.get("scaler") or {}, missing),
        sections.ADVICE: bullet_lines((rec or {}).get("advice") or []) or [sections.ADVICE.empty],
        sections.SCALE: _scale_section(report.get("scale"), missing),
        sections.LAYERS: _layers_section(report.get("layers") or [], missing),
        sections.ORIGINS: _origins_section(report.get("overflow_origins") or [], missing),
        sections.RUN: _run_section(run),
        sections.WARNINGS: bullet_lines(report.get("warnings") or []) or [sections.WARNINGS.empty],
    }
    parts = [(section, content[section]) for section in sections.REPORT_ORDER]
    other = sections.unplaced_notes(missing)
    if other:
        parts.append((sections.NOT_AVAILABLE, [_field(_inline(k), v) for k, v in other.items()]))
    lines = ["# ampdoctor report", ""]
    if run:
        lines.append(f"{code_span(run.get('path', ''), in_table=False)}: {_inline(sections.run_summary(run))}")
    for section, body in parts:
        lines += ["", f"## {section.title}", ""] + body
    return "\n".join(lines) + "\n"


def simulate_markdown(sim: dict) -> str:
    """``ampdoctor simulate --format markdown``: the simulated scaler beside the recorded one."""
    actual = sim.get("actual")
    cols = ["simulated"] + (["recorded run"] if actual else [])
    runs = [sim] + ([actual] if actual else [])
    right = range(1, len(cols) + 1)
    lines = ["# ampdoctor simulate", "",
             escaped_text(f"{sim.get('steps', '—')} recorded steps replayed in "
                   f"{sim.get('target_dtype') or '—'}."),
             "", "## Settings", ""]
    lines += table_lines(["setting"] + cols,
                    [[k] + [setting(k, (r.get("config") or {}).get(k)) for r in runs]
                     for k in SCALER_KEYS + REPLAY_KEYS],
                    right=right, code=(0,))
    outcome = [
        ["skipped steps"] + [f"{r.get('skipped_steps', '—')} ({percent(r.get('skipped_fraction'))})"
                             for r in runs],
        ["underflow rate"] + [underflow(r) for r in runs],
    ] + [[f"{which} scale"] + [scale_str((r.get("scale") or {}).get(which)) for r in runs]
         for which in ("final", "min", "max")]
    lines += ["", "## Outcome", ""] + table_lines([" "] + cols, outcome, right=right)
    uncertain = sim.get("uncertain_steps")
    if uncertain:
        lines += ["", f"{uncertain} step(s) were too close to the overflow threshold to call either way."]
    threshold = sim.get("threshold") or {}
    if threshold.get("overflow_log2") is not None:
        lines += ["", escaped_text(f"Overflow threshold: scaled magnitudes above "
                            f"2**{threshold['overflow_log2']:.6g} "
                            f"({threshold.get('source') or 'unknown source'}).")]
    lines += ["", "## Layers", ""]
    layers = sim.get("layers") or []
    if layers:
        lines += table_lines(["layer", "kind", "underflow"],
                        [[layer.get("name", ""), layer.get("kind", ""), underflow(layer)]
                         for layer in layers], right=(2,), code=(0, 1))
    else:
        lines.append("No per-layer statistics.")
    if sim.get("notes"):
        lines += ["", "## Notes", ""] + bullet_lines(sim["notes"])
    return "\n".join(lines) + "\n"


def layers_markdown(layers: dict) -> str:
    """``ampdoctor layers --format markdown``: the per-layer table in the order it was sorted."""
    rows = layers.get("layers") or []
    lines = ["# ampdoctor layers", ""]
    if rows:
        lines += [escaped_text(f"Sorted by {layers.get('sort') or 'underflow'}."), ""] + _layer_table(rows)
    elif not layers.get("missing"):
        lines.append("No per-layer statistics.")
    if layers.get("missing"):
        lines += ["", f"> {escaped_text(layers['missing'])}"]
    if layers.get("warnings"):
        lines += ["", "## Warnings", ""] + bullet_lines(layers["warnings"])
    return "\n".join(lines) + "\n"


def postmortem_markdown(pm: dict) -> str:
    """``ampdoctor postmortem --format md``."""
    run = pm.get("run") or {}
    out = ["# ampdoctor postmortem", "", f"- **run**: {code_span(run.get('path', ''), in_table=False)}", ""]
    if pm.get("status") == "healthy":
        out += ["**healthy**: no non-finite loss, parameter or run of skipped steps.", ""]
        if pm.get("advice"):
            out += ["## Worth a look", ""] + bullet_lines(pm["advice"]) + [""]
        out += bullet_lines(pm.get("notes") or [])
        return "\n".join(out).rstrip() + "\n"
    origin = pm.get("origin") or {}
    out += [f"**Cause: {_inline(pm.get('cause'))}**", "", _field("event", pm["event"]["description"])]
    if origin.get("name"):
        out.append(f"- **origin**: {code_span(origin['name'], in_table=False)} ({_inline(origin.get('kind'))}), "
                   f"step {_inline(origin.get('step'))}, rank {_inline(origin.get('rank'))}")
    later = (pm.get("evidence") or {}).get("later_origins") or []
    if later:
        out.append("- **later origins**: " + "; ".join(
            f"{code_span(origin_name(o), in_table=False)} ({_inline(o.get('kind'))}), {_inline(origin_steps(o))}"
            for o in later))
    out.append("")
    if pm.get("advice"):  # the answer before the evidence, as in the HTML page
        out += ["## What to change", ""] + [f"{i}. {escaped_text(a)}" for i, a in enumerate(pm["advice"], 1)] + [""]
    if pm.get("timeline"):
        rows = [sections.timeline_cells(r) + [r["max_activation_module"] or "—"] for r in pm["timeline"]]
        out += ["## Steps before the event", ""]
        out += table_lines(sections.TIMELINE_HEADERS, rows, right=(0, 1, 3, 4, 5), code=(6,))
        out.append("")
    if pm.get("notes"):
        out += ["## Not determined / notes", ""] + bullet_lines(pm["notes"]) + [""]
    return "\n".join(out).rstrip() + "\n"
