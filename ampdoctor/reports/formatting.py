"""Number and name formatting shared by the renderers (text, Markdown, HTML), so that the same value
reads the same in every output. Pure functions; missing values (None, NaN) render as an em dash."""

from __future__ import annotations

import math

MISSING = "—"


def _missing(x: float | None) -> bool:
    # math.isnan, not isinstance(x, float): numpy scalars from pandas are not all float subclasses.
    return x is None or math.isnan(x)


def percent(x: float | None) -> str:
    """A fraction as a percentage with three significant digits: ``0.123`` → ``12.3%``,
    ``1.2e-4`` → ``0.012%``, exact zero → ``0``. Tiny nonzero rates stay visibly nonzero
    (``<0.001%``) and a rate just short of 1 never rounds up to ``100%``."""
    if _missing(x):
        return MISSING
    if x == 0:
        return "0"
    pct = 100.0 * x
    if 0 < pct < 0.001:
        return "<0.001%"
    text = f"{pct:.3g}"
    if x < 1 and float(text) >= 100:
        return ">99.9%"
    return f"{text}%"


def scale_str(x: float | None) -> str:
    """A loss scale: ``2**k`` when it is an exact power of two (as scales usually are), else ``%g``."""
    if _missing(x):
        return MISSING
    if math.isinf(x) or x <= 0:
        return f"{x:g}"
    mantissa, exp = math.frexp(x)
    if mantissa == 0.5:
        return f"2**{exp - 1}"
    return f"{x:g}"


def number(x: float | None) -> str:
    """A magnitude (amax, amin, ...) in ``%.3g``."""
    if _missing(x):
        return MISSING
    return f"{x:.3g}"


def binades(x: float | None) -> str:
    """A log2 distance such as headroom, signed with one decimal: ``+3.2``, ``-1.0``."""
    if _missing(x):
        return MISSING
    return f"{x:+.1f}"


_SCALE_KEYS = frozenset({"init_scale", "min_scale", "max_scale"})


def setting(key: str, value: object) -> str:
    """One GradScaler setting by its keyword: scales as :func:`scale_str`, factors in ``%g``,
    intervals as integers."""
    if value is None or (isinstance(value, (int, float)) and _missing(value)):
        return MISSING
    if key in _SCALE_KEYS:
        return scale_str(value)
    if isinstance(value, float):
        return str(int(value)) if key.endswith("interval") and value.is_integer() else f"{value:g}"
    return str(value)


# One wording per recommendation verdict, shared so that every output says the same thing.
VERDICTS = {
    "keep": "Keep the current scaler settings.",
    "change": "Change the scaler settings.",
    "no_scale_works": "No loss scale fits these gradients in the target format.",
    "unknown": "Underflow unknown: the record cannot tell how far below fp16's range the zero gradients were.",
}


def shorten(name: str, width: int = 48) -> str:
    """``name`` cut to ``width`` characters with an ellipsis in the middle. Qualified names differ
    most in their tail (``layers.11.attn.out_proj.weight``), so the tail keeps two thirds."""
    if len(name) <= width:
        return name
    if width < 4:
        return name[:width]
    tail = (width - 1) * 2 // 3
    head = width - 1 - tail
    return f"{name[:head]}…{name[len(name) - tail:]}"
