"""Module taps: forward activations and gradients w.r.t. module outputs, in execution order.

Mechanism. Each selected module gets a forward pre-hook and a forward hook (``always_call``, so a
forward that raises cannot unbalance the call stack). The forward hook hands each floating-point
output tensor to the sink and, when it requires grad, registers a pre-hook on its autograd node
(``grad_fn.register_prehook``), which receives the gradient w.r.t. each output of the node and
hands the sink the one of the returned tensor. That is the gradient w.r.t. the value the module
returned even when the tensor is modified in place afterwards (``ReLU(inplace=True)``,
``x += residual``): the in-place op gives the tensor a new node, and the old node still receives
the gradient of the pre-op value. A node pre-hook rather than a tensor hook
(``Tensor.register_hook``, which autograd runs at the same place): it is registered in C++, for
half the host time, and it sees the gradient as the node receives it, after any tensor hook the
user put on that output. Module *full* backward hooks are not used: they route outputs through a
custom autograd Function, which makes them views that in-place ops refuse to modify.

Structure. Every call of a tapped module gets a number, its parent call and the calls whose
returned tensors it received (:mod:`ampdoctor.record.call_graph`).

Cost. Hooks run per tapped call and per output, so they do little: what a light step keeps per
tensor is one ``aminmax`` and a few entries in a list (:mod:`ampdoctor.record.light_taps`); no lock is
taken (counters are ``itertools.count`` objects, call stacks are per thread); and a static model
makes no new Python object per call that lives to the step's end (the call's facts and its
gradient hook are the previous step's when they are equal), because such objects set off
Python's garbage collector. Measured by ``benchmarks/host_cost.py`` (docs/benchmarks.md).

Lifetime. Nothing here holds a tensor or an autograd node: returned tensors are remembered by id,
version and node sequence number (weak references for those without history), and node
pre-hooks capture only the call's facts. ``remove()`` removes every module hook and turns the
pre-hooks still attached to live nodes into no-ops.

Under ``torch.compile`` the hooks return at once (``torch.compiler.is_compiling()``), so dynamo
traces them as no-ops and the compiled graph is what it would be without them. Under
``torch.inference_mode()`` they return at once too: inference tensors have no version counter,
which the call structure and the repeat check read, and such a pass has no gradients to explain
(a validation pass under ``no_grad`` gets its forward rows).
"""

from __future__ import annotations

import functools
import itertools
import re
import threading
import weakref
from typing import Any, Callable, Iterable, Protocol, Union

import torch
from torch import nn

from .call_graph import CallGraph, ModuleCall, tensors_in
from ..run_file.schema import ROOT_NAME

WRAPPER_CLASSES = ("FullyShardedDataParallel", "CheckpointWrapper", "OptimizedModule")  # never tapped

# Modules that only hold other modules: tapping them would repeat their last child's rows.
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)

ModuleFilter = Union[None, str, "re.Pattern[str]", type, Iterable[Union[str, "re.Pattern[str]", type]],
                     Callable[[str, nn.Module], bool]]

_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_get_ident = threading.get_ident
_is_compiling = torch.compiler.is_compiling
_is_inference = torch.is_inference_mode_enabled
_is_grad_enabled = torch.is_grad_enabled


class TapSink(Protocol):
    """What the taps hand each tensor to (``observe_tap``, unless :meth:`ModuleTaps.reset` names
    another observer for the step) and their failures (``fail``)."""

    def observe_tap(self, kind: str, call: ModuleCall, order: int, tensor: torch.Tensor) -> None: ...

    def fail(self, exc: BaseException) -> None: ...


# Modules that wrappers insert between a model and its submodules (FSDP1, activation
# checkpointing, torch.compile): not part of the names users know their model by.
_WRAPPER_ATTRIBUTES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside ``torch.compile`` (OptimizedModule) and DistributedDataParallel
    wrappers, or ``model`` itself: the module whose names are the user's."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif type(model).__name__ == "DistributedDataParallel" and isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            return model


def clean_name(name: str) -> str:
    """A parameter or module name without the wrapper levels of FSDP1, checkpoint wrappers and
    ``torch.compile`` (``layers.0._fsdp_wrapped_module.fc.weight`` → ``layers.0.fc.weight``)."""
    if not any(w in name for w in _WRAPPER_ATTRIBUTES):
        return name
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_ATTRIBUTES)


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` is a ``torch.compile`` wrapper or contains a module compiled in place."""
    return any(hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


def select_modules(model: nn.Module, modules: ModuleFilter = None) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs to tap, in ``named_modules()`` order.

    ``modules=None`` taps every module except pure containers (Sequential, ModuleList, ...): leaves
    and blocks. TorchScript modules take no hooks and are never tapped. Otherwise: a regular expression (``str`` or compiled) that must match the whole
    qualified name, a module type, a list mixing those, or a callable ``(name, module) -> bool``.
    The model itself is named ``"(model)"``.
    """
    match = _matcher(modules)
    out = []
    for name, m in unwrap_model(model).named_modules():
        name = clean_name(name) or ROOT_NAME
        if type(m).__name__ in WRAPPER_CLASSES or isinstance(m, torch.jit.ScriptModule):
            continue  # a wrapper's output is its wrapped module's; TorchScript refuses hooks
        if match(name, m):
            out.append((name, m))
    return out


def check_module_filter(modules: ModuleFilter) -> None:
    """Raise ``TypeError`` for a ``modules=`` that is none of the forms :func:`select_modules` takes."""
    _matcher(modules)


def _matcher(modules: ModuleFilter) -> Callable[[str, nn.Module], bool]:
    if modules is None:
        return lambda name, m: not isinstance(m, CONTAINERS)
    if isinstance(modules, (str, re.Pattern)):
        pattern = re.compile(modules)
        return lambda name, m: pattern.fullmatch(name) is not None
    if isinstance(modules, type):
        return lambda name, m: isinstance(m, modules)
    if callable(modules):
        return lambda name, m: bool(modules(name, m))
    try:
        items = list(modules)
    except TypeError:
        raise TypeError(f"modules must be a regex, a module type, a list of those or a callable, "
                        f"got {type(modules).__name__}") from None
    if any(not isinstance(item, (str, re.Pattern, type)) for item in items):
        raise TypeError("a modules list may hold regular expressions and module types only")
    parts = [_matcher(item) for item in items]
    return lambda name, m: any(p(name, m) for p in parts)


def float_tensors(value: Any) -> list[torch.Tensor]:
    """The non-empty floating-point dense tensors in a (nested) tuple / list / dict output
    (float8 tensors are skipped: torch has no reductions for them)."""
    tensors = [value] if isinstance(value, torch.Tensor) else tensors_in(value)
    return [t for t in tensors if _observable(t)]


def _observable(t: torch.Tensor) -> bool:
    """A dense, non-empty tensor of a floating-point dtype torch reduces (not float8)."""
    return t.dtype in _TAPPED_DTYPES and t.layout == torch.strided and bool(t.numel())


# The floating-point dtypes torch reduces (not float8), as a set: one lookup per tensor.
_TAPPED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def inert_hook(*args: Any, **kwargs: Any) -> None:
    """What a module hook of ours becomes in a copy of the model: nothing."""
    return None


def _inert() -> Callable[..., None]:
    return inert_hook


class ModuleHook:
    """A hook that belongs to one module object. It runs only when called for that module: a deep
    copy of the model (EMA, SWA's ``AveragedModel``) or an unpickled one gets :func:`inert_hook`
    instead, so copies never record under the original's names, and pickling never meets our
    locks or closures. Holds the module weakly."""

    __slots__ = ("_module", "_fn", "__weakref__")

    def __init__(self, module: nn.Module, fn: Callable[..., Any]) -> None:
        self._module = weakref.ref(module)
        self._fn = fn

    def __call__(self, module: nn.Module, *args: Any) -> Any:
        # (torch passes hook arguments by position.) DataParallel's replicas share the
        # original's hook dicts: they are the training model.
        if module is not self._module() and not getattr(module, "_is_replica", False):
            return None
        return self._fn(module, *args)

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return inert_hook

    def __reduce__(self) -> tuple:
        return _inert, ()  # unpickles as the module-level no-op


class ModuleTaps:
    """Forward and gradient taps on the selected modules of one model; feeds a :class:`TapSink`.
    Hooks never sync: they only hand tensors to the sink, which queues device work."""

    def __init__(self, model: nn.Module, modules: ModuleFilter, sink: TapSink,
                 gemm: Callable[[nn.Module], bool] | None = None) -> None:
        """``gemm``: which of the tapped modules are GEMM layers, whose inputs are handed to the
        step's input observer (:meth:`reset`)."""
        self.targets = select_modules(model, modules)
        self.gemm_layers = {name: m for name, m in self.targets if gemm is not None and gemm(m)}
        self._sink = sink
        self._handles: list[Any] = []
        self._on = False  # the module hooks are installed: node pre-hooks left on live nodes check it
        self._stopped = False  # stop() was called: never on again
        self._graph = CallGraph()
        self.reset()

    @property
    def calls(self) -> int:
        """The calls begun in the step in progress (0: no tap fired). No sync."""
        return self._graph.calls

    def install(self) -> None:
        """Register the module hooks (between iterations). Idempotent; nothing after
        :meth:`stop`. No sync."""
        if self._handles or self._stopped:
            return
        try:
            for name, module in self.targets:
                before = self._before_gemm_forward if name in self.gemm_layers else self._before_forward
                self._handles.append(module.register_forward_pre_hook(
                    ModuleHook(module, functools.partial(before, name)), with_kwargs=True))
                self._handles.append(module.register_forward_hook(
                    ModuleHook(module, self._after_forward), with_kwargs=True, always_call=True))
        except BaseException:
            self.remove()
            raise
        self._on = True

    def remove(self) -> None:
        """Remove every module hook; node pre-hooks still on live autograd nodes become no-ops
        (they return at once while no module hook is installed). Idempotent. No sync."""
        self._on = False
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def stop(self) -> None:
        """Make every hook return at once, for good, without touching the modules' hook
        dictionaries: safe where :meth:`remove` is not (a garbage collector callback, which may
        run while torch iterates them). The hooks stay installed until :meth:`remove`. No sync."""
        self._on = False
        self._stopped = True

    def reset(self, observe: Callable[[str, ModuleCall, int, torch.Tensor], None] | None = None,
              observe_input: Callable[[ModuleCall, nn.Module, torch.Tensor | None, bool], None] | None = None,
              observe_gemm_grad: Callable[[ModuleCall, int, torch.Tensor], None] | None = None) -> None:
        """Start a new step (between iterations, on the training thread): numbering restarts,
        remembered tensors are forgotten, and call stacks left over from a forward that never
        returned (KeyboardInterrupt) are dropped. ``observe``: what the taps hand each tensor to
        in this step, called as the sink's ``observe_tap`` is (the default); ``observe_input``:
        what a GEMM layer's call hands its input to (None: none fit to observe) and whether grad
        is enabled, ``observe_gemm_grad`` its output gradient,
        after ``observe`` (None: nothing). No sync."""
        self._observe = observe or self._sink.observe_tap
        self._observe_input = observe_input
        self._observe_gemm_grad = observe_gemm_grad
        self._graph.reset()
        self._previous_hooks, self._hooks = getattr(self, "_hooks", {}), {}  # call (, output) -> node pre-hook
        self._forward_order = itertools.count()
        self._backward_order = itertools.count()
        self._stacks: dict[int, list[ModuleCall]] = {}  # thread id -> its call stack
        self._training: dict[int, bool] = {}  # thread id -> grad mode when its outermost tapped call began

    # -- hooks (no sync; a failure goes to the sink's fail()) ---------------------------------
    # They run per tapped call and per output: each attribute lookup and call counts here.
    # Reentrant checkpointing recomputes forwards inside backward, so each thread keeps its
    # own call stack.

    def _before_forward(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if _is_compiling() or not self._on or _is_inference():
            return None
        try:
            self._begin(name, module, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - a tap failure must not reach training
            self._sink.fail(exc)
        return None

    def _before_gemm_forward(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A GEMM layer's pre-hook: the call begins, and its input goes to the input observer
        (not when a checkpoint recomputes the call in backward: its input was seen in forward)."""
        if _is_compiling() or not self._on or _is_inference():
            return None
        try:
            info = self._begin(name, module, args, kwargs)
            observe = self._observe_input
            # Not a checkpoint's recomputation in backward (its forward was seen). Whether the call
            # trains goes with it: grad mode at the outermost tapped call (a validation pass runs the
            # whole model under no_grad; a reentrant checkpoint's forward or a frozen block runs under
            # no_grad inside a training forward).
            if observe is not None and _current_graph_task_id() == -1:
                x = args[0] if args else kwargs.get("input", kwargs.get("x"))
                observe(info, module, x if isinstance(x, torch.Tensor) and _observable(x) else None,
                        self._training.get(_get_ident(), True))
        except Exception as exc:  # noqa: BLE001 - a tap failure must not reach training
            self._sink.fail(exc)
        return None

    def _begin(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> ModuleCall:
        """A call of a tapped module begins: on this thread's call stack, with its facts."""
        stack = self._stacks.get(_get_ident())
        if stack is None:
            stack = self._stacks.setdefault(_get_ident(), [])
        if not stack:
            self._training[_get_ident()] = _is_grad_enabled()
        info = self._graph.begin(name, id(module), stack[-1].call if stack else None, args, kwargs)
        stack.append(info)
        return info

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if _is_compiling() or not self._on or _is_inference():
            return None
        try:
            stack = self._stacks.get(_get_ident())
            if not stack or stack[-1].module_id != id(module):
                return None  # installed while this module was running
            info = stack.pop()
            if output is None:
                return None  # forward raised (always_call) or returned nothing
            # Inside backward this is a checkpoint recomputation: its forward was observed
            # when it first ran; its outputs still get gradient taps (reentrant checkpointing
            # backpropagates through the recomputed graph).
            recomputing = _current_graph_task_id() != -1
            for t in float_tensors(output):
                if not recomputing:
                    self._observe("output", info, next(self._forward_order), t)
                self._graph.returned(t, info.call)
                # Not on leaves (a returned parameter): their hooks would outlive the step.
                node = t.grad_fn
                if node is not None and t.requires_grad:
                    node.register_prehook(self._gradient_hook(info, t.output_nr))
        except Exception as exc:  # noqa: BLE001
            self._sink.fail(exc)
        return None

    def _gradient_hook(self, info: ModuleCall, output_nr: int) -> Callable[[tuple], None]:
        """The pre-hook of the autograd node of call ``info``'s output ``output_nr``: a partial,
        not a closure (the bound method and the facts, nothing else), and the previous step's one
        when ``info`` is the previous step's call (see :mod:`ampdoctor.record.call_graph`: a static
        model makes no new object per step). No sync."""
        key = info.call if not output_nr else (info.call, output_nr)  # (an int: no new object)
        hook = self._hooks.get(key)
        if hook is None:
            hook = self._previous_hooks.get(key)
            if hook is None or hook.args[0] is not info:
                hook = functools.partial(self._on_gradients, info, output_nr)
            self._hooks[key] = hook
        return hook

    def _on_gradients(self, info: ModuleCall, output_nr: int, grads: tuple) -> None:
        if _is_compiling() or not self._on:
            return None
        try:
            grad = grads[output_nr]
            if grad is not None and grad.layout == torch.strided and grad.numel():
                order = next(self._backward_order)
                self._observe("grad_output", info, order, grad)
                if self._observe_gemm_grad is not None and info.name in self.gemm_layers:
                    self._observe_gemm_grad(info, order, grad)
        except Exception as exc:  # noqa: BLE001
            self._sink.fail(exc)
        return None  # never changes the gradients
