"""Overflow and forward origins on real fp16 arithmetic (CPU autocast), from recorded runs."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

import ampdoctor
from ampdoctor.analysis.origins import OUTSIDE, find_origins, nonfinite_rows
from ampdoctor.analysis.report import report_data
from ampdoctor.render import contract
from models import CallAmplifier, DeepNet, SharedNet, batches, fit, set_at

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
    report = contract(report_data(run_path))
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
    report = contract(report_data(path))
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
