"""One entry point per command: report data → the requested output format (a string)."""

from __future__ import annotations

import importlib
import json
import math


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


# (command, format) → (module, function); JSON is the same for every command.
_RENDERERS = {
    ("report", "text"): ("render_text", "report_text"),
    ("report", "md"): ("render_markdown", "report_markdown"),
    ("report", "html"): ("render_html", "report_html"),
    ("simulate", "text"): ("render_text", "simulate_text"),
    ("simulate", "md"): ("render_markdown", "simulate_markdown"),
    ("layers", "text"): ("render_text", "layers_text"),
    ("layers", "md"): ("render_markdown", "layers_markdown"),
    ("postmortem", "text"): ("render_text", "postmortem_text"),
    ("postmortem", "md"): ("render_markdown", "postmortem_markdown"),
    ("postmortem", "html"): ("render_html", "postmortem_html"),
}


def _render(command: str, data: dict, fmt: str, **text_options) -> str:
    """Renderers are imported on use (the HTML one pulls in matplotlib); ``text_options`` (colour,
    rows shown) go to the terminal renderer only."""
    if fmt == "json":
        return to_json(data)
    try:
        module, name = _RENDERERS[(command, fmt)]
    except KeyError:
        raise ValueError(f"{command} has no {fmt!r} output") from None
    renderer = getattr(importlib.import_module(f".{module}", __package__), name)
    return renderer(data, **text_options) if fmt == "text" else renderer(data)


def report(data: dict, fmt: str, *, color: bool = False, top: int = 15) -> str:
    return _render("report", data, fmt, color=color, top=top)


def simulate(data: dict, fmt: str) -> str:
    return _render("simulate", data, fmt)


def layers(data: dict, fmt: str) -> str:
    return _render("layers", data, fmt)


def postmortem(data: dict, fmt: str, *, color: bool = False) -> str:
    return _render("postmortem", data, fmt, color=color)
