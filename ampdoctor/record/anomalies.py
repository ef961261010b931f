"""Anomaly detection and the flight recorder of one recorder (training thread).

An *anomaly* is a skipped step, a non-finite loss or parameter, or the scale falling below
``scale_floor``. Each step's scalars are checked once their copy has landed (its fence has
passed: ``query()``, never a wait, except at close); a skip that torch's ``step()`` already saw
on the host is acted on at once. On an anomaly the flight recorder's steps of the
``flight_steps`` before it are written out, the next steps are escalated (:mod:`ampdoctor.record.plan`),
and the training thread waits for the writer to put the rows on disk, except inside a run of
skipped steps.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass

import torch

from .plan import StepPlan
from .records import FlightRecord, FlightStep, read_scalars
from .transfer import Fence, HostCopies
from .writer import RunWriter


@dataclass
class Seen:
    """What the checks have read so far from the steps' host scalars: the end-of-run summary of
    :mod:`ampdoctor.record.live_status`, counted without a device read of its own."""

    steps: int = 0             # steps handed to the watch (recorded, or dropped by a full queue)
    checked: int = 0           # of those, the steps whose scalars were read
    skipped: int = 0           # checked steps the scaler skipped
    anomalies: int = 0         # anomalous steps (skipped, non-finite loss or parameter, scale below the floor)
    nonfinite_losses: int = 0  # checked steps whose loss was NaN or inf
    nonfinite_params: int = 0  # checked steps whose parameter check found a NaN or inf


class AnomalyWatch:
    """Checks each step's scalars once they have landed, keeps the flight recorder, and reacts to
    an anomaly (flight record, escalation, writer sync). Training thread; never syncs the device."""

    def __init__(self, plan: StepPlan, writer: RunWriter, copies: HostCopies, *, rank: int, flight_steps: int,
                 scale_floor: float | None, start_step: int) -> None:
        self._plan, self._writer, self.copies = plan, writer, copies
        self._rank, self._flight_steps, self._scale_floor = rank, flight_steps, scale_floor
        # Entries leave the flight recorder once their step and the F-1 steps after it are checked
        # (fused optimizers do not sync in step(), so checks can lag); the cap bounds a lag that
        # never ends (a disabled scaler that never syncs).
        self.flight: collections.deque[FlightStep] = collections.deque(maxlen=4 * flight_steps + 64)
        self.pending: collections.deque = collections.deque()  # (step, host scalars, fence)
        self.checked_until = start_step   # steps below this have been checked
        self.last_scalars: torch.Tensor | None = None  # host scalars of the last checked step
        self.handled = start_step - 1      # the last anomalous step whose window was written
        self.closing = False               # the recorder is closing: no waits for the writer
        self._last_checked_anomaly = -2    # a run of anomalous steps waits for the writer once
        self._below_floor = False
        self.seen = Seen()

    def step_done(self, step: int, scalars: torch.Tensor | None, fence: Fence | None, flight_step: FlightStep | None,
                  *, skipped_on_host: bool) -> None:
        """``step``'s record is queued: keep its module peaks (``flight_step``, when its module taps
        were light) in the flight recorder and its scalars for the check; act on a skip seen on the
        host; then check the steps whose copies have landed. No sync."""
        self.seen.steps += 1
        if flight_step is not None:
            flight_step.scalars, flight_step.event = scalars, fence
            self.flight.append(flight_step)
        if skipped_on_host:
            self.on_anomaly(step, step, seen_on_host=True)
        self.pending.append((step, scalars, fence))
        self.check(step, wait=False)

    def check(self, current_step: int, *, wait: bool, deadline: float | None = None) -> None:
        """Read the scalars of finished steps (those whose fence has passed; all of them when
        ``wait``, a host-side wait, until ``deadline`` if given) and react to the first anomaly
        of a run of them."""
        while self.pending:
            step, scalars, fence = self.pending[0]
            if fence is not None:
                if wait and deadline is None:
                    fence.synchronize()
                elif wait:
                    while not fence.query():
                        if time.monotonic() > deadline:
                            return
                        time.sleep(0.01)
                elif not fence.query():
                    break
            self.pending.popleft()
            self.checked_until = step + 1
            if scalars is not None:
                self.last_scalars = scalars
            values = read_scalars(scalars)
            below = self._scale_floor is not None and scalars is not None and values.scale < self._scale_floor
            bad_loss = values.loss is not None and not math.isfinite(values.loss)
            bad_params = values.param_peak is not None and not math.isfinite(values.param_peak)
            fatal = bad_loss or bad_params
            self._count(values.skipped, bad_loss, bad_params)
            if values.skipped or fatal or (below and not self._below_floor):
                self.on_anomaly(step, current_step, fatal=fatal)
            self._below_floor = below
        # A checked step can still be in the window of an anomaly up to flight_steps - 1 later.
        horizon = self.checked_until - self._flight_steps
        while self.flight and self.flight[0].step < horizon:
            self.flight.popleft()

    def _count(self, skipped: bool, bad_loss: bool, bad_params: bool) -> None:
        seen = self.seen
        seen.checked += 1
        seen.skipped += skipped
        seen.nonfinite_losses += bad_loss
        seen.nonfinite_params += bad_params

    def on_anomaly(self, step: int, current_step: int, *, fatal: bool = False, seen_on_host: bool = False) -> None:
        """Write out the flight recorder's steps up to ``step`` and escalate the steps after
        ``current_step``, once per anomalous step. ``seen_on_host``: a skip known at ``step()``
        already (torch read found_inf), before its copies have landed; the later check of its
        scalars comes back here for the rest."""
        if step > self.handled:
            self.handled = step
            self.seen.anomalies += 1
            window = [e for e in self.flight if step - self._flight_steps < e.step <= step]
            later = [e for e in self.flight if e.step > step]  # seen already, checked later
            self.flight.clear()
            self.flight.extend(later)
            if window:
                for e in window:
                    e.peaks = self.copies.to_host(e.peaks)
                self._writer.put(FlightRecord(self._rank, window, self.copies.seal()))
            self._plan.escalate(current_step)
        if seen_on_host:
            return  # waiting for the writer now would wait for this step's copies: a sync
        # The anomaly's rows go to disk now, before the process can die of it (the step's own
        # record is queued already; its materialization closes a segment at once). A run of
        # skipped steps waits only at its first: a collapsing run must not also crawl; a non-finite
        # loss or parameter, which training may not survive, always waits.
        if (fatal or step != self._last_checked_anomaly + 1) and not self.closing:
            self._writer.sync()
        self._last_checked_anomaly = step

    def rewind(self, step: int) -> None:
        """The numbering goes on at ``step``: the abandoned steps' flight entries and checks go."""
        self.handled = min(self.handled, step - 1)
        self.flight.clear()
        self.seen.steps -= len(self.pending)  # never checked, and not part of the run any more
        self.pending.clear()
        self.last_scalars = None
