"""What each command says, for library users: the command's JSON contract as a dict
(docs/json-contracts.md), the same data ``ampdoctor COMMAND RUN --format json`` prints, with every
sentence worded. The analyses themselves (``analysis.*_data``) return findings, not sentences."""

from __future__ import annotations

import os

from .render import contract
from .run import Run, read_run

RunLike = Run | str | os.PathLike


def _run(run: RunLike, run_id: str | None) -> Run:
    return run if isinstance(run, Run) else read_run(run, run_id)


def report(run: RunLike, run_id: str | None = None) -> dict:
    """``ampdoctor report``: scale history, layers, overflow origins, recommendation."""
    from .analysis.report import report_data
    return contract(report_data(_run(run, run_id)))


def postmortem(run: RunLike, run_id: str | None = None) -> dict:
    """``ampdoctor postmortem``: the first non-finite event, its cause, origin, timeline, advice."""
    from .analysis.postmortem import postmortem_data
    return contract(postmortem_data(_run(run, run_id)))
