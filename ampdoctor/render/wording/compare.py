"""The sentences of ``compare``."""

from __future__ import annotations

from ..formatting import percent, setting
from . import register, register_fixed, word
from .phrases import underflow_phrase

# -- compare (analysis/compare.py) -------------------------------------------------------------------

def _run_warning(warning) -> str:
    return warning if isinstance(warning, str) else word(warning)


@register
def warning_of_run(run, warning):
    return f"run {run}: {_run_warning(warning)}"


@register
def compare_different_formats(a, b):
    return (f"the runs trained in different formats (run A {a}, run B {b}): their underflow and headroom are "
            f"not comparable, and run A's prediction is not checked")


@register
def compare_skipped(a, b, steps_a, steps_b):
    change = "as many" if a == b else f"{abs(b - a)} {'fewer' if b < a else 'more'}"
    return f"skipped steps: {a} of {steps_a} in run A, {b} of {steps_b} in run B ({change})"


@register
def compare_underflow(a, b):
    return f"gradient underflow: {underflow_phrase(a)} in run A, {underflow_phrase(b)} in run B"


@register
def compare_not_float16(dtype):
    return (f"both runs trained in {dtype}, which needs no loss scaling: run A's prediction (for float16 "
            f"loss scaling) is not checked")


@register
def compare_steps_differ(a, b):
    return (f"the runs trained for different numbers of steps ({a} and {b}): skipped steps do not scale with "
            f"the length (the start-up backoff skips a fixed few), so the prediction is not checked; train run B "
            f"for as many steps")


register_fixed("compare_no_recommendation",
       "run A's report has no recommendation (fewer than 2 steps): there is no prediction to check")


@register
def compare_settings_differ(differences):
    listed = "; ".join(f"{d['setting']} recommended {setting(d['setting'], d['recommended'])}, recorded "
                       f"{setting(d['setting'], d['recorded'])}" for d in differences)
    return (f"run B's GradScaler settings are not the ones run A's report recommended ({listed}): no verdict "
            f"on the prediction")


def _skipped_check(check: dict, missed: bool) -> str:
    predicted, uncertain = check["predicted"], check["uncertain"]
    text = f"predicted {predicted} skipped" + (f" (and {uncertain} uncertain)" if uncertain else "")
    text += f", got {check['got']}"
    return text + (f" (more than {check['tolerance']:g} off)" if missed and not check["held"] else "")


def _underflow_check(check: dict, missed: bool) -> str:
    if check["held"] is None:
        return "underflow not checked (a range is unknown)"
    text = f"predicted {underflow_phrase(check['predicted'])}, got {underflow_phrase(check['got'])}"
    return text + (f" ({percent(check['gap'])} apart)" if missed and not check["held"] else "")


@register
def prediction_held(skipped, underflow):
    return f"the prediction held: {_skipped_check(skipped, False)}; {_underflow_check(underflow, False)}"


@register
def prediction_missed(skipped, underflow):
    return f"the prediction did not hold: {_skipped_check(skipped, True)}; {_underflow_check(underflow, True)}"
