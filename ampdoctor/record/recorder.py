"""The recorder: wires the recording parts for one scaler and takes its calls.

The scaler calls, per iteration, ``observe_loss`` (from ``scale``), ``observe_grads`` (from
``unscale_``/``step``, before torch unscales, so the values are the scaled ones backward produced),
``observe_params`` (after ``step``), ``before_update`` and ``after_update``. None of them syncs:
statistics stay on the device and ``after_update`` hands the step to the writer
(:mod:`ampdoctor.record.handoff`). Every method is guarded: an exception of ours warns once and
stops recording, and is raised (as :class:`RecorderError`) only with ``strict=True``. The parts it
wires are listed in :mod:`ampdoctor.record`: each is a module of its own.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import uuid
import warnings
import weakref
from typing import Iterable

import torch

from ..errors import RecorderError
from ..float_formats import dtype_name, float_format
from ..stats import SlotLayouts, full_stats, light_stats
from . import shutdown
from .anomalies import AnomalyWatch
from .gemm_operands import MAX_BLOCK_STATS, MAX_FINE_HISTS, GemmOperands, is_gemm
from .handoff import start_copies, step_scalars
from .hooks import ModuleCall, ModuleHook, ModuleTaps, check_module_filter, clean_name, is_compiled, unwrap_model
from .light_taps import LightTaps, Repeat
from .live_status import LiveStatus
from .measured_steps import MeasuredSteps
from .options import RecordOptions, default_path
from .param_checks import OptimizerSteps
from .parameters import ParameterIndex
from .plan import StepPlan
from .records import GroupRecord, ParamRecord, StepRecord, TapObservation, merge_params
from .rows import materialize
from .run_identity import env_run_id, rank_and_world
from .run_metadata import RunMetadata
from .transfer import HostCopies
from .writer import RunWriter

MAX_TAP_ROWS_PER_STEP = 100_000  # beyond this (a long forward-only loop between steps) rows are dropped


def _guarded(method):
    """Run a recorder method so that a failure never reaches the training loop (unless strict)."""

    @functools.wraps(method)
    def run(self: "Recorder", *args, **kwargs):
        if not self.active:
            if self._measured.active:  # (stopped inside a measured step's backward: leave its mode here)
                self._measured.end(self.step)
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
        # (ampdoctor's own arguments were checked by recorder_for, the one caller: check_arguments)
        try:
            self._set_up(scaler, model, options, scaler_class, start_step, run_id)
        except BaseException:
            self._abandon()  # what was installed before the failure: hooks, the writer, the exit entry
            raise

    def _set_up(self, scaler: torch.amp.GradScaler, model: torch.nn.Module | None, options: RecordOptions,
                scaler_class: str, start_step: int, run_id: str | None) -> None:
        self.options = options
        self.active = True
        self.step = start_step
        self.path = os.fspath(options.path) if options.path is not None else default_path()
        self.device_type = torch.device(getattr(scaler, "_device", "cuda")).type
        self._observed: set[int] = set()
        self._groups: list[GroupRecord] = []
        self._loss: torch.Tensor | None = None
        self._layouts = SlotLayouts()
        self._copies = HostCopies()
        self._reported = False  # a failure has been warned about (or raised)
        self.dropped_steps = 0  # step records the writer could not take (its queue was full)
        self._sniff_handle = None
        self._amp_dtype = dtype_name(options.amp_dtype) if options.amp_dtype is not None else None
        # Module taps, the flight recorder and escalation.
        self._taps: ModuleTaps | None = None
        self._module_stats: str | None = None   # what module taps record in the step in progress (plan.py)
        self._tap_obs: list[TapObservation] = []   # full module statistics of the step in progress
        # A tensor seen twice in a row gets its statistics once (per kind: only gradients are unscaled)
        self._tap_repeats = {"output": Repeat(), "grad_output": Repeat()}
        self._light_taps = LightTaps(MAX_TAP_ROWS_PER_STEP)  # light ones (the flight recorder's)
        self._dropped_taps = 0
        self._warned_dropped = False
        self._warned_hists = False  # (the GEMM operands' fine histograms beyond their cap)
        self._warned_blocks = self._warned_blocks_failed = False  # (their block statistics: beyond the cap, failed)
        self._backward_scale: torch.Tensor | None = None  # the scale this step's backward used
        self._inv_scales: dict[torch.device, torch.Tensor] = {}
        self._plan = StepPlan(options, start_step)
        self._gemm: GemmOperands | None = None  # the GEMM operands FP8 would cast (level="full": gemm_operands.py)
        self._measured = MeasuredSteps()  # the float32 shadow backward of measured steps
        self.rank, self.world_size = rank_and_world(options.rank)
        self.run_id = run_id or env_run_id() or uuid.uuid4().hex
        inner = unwrap_model(model) if model is not None else None
        self._run_metadata = RunMetadata(scaler, scaler_class, options, device_type=self.device_type,
                                         world_size=self.world_size, model=inner)
        self._compiled = model is not None and is_compiled(model)
        self._parameters = ParameterIndex(
            {id(p): clean_name(n) for n, p in inner.named_parameters()} if inner is not None else {})
        self._optimizers = OptimizerSteps(self._parameters, options.check_params, scaler.is_enabled(), start_step)
        if inner is not None:
            if self._compiled:
                if options.level == "full" or self._plan.measure_every:
                    self._measured.warned = True  # (said here: no second warning at the first measured step)
                    warnings.warn("ampdoctor: the model is compiled with torch.compile; module taps "
                                  "and the measured underflow are off (the estimate stands in), and "
                                  "recording continues at level='params'", RuntimeWarning, stacklevel=4)
            else:
                self._taps = ModuleTaps(inner, options.modules, self, gemm=is_gemm if options.level == "full" and options.fp8 else None)
                if self._taps.gemm_layers:
                    self._gemm = GemmOperands(self._taps.gemm_layers, self._light_taps.repeat, MAX_TAP_ROWS_PER_STEP,
                                              self._inv_scale)
                    self._plan.light_taps = True  # the operands' peaks every step, flight recorder or not
                    self._run_metadata.gemm_layers({n: type(m).__name__ for n, m in self._taps.gemm_layers.items()})
            if self._amp_dtype is None:
                self._sniff_handle = inner.register_forward_pre_hook(ModuleHook(inner, self._sniff_autocast))
        self.writer = RunWriter(
            self.path, metadata=self._metadata, materialize=functools.partial(materialize, hist_bins=options.hist_bins),
            rank=self.rank,
            hist_bins=options.hist_bins, flush_every=options.flush_every,
            flush_seconds=options.flush_seconds, queue_size=options.queue_size)
        # At exit: is this still the scaler's recorder? And a scaler dropped without close() stops
        # the module taps, whose hooks on the model would otherwise keep this recorder recording,
        # and its writer's thread (this recorder may be collected with the scaler).
        self._scaler_ref = weakref.ref(scaler, _when_dropped(weakref.ref(self), self.writer))
        self._anomalies = AnomalyWatch(self._plan, self.writer, self._copies, rank=self.rank,
                                       flight_steps=options.flight_steps, scale_floor=options.scale_floor,
                                       start_step=start_step)
        self._status = LiveStatus(self.path, options.level, self.rank, self.world_size)
        shutdown.opened(self)
        self._check_path()
        self._plan_step()

    # -- lifecycle -------------------------------------------------------------------------
    def _stop_recording(self) -> None:
        """The writer was closed by someone else (its thread's ``stop()``, a signal): stop the
        taps and observations, which would compute for nobody. No warning: nothing failed."""
        self.active = False
        self._remove_hooks()
        self._measured.drop("recording stopped")

    def _abandon(self) -> None:
        """Undo a set-up that failed half-way: nothing of it stays on the model, the disk or the
        process (the writer never started: closed as at exit, it writes nothing)."""
        for undo in (lambda: self._remove_hooks(), lambda: self.writer.close(0, at_exit=True),
                     lambda: shutdown.closed(self)):
            try:
                undo()
            except Exception:  # noqa: BLE001 - the part was never made (AttributeError) or cannot be undone
                pass
        self.active = False

    def fail(self, exc: BaseException) -> None:
        """Stop recording after ``exc``: warn once, or raise in strict mode."""
        self.active = False
        self._remove_hooks()
        self._measured.drop("recording stopped")  # (a flag: this may be an autograd thread)
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
        """Flush and finish the run. Idempotent. Waits for the last anomaly checks (their copies:
        the device's queued work) and then for the writer thread while it makes progress, at most
        :data:`~ampdoctor.record.writer.CLOSE_TIMEOUT` (5 s) after its last (``RunWriter.close``); with
        ``timeout``, at most that in all: host-side waits only, after training. ``at_exit``: the interpreter
        is exiting; the final parameter check runs only if this is still its scaler's recorder
        (an abandoned scaler's run must not describe parameters that another scaler went on
        training), and the writer counts what it cannot write in time (writer.py)."""
        self._anomalies.closing = True  # the close writes everything: anomalies found now need no sync of their own
        self._measured.end(self.step)  # (a run closed, or stopped, between scale() and unscale_: leave the shadow backward)
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.active:
            try:
                self._anomalies.check(self.step, wait=True, deadline=deadline)
                scaler = self._scaler_ref()
                if not at_exit or (scaler is not None and getattr(scaler, "recorder", None) is self):
                    self._final_param_check()
            except Exception as exc:  # noqa: BLE001
                self.fail(exc)
        self._remove_hooks()
        self.active = False
        shutdown.closed(self)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())  # (None: CLOSE_TIMEOUT)
        finished = self.writer.close(left, at_exit=at_exit)
        if self.writer.error is not None and not self._reported:
            self.fail(self.writer.error)
        elif not finished and not self._reported:
            self._reported = True
            warnings.warn(f"ampdoctor: the writer did not finish {self.path} in time (a stalled disk?); its last "
                          f"steps may be missing", RuntimeWarning, stacklevel=3)
        self._status.finished(self.run_id, self._anomalies.seen, self.dropped_steps)

    @_guarded
    def set_step(self, step: int) -> None:
        """Continue the step numbering at ``step`` (a resumed or rolled-back run): the flight
        recorder and pending anomaly checks of the abandoned steps are dropped."""
        self.step = step
        self._plan.rewind(step)
        self._anomalies.rewind(step)
        self._optimizers.rewind(step)
        self._plan_step()

    def use_copies(self, copies: HostCopies) -> None:  # tests: fences whose events complete late
        self._copies = self._anomalies.copies = copies

    def continue_run(self, run_id: str) -> None:
        """Record into the run ``run_id`` (a resumed run: its scaler's state_dict was loaded),
        not a new one beside it. Segments written from now on carry that id."""
        self.run_id = run_id

    def _remove_hooks(self) -> None:
        self._remove_sniff()
        self._optimizers.remove()
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

    @_guarded
    def observe_loss(self, outputs: torch.Tensor | Iterable, scale: torch.Tensor | None = None) -> None:
        """Add the unscaled value(s) passed to ``scale()`` to this iteration's loss; ``scale`` is
        the loss scale their backward will carry (None: not scaled)."""
        self._backward_scale = scale
        for t in _tensors(outputs):
            value = t.detach().float().sum()
            self._loss = value if self._loss is None else self._loss + value.to(self._loss.device)

    @_guarded
    def observe_scaled(self, scaled: torch.Tensor | Iterable) -> None:
        """The scaled loss(es) ``scale()`` returns, whose backward comes next: on a measured step,
        seed the shadow backward with them and make it active (:mod:`ampdoctor.record.underflow_probe`).
        Skipped, with one warning, where it cannot run safely: another dispatch mode is active
        (it would sit above ours and could leave first), the model is compiled, or inside
        ``torch.compile``. No sync."""
        if self._measured.probe is not None:
            roots = [t for t in _tensors(scaled) if t.requires_grad]
            self._measured.start(roots, self.step, self._compiled)

    def observe_tap(self, kind: str, call: ModuleCall, order: int, tensor: torch.Tensor) -> None:
        """Full statistics of a tensor a module tap saw (``output``, or ``grad_output``: still
        scaled). Called from module and node hooks, per tensor; not guarded, because the hooks
        hand any failure to :meth:`fail` themselves. On light steps the taps call
        :meth:`LightTaps.add <ampdoctor.record.light_taps.LightTaps.add>` instead (:meth:`_plan_step`).
        Does not sync."""
        if self._module_stats != "full":
            return
        if len(self._tap_obs) >= MAX_TAP_ROWS_PER_STEP:
            self._dropped_taps += 1
            return
        inv = self._inv_scale(tensor.device) if kind == "grad_output" else None
        stats = self._tap_repeats[kind].of(tensor, lambda t: full_stats(
            [t], inv_scale=inv, subnormal_below=float_format(t.dtype).smallest_normal,
            hist_min_exp=self.options.hist_min_exp, hist_bins=self.options.hist_bins, layouts=self._layouts,
            lines="features"))
        probe = self._measured.during_backward() if kind == "grad_output" else None
        measured = probe.count(tensor) if probe is not None else None
        lost = None
        if measured is not None:
            # The magnitudes of what underflowed (underflow_hist): how much of the count may be
            # rounding noise (analysis/calibration.py). A copy, freed here: the backward still
            # reads the shadow.
            values = probe.lost_copy(tensor)
            if values is not None:
                lost = full_stats([values], inv_scale=inv, subnormal_below=float_format(tensor.dtype).smallest_normal,
                                  hist_min_exp=self.options.hist_min_exp, hist_bins=self.options.hist_bins)
        self._tap_obs.append(TapObservation(kind, call, order, dtype_name(tensor.dtype), tensor.numel(), stats,
                                            measured, lost))

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
        self._optimizers.watch(optimizer)
        full = self._plan.gradient_stats(self.step) == "full"
        per_tensor = self._plan.per_tensor(self.step)
        inv_scale = scale.double().reciprocal().float() if scale is not None else None
        below = float_format(self.amp_dtype).smallest_normal
        self._measured.end(self.step)
        probe = self._measured.after_backward()
        groups = self._parameters.gradient_groups(optimizer, check=full)
        for (device, dtype), (names, numels, tensors) in groups.items():
            inv = inv_scale.to(device, non_blocking=True) if inv_scale is not None else None
            if full:
                stats = full_stats(tensors, inv_scale=inv, subnormal_below=below, per_tensor=per_tensor,
                                     hist_min_exp=self.options.hist_min_exp,
                                     hist_bins=self.options.hist_bins, layouts=self._layouts)
            else:
                stats = light_stats(tensors, inv_scale=inv)
            measured = probe.counts(tensors) if probe is not None and full else None
            lost = None
            if measured is not None:
                # The magnitudes of what underflowed: where a higher scale would still lose them
                # (analysis/calibration.py). Measured steps only; the shadows' last use.
                lost = full_stats(probe.lost_values(tensors), inv_scale=inv, subnormal_below=below,
                                  hist_min_exp=self.options.hist_min_exp, hist_bins=self.options.hist_bins)
            self._groups.append(GroupRecord(names, dtype_name(dtype), numels, stats, measured, lost))

    @_guarded
    def observe_params(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.step()``: whether it ran, and the parameter check on the steps that
        have one (:mod:`ampdoctor.record.param_checks`). Does not sync."""
        self._optimizers.stepped_by(optimizer, self._plan.gradient_stats(self.step) == "full")

    def _final_param_check(self) -> None:
        """At the end of the run: check the parameters as they are, unless the step that left
        them so was checked already; its row carries the last recorded step's scale. After
        training: may sync."""
        scalars = self._anomalies.last_scalars
        found = self._optimizers.final_check(self.step) if scalars is not None else None
        if found is None:
            return
        step, params = found
        params.peaks = self._copies.to_host(params.peaks)
        self.writer.put(ParamRecord(step, self.rank, self.amp_dtype, scalars, params, self._copies.seal()))

    @_guarded
    def before_update(self, scaler: torch.amp.GradScaler) -> torch.Tensor | None:
        """The step's scalars, taken before ``update()`` changes the scale in place
        (:func:`~ampdoctor.record.handoff.step_scalars`). No sync."""
        return step_scalars(scaler, self._loss, self._optimizers.checks)

    @_guarded
    def after_update(self, scalars: torch.Tensor | None) -> None:
        """Hand this iteration to the writer: start the copies, record an event, queue. Then
        look at finished steps for anomalies and plan the next step. No sync."""
        if self.writer.failed:
            self.fail(self.writer.error)
            return
        if self.writer.closed:  # closed from outside: a thread check's stop(), a signal; nothing more is written
            self._stop_recording()
            return
        taps, self._tap_obs = self._tap_obs, []
        for repeat in self._tap_repeats.values():
            repeat.clear()
        module_stats = self._module_stats
        record = StepRecord(step=self.step, rank=self.rank, per_tensor=self._plan.per_tensor(self.step),
                            amp_dtype=self.amp_dtype, scalars=scalars, groups=self._groups,
                            taps=taps if module_stats == "full" else [], params=merge_params(self._optimizers.checks))
        self._dropped_taps += self._light_taps.dropped
        flight_step = self._light_taps.flight_step(self.step)
        if self._gemm is not None and module_stats is not None:
            self._dropped_taps += self._gemm.dropped  # (beyond the per-step limit: warned below)
            record.gemm = self._gemm.finish(self.step)
        self._measured.end(self.step)
        if not self._measured.step_done(self.step):
            self._plan.measure_every = 0
        start_copies(record, self._copies)
        if module_stats is not None and self._taps is not None and self._taps.calls == 0 and self._observed:
            self._compiled = True
            self._taps_off(f"no module tap fired in step {self.step} although gradients were "
                           "recorded: the model runs under torch.compile, or model= is not the "
                           "module being trained")
        if self._gemm is not None and self._gemm.dropped_hists and not self._warned_hists:
            self._warned_hists = True
            warnings.warn(f"ampdoctor: more than {MAX_FINE_HISTS} GEMM operands in one module-sampled step; the "
                          "fine histograms of the rest are not recorded (their peaks are)", RuntimeWarning, stacklevel=3)
        if self._gemm is not None and self._gemm.dropped_blocks and not self._warned_blocks:
            self._warned_blocks = True
            warnings.warn(f"ampdoctor: more than {MAX_BLOCK_STATS} GEMM operands in one module-sampled step; the "
                          "block statistics of the rest are not recorded (ampdoctor fp8 says unknown for their "
                          "layers' block formats)", RuntimeWarning, stacklevel=3)
        if self._gemm is not None and self._gemm.blocks_failed and not self._warned_blocks_failed:
            self._warned_blocks_failed = True
            warnings.warn(f"ampdoctor: block statistics stopped ({self._gemm.blocks_failed}); the rest of the "
                          "run records no MXFP8/NVFP4 statistics, everything else as before", RuntimeWarning,
                          stacklevel=3)
        if self._dropped_taps and not self._warned_dropped:
            self._warned_dropped = True
            warnings.warn(f"ampdoctor: more than {MAX_TAP_ROWS_PER_STEP} module observations in "
                          "one step (a long forward-only loop?); the rest of such steps is not "
                          "recorded", RuntimeWarning, stacklevel=3)
        self._dropped_taps = 0
        self._groups, self._loss, self._observed = [], None, set()
        self._backward_scale, self._inv_scales = None, {}
        if not self.writer.put(record) and not self.writer.closed and not self.writer.failed:
            self._step_dropped()
        self._status.started(self.run_id)
        self._anomalies.step_done(self.step, record.scalars, record.event, flight_step,
                                  skipped_on_host=self._optimizers.skipped_on_host)
        self._optimizers.step_done(self.step)
        self.step += 1
        self._remove_sniff()  # the autocast dtype is known after the first iteration or never
        self._plan_step()

    def came_through(self, framework: str) -> None:
        """The scaler is set through ``framework``'s own arguments (``"lightning"``,
        ``"accelerate"``): the report's recommendation is then written in them. No sync."""
        self._run_metadata.came_through(framework)

    def scaler_dropped(self) -> None:
        """The scaler was garbage-collected without ``close()``: its model's hooks still hold this
        recorder, and would record every forward and backward of the model from now on (at full
        statistics forever if the scaler was dropped before its first ``update()``, whatever
        scaler trains the model next). They return at once from now on. Called from the garbage
        collector, in any thread and at any allocation, possibly while torch iterates the model's
        hook dictionaries: so it only sets a flag (:meth:`ModuleTaps.stop`). The caller then ends
        the writer's thread (:meth:`RunWriter.close_when_dropped`): what was queued is written as
        the run's last segment (the exit handler still closes this recorder: no final parameter
        check, its scaler is gone). No sync."""
        taps = self._taps
        if taps is not None:
            taps.stop()
        self._measured.drop("the scaler was dropped")

    def _taps_off(self, why: str) -> None:
        """Stop module taps for good (warning once); the rest of the recording goes on."""
        warnings.warn(f"ampdoctor: {why}. Module rows are off; recording continues at "
                      "level='params'", RuntimeWarning, stacklevel=5)
        self._taps.remove()
        self._taps, self._module_stats, self._gemm = None, None, None

    def _plan_step(self) -> None:
        """Decide what the module taps record in the step about to start, and whether its
        underflow is measured; (un)install the taps."""
        self._measured.plan(self._plan.measured(self.step))
        if self._taps is None:
            self._module_stats = None
            return
        self._module_stats = self._plan.module_stats(self.step)
        # Light steps: the taps hand tensors straight to the flight recorder's buffer (one call
        # less per tensor than through observe_tap).
        observe = None
        if self._module_stats == "light":
            # (light taps for the GEMM operands alone, with the flight recorder off: nothing else kept)
            observe = self._light_taps.add if self.options.flight_steps else _ignore
        observe_input = observe_grad = None
        if self._gemm is not None and self._module_stats is not None:
            # (block statistics on the module_every cadence alone: escalations come in runs of 20 steps)
            self._gemm.start(sampled=self._module_stats == "full", blocks=self._plan.module_sampled(self.step))
            observe_input, observe_grad = self._gemm.input, self._gemm.grad
        if self._measured.probe is not None:  # the taps' own ops must not be shadowed
            observe = self._measured.paused(observe or self.observe_tap)
            if observe_input is not None:
                observe_input, observe_grad = self._measured.paused(observe_input), self._measured.paused(observe_grad)
        self._taps.reset(observe, observe_input, observe_grad)
        if self._module_stats is None:
            self._taps.remove()
            return
        try:
            self._taps.install()
        except Exception as exc:  # noqa: BLE001 - e.g. a module type that refuses hooks
            self._taps_off(f"module taps could not be installed ({type(exc).__name__}: {exc})")

    def _metadata(self) -> dict[str, str]:
        """The metadata of a segment written now (writer thread)."""
        return self._run_metadata(amp_dtype=self.amp_dtype, run_id=self.run_id, dropped_steps=self.dropped_steps)


def _ignore(kind: str, call: ModuleCall, order: int, tensor: torch.Tensor) -> None:
    """A light step's observer with the flight recorder off (the GEMM operands are observed apart)."""


def check_arguments(options: RecordOptions, model: torch.nn.Module | None) -> None:
    """Raise for ampdoctor's own arguments that are wrong or cannot go together (the user's to
    fix, unlike a set-up that recording cannot use: :func:`~ampdoctor.record.scaler.recorder_for`)."""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model= must be a torch.nn.Module, got {type(model).__name__}")
    if options.level == "full" and model is None:
        raise ValueError("level='full' needs model=: the module taps are installed on it")
    check_module_filter(options.modules)


def _when_dropped(recorder: "weakref.ref[Recorder]", writer: RunWriter):
    """The callback of a recorder's weak reference to its scaler (holding the recorder weakly and
    its writer strongly: the writer's thread must end even when the recorder went with the scaler)."""
    def dropped(_: weakref.ref) -> None:
        alive = recorder()
        if alive is not None:
            alive.scaler_dropped()
        writer.close_when_dropped()
    return dropped


def _tensors(outputs) -> Iterable[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        yield outputs
    elif isinstance(outputs, (list, tuple)):
        for o in outputs:
            yield from _tensors(o)
