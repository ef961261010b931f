"""transfer.py on its own: fences over injected events, copies from a (fake) accelerator, and a
backend without events."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ampdoctor.record import transfer
from ampdoctor.record.transfer import Fence, HostCopies


class Event:
    """An event that has passed once ``done`` is set; counts the calls made on it."""

    def __init__(self, device=None, done: bool = False) -> None:
        self.device, self.done, self.queries, self.waits = device, done, 0, 0

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def test_a_fence_not_yet_passed_never_waits():
    landed, pending = Event(done=True), Event()
    fence = Fence([landed, pending])
    assert not fence.query() and not fence.query()
    assert pending.waits == 0 and pending.queries == 2


def test_a_passed_fence_forgets_its_events():
    event = Event()
    fence = Fence([event])
    event.done = True
    assert fence.query()
    assert fence.query() and event.queries == 1  # passed for good: later queries cost nothing
    fence.synchronize()
    assert event.waits == 0


def test_synchronize_waits_on_every_event_once():
    events = [Event(), Event(done=True)]
    fence = Fence(events)
    fence.synchronize()
    assert [e.waits for e in events] == [1, 1]
    assert fence.query() and all(e.queries == 0 for e in events)


def test_host_tensors_are_used_as_they_are_and_need_no_fence():
    copies = HostCopies(Event)
    t = torch.ones(3)
    assert copies.to_host(t) is t and copies.seal() is None
    fenced = HostCopies(Event, fence_host=True)  # tests: CPU tensors through the late-event paths
    assert fenced.to_host(t) is t
    fence = fenced.seal()
    assert [e.device for e in fence._events] == [torch.device("cpu")]


def test_copies_from_two_devices_are_sealed_by_an_event_each():
    made = []

    def factory(device):
        made.append(Event(device))
        return made[-1]

    copies = HostCopies(factory)
    with FakeTensorMode() as mode:
        a = FakeTensor(mode, torch.empty(4, device="meta"), torch.device("cuda:0"))
        b = FakeTensor(mode, torch.empty(2, device="meta"), torch.device("cuda:1"))
        host = [copies.to_host(a), copies.to_host(b), copies.to_host(a)]
    assert [h.device.type for h in host] == ["cpu"] * 3 and [h.shape for h in host] == [(4,), (2,), (4,)]
    assert made == []  # events are recorded at seal(), once the batch's copies are queued
    fence = copies.seal()
    assert [e.device for e in made] == [torch.device("cuda:0"), torch.device("cuda:1")]
    assert not fence.query()
    made[0].done = True
    assert not fence.query()  # cuda:1's copies have not landed
    made[1].done = True
    assert fence.query()
    assert copies.seal() is None  # a new batch: nothing copied since


def test_a_backend_without_events_copies_synchronously():
    """Issue 17, item 10: on a backend with no events (mps), records counted as ready before
    their copies landed; now the copy is synchronous, and that is said once."""
    copies = HostCopies()
    with FakeTensorMode() as mode, mock.patch("ampdoctor.record.transfer.has_events", return_value=False):
        t = FakeTensor(mode, torch.empty(3, device="meta"), torch.device("mps"))
        with pytest.warns(RuntimeWarning, match="no events"):
            out = copies.to_host(t)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            copies.to_host(t)  # warned once per device type
    assert out.device.type == "cpu" and copies.seal() is None


def test_real_events_are_blocking_and_per_device():
    """The default factory asks the backend for ``blocking=True`` events (a wait sleeps instead
    of spinning a core) recorded on each source device's current stream."""
    made = []

    class Module:
        class Event:
            def __init__(self, **kw):
                made.append(kw)

            def record(self, stream):
                made.append(stream)

        @staticmethod
        def current_stream(device):
            return f"stream of {device}"

    with mock.patch.object(torch, "get_device_module", return_value=Module):
        transfer._device_event(torch.device("cuda:1"))
    assert made == [{"blocking": True}, "stream of cuda:1"]

