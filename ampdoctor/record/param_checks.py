"""The optimizers a recorder sees: whether each one's ``step()`` really ran (a skipped step is
known on the host, before the scalars' copy lands), and the parameter check after it.

The parameter check is each parameter's peak magnitude after ``optimizer.step()`` (NaN and inf
propagate), :func:`~ampdoctor.stats.tensor_peaks` per (device, dtype), kept on the device; the
step's largest rides in its scalars, so a non-finite parameter is an anomaly. With
``check_params=True`` it runs on the steps with full gradient statistics (sampled and escalated)
and once more when the run closes; with ``"always"`` (or a disabled scaler: it never skips a step,
so a non-finite parameter cannot be traced back over skipped steps to the step that wrote it)
after every step. Between checks a non-finite parameter still shows: the next forward's loss is
non-finite, the steps skip (parameters unchanged) and the escalated steps check them;
``postmortem`` traces them back over the skipped steps to the step that wrote them. No sync.
"""

from __future__ import annotations

import weakref

import torch

from ..stats import tensor_peaks
from .hooks import ModuleHook
from .parameters import ParameterIndex
from .records import ParamCheck, merge_params


class OptimizerSteps:
    """One recorder's view of its optimizers' steps, for the iteration in progress."""

    def __init__(self, parameters: ParameterIndex, check_params: bool | str, scaler_enabled: bool,
                 start_step: int) -> None:
        self._parameters = parameters
        self._check = check_params
        self._scaler_enabled = scaler_enabled
        self.every_step = check_params == "always" or not scaler_enabled
        self.checks: list[ParamCheck] = []  # this iteration's parameter checks, per optimizer
        self._checked: set[int] = set()
        self._optimizers: weakref.WeakSet = weakref.WeakSet()  # for the check at the end
        self.last_checked = start_step - 1  # the last step whose parameter check was queued
        self.stepped = False  # an optimizer stepped in the iteration in progress (no update() yet)
        # Whether torch's step() ran each optimizer this iteration (a step pre-hook): torch reads
        # found_inf on the host for it anyway, so a skip is known before the scalars' copy lands.
        self._hooks: dict[int, tuple] = {}  # id(optimizer) -> (weak reference to it, hook handle)
        self._ran: set[int] = set()
        self.skipped_on_host = False

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook ``optimizer``'s step (once): its gradients are being unscaled."""
        if not self._watched(optimizer) and hasattr(optimizer, "_optimizer_step_pre_hooks"):
            # (an optimizer that never ran Optimizer.__init__ takes no hooks: its skips are read
            # from the device, a step later)
            handle = optimizer.register_step_pre_hook(ModuleHook(optimizer, self._optimizer_ran))
            self._hooks[id(optimizer)] = (weakref.ref(optimizer), handle)

    def stepped_by(self, optimizer: torch.optim.Optimizer, full_step: bool) -> None:
        """``optimizer.step()`` returned; ``full_step``: this step has full gradient statistics.
        Checks its parameters when this step is one to check."""
        self.stepped = True
        if (self._scaler_enabled and id(optimizer) not in self._ran and self._watched(optimizer)
                and not getattr(optimizer, "_step_supports_amp_scaling", False)):
            self.skipped_on_host = True  # torch's step() saw found_inf and did not run the optimizer
        if not self._check or id(optimizer) in self._checked:
            return
        self._optimizers.add(optimizer)
        if not (self.every_step or full_step):
            return
        self._checked.add(id(optimizer))
        self.checks.extend(self._check_params(optimizer))

    def final_check(self, step: int) -> tuple[int, ParamCheck] | None:
        """At the end of the run: the parameters as they are, and the step they belong to, unless
        that step was checked already. That step is the last one recorded (``step`` - 1), or the
        iteration in progress (``step``) when an optimizer stepped in it but ``update()`` never
        came (training died in between). After training."""
        step = step if self.stepped else step - 1
        if not self._check or step <= self.last_checked:
            return None
        params = merge_params([p for opt in list(self._optimizers) for p in self._check_params(opt)])
        if params is None:
            return None
        self.last_checked = step
        return step, params

    def step_done(self, step: int) -> None:
        """The iteration's record is handed off (its parameter checks with it)."""
        if self.checks:
            self.last_checked = step
        self.checks, self._checked, self.stepped = [], set(), False
        self.skipped_on_host = False
        self._ran.clear()

    def rewind(self, step: int) -> None:
        self.last_checked, self.stepped = step - 1, False

    def remove(self) -> None:
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()

    def _check_params(self, optimizer: torch.optim.Optimizer) -> list[ParamCheck]:
        return [ParamCheck(names, numels, tensor_peaks(tensors))
                for names, numels, tensors in self._parameters.param_groups(optimizer)]

    def _watched(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether our step pre-hook is on ``optimizer`` (not on a freed one that had its id)."""
        entry = self._hooks.get(id(optimizer))
        return entry is not None and entry[0]() is optimizer

    def _optimizer_ran(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        self._ran.add(id(optimizer))
