"""Copies of device tensors into host memory, and the fences that say when they have landed.

The training thread starts the copies (non-blocking, into pinned memory) and seals them into a
:class:`Fence`: one event per source device, recorded on that device's current stream, the
stream that queued the copies. A record is read (by the writer thread, or by the anomaly check
once ``query()`` says so) only after its fence has passed. One event for all devices would be
recorded on the current device's stream only: copies from another GPU (a model split over GPUs,
training on ``cuda:1`` without ``set_device``) could land after it.

Events are created with ``blocking=True``: waiting on one puts the waiting thread to sleep
instead of spinning a CPU core. A device type whose backend offers no events (or no
``current_stream``) gets synchronous copies: correct, at the cost of a sync, and said once.

Tests build a :class:`HostCopies` with their own ``event_factory`` (an event that completes late)
to exercise the paths that only real accelerators take.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch


class Fence:
    """The events of one batch of copies (one per source device)."""

    def __init__(self, events: list) -> None:
        self._events = events

    def query(self) -> bool:
        """Whether every copy has landed. Never waits."""
        if all(e.query() for e in self._events):
            self._events = []  # passed for good: later queries cost nothing
            return True
        return False

    def synchronize(self) -> None:
        """Wait until every copy has landed (sleeps; a host-side wait, no device-wide sync)."""
        for e in self._events:
            e.synchronize()
        self._events = []


def _device_event(device: torch.device):
    """A blocking event recorded on ``device``'s current stream."""
    module = torch.get_device_module(device.type)
    try:
        event = module.Event(blocking=True)
    except TypeError:  # a backend whose events take no blocking= (waits on them may spin)
        event = module.Event()
    event.record(module.current_stream(device))
    return event


def has_events(device_type: str) -> bool:
    """Whether the backend of ``device_type`` offers events recorded on a device's current stream."""
    try:
        module = torch.get_device_module(device_type)
    except (RuntimeError, AttributeError):
        return False
    return hasattr(module, "Event") and hasattr(module, "current_stream")


class HostCopies:
    """Starts non-blocking copies to the host and seals them into a :class:`Fence` per batch.

    ``event_factory(device)`` returns an event already recorded on ``device``'s current stream
    (default: the backend's own); ``fence_host`` also fences host tensors (tests: CPU tensors
    then go through the late-event paths). Nothing here syncs, except on a backend with no
    events, whose copies are synchronous. Training thread only."""

    def __init__(self, event_factory: Callable[[torch.device], Any] | None = None, *, fence_host: bool = False):
        self._event_factory = event_factory or _device_event
        self._fence_host = fence_host
        self._devices: dict[torch.device, None] = {}  # ordered set: the devices of the open batch
        self._with_events: set[str] = set()
        self._warned: set[str] = set()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself on the CPU; else a copy into pinned memory, landed once the batch's fence
        has passed. No sync (except on a backend with no events: a synchronous copy)."""
        if t.device.type == "cpu":
            if self._fence_host:
                self._devices[t.device] = None
            return t
        if t.device.type not in self._with_events:
            if self._event_factory is _device_event and not has_events(t.device.type):
                self._warn_no_events(t.device.type)
                return t.to("cpu")
            self._with_events.add(t.device.type)
        self._devices[t.device] = None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.accelerator.is_available())
        return host.copy_(t, non_blocking=True)

    def seal(self) -> Fence | None:
        """The fence of the copies started since the last seal (None when there were none to
        wait for). Records one event per source device; no sync."""
        devices, self._devices = list(self._devices), {}
        return Fence([self._event_factory(d) for d in devices]) if devices else None

    def _warn_no_events(self, device_type: str) -> None:
        if device_type not in self._warned:
            self._warned.add(device_type)
            warnings.warn(f"ampdoctor: the {device_type} backend offers no events; statistics are copied to the "
                          f"host synchronously (a sync per step)", RuntimeWarning, stacklevel=4)
