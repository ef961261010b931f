"""Live status of a recording: log lines on the ``ampdoctor`` logger (:data:`logger`), from the
recording ranks only (a rank that does not record has no recorder).

* INFO when the first step has been handed to the writer: where the run is written, at which
  level, under which run id (known by then: ``load_state_dict`` of a resumed run may change it
  after the scaler is made).
* INFO when the recording ends (``close()``, the interpreter's exit, ``unwrap()``): steps
  recorded, skipped steps, anomalies, steps dropped by a full writer queue, and the command to
  read the run: ``ampdoctor report PATH``, or ``ampdoctor postmortem PATH`` when a non-finite loss
  or parameter was seen.

The counts are what :class:`~ampdoctor.record.anomalies.AnomalyWatch` read from the steps' host scalars
for its own checks (:class:`~ampdoctor.record.anomalies.Seen`): no device read, no sync of their own. A
logging failure (a handler or filter that raises) is swallowed: it must never reach training.

Python shows INFO lines once logging is configured to (``logging.basicConfig(level=logging.INFO)``,
or a handler on ``logging.getLogger("ampdoctor")``); by default it shows only warnings.
"""

from __future__ import annotations

import logging
import shlex

from .anomalies import Seen

logger = logging.getLogger("ampdoctor")


class LiveStatus:
    """The start and end lines of one recorder's run; each is logged at most once."""

    def __init__(self, path: str, level: str, rank: int, world_size: int) -> None:
        self.path, self.level = path, level
        self.where = f" (rank {rank} of {world_size})" if world_size > 1 else ""
        self.announced = False
        self.ended = False

    def started(self, run_id: str) -> None:
        """The first step is recorded: say where the run goes."""
        if self.announced:
            return
        self.announced = True
        _log("ampdoctor recording run %s%s at level %r to %s", run_id, self.where, self.level, self.path)

    def finished(self, run_id: str, seen: Seen, dropped: int) -> None:
        """The recording ended: what it recorded and how to read it."""
        if self.ended:
            return
        self.ended = True
        fatal = seen.nonfinite_losses or seen.nonfinite_params
        command = f"ampdoctor {'postmortem' if fatal else 'report'} {shlex.quote(self.path)}"
        nonfinite = ""
        if seen.nonfinite_losses:
            nonfinite += f", non-finite loss at {seen.nonfinite_losses} step(s)"
        if seen.nonfinite_params:
            nonfinite += f", non-finite parameters at {seen.nonfinite_params} check(s)"
        unchecked = seen.steps - seen.checked
        checked = f" ({unchecked} step(s) not checked before the end)" if unchecked > 0 else ""
        _log("ampdoctor run %s%s ended: %d step(s) recorded, %d skipped, %d anomalous%s, %d dropped%s; "
             "%s with: %s", run_id, self.where, max(seen.steps - dropped, 0), seen.skipped, seen.anomalies,
             nonfinite, dropped, checked, "find out why" if fatal else "read it", command)


def _log(message: str, *args: object) -> None:
    try:
        logger.info(message, *args)
    except Exception:  # noqa: BLE001 - a broken handler or filter must not stop training
        pass
