"""Renderers: pure functions from a command's data (the analyses' JSON contracts) to text,
Markdown, HTML or JSON. One entry point per command here; the renderers themselves are in
:mod:`.text`, :mod:`.markdown` and :mod:`.html` (which imports matplotlib only when it draws)."""

from __future__ import annotations

import json
import math

from . import html, markdown, text


def to_json(data: dict) -> str:
    """The JSON contract: the data minus the chart series, non-finite floats as null."""
    return json.dumps(_clean({k: v for k, v in data.items() if k != "charts"}), indent=2)


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _pick(command: str, fmt: str, renderers: dict):
    if fmt not in renderers:
        raise ValueError(f"{command} has no {fmt!r} output")
    return renderers[fmt]


def report(data: dict, fmt: str, *, color: bool = False, top: int = 15) -> str:
    if fmt == "text":
        return text.report_text(data, color=color, top=top)
    return _pick("report", fmt, {"json": to_json, "md": markdown.report_markdown, "html": html.report_html})(data)


def simulate(data: dict, fmt: str) -> str:
    return _pick("simulate", fmt, {"json": to_json, "text": text.simulate_text, "md": markdown.simulate_markdown})(data)


def layers(data: dict, fmt: str) -> str:
    return _pick("layers", fmt, {"json": to_json, "text": text.layers_text, "md": markdown.layers_markdown})(data)


def postmortem(data: dict, fmt: str, *, color: bool = False) -> str:
    if fmt == "text":
        return text.postmortem_text(data, color=color)
    return _pick("postmortem", fmt, {"json": to_json, "md": markdown.postmortem_markdown,
                                     "html": html.postmortem_html})(data)
