"""How the analyses write values into the JSON contracts (``docs/json-contracts.md``): a number
the record cannot tell as None, and an underflow estimate as its three fields."""

from __future__ import annotations

import math

RANGE_TOLERANCE = 1e-4  # an underflow range narrower than this (absolute) is reported as a point


def finite_or_none(value) -> float | None:
    """A float, or None for a missing (None, a pandas NA) or non-finite value."""
    value = _recorded(value)
    return value if value is not None and math.isfinite(value) else None


def float_or_nonfinite(value) -> float | str | None:
    """A float, or ``"nan"`` / ``"inf"`` / ``"-inf"`` for a non-finite one (JSON has no NaN, and a
    timeline must say which non-finite value a loss was); None for a missing one."""
    value = _recorded(value)
    return value if value is None or math.isfinite(value) else str(value)


def _recorded(value) -> float | None:
    """``value`` as a float; None when it was not recorded (None, a pandas NA)."""
    if value is None:
        return None
    try:
        return float(value)
    except TypeError:  # pd.NA
        return None


def underflow_point(low: float, high: float) -> float | None:
    """One underflow rate for a range narrower than :data:`RANGE_TOLERANCE`, else None."""
    return finite_or_none(low) if high - low <= RANGE_TOLERANCE else None


def underflow_fields(low: float, high: float) -> dict:
    """The contracts' underflow fields: the point value (None when the record cannot decide) and
    the range it lies in."""
    return {"underflow_rate": underflow_point(low, high), "underflow_rate_min": finite_or_none(low),
            "underflow_rate_max": finite_or_none(high)}
