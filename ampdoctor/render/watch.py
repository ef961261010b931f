"""What ``ampdoctor watch`` prints: one line per poll that found new steps, the end of the run,
and its waiting and timeout messages, from :class:`~ampdoctor.read.watch.Progress` (text) or its
dict (one JSON object per line)."""

from __future__ import annotations

import json
import math
import shlex

from .formatting import MISSING, number, scale_str


def progress_line(progress) -> str:
    """``step 120  scale 2**16  skipped 3  loss 0.412  anomalies 3``."""
    loss = progress.loss
    loss_text = MISSING if loss is None else (number(loss) if math.isfinite(loss) else str(loss))
    ranks = f"  ranks {progress.ranks}" if progress.ranks > 1 else ""
    step = MISSING if progress.step is None else str(progress.step)
    return (f"step {step}  scale {scale_str(progress.scale)}  skipped {progress.skipped}  loss {loss_text}  "
            f"anomalies {progress.anomalies}{ranks}")


def ended_line(progress) -> str:
    """The run has ended: what it holds and the command to read it with."""
    nonfinite = ""
    if progress.nonfinite_losses:
        nonfinite += f", non-finite loss at {progress.nonfinite_losses} step(s)"
    if progress.nonfinite_params:
        nonfinite += f", non-finite parameters at {progress.nonfinite_params} step(s)"
    verb = "Find out why with" if progress.command == "postmortem" else "Read it with"
    # A run that had ended before watch looked is an old one: a training that starts later writes
    # a new run at the path, which `watch` started then would follow.
    when = " before watch started (an earlier run)" if progress.ended_before_watch else ""
    return (f"Run {progress.run_id or '(no id)'} ended{when}: {progress.steps} step(s), {progress.skipped} skipped, "
            f"{progress.anomalies} anomalous{nonfinite}. {verb}:\n  "
            f"ampdoctor {progress.command} {shlex.quote(progress.path)}")


def following_line(progress) -> str:
    return f"Following run {progress.run_id or '(no id)'} at {progress.path}"


def waiting_line(path: str) -> str:
    return f"Waiting for a run at {path} ..."


def timeout_message(path: str, timeout: float, progress) -> str:
    """``watch`` gave up: no run appeared, or the run did not end, within ``timeout`` seconds."""
    if progress is None:
        return f"{path}: no run appeared within {timeout:g} s"
    last = "no step recorded yet" if progress.step is None else f"last step {progress.step}"
    return (f"{path}: run {progress.run_id or '(no id)'} has not ended after {timeout:g} s ({last}; "
            f"a writer is still recording, or was killed before close())")


def json_line(progress, event: str) -> str:
    """One JSON object: ``event`` (``progress`` or ``ended``) and the progress fields."""
    data = {"event": event, **progress.as_dict()}
    return json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in data.items()})
