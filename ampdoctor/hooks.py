"""Module taps: forward activations and gradients w.r.t. module outputs, in execution order.

Mechanism. Each selected module gets a forward pre-hook and a forward hook (``always_call``, so a
forward that raises cannot unbalance the call stack). The forward hook hands each floating-point
output tensor to the sink and registers a *tensor* hook on it when it requires grad. A tensor hook
receives the gradient w.r.t. the value the module returned even when that tensor is modified in
place afterwards (``ReLU(inplace=True)``, ``x += residual``): autograd gives hooks registered before
an in-place op the gradient of the pre-op value. Module *full* backward hooks are not used: they
route outputs through a custom autograd Function, which makes them views that in-place ops refuse
to modify.

Structure. Every call of a tapped module gets a number (``call``, in the order calls begin), its
``parent`` (the innermost tapped call it ran inside) and its ``inputs``: the tapped calls whose
returned tensor it received, either unmodified (same object, same version) or through untapped
operations (``torch.tanh(x)``, ``h += x``, a reshape), found by walking back a few autograd nodes
to the nodes of tapped outputs. These are the facts the analysis needs to name the module whose
backward produced a gradient (:mod:`ampdoctor.analysis.origins`).

Lifetime. Nothing here holds a tensor: returned tensors are remembered through weak references for
the ``inputs`` facts, and tensor hooks capture only the call's facts. ``remove()`` removes every
module hook and turns the tensor hooks still attached to live tensors into no-ops.

Under ``torch.compile`` the hooks return at once (``torch.compiler.is_compiling()``), so dynamo
traces them as no-ops and the compiled graph is what it would be without them.
"""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol, Union

import torch
from torch import nn

from .schema import ROOT_NAME

WRAPPER_CLASSES = ("FullyShardedDataParallel", "CheckpointWrapper", "OptimizedModule")  # never tapped

# Modules that only hold other modules: tapping them would repeat their last child's rows.
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)

ModuleFilter = Union[None, str, "re.Pattern[str]", type, Iterable[Union[str, "re.Pattern[str]", type]],
                     Callable[[str, nn.Module], bool]]

_MAX_REMEMBERED = 1 << 16  # returned-tensor entries kept for the ``inputs`` facts before pruning
_MAX_WALK = 64             # autograd nodes visited per input when looking for its tapped sources
_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


@dataclass(frozen=True)
class ModuleCall:
    """The structural facts of one call of a tapped module."""

    name: str
    call: int
    parent: int | None
    inputs: tuple[int, ...]
    module_id: int


class TapSink(Protocol):
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


def float_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The non-empty floating-point dense tensors in a (nested) tuple / list / dict output
    (float8 tensors are skipped: torch has no reductions for them)."""
    for t in _all_tensors(value):
        if t.is_floating_point() and t.layout == torch.strided and t.numel() and t.element_size() > 1:
            yield t


def _all_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _all_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _all_tensors(v)


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

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # DataParallel's replicas share the original's hook dicts: they are the training model.
        if module is not self._module() and not getattr(module, "_is_replica", False):
            return None
        return self._fn(module, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return inert_hook

    def __reduce__(self) -> tuple:
        return _inert, ()  # unpickles as the module-level no-op


class ModuleTaps:
    """Forward and gradient taps on the selected modules of one model; feeds a :class:`TapSink`.

    Hooks never sync: they only hand tensors to the sink, which queues device work."""

    def __init__(self, model: nn.Module, modules: ModuleFilter, sink: TapSink) -> None:
        self.targets = select_modules(model, modules)
        self._sink = sink
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        self._local = threading.local()  # per-thread call stack (recomputation runs in backward)
        self.reset()

    def install(self) -> None:
        """Register the module hooks (between iterations). Idempotent."""
        if self._handles:
            return
        try:
            for name, module in self.targets:
                self._handles.append(module.register_forward_pre_hook(
                    ModuleHook(module, self._pre_hook(name)), with_kwargs=True))
                self._handles.append(module.register_forward_hook(
                    ModuleHook(module, self._post_hook()), with_kwargs=True, always_call=True))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Remove every module hook; tensor hooks still on live tensors become no-ops (they
        return at once while no module hook is installed). Idempotent."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def reset(self) -> None:
        """Start a new step: numbering restarts, remembered tensors are forgotten, and call
        stacks left over from a forward that never returned (KeyboardInterrupt) are dropped."""
        with self._lock:
            self._generation = getattr(self, "_generation", 0) + 1
            self.calls = 0
            self._forward_order = 0
            self._backward_order = 0
            self._returned: dict[int, list[tuple[weakref.ref, int, int]]] = {}
            self._node_calls: dict[tuple[int, int], list[int]] = {}  # autograd node key -> calls

    # -- hooks -------------------------------------------------------------------------------
    def _stack(self) -> list[ModuleCall]:
        if getattr(self._local, "generation", None) != self._generation:
            self._local.stack, self._local.generation = [], self._generation
        return self._local.stack

    def _pre_hook(self, name: str):
        def before_forward(module, args, kwargs):
            if torch.compiler.is_compiling() or not self._handles:
                return None
            try:
                stack = self._stack()
                with self._lock:
                    call = self.calls
                    self.calls += 1
                stack.append(ModuleCall(name, call, stack[-1].call if stack else None,
                                        self._sources((args, kwargs)), id(module)))
            except Exception as exc:  # noqa: BLE001 - a tap failure must not reach training
                self._sink.fail(exc)
            return None

        return before_forward

    def _post_hook(self):
        def after_forward(module, args, kwargs, output):
            if torch.compiler.is_compiling() or not self._handles:
                return None
            try:
                stack = self._stack()
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
                        self._sink.observe_tap("output", info, self._next_forward(), t)
                    self._remember(t, info.call)
                    # Not on leaves (a returned parameter): their hooks would outlive the step.
                    if t.requires_grad and t.grad_fn is not None:
                        t.register_hook(self._grad_hook(info))
            except Exception as exc:  # noqa: BLE001
                self._sink.fail(exc)
            return None

        return after_forward

    def _grad_hook(self, info: ModuleCall):
        def on_gradient(grad):
            if torch.compiler.is_compiling() or not self._handles:
                return None
            try:
                if grad is not None and grad.layout == torch.strided and grad.numel():
                    self._sink.observe_tap("grad_output", info, self._next_backward(), grad)
            except Exception as exc:  # noqa: BLE001
                self._sink.fail(exc)
            return None  # never changes the gradient

        return on_gradient

    # -- bookkeeping -------------------------------------------------------------------------
    def _next_forward(self) -> int:
        with self._lock:
            order = self._forward_order
            self._forward_order += 1
        return order

    def _next_backward(self) -> int:
        with self._lock:
            order = self._backward_order
            self._backward_order += 1
        return order

    def _remember(self, t: torch.Tensor, call: int) -> None:
        """Note that ``call`` returned ``t`` (at its current version)."""
        with self._lock:
            entries = self._returned.get(id(t))
            if entries is None or entries[0][0]() is not t:  # new tensor (or a reused id)
                if len(self._returned) >= _MAX_REMEMBERED:
                    self._returned = {k: v for k, v in self._returned.items() if v[0][0]() is not None}
                entries = self._returned[id(t)] = []
            entries.append((weakref.ref(t), t._version, call))
            if t.grad_fn is not None:
                if len(self._node_calls) >= _MAX_REMEMBERED:
                    self._node_calls = {}
                self._node_calls.setdefault(_node_key(t.grad_fn), []).append(call)

    def _sources(self, value: Any) -> tuple[int, ...]:
        """The tapped calls whose returned tensors reach the tensors in ``value``."""
        found: set[int] = set()
        with self._lock:
            for t in _all_tensors(value):
                direct = [call for ref, version, call in self._returned.get(id(t), ())
                          if ref() is t and version == t._version]
                if direct:
                    found.update(direct)
                elif t.grad_fn is not None:
                    found.update(self._upstream_calls(t.grad_fn))
        return tuple(sorted(found))

    def _upstream_calls(self, node) -> set[int]:
        """Breadth-first from ``node`` through untapped autograd nodes, stopping at the nodes of
        tapped outputs; visits at most _MAX_WALK nodes. Holds no node after returning."""
        calls: set[int] = set()
        queue, seen = [node], {id(node)}
        for _ in range(_MAX_WALK):
            if not queue:
                break
            current = queue.pop(0)
            hit = self._node_calls.get(_node_key(current))
            if hit is not None:
                calls.update(hit)
                continue
            for nxt, _ in current.next_functions:
                if nxt is not None and id(nxt) not in seen:
                    seen.add(id(nxt))
                    queue.append(nxt)
        return calls


def _node_key(node) -> tuple[int, int]:
    """Identifies an autograd node without holding it (nodes cannot be weakly referenced): its
    sequence number, unique per thread, and the thread-independent part of its type."""
    return node._sequence_nr(), hash(type(node).__name__)
