"""What each command says, for library users and notebooks: ``ampdoctor.report(path)``,
``ampdoctor.postmortem(path)``, ``ampdoctor.compare(a, b)``, ``ampdoctor.simulate(path, ...)``,
``ampdoctor.layers(path, ...)`` and ``ampdoctor.fp8(path, ...)`` return the command's JSON contract
(docs/json-contracts.md) as a dict, the same data ``ampdoctor COMMAND ... --format json`` prints
with every sentence worded, that Jupyter shows as the command's HTML page. The analyses
themselves (``analysis.*_data``) return findings, not sentences."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from html import escape

from . import render
from .read.run import Run, read_run

RunLike = Run | str | os.PathLike
NOTEBOOK_HEIGHT = 640  # pixels of the notebook frame that shows the page (it scrolls inside)


class CommandResult(dict):
    """A command's JSON contract as a dict (indexing it works as on a plain dict), that renders
    itself: :meth:`html` is the page ``--format html`` writes, shown by Jupyter
    (:meth:`_repr_html_`); :meth:`text` and :meth:`markdown` the other formats; :meth:`to_dict`
    and :meth:`json` the contract exactly as ``--format json`` writes it. The charts are drawn (and
    matplotlib imported) only when the page is asked for."""

    def __init__(self, data: dict, renderer: Callable[..., str]) -> None:
        super().__init__(render.contract(data))
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


def _run(run: RunLike, run_id: str | None) -> Run:
    if isinstance(run, Run):
        if run_id is not None:
            raise ValueError("run_id picks a run of a path; this Run is already one run: pass its path instead")
        return run
    return read_run(run, run_id)


def report(run: RunLike, run_id: str | None = None) -> Report:
    """``ampdoctor report``: scale history, layers, overflow origins, recommendation."""
    from .analysis.report import report_data
    return Report(report_data(_run(run, run_id)), render.report)


def postmortem(run: RunLike, run_id: str | None = None) -> Postmortem:
    """``ampdoctor postmortem``: the first non-finite event, its cause, origin, timeline, advice."""
    from .analysis.postmortem import postmortem_data
    return Postmortem(postmortem_data(_run(run, run_id)), render.postmortem)


def compare(run_a: RunLike, run_b: RunLike, run_id_a: str | None = None, run_id_b: str | None = None) -> Comparison:
    """``ampdoctor compare``: two runs side by side, and whether run A's recommendation, applied in
    run B, did what its replay predicted."""
    from .analysis.compare import compare_data
    return Comparison(compare_data(_run(run_a, run_id_a), _run(run_b, run_id_b)), render.comparison)


def simulate(run: RunLike, run_id: str | None = None, **settings) -> Simulation:
    """``ampdoctor simulate``: the run's recorded gradients replayed under other GradScaler
    settings (``init_scale=``, ``growth_factor=``, ``backoff_factor=``, ``growth_interval=``,
    ``hysteresis=``, ``min_scale=``, ``max_scale=``; the run's own where not given)."""
    from .analysis.simulate import simulate_data
    return Simulation(simulate_data(_run(run, run_id), **settings), render.simulate)


def layers(run: RunLike, run_id: str | None = None, sort: str = "underflow", top: int | None = None) -> Layers:
    """``ampdoctor layers``: the per-layer table, sorted by ``underflow``, ``headroom`` or ``amax``."""
    from .analysis.layers import layers_data
    return Layers(layers_data(_run(run, run_id), sort=sort, top=top), render.layers)


def fp8(run: RunLike, run_id: str | None = None, flush_limit: float = 0.01) -> Fp8Readiness:
    """``ampdoctor fp8``: FP8 readiness per GEMM layer (ready, keep, unknown) under current and
    delayed scaling, the layers to keep and torchao's filter for them, the shortest amax history.
    ``flush_limit``: the share of an operand's nonzero elements a layer may flush (0 < x < 1)."""
    from .analysis.fp8 import fp8_data
    from .render.fp8 import render_fp8
    return Fp8Readiness(fp8_data(_run(run, run_id), flush_limit=flush_limit), render_fp8)
