"""The measured-underflow steps in a recorder's life: when the float32 shadow backward
(:class:`~ampdoctor.record.underflow_probe.ShadowBackward`) is made, entered, left and dropped.

A measured step's shadow is made when the step is planned, entered at ``scale()`` (seeded with
the scaled loss) and left at the step's first ``unscale_``/``step`` (the backward is over), where
its counts are read. It is not entered where it cannot run safely: another dispatch mode is
active (it would sit above ours and could leave first), the model is compiled, or inside
``torch.compile``; each such step warns once and the estimate stands in. None of this syncs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from .underflow_probe import ShadowBackward


class MeasuredSteps:
    """The shadow backward of the step in progress, if it is measured. Training thread, except
    :meth:`drop` (any thread: it only sets a flag)."""

    def __init__(self) -> None:
        self.probe: ShadowBackward | None = None
        self.active = False  # entered: from scale() to the step's first observe_grads
        self.warned = False

    def plan(self, measured: bool) -> None:
        """The step about to start is measured: make its shadow (unless one is still active)."""
        if measured and not self.active:
            self.probe = ShadowBackward()

    def start(self, roots: list[torch.Tensor], step: int, compiled: bool) -> None:
        """Seed the shadow backward with the scaled losses ``roots`` and make it active."""
        probe = self.probe
        if probe is None or not roots:
            return
        if not self.active:
            _leave_orphans()
            reason = None
            if torch._C._len_torch_dispatch_stack() > 0:
                reason = "another TorchDispatchMode is active around the backward"
            elif torch.compiler.is_compiling() or compiled or _compiled_backward(roots):
                reason = "its backward runs code compiled by torch.compile"
            if reason is not None:
                self.probe = None
                self.warn(f"underflow is not measured in step {step}: {reason}", stacklevel=5)
                return
            probe.__enter__()
            self.active = True
        for t in roots:
            probe.seed(t)

    def end(self, step: int) -> None:
        """Leave the shadow backward (the step's backward is over); its shadows stay readable.
        If another dispatch mode was entered above it meanwhile, ours cannot leave first: the
        step's measurement is dropped (warned once) and it leaves when it is on top again."""
        if not self.active:
            return
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if _get_current_dispatch_mode() is not self.probe:
            if self.probe.dropped:  # (passes everything through: the next recorder's scale() leaves it)
                self.active = False
                return
            self.warn(f"underflow is not measured in step {step}: another TorchDispatchMode was "
                      "entered during its backward and is still active")
            return
        self.probe.__exit__(None, None, None)
        self.active = False

    def after_backward(self) -> ShadowBackward | None:
        """The shadow whose backward is over (its counts are read now), or None."""
        return self.probe if self.probe is not None and not self.active else None

    def during_backward(self) -> ShadowBackward | None:
        """The shadow of the backward running now, or None."""
        return self.probe if self.active else None

    def step_done(self, step: int) -> bool:
        """The step's record is handed off: forget its shadow (the shadows go with it). Returns
        False when measuring stops for good: the shadows ran out of memory (freed, training went
        on), warned once."""
        dropped = self.probe is not None and self.probe.dropped
        if dropped:
            self.warn(f"underflow is not measured from step {step} on: {self.probe.dropped}; "
                      "the shadows were freed", stacklevel=5)
        if not self.active:
            self.probe = None
        return not dropped

    def drop(self, why: str) -> None:
        """Recording stopped, or the scaler was dropped: the shadow's mode, if left active, passes
        every op through from now on and the training thread leaves it at its next scaler call.
        Any thread (a flag)."""
        if self.probe is not None:
            self.probe._drop(why)

    def paused(self, observe: Callable) -> Callable:
        """``observe`` (a tap's observer) run with the shadow paused: the taps' own ops must not be
        shadowed."""
        probe = self.probe
        if probe is None:
            return observe

        def paused(*args) -> None:
            with probe.paused():
                observe(*args)
        return paused

    def warn(self, why: str, stacklevel: int = 4) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(f"ampdoctor: {why} (the estimate stands in; warned once)", RuntimeWarning,
                          stacklevel=stacklevel)


def _leave_orphans() -> None:
    """Leave the shadow modes that a stopped or dropped recorder left on top of this thread's
    dispatch stack (they pass every op through, at a Python call each). Training thread."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    mode = _get_current_dispatch_mode()
    while isinstance(mode, ShadowBackward) and mode.dropped:
        mode.__exit__(None, None, None)
        mode = _get_current_dispatch_mode()


def _compiled_backward(roots: list[torch.Tensor], limit: int = 200_000) -> bool:
    """Whether the backward of ``roots`` runs a region compiled by ``torch.compile`` (aot_autograd's
    ``CompiledFunctionBackward``): its kernels bypass the dispatcher and reuse buffers that have
    shadows, so the shadows would go stale (wrong counts, not missing ones). A walk of the graph:
    on measured steps only. No sync."""
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen: set[int] = set()
    while stack and len(seen) < limit:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if "CompiledFunction" in type(node).__name__:
            return True
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return False
