"""Renderers: pure functions from a command's data (the analyses' JSON contracts, whose sentences
are findings) to text, Markdown, HTML or JSON. One entry point per command here: each words the
findings first (:mod:`.wording`), so the renderers themselves (:mod:`.text`, :mod:`.markdown`,
:mod:`.html`, which imports matplotlib only when it draws) receive strings."""

from __future__ import annotations

import json
import math

from . import html, markdown, text
from .wording import worded

CHARTS = "charts"  # the report's series for the HTML charts: no findings in them, and not in the JSON


def contract(data: dict) -> dict:
    """A command's JSON contract: its findings worded, without the chart series, every non-finite
    float as None."""
    return _finite({k: worded(v) for k, v in data.items() if k != CHARTS})


def to_json(data: dict) -> str:
    """The JSON contract as text."""
    return json.dumps(contract(data), indent=2)


def _with_sentences(data: dict) -> dict:
    """What the text, Markdown and HTML renderers receive: the data with its findings worded."""
    return {k: v if k == CHARTS else worded(v) for k, v in data.items()}


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _pick(command: str, fmt: str, renderers: dict):
    if fmt not in renderers:
        raise ValueError(f"{command} has no {fmt!r} output")
    return renderers[fmt]


def report(data: dict, fmt: str, *, color: bool = False, top: int = 15) -> str:
    data = _with_sentences(data)
    if fmt == "text":
        return text.report_text(data, color=color, top=top)
    return _pick("report", fmt, {"json": to_json, "md": markdown.report_markdown, "html": html.report_html})(data)


def simulate(data: dict, fmt: str) -> str:
    return _pick("simulate", fmt, {"json": to_json, "text": text.simulate_text,
                                   "md": markdown.simulate_markdown})(_with_sentences(data))


def layers(data: dict, fmt: str) -> str:
    return _pick("layers", fmt, {"json": to_json, "text": text.layers_text,
                                 "md": markdown.layers_markdown})(_with_sentences(data))


def comparison(data: dict, fmt: str, *, color: bool = False, top: int = 15) -> str:
    """``ampdoctor compare`` (named apart from the command: ``render.compare`` is its renderers'
    module, which importing it would bind in this package's namespace in place of the function)."""
    from . import compare

    data = _with_sentences(data)
    if fmt == "text":
        return compare.compare_text(data, color=color, top=top)
    return _pick("compare", fmt, {"json": to_json, "md": compare.compare_markdown, "html": compare.compare_html})(data)


def postmortem(data: dict, fmt: str, *, color: bool = False) -> str:
    data = _with_sentences(data)
    if fmt == "text":
        return text.postmortem_text(data, color=color)
    return _pick("postmortem", fmt, {"json": to_json, "md": markdown.postmortem_markdown,
                                     "html": html.postmortem_html})(data)
