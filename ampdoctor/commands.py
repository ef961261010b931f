"""The commands: each analysis paired with its renderer, once (:data:`COMMANDS`), for the CLI
and for library users and notebooks.

``ampdoctor.report(path)``, ``ampdoctor.postmortem(path)``, ``ampdoctor.compare(a, b)``,
``ampdoctor.simulate(path, ...)``, ``ampdoctor.layers(path, ...)`` and ``ampdoctor.fp8(path, ...)``
return the command's JSON contract (docs/json-contracts.md) as a dict, the same data
``ampdoctor COMMAND ... --format json`` prints with every sentence worded, that Jupyter shows as
the command's HTML page. The analyses themselves (``analysis.*_data``) take a read
:class:`~ampdoctor.read.run.Run` and return findings, not sentences; the path is read here (or by
the CLI), the one place besides ``read_run`` that turns a path into a run. This module imports
neither torch nor pandas: each analysis and renderer loads on first use."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from html import escape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .read.run import Run

    RunLike = Run | str | os.PathLike

NOTEBOOK_HEIGHT = 640  # pixels of the notebook frame that shows the page (it scrolls inside)


class CommandResult(dict):
    """A command's JSON contract as a dict (indexing it works as on a plain dict), that renders
    itself: :meth:`html` is the page ``--format html`` writes, shown by Jupyter
    (:meth:`_repr_html_`); :meth:`text` and :meth:`markdown` the other formats; :meth:`to_dict`
    and :meth:`json` the contract exactly as ``--format json`` writes it. The charts are drawn (and
    matplotlib imported) only when the page is asked for."""

    def __init__(self, data: dict, renderer: Callable[..., str]) -> None:
        from .render import contract
        super().__init__(contract(data))
        self._data = data  # with its findings and chart series: what the renderers take
        self._renderer = renderer

    def render(self, fmt: str = "text", **options) -> str:
        """The command's output in ``fmt`` (``text``, ``md``, ``json`` or ``html``), as the CLI
        writes it; ``options`` as the command's (``top=``, ``color=``)."""
        return self._renderer(self._data, fmt, **options)

    def text(self, **options) -> str:
        return self.render("text", **options)

    def markdown(self) -> str:
        return self.render("md")

    def html(self) -> str:
        """The self-contained HTML page of ``--format html``."""
        return self.render("html")

    def json(self) -> str:
        """The JSON text of ``--format json``."""
        return self.render("json")

    def to_dict(self) -> dict:
        """A plain dict of the contract, equal to ``json.loads`` of ``--format json``."""
        return json.loads(self.json())

    def _repr_html_(self) -> str:
        try:
            page = self.html()
        except ValueError:  # simulate and layers have no page: their text, as the terminal shows it
            return f"<pre>{escape(self.text())}</pre>"
        # The page in an iframe of its own: its stylesheet styles <body>, <table>, <h2>..., which
        # would restyle the whole notebook if the page were inlined into it.
        return (f'<iframe srcdoc="{escape(page, quote=True)}" style="width:100%;'
                f'height:{NOTEBOOK_HEIGHT}px;border:1px solid #ddd" sandbox="allow-same-origin" '
                f'title="ampdoctor"></iframe>')

    def __reduce__(self):
        # A copy or a pickle is the plain contract: the renderers' data holds findings and series.
        return dict, (dict(self),)


class Report(CommandResult):
    """``ampdoctor.report(path)``."""


class Postmortem(CommandResult):
    """``ampdoctor.postmortem(path)``."""


class Comparison(CommandResult):
    """``ampdoctor.compare(a, b)``."""


class Simulation(CommandResult):
    """``ampdoctor.simulate(path, init_scale=...)``."""


class Layers(CommandResult):
    """``ampdoctor.layers(path)``."""


class Fp8Readiness(CommandResult):
    """``ampdoctor.fp8(path)``."""


@dataclass(frozen=True)
class Command:
    """One command: its analysis (``module:function`` in :mod:`ampdoctor.analysis`, taking the
    read run(s) and the command's options, returning findings), its renderer (in
    :mod:`ampdoctor.render`, taking that data, a format and display options: ``color=``,
    ``top=``) and the class of its notebook result. Both load on first use."""

    analysis: str
    renderer: str
    result: type[CommandResult]

    def analyse(self, *runs: "Run", **options) -> dict:
        """The command's data for read runs. Raises ``ValueError`` for options it cannot use."""
        return self.analysis_function()(*runs, **options)

    def analysis_function(self) -> Callable[..., dict]:
        """The analysis itself, imported now (a dependency that fails to import fails here)."""
        return _load(self.analysis)

    def render(self, data: dict, fmt: str, **options) -> str:
        """The command's output in ``fmt`` (``text``, ``md``, ``json``, ``html``)."""
        return _load(self.renderer)(data, fmt, **options)

    def __call__(self, *runs: "Run", **options) -> CommandResult:
        return self.result(self.analyse(*runs, **options), self.render)


COMMANDS: dict[str, Command] = {
    "report": Command("analysis.report:report_data", "render:report", Report),
    "postmortem": Command("analysis.postmortem:postmortem_data", "render:postmortem", Postmortem),
    "compare": Command("analysis.compare:compare_data", "render:comparison", Comparison),
    "simulate": Command("analysis.simulate:simulate_data", "render:simulate", Simulation),
    "layers": Command("analysis.layers:layers_data", "render:layers", Layers),
    "fp8": Command("analysis.fp8:fp8_data", "render.fp8:render_fp8", Fp8Readiness),
}


def _load(reference: str) -> Callable:
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(f".{module}", __package__), name)


def _run(run: RunLike, run_id: str | None) -> "Run":
    from .read.run import Run, read_run
    if isinstance(run, Run):
        if run_id is not None:
            raise ValueError("run_id picks a run of a path; this Run is already one run: pass its path instead")
        return run
    return read_run(run, run_id)


def report(run: RunLike, run_id: str | None = None) -> Report:
    """``ampdoctor report``: scale history, layers, overflow origins, recommendation."""
    return COMMANDS["report"](_run(run, run_id))


def postmortem(run: RunLike, run_id: str | None = None) -> Postmortem:
    """``ampdoctor postmortem``: the first non-finite event, its cause, origin, timeline, advice."""
    return COMMANDS["postmortem"](_run(run, run_id))


def compare(run_a: RunLike, run_b: RunLike, run_id_a: str | None = None, run_id_b: str | None = None) -> Comparison:
    """``ampdoctor compare``: two runs side by side, and whether run A's recommendation, applied in
    run B, did what its replay predicted."""
    return COMMANDS["compare"](_run(run_a, run_id_a), _run(run_b, run_id_b))


def simulate(run: RunLike, run_id: str | None = None, **settings) -> Simulation:
    """``ampdoctor simulate``: the run's recorded gradients replayed under other GradScaler
    settings (``init_scale=``, ``growth_factor=``, ``backoff_factor=``, ``growth_interval=``,
    ``hysteresis=``, ``min_scale=``, ``max_scale=``; the run's own where not given)."""
    return COMMANDS["simulate"](_run(run, run_id), **settings)


def layers(run: RunLike, run_id: str | None = None, sort: str = "underflow", top: int | None = None) -> Layers:
    """``ampdoctor layers``: the per-layer table, sorted by ``underflow``, ``headroom`` or ``amax``."""
    return COMMANDS["layers"](_run(run, run_id), sort=sort, top=top)


def fp8(run: RunLike, run_id: str | None = None, flush_limit: float = 0.01) -> Fp8Readiness:
    """``ampdoctor fp8``: FP8 readiness per GEMM layer (ready, keep, unknown) under current and
    delayed scaling, the layers to keep and torchao's filter for them, the shortest amax history.
    ``flush_limit``: the share of an operand's nonzero elements a layer may flush (0 < x < 1)."""
    return COMMANDS["fp8"](_run(run, run_id), flush_limit=flush_limit)
