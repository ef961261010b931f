"""Overflow and forward origins on real fp16 arithmetic (CPU autocast), from recorded runs."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

import ampdoctor
from ampdoctor.read.run import read_run
from ampdoctor.analysis.origins import OUTSIDE, find_origins, nonfinite_rows
from ampdoctor.analysis.report import report_data
from ampdoctor.record.call_graph import tensors_in
from ampdoctor.render import contract
from models import Amplify, CallAmplifier, DeepNet, SharedNet, batches, fit, set_at

K = 3          # the step at which something goes wrong
STEPS = 6
QUIET = dict(init_scale=2.0**10)  # no overflow of its own in these tiny models


def record(model, path, *, before_step=None, data=None, **options) -> pd.DataFrame:
    options = {"level": "full", "every": 1, **QUIET, **options}
    with ampdoctor.GradScaler("cpu", model=model, path=path, **options) as scaler:
        fit(model, scaler, data or batches(STEPS, seed=0), before_step=before_step)
    return ampdoctor.load(path)


def rows(frame, step, kind, name=None):
    sel = frame[(frame.step == step) & (frame.kind == kind)]
    return sel if name is None else sel[sel.name == name]


@pytest.mark.parametrize("child", [True, False], ids=["on-its-child-output", "on-its-input"])
def test_backward_amplification_three_levels_deep(child, run_path):
    """A custom autograd Function inside blocks.1.inner.boom multiplies its backward gradient by
    1e8 at step K; the module is followed by an in-place residual add and an in-place ReLU."""
    torch.manual_seed(0)
    model = DeepNet(child=child)
    boom = model.blocks[1].inner.boom

    before_step = set_at(boom, "factor", 1e8, K)

    frame = record(model, run_path, before_step=before_step)
    origins = find_origins(frame)
    assert [o.step for o in origins] == [K]
    (o,) = origins
    assert o.skipped and o.forward is None and o.detail == "full"
    assert o.overflow.name == "blocks.1.inner.boom"
    assert (o.overflow.kind, o.overflow.step, o.overflow.rank) == ("grad_output", K, 0)
    # Real arithmetic: boom's own output gradient was finite, the one its backward produced was not.
    grads = rows(frame, K, "grad_output")
    assert not nonfinite_rows(grads[grads.name == "blocks.1.inner.boom"]).any()
    produced = grads[grads.name == o.overflow.tensor]
    assert produced.dtype.iloc[0] == "float16" and produced.n_inf.iloc[0] > 0
    assert o.overflow.tensor == ("blocks.1.inner.boom.lin" if child else "blocks.1.inner.gain")


def test_forward_overflow_names_the_module_whose_fp16_output_exceeded_65504(run_path):
    torch.manual_seed(0)
    model = DeepNet()
    gain = model.blocks[1].inner.gain

    before_step = set_at(gain, "gain", 1e6, K)

    frame = record(model, run_path, before_step=before_step)
    (o,) = find_origins(frame)
    assert o.step == K and o.skipped and o.overflow is None
    assert (o.forward.name, o.forward.kind, o.forward.occurrence) == ("blocks.1.inner.gain", "output", 0)
    out = rows(frame, K, "output", "blocks.1.inner.gain")
    assert out.dtype.iloc[0] == "float16" and out.n_inf.iloc[0] > 0
    assert not nonfinite_rows(rows(frame, K, "output", "blocks.1.inner.pre")).any()


def test_nan_in_the_batch_blames_the_first_module_that_sees_it(run_path):
    torch.manual_seed(0)
    data = batches(STEPS, seed=0)
    data[K][0][2, 5] = float("nan")
    frame = record(DeepNet(), run_path, data=data)
    (o,) = find_origins(frame)
    assert o.step == K and o.forward.name == "inp" and o.overflow is None
    assert o.loss is not None and math.isnan(o.loss)
    # Every later module's output was non-finite too, and none of them is blamed.
    later = rows(frame, K, "output")
    assert nonfinite_rows(later).sum() == len(later)


def test_shared_module_forward_overflow_names_the_second_call(run_path):
    torch.manual_seed(0)
    model = SharedNet()

    def before_step(i):  # tanh ≤ 1 → ×200 → ×200 (< 65504) → ×200 overflows fp16
        model.shared.gain = model.mid.gain = 200.0 if i == K else 1.0

    frame = record(model, run_path, before_step=before_step)
    (o,) = find_origins(frame)
    assert (o.forward.name, o.forward.occurrence) == ("shared", 1)
    first_call = rows(frame, K, "output", "shared").sort_values("order").iloc[:1]
    assert not nonfinite_rows(first_call).any()


@pytest.mark.parametrize("fire_on", [0, 1])
def test_shared_module_backward_overflow_names_the_right_call(fire_on, run_path):
    """With fire_on=0 a functional tanh sits between ``inp`` and the amplifying call."""
    torch.manual_seed(0)
    model = SharedNet(shared=CallAmplifier(fire_on))

    before_step = set_at(model.shared, "factor", 1e8, K)

    frame = record(model, run_path, before_step=before_step)
    (o,) = find_origins(frame)
    assert o.forward is None
    assert (o.overflow.name, o.overflow.occurrence) == ("shared", fire_on)
    assert o.overflow.tensor == ("inp" if fire_on == 0 else "mid")


def test_weight_gradient_overflow_is_named_by_its_module(run_path):
    """Only a parameter gradient is non-finite (param rows, no module taps): its module is named."""
    torch.manual_seed(0)
    model = DeepNet()
    data = batches(STEPS, seed=0)

    weight = model.blocks[0].inner.pre.weight
    fire = {"now": False}
    weight.register_hook(lambda g: torch.full_like(g, float("inf")) if fire["now"] else g)

    def before_step(i):  # at step K a weight gradient is inf while every other one is finite
        fire["now"] = i == K

    frame = record(model, run_path, before_step=before_step, data=data, level="params")
    (o,) = find_origins(frame)
    assert o.detail is None and o.forward is None
    assert (o.overflow.name, o.overflow.kind) == ("blocks.0.inner.pre", "param_grad")
    assert o.overflow.tensor == "blocks.0.inner.pre.weight"


def test_healthy_run_has_no_origins(run_path):
    torch.manual_seed(0)
    assert find_origins(record(DeepNet(), run_path)) == []


def test_origins_from_flight_recorder_rows(run_path):
    """At a light step (only peak magnitudes recorded) the origins are found all the same."""
    torch.manual_seed(0)
    model = DeepNet()
    boom = model.blocks[1].inner.boom

    before_step = set_at(boom, "factor", 1e8, K)

    frame = record(model, run_path, before_step=before_step, every=100, flight_steps=2)
    (o,) = find_origins(frame)
    assert o.detail == "light" and o.overflow.name == "blocks.1.inner.boom"
    assert o.to_dict()["overflow"]["name"] == "blocks.1.inner.boom"
    # Only the flight window (K-1, K) was written as light rows: nothing at the quiet steps before.
    light = frame[frame.kind.isin(["output", "grad_output"]) & frame.n_nan.isna()]
    assert sorted(light.step.unique()) == [K - 1, K]


def test_gradient_produced_outside_the_model(run_path):
    """A loss whose gradient overflows before reaching the model: produced outside the taps."""
    torch.manual_seed(0)
    model = DeepNet()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=run_path, level="full", **QUIET)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(batches(STEPS, seed=0)):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
            # A finite loss whose gradient, cast back to fp16 at the model's output, overflows.
            loss = (out.float() * (1e6 if i == K else 1.0)).mean() + (out.float() - y).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    scaler.close()
    (o,) = find_origins(ampdoctor.load(run_path))
    assert o.step == K and o.forward is None and math.isfinite(o.loss)
    assert o.overflow.name == OUTSIDE and o.overflow.tensor == "head"  # head returned it for the model
    # The report names where it was seen and says what to do about it.
    report = contract(report_data(read_run(run_path)))
    (origin,) = report["overflow_origins"]
    assert origin["name"] == OUTSIDE and origin["after"] == "head" and origin["count"] == 1
    assert any("outside every tapped module" in a and "into `head`'s output" in a and "or the loss" in a
               for a in report["recommendation"]["advice"]), report["recommendation"]["advice"]


def test_skipped_steps_without_an_origin_are_counted_in_a_warning(tmp_path):
    """init_scale far too high at level='params': the first skipped step has no module rows (the
    escalation starts after it), the later ones do. Their origins add up to fewer than the
    skipped steps, and the report says how many have none."""
    from models import train_recorded

    path = tmp_path / "run.parquet"
    skipped = train_recorded(path, steps=30, init_scale=2.0**24, level="params")
    report = contract(report_data(read_run(path)))
    named = sum(o["count"] for o in report["overflow_origins"])
    assert 0 < named < skipped == report["scale"]["skipped_steps"]
    assert f"{skipped - named} of the {skipped} anomalous steps have no origin" in " ".join(report["warnings"])


def test_pass_through_module_is_not_blamed(run_path):
    """An nn.Identity between the producer and the amplifier returns the same tensor: the
    amplifier is named, not the Identity."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 16)
            self.drop = torch.nn.Identity()
            self.b = CallAmplifier(fire_on=0)
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x):
            self.b.calls = 0
            return self.head(self.b(self.drop(self.a(x))))

    torch.manual_seed(0)
    model = Net()

    before_step = set_at(model.b, "factor", 1e8, K)

    (o,) = find_origins(record(model, run_path, before_step=before_step))
    assert o.overflow.name == "b"


def test_parameter_of_the_model_itself_is_named_by_the_model(run_path):
    class Net(DeepNet):
        def __init__(self):
            super().__init__()
            self.pos = torch.nn.Parameter(torch.zeros(16))

        def forward(self, x):
            return super().forward(x + self.pos)

    torch.manual_seed(0)
    model = Net()
    fire = {"now": False}
    model.pos.register_hook(lambda g: torch.full_like(g, float("inf")) if fire["now"] else g)

    def before_step(i):
        fire["now"] = i == K

    (o,) = find_origins(record(model, run_path, before_step=before_step, level="params"))
    assert (o.overflow.name, o.overflow.tensor) == ("(model)", "pos")


def test_masked_minus_inf_activation_is_not_an_anomaly(run_path):
    """A module that outputs -inf on purpose (masked logits) does not make steps anomalous, and
    a real overflow elsewhere is still found."""
    class Masked(torch.nn.Module):
        def forward(self, x):
            return x.masked_fill(torch.ones_like(x, dtype=torch.bool).triu(1)[: x.shape[0]], float("-inf"))

    class Net(DeepNet):
        def __init__(self):
            super().__init__()
            self.mask = Masked()

        def forward(self, x):
            self.mask(x)  # computed and thrown away, like an attention mask never applied
            return super().forward(x)

    torch.manual_seed(0)
    model = Net()
    boom = model.blocks[1].inner.boom

    before_step = set_at(boom, "factor", 1e8, K)

    frame = record(model, run_path, before_step=before_step)
    assert nonfinite_rows(frame[(frame.kind == "output") & (frame.name == "mask")]).all()
    (o,) = find_origins(frame)
    assert o.step == K and o.forward.name == "mask" and o.overflow.name == "blocks.1.inner.boom"


# -- autograd Functions called inline, in a module's own forward (not wrapped in a module) ---------

class InfBackward(torch.autograd.Function):
    """Identity forward; at ``fire`` its backward returns inf in place of the gradient."""

    @staticmethod
    def forward(ctx, x, fire):
        ctx.fire = fire
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return (torch.full_like(grad, float("inf")) if ctx.fire else grad), None


class Float32Amplify(torch.autograd.Function):
    """Computes in float32 (``custom_fwd``); its backward returns a float32 gradient ``factor``
    times larger, finite, which autograd casts back to its float16 input's dtype: it overflows there."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x * 1.0

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        return grad * ctx.factor, None


def inline(kind: str, x: torch.Tensor, fire: bool) -> torch.Tensor:
    if kind == "amplify":  # fp16 arithmetic: grad * 1e8 overflows
        return Amplify.apply(x, 1e8 if fire else 1.0)
    if kind == "inf":
        return InfBackward.apply(x, fire)
    return Float32Amplify.apply(x, 1e8 if fire else 1.0)


class Probe:
    """The gradients w.r.t. a Function's input and output at the step it fires, from tensor hooks
    of the test's own: whether each was finite."""

    def __init__(self) -> None:
        self.armed = False
        self.finite: dict[str, bool] = {}

    def around(self, fn, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            x.register_hook(self._keep("input"))
        y = fn(x)
        if self.armed:
            y.register_hook(self._keep("output"))
        return y

    def _keep(self, what: str):
        def hook(grad):
            self.finite[what] = bool(torch.isfinite(grad).all())
        return hook


class InlineBlock(torch.nn.Module):
    """``b(Function(a(x)))``: the Function is called by this block's own forward, on call
    ``fire_on`` of each forward (``calls`` is reset by its owner)."""

    def __init__(self, kind: str, probe: Probe, d: int = 16, fire_on: int = 0) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.kind, self.probe, self.fire_on = kind, probe, fire_on
        self.fire, self.calls = False, 0

    def forward(self, x):
        mine = self.fire and self.calls == self.fire_on
        self.calls += 1
        self.probe.armed = mine
        return self.b(self.probe.around(lambda h: inline(self.kind, h, mine), self.a(x)))


class InlineNet(torch.nn.Module):
    """``head(block(block(inp(x))))`` (the block called ``calls`` times), or with ``top``, the
    Function called by the model's own forward between the block and the head."""

    def __init__(self, kind: str, *, top: bool = False, calls: int = 1, fire_on: int = 0) -> None:
        super().__init__()
        self.probe = Probe()
        self.inp = torch.nn.Linear(16, 16)
        self.block = InlineBlock(kind, self.probe, fire_on=fire_on)
        self.head = torch.nn.Linear(16, 4)
        self.kind, self.top, self.n_calls = kind, top, calls
        self.fire = False

    def forward(self, x):
        self.block.calls = 0
        self.block.fire = self.fire and not self.top
        h = self.inp(x)
        for _ in range(self.n_calls):
            h = self.block(h)
        if self.top:
            self.probe.armed = self.fire
            h = self.probe.around(lambda t: inline(self.kind, t, self.fire), h)
        return self.head(h)


def call_of(frame, step, name, occurrence=0) -> int:
    """The ``call`` number of a module's ``occurrence``-th call at ``step``, from its output rows."""
    return int(sorted(rows(frame, step, "output", name)["call"])[occurrence])


@pytest.mark.parametrize("kind", ["amplify", "inf", "float32"])
def test_function_called_inline_in_a_block_is_named_by_the_block(kind, run_path):
    """A Function called between the block's two children (not wrapped in a module) makes the
    first non-finite gradient: the block whose forward called it is named, not ``block.b``, whose
    backward ran just before, nor ``head``."""
    torch.manual_seed(0)
    model = InlineNet(kind)
    frame = record(model, run_path, before_step=set_at(model, "fire", True, K, normal=False))
    # Ground truth from the test's own hooks: b's backward handed the Function a finite gradient,
    # the Function's backward made it non-finite.
    assert model.probe.finite == {"output": True, "input": False}
    (o,) = find_origins(frame)
    assert o.step == K and o.skipped and o.forward is None
    assert (o.overflow.name, o.overflow.kind, o.overflow.tensor) == ("block", "grad_output", "block.a")
    assert (o.overflow.call, o.overflow.occurrence) == (call_of(frame, K, "block"), 0)
    # The rows agree: b's output gradient finite, a's (the Function's input's) not, in float16.
    assert not nonfinite_rows(rows(frame, K, "grad_output", "block.b")).any()
    into_a = rows(frame, K, "grad_output", "block.a")
    assert into_a.dtype.iloc[0] == "float16" and into_a.n_inf.iloc[0] > 0
    # The record: b received a's output through the Function (computed), not unchanged.
    b = rows(frame, K, "output", "block.b").iloc[0]
    a_call = call_of(frame, K, "block.a")
    assert list(b["inputs"]) == [a_call] and list(b["computed_inputs"]) == [a_call]
    report = contract(report_data(read_run(run_path)))
    (origin,) = report["overflow_origins"]
    assert (origin["name"], origin["kind"], origin["first_step"]) == ("block", "grad_output", K)


@pytest.mark.parametrize("fire_on", [0, 1])
def test_function_called_inline_names_the_call_of_the_block_that_ran_it(fire_on, run_path):
    """The block is called twice; the Function fires in one of its calls: that call is named."""
    torch.manual_seed(0)
    model = InlineNet("amplify", calls=2, fire_on=fire_on)
    frame = record(model, run_path, before_step=set_at(model, "fire", True, K, normal=False))
    assert model.probe.finite == {"output": True, "input": False}
    (o,) = find_origins(frame)
    assert (o.overflow.name, o.overflow.occurrence) == ("block", fire_on)
    assert o.overflow.call == call_of(frame, K, "block", fire_on)
    # The first non-finite gradient in backward order is the one into the Function: the output
    # gradient of block.a in the same call of the block.
    grads = rows(frame, K, "grad_output").sort_values("order")
    first = grads[nonfinite_rows(grads)].iloc[0]
    assert (first["name"], int(first["call"])) == ("block.a", call_of(frame, K, "block.a", fire_on))


@pytest.mark.parametrize("kind", ["amplify", "inf", "float32"])
def test_function_called_inline_in_the_model_forward_is_named_by_the_model(kind, run_path):
    """The Function sits between the block and the head in the model's own forward: the model is
    named (the head's backward was finite), and the postmortem names it too."""
    from ampdoctor.analysis.postmortem import postmortem_data

    torch.manual_seed(0)
    model = InlineNet(kind, top=True)
    steps = K + 6  # every step from K skipped: a run of skipped steps for the postmortem
    frame = record(model, run_path, before_step=set_at(model, "fire", True, range(K, steps), normal=False),
                   data=batches(steps, seed=0))
    assert model.probe.finite == {"output": True, "input": False}
    origins = find_origins(frame)
    assert [o.step for o in origins] == list(range(K, steps))
    for o in origins:
        assert (o.overflow.name, o.overflow.kind, o.overflow.occurrence) == ("(model)", "grad_output", 0)
        assert o.overflow.tensor in ("block", "block.b")  # the block returned b's output as its own
    assert not nonfinite_rows(rows(frame, K, "grad_output", "head")).any()
    pm = contract(postmortem_data(read_run(run_path)))
    assert pm["cause"] == "backward_overflow" and pm["origin"]["name"] == "(model)"


@pytest.mark.parametrize("between", ["scaled", "passed"])
def test_overflow_through_computing_inline_code_names_the_enclosing_call(between, run_path):
    """The reverse case: the consumer's backward overflows (an amplifier wrapped in a module, at a
    known step), and its input came through untapped code. Through code that computes (``* 0.5``)
    the record cannot tell the consumer's backward from that code's: the call whose code ran it,
    which holds both, is named. Through code that only passes gradients on (``torch.tanh``, a
    reshape) the consumer itself is named."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(16, 16)
            self.block = torch.nn.Module()
            self.block.a, self.block.amp = torch.nn.Linear(16, 16), CallAmplifier(fire_on=0)
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x):
            self.block.amp.calls = 0
            h = self.block.a(self.inp(x))
            h = h * 0.5 if between == "scaled" else torch.tanh(h).reshape(h.shape)
            return self.head(self.block.amp(h))

    torch.manual_seed(0)
    model = Net()
    frame = record(model, run_path, before_step=set_at(model.block.amp, "factor", 1e8, K))
    (o,) = find_origins(frame)
    assert (o.overflow.name, o.overflow.tensor) == ("(model)" if between == "scaled" else "block.amp", "block.a")
    # The amplifier's output gradient was finite, the gradient into block.a was not.
    assert not nonfinite_rows(rows(frame, K, "grad_output", "block.amp")).any()
    assert nonfinite_rows(rows(frame, K, "grad_output", "block.a")).all()


# -- dtype casts in untapped code: a cast passes when its backward keeps or widens the range ------

class GradientTruth:
    """The test's own ground truth: tensor hooks (no autograd node added) on the float inputs and
    outputs of every submodule, per step. A module *made* a non-finite gradient at a step when
    every gradient w.r.t. its outputs was finite and one w.r.t. its inputs was not."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.step = 0
        self.seen: dict[tuple[int, str], dict[str, list[bool]]] = {}
        for name, module in model.named_modules():
            if name:
                module.register_forward_hook(self._watch(name))

    def _watch(self, name: str):
        def forward_hook(module, args, out):
            seen = self.seen.setdefault((self.step, name), {"output": [], "input": []})
            for what, values in (("input", args), ("output", out)):
                for t in tensors_in(values):
                    if t.is_floating_point() and t.requires_grad:
                        t.register_hook(lambda g, flags=seen[what]: flags.append(bool(torch.isfinite(g).all())))
        return forward_hook

    def made(self, step: int) -> set[str]:
        return {name for (s, name), seen in self.seen.items()
                if s == step and all(seen["output"]) and seen["output"] and not all(seen["input"])}


class Amplifier(torch.nn.Module):
    """An autograd Function (identity forward) wrapped in a module: its backward multiplies the
    gradient by ``factor``, in the gradient's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x):
        return Amplify.apply(x, self.factor)


class LSTMLM(torch.nn.Module):
    """``Embedding -> LSTM -> grl -> Linear``. The LSTM runs in float32 (autocast off: oneDNN's
    LSTM refuses float16 autocast on the CPU) and the model casts its output to float16 for
    ``grl`` (forward fp32 -> fp16: the backward widens the gradient to float32). The tuple the LSTM
    returns is unpacked; with ``sliced``, ``grl`` receives one position of the cast output, taken
    by views."""

    def __init__(self, vocab: int = 32, d: int = 16, sliced: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.lstm = torch.nn.LSTM(d, d, batch_first=True)
        self.grl = Amplifier()
        self.head = torch.nn.Linear(d, vocab)
        self.sliced = sliced

    def forward(self, idx):
        with torch.autocast("cpu", enabled=False):
            out, _ = self.lstm(self.emb(idx).float())
        h = out.half()
        if self.sliced:
            h = h[:, 1:].transpose(0, 1)[0]  # a slice, a transpose, a select: views
        return self.head(self.grl(h))


@pytest.mark.parametrize("sliced", [False, True], ids=["cast", "cast-unpacked-sliced"])
def test_a_cast_whose_backward_widens_passes_the_gradient_on(sliced, run_path):
    """Issue 37: an fp32 -> fp16 cast between the LSTM and ``grl`` (whose backward makes the
    gradient inf from step K on: a run of skipped steps for the postmortem) cannot make a gradient
    non-finite: its backward casts fp16 -> fp32. ``grl`` is named, not the model whose forward ran
    the cast."""
    torch.manual_seed(0)
    vocab, steps = 32, K + 6
    model = LSTMLM(vocab, sliced=sliced)
    truth = GradientTruth(model)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampdoctor.GradScaler("cpu", model=model, path=run_path, level="full", every=1, amp_dtype=torch.float16,
                              **QUIET) as scaler:
        for step in range(steps):
            truth.step = step
            model.grl.factor = 1e8 if step >= K else 1.0
            idx = torch.randint(0, vocab, (2, 9), generator=gen)
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(idx[:, :-1])
            target = idx[:, 2] if sliced else idx[:, 1:]  # (sliced: the token after input position 1)
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), target.reshape(-1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    # Ground truth from the test's own hooks: only grl's backward made a gradient non-finite.
    assert [truth.made(step) for step in range(steps)] == [set()] * K + [{"grl"}] * (steps - K)
    frame = ampdoctor.load(run_path)
    origins = find_origins(frame)
    assert [o.step for o in origins] == list(range(K, steps))
    for o in origins:
        assert o.forward is None
        assert (o.overflow.name, o.overflow.kind, o.overflow.tensor) == ("grl", "grad_output", "lstm")
    # The record: grl received the LSTM's output through the cast, as passed on, not computed.
    grl = rows(frame, K, "output", "grl").iloc[0]
    assert list(grl["inputs"]) == [call_of(frame, K, "lstm")] and list(grl["computed_inputs"]) == []
    pm = ampdoctor.postmortem(run_path)
    assert (pm["cause"], pm["event"]["kind"]) == ("backward_overflow", "skip_run")
    assert pm["origin"] == {"name": "grl", "kind": "grad_output", "rank": 0, "step": K}


def test_a_cast_whose_backward_narrows_computes(run_path):
    """The other way: ``block.a``'s fp16 output cast to fp32 (``.float()``) in the model's own
    forward before an amplifier whose float32 backward stays finite (×1e8); the cast's backward,
    fp32 -> fp16, overflows. The cast made the non-finite gradient, in the model's forward: the
    model is named, not the amplifier."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(16, 16)
            self.block = torch.nn.Module()
            self.block.a, self.block.amp = torch.nn.Linear(16, 16), Amplifier()
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x):
            h = self.block.a(self.inp(x))
            wide = h.float()
            self.casts.append((h.dtype, wide.dtype))
            return self.head(self.block.amp(wide))

    torch.manual_seed(0)
    model = Net()
    model.casts = []
    truth = GradientTruth(model)

    def before_step(i):
        truth.step = i
        model.block.amp.factor = 1e8 if i == K else 1.0

    frame = record(model, run_path, before_step=before_step)
    assert set(model.casts) == {(torch.float16, torch.float32)}
    # Ground truth: no module made the non-finite gradient at K (the amplifier's float32 backward
    # was finite), yet block.a's output gradient was inf: the cast between them made it.
    assert truth.made(K) == set()
    assert truth.seen[(K, "block.amp")] == {"output": [True], "input": [True]}
    assert truth.seen[(K, "block.a")]["output"] == [False]
    (o,) = find_origins(frame)
    assert o.step == K and o.forward is None
    assert (o.overflow.name, o.overflow.tensor) == ("(model)", "block.a")
    amp = rows(frame, K, "output", "block.amp").iloc[0]
    a_call = call_of(frame, K, "block.a")
    assert list(amp["inputs"]) == [a_call] and list(amp["computed_inputs"]) == [a_call]
