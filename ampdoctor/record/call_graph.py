"""Which tapped call fed which: the ``call``, ``parent`` and ``inputs`` facts of module taps.

Every call of a tapped module gets a number (``call``, in the order calls begin), its ``parent``
(the innermost tapped call it ran inside, given by the hooks' call stack) and its ``inputs``: the
tapped calls whose returned tensors it received, either unmodified or through untapped operations
(``torch.tanh(x)``, ``h += x``, a reshape). These are the facts the origins analysis needs to name
the module whose backward produced a gradient (:mod:`ampdoctor.analysis.origins`).

How ``inputs`` are found. An argument that is a tensor some call returned, unmodified (the same
object at the same version), is that call's output: a dictionary lookup by ``id``. Otherwise a
breadth-first walk back from its autograd node through at most ``MAX_WALK`` untapped nodes finds
the nodes of tapped outputs it was computed from (``h = x + proj(a)``: the residual's and the
projection's calls). The walk is the one costly part (a transformer block's attention projection
is ten nodes from ``qkv``'s output), and it is needed for only a few calls per block.

Passed on or computed. A call whose returned tensor reached this one only after untapped code
computed with it (an autograd Function called inline, ``x * s``, a matmul, a cast whose
backward narrows: ``h.float()`` of a float16 ``h``) is stored as
``~call`` (``-1 - call``, :func:`through_untapped`; the run file lists such calls in ``inputs``
and again in ``computed_inputs``): a non-finite gradient w.r.t. that call's
output may then have been made by that code's backward, which ran in an enclosing call, not in this
call's. Untapped nodes whose backward cannot make a finite gradient non-finite (:data:`PASSES`:
views, reshapes, transposes, slices, splits, copies, ``x + y``, ReLU, tanh, sigmoid: each element
moved or multiplied by at most 1 in magnitude; :data:`CASTS` whose backward keeps or widens the
range: ``h.half()`` of a float32 ``h``, whose backward casts a float16 gradient to float32) are
looked through: a tensor made by those alone from a tapped output counts as that output. Unpacking
a returned tuple, list or ``ModelOutput`` makes no autograd node: the element is the returned
tensor itself. Telling them apart costs nothing on the common path
(the argument is a tapped output, unchanged) and a dictionary lookup per node the walk meets before
the first node that computes.

Computed anew for every call, then reused. The facts of call ``k`` are found exactly on every
step. Whether the untapped code between two calls routed the same tensors as on the step before
can only be told from the autograd graph, which is the walk a cache of the facts would save; a
cheaper fingerprint (the order, number and types of the autograd nodes made) cannot see routing
between tensors that both exist (``h = a if flag else b``; a test has it), and would write wrong
``inputs`` on the steps that differ. What is reused is the *object*: when call ``k``'s facts equal
those of call ``k`` on the step before (a static model: every call, every step),
:meth:`CallGraph.begin` returns the previous step's :class:`ModuleCall`, and the hooks reuse the
gradient hook they made for it. Objects that live until the step ends are what sets off Python's
garbage collector; a static model's steps make none of these (docs/benchmarks.md).

Threads. The training thread runs forwards; a checkpoint's recomputation runs forwards inside
backward, on an autograd device thread for CUDA (and DataParallel runs its replicas' forwards on a
thread each). No lock is taken: call numbers come from an ``itertools.count`` (its ``next`` is
atomic under the GIL), and an update of the maps below is a lookup and a store under one key, a
tensor or an autograd node that a single thread made. Nothing here holds a tensor or an autograd
node after returning. None of it syncs: only tensor metadata is read.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, NamedTuple

import torch

MAX_REMEMBERED = 1 << 16  # returned-tensor entries kept per map before it is pruned (long forward-only loops)
MAX_WALK = 64             # autograd nodes visited per argument when looking for its tapped sources

# Autograd nodes whose backward cannot make a finite gradient non-finite: it moves the gradient's
# elements or multiplies each by a factor of magnitude at most 1 (not expand, gather or as_strided,
# which sum elements; dtype casts are decided per node: CASTS).
PASSES = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0", "TBackward0",
    "TransposeBackward0", "TransposeBackward1", "PermuteBackward0", "SqueezeBackward0", "SqueezeBackward1",
    "SqueezeBackward2", "UnsqueezeBackward0", "SliceBackward0", "SelectBackward0", "CloneBackward0",
    "SplitBackward0", "SplitWithSizesBackward0", "UnbindBackward0", "NegBackward0", "AbsBackward0",
    "ReluBackward0", "ThresholdBackward0", "HardtanhBackward0", "TanhBackward0", "SigmoidBackward0",
    "HardsigmoidBackward0", "SoftplusBackward0",
})
# Nodes that pass the gradient on times a saved factor: they pass when it is at most 1 in magnitude
# and their inputs have their output's dtype (the engine casts each input's gradient to that
# input's dtype: fp32 residual + fp16 branch hands the branch a float32 gradient cast to fp16).
SCALED_PASSES = {"AddBackward0": "_saved_alpha", "SubBackward0": "_saved_alpha", "RsubBackward0": "_saved_alpha",
                 "RsubBackward1": "_saved_alpha", "LeakyReluBackward0": "_saved_negative_slope"}
# Casts (``.half()``, ``.float()``, ``.to(dtype)``, autocast's casts, device moves). The backward of
# a cast is the cast the other way, from the output's dtype to the input's: it can overflow only
# when the input's format has the smaller range (a forward float16 -> float32 cast: a float32
# gradient beyond 65504 becomes inf). A forward float32 -> float16 or -> bfloat16 cast, or one
# that keeps the dtype, hands on the gradient in a format at least as wide: it passes, decided per
# node from the dtypes (:func:`_cast_passes`). Counting those as computing would name the enclosing
# call for an overflow in the next module's backward (a module run in float32, an LSTM, whose
# output the model casts to float16 for the next one).
CASTS = frozenset({"ToCopyBackward0"})
# Node type -> True or False (passes or not, whatever the node), or the function that decides per
# node: a node of SCALED_PASSES (its factor and dtypes) or of CASTS (its dtypes). One store per
# key: no lock.
_passing: dict[type, bool | Callable[[Any], bool]] = {}

_Tensor = torch.Tensor
_finfo = torch.finfo


def through_untapped(source: int) -> bool:
    """Whether an entry of :attr:`ModuleCall.inputs` is a call whose returned tensor was received
    only after untapped operations computed with it (held as ``~call``; the run file has it in
    ``computed_inputs``, rows.py); ``~source`` is then the call."""
    return source < 0


_NUMBERS = (int, float)


def _passes(node) -> bool:
    """Whether ``node``'s backward cannot make a finite gradient non-finite (:data:`PASSES`,
    :data:`SCALED_PASSES`, :data:`CASTS`; the answer, or the function deciding it per node, is
    cached per node type). No sync."""
    kind = type(node)
    passes = _passing.get(kind)
    if passes is None:
        passes = _passing[kind] = _rule(kind.__name__)
    if passes is True or passes is False:
        return passes
    return passes(node)


def _rule(name: str) -> bool | Callable[[Any], bool]:
    """What :data:`_passing` holds for the node type ``name``."""
    if name in CASTS:
        return _cast_passes
    factor_name = SCALED_PASSES.get(name)
    if factor_name is not None:
        return lambda node: _scaled_passes(node, factor_name)
    return name in PASSES


def _scaled_passes(node, factor_name: str) -> bool:
    """Whether a node of :data:`SCALED_PASSES` passes: its factor (a Python number: no sync) is
    at most 1 in magnitude and no input's gradient is cast to another dtype."""
    factor = getattr(node, factor_name, None)
    if type(factor) not in _NUMBERS or not -1 <= factor <= 1:
        return False
    try:
        dtype = node._input_metadata[0].dtype
        return all(nxt is None or nxt._input_metadata[i].dtype == dtype for nxt, i in node.next_functions)
    except (AttributeError, IndexError):  # (a torch without the metadata: counted as computing)
        return False


def _cast_passes(node) -> bool:
    """Whether a cast (:data:`CASTS`) passes: its backward casts the gradient from its output's
    dtype to its input's, which cannot overflow when the input's format reaches at least as far
    as the output's (float16 -> float32, bfloat16 -> float32, float16 -> bfloat16, the same dtype;
    not float32 -> bfloat16, whose largest value is just below float32's). Autograd's metadata
    only: no sync."""
    try:
        reach = _finfo(node._input_metadata[0].dtype).max
        return all(nxt is None or _finfo(nxt._input_metadata[i].dtype).max >= reach
                   for nxt, i in node.next_functions)
    except (AttributeError, IndexError, TypeError):  # (no metadata, or not a floating dtype: computing)
        return False


class ModuleCall(NamedTuple):
    """The structural facts of one call of a tapped module."""

    name: str
    call: int
    parent: int | None
    inputs: tuple[int, ...]
    module_id: int


# A returned tensor is remembered twice. By its id, for arguments that are that very tensor:
# (call, version, mark), where the mark tells it from a later tensor that reuses the id of a
# freed one: its autograd node's sequence number, or, for a tensor without history, a weak
# reference to it. And, with history, by its node's sequence number, for the walks: (the node's
# type, call). Either value is a list when several share the key (a module returning its child's
# output). Sequence numbers count per thread: the type tells apart most nodes of two threads that
# share one (a recomputation on an autograd device thread). Only ints, a type and (without
# history) a weak reference are kept: no tensor, no node.
_ByTensor = tuple[int, int, "int | weakref.ref"]
_ByNode = tuple[type, int]


class CallGraph:
    """The calls of the step in progress: numbers them and finds their facts."""

    def __init__(self) -> None:
        self._made: dict[int, ModuleCall] = {}
        self.reset()

    def reset(self) -> None:
        """Start a new step (between iterations): numbering restarts and returned tensors are
        forgotten; this step's calls are kept for the next one to reuse. No sync."""
        self._numbers = itertools.count()
        self.calls = 0  # calls begun this step
        self._previous, self._made = self._made, {}
        self._tensors: dict[int, _ByTensor | list[_ByTensor]] = {}
        self._nodes: dict[int, _ByNode | list[_ByNode]] = {}

    def begin(self, name: str, module_id: int, parent: int | None, args: tuple, kwargs: dict) -> ModuleCall:
        """The facts of a call that begins now with these arguments: the previous step's object
        for this call number when they are equal. No sync."""
        call = next(self._numbers)
        self.calls = call + 1  # (racing threads may store a smaller count: only 0 or not is read)
        if not kwargs and len(args) == 1 and isinstance(args[0], _Tensor):
            t = args[0]
            # The common case, inlined: the one argument is what one tapped call returned.
            held = self._tensors.get(id(t))
            node = t.grad_fn
            if (type(held) is tuple and held[1] == t._version and node is not None
                    and held[2] == node._sequence_nr()):
                found = (held[0],)
            else:
                found = self._sources(t)
        else:
            found = []
            for t in tensors_in(args, kwargs):
                found.extend(self._sources(t))
        if len(found) > 1:
            unique = set(found)
            if min(unique) < 0:  # a call reached both unchanged and through code: through code
                unique = {c for c in unique if c < 0 or ~c not in unique}
            inputs = tuple(sorted(unique))
        else:
            inputs = tuple(found)
        info = self._previous.get(call)
        if (info is None or info.inputs != inputs or info.parent != parent or info.module_id != module_id
                or info.name != name):
            info = ModuleCall(name, call, parent, inputs, module_id)
        self._made[call] = info
        return info

    def returned(self, t: torch.Tensor, call: int) -> None:
        """Note that ``call`` returned ``t`` (a floating-point tensor), as it is now. No sync."""
        node = t.grad_fn
        if node is None:
            mark = weakref.ref(t)
        else:
            mark = node._sequence_nr()
            if mark in self._nodes or len(self._nodes) >= MAX_REMEMBERED:
                _add(self._nodes, mark, (type(node), call))
            else:
                self._nodes[mark] = (type(node), call)  # (the usual case, inlined)
        key = id(t)
        if key not in self._tensors and len(self._tensors) < MAX_REMEMBERED:
            self._tensors[key] = (call, t._version, mark)  # (the usual case, inlined)
            return
        held = self._tensors.get(key)
        if held is not None and not any(self._same(t, entry[2]) for entry in _entries(held)):
            del self._tensors[key]  # a freed tensor's: its id is reused
        _add(self._tensors, key, (call, t._version, mark))

    @staticmethod
    def _same(t: torch.Tensor, mark) -> bool:
        """Whether ``mark`` was made for ``t`` (not for a freed tensor whose id ``t`` reuses).
        No sync."""
        node = t.grad_fn
        return mark == node._sequence_nr() if isinstance(mark, int) and node is not None else (
            not isinstance(mark, int) and mark() is t)

    def _sources(self, t: torch.Tensor) -> list[int]:
        """The tapped calls whose returned tensors reach ``t`` (possibly repeated): the calls
        that returned this very tensor unmodified, else a walk from its autograd node; calls
        reached only through nodes that compute (not :data:`PASSES`) as ``~call``. No sync."""
        held = self._tensors.get(id(t))
        if held is not None:
            version = t._version
            direct = [call for call, v, mark in _entries(held) if v == version and self._same(t, mark)]
            if direct:
                return direct
        node = t.grad_fn
        return self._upstream(node) if node is not None else []

    def _returned_by(self, node) -> list[int] | None:
        """The calls that returned one of ``node``'s outputs, or None. No sync."""
        held = self._nodes.get(node._sequence_nr())
        if held is None:
            return None
        kind = type(node)
        return [call for k, call in _entries(held) if k is kind] or None

    def _upstream(self, node) -> list[int]:
        """Breadth-first from ``node`` through untapped autograd nodes, stopping at the nodes of
        tapped outputs (``node`` itself too): their calls, as ``~call`` when reached through a
        node that computes (not :data:`PASSES`); visits at most MAX_WALK nodes. A node reached
        first by a path that only passes gradients on is visited again if a path through code
        reaches it too. The queue keeps every visited node's Python object alive during the
        walk, so their ids stay unique; it is dropped on return. No sync."""
        calls: list[int] = []
        queue, through, seen = [node], [False], {id(node): False}  # through: past a node that computes
        for visited, current in enumerate(queue):  # (the loop sees what is appended to the queue)
            if visited == MAX_WALK:
                break
            computed = through[visited]
            hit = self._returned_by(current)
            if hit is not None:
                calls.extend([~call for call in hit] if computed else hit)
                continue
            if not computed:
                computed = not _passes(current)
            for nxt, _ in current.next_functions:
                if nxt is not None:
                    key = id(nxt)
                    before = seen.get(key)
                    if before is None or (computed and not before):
                        seen[key] = computed
                        queue.append(nxt)
                        through.append(computed)
        return calls


def _entries(held) -> list:
    return held if isinstance(held, list) else [held]


def _add(table: dict, key: int, entry: tuple) -> None:
    """Add ``entry`` under ``key``: the entry itself, a list from the second one on. A table
    that outgrew MAX_REMEMBERED (a long forward-only loop) is emptied first."""
    held = table.get(key)
    if held is None:
        if len(table) >= MAX_REMEMBERED:
            table.clear()
        table[key] = entry
    elif isinstance(held, list):
        held.append(entry)
    else:
        table[key] = [held, entry]


def tensors_in(*values: Any) -> list[torch.Tensor]:
    """The tensors in (nested) tuples, lists and dicts, in order. No sync."""
    out: list[torch.Tensor] = []
    for value in values:
        _collect(value, out)
    return out


def _collect(value: Any, out: list[torch.Tensor]) -> None:
    if isinstance(value, _Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _collect(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, out)
