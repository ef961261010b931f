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


def underflow(fields: dict) -> str:
    """An underflow rate from a contract's fields: the point value, or the range
    ``underflow_rate_min``..``underflow_rate_max`` (``0.002%..96.5%``) when the record cannot
    decide one."""
    if fields.get("underflow_rate") is not None or fields.get("underflow_rate_max") is None:
        return percent(fields.get("underflow_rate"))
    return f"{percent(fields.get('underflow_rate_min'))}..{percent(fields['underflow_rate_max'])}"


def underflow_range(fields: dict) -> str:
    """A layer's underflow range, ``underflow_rate_min``..``underflow_rate_max`` with one percent
    sign (``0.52..64.1%``); one number where both ends print the same; from 0 where the lower end
    is unknown (a gradient 0 everywhere: nothing says how much of it underflowed); "—" where the
    upper end is unknown too."""
    low, high = fields.get("underflow_rate_min"), fields.get("underflow_rate_max")
    if _missing(high):
        return MISSING
    low_text, high_text = percent(0.0 if _missing(low) else low), percent(high)
    if low_text == high_text:
        return high_text
    return f"{low_text.rstrip('%')}..{high_text}"


def code_spans(text: str) -> list[tuple[str, bool]]:
    """Prose from the analyses split into ``(piece, is_code)``: the analyses mark code (a setting,
    a call to paste) with single backticks, which each renderer shows its own way. An unpaired
    backtick stays literal."""
    parts = str(text).split("`")
    if len(parts) % 2 == 0:  # an odd number of backticks: the last one has no partner
        parts[-2:] = [parts[-2] + "`" + parts[-1]]
    return [(piece, i % 2 == 1) for i, piece in enumerate(parts) if piece]


def origin_name(origin: dict) -> str:
    """An overflow origin's place: the module, or for one outside the tapped modules the module
    whose output gradient it reached first (``(outside tapped modules, after head)``)."""
    name = str(origin.get("name", ""))
    after = origin.get("after")
    return f"{name[:-1]}, after {after})" if after and name.startswith("(") else name


def origin_steps(entry: dict) -> str:
    """When a counted origin (an ``overflow_origins`` entry) was seen, and where: ``step 8, rank
    0`` or ``5 steps from 8 to 12, rank 0``."""
    first, last, count = entry.get("first_step"), entry.get("last_step"), entry.get("count")
    when = f"step {first}" if first == last else f"{count} steps from {first} to {last}"
    return f"{when}, rank {entry.get('rank')}"


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


def number_or_word(x: float | str | None) -> str:
    """A value the analyses give as a number or, where no number applies, as a word
    (``"non-finite"``): the number as :func:`number`, the word as it is."""
    return x if isinstance(x, str) else number(x)


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
    "unknown": "Underflow unknown: too many zeros could be underflow or structure to tell.",
}


def shorten(name: str, width: int = 48, *, keep_head: bool = True) -> str:
    """``name`` cut to ``width`` characters with an ellipsis. Qualified names differ most in their
    tail (``layers.11.attn.out_proj.weight``): the tail keeps two thirds, and all but the ellipsis
    with ``keep_head=False`` (``…attn.out_proj.weight``, for narrow text columns)."""
    if len(name) <= width:
        return name
    if width < 4:
        return name[:width]
    tail = (width - 1) * 2 // 3 if keep_head else width - 1
    head = width - 1 - tail
    return f"{name[:head]}…{name[len(name) - tail:]}"
