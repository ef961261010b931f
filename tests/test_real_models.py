"""Diagnoses on third-party architectures, checked against ground truth measured here.

Underflow: the same batch on the same weights in float32 (autocast off) is the reference; an
element underflowed when it is exactly 0 in the fp16 AMP backward and nonzero in float32, unless
its float32 value is rounding noise (``architectures.true_underflow``).
Recommendations: re-training with the recommended settings.
"""

from __future__ import annotations

import pytest
import torch

import ampdoctor
from ampdoctor.read.run import read_run
from ampdoctor.analysis.report import report_data
from ampdoctor.analysis.simulate import simulate_data
from ampdoctor.render import contract

import architectures as A

pytestmark = pytest.mark.skipif(A.transformers is None, reason="needs transformers (the test extra)")

ARCHS = ["gpt2", "t5", "vit", "bert", "nanogpt", "relu_mlp", "cnn"]


def _train(arch, path, steps, *, lr=0.0, adam=False, loss_factor=1.0, capture=None, **settings):
    """``steps`` fp16 AMP steps of ``arch`` recorded to ``path`` (with lr 0 the weights stay those
    the truth is measured on); ``capture`` receives step 0's unscaled gradients. Returns the
    report and the scaler's final scale. The underflow is estimated (``measure_every=0``) unless
    ``measure_every`` is given: this module checks the estimate, test_underflow_probe.py the
    measurement."""
    settings.setdefault("measure_every", 0)
    model = arch.model
    opt = (torch.optim.AdamW if adam else torch.optim.SGD)(model.parameters(), lr=lr)
    scaler = ampdoctor.GradScaler("cpu", model=model, path=path, amp_dtype=torch.float16, **settings)
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = arch.loss(model, step) * loss_factor
        scaler.scale(loss).backward()
        if capture is not None and step == 0:
            scale = scaler.get_scale()
            capture.update({n: p.grad.detach().clone() / scale for n, p in model.named_parameters()
                            if p.grad is not None})
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    scaler.close()
    return contract(report_data(read_run(path))), scaler.get_scale()


def _record_one_step(arch, path, scale, loss_factor=1.0):
    """One fp16 AMP step at ``scale`` with full statistics, weights unchanged; returns the
    unscaled AMP gradients."""
    amp = {}
    _train(arch, path, 1, loss_factor=loss_factor, capture=amp, init_scale=scale, growth_interval=10**6,
           level="full", every=1)
    return amp


def _param_rows(path):
    return {r["name"]: r for r in report_data(read_run(path))["layers"] if r["kind"] == "param_grad"}


def _tolerance(t):
    """The acceptance tolerance, plus the elements the reference cannot decide."""
    return max(0.005, 0.25 * t.rate) + t.undecided_rate


@pytest.mark.parametrize("name", ARCHS)
def test_healthy_scale_underflow_matches_the_fp32_reference(tmp_path, name):
    """At torch's default scale the structural zeros (unused embedding rows, dead ReLU units,
    T5's unused position buckets, ignored positions) are not underflow; what is, is counted."""
    torch.set_num_threads(1)
    arch = A.build(name)
    path = tmp_path / "run.parquet"
    amp = _record_one_step(arch, path, 2.0**16)
    truth = A.true_underflow(arch, 0, amp)
    assert sum(t.undecided for t in truth.values()) <= 0.01 * sum(t.numel for t in truth.values())
    report = report_data(read_run(path))
    layers = {(r["name"], r["kind"]): r for r in report["layers"]}
    zeros_seen = 0.0
    for param, t in truth.items():
        row = layers[(param, "param_grad")]
        estimate = row["underflow_rate"]
        zeros_seen = max(zeros_seen, row["zero_rate"] or 0.0)
        if estimate is None:  # a gradient that is 0 everywhere: unknown, with every element as its bound
            assert row["underflow_rate_max"] == pytest.approx(row["zero_rate"]), param
            continue
        assert abs(estimate - t.rate) <= _tolerance(t), (param, estimate, t, row)
        if t.rate < 0.001:
            assert estimate <= 0.01 + t.undecided_rate, (param, estimate, t)
        assert (row["underflow_rate_max"] or 0.0) >= estimate - 1e-12
    # Module output gradients, against the same reference taken with hooks of this file.
    grads = {r["name"]: r for r in report["layers"] if r["kind"] == "grad_output"}
    truth = A.true_output_underflow(arch, 0, 2.0**16)
    assert len(set(grads) & set(truth)) >= 5
    for module in set(grads) & set(truth):
        t, estimate = truth[module], grads[module]["underflow_rate"]
        assert estimate is not None and abs(estimate - t.rate) <= _tolerance(t), (module, estimate, t)
        if t.rate < 0.001:
            assert estimate <= 0.01 + t.undecided_rate, (module, estimate, t)
    # Activations are not loss-scaled: no underflow estimate on output rows.
    outputs = [r for r in report["layers"] if r["kind"] == "output"]
    assert outputs and all(r["underflow_rate"] is None and r["underflow_rate_max"] is None for r in outputs)
    if name in ("gpt2", "t5", "bert", "nanogpt", "relu_mlp"):
        assert zeros_seen > 0.1  # the architecture really has structural zeros to get wrong


@pytest.mark.parametrize("name, scale", [("gpt2", 1.0), ("bert", 2.0**8)])
def test_heavy_underflow_matches_the_fp32_reference(tmp_path, name, scale):
    """The loss x 1e-3 at a low scale: whole lines of the attention weights' gradients underflow
    (their output gradient's columns did), next to structural lines; the magnitudes pile up at
    the cut-off, which tells them apart."""
    torch.set_num_threads(1)
    arch = A.build(name)
    amp = _record_one_step(arch, tmp_path / "run.parquet", scale, loss_factor=1e-3)
    truth = A.true_underflow(arch, 0, amp, loss_factor=1e-3)
    rows = _param_rows(tmp_path / "run.parquet")
    heavy = 0
    for param, t in truth.items():
        estimate = rows[param]["underflow_rate"]
        assert estimate is not None, param
        assert abs(estimate - t.rate) <= _tolerance(t), (param, estimate, t)
        heavy += t.rate > 0.1
    assert heavy >= 2  # the run really underflows heavily


@pytest.mark.parametrize("scale", [1.0, 2.0**4, 2.0**8])
def test_underflow_from_upstream_lies_within_the_reported_range(tmp_path, scale):
    """BERT, loss x 1e-3 at low scales: at scale 1 the value projection's output gradient
    underflowed almost entirely, so its weight gradient is 97% zero lines next to a few healthy
    values, and the float32 LayerNorm output gradients carry zeros from fp16 paths next to their
    own float32 residual path. Nothing in those tensors tells such zeros from structure: for every
    parameter and module output gradient the truth lies within its range [at least, at most]."""
    torch.set_num_threads(1)
    arch = A.build("bert")
    amp = _record_one_step(arch, tmp_path / "run.parquet", scale, loss_factor=1e-3)
    report = report_data(read_run(tmp_path / "run.parquet"))
    checked = 0
    for kind, truth in (("param_grad", A.true_underflow(arch, 0, amp, loss_factor=1e-3)),
                        ("grad_output", A.true_output_underflow(arch, 0, scale, loss_factor=1e-3))):
        rows = {r["name"]: r for r in report["layers"] if r["kind"] == kind}
        for name in set(rows) & set(truth):
            t, row = truth[name], rows[name]
            low, high = row["underflow_rate_min"] or 0.0, row["underflow_rate_max"]  # None: 0 everywhere, unknown
            assert low - _tolerance(t) <= t.rate <= high + _tolerance(t), (kind, name, low, high, t)
            checked += 1
    assert checked > 80
    if scale == 1.0:
        value = "bert.encoder.layer.1.attention.self.value.weight"
        rows = _param_rows(tmp_path / "run.parquet")
        truth = A.true_underflow(arch, 0, amp, loss_factor=1e-3)[value]
        assert truth.rate > 0.9 and rows[value]["underflow_rate"] < 0.1
        # Measured, it is no longer a range: the shadow backward sees the lines underflow upstream.
        _train(A.build("bert"), tmp_path / "measured.parquet", 1, loss_factor=1e-3, init_scale=scale,
               growth_interval=10**6, level="full", every=1, measure_every=1)
        measured = _param_rows(tmp_path / "measured.parquet")[value]
        assert abs(measured["underflow_rate"] - truth.rate) <= _tolerance(truth) and measured["underflow_measured"] == 1


RETRAIN = {
    # name: (architecture, seed, steps, training, loss factor, the settings that misbehave)
    "relu_mlp_init_too_high": ("relu_mlp", 3, 40, dict(lr=0.05), 1.0, dict(init_scale=2.0**30)),
    "gpt2_init_too_high": ("gpt2", 0, 30, dict(lr=1e-3, adam=True), 1.0, dict(init_scale=2.0**30)),
    "gpt2_underflow": ("gpt2", 0, 20, dict(lr=1e-3, adam=True), 1e-4, dict(init_scale=1.0, growth_interval=10**6)),
}


@pytest.mark.parametrize("case", RETRAIN)
def test_retraining_with_the_recommendation_does_what_it_predicted(tmp_path, case):
    """Re-trained from the same seed with the recommended settings: no more skipped steps than
    before, within max(2, 20%) of the prediction, and no more true underflow (fp32 reference on
    a fixed batch, final weights, final scale) than before plus 0.1 percentage points."""
    torch.set_num_threads(1)
    name, seed, steps, training, factor, settings = RETRAIN[case]

    def train(path, **scaler):
        arch = A.build(name, seed=seed)
        report, final_scale = _train(arch, path, steps, loss_factor=factor, **training, **scaler)
        return report, A.true_rate(arch, 0, final_scale, factor)

    before, true_before = train(tmp_path / "before.parquet", **settings)
    rec = before["recommendation"]
    assert rec["verdict"] == "change", rec
    after, true_after = train(tmp_path / "after.parquet", **{k: rec[k] for k in (
        "init_scale", "growth_interval", "backoff_factor", "growth_factor")})
    skipped, predicted = after["scale"]["skipped_steps"], rec["predicted"]["skipped_steps"]
    assert skipped <= before["scale"]["skipped_steps"]
    assert abs(skipped - predicted) <= max(2, 0.2 * predicted), (skipped, predicted)
    assert true_after <= true_before + 0.001, (true_after, true_before)
    if "init_too_high" in case:
        assert before["scale"]["skipped_steps"] >= 5 and rec["init_scale"] < settings["init_scale"]
    else:
        assert true_before > 0.01 and true_after < true_before / 10, (true_before, true_after)


@pytest.mark.parametrize("name", ["gpt2", "t5", "bert", "nanogpt"])
def test_a_healthy_model_with_the_loss_inside_is_told_to_keep(tmp_path, name):
    """The loss computed inside the model (``labels=``): its float32 output gradient (1.0 times
    the scale) is no fp16 tensor and must not lower the overflow threshold; and gradients a
    binade or two below overflow at torch's default scale are no reason to change it."""
    torch.set_num_threads(1)
    report, _ = _train(A.build(name), tmp_path / "run.parquet", 12, lr=1e-3, adam=True, level="full")
    assert report["scale"]["skipped_steps"] == 0
    assert report["recommendation"]["verdict"] == "keep", report["recommendation"]
    assert report["run"]["level"] == "full"


def test_gradients_zero_everywhere_give_an_underflow_range_not_a_number(tmp_path):
    """loss x 1e-6 at scale 1: every gradient but the head's is 0 everywhere. No magnitude was
    recorded for them, so their underflow (now and at any other scale) is unknown: the report
    gives ranges that hold the truth measured at each scale, and still raises the scale, which
    the head's own underflow calls for."""
    torch.set_num_threads(1)
    factor = 1e-6
    arch = A.build("relu_mlp")
    truth = {}
    for scale in (1.0, 4.0):
        amp = A.amp_grads(arch, 0, scale, factor)
        truth[scale] = A.overall(A.true_underflow(arch, 0, amp, factor))
        if scale == 1.0:
            assert all((g == 0).all() for n, g in amp.items() if n.startswith("body."))
            assert (amp["head.bias"] != 0).all()
    assert truth[1.0] > 0.5

    path = tmp_path / "zero.parquet"
    report, _ = _train(arch, path, 3, loss_factor=factor, init_scale=1.0, growth_interval=10**6, every=1)
    rows = {r["name"]: r for r in report["layers"] if r["kind"] == "param_grad"}
    assert all(rows[n]["underflow_rate"] is None and rows[n]["underflow_rate_max"] == 1.0
               for n in rows if n.startswith("body."))
    assert rows["head.weight"]["underflow_rate"] > 0.1  # what has magnitudes is judged
    rec = report["recommendation"]
    cur = rec["current"]
    assert cur["underflow_rate"] is None and cur["underflow_rate_min"] <= truth[1.0] <= cur["underflow_rate_max"]
    assert rec["verdict"] == "change" and rec["init_scale"] > 1.0
    assert rec["predicted"]["underflow_rate"] is None
    assert any("cannot be called underflow or structure" in a for a in rec["advice"])
    sim = simulate_data(read_run(path), init_scale=4.0)
    assert sim["underflow_rate"] is None
    assert sim["underflow_rate_min"] <= truth[4.0] <= sim["underflow_rate_max"]
    layer = {r["name"]: r for r in sim["layers"]}
    assert layer["body.0.weight"]["underflow_rate"] is None

    # Re-trained with the recommendation: the truth lies within the predicted range.
    retrained = A.true_rate(arch, 0, rec["init_scale"], factor)
    pred = rec["predicted"]
    assert pred["underflow_rate_min"] - 1e-3 <= retrained <= pred["underflow_rate_max"]
    assert retrained < truth[1.0] / 10

    # Measured, the gradients 0 everywhere are no longer unknown: the shadow tells the elements
    # that underflowed from the dead units' structural zeros, as the fp32 reference does.
    arch = A.build("relu_mlp")
    amp = {}
    measured, _ = _train(arch, tmp_path / "measured.parquet", 1, loss_factor=factor, init_scale=1.0, capture=amp,
                         growth_interval=10**6, every=1, measure_every=1)
    rows = {r["name"]: r for r in measured["layers"] if r["kind"] == "param_grad"}
    for name, t in A.true_underflow(arch, 0, amp, factor).items():
        assert rows[name]["underflow_measured"] == 1 and abs(rows[name]["underflow_rate"] - t.rate) <= _tolerance(t)
    assert 0 < rows["body.2.weight"]["underflow_rate"] < rows["body.2.weight"]["zero_rate"] == 1.0


class _DeadBranch(torch.nn.Module):
    """A ReLU MLP with a branch switched off by a zero factor: its gradients are 0 at any scale."""

    def __init__(self):
        super().__init__()
        self.mlp = A.ReluMLP()
        self.branch = torch.nn.Linear(16, 6)

    def forward(self, x):
        return self.mlp(x) + 0.0 * self.branch(x)


def test_a_gradient_zero_at_a_healthy_scale_gives_unknown_not_keep(tmp_path):
    """At torch's default scale a gradient that is 0 everywhere is most likely structure, but the
    record cannot tell: the verdict is ``unknown`` with the advice to look, never a silent ``keep``
    or an invented number; the rest of the run is judged as usual."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    arch = A.relu_mlp()
    arch.model = _DeadBranch()
    report, _ = _train(arch, tmp_path / "run.parquet", 3, growth_interval=10**6, every=1)
    rows = {r["name"]: r for r in report["layers"] if r["kind"] == "param_grad"}
    assert rows["branch.weight"]["underflow_rate"] is None and rows["branch.weight"]["underflow_rate_max"] == 1.0
    assert rows["mlp.head.weight"]["underflow_rate"] == 0
    rec = report["recommendation"]
    assert rec["verdict"] == "unknown" and rec["init_scale"] == 2.0**16
    assert rec["current"]["underflow_rate_min"] == 0 and rec["current"]["underflow_rate_max"] > 0.01
    assert any("cannot be called underflow or structure" in a for a in rec["advice"])
    # Measured, the branch's zeros are zeros in the float32 shadow too: structure, and the
    # settings are kept.
    torch.manual_seed(0)
    arch.model = _DeadBranch()
    measured, _ = _train(arch, tmp_path / "measured.parquet", 3, growth_interval=10**6, every=1, measure_every=1)
    rows = {r["name"]: r for r in measured["layers"] if r["kind"] == "param_grad"}
    assert rows["branch.weight"]["underflow_rate"] == 0 and rows["branch.weight"]["underflow_measured"] == 1
    assert measured["recommendation"]["verdict"] == "keep"


def test_overflowed_gradients_are_not_undecided_zeros(tmp_path):
    """init_scale=2**30 for 12 steps: every step overflows and skips. An overflowed gradient's
    histogram lost its values, so its zeros (dead ReLU rows) are not judged: the underflow stays
    a number (0), and since every step skipped, a lower init_scale is recommended."""
    torch.set_num_threads(1)
    report, _ = _train(A.build("relu_mlp", seed=3), tmp_path / "run.parquet", 12, lr=0.05, init_scale=2.0**30)
    rec = report["recommendation"]
    assert report["scale"]["skipped_steps"] == 12
    assert rec["current"]["underflow_rate"] == 0 and rec["current"]["underflow_rate_max"] == 0
    assert rec["verdict"] == "change" and rec["init_scale"] <= 2.0**16
    assert rec["predicted"]["skipped_steps"] == 0 and rec["predicted"]["uncertain_steps"] > 0


def test_a_bfloat16_run_has_no_undecided_zeros(tmp_path):
    """bfloat16 with the scaler disabled: a gradient 0 everywhere at bf16's cut-off (2^-134) is
    structure, not a possible underflow; neither report nor postmortem suggests otherwise."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, arch = _DeadBranch(), A.relu_mlp()
    path = tmp_path / "bf16.parquet"
    scaler = ampdoctor.GradScaler("cpu", enabled=False, model=model, path=path, amp_dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = arch.loss(model, step)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    scaler.close()
    report = contract(report_data(read_run(path)))
    branch = {r["name"]: r for r in report["layers"]}["branch.weight"]
    assert branch["underflow_rate"] == 0 and branch["underflow_rate_max"] == 0
    rec = report["recommendation"]
    assert rec["current"]["underflow_rate"] is not None
    assert not any("cannot be called" in a for a in rec["advice"])
    pm = ampdoctor.postmortem(path)
    assert pm["status"] == "healthy" and pm["advice"] == []
