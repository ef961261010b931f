"""The recorder: what one training iteration observed, handed from the training thread to the writer.

The scaler calls, per iteration, ``observe_loss`` (from ``scale``), ``observe_grads`` (from
``unscale_``/``step``, before torch unscales, so the values are the scaled ones backward produced),
``observe_params`` (after ``step``), ``before_update`` and ``after_update``. None of them syncs:
statistics stay on the device, ``after_update`` starts non-blocking copies into pinned memory,
seals them with a fence (:mod:`ampdoctor.transfer`: an event per source device) and queues the
record; the writer thread waits on the fence. Every method is guarded: an exception of ours warns
once and stops recording, and is raised (as :class:`RecorderError`) only with ``strict=True``.

Module taps (``level="full"``, or an escalation) call ``observe_tap`` from forward and gradient
hooks (:mod:`ampdoctor.hooks`). On module-sampled steps (every ``module_every`` steps) and the
``escalate_steps`` after an anomaly each tapped tensor gets the full statistics; on the other steps it gets one
reduction, its min and max (hence its peak magnitude), which is enough to see every non-finite value. The peaks of the last
``flight_steps`` steps stay on the device (the flight recorder) and are written out only when an
anomaly is seen: a skipped step, a non-finite loss, or the scale falling below ``scale_floor``.
A skipped step is known on the host in the step itself when torch's ``step()`` read found_inf and
did not run the optimizer (a step pre-hook tells whether it ran). Other anomalies (a non-finite
loss or parameter, the scale floor, skips of fused optimizers, which decide on the device) are read
from the pinned copy of each step's scalars once its fence has passed (``query()``, never a wait):
on CUDA usually one step later.
"""

from __future__ import annotations

import atexit
import collections
import functools
import math
import os
import signal
import threading
import time
import uuid
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

from . import __version__
from .errors import RecorderError
from .formats import dtype_name, float_format
from .hooks import ModuleCall, ModuleFilter, ModuleHook, ModuleTaps, clean_name, is_compiled, unwrap_compiled
from .schema import HIST_BINS, HIST_MIN_EXP, META_SCHEMA_VERSION, META_TORCH_VERSION, META_VERSION, SCHEMA_VERSION
from .stats import (DeviceStats, HostStats, LightStats, SlotLayouts, extremes, light_stats, peak_magnitudes,
                    peaks, tensor_stats)
from .transfer import Fence, HostCopies
from .writer import RunWriter, close_all_writers

LEVELS = ("steps", "params", "full")
# Full statistics of the gradients every 100 steps; of the module taps (about ten times the
# elements of the gradients in a transformer) every 1000, unless ``every`` is set explicitly.
DEFAULT_EVERY = 100
DEFAULT_MODULE_EVERY = 1000
MAX_TAP_ROWS_PER_STEP = 100_000  # beyond this (a long forward-only loop between steps) rows are dropped


@dataclass(frozen=True)
class RecordOptions:
    """The keyword-only recording options of :class:`ampdoctor.GradScaler` and :func:`ampdoctor.wrap`."""

    path: str | os.PathLike | None = None
    level: str = "params"
    every: int | None = None          # None: DEFAULT_EVERY
    module_every: int | None = None   # None: ``every`` when given, else DEFAULT_MODULE_EVERY
    strict: bool = False
    flush_every: int = 1000
    flush_seconds: float = 60.0
    amp_dtype: torch.dtype | str | None = None
    hist_min_exp: int = HIST_MIN_EXP
    hist_bins: int = HIST_BINS
    queue_size: int = 256
    rank: int | None = None
    modules: ModuleFilter = None
    flight_steps: int = 32
    escalate_steps: int = 20
    scale_floor: float | None = 1.0
    check_params: bool | str = True  # True: sampled steps, escalated steps and the end; "always"; False
    ranks: Any = None  # the ranks that record (an int or an iterable of ints); None: all

    @property
    def gradient_interval(self) -> int:
        return self.every or DEFAULT_EVERY

    @property
    def module_interval(self) -> int:
        return self.module_every or self.every or DEFAULT_MODULE_EVERY

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level!r}")
        for name in ("every", "module_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        for name in ("flush_every", "hist_bins", "queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("flight_steps", "escalate_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.scale_floor is not None and not self.scale_floor > 0:
            raise ValueError(f"scale_floor must be > 0 or None, got {self.scale_floor!r}")
        if not self.flush_seconds > 0:
            raise ValueError(f"flush_seconds must be > 0, got {self.flush_seconds!r}")
        if self.amp_dtype is not None:
            float_format(self.amp_dtype)  # ValueError for a non-float dtype
        if self.check_params not in (True, False, "always"):
            raise ValueError(f"check_params must be True, False or 'always', got {self.check_params!r}")
        if self.ranks is not None:
            ranks = (self.ranks,) if isinstance(self.ranks, int) else self.ranks
            try:
                ranks = tuple(ranks)
            except TypeError:
                raise TypeError(f"ranks must be an int, an iterable of ints or None, got {self.ranks!r}") from None
            if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
                raise ValueError(f"ranks must be non-negative ints, got {self.ranks!r}")
            object.__setattr__(self, "ranks", ranks)


def default_path() -> str:
    return f"ampdoctor-{time.strftime('%Y%m%d-%H%M%S')}.parquet"


@dataclass
class GroupRecord:
    """The observed gradients of one (device, dtype) group of one optimizer."""

    names: list[str]
    dtype: str
    numels: np.ndarray
    stats: DeviceStats | LightStats   # full statistics on detailed steps, else light ones


@dataclass
class TapObservation:
    """One tensor seen by a module tap: an ``output`` or a ``grad_output``."""

    kind: str
    call: ModuleCall
    order: int
    dtype: str
    numel: int
    stats: DeviceStats | tuple | None  # full statistics, or the (min, max) pair of a light step


@dataclass
class StepRecord:
    step: int
    rank: int
    per_tensor: bool
    amp_dtype: str
    scalars: torch.Tensor | None      # float32 [scale, found_inf, loss, has_loss, param_peak, has_params]
    groups: list[GroupRecord] = field(default_factory=list)
    taps: list[TapObservation] = field(default_factory=list)  # detailed steps only
    params: "ParamPeaks | None" = None  # parameter peaks after optimizer.step()
    event: Fence | None = None        # to wait on before reading (None: nothing to wait for)


@dataclass
class ParamPeaks:
    """``max |w|`` of each parameter after ``optimizer.step()`` (NaN/inf when it holds one)."""

    names: list[str]
    numels: list[int]
    peaks: torch.Tensor               # float32 [len(names)], on the device until copied


@dataclass
class ParamRecord:
    """A parameter check outside an iteration (at the end of the run): ``param`` rows only,
    carrying the scale and skipped flag of ``step``, the step that left the parameters so."""

    step: int
    rank: int
    amp_dtype: str
    scalars: torch.Tensor             # host scalars of ``step`` (see StepRecord)
    params: ParamPeaks
    event: Fence | None = None


@dataclass
class LightStep:
    """A step's module peaks in the flight recorder: ``peaks[i]`` belongs to ``taps[i]``
    (gradients still scaled by the step's scale)."""

    step: int
    taps: list[TapObservation]
    peaks: torch.Tensor               # float32 [len(taps)], on the device until dumped
    scalars: torch.Tensor | None      # the step's host scalars (see StepRecord)
    event: Fence | None = None        # the step's copy fence (its scalars)


@dataclass
class FlightRecord:
    """The flight recorder's steps, written out after an anomaly."""

    rank: int
    steps: list[LightStep]
    event: Fence | None = None


def _guarded(method):
    """Run a recorder method so that a failure never reaches the training loop (unless strict)."""

    @functools.wraps(method)
    def run(self: "Recorder", *args, **kwargs):
        if not self.active:
            return None
        try:
            return method(self, *args, **kwargs)
        except RecorderError:
            raise  # strict mode, raised by fail() already: not wrapped a second time
        except Exception as exc:  # noqa: BLE001 - a recorder bug must not stop training
            self.fail(exc)
            return None

    return run


class Recorder:
    """Collects one scaler's observations and feeds a :class:`RunWriter`."""

    def __init__(self, scaler: torch.amp.GradScaler, model: torch.nn.Module | None,
                 options: RecordOptions, *, scaler_class: str, start_step: int = 0,
                 run_id: str | None = None) -> None:
        if options.level == "full" and model is None:
            raise ValueError("level='full' needs model=: the module taps are installed on it")
        self.options = options
        self.active = True
        self.step = start_step
        self.path = os.fspath(options.path) if options.path is not None else default_path()
        self.device_type = torch.device(getattr(scaler, "_device", "cuda")).type
        self._names: dict[int, str] = {}
        self._optimizer_index: dict[int, int] = {}
        self._observed: set[int] = set()
        self._groups: list[GroupRecord] = []
        self._loss: torch.Tensor | None = None
        self._params: list[ParamPeaks] = []      # this iteration's parameter checks, per optimizer
        self._params_checked: set[int] = set()
        self._param_optimizers: weakref.WeakSet = weakref.WeakSet()  # for the check at the end
        self._last_param_check = start_step - 1  # the last step whose parameter check was queued
        self._last_scalars: torch.Tensor | None = None  # host scalars of the last checked step
        self._stepped = False  # an optimizer stepped in the iteration in progress (no update() yet)
        self._scaler_ref = weakref.ref(scaler)  # at exit: is this still the scaler's recorder?
        self._param_group_cache: dict[tuple, tuple[list, list]] = {}
        self._layouts = SlotLayouts()
        self._copies = HostCopies()
        self._reported = False  # a failure has been warned about (or raised)
        self.dropped_steps = 0  # step records the writer could not take (its queue was full)
        self._closing = False   # close() has begun
        self._sniff_handle = None
        self._amp_dtype = dtype_name(options.amp_dtype) if options.amp_dtype is not None else None
        # Module taps, the flight recorder and escalation.
        self._taps: ModuleTaps | None = None
        self._tap_mode: str | None = None       # None, "light" or "full" for the step in progress
        self._tap_obs: list[TapObservation] = []
        self._dropped_taps = 0
        self._warned_dropped = False
        self._backward_scale: torch.Tensor | None = None  # the scale this step's backward used
        self._inv_scales: dict[torch.device, torch.Tensor] = {}
        # Entries leave the flight recorder once their step and the F-1 steps after it are checked
        # (fused optimizers do not sync in step(), so checks can lag); the cap bounds a lag that
        # never ends (a disabled scaler that never syncs).
        self._flight: collections.deque[LightStep] = collections.deque(maxlen=4 * options.flight_steps + 64)
        self._checked_until = start_step  # steps below this have been checked for anomalies
        self._pending_checks: collections.deque = collections.deque()  # (step, host scalars, event)
        self._escalate_until = start_step       # steps below this are detailed (after an anomaly)
        self._below_floor = False
        self._last_anomaly = -2                 # the last anomalous step checked (a run of them syncs once)
        self._handled_anomaly = start_step - 1  # the last anomalous step whose window was written
        # Whether torch's step() ran each optimizer this iteration (a step pre-hook): torch reads
        # found_inf on the host for it anyway, so a skip is known before the scalars' copy lands.
        self._step_hooks: dict[int, tuple] = {}  # id(optimizer) -> (weak reference to it, hook handle)
        self._optimizers_ran: set[int] = set()
        self._skipped_on_host = False
        self._scaler_enabled = scaler.is_enabled()
        self.rank, self.world_size = _rank_and_world(options.rank)
        self.run_id = run_id or _env_run_id() or uuid.uuid4().hex
        self.started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        # A disabled scaler never skips a step, so a non-finite parameter cannot be traced back
        # over skipped steps to the step that wrote it: check after every step.
        self._params_every_step = options.check_params == "always" or not scaler.is_enabled()
        meta = {"scaler.class": scaler_class, "scaler.enabled": str(scaler.is_enabled()).lower(),
                "scaler.init_scale": str(_current_scale(scaler)), "device": self.device_type}
        for name in ("growth_factor", "backoff_factor", "growth_interval"):  # a disabled torch scaler has none
            if hasattr(scaler, f"_{name}"):
                meta[f"scaler.{name}"] = str(getattr(scaler, f"_{name}"))
        self._scaler_meta = meta
        if model is not None:
            inner = unwrap_compiled(model)
            self._names = {id(p): clean_name(n) for n, p in inner.named_parameters()}
            if is_compiled(model):
                if options.level == "full":
                    warnings.warn("ampdoctor: the model is compiled with torch.compile; module taps "
                                  "are off and recording continues at level='params'",
                                  RuntimeWarning, stacklevel=4)
            else:
                self._taps = ModuleTaps(inner, options.modules, self)
            if self._amp_dtype is None:
                self._sniff_handle = inner.register_forward_pre_hook(ModuleHook(inner, self._sniff_autocast))
        self.writer = RunWriter(
            self.path, metadata=self._metadata, materialize=self._materialize, rank=self.rank,
            hist_bins=options.hist_bins, flush_every=options.flush_every,
            flush_seconds=options.flush_seconds, queue_size=options.queue_size)
        _install_sigterm_handler()
        _open_recorders.add(self)
        self._check_path()
        self._plan_step()

    # -- lifecycle -------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """Stop recording after ``exc``: warn once, or raise in strict mode."""
        self.active = False
        self._remove_hooks()
        if threading.current_thread() is threading.main_thread():
            self.writer.close()
        else:  # an autograd device thread (a gradient tap): joining the writer would stall backward
            threading.Thread(target=self.writer.close, name="ampdoctor-close", daemon=True).start()
        first, self._reported = not self._reported, True
        if self.options.strict:
            raise RecorderError(f"ampdoctor recording failed: {type(exc).__name__}: {exc}") from exc
        if first:
            warnings.warn(f"ampdoctor: recording to {self.path} stopped ({type(exc).__name__}: "
                          f"{exc}); training continues unaffected", RuntimeWarning, stacklevel=4)

    def _step_dropped(self) -> None:
        """The writer is behind (a slow or stalled disk): this step is not recorded, training
        goes on. Warns once; the count goes into the run's metadata."""
        self.dropped_steps += 1
        if self.dropped_steps == 1:
            warnings.warn(f"ampdoctor: the writer fell behind (a slow or stalled disk at {self.path}); steps "
                          f"are not recorded while its queue is full (step {self.step} was the first), and the "
                          f"run will say how many; training continues unaffected", RuntimeWarning, stacklevel=5)

    def close(self, timeout: float | None = None, *, at_exit: bool = False) -> None:
        """Flush and finish the run. Idempotent. Waits for the last anomaly checks (their copies)
        and for the writer thread (at most ``timeout`` seconds each when given): host-side waits
        only, after training. ``at_exit``: the interpreter is exiting; the final parameter check
        runs only if this is still its scaler's recorder (an abandoned scaler's run must not
        describe parameters that another scaler went on training)."""
        self._closing = True  # the close writes everything: anomalies found now need no sync of their own
        if self.active:
            try:
                deadline = None if timeout is None else time.monotonic() + timeout
                self._check_anomalies(wait=True, deadline=deadline)
                scaler = self._scaler_ref()
                if not at_exit or (scaler is not None and getattr(scaler, "recorder", None) is self):
                    self._final_param_check()
            except Exception as exc:  # noqa: BLE001
                self.fail(exc)
        self._remove_hooks()
        self.active = False
        _open_recorders.discard(self)
        finished = self.writer.close(timeout)
        if self.writer.error is not None and not self._reported:
            self.fail(self.writer.error)
        elif not finished and not self._reported:
            self._reported = True
            warnings.warn(f"ampdoctor: the writer did not finish {self.path} in time (a stalled disk?); its last "
                          f"steps may be missing", RuntimeWarning, stacklevel=3)

    @_guarded
    def set_step(self, step: int) -> None:
        """Continue the step numbering at ``step`` (a resumed or rolled-back run): the flight
        recorder and pending anomaly checks of the abandoned steps are dropped."""
        self.step = step
        self._escalate_until = min(self._escalate_until, step)
        self._handled_anomaly = min(self._handled_anomaly, step - 1)
        self._flight.clear()
        self._pending_checks.clear()
        self._last_param_check, self._last_scalars, self._stepped = step - 1, None, False
        self._plan_step()

    def continue_run(self, run_id: str) -> None:
        """Record into the run ``run_id`` (a resumed run: its scaler's state_dict was loaded),
        not a new one beside it. Segments written from now on carry that id."""
        self.run_id = run_id

    def _remove_hooks(self) -> None:
        self._remove_sniff()
        for _, handle in self._step_hooks.values():
            handle.remove()
        self._step_hooks.clear()
        if self._taps is not None:
            self._taps.remove()

    def _remove_sniff(self) -> None:
        if self._sniff_handle is not None:
            self._sniff_handle.remove()
            self._sniff_handle = None

    @_guarded
    def _check_path(self) -> None:
        os.makedirs(self.path, exist_ok=True)

    # -- observations (training thread; none of these syncs) -------------------------------
    def _sniff_autocast(self, module, args) -> None:
        if torch.is_autocast_enabled(self.device_type):
            self._amp_dtype = dtype_name(torch.get_autocast_dtype(self.device_type))
            self._remove_sniff()

    @property
    def amp_dtype(self) -> str:
        return self._amp_dtype or "float16"

    @property
    def tap_mode(self) -> str | None:
        """What the module taps record this step: None, ``"light"`` (peaks) or ``"full"``."""
        return self._tap_mode

    @_guarded
    def observe_loss(self, outputs: torch.Tensor | Iterable, scale: torch.Tensor | None = None) -> None:
        """Add the unscaled value(s) passed to ``scale()`` to this iteration's loss; ``scale`` is
        the loss scale their backward will carry (None: not scaled)."""
        self._backward_scale = scale
        for t in _tensors(outputs):
            value = t.detach().float().sum()
            self._loss = value if self._loss is None else self._loss + value.to(self._loss.device)

    @_guarded
    def observe_tap(self, kind: str, call: ModuleCall, order: int, tensor: torch.Tensor) -> None:
        """Statistics of a tensor a module tap saw (``output``, or ``grad_output``: still scaled).
        Called from module and tensor hooks. Does not sync."""
        mode = self._tap_mode
        if mode is None:
            return
        if len(self._tap_obs) >= MAX_TAP_ROWS_PER_STEP:
            self._dropped_taps += 1
            return
        if mode == "light":
            stats: DeviceStats | tuple = extremes(tensor)
        else:
            inv = self._inv_scale(tensor.device) if kind == "grad_output" else None
            stats = tensor_stats([tensor], inv_scale=inv,
                                 subnormal_below=float_format(tensor.dtype).smallest_normal,
                                 hist_min_exp=self.options.hist_min_exp,
                                 hist_bins=self.options.hist_bins, layouts=self._layouts, lines="features")
        self._tap_obs.append(TapObservation(kind, call, order, dtype_name(tensor.dtype),
                                            tensor.numel(), stats))

    def _inv_scale(self, device: torch.device) -> torch.Tensor | None:
        """1/scale as torch's unscale_ computes it, on ``device`` (once per step and device)."""
        if self._backward_scale is None:
            return None
        inv = self._inv_scales.get(device)
        if inv is None:
            inv = self._backward_scale.double().reciprocal().float().to(device, non_blocking=True)
            self._inv_scales[device] = inv
        return inv

    @_guarded
    def observe_grads(self, optimizer: torch.optim.Optimizer, scale: torch.Tensor | None) -> None:
        """Statistics of ``optimizer``'s gradients, still scaled by ``scale`` (None: unscaled).
        Once per optimizer per iteration. Does not sync."""
        if id(optimizer) in self._observed:
            return
        self._observed.add(id(optimizer))
        if not self._watched(optimizer) and hasattr(optimizer, "_optimizer_step_pre_hooks"):
            # (an optimizer that never ran Optimizer.__init__ takes no hooks: its skips are read
            # from the device, a step later)
            handle = optimizer.register_step_pre_hook(ModuleHook(optimizer, self._optimizer_ran))
            self._step_hooks[id(optimizer)] = (weakref.ref(optimizer), handle)
        detailed = self._detailed_step()
        per_tensor = self._per_tensor_step()
        inv_scale = scale.double().reciprocal().float() if scale is not None else None
        below = float_format(self.amp_dtype).smallest_normal
        for (device, dtype), (names, numels, tensors) in self._gradient_groups(optimizer).items():
            inv = inv_scale.to(device, non_blocking=True) if inv_scale is not None else None
            if detailed:
                stats = tensor_stats(tensors, inv_scale=inv, subnormal_below=below, per_tensor=per_tensor,
                                     hist_min_exp=self.options.hist_min_exp,
                                     hist_bins=self.options.hist_bins, layouts=self._layouts)
            else:
                stats = light_stats(tensors, inv_scale=inv)
            self._groups.append(GroupRecord(names, dtype_name(dtype), numels, stats))

    def _gradient_groups(self, optimizer: torch.optim.Optimizer) -> dict[tuple, tuple[list, np.ndarray, list]]:
        """This step's observable gradients of ``optimizer`` per (device, dtype): names, numels,
        tensors. Dense gradients have their parameter's device, dtype and size (torch enforces
        it), so their grouping is planned once per set of parameters and each step only reads
        ``p.grad``: host work per tensor is a few attribute reads, not a Python loop of lookups."""
        dense, others = self._gradient_plan(optimizer)
        groups: dict[tuple, tuple[list, np.ndarray, list]] = {}
        rest = list(others)
        for key, (names, numels, params) in dense.items():
            grads = [p.grad for p in params]
            usable = [g is not None and not g.is_sparse for g in grads]
            if all(usable):
                groups[key] = (names, numels, grads)
                continue
            rest.extend((n, p) for n, p, ok in zip(names, params, usable) if not ok)
            kept = [i for i, ok in enumerate(usable) if ok]
            if kept:
                groups[key] = ([names[i] for i in kept], numels[kept], [grads[i] for i in kept])
        added: dict[tuple, tuple[list, list, list]] = {}
        for name, grad in self._named_grads(rest):
            names, numels, tensors = added.setdefault((grad.device, grad.dtype), ([], [], []))
            names.append(name)
            numels.append(grad.numel())
            tensors.append(grad)
        for key, (names, numels, tensors) in added.items():
            old_names, old_numels, old_tensors = groups.get(key, ([], np.zeros(0, np.int64), []))
            groups[key] = (old_names + names, np.concatenate([old_numels, numels]).astype(np.int64),
                           old_tensors + tensors)
        return groups

    def _gradient_plan(self, optimizer: torch.optim.Optimizer):
        """``(dense, others)``: the plain parameters grouped by (device, dtype) as ``(names,
        numels, params)``, and the ``(name, parameter)`` of the rest (DTensor shards, sparse
        parameters, empty ones), built once per set of parameters; checked against the
        parameters on detailed steps (``p.data = ...`` may change a parameter's dtype or size)."""
        named = self._named_parameters(optimizer)
        key = ("plan", id(optimizer), len(named))
        cached = self._param_group_cache.get(key)
        if cached is not None and cached[0] is named and (not self._detailed_step() or _plan_holds(cached[1][0])):
            return cached[1]
        dense: dict[tuple, tuple[list, list, list]] = {}
        others = []
        for name, p in named:
            if type(p) in (torch.Tensor, torch.nn.Parameter) and not p.is_sparse and p.numel():
                names, numels, params = dense.setdefault((p.device, p.dtype), ([], [], []))
                names.append(name)
                numels.append(p.numel())
                params.append(p)
            else:
                others.append((name, p))
        plan = ({k: (names, np.array(numels, np.int64), params) for k, (names, numels, params) in dense.items()}, others)
        self._param_group_cache[key] = (named, plan)
        return plan

    def _watched(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether our step pre-hook is on ``optimizer`` (not on a freed one that had its id)."""
        entry = self._step_hooks.get(id(optimizer))
        return entry is not None and entry[0]() is optimizer

    def _optimizer_ran(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        self._optimizers_ran.add(id(optimizer))

    @_guarded
    def observe_params(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.step()``: each parameter's peak magnitude (NaN and inf propagate),
        :func:`~ampdoctor.stats.peaks` per (device, dtype). Kept on the device; the step's largest
        rides in its scalars, so a non-finite parameter is an anomaly. Does not sync.

        With ``check_params=True`` this runs on detailed steps (sampled, and escalated after an
        anomaly) and once more when the run closes; with ``"always"`` (or a disabled scaler)
        after every step. Between checks a non-finite parameter still shows: the next forward's
        loss is non-finite, the steps skip (parameters unchanged) and the escalated steps check
        them; ``postmortem`` traces them back over the skipped steps to the step that wrote them."""
        self._stepped = True
        if (self._scaler_enabled and id(optimizer) not in self._optimizers_ran and self._watched(optimizer)
                and not getattr(optimizer, "_step_supports_amp_scaling", False)):
            self._skipped_on_host = True  # torch's step() saw found_inf and did not run the optimizer
        if not self.options.check_params or id(optimizer) in self._params_checked:
            return
        self._param_optimizers.add(optimizer)
        if not (self._params_every_step or self._detailed_step()):
            return
        self._params_checked.add(id(optimizer))
        self._params.extend(self._check_params(optimizer))

    def _check_params(self, optimizer: torch.optim.Optimizer) -> list[ParamPeaks]:
        return [ParamPeaks(names, numels, peaks(tensors)) for names, numels, tensors in self._param_groups(optimizer)]

    def _final_param_check(self) -> None:
        """At the end of the run: check the parameters as they are, unless the step that left
        them so was checked already. That step is the last one recorded, or the iteration in
        progress when an optimizer stepped in it but ``update()`` never came (training died in
        between); its row then carries the last recorded step's scale. After training: may sync."""
        step = self.step if self._stepped else self.step - 1
        if not self.options.check_params or step <= self._last_param_check or self._last_scalars is None:
            return
        params = _merge_params([p for opt in list(self._param_optimizers) for p in self._check_params(opt)])
        if params is None:
            return
        params.peaks = self._copies.to_host(params.peaks)
        self._last_param_check = step
        self.writer.put(ParamRecord(step, self.rank, self.amp_dtype, self._last_scalars, params,
                                    self._copies.seal()))

    def _param_groups(self, optimizer: torch.optim.Optimizer) -> list[tuple[list[str], list[int], list]]:
        """``optimizer``'s parameters grouped by (device, dtype) and named, built once per set of
        parameters (the name lookups and grouping are not redone every step)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        key = (id(optimizer), len(params))
        cached = self._param_group_cache.get(key)
        if cached is not None and all(a is b for a, b in zip(cached[0], params)):
            return cached[1]
        groups: dict[tuple, tuple[list, list, list]] = {}
        for name, p in self._named_parameters(optimizer):
            if p.is_sparse:
                continue
            local = local_tensor(p)
            names, numels, tensors = groups.setdefault((local.device, local.dtype), ([], [], []))
            names.append(name)
            numels.append(local.numel())
            tensors.append(local)  # the parameter itself (read under no_grad): a later p.data = ... shows
        self._param_group_cache[key] = (params, list(groups.values()))
        return self._param_group_cache[key][1]

    def _param_peak(self, device: torch.device) -> tuple[torch.Tensor, float]:
        """The largest parameter peak of the iteration on ``device`` (NaN if any is NaN), and
        whether there was one."""
        if not self._params:
            return torch.zeros((), device=device), 0.0
        tops = [p.peaks.to(device, non_blocking=True).max() for p in self._params if len(p.names)]
        if not tops:
            return torch.zeros((), device=device), 0.0
        return torch.stack(tops).max(), 1.0

    @staticmethod
    def _named_grads(named_params: list[tuple[str, torch.Tensor]]):
        """``(name, gradient)`` of each parameter with a nonempty gradient: this rank's shard of a
        DTensor's (FSDP2), the stored values of a sparse one."""
        for name, p in named_params:
            grad = p.grad
            if grad is None:
                continue
            if type(grad) is not torch.Tensor:
                grad = local_tensor(grad)  # FSDP2: this rank's shard
            if grad.is_sparse:
                # Observed through the stored values. On the CPU coalesced first, so that
                # duplicates are summed as the optimizer will see them; on an accelerator
                # coalescing syncs (its size depends on the data), so an uncoalesced gradient
                # is observed with its duplicate entries apart.
                if not grad.is_coalesced() and grad.device.type == "cpu":
                    grad = grad.coalesce()
                grad = grad._values()
            if grad.numel():  # FSDP1: a rank may hold no shard of a parameter
                yield name, grad

    def _named_parameters(self, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
        """``optimizer``'s parameters with their names, built once per set of parameters."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        key = ("named", id(optimizer), len(params))
        cached = self._param_group_cache.get(key)
        if cached is not None and all(a is b for a, (_, b) in zip(params, cached)):
            return cached
        k = self._optimizer_index.setdefault(id(optimizer), len(self._optimizer_index))
        prefix = "" if k == 0 else f"optimizer{k}."
        named = [(self._names.get(id(p)) or f"{prefix}group{g}.param{i}", p)
                 for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])]
        self._param_group_cache[key] = named
        return named

    @_guarded
    def before_update(self, scaler: torch.amp.GradScaler) -> torch.Tensor | None:
        """Snapshot [scale, found_inf, loss, has_loss] before ``update()`` changes the scale in place."""
        scale = getattr(scaler, "_scale", None)
        if not scaler.is_enabled() or scale is None:
            if self._loss is None and not self._params:
                return None
            device = self._loss.device if self._loss is not None else self._params[0].peaks.device
            peak, has_params = self._param_peak(device)
            loss = self._loss if self._loss is not None else torch.zeros((), device=device)
            return torch.stack([torch.ones_like(loss), torch.zeros_like(loss), loss.float(),
                                torch.full_like(loss, 1.0 if self._loss is not None else 0.0, dtype=torch.float32),
                                peak, torch.full((), has_params, device=device)])
        found = [f.to(scale.device, non_blocking=True)
                 for state in scaler._per_optimizer_states.values()
                 for f in state["found_inf_per_device"].values()]
        if not found:
            return None  # update() without step(): torch raises next, and we record nothing
        if self._loss is not None:
            loss, has_loss = self._loss.to(scale.device, non_blocking=True), 1.0
        else:
            loss, has_loss = torch.zeros((), device=scale.device), 0.0
        peak, has_params = self._param_peak(scale.device)
        return torch.stack([scale.float(), torch.stack(found).sum(), loss.float(),
                            torch.full((), has_loss, device=scale.device), peak,
                            torch.full((), has_params, device=scale.device)])

    @_guarded
    def after_update(self, scalars: torch.Tensor | None) -> None:
        """Hand this iteration to the writer: start the copies, record an event, queue. Then
        look at finished steps for anomalies and plan the next step. No sync."""
        if self.writer.failed:
            self.fail(self.writer.error)
            return
        taps, self._tap_obs = self._tap_obs, []
        mode = self._tap_mode
        record = StepRecord(step=self.step, rank=self.rank, per_tensor=self._per_tensor_step(),
                            amp_dtype=self.amp_dtype, scalars=scalars, groups=self._groups,
                            taps=taps if mode == "full" else [], params=_merge_params(self._params))
        light = None
        if mode == "light" and taps:
            tops = peak_magnitudes([t.stats for t in taps], taps[0].stats[0].device)
            for t in taps:
                t.stats = None
            light = LightStep(self.step, taps, tops, None)
        copy = self._copies.to_host  # non-blocking copies into pinned memory; CPU tensors as they are
        record.scalars = copy(scalars) if scalars is not None else None
        for item in (*record.groups, *record.taps):
            item.stats = item.stats.to_host(copy)
        if record.params is not None:
            record.params.peaks = copy(record.params.peaks)
        record.event = self._copies.seal()
        if mode is not None and self._taps is not None and self._taps.calls == 0 and self._observed:
            self._taps_off(f"no module tap fired in step {self.step} although gradients were "
                           "recorded: the model runs under torch.compile, or model= is not the "
                           "module being trained")
        if self._dropped_taps and not self._warned_dropped:
            self._warned_dropped = True
            warnings.warn(f"ampdoctor: more than {MAX_TAP_ROWS_PER_STEP} module observations in "
                          "one step (a long forward-only loop?); the rest of such steps is not "
                          "recorded", RuntimeWarning, stacklevel=3)
        self._dropped_taps = 0
        self._groups, self._loss, self._observed = [], None, set()
        if self._params:
            self._last_param_check = self.step  # queued with this step's record
        self._params, self._params_checked, self._stepped = [], set(), False
        self._backward_scale, self._inv_scales = None, {}
        if not self.writer.put(record) and not self.writer.closed and not self.writer.failed:
            self._step_dropped()
        if light is not None:
            light.scalars, light.event = record.scalars, record.event
            self._flight.append(light)
        if self._skipped_on_host:
            self._on_anomaly(self.step, seen_on_host=True)
        self._skipped_on_host = False
        self._optimizers_ran.clear()
        self._pending_checks.append((self.step, record.scalars, record.event))
        self._check_anomalies(wait=False)
        self.step += 1
        self._remove_sniff()  # the autocast dtype is known after the first iteration or never
        self._plan_step()

    def _taps_off(self, why: str) -> None:
        """Stop module taps for good (warning once); the rest of the recording goes on."""
        warnings.warn(f"ampdoctor: {why}. Module rows are off; recording continues at "
                      "level='params'", RuntimeWarning, stacklevel=5)
        self._taps.remove()
        self._taps, self._tap_mode = None, None

    def _detailed_step(self) -> bool:
        """Whether this step's gradients get the full statistics (counts, histograms): every
        ``every`` steps, and the ``escalate_steps`` after an anomaly."""
        return self.step % self.options.gradient_interval == 0 or self.step < self._escalate_until

    def _per_tensor_step(self) -> bool:
        """Whether this step writes a row per parameter (else only the step row)."""
        return self.options.level != "steps" or self.step < self._escalate_until

    def _plan_step(self) -> None:
        """Decide what the module taps record in the step about to start; (un)install them."""
        if self._taps is None:
            self._tap_mode = None
            return
        escalated = self.step < self._escalate_until
        mode = None
        if self.options.level == "full":
            if escalated or self.step % self.options.module_interval == 0:
                mode = "full"
            elif self.options.flight_steps:
                mode = "light"
        elif escalated:
            mode = "full"
        self._tap_mode = mode
        self._taps.reset()
        if mode is None:
            self._taps.remove()
            return
        try:
            self._taps.install()
        except Exception as exc:  # noqa: BLE001 - e.g. a module type that refuses hooks
            self._taps_off(f"module taps could not be installed ({type(exc).__name__}: {exc})")

    # -- anomalies: the flight recorder and escalation ---------------------------------------
    def _check_anomalies(self, *, wait: bool, deadline: float | None = None) -> None:
        """Read the scalars of finished steps (those whose copy event has completed; all of
        them when ``wait``, which syncs, until ``deadline`` if given) and react to the first
        anomaly of a run of them."""
        while self._pending_checks:
            step, scalars, event = self._pending_checks[0]
            if event is not None:
                if wait and deadline is None:
                    event.synchronize()
                elif wait:
                    while not event.query():
                        if time.monotonic() > deadline:
                            return
                        time.sleep(0.01)
                elif not event.query():
                    break
            self._pending_checks.popleft()
            self._checked_until = step + 1
            if scalars is not None:
                self._last_scalars = scalars
            scale, skipped, loss, params = _read_scalars(scalars)
            floor = self.options.scale_floor
            below = floor is not None and scalars is not None and scale < floor
            fatal = ((loss is not None and not math.isfinite(loss))
                     or (params is not None and not math.isfinite(params)))
            if skipped or fatal or (below and not self._below_floor):
                self._on_anomaly(step, fatal=fatal)
            self._below_floor = below
        # A checked step can still be in the window of an anomaly up to flight_steps - 1 later.
        horizon = self._checked_until - self.options.flight_steps
        while self._flight and self._flight[0].step < horizon:
            self._flight.popleft()

    def _on_anomaly(self, step: int, *, fatal: bool = False, seen_on_host: bool = False) -> None:
        """Write out the flight recorder's steps up to ``step`` and escalate the next steps, once
        per anomalous step. ``seen_on_host``: a skip known at ``step()`` already (torch read
        found_inf), before its copies have landed; the later check of its scalars comes back
        here for the rest."""
        if step > self._handled_anomaly:
            self._handled_anomaly = step
            window = [e for e in self._flight if step - self.options.flight_steps < e.step <= step]
            later = [e for e in self._flight if e.step > step]  # seen already, checked later
            self._flight.clear()
            self._flight.extend(later)
            if window:
                for e in window:
                    e.peaks = self._copies.to_host(e.peaks)
                self.writer.put(FlightRecord(self.rank, window, self._copies.seal()))
            if self.options.escalate_steps:
                self._escalate_until = max(self._escalate_until, self.step + 1 + self.options.escalate_steps)
        if seen_on_host:
            return  # waiting for the writer now would wait for this step's copies: a sync
        # The anomaly's rows go to disk now, before the process can die of it (the step's own
        # record is queued already; its materialization closes a segment at once). A run of
        # skipped steps waits only at its first: a collapsing run must not also crawl; a non-finite
        # loss or parameter, which training may not survive, always waits.
        if (fatal or step != self._last_anomaly + 1) and not self._closing:
            self.writer.sync()
        self._last_anomaly = step

    # -- worker thread -----------------------------------------------------------------------
    def _metadata(self) -> dict[str, str]:
        return {
            META_SCHEMA_VERSION: str(SCHEMA_VERSION), META_VERSION: __version__,
            META_TORCH_VERSION: torch.__version__, **self._scaler_meta,
            "amp.dtype": self.amp_dtype, "world_size": str(self.world_size),
            "hist.min_exp": str(self.options.hist_min_exp), "hist.bins": str(self.options.hist_bins),
            "run.id": self.run_id, "run.started": self.started, "record.level": self.options.level,
            "record.dropped_steps": str(self.dropped_steps),
        }

    def _materialize(self, record: StepRecord | FlightRecord | ParamRecord):
        """Rows of one record, as ``([(columns, n_rows), ...], anomaly)``: a step row, one row
        per observed gradient, one per module observation; or a flight record's light rows."""
        if record.event is not None:
            record.event.synchronize()
        if isinstance(record, FlightRecord):
            for light in record.steps:  # their scalars came with their own step's copies
                if light.event is not None:
                    light.event.synchronize()
            return [self._light_rows(s, record.rank) for s in record.steps], True
        if isinstance(record, ParamRecord):
            scale, skipped, _, _ = _read_scalars(record.scalars)
            common = dict(step=record.step, rank=record.rank, scale=scale, skipped=skipped)
            block = _param_rows(record.params, common, float_format(record.amp_dtype).max)
            return [block], not np.isfinite(block[0]["amax"][0])
        scale, skipped, loss, param_peak = _read_scalars(record.scalars)
        parts = [HostStats.of(g.stats) for g in record.groups]
        if parts:
            merged = HostStats.concat(parts)
            total = merged.total()
        else:
            merged, total = None, _empty_stats(self.options.hist_bins)
        names = [""]
        dtypes = [record.amp_dtype]
        numels = [int(sum(g.numels.sum() for g in record.groups))]
        stats = [total]
        if record.per_tensor and merged is not None:
            for g in record.groups:
                names.extend(g.names)
                dtypes.extend([g.dtype] * len(g.names))
                numels.extend(g.numels.tolist())
            stats.append(merged)
        kinds = ["step"] + ["param_grad"] * (len(names) - 1)
        common = dict(step=record.step, rank=record.rank, scale=scale, skipped=skipped)
        blocks = [_block(**common, kinds=kinds, names=names, dtypes=dtypes, numels=numels,
                         stats=_stat_columns(HostStats.concat(stats)), losses=[loss])]
        if record.taps:
            taps = record.taps
            blocks.append(_block(
                **common, kinds=[t.kind for t in taps], names=[t.call.name for t in taps],
                dtypes=[t.dtype for t in taps], numels=[t.numel for t in taps],
                stats=_stat_columns(HostStats.concat([HostStats.of(t.stats) for t in taps])),
                **_call_columns(taps)))
        if record.params is not None:
            blocks.append(_param_rows(record.params, common, float_format(record.amp_dtype).max))
        anomaly = (skipped or (loss is not None and not np.isfinite(loss))
                   or (param_peak is not None and not np.isfinite(param_peak)))
        return blocks, anomaly

    def _light_rows(self, light: LightStep, rank: int) -> tuple[dict[str, np.ndarray], int]:
        """A flight-recorder step: only ``amax`` is measured, as the peak magnitude (NaN or inf
        when the tensor held one); the other statistics are null."""
        scale, skipped, _, _ = _read_scalars(light.scalars)
        taps = light.taps
        peaks = light.peaks.numpy().astype(np.float32)
        inv = np.float32(1.0 / np.float64(scale))  # as torch's unscale_: fp32 1/scale
        grads = np.array([t.kind == "grad_output" for t in taps])
        with np.errstate(over="ignore", invalid="ignore"):
            amax = np.where(grads, peaks * inv, peaks).astype(np.float32)
        stats = _light_columns(amax)
        return _block(step=light.step, rank=rank, scale=scale, skipped=skipped,
                      kinds=[t.kind for t in taps], names=[t.call.name for t in taps],
                      dtypes=[t.dtype for t in taps], numels=[t.numel for t in taps], stats=stats,
                      **_call_columns(taps))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (FSDP2 parameters and gradients;
    reductions on the DTensor itself would be collectives), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None and type(t).__name__ == "DTensor" else t


def _plan_holds(dense: dict) -> bool:
    """Whether every planned parameter still has its group's device and dtype and its size."""
    return all(p.device == device and p.dtype == dtype and p.numel() == n
               for (device, dtype), (_, numels, params) in dense.items() for p, n in zip(params, numels.tolist()))


def _read_scalars(scalars: torch.Tensor | None) -> tuple[float, bool, float | None, float | None]:
    """(scale, skipped, loss or None, largest parameter peak or None) from a host copy of
    before_update's snapshot."""
    if scalars is None:
        return 1.0, False, None, None
    scale, found_inf, loss, has_loss, peak, has_params = (float(v) for v in scalars.tolist())
    return scale, found_inf > 0, (loss if has_loss else None), (peak if has_params else None)


def _merge_params(parts: list[ParamPeaks]) -> ParamPeaks | None:
    """One :class:`ParamPeaks` for the iteration (every optimizer and device), on one device."""
    parts = [p for p in parts if p.names]
    if not parts:
        return None
    device = parts[0].peaks.device
    return ParamPeaks([n for p in parts for n in p.names], [k for p in parts for k in p.numels],
                      torch.cat([p.peaks.to(device, non_blocking=True) for p in parts]))


def _param_rows(params: ParamPeaks, common: dict, amp_max: float) -> tuple[dict[str, np.ndarray], int]:
    """``param`` rows: one for all parameters together (name ""), plus one per parameter that
    is not finite or is beyond the AMP format's max (autocast would cast it to inf). Light rows:
    only ``amax``, the peak ``max |w|`` (NaN or inf when it held one)."""
    peaks = params.peaks.numpy().astype(np.float32)
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero(~np.isfinite(peaks) | (peaks > amp_max))
    with np.errstate(invalid="ignore"):
        total = np.float32(np.nan) if np.isnan(peaks).any() else peaks.max()
    names = [""] + [params.names[i] for i in bad]
    numels = [int(sum(params.numels))] + [params.numels[i] for i in bad]
    amax = np.concatenate([[total], peaks[bad]]).astype(np.float32)
    n = len(names)
    return _block(**common, kinds=["param"] * n, names=names, dtypes=["float32"] * n, numels=numels,
                  stats=_light_columns(amax))


def _objects(n: int, values=None) -> np.ndarray:
    """An object column of ``n`` entries (None where ``values`` has none)."""
    out = np.full(n, None, dtype=object)
    if values is not None:
        for i, v in enumerate(values):
            out[i] = v
    return out


def _light_columns(amax: np.ndarray, l2: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The statistics columns of light rows: the peak magnitude as ``amax`` (NaN or inf when the
    tensor held one), the norm where measured; the rest null."""
    nulls = np.full(len(amax), None, dtype=object)
    return {"amax": amax, "amin": nulls, "l2": nulls if l2 is None else l2, "n_zero": nulls,
            "n_subnormal": nulls, "n_nan": nulls, "n_inf": nulls, "hist": nulls, "n_zero_lines": nulls}


def _stat_columns(s: HostStats) -> dict[str, np.ndarray]:
    if s.light:
        return _light_columns(s.amax, s.l2)
    return {"amax": s.amax, "amin": s.amin, "l2": s.l2, "n_zero": s.n_zero,
            "n_subnormal": s.n_subnormal, "n_nan": s.n_nan, "n_inf": s.n_inf, "hist": s.hist,
            "n_zero_lines": _objects(len(s.amax), [None if np.isnan(v) else int(v) for v in s.n_zero_lines])}


def _call_columns(taps: list[TapObservation]) -> dict[str, list]:
    return {"orders": [t.order for t in taps], "calls": [t.call.call for t in taps],
            "parents": [t.call.parent for t in taps], "inputs": [list(t.call.inputs) for t in taps]}


def _block(*, step: int, rank: int, scale: float, skipped: bool, kinds: list[str], names: list[str],
           dtypes: list[str], numels: list[int], stats: dict[str, np.ndarray], losses=None,
           orders=None, calls=None, parents=None, inputs=None) -> tuple[dict[str, np.ndarray], int]:
    """One block of rows with every column of the schema."""
    n = len(kinds)
    return {
        "step": np.full(n, step, dtype=np.int64),
        "rank": np.full(n, rank, dtype=np.int32),
        "kind": np.array(kinds, dtype=object),
        "name": np.array(names, dtype=object),
        "order": _objects(n, orders),
        "dtype": np.array(dtypes, dtype=object),
        "numel": np.array(numels, dtype=np.int64),
        "scale": np.full(n, scale, dtype=np.float32),
        "skipped": np.full(n, skipped, dtype=bool),
        "loss": _objects(n, losses),
        **stats,
        "call": _objects(n, calls),
        "parent": _objects(n, parents),
        "inputs": _objects(n, inputs),
    }, n


def _empty_stats(bins: int) -> HostStats:
    return HostStats(np.zeros(1, np.float32), np.full(1, np.nan, np.float32), np.zeros(1, np.float32),
                     *(np.zeros(1, np.int64) for _ in range(4)), np.zeros((1, bins), np.int32))


def _tensors(outputs) -> Iterable[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        yield outputs
    elif isinstance(outputs, (list, tuple)):
        for o in outputs:
            yield from _tensors(o)


def _current_scale(scaler: torch.amp.GradScaler) -> float:
    """The scale a recording starts from. Reads the device scale once (a sync) when wrapping a
    scaler that has already been used; free for a new scaler."""
    if not scaler.is_enabled():
        return 1.0
    if getattr(scaler, "_scale", None) is None:
        return float(scaler._init_scale)
    return float(scaler.get_scale())


def recorder_for(scaler: torch.amp.GradScaler, model: torch.nn.Module | None, options: RecordOptions, *,
                 scaler_class: str, start_step: int = 0) -> Recorder | None:
    """A :class:`Recorder` for this process, or None when its rank is not among ``options.ranks``.

    Every rank of a run shares one ``run.id``: ``$AMPDOCTOR_RUN_ID`` or torchrun's
    ``$TORCHELASTIC_RUN_ID`` when set, else rank 0's, broadcast. That broadcast is a collective:
    with ``torch.distributed`` initialized (and no such variable), every rank must create its
    scaler, recording or not. It happens once, at construction. Rank 0's id is new, except when
    ``start_step`` > 0 (a resumed run): then it continues the latest run already at the path."""
    rank, world_size = _rank_and_world(options.rank)
    run_id = _shared_run_id(world_size, options.path if start_step > 0 else None, model)
    if options.ranks is not None and rank not in options.ranks:
        return None
    return Recorder(scaler, model, options, scaler_class=scaler_class, start_step=start_step, run_id=run_id)


def _env_run_id() -> str | None:
    for key in ("AMPDOCTOR_RUN_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(key)
        if value and value != "none":  # torchrun's default rendezvous id is "none"
            return value
    return None


def broadcast_device(model: torch.nn.Module | None) -> torch.device | None:
    """The device this rank's collectives use: NCCL's default is ``torch.cuda.current_device()``,
    which is GPU 0 on every rank that never called ``set_device``. The model's device when it is
    on a GPU; else, under NCCL, ``LOCAL_RANK``'s GPU when this process sees that many (one GPU per
    process through ``CUDA_VISIBLE_DEVICES`` sees only GPU 0); else the backend's default (None)."""
    if model is not None:
        for p in model.parameters():
            if p.device.type == "cuda":
                return p.device
            break  # on the CPU or meta (deferred initialization): no help
    dist = torch.distributed
    if dist.get_backend() == "nccl":
        local = os.environ.get("LOCAL_RANK")
        if local is not None and int(local) < torch.cuda.device_count():
            return torch.device("cuda", int(local))
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _shared_run_id(world_size: int, resume_at: str | os.PathLike | None = None,
                   model: torch.nn.Module | None = None) -> str | None:
    # Resuming: the latest run at the path, unless the user named the run (torchrun makes a new
    # rendezvous id at every launch, so its id cannot say which run is resumed).
    explicit = os.environ.get("AMPDOCTOR_RUN_ID") or None
    env = _env_run_id()
    if explicit is not None or (resume_at is None and env is not None):
        return explicit or env
    dist = torch.distributed
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        box = [(_latest_run_id(resume_at) or env or uuid.uuid4().hex) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0, device=broadcast_device(model))
        return box[0]
    shared = _latest_run_id(resume_at) or env
    if shared is None and world_size > 1:
        warnings.warn(f"ampdoctor: {world_size} ranks but torch.distributed is not initialized and no "
                      f"AMPDOCTOR_RUN_ID is set: the ranks cannot agree on one run id, so each will be read as a "
                      f"run of its own; create the scaler after init_process_group, or set AMPDOCTOR_RUN_ID",
                      RuntimeWarning, stacklevel=4)
    return shared


def _latest_run_id(path: str | os.PathLike | None) -> str | None:
    """The id of the latest run at ``path`` (the one a resumed run continues), or None."""
    if path is None:
        return None
    from .run import read_run  # the reader, lazily: recording does not need it otherwise
    try:
        return read_run(path).metadata.get("run.id") or None
    except Exception:  # noqa: BLE001 - no run there (or none readable): a new run
        return None


def _rank_and_world(rank: int | None) -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return (dist.get_rank() if rank is None else rank), dist.get_world_size()
    return (int(os.environ.get("RANK", 0)) if rank is None else rank,
            int(os.environ.get("WORLD_SIZE", 1)))


_sigterm_installed = False
_open_recorders: "weakref.WeakSet[Recorder]" = weakref.WeakSet()


EXIT_TIMEOUT = 30.0  # seconds each wait at exit may take: a hung disk must not hang the exit


@atexit.register  # registered after the writer module's handler, so it runs before it
def _close_open_recorders() -> None:
    """At interpreter exit (training is over, also after an exception): finish every open run
    as ``close()`` would, final parameter check included, with bounded waits. Never raises: one
    run's failure (even with ``strict=True``) must not keep the others from closing."""
    for recorder in list(_open_recorders):
        try:
            recorder.close(EXIT_TIMEOUT, at_exit=True)
        except BaseException as exc:  # noqa: BLE001
            warnings.warn(f"ampdoctor: closing {recorder.path} at exit failed ({type(exc).__name__}: {exc})",
                          RuntimeWarning)


def _install_sigterm_handler() -> None:
    """Flush every open run on SIGTERM, then let the previous handler (or the default) act."""
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        # No lock here: the interrupted frame may hold any of them (a queue's, ours). A program
        # that handles SIGTERM itself may train on: its runs are flushed, not finished (exit or
        # close() finishes them); otherwise the default action ends the process: finish them.
        dies = not callable(previous) and previous != signal.SIG_IGN
        close_all_writers(from_signal=True, timeout=EXIT_TIMEOUT, finish=dies)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
        _sigterm_installed = True
    except (ValueError, OSError):  # not allowed here (embedded interpreter); atexit still flushes
        pass
