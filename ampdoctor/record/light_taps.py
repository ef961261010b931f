"""The light module observations of one step, the flight recorder's and the GEMM operands': per
tapped tensor what its row needs, and its peak magnitude, reduced with many others at once.

Every tapped module's output and output gradient pass through here on the steps between module
samples, so a tap does bookkeeping only: it hands the tensor to :class:`Peaks`, which holds it and
gives it an id, and extends a flat list with its facts (one ``list.extend``: no Python object per
tensor that lives until the step ends; such objects are what sets off Python's garbage collector,
docs/benchmarks.md). :class:`Peaks` reduces the tensors it holds together
(:func:`~ampdoctor.stats.peaks.batch_peaks`: on CUDA two Triton launches for all those of a dtype;
on the CPU one ``_foreach_norm`` for all) when it holds :data:`BATCH` tensors (of a dtype, on CUDA) or :data:`HOLD_SHARE` of the memory the device has allocated (a
held tensor lives a little longer: that bounds what it costs), and at the step's end, when all of
the step's peaks become one device vector (:meth:`Peaks.finish`). The
:class:`~ampdoctor.record.records.TapObservation` of each tensor is made only if its step is
written, on the writer thread (:func:`observations`).

A tensor seen twice in a row is held once (:class:`Repeat`): a model that returns its head's
output (the logits, the largest tensor of a language model, forward and backward), a block that
returns its last child's output, a gradient that an addition hands unchanged to a tapped branch,
a GEMM layer's input that is the previous tap's output.

The one ``extend`` per tensor is atomic under the GIL, and :class:`Peaks` takes a lock around its
lists (never around a launch): taps on two autograd threads never interleave their entries.
Nothing here syncs.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..float_formats import dtype_name
from ..stats.light import extremes, peaks_of_pairs
from ..stats.peaks import batch_peaks
from .call_graph import ModuleCall
from .records import FlightStep, TapObservation

FIELDS = 6          # entries per tensor in a flat list: kind, call, order, torch dtype, numel, peak id
_ID = 5             # the peak id's place
BATCH = 64          # tensors of one dtype held on CUDA before they are reduced together (3 launches)
CPU_BATCH = 1024    # tensors held on the CPU before they are reduced together (the bytes bound below rules)
HOLD_SHARE = 0.01   # ... or their bytes, as a share of what the device has allocated (CUDA)
MIN_HOLD_BYTES = 4 << 20    # (never less than this: tiny models would reduce at every tensor)
CPU_HOLD_BYTES = 64 << 20   # the CPU has no allocator statistics: a fixed bound
MAX_AT_ONCE = 1 << 16       # observations learnt to be read at once (a static model has few)


class Repeat:
    """The statistics of the last tensor the taps saw, for the same tensor seen next: the repeats
    above come one right after the other (a module returns, then its parent returns the same
    tensor; two node pre-hooks on one node, or the consumer of an addition run next in
    backward). Only the last one is kept: no lookup table, nothing that outlives the step but
    one small tuple. The tensor is recognised by a weak reference and its version counter (an
    id is reused once a tensor is freed; an in-place op bumps the version); none is held. A
    race between two autograd threads can only miss a repeat. Limit: a write that does not move
    the version counter (through ``.data``, a numpy view, a kernel writing by ``data_ptr``)
    between the two observations goes unseen, as it does for autograd. No sync."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple | None = None

    def of(self, tensor: torch.Tensor, compute: Callable[[torch.Tensor], Any]) -> Any:
        """``compute(tensor)``, or what it returned for this tensor, unchanged, just before."""
        last = self._last
        if last is not None and last[0]() is tensor and last[1] == tensor._version:
            return last[2]
        value = compute(tensor)
        self._last = (weakref.ref(tensor), tensor._version, value)
        return value

    def clear(self) -> None:
        """Forget the last tensor (a new step). No sync."""
        self._last = None


@dataclass
class StepPeaks:
    """A step's peaks: one float32 device vector, and where each peak id's value is in it."""

    values: torch.Tensor
    position: np.ndarray  # int64 [ids]: the place of id ``i`` in ``values``; -1: changed before it was read

    def index(self, flat: list) -> np.ndarray:
        """The places in :attr:`values` of the peaks of a flat list's tensors, in its order (-1
        for a tensor changed in place before its peak was read: unknown)."""
        return self.position[np.asarray(flat[_ID::FIELDS], dtype=np.int64)]


class Peaks:
    """The tensors the light taps of one recorder hold until they are reduced, per dtype; shared
    by the flight recorder's :class:`LightTaps` and the GEMM operands' (one repeat check, one
    batch for both). Training thread and autograd threads; no sync."""

    def __init__(self, batch: int = BATCH) -> None:
        self.repeat = Repeat()
        self._batch = batch
        self._lock = threading.Lock()  # around the lists only: a launch never runs under it
        self._held: dict[torch.dtype | None, list] = {}  # dtype (CUDA; None elsewhere) -> [tensors, ids, bytes, versions]
        self._done: list[tuple[list[int], torch.Tensor]] = []  # (ids, their peaks) per reduced batch
        self._next = 0
        self._budget: int | None = None  # bytes held per dtype before a reduction (set at the first)
        # Observations whose tensor was changed in place while held, by (kind, module, order):
        # from the next step on they are read at once (one aminmax each), exactly.
        self.at_once: set[tuple] = set()
        self._pairs: list[torch.Tensor] = []  # their (min, max), flat
        self._pair_ids: list[int] = []

    def hold(self, tensor: torch.Tensor, key: tuple | None = None) -> int:
        """Hold ``tensor`` (not empty) until its peak is reduced; its peak id. The same tensor seen
        again at once gets the same id. ``key`` names the observation (kind, module, order) across
        steps: one whose tensor was changed in place while held is read at once from then on. No sync."""
        if key is not None and key in self.at_once:
            return self.repeat.of(tensor, self._read_now)
        return self.repeat.of(tensor, lambda t: self._hold(t, key))

    def _read_now(self, tensor: torch.Tensor) -> int:
        low, high = extremes(tensor)  # (one launch, before anything can change the tensor)
        with self._lock:
            pid = self._next
            self._next += 1
            self._pairs.extend((low, high))
            self._pair_ids.append(pid)
        return pid

    def _hold(self, tensor: torch.Tensor, key: tuple | None = None) -> int:
        size = tensor.numel() * tensor.element_size()
        with self._lock:
            pid = self._next
            self._next += 1
            group = tensor.dtype if tensor.is_cuda else None  # (the CPU reduces mixed dtypes in one op)
            held = self._held.get(group)
            if held is None:
                held = self._held[group] = [[], [], 0, [], [], []]
            held[0].append(tensor)
            held[1].append(pid)
            held[2] += size
            held[3].append(tensor._version)
            held[4].append(key)
            held[5].append(tensor.data_ptr())
            budget = self._budget if self._budget is not None else MIN_HOLD_BYTES
            full = len(held[0]) >= (self._batch if group is not None else CPU_BATCH) or held[2] >= budget
            if full:
                del self._held[group]
        if full:
            self._reduce(held)
        return pid

    def _reduce(self, held: list) -> None:
        tensors, ids, _, versions, keys, addresses = held
        # A tensor changed in place since it was held (ReLU(inplace=True) on a module's output, an
        # in-place residual add), or whose memory was freed or moved (FSDP frees an unsharded
        # weight after its block's forward: reading it would read freed memory), no longer holds
        # what its module had: its peak is unknown, and its row is left out (this step only:
        # that observation is read at once from the next). One unchanged is read now, before any
        # later change (stream order): exact.
        changed = [i for i, (t, v, a) in enumerate(zip(tensors, versions, addresses))
                   if t._version != v or t.data_ptr() != a]
        if changed:
            if len(self.at_once) < MAX_AT_ONCE:
                self.at_once.update(keys[i] for i in changed if keys[i] is not None)
            keep = sorted(set(range(len(tensors))) - set(changed))  # (their ids get no place: -1)
            tensors, ids = [tensors[i] for i in keep], [ids[i] for i in keep]
            if not tensors:
                return
        if not tensors[0].is_cuda and len({t.dtype for t in tensors}) > 1:  # each dtype's together: fewer ops
            order = sorted(range(len(tensors)), key=lambda i: str(tensors[i].dtype))
            tensors, ids = [tensors[i] for i in order], [ids[i] for i in order]
        peaks = batch_peaks(tensors)
        with self._lock:
            self._done.append((ids, peaks))
        device = tensors[0].device
        if device.type == "cuda":  # (an allocator statistic on the host: no sync)
            self._budget = max(MIN_HOLD_BYTES, int(HOLD_SHARE * torch.cuda.memory_allocated(device)))
        elif self._budget is None:
            self._budget = CPU_HOLD_BYTES

    def flush(self) -> None:
        """Reduce what is held now: at the end of the backward (the first ``unscale_``/``step``),
        before the optimizer changes the weights held for the GEMM operands in place. A few
        launches; no sync."""
        with self._lock:
            held, self._held = self._held, {}
        for batch in held.values():
            self._reduce(batch)

    def finish(self) -> StepPeaks | None:
        """Reduce what is still held; the step's peaks (None if it held no tensor); starts the
        next step. A few launches; no sync."""
        self.flush()
        with self._lock:
            pairs, pair_ids, self._pairs, self._pair_ids = self._pairs, self._pair_ids, [], []
        if pairs:
            device = pairs[0].device
            peaks = peaks_of_pairs(torch.stack([v.to(device, non_blocking=True) for v in pairs]))
            with self._lock:
                self._done.append((pair_ids, peaks))
        with self._lock:
            done, self._done, count, self._next = self._done, [], self._next, 0
        self.repeat.clear()
        if not done:
            return None
        device = done[0][1].device
        vectors = [peaks.to(device, non_blocking=True) for _, peaks in done]
        values = vectors[0] if len(vectors) == 1 else torch.cat(vectors)
        position = np.full(count, -1, dtype=np.int64)
        position[np.concatenate([np.asarray(ids, dtype=np.int64) for ids, _ in done])] = np.arange(values.numel())
        return StepPeaks(values, position)


class LightTaps:
    """The light observations of the step in progress (the flight recorder's, or the GEMM
    operands'), their peaks held in a :class:`Peaks` that may be shared."""

    def __init__(self, limit: int, peaks: Peaks | None = None) -> None:
        self._limit = limit  # tensors kept per step; more are counted in ``dropped``
        self.peaks = peaks or Peaks()
        self._flat: list = []  # FIELDS entries per tensor
        self._count = 0
        self.dropped = 0

    @property
    def repeat(self) -> Repeat:
        return self.peaks.repeat

    def add(self, kind: str, call: ModuleCall, order: int, tensor: torch.Tensor) -> None:
        """Keep ``tensor``'s facts and hold it for its peak (no launch: see :class:`Peaks`). No sync."""
        if self._count >= self._limit:
            self.dropped += 1
            return
        self._count += 1  # (two autograd threads may race here: the limit is a bound, not exact)
        self._flat.extend((kind, call, order, tensor.dtype, tensor.numel(),
                           self.peaks.hold(tensor, (kind, call.name, order))))

    def flight_step(self, step: int, peaks: StepPeaks | None) -> FlightStep | None:
        """The step's observations with their peaks (``peaks``: :meth:`Peaks.finish` of this
        step), or None if there were none; starts the next step. No sync."""
        flat, self._flat, self._count, self.dropped = self._flat, [], 0, 0
        if not flat or peaks is None:
            return None
        return FlightStep(step, flat, peaks.values, None, index=peaks.index(flat))


def observations(flat: list) -> list[TapObservation]:
    """The observations of a flight step's flat list (writer thread; statistics None). Reads
    no tensor."""
    facts = [flat[i::FIELDS] for i in range(_ID)]
    return [TapObservation(kind, call, order, dtype_name(dtype), numel, None)
            for kind, call, order, dtype, numel in zip(*facts)]
