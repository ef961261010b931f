"""plan.py and anomalies.py on their own: which steps are sampled, escalated and light, and the
flight recorder's window, with fences that land late and a writer that only collects."""

from __future__ import annotations

import pytest
import torch

from ampdoctor.record.anomalies import AnomalyWatch
from ampdoctor.record.options import RecordOptions
from ampdoctor.record.plan import StepPlan
from ampdoctor.record.records import FlightRecord, FlightStep, pack_scalars
from ampdoctor.record.transfer import HostCopies


def _plan(**options) -> StepPlan:
    return StepPlan(RecordOptions(**options), start_step=0)


def test_sampled_steps_and_levels():
    plan = _plan(level="params", every=10)
    assert [s for s in range(25) if plan.gradient_stats(s) == "full"] == [0, 10, 20]
    assert plan.gradient_stats(1) == "light"
    assert all(plan.per_tensor(s) for s in range(25)) and all(plan.module_stats(s) is None for s in range(25))
    steps = _plan(level="steps", every=10)
    assert not any(steps.per_tensor(s) for s in range(25))
    full = _plan(level="full", every=10, module_every=20)
    assert [full.module_stats(s) for s in (0, 1, 10, 20)] == ["full", "light", "light", "full"]
    assert _plan(level="full", flight_steps=0).module_stats(1) is None  # no flight recorder, no light taps
    assert _plan(level="params", every=7).module_every == 7  # module_every follows every when given


def test_escalation_covers_the_steps_after_the_one_that_saw_the_anomaly():
    plan = _plan(level="steps", every=100, escalate_steps=3)
    plan.escalate(after_step=5)  # asked only of the steps to come
    assert [s for s in range(6, 12) if plan.gradient_stats(s) == "full"] == [6, 7, 8]
    assert [s for s in range(6, 12) if plan.per_tensor(s)] == [6, 7, 8]
    assert [plan.module_stats(s) for s in (6, 8, 9)] == ["full", "full", None]
    plan.escalate(after_step=7)  # a second anomaly extends, never shortens
    assert plan.escalate_until == 11
    plan.rewind(4)  # a rolled-back run: its numbering goes on at 4
    assert plan.escalate_until == 4 and not plan.escalated(4)
    assert _plan(escalate_steps=0).escalate_until == 0


class _Event:
    def __init__(self, clock, lag):
        self.clock, self.ready_at = clock, clock[0] + lag

    def query(self):
        return self.clock[0] >= self.ready_at

    def synchronize(self):
        self.ready_at = 0


class _Writer:
    def __init__(self):
        self.put_records, self.syncs = [], 0

    def put(self, record):
        self.put_records.append(record)
        return True

    def sync(self):
        self.syncs += 1
        return True


def _scalars(*, skipped=False, loss=1.0, scale=1024.0):
    return pack_scalars(torch.tensor(scale), torch.tensor(float(skipped)), torch.tensor(loss), torch.tensor(1.0),
                        has_loss=True, has_params=True)


@pytest.mark.parametrize("lag", [0, 3])
def test_the_flight_window_and_escalation_with_late_copies(lag):
    """Step 6 skips. With copies that land ``lag`` steps late, the window is still steps 3-6
    (flight_steps=4), the escalation starts after the step that saw it, and the writer is waited
    on once, after the copies landed."""
    clock = [0]
    plan = _plan(level="full", flight_steps=4, escalate_steps=2, every=100, module_every=100)
    writer = _Writer()
    watch = AnomalyWatch(plan, writer, HostCopies(lambda device: _Event(clock, lag), fence_host=True),
                         rank=0, flight_steps=4, scale_floor=None, start_step=0)
    for step in range(12):
        clock[0] = step
        flight_step = FlightStep(step, [], torch.zeros(0), None)
        fence = HostCopies(lambda device: _Event(clock, lag), fence_host=True)
        fence.to_host(torch.zeros(1))
        watch.step_done(step, _scalars(skipped=step == 6), fence.seal(), flight_step, skipped_on_host=False)
    (flight,) = [r for r in writer.put_records if isinstance(r, FlightRecord)]
    assert [e.step for e in flight.steps] == [3, 4, 5, 6]
    assert writer.syncs == 1
    seen_at = 6 + lag
    assert plan.escalate_until == seen_at + 1 + 2
    assert len(watch.flight) <= 4 + lag  # checked steps leave once out of every window


def test_a_skip_seen_on_the_host_is_handled_once():
    """Seen at step() (torch read found_inf): the window and escalation at once, no writer wait
    (it would wait for this step's copies); when its scalars land, the wait, not a second window."""
    clock = [0]
    plan = _plan(level="full", flight_steps=2, escalate_steps=1, every=100, module_every=100)
    writer = _Writer()
    watch = AnomalyWatch(plan, writer, HostCopies(lambda device: _Event(clock, 2), fence_host=True),
                         rank=0, flight_steps=2, scale_floor=None, start_step=0)
    for step in range(6):
        clock[0] = step
        copies = HostCopies(lambda device: _Event(clock, 2), fence_host=True)
        copies.to_host(torch.zeros(1))
        watch.step_done(step, _scalars(skipped=step == 2), copies.seal(), FlightStep(step, [], torch.zeros(0), None),
                        skipped_on_host=step == 2)
        if step == 2:
            assert plan.escalate_until == 4 and writer.syncs == 0
    assert len([r for r in writer.put_records if isinstance(r, FlightRecord)]) == 1
    assert writer.syncs == 1 and plan.escalate_until == 4


def test_a_non_finite_loss_always_waits_and_a_run_of_skips_waits_once():
    plan = _plan(escalate_steps=0)
    writer = _Writer()
    watch = AnomalyWatch(plan, writer, HostCopies(), rank=0, flight_steps=0, scale_floor=1.0, start_step=0)
    steps = [_scalars(skipped=True)] * 3 + [_scalars(), _scalars(loss=float("nan")), _scalars(loss=float("nan")),
                                            _scalars(), _scalars(scale=0.5), _scalars(scale=0.25)]
    for step, scalars in enumerate(steps):
        watch.step_done(step, scalars, None, None, skipped_on_host=False)
    # steps 0-2: one wait; 4 and 5 (NaN loss): each; 7 (below the floor, first time): one; 8: still
    # below, not an anomaly
    assert writer.syncs == 4


def test_a_rewind_drops_the_unchecked_steps_from_the_summary_counts():
    """Steps whose copies had not landed when the run was rolled back are no longer part of it:
    the live summary (``watch.seen``) neither counts them as recorded nor as not checked."""
    clock = [0]
    plan = _plan(level="params", flight_steps=0, escalate_steps=0, every=100, module_every=100)
    watch = AnomalyWatch(plan, _Writer(), HostCopies(lambda device: _Event(clock, 3), fence_host=True),
                         rank=0, flight_steps=0, scale_floor=None, start_step=0)
    for step in range(5):
        clock[0] = step
        copies = HostCopies(lambda device: _Event(clock, 3), fence_host=True)
        copies.to_host(torch.zeros(1))
        watch.step_done(step, _scalars(), copies.seal(), None, skipped_on_host=False)
    assert watch.seen.steps == 5 and watch.seen.checked == 2  # steps 0 and 1 landed; 2-4 in flight
    watch.rewind(2)  # resumed from a checkpoint of step 2: steps 2-4 are abandoned
    assert watch.seen.steps == 2 and watch.seen.checked == 2
