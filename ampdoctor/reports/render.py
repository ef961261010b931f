"""One entry point per command: report data → the requested output format (a string)."""

from __future__ import annotations

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


def report(data: dict, fmt: str, *, color: bool = False, top: int = 15) -> str:
    if fmt == "json":
        return to_json(data)
    if fmt == "md":
        from .render_markdown import report_markdown
        return report_markdown(data)
    if fmt == "html":
        from .render_html import report_html
        return report_html(data)
    from .render_text import report_text
    return report_text(data, color=color, top=top)


def simulate(data: dict, fmt: str) -> str:
    if fmt == "json":
        return to_json(data)
    if fmt == "md":
        from .render_markdown import simulate_markdown
        return simulate_markdown(data)
    from .render_text import simulate_text
    return simulate_text(data)


def layers(data: dict, fmt: str) -> str:
    if fmt == "json":
        return to_json(data)
    if fmt == "md":
        from .render_markdown import layers_markdown
        return layers_markdown(data)
    from .render_text import layers_text
    return layers_text(data)


def postmortem(data: dict, fmt: str, *, color: bool = False) -> str:
    if fmt == "json":
        return to_json(data)
    if fmt == "md":
        from .render_markdown import postmortem_markdown
        return postmortem_markdown(data)
    if fmt == "html":
        from .render_html import postmortem_html
        return postmortem_html(data)
    from .render_text import postmortem_text
    return postmortem_text(data, color=color)
