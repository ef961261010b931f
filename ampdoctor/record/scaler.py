"""The instrumented GradScaler, and wrap()/unwrap() for a scaler that already exists.

Recording is a mixin over torch's scaler. Each tapped method calls torch's own implementation
unchanged and observes around it, so the training arithmetic is torch's, bit for bit. ``wrap()``
swaps the instance's class for a recording subclass of its own class: every holder of the object
(Accelerate, Lightning, a checkpoint helper) records through the same object, ``isinstance``
checks keep passing, and no state (scale, growth tracker, per-optimizer stages) is copied or lost.

Synchronisation: no method here adds a host-device sync. ``step()`` keeps torch's one (reading
``found_inf``); ``wrap()`` reads the current scale once when the scaler has already been used.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from ..errors import RecorderError
from .options import RecordOptions
from .recorder import Recorder, check_arguments
from .run_identity import rank_and_world, shared_run_id

_RECORDER = "_ampdoctor_recorder"
_STEP_KEY = "ampdoctor.step"
_RUN_KEY = "ampdoctor.run_id"


class _Recording:
    """Mixin that records around torch.amp.GradScaler's methods. Not public; see GradScaler/wrap."""

    _ampdoctor_plain_class: type  # what pickling and unwrap() turn the instance back into

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A user's subclass of ampdoctor.GradScaler is its own plain class (a copy keeps its
        # methods); the recording classes wrap() makes name theirs in their class dict.
        super().__init_subclass__(**kwargs)
        if "_ampdoctor_plain_class" not in cls.__dict__:
            cls._ampdoctor_plain_class = cls

    @property
    def recorder(self) -> Recorder | None:
        """The active :class:`Recorder`, or None when this scaler is not recording."""
        return self.__dict__.get(_RECORDER)

    def scale(self, outputs):
        """As torch: multiply by the scale. Also adds ``outputs`` to the step's loss and, on a
        measured step, starts the shadow of the backward to come. No sync."""
        scaled = super().scale(outputs)
        rec = self.recorder
        if rec is not None:
            rec.observe_loss(outputs, self._scale if self._enabled else None)
            rec.observe_scaled(scaled)  # on a measured step: the shadow backward starts here
        return scaled

    def _observe_scaled_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """Record ``optimizer``'s gradients if they are still as backward left them (scaled, not
        yet unscaled this iteration); a disabled scaler's gradients are recorded as they are."""
        rec = self.recorder
        if rec is None:
            return
        if not self._enabled:
            rec.observe_grads(optimizer, None)
        elif self._scale is not None:
            state = self._per_optimizer_states.get(id(optimizer))  # .get: don't create state
            if state is None or state["stage"] is OptState.READY:  # otherwise torch raises
                rec.observe_grads(optimizer, self._scale)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """As torch. First records the statistics of the (still scaled) gradients. No sync."""
        if self._enabled:
            self._observe_scaled_grads(optimizer)
        super().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        """As torch (one sync, torch's own). Records gradients not yet seen by ``unscale_``:
        fused optimizers unscale inside their step, and a disabled scaler never unscales. Then
        checks the parameters the optimizer wrote (one fused inf-norm per device and dtype)."""
        if not self._enabled or "closure" not in kwargs:  # enabled torch refuses closures
            self._observe_scaled_grads(optimizer)
        result = super().step(optimizer, *args, **kwargs)
        rec = self.recorder
        if rec is not None:
            rec.observe_params(optimizer)  # did the optimizer write non-finite values? no sync
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """As torch. Then hands the iteration's record to the writer (non-blocking copies). No sync."""
        rec = self.recorder
        scalars = rec.before_update(self) if rec is not None else None
        super().update(new_scale)
        if rec is not None:
            rec.after_update(scalars)

    def state_dict(self) -> dict[str, Any]:
        """As torch, plus ``"ampdoctor.step"`` and ``"ampdoctor.run_id"`` (ignored by torch's
        loader) so a resumed run continues its step numbering in the same run. Syncs, as torch's
        does."""
        state = super().state_dict()
        rec = self.recorder
        if state and rec is not None:
            state[_STEP_KEY] = rec.step
            state[_RUN_KEY] = rec.run_id
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch. A state saved by a recording scaler continues its run: the same run id and
        the step numbering after its last step. No sync."""
        super().load_state_dict(state_dict)
        rec = self.recorder
        if rec is not None and _STEP_KEY in state_dict:
            rec.set_step(int(state_dict[_STEP_KEY]))
        if rec is not None and state_dict.get(_RUN_KEY):
            rec.continue_run(str(state_dict[_RUN_KEY]))

    def close(self) -> None:
        """Flush and finish the run; the scaler keeps working (without recording). Idempotent."""
        rec = self.__dict__.pop(_RECORDER, None)
        if rec is not None:
            rec.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop(_RECORDER, None)  # a copy must not write into the same run
        return state

    def __reduce_ex__(self, protocol):
        # Pickle as the plain class (a wrapped scaler's class is made at run time), under every
        # protocol: copyreg.__newobj__ would insist on the instance's own class.
        return _unpickle_plain, (type(self)._ampdoctor_plain_class, self.__getstate__())


def _unpickle_plain(cls: type, state: dict[str, Any]):
    """An unpickled scaler: ``cls`` (the plain class) with the pickled state, not recording."""
    obj = cls.__new__(cls)
    if hasattr(obj, "__setstate__"):
        obj.__setstate__(state)
    else:  # pragma: no cover - torch's GradScaler defines __setstate__
        obj.__dict__.update(state)
    return obj


class GradScaler(_Recording, torch.amp.GradScaler):
    """Drop-in for :class:`torch.amp.GradScaler` that records a run.

    Positional and keyword arguments are torch's. The keyword-only options are those of
    :class:`ampdoctor.record.options.RecordOptions` plus ``model`` (for parameter names; without it,
    parameters are named ``group{g}.param{i}``). An unpickled or deep-copied instance does not
    record (two writers must not share one run); :func:`wrap` it to record again.
    """

    _ampdoctor_plain_class = None  # set below: pickles as itself, without its recorder

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 model: torch.nn.Module | None = None, path: str | os.PathLike | None = None,
                 start_step: int = 0, **options: Any) -> None:
        record_options = RecordOptions(path=path, **options)  # validate before touching torch state
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        own = type(self)  # a subclass of ours is the user's class: its advice names it
        scaler_class = "ampdoctor.GradScaler" if own is GradScaler else f"{own.__module__}.{own.__qualname__}"
        recorder = recorder_for(self, model, record_options, scaler_class=scaler_class, start_step=start_step)
        if recorder is not None:  # None: a rank that does not record (``ranks=``)
            self.__dict__[_RECORDER] = recorder


GradScaler._ampdoctor_plain_class = GradScaler

_recording_classes: dict[type, type] = {}


def _recording_class(base: type) -> type:
    cls = _recording_classes.get(base)
    if cls is None:
        cls = type(f"Recording{base.__name__}", (_Recording, base),
                   {"_ampdoctor_plain_class": base, "__module__": __name__})
        _recording_classes[base] = cls
    return cls


def wrap(scaler: torch.amp.GradScaler, *, model: torch.nn.Module | None = None,
         path: str | os.PathLike | None = None, start_step: int = 0, **options: Any):
    """Instrument ``scaler`` in place and return it (the same object).

    Works on :class:`torch.amp.GradScaler` and its subclasses (``torch.cuda.amp.GradScaler``,
    FSDP's ``ShardedGradScaler``). Call it between iterations. Reads the current scale once
    (one sync) when the scaler has already been used. Options as for :class:`GradScaler`.
    """
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"wrap() expects a torch.amp.GradScaler, got {type(scaler).__name__}")
    if scaler.__dict__.get(_RECORDER) is not None:
        raise ValueError("this scaler is already recording; call ampdoctor.unwrap(scaler) first")
    record_options = RecordOptions(path=path, **options)
    plain = type(scaler)._ampdoctor_plain_class if isinstance(scaler, _Recording) else type(scaler)
    # The recorder first: if its arguments are wrong, the scaler is left untouched.
    recorder = recorder_for(scaler, model, record_options,
                            scaler_class=f"{plain.__module__}.{plain.__qualname__}", start_step=start_step)
    if recorder is None:  # a rank that does not record (``ranks=``): the scaler stays as it is
        return scaler
    if not isinstance(scaler, _Recording):
        scaler.__class__ = _recording_class(plain)
    scaler.__dict__[_RECORDER] = recorder
    return scaler


def unwrap(scaler: torch.amp.GradScaler) -> torch.amp.GradScaler:
    """Finish the run and restore plain behaviour; returns the same object. A wrapped scaler gets
    its original class back; an :class:`ampdoctor.GradScaler` stops recording. Idempotent."""
    if isinstance(scaler, _Recording):
        scaler.close()
        plain = type(scaler)._ampdoctor_plain_class
        if type(scaler) is not plain:
            scaler.__class__ = plain
    return scaler


def recorder_for(scaler: torch.amp.GradScaler, model: torch.nn.Module | None, options: RecordOptions, *,
                 scaler_class: str, start_step: int = 0) -> Recorder | None:
    """A :class:`Recorder` for this process, or None when its rank is not among ``options.ranks``
    or recording cannot use this set-up.

    Set-up that torch's scaler accepts never fails here: what recording cannot use (a device that
    is not a device, a model whose modules refuse hooks, a directory that cannot be made) warns
    and the scaler trains as torch's, unrecorded; ``strict=True`` raises :class:`RecorderError`
    instead. ampdoctor's own arguments that cannot go together raise ``ValueError`` as always.

    Every rank of a run shares one ``run.id``: ``$AMPDOCTOR_RUN_ID`` or torchrun's
    ``$TORCHELASTIC_RUN_ID`` when set, else rank 0's, broadcast. That broadcast is a collective:
    with ``torch.distributed`` initialized (and no such variable), every rank must create its
    scaler, recording or not. It happens once, at construction. Rank 0's id is new, except when
    ``start_step`` > 0 (a resumed run): then it continues the latest run already at the path."""
    check_arguments(options, model)
    rank, world_size = rank_and_world(options.rank)
    run_id = shared_run_id(world_size, options.path if start_step > 0 else None, model)
    if options.ranks is not None and rank not in options.ranks:
        return None
    try:
        return Recorder(scaler, model, options, scaler_class=scaler_class, start_step=start_step, run_id=run_id)
    except RecorderError:
        raise  # strict mode, raised by the recorder's own failure path already
    except Exception as exc:  # noqa: BLE001 - recording set-up must not break training set-up
        message = str(exc).strip()
        why = f"{type(exc).__name__}: {message.splitlines()[0]}" if message else type(exc).__name__
        if options.strict:
            raise RecorderError(f"ampdoctor cannot record with this set-up ({why})") from exc
        warnings.warn(f"ampdoctor: cannot record with this set-up ({why}); the scaler trains unrecorded, "
                      "as torch's GradScaler", RuntimeWarning, stacklevel=3)
        return None
