"""The report's sections as the Markdown and HTML renderers both lay them out (their order and
titles, which ``missing`` note each shows, what each says without data), and the rows and cells the
renderers share: the scaler's settings, the recommendation's tables, the postmortem's timeline (the
text renderer too). Pure functions; text comes back unescaped, for each renderer to escape.

Markdown and HTML lead with the answer (:data:`REPORT_ORDER`): the recommendation, then the advice,
then the evidence. A page is read from the top; the terminal's report keeps the evidence first,
because what a terminal leaves on screen after a command is its last lines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..run_file.schema import SCALER_META
from .formatting import MISSING, number_or_word, scale_str, setting, underflow

LAYER_ROWS = 50  # layers in a report's table (the worst first); `ampdoctor layers` lists them all
SCALER_KEYS = tuple(SCALER_META)  # GradScaler's four settings, in its order
REPLAY_KEYS = ("hysteresis", "min_scale", "max_scale")  # the replay's settings beyond GradScaler's


@dataclass(frozen=True)
class Section:
    key: str  # the report's key for its data, and its key in the report's ``missing``
    title: str
    empty: str = ""  # what it says when it has no data and ``missing`` gives no reason

    @property
    def anchor(self) -> str:
        """The HTML id of the section."""
        return self.key.replace("_", "-")


RUN = Section("run", "Run details")
SCALE = Section("scale", "Loss scale", "No loss-scale data.")
LAYERS = Section("layers", "Layers", "No per-layer statistics.")
ORIGINS = Section("overflow_origins", "Overflow origins", "No overflow was recorded.")
RECOMMENDATION = Section("recommendation", "Recommendation", "No recommendation.")
ADVICE = Section("advice", "Advice", "None.")  # the recommendation's advice, shown on its own after it
WARNINGS = Section("warnings", "Warnings", "None.")
NOT_AVAILABLE = Section("not_available", "Not available")  # the ``missing`` notes no section shows

# The sections that show their own ``missing`` note.
NOTED = (SCALE, LAYERS, ORIGINS, RECOMMENDATION)
# The report's sections in Markdown and HTML: the answer, what to do, then the evidence behind it
# (NOT_AVAILABLE follows when some ``missing`` note has no section).
REPORT_ORDER = (RECOMMENDATION, ADVICE, SCALE, LAYERS, ORIGINS, RUN, WARNINGS)


def missing_note(missing: dict, section: Section) -> str | None:
    """Why ``section`` has no (or partial) data, as the analysis said; None when it did not."""
    return missing.get(section.key) or None


def placeholder(section: Section, has_data: bool, missing: dict) -> str | None:
    """What ``section`` says in place of its data: only when it has none and no ``missing`` note
    says why."""
    return None if has_data or missing.get(section.key) else section.empty


def unplaced_notes(missing: dict) -> dict:
    """The ``missing`` notes that no section shows (``postmortem``, ...), for :data:`NOT_AVAILABLE`."""
    noted = {s.key for s in NOTED}
    return {k: v for k, v in missing.items() if k not in noted}


def layers_shown(layers: Sequence[dict]) -> tuple[Sequence[dict], str | None]:
    """The first :data:`LAYER_ROWS` layers, and a sentence saying so when there are more."""
    shown = layers[:LAYER_ROWS]
    if len(layers) > len(shown):
        return shown, f"The {len(shown)} worst of {len(layers)} layers by underflow rate."
    return shown, None


def run_summary(run: dict) -> str:
    """The run in one line, for the top of a page whose run details come last:
    ``150 steps on 1 rank(s), float16 on cpu, level params``."""
    ranks = run.get("ranks")
    return (f"{run.get('steps', MISSING)} steps" + (f" on {ranks} rank(s)" if ranks is not None else "")
            + f", {run.get('amp_dtype') or MISSING} on {run.get('device') or 'unknown device'}, "
              f"level {run.get('level') or MISSING}")


def layer_label(layer: dict) -> str:
    """A layer's name as the tables and charts show it: with its module's class where the module's
    name is only an index (``mlp.2.weight (Linear)``), else the name alone."""
    name = str(layer.get("name", ""))
    module_type = layer.get("module_type")
    return f"{name} ({module_type})" if module_type else name


def scaler_call(scaler: dict) -> str:
    """The run's scaler as the call that made it: ``GradScaler(init_scale=2**16, ...)``."""
    args = ", ".join(f"{k}={setting(k, scaler.get(k))}" for k in SCALER_KEYS if k in scaler)
    return f"{scaler.get('class', 'GradScaler')}({args})"


def ended_cleanly(ended: bool | None) -> str:
    return MISSING if ended is None else "yes" if ended else "no (killed, crashed or still running)"


# --- the recommendation's tables -----------------------------------------------------------------

SETTINGS_HEADERS = ("setting", "current", "recommended")
OUTCOME_HEADERS = ("on this run", "current", "predicted")


def settings_rows(current: dict, recommendation: dict) -> list[list[str]]:
    """Each scaler setting: its name, the run's value and the recommended one."""
    return [[k, setting(k, current.get(k)), setting(k, recommendation.get(k))] for k in SCALER_KEYS]


def outcome_rows(recommendation: dict) -> list[list[str]]:
    """Skipped steps and underflow rate on this run: with the current settings and as predicted."""
    cur, pred = recommendation.get("current") or {}, recommendation.get("predicted") or {}
    return [["skipped steps", str(cur.get("skipped_steps", MISSING)), str(pred.get("skipped_steps", MISSING))],
            ["underflow rate", underflow(cur), underflow(pred)]]


# --- the postmortem's timeline -------------------------------------------------------------------

TIMELINE_HEADERS = ("step", "scale", "skipped", "loss", "grad norm", "max activation", "module")


def timeline_cells(step: dict) -> list[str]:
    """One step before the event as its cells, the last column (the module, which each renderer
    marks as code its own way) left out."""
    return [str(step["step"]), scale_str(step["scale"]), "yes" if step["skipped"] else "",
            number_or_word(step["loss"]), number_or_word(step["grad_norm"]), number_or_word(step["max_activation"])]


def measured_legend(layers: Sequence[dict]) -> str | None:
    """The legend of the layer tables' marks (:func:`measured_mark`), when a shown layer has one:
    with how far a figure got from its measurement."""
    marked = [layer for layer in layers if measured_mark(layer.get("underflow_measured"))]
    if not marked:
        return None
    far = max((layer.get("measure_distance") or 0 for layer in marked), default=0)
    distance = f", at most {far} step(s) away" if far else ""
    return (f"underflow: * measured, ~ measured on some steps and on the others estimated from the nearest "
            f"measurement{distance}, else estimated")


def range_legend(layers: Sequence[dict]) -> str | None:
    """The legend of the layer tables' range column, when a shown layer's range is wider than a
    point."""
    wide = [layer for layer in layers if layer.get("underflow_rate_max") is not None
            and abs(layer["underflow_rate_max"] - (layer.get("underflow_rate_min") or 0.0)) >= 1e-4]
    if not wide:
        return None
    return ("range: what the record allows, from zeros that may be structure or rounding noise (and, between "
            "measurements, structure that changed) to every zero that may have underflowed")


def measured_mark(share: float | None) -> str:
    """The mark after a layer's underflow rate: ``*`` all of it measured, ``~`` part of it, else
    none (estimated, or no rate)."""
    if share is None or share <= 0:
        return ""
    return "*" if share >= 0.999 else "~"
