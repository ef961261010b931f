"""The call structure of module taps across steps (ampdoctor/record/call_graph.py) and what a light step
costs: the facts of every call are those a fresh set of taps computes, on models whose calls or
routing change from step to step; a static model makes no new call objects after its first step;
a light step dispatches two ops per tapped module (their ``aminmax``) and a constant."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.cli.demo import TinyGPT
from ampdoctor.record.call_graph import ModuleCall
from ampdoctor.record.hooks import ModuleTaps
from ampdoctor.record.light_taps import LightTaps, observations
from models import DeepNet, batches, checkpointed

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from host_cost import OpCounter  # noqa: E402


class Recording:
    """A tap sink that keeps what each observation said about its call."""

    def __init__(self) -> None:
        self.seen: list = []

    def observe_tap(self, kind, call, order, tensor) -> None:
        self.seen.append((kind, order, call))

    def fail(self, exc: BaseException) -> None:
        raise exc


class OddSteps(nn.Module):
    """An extra tapped module on odd steps (dynamic control flow: the call sequence changes)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.extra, self.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.step = 0

    def forward(self, x):
        h = self.a(x)
        if self.step % 2:
            h = self.extra(h)
        return self.head(torch.tanh(h))


class Routed(nn.Module):
    """The same calls every step, but which tapped output reaches ``head`` alternates, through
    untapped code that makes the same autograd nodes either way: only the graph's edges differ."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.step = 0

    def forward(self, x):
        ha, hb = self.a(x), self.b(x)
        chosen = ha if self.step % 2 else hb
        return self.head(torch.tanh(chosen) * 2) + 0 * ha.sum() + 0 * hb.sum()


class Deepening(nn.Module):
    """1, 2, 3, 1, 2, 3, ... blocks: the module sequence changes every step."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)
        self.step = 0

    def forward(self, x):
        for block in self.blocks[: self.step % 3 + 1]:
            x = torch.relu(block(x))
        return self.head(x)


MODELS = {
    "static": DeepNet,
    "odd-steps": OddSteps,
    "routed": Routed,
    "deepening": Deepening,
    "checkpoint": lambda: checkpointed(reentrant=False),
    "checkpoint-reentrant": lambda: checkpointed(reentrant=True),
}


def facts(seen) -> list:
    return [(kind, order, c.name, c.call, c.parent, c.inputs) for kind, order, c in seen]


def run_steps(model, steps=6):
    """Per step: the observations of taps kept across steps, and of taps made for that step."""
    torch.manual_seed(0)
    kept_sink = Recording()
    kept = ModuleTaps(model, None, kept_sink)
    kept.install()
    out = []
    for step, (x, y) in enumerate(batches(steps)):
        model.step = step
        fresh_sink = Recording()
        fresh = ModuleTaps(model, None, fresh_sink)  # no step before it: nothing to reuse
        fresh.install()
        kept.reset()
        kept_sink.seen = []
        x.requires_grad_(True)  # reentrant checkpointing needs an input that requires grad
        loss = (model(x) - y).square().mean()
        loss.backward()
        fresh.remove()
        out.append((kept_sink.seen, fresh_sink.seen))
    kept.remove()
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_facts_reused_across_steps_are_the_freshly_computed_ones(name):
    for kept, fresh in run_steps(MODELS[name]()):
        assert facts(kept) == facts(fresh)
        assert any(kind == "grad_output" for kind, _, _ in kept)


def test_untapped_routing_that_changes_with_the_step_is_followed():
    """The case a fingerprint of the step's autograd nodes could not tell apart: ``head``'s
    input comes from ``a`` on odd steps, from ``b`` on even ones."""
    for step, (kept, _) in enumerate(run_steps(Routed())):
        calls = {c.name: c for kind, _, c in kept if kind == "output"}
        source = "a" if step % 2 else "b"
        # (``* 2`` computes with it: the source is stored as ``~call``)
        assert calls["head"].inputs == (~calls[source].call,), step


class Total(nn.Module):
    """Returns a new tensor (not its input, as ``nn.Identity`` does: the next consumer would
    then receive this module's output too)."""

    def forward(self, x):
        return x.float().sum()


class Routes(nn.Module):
    """``a``'s output reaches each consumer another way: unchanged, through views, through code
    that passes gradients on (tanh, ReLU, a residual add), and through code that computes with
    it (``* 3``, an autograd Function, a cast, ``expand``, an addition of another dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.names = ["same", "view", "passes", "scaled", "function", "cast", "expand", "mixed", "dtypes"]
        for name in self.names:
            setattr(self, name, Total())

    def forward(self, x):
        from models import Amplify

        h = self.a(x)
        outs = [self.same(h),
                self.view(h.view(-1, 4, 4).transpose(1, 2)[:, 1:].reshape(-1, 12)),
                self.passes(torch.relu(torch.tanh(h) + x)),
                self.scaled(h * 3),
                self.function(Amplify.apply(h, 1.0)),
                self.cast(h.double()),
                self.expand(h[:1].expand(4, -1)),
                self.mixed(h + h * 3),  # unchanged on one path, computed on the other
                # a residual add of another dtype: the engine casts h's gradient from float64
                self.dtypes(h + x.double())]
        return sum(outs)


def test_inputs_say_whether_untapped_code_computed_with_the_tensor():
    """A consumer that received a tapped output through code whose backward may make a finite
    gradient non-finite lists it as ``~call``; through views and pass-through code, as ``call``."""
    model = Routes()
    sink = Recording()
    taps = ModuleTaps(model, None, sink)
    taps.install()
    x = torch.randn(4, 16)
    model(x).backward()
    taps.remove()
    calls = {c.name: c for kind, _, c in sink.seen if kind == "output"}
    a = calls["a"].call
    direct, computed = (a,), (~a,)
    assert {name: calls[name].inputs for name in model.names} == {
        "same": direct, "view": direct, "passes": direct, "scaled": computed, "function": computed,
        "cast": computed, "expand": computed, "mixed": computed, "dtypes": computed}


class Same(nn.Module):
    """Returns its input in the dtype it came in (a tapped module of any dtype: no parameters)."""

    def forward(self, x):
        return x * 1


CASTS = {  # (forward from, to): whether the cast passes gradients on (its backward: to -> from)
    (torch.float32, torch.float16): True,     # fp16 -> fp32: widens
    (torch.float32, torch.bfloat16): True,    # bf16 -> fp32: widens
    (torch.bfloat16, torch.float16): True,    # fp16 -> bf16: its range is wider
    (torch.float64, torch.float32): True,
    (torch.float32, torch.float32): True,     # a copy (``copy=True``): keeps the dtype
    (torch.float16, torch.float32): False,    # fp32 -> fp16: overflows beyond 65504
    (torch.bfloat16, torch.float32): False,   # fp32 -> bf16: bf16's largest value is below fp32's
    (torch.float16, torch.bfloat16): False,   # bf16 -> fp16: overflows beyond 65504
    (torch.float32, torch.float64): False,
}


@pytest.mark.parametrize(("source", "target"), list(CASTS), ids=lambda d: str(d).removeprefix("torch."))
def test_a_cast_passes_when_its_backward_keeps_or_widens_the_range(source, target):
    """A cast's backward is the cast the other way: the consumer of a cast tapped output lists the
    producer as passed on when that backward cannot overflow, as ``~call`` when it can."""
    model = nn.Module()
    model.a, model.b = Same(), Same()
    sink = Recording()
    taps = ModuleTaps(model, None, sink)
    taps.install()
    x = torch.randn(4, 16, dtype=source, requires_grad=True)
    out = model.b(model.a(x).to(target, copy=True))
    out.float().sum().backward()
    taps.remove()
    calls = {c.name: c for kind, _, c in sink.seen if kind == "output"}
    a = calls["a"].call
    assert out.dtype == target and calls["b"].inputs == ((a,) if CASTS[source, target] else (~a,))


def test_unpacking_a_returned_tuple_or_model_output_passes():
    """A module returns a tuple, or a Hugging Face ``ModelOutput``: the element a consumer
    receives, unpacked, sliced or split, is that call's output, passed on."""
    transformers = pytest.importorskip("transformers")

    class Pair(nn.Module):
        def __init__(self, hf: bool) -> None:
            super().__init__()
            self.lin, self.hf = nn.Linear(16, 16), hf

        def forward(self, x):
            h = self.lin(x) + 1  # (not the child's output: the consumers received this call's only)
            if self.hf:
                return transformers.modeling_outputs.BaseModelOutput(last_hidden_state=h, hidden_states=(x, h))
            return h, torch.tanh(h)

    for hf in (False, True):
        model = nn.Module()
        model.pair, model.first, model.sliced, model.split = Pair(hf), Same(), Same(), Same()
        sink = Recording()
        taps = ModuleTaps(model, None, sink)
        taps.install()
        out = model.pair(torch.randn(4, 16))
        h = out.last_hidden_state if hf else out[0]
        second = out.hidden_states[1] if hf else out[1]
        total = model.first(h).sum() + model.sliced(second[1:, :8]).sum() + model.split(h.unbind(0)[2]).sum()
        total.backward()
        taps.remove()
        calls = {c.name: c for kind, _, c in sink.seen if kind == "output"}
        pair = calls["pair"].call
        assert {n: calls[n].inputs for n in ("first", "sliced", "split")} == {
            "first": (pair,), "sliced": (pair,), "split": (pair,)}, hf


def test_a_static_model_makes_no_new_call_objects_after_its_first_step():
    """Objects that outlive a step set off Python's garbage collector: the facts of a call and
    its gradient hook are the previous step's when nothing changed."""
    steps = run_steps(DeepNet(), steps=4)
    first = {c.call: c for _, _, c in steps[1][0]}
    for kept, _ in steps[2:]:
        assert all(c is first[c.call] for _, _, c in kept)
    changing = run_steps(Deepening(), steps=4)
    second = {c.call: c for _, _, c in changing[1][0]}  # 2 blocks; step 2 has 3: head's call differs
    third = {c.name: c for _, _, c in changing[2][0]}
    assert third["head"] is not second.get(third["head"].call)


def test_gradient_hooks_are_reused_on_a_static_model():
    model = DeepNet()
    taps = ModuleTaps(model, None, Recording())
    taps.install()
    hooks = []
    for x, y in batches(3):
        taps.reset()
        (model(x) - y).square().mean().backward()
        hooks.append(dict(taps._hooks))
    taps.remove()
    assert hooks[1].keys() == hooks[2].keys() and all(hooks[2][k] is hooks[1][k] for k in hooks[1])


def light_step_ops(layers: int, level: str, tmp_path, fp8: bool = False) -> tuple[OpCounter, int]:
    """The ops one steady (light) step dispatches, and the number of tapped modules (the GEMM
    operands for ``ampdoctor fp8`` only with ``fp8``: counted apart below)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=16, d=8, layers=layers, heads=2, context=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    scaler = ampdoctor.GradScaler("cpu", model=model, path=tmp_path / f"{level}-{layers}-{fp8}.parquet", level=level,
                                  every=100, fp8=fp8)
    seq = torch.randint(0, 16, (1, 5), generator=torch.Generator().manual_seed(1))
    x, y = seq[:, :-1], seq[:, 1:]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, 16), y.reshape(-1))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):  # past step 0 (sampled) and the first light step (lazy state)
        step()
    with OpCounter() as counter:
        step()
    modules = len(scaler.recorder._taps.targets) if scaler.recorder._taps is not None else 0
    scaler.close()
    return counter, modules


def test_a_light_step_dispatches_two_ops_per_tapped_module_and_a_constant(tmp_path):
    # The model returns its head's output itself: one tensor seen twice in forward (the head's
    # and the model's output) and one gradient seen twice in backward, each reduced once.
    model = TinyGPT(vocab=16, d=8, layers=1, heads=2, context=4)
    seen = []
    model.head.register_forward_hook(lambda m, a, out: seen.append(out))
    assert model(torch.zeros(1, 4, dtype=torch.long)) is seen[0]
    extra = {}
    for layers in (1, 3):
        full, modules = light_step_ops(layers, "full", tmp_path)
        params, _ = light_step_ops(layers, "params", tmp_path)
        # Every tapped module here returns one float tensor that requires grad: one aminmax of
        # it in forward, one of its gradient in backward; none for the two repeats.
        assert full.ops["aminmax"] - params.ops["aminmax"] == 2 * modules - 2
        extra[layers] = (full.total - params.total) - 2 * modules
    assert extra[1] == extra[3]  # the step-end stacking: the same for any number of modules
    assert extra[1] <= 8  # a stack per dtype, a cat, abs, amax (and views)


def test_the_fp8_operands_add_a_reduction_per_weight_and_per_input_no_tap_has_reduced(tmp_path):
    """Per GEMM layer and step one aminmax of its weight (read at its call, when FSDP has
    materialised it); its input, where that is the previous tapped output (a LayerNorm's, the
    GELU's), and its output gradient (which the flight recorder has just reduced) cost none: only
    the attention projection's input, computed by untapped code (SDPA, a reshape), costs one, once
    per block. TinyGPT: 4 GEMM layers a block and the head. The step-end stacking is a constant."""
    extra = {}
    for layers in (1, 3):
        on, _ = light_step_ops(layers, "full", tmp_path, fp8=True)
        off, _ = light_step_ops(layers, "full", tmp_path, fp8=False)
        gemm_layers = 4 * layers + 1
        assert on.ops["aminmax"] - off.ops["aminmax"] == gemm_layers + layers
        extra[layers] = (on.total - off.total) - (gemm_layers + layers)
    # the step-end stacking (a stack per dtype, a cat, abs, amax) with its views: any depth alike
    assert extra[1] == extra[3] and extra[1] <= 10


def test_a_tensor_seen_again_at_once_is_reduced_once_unless_it_changed():
    """LightTaps: the same tensor twice in a row costs one aminmax and gets two rows with its
    peak; after an in-place change, or another tensor in between, it is reduced again."""
    taps = LightTaps(limit=100)
    call = ModuleCall("m", 0, None, (), 0)
    t = torch.tensor([1.0, -3.0, 2.0])
    other = torch.tensor([5.0])
    with OpCounter() as counter:
        taps.add("output", call, 0, t)
        taps.add("output", call, 1, t)      # a repeat: no op
        t.mul_(2)                           # changed in place: its version moved
        taps.add("output", call, 2, t)
        taps.add("output", call, 3, other)
        taps.add("output", call, 4, t)      # not the last one seen: reduced again
    assert counter.ops["aminmax"] == 4
    step = taps.flight_step(0)
    assert step.peaks.tolist() == [3.0, 3.0, 6.0, 5.0, 6.0]
    assert [o.order for o in observations(step.taps)] == [0, 1, 2, 3, 4]
    # A freed tensor's id may be reused: the weak reference tells the new tensor apart.
    taps.add("output", call, 0, torch.tensor([7.0]))
    taps.add("output", call, 1, torch.tensor([-8.0]))
    assert taps.flight_step(1).peaks.tolist() == [7.0, 8.0]
