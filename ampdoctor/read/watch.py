"""Following a run while another process writes it (``ampdoctor watch``): the data side.

A :class:`RunFollower` polls the run directory. Each poll lists it, reads the footers of the
files new or changed since the last poll (:func:`read_run`'s ``footers``; no data) and then only
the step and parameter-check rows of the segments it has not seen; a
segment is whole once visible (the writer renames it into place), so nothing is read half
written. The first run found is followed by its run id from then on, so that a second run
started at the same path is not mixed in. The run has *ended* when every writer seen has written
its final segment (:attr:`Run.ended_cleanly`); a writer that has not closed its first segment
yet cannot be seen.

Memory: the distinct steps seen (a set of ints), the anomalous ones and the footers read (a few
hundred bytes a segment). No torch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow.compute as pc

from ..errors import RunError
from ..run_file.names import is_segment_name
from .run import Run, read_run
from ..run_file.schema import META_RUN_ID

_COLUMNS = ["step", "rank", "kind", "name", "scale", "skipped", "loss", "amax"]


class TimedOut(Exception):
    """:func:`follow` gave up: no run appeared (``last`` None), or the run did not end, in time."""

    def __init__(self, last: "Progress | None") -> None:
        super().__init__("the run did not end in time")
        self.last = last


@dataclass
class Progress:
    """What a run shows so far: the ``ampdoctor watch`` JSON line (docs/json-contracts.md)."""

    path: str
    run_id: str
    step: int | None            # the latest step recorded (None: no step row yet)
    steps: int                  # distinct steps recorded
    new_steps: int              # of those, first seen in this poll
    scale: float | None         # the latest step's loss scale
    skipped: int                # steps skipped on any rank
    loss: float | None          # the latest step's loss (mean over ranks; NaN: non-finite; None: not recorded)
    nonfinite_losses: int       # steps whose loss was NaN or inf
    nonfinite_params: int       # steps whose parameter check found a NaN or inf
    anomalies: int              # steps with any of those three
    ranks: int
    ended: bool                 # every writer has written its final segment
    ended_before_watch: bool = False  # it had already ended at the first look: an old run, not a live one
    warnings: list[str] = field(default_factory=list)  # the reader's, new in this poll

    @property
    def command(self) -> str:
        """What reads the run next: ``postmortem`` once a loss or parameter went non-finite."""
        return "postmortem" if self.nonfinite_losses or self.nonfinite_params else "report"

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["command"] = self.command
        return out


class RunFollower:
    """Polls the run at ``path`` (``run_id``: which run of the directory; default the latest)."""

    def __init__(self, path: str | os.PathLike, run_id: str | None = None) -> None:
        self.path = Path(path)
        self.run_id = run_id
        self._segments: set[Path] = set()
        self._steps: set[int] = set()
        self._skipped: set[int] = set()
        self._bad_loss: set[int] = set()
        self._bad_params: set[int] = set()
        self._ranks: set[int] = set()
        self._latest: tuple[int, float, float | None] | None = None  # (step, scale, loss)
        self._warned: set[str] = set()
        self._footers: dict = {}  # the segments' footers read so far (read_run's ``footers``)
        self.found = False   # a run has been read at least once
        self.ended = False

    def poll(self) -> Progress | None:
        """Read what is new. None while there is no run at the path yet (nothing there, or no
        finished segment); a :class:`Progress` otherwise (``new_steps`` 0 when nothing changed).
        Raises :class:`RunError` when the path holds something that is not a run."""
        if not self._visible():
            return None
        try:
            run = read_run(self.path, self.run_id, footers=self._footers)
        except RunError:
            if self._visible():  # still there: not a run (another tool's Parquet, a newer schema)
                raise
            return None  # removed between the look and the read (a demo replacing its run)
        first_look = not self.found
        if first_look:
            self.found = True
            self.run_id = run.metadata.get(META_RUN_ID, "") or None
        fresh = [s for s in run.segments if s.path not in self._segments]
        before = len(self._steps)
        if fresh:
            self._take(Run(run.path, fresh).table(_COLUMNS, kinds=["step", "param"]))
            self._segments.update(s.path for s in fresh)
        self.ended = run.ended_cleanly
        warnings = [w for w in run.warnings if w not in self._warned]
        self._warned.update(warnings)
        step, scale, loss = self._latest if self._latest is not None else (None, None, None)
        return Progress(path=str(self.path), run_id=self.run_id or "", step=step, steps=len(self._steps),
                        new_steps=len(self._steps) - before, scale=scale, skipped=len(self._skipped),
                        loss=loss, nonfinite_losses=len(self._bad_loss), nonfinite_params=len(self._bad_params),
                        anomalies=len(self._skipped | self._bad_loss | self._bad_params), ranks=len(self._ranks),
                        ended=self.ended, ended_before_watch=first_look and self.ended, warnings=warnings)

    def _visible(self) -> bool:
        """Whether the path shows a finished segment (or is a file): else it is not a run yet."""
        try:
            if self.path.is_file():
                return True
            return self.path.is_dir() and any(is_segment_name(p.name) for p in self.path.iterdir())
        except OSError:
            return False

    def _take(self, table) -> None:
        if not table.num_rows:
            return
        kind = table.column("kind").cast("string").to_numpy(zero_copy_only=False)
        step = table.column("step").to_numpy()
        rank = table.column("rank").to_numpy()
        self._ranks.update(int(r) for r in np.unique(rank))
        params = (kind == "param") & (table.column("name").cast("string").to_numpy(zero_copy_only=False) == "")
        amax = table.column("amax").to_numpy(zero_copy_only=False).astype(np.float64)
        self._bad_params.update(int(s) for s in step[params & ~np.isfinite(amax)])
        rows = kind == "step"
        if not rows.any():
            return
        step, rank = step[rows], rank[rows]
        scale = table.column("scale").to_numpy(zero_copy_only=False)[rows].astype(np.float64)
        skipped = table.column("skipped").to_numpy(zero_copy_only=False)[rows].astype(bool)
        recorded = pc.is_valid(table.column("loss")).to_numpy(zero_copy_only=False)[rows]
        loss = table.column("loss").to_numpy(zero_copy_only=False)[rows].astype(np.float64)
        self._steps.update(int(s) for s in np.unique(step))
        self._skipped.update(int(s) for s in np.unique(step[skipped]))
        self._bad_loss.update(int(s) for s in np.unique(step[recorded & ~np.isfinite(loss)]))
        last = int(step.max())
        if self._latest is None or last >= self._latest[0]:
            at = step == last
            losses = loss[at & recorded]
            mean = float(losses.mean()) if len(losses) else None
            self._latest = (last, float(scale[at][np.argmin(rank[at])]), mean)


def follow(path: str | os.PathLike, run_id: str | None = None, *, interval: float = 2.0,
           timeout: float | None = None) -> Iterator["Progress | None"]:
    """Poll the run at ``path`` every ``interval`` seconds until it ends: yields None while there
    is no run yet, then a :class:`Progress` per poll (the last one ``ended``). Raises
    :class:`TimedOut` after ``timeout`` seconds (None: no limit), :class:`RunError` for a path
    that holds something other than a run."""
    follower = RunFollower(path, run_id)
    deadline = None if timeout is None else time.monotonic() + timeout
    last = None
    while True:
        progress = follower.poll()
        last = progress or last
        yield progress
        if progress is not None and progress.ended:
            return
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimedOut(last)
        time.sleep(interval if left is None else min(interval, left))
