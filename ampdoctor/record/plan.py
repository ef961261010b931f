"""What each step records: integer logic over step numbers, no tensors.

A step is *sampled* every ``every`` steps (full statistics of the gradients: counts and
histograms), *module-sampled* every ``module_every`` (full statistics of the module taps, at
``level="full"``) and *measured* every ``measure_every`` (its underflow measured by a float32
shadow of its backward, with full statistics of the gradients); after an anomaly the next
``escalate_steps`` steps are *escalated*: full
statistics of the gradients, a row per parameter and full module taps, whatever the level. Other
steps are *light*: light statistics of the gradients and, at ``level="full"`` with a flight
recorder, light module taps (each tensor's min and max), kept for the flight recorder.
"""

from __future__ import annotations

from typing import Literal

from .options import RecordOptions

Statistics = Literal["full", "light"]


class StepPlan:
    def __init__(self, options: RecordOptions, start_step: int) -> None:
        self.level = options.level
        self.every = options.gradient_interval
        self.module_every = options.module_interval
        self.measure_every = options.measure_interval
        self.flight_steps = options.flight_steps
        self.escalate_steps = options.escalate_steps
        self.escalate_until = start_step  # steps below this are escalated
        # Light module taps on the steps between samples: for the flight recorder, and for the GEMM
        # operands' peaks (the recorder sets it when it records them: gemm_operands.py).
        self.light_taps = bool(options.flight_steps)

    def escalated(self, step: int) -> bool:
        return step < self.escalate_until

    def gradient_stats(self, step: int) -> Statistics:
        """What ``step``'s gradients get: ``"full"`` on sampled, measured and escalated steps, else
        ``"light"``."""
        return "full" if step % self.every == 0 or self.escalated(step) or self.measured(step) else "light"

    def measured(self, step: int) -> bool:
        """Whether ``step``'s underflow is measured (a float32 shadow of its backward:
        :mod:`ampdoctor.record.underflow_probe`)."""
        return bool(self.measure_every) and step % self.measure_every == 0

    def per_tensor(self, step: int) -> bool:
        """Whether ``step`` writes a row per parameter gradient (else only the step row)."""
        return self.level != "steps" or self.escalated(step)

    def module_stats(self, step: int) -> Statistics | None:
        """What ``step``'s module taps record: ``"full"`` on escalated steps and, at
        ``level="full"``, module-sampled ones; ``"light"`` on other steps at ``level="full"``
        when there is a flight recorder; else None (no taps)."""
        if self.escalated(step):
            return "full"
        if self.level != "full":
            return None
        if self.module_sampled(step):
            return "full"
        return "light" if self.light_taps else None

    def module_sampled(self, step: int) -> bool:
        """Whether ``step`` is module-sampled on the cadence (``level="full"``, ``module_every``),
        escalated or not."""
        return self.level == "full" and step % self.module_every == 0

    def escalate(self, after_step: int) -> None:
        """An anomaly was seen by the end of ``after_step``: escalate the steps after it."""
        if self.escalate_steps:
            self.escalate_until = max(self.escalate_until, after_step + 1 + self.escalate_steps)

    def rewind(self, step: int) -> None:
        """The numbering goes on at ``step`` (a resumed or rolled-back run)."""
        self.escalate_until = min(self.escalate_until, step)
