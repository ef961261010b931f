"""Measured underflow: a float32 shadow of the backward, run beside the real one on measured steps.

Why. The record of a gradient (its zeros, subnormals, zero lines and histogram) cannot tell a zero
that underflowed from a structural one when whole lines underflowed upstream (an embedding fed by
a tied head, a projection whose output gradient underflowed almost entirely): the estimate of
:mod:`ampdoctor.analysis.underflow` then gives a range. A measurement settles it: an element that
is 0 in the real gradient but not in a float32 computation of the same backward underflowed.

How. :class:`ShadowBackward` is a ``TorchDispatchMode``, entered when ``scale()`` hands out the
scaled loss of a measured step and left when that step's gradients are first observed
(``unscale_`` or ``step``). Every aten op dispatched meanwhile runs exactly as it would (the same
call with the same arguments: training is bit for bit the same). An op that reads a tensor that
has a *shadow* runs a second time on the shadows, with its other float16/bfloat16 inputs and any
half dtype it names made float32, and its floating outputs get those results as their shadows.
The seed is the gradient autograd makes for the scaled loss (``ones_like`` of it, or of a tensor
computed from it, such as ``loss / accumulation_steps``). So each gradient of that backward gets a
float32 shadow computed from the same saved activations and weights, without the half format's
cut-off; :meth:`ShadowBackward.count` compares them. Autograd's worker threads run under the mode
too (it is part of the thread-local state autograd carries into them).

Nothing the user can see runs twice: no autograd hook, module hook or optimizer hook (those are
Python callbacks, above the dispatcher); no collective (an op of a distributed namespace: DDP's and
FSDP's reductions), custom op (its Python body) or random op (the random stream stays the one
training draws from), no op that re-points a tensor's storage (``set_``): they run once, and their
outputs, and every tensor later computed from them or sharing a collective's storage (a bucket's
views), are *unmeasured* (counted as such, never guessed). Ops that do not produce a floating
tensor (``.item()``, ``nonzero``) are never shadowed, nor, on an accelerator, ops that find a
boolean mask's elements (``logits[mask]``'s backward): the shadow adds no host-device sync.
ampdoctor's own work inside the backward (the module taps) runs :meth:`paused`. A shadow op never
writes a real tensor (a written argument without a shadow is copied, once, at every place it is
passed), and no shadow aliases a real tensor.

Limits. An op that refuses float32 inputs (a fused kernel for half types only) runs on bfloat16
shadows instead (the same exponent range: no underflow short of 2^-133), else its outputs are
unmeasured. A kernel that bypasses the dispatcher (an extension writing by ``data_ptr``) leaves
new outputs without shadows (later ops read their real values as if they were activations: what
underflowed before it is not counted there, a lower bound), and one that writes in place into a
gradient that has a shadow leaves that shadow stale: wrong counts from there (a fused extension
backward that reuses its output-gradient buffer; a region compiled by ``torch.compile``, whose
generated kernels do both: a backward that runs one is found by the recorder and not measured). A
gradient that is mathematically zero (an attention key bias) can be rounding noise in the shadow,
computed from the half-precision activations, and count as underflow where the half backward gives
exactly 0: a float64 shadow computes from the same rounded activations and cannot tell either
(tried: the same 4 of 2556 parameter gradients of benchmarks/underflow_accuracy.py off); the
magnitudes of what underflowed (``underflow_hist``) let the report's range leave such noise out. A
user-given ``backward(gradient=...)`` is not seeded: nothing is measured. Cost: every op of the
measured step's backward goes through Python and runs twice (in float32); memory: a float32 shadow
per live gradient, the parameter gradients' until the step ends. Measured steps are rare
(``measure_every``) for that reason. Should a real op run out of memory while shadows are held,
the shadows are freed and (if it wrote nothing and drew no random number) the op runs again: the
step goes unmeasured and training does not fail.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

_HALF = (torch.float16, torch.bfloat16)
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd",
                                    "_dtensor", "symm_mem"})
_SHADOWED_NAMESPACES = frozenset({"aten", "prims"})  # a custom op's Python body must not run twice
_STORAGE_OPS = frozenset({"set_", "resize_", "resize_as_", "as_strided_"})  # they make a tensor another's alias
# Ops that, given a boolean mask, find its true elements (a host-device sync on an accelerator).
_MASK_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_", "masked_select", "masked_scatter",
                       "masked_scatter_"})
_RANDOM, _INPLACE_VIEW, _DYNAMIC_SHAPE = (torch.Tag.nondeterministic_seeded, torch.Tag.inplace_view,
                                          torch.Tag.dynamic_output_shape)
_ONES_LIKE = torch.ops.aten.ones_like.default
_Tensor = torch.Tensor


class _Unmeasured:
    """The shadow of a tensor that is not measured: computed by an op that is not shadowed (a
    collective, a custom or random op, ...), from such a tensor, or by an op whose shadow failed."""

    def __repr__(self) -> str:
        return "UNMEASURED"


UNMEASURED = _Unmeasured()


class ShadowBackward(TorchDispatchMode):
    """A float32 shadow of every gradient computed from the seeded losses while it is active.
    Enter it on the training thread (``with``, or ``__enter__``/``__exit__``); it keeps the real
    tensors by weak reference and their shadows for as long as they live. No sync."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dtype = dtype                     # of the shadows (an op that refuses it falls back to bfloat16)
        self._shadows = WeakIdKeyDictionary()  # real tensor -> float32 (or bfloat16) shadow, or UNMEASURED
        self._roots = WeakIdKeyDictionary()    # seeded losses and tensors computed from them (forward)
        self._local = threading.local()        # .paused: ampdoctor's own ops pass straight through
        # Storages a collective wrote (address -> weak references to its tensors, while one lives:
        # an address is reused once freed): what reads them is unmeasured.
        self._collective_storages: dict[int, list] = {}
        self.shadowed_ops = 0                  # ops run a second time
        self.dropped: str | None = None        # why the shadows were dropped (out of memory): nothing is measured
        self.unmeasured_ops: dict[str, int] = {}  # op -> times its outputs went unmeasured

    def seed(self, loss: torch.Tensor) -> None:
        """Shadow the backward of ``loss`` (a scaled loss, or anything whose backward should be
        measured). No sync."""
        self._roots[loss] = True

    def paused(self) -> "_Paused":
        """A context in which ops on this thread pass straight through (ampdoctor's own work)."""
        return _Paused(self._local)

    def shadow(self, real: torch.Tensor) -> torch.Tensor | None:
        """``real``'s shadow, or None when it has no usable one (none, unmeasured, reshaped,
        dropped)."""
        if self.dropped:
            return None
        shadow = self._shadows.get(real)
        if shadow is None or shadow is UNMEASURED or shadow.shape != real.shape:
            return None
        return shadow

    def count(self, real: torch.Tensor) -> torch.Tensor | None:
        """The elements of ``real`` that are 0 where their shadow is not (int64, 0-dim, on
        ``real``'s device), or None when ``real`` has no usable shadow. Runs paused. No sync."""
        shadow = self.shadow(real)
        if shadow is None:
            return None
        with self.paused():
            return ((real == 0) & (shadow != 0)).sum()

    def lost_values(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """For each of ``tensors``, its shadow's values where the real tensor is 0 (what
        underflowed, at its float32 magnitude), 0 elsewhere, as float32 and flat (its histogram is
        what is wanted: a flat tensor has no zero lines to look for); an empty tensor where there
        is no usable shadow. Written into the shadows themselves (so they hold nothing more after
        it: call it last, once the step's counts are taken): no second copy of every gradient (a
        bfloat16 shadow, rare, is copied to float32). Runs paused. No sync."""
        out = []
        with self.paused(), torch.no_grad():
            for t in tensors:
                shadow = self.shadow(t)
                if shadow is None:
                    out.append(torch.zeros(0, dtype=torch.float32, device=t.device))
                    continue
                self._shadows[t] = UNMEASURED  # (its values are no longer the gradient's shadow)
                out.append(shadow.masked_fill_(t != 0, 0).float().reshape(-1))
        return out

    def lost_copy(self, real: torch.Tensor) -> torch.Tensor | None:
        """``real``'s shadow's values where ``real`` is 0 (what underflowed), 0 elsewhere, flat,
        in a new tensor (the shadow stays as it is: the backward still reads it); None when
        ``real`` has no usable shadow. Runs paused. No sync."""
        shadow = self.shadow(real)
        if shadow is None:
            return None
        with self.paused(), torch.no_grad():
            return torch.where(real == 0, shadow, 0).reshape(-1)

    def counts(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """int64 ``[len(tensors)]`` of :meth:`count` on one device, -1 where a tensor is not
        measured; None when none is. Runs paused. No sync."""
        with self.paused():
            return stack_counts([self.count(t) for t in tensors])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(self._local, "paused", False) or self.dropped:
            return func(*args, **kwargs)
        flat, spec = tree_flatten((args, kwargs))
        if func.namespace in _COLLECTIVE_NAMESPACES:
            return self._collective(func, args, kwargs, flat)
        if self._collective_storages and any(self._from_collective(a) for a in flat):
            return self._unmeasured(func, args, kwargs, flat, taint=True)
        shadows = [self._shadows.get(a) if isinstance(a, _Tensor) else None for a in flat]
        if all(s is None for s in shadows):
            if func is _ONES_LIKE and args[0] in self._roots:  # autograd's seed gradient of a root
                out = self._call(func, args, kwargs)
                self._shadows[out] = torch.ones_like(out, dtype=self.dtype)
                return out
            out = self._call(func, args, kwargs)
            if self._roots and any(isinstance(a, _Tensor) and a in self._roots for a in flat):
                for o in tree_flatten(out)[0]:  # (loss / accumulation_steps is a root too)
                    if isinstance(o, _Tensor) and o.is_floating_point():
                        self._roots[o] = True
            return out
        if not _shadowable(func, flat) or not _same_layouts(func, flat, shadows):
            return self._unmeasured(func, args, kwargs, flat)
        return self._shadowed(func, args, kwargs, flat, spec, shadows)

    def _collective(self, func, args, kwargs, flat):
        """A collective (DDP's, FSDP's reductions): run once, never on shadows (the other ranks
        would not take part). Its tensors, and from now on every tensor that shares their
        storage (a bucket's views) or is computed from them, are unmeasured."""
        out = self._call(func, args, kwargs)
        tensors = [t for t in (*flat, *tree_flatten(out)[0]) if isinstance(t, _Tensor)]
        for t in tensors:
            self._taint(t)
        for t in tensors:
            if t.is_floating_point():
                self._shadows[t] = UNMEASURED
        self._count_unmeasured(func)
        return out

    def _taint(self, t: torch.Tensor) -> None:
        key = _storage(t)
        if key is not None:
            self._collective_storages.setdefault(key, []).append(weakref.ref(t))

    def _from_collective(self, a: Any) -> bool:
        """Whether ``a`` shares a storage a collective wrote (and that storage still lives)."""
        key = _storage(a)
        refs = self._collective_storages.get(key) if key is not None else None
        if refs is None:
            return False
        if any(r() is not None for r in refs):
            return True
        del self._collective_storages[key]  # freed: the address may be another tensor's now
        return False

    def _unmeasured(self, func, args, kwargs, flat, taint: bool = False):
        """An op that is not shadowed (one that reads what a collective wrote, with ``taint``; a
        custom op, a random one, one that re-points a tensor's storage, one that would sync): run
        once; its floating outputs and the tensors it writes are unmeasured."""
        out = self._call(func, args, kwargs)
        for i in _written(func, args, kwargs, flat):
            if taint:
                self._taint(flat[i])
            if flat[i].is_floating_point():
                self._shadows[flat[i]] = UNMEASURED
        for o in tree_flatten(out)[0]:
            if isinstance(o, _Tensor) and o.is_floating_point():
                self._shadows[o] = UNMEASURED
        self._count_unmeasured(func)
        return out

    def _count_unmeasured(self, func) -> None:
        name = str(func.overloadpacket.__name__)
        self.unmeasured_ops[name] = self.unmeasured_ops.get(name, 0) + 1

    def _shadowed(self, func, args, kwargs, flat, spec, shadows):
        """Run ``func`` for real and on the shadows, and give its floating outputs their shadows.
        An op that writes its inputs runs on the shadows first (the real input must still hold its
        old value); any other op runs for real first, and on the shadows only if it gave a
        floating tensor (``.item()``, ``nonzero``: never twice, no second sync)."""
        written = _written(func, args, kwargs, flat)
        measurable = all(s is not UNMEASURED for s in shadows)
        shadow_out = shadow_flat = None
        if written:
            if measurable:
                shadow_out, shadow_flat = self._run_shadow(func, flat, spec, shadows, written)
            out = self._call(func, args, kwargs)
        else:
            out = self._call(func, args, kwargs)
            if not any(isinstance(o, _Tensor) and o.is_floating_point() for o in tree_flatten(out)[0]):
                return out
            if measurable:
                shadow_out, shadow_flat = self._run_shadow(func, flat, spec, shadows, written)
        self.shadowed_ops += 1
        outs = tree_flatten(out)[0]
        shadow_outs = tree_flatten(shadow_out)[0] if shadow_out is not None else []
        if len(shadow_outs) != len(outs):
            shadow_outs = [None] * len(outs)
        if shadow_out is None:
            self._count_unmeasured(func)
        real = {_storage(a) for a in flat} - {None}
        for o, s in zip(outs, shadow_outs):
            if isinstance(o, _Tensor) and o.is_floating_point():
                if isinstance(s, _Tensor) and _storage(s) in real:
                    s = s.clone()  # (a shadow must never alias a real tensor: a shadow op could write it)
                self._shadows[o] = s if isinstance(s, _Tensor) else UNMEASURED
        for i in written:  # in place: the real input's shadow is the one the shadow op wrote
            if flat[i].is_floating_point():
                s = shadow_flat[i] if shadow_flat is not None else None
                if isinstance(s, _Tensor) and _storage(s) in real:
                    s = s.clone()
                self._shadows[flat[i]] = s if isinstance(s, _Tensor) else UNMEASURED
        return out

    def _call(self, func, args, kwargs):
        """The real op. Should it run out of memory while shadows are held, the shadows are
        dropped (this step is unmeasured from here on) and it runs once more: the measurement
        never makes training run out of memory."""
        try:
            return func(*args, **kwargs)
        except torch.OutOfMemoryError:
            if self.dropped or not self._drop("a real op ran out of memory with the shadows held"):
                raise
            if func._schema.is_mutable or _RANDOM in func.tags:
                raise  # (it may have written, or drawn, before it failed: not run twice; the shadows are freed)
            return func(*args, **kwargs)

    def _drop(self, why: str) -> bool:
        """Free every shadow and pass every op straight through from now on; False if there was
        nothing to free."""
        had = len(self._shadows) > 0
        self.dropped = why
        self._shadows = WeakIdKeyDictionary()
        self._roots = WeakIdKeyDictionary()
        return had

    def _run_shadow(self, func, flat, spec, shadows, written):
        """``func`` on the shadow arguments, in float32, else in bfloat16 (a kernel for half types
        only); ``(None, None)`` if both fail. A written argument without a shadow is a copy: the
        shadow op must never write a real tensor."""
        for dtype in dict.fromkeys((self.dtype, torch.bfloat16)):
            shadow_flat = [_shadow_arg(a, s, dtype) for a, s in zip(flat, shadows)]
            # A written tensor without a shadow gets one copy, at every place it is passed (an
            # out= that is also an input): the shadow op must never write a real tensor.
            targets = {id(flat[i]) for i in written}
            copies: dict[int, torch.Tensor] = {}
            for i, a in enumerate(flat):
                if id(a) in targets and shadow_flat[i] is a:
                    if id(a) not in copies:
                        copies[id(a)] = a.clone()
                    shadow_flat[i] = copies[id(a)]
            shadow_args, shadow_kwargs = tree_unflatten(shadow_flat, spec)
            try:
                with self.paused():
                    return func(*shadow_args, **shadow_kwargs), shadow_flat
            except torch.OutOfMemoryError:
                self._drop("a shadow op ran out of memory")
                return None, None
            except Exception:  # noqa: BLE001 - try bfloat16, then give up (unmeasured)
                continue
        return None, None


class _Paused:
    __slots__ = ("_local", "_was")

    def __init__(self, local: threading.local) -> None:
        self._local = local

    def __enter__(self) -> None:
        self._was = getattr(self._local, "paused", False)
        self._local.paused = True

    def __exit__(self, *exc: Any) -> None:
        self._local.paused = self._was


def _shadow_arg(a: Any, shadow: Any, dtype: torch.dtype) -> Any:
    """An argument of the shadow op: the shadow of a tensor that has one (in ``dtype`` when it
    must be), a float16/bfloat16 tensor in ``dtype``, ``dtype`` for a half dtype named."""
    if isinstance(shadow, _Tensor):
        return shadow if shadow.dtype == dtype or dtype == torch.float32 else shadow.to(dtype)
    if isinstance(a, _Tensor):
        return a.to(dtype) if _converts(a.dtype, dtype) else a
    if isinstance(a, torch.dtype) and _converts(a, dtype):
        return dtype
    return a


def stack_counts(found: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """0-dim counts (None: not measured) as one int64 tensor on the first count's device, -1 for
    None; None when none was measured. No sync."""
    first = next((c for c in found if c is not None), None)
    if first is None:
        return None
    missing = torch.full((), -1, dtype=torch.int64, device=first.device)
    return torch.stack([c.to(first.device, non_blocking=True) if c is not None else missing for c in found])


def _shadowable(func, flat: list) -> bool:
    """Whether ``func`` may run a second time on shadows: an aten op that draws no random
    numbers, does not re-point a tensor's storage, and (on an accelerator) does not sync to find
    a mask's elements."""
    if func.namespace not in _SHADOWED_NAMESPACES:
        return False
    tags = func.tags
    name = func.overloadpacket.__name__
    if _RANDOM in tags or _INPLACE_VIEW in tags or name in _STORAGE_OPS:
        return False
    on_device = any(isinstance(a, _Tensor) and a.device.type not in ("cpu", "meta") for a in flat)
    if on_device and (_DYNAMIC_SHAPE in tags or (name in _MASK_OPS and any(
            isinstance(a, _Tensor) and a.dtype == torch.bool for a in flat))):
        return False
    return True


def _same_layouts(func, flat: list, shadows: list) -> bool:
    """For the ops that address a tensor's storage directly (``as_strided``): whether every
    shadow has its real tensor's layout in storage (a shadow made by a copy is compact)."""
    if not func.overloadpacket.__name__.startswith("as_strided"):
        return True
    for a, s in zip(flat, shadows):
        if isinstance(s, _Tensor) and (s.stride() != a.stride() or s.storage_offset() != a.storage_offset()
                                       or s.untyped_storage().nbytes() // s.element_size()
                                       != a.untyped_storage().nbytes() // a.element_size()):
            return False
    return True


def _storage(t: Any) -> int | None:
    """The address of ``t``'s storage (views of one tensor share it); None for a non-tensor or a
    tensor without storage."""
    if not isinstance(t, _Tensor):
        return None
    try:
        return t.untyped_storage().data_ptr() or None  # (0: no storage, an empty tensor's)
    except (RuntimeError, NotImplementedError):
        return None


def _converts(real: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether a real tensor (or named dtype) of ``real`` takes the shadow's ``dtype``: the half
    types always; float32 into a float64 shadow (or a bfloat16 one, whose kernels want one type)."""
    if real == dtype:
        return False
    return real in _HALF or (real == torch.float32 and dtype in (torch.float64, torch.bfloat16))


def _written(func, args: tuple, kwargs: dict, flat: list) -> list[int]:
    """Positions in ``flat`` of the tensor arguments ``func`` writes (in place, ``out=``)."""
    schema = func._schema
    if not schema.is_mutable:
        return []
    objects = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        if isinstance(value, _Tensor):
            objects.append(value)
        elif isinstance(value, (list, tuple)):  # (the _foreach_*_ ops)
            objects.extend(v for v in value if isinstance(v, _Tensor))
    return [next(i for i, a in enumerate(flat) if a is o) for o in objects]

