"""Phrases that several commands' sentences share."""

from __future__ import annotations

from ..formatting import percent, scale_str


def underflow_phrase(fields: dict) -> str:
    """``no underflow``, ``0.5% underflow`` or ``between 0.001% and 96% underflow``."""
    if fields["underflow_rate"] is None:
        return (f"between {percent(fields['underflow_rate_min'])} and {percent(fields['underflow_rate_max'])} "
                f"underflow")
    rate = fields["underflow_rate"]
    return "no underflow" if rate == 0 else f"{percent(rate)} underflow"


def settings_phrase(settings: dict) -> str:
    """``init_scale=2**12, growth_interval=500``: GradScaler keywords as they are pasted."""
    return ", ".join(f"{name}={scale_str(value)}" if name == "init_scale" else f"{name}={value!r}"
                     for name, value in settings.items())


def to_record_modules(recorded_full: bool) -> str:
    """How to get module rows at a step that has none, given how the run was recorded."""
    if recorded_full:
        return ("keep the flight recorder on (flight_steps > 0, the default) or tap modules on every step "
                "(module_every=1)")
    return "record with level='full'"


def parameter_phrase(name: str | None) -> str:
    return f"`{name}`" if name else "the parameters"
