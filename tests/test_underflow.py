"""fp16 underflow really happens on the CPU, and the run shows it on the layers where it happens."""

import pytest
import torch

from ampdoctor.read.run import read_run
import ampdoctor
from models import MLP, batches, mse

TINY = 1e-5  # true gradients ~1e-9..1e-5: straddling fp16 subnormals (and zero) at scale 1


def _record(path, init_scale):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # keep the weights: every step sees the same model
    scaler = ampdoctor.GradScaler("cpu", init_scale=init_scale, growth_interval=10_000, model=model,
                                  path=path, amp_dtype=torch.float16)
    for x, y in batches(3, seed=5):
        scaler.scale(mse(model, x, y) * TINY).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    scaler.close()
    return model, ampdoctor.load(path).query("kind == 'param_grad'").groupby("name", observed=True).sum(
        numeric_only=True)


def _fp32_grads(model):
    """The same batch in fp32: the true gradients, to tell underflow from structural zeros."""
    x, y = batches(3, seed=5)[-1]
    model.zero_grad()
    with torch.autocast("cpu", enabled=False):
        (torch.nn.functional.mse_loss(model(x), y) * TINY).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_low_scale_shows_underflow_high_scale_shows_none(tmp_path):
    model, low = _record(tmp_path / "low.parquet", init_scale=1.0)
    _, high = _record(tmp_path / "high.parquet", init_scale=2.0**20)
    true = _fp32_grads(model)
    # Weight and bias gradients of the fp16 matmuls: underflowed at scale 1 ...
    for name in ("fc1.weight", "fc1.bias", "fc2.weight"):
        assert (true[name] != 0).all()  # so every zero below is an underflow, not structure
        assert low.loc[name, "n_zero"] > 0, name
        assert low.loc[name, "n_subnormal"] > 0, name
        # ... and at 2^20 none of them is zero or subnormal any more.
        assert high.loc[name, "n_zero"] == 0, name
        assert high.loc[name, "n_subnormal"] == 0, name
    assert high["n_inf"].sum() == 0 and high["n_nan"].sum() == 0  # no overflow traded for it


def _layer_rates(path):
    from ampdoctor.analysis.layers import layers_data
    return {r["name"]: r for r in layers_data(read_run(path))["layers"] if r["kind"] == "param_grad"}


def test_underflow_rate_matches_an_fp32_reference(tmp_path):
    """The README's definition: elements nonzero in exact arithmetic that are 0 in the fp16 run.
    The reference is the same batch in fp32; the run has one step, so the rates compare 1:1."""
    torch.manual_seed(0)
    model = MLP()
    x, y = batches(1, seed=5)[0]
    path = tmp_path / "low.parquet"
    scaler = ampdoctor.GradScaler("cpu", init_scale=1.0, model=model, path=path, amp_dtype=torch.float16)
    scaler.scale(mse(model, x, y) * TINY).backward()
    fp16 = {n: p.grad.clone() for n, p in model.named_parameters()}
    scaler.step(torch.optim.SGD(model.parameters(), lr=0.0))
    scaler.update()
    scaler.close()
    model.zero_grad()
    with torch.autocast("cpu", enabled=False):
        (torch.nn.functional.mse_loss(model(x), y) * TINY).backward()
    rates = _layer_rates(path)
    total_true = total_estimated = 0.0
    for name, p in model.named_parameters():
        true = ((p.grad != 0) & (fp16[name] == 0)).sum().item()
        estimated = rates[name]["underflow_rate"] * p.numel()
        assert estimated == pytest.approx(true, abs=max(1.0, 0.1 * true)), name
        total_true += true
        total_estimated += estimated
    assert total_true > 10  # the scale really was too low


def test_structural_zeros_are_not_underflow(tmp_path):
    """Dead ReLU units give exact zeros at any scale: zeros, but no underflow."""
    torch.manual_seed(0)
    model = MLP(act=torch.nn.ReLU)
    with torch.no_grad():
        model.fc1.bias[:16] = -100.0  # half the units never fire
    x, y = batches(1, seed=5)[0]
    path = tmp_path / "dead.parquet"
    scaler = ampdoctor.GradScaler("cpu", init_scale=2.0**12, model=model, path=path, amp_dtype=torch.float16)
    scaler.scale(mse(model, x, y)).backward()
    scaler.step(torch.optim.SGD(model.parameters(), lr=0.0))
    scaler.update()
    scaler.close()
    rates = _layer_rates(path)
    assert rates["fc2.weight"]["zero_rate"] >= 0.5  # the dead units' columns
    assert rates["fc2.weight"]["underflow_rate"] < 0.01


def test_a_drifting_run_s_range_holds_the_measured_underflow(tmp_path):
    """Gradients that shrink by 2^4 between samples (the loss falls geometrically, the scale is
    fixed): the steps between samples lose more below the cut-off than their sample did. The run's
    range, from samples every 40 steps with no step measured, holds the underflow a run measured at
    every step finds (float32 shadow, checked against fp32 references in test_underflow_probe.py).
    Without the drift of the gradient norm the range missed it: ..0.79% against 1.58%."""
    import architectures as A

    def run(path, **options):
        arch = A.build("nanogpt")
        opt = torch.optim.SGD(arch.model.parameters(), lr=1e-3)
        with ampdoctor.GradScaler("cpu", model=arch.model, path=path, init_scale=2.0**6, growth_interval=10**6,
                                  amp_dtype=torch.float16, **options) as scaler:
            for t in range(120):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = arch.loss(arch.model, t) * 2.0 ** (-8 - 4 * t / 40)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
        return ampdoctor.report(path)["recommendation"]["current"]

    truth = run(tmp_path / "dense", every=1, measure_every=1)
    sampled = run(tmp_path / "sampled", every=40, measure_every=0)
    assert truth["underflow_rate"] > 0.005  # (it does underflow, and more as it goes)
    tolerance = max(0.005, 0.25 * truth["underflow_rate"])
    assert sampled["underflow_rate_min"] - tolerance <= truth["underflow_rate"] <= sampled["underflow_rate_max"] + tolerance


def test_the_underflow_model_reads_a_drift_as_a_moved_cut_off():
    """Magnitudes 2^4 smaller lose at a cut-off what the recorded ones lose 4 binades higher."""
    from ampdoctor.analysis.underflow import UnderflowModel

    hist = torch.zeros(1, 64, dtype=torch.float64)
    hist[0, 20:30] = torch.arange(1, 11, dtype=torch.float64) * 100  # binades 2^-36 .. 2^-27 (min_exp -56)
    cut = torch.tensor([-34.0]).numpy()
    at_cut = torch.tensor([50.0]).numpy()
    plain = UnderflowModel(hist.numpy(), cut, at_cut, -56)
    drifted = UnderflowModel(hist.numpy(), cut, at_cut, -56, drift_log2=torch.tensor([-4.0]).numpy())
    for x in (-40.0, -34.0, -31.0, -28.0):
        assert drifted.lost(torch.tensor([x]).numpy())[0] == plain.lost(torch.tensor([x + 4]).numpy())[0]
    assert drifted.lost(cut)[0] > plain.lost(cut)[0] == 50.0


def test_between_samples_the_drift_is_counted_once():
    """A step between two samples whose gradients shrank by 2^2: it loses what its sample lost
    plus the recorded values that now fall below the cut-off u, not also the interpolation of the
    lost share towards the next sample's. Recorded values lie on fp16's subnormal grid (spacing
    2u), so the true values below 4u are the recorded ones below 5u: the smallest subnormal's
    binade (1000) and a quarter of the next (250)."""
    import numpy as np
    import pandas as pd

    from ampdoctor.analysis.steps import StepSeries, attach_param_lost
    from ampdoctor.float_formats import FLOAT16

    bins, min_exp = 64, -56
    hist = np.zeros(bins)
    first = int(np.ceil(np.log2(FLOAT16.underflow_below))) - min_exp
    hist[first + 1:first + 9] = 1000.0  # from the smallest subnormal, 2u, up
    n = 3
    series = StepSeries(steps=np.arange(n), scale=np.ones(n), recorded_scale=np.ones(n), skipped=np.zeros(n, bool),
                        forced=np.zeros(n, bool), nonfinite=np.zeros(n, bool), amax=np.ones(n), l2=np.ones(n),
                        loss=np.ones(n), loss_recorded=np.ones(n, bool), numel=np.full(n, 9010.0),
                        n_zero=np.full(n, 1010.0), n_subnormal=np.zeros(n), hist=np.tile(hist, (n, 1)), ranks=1,
                        fmt=FLOAT16, min_exp=min_exp, drift_log2=np.array([0.0, -2.0, 0.0]))
    attach_param_lost(series, pd.DataFrame({"lost": [10.0, 4010.0], "n_zero": [1010.0, 5010.0],
                                            "undecided": [0.0, 0.0]}, index=[0, 2]))
    assert series.lost_at_recorded()[1] == pytest.approx(10 + 1000 + 250)
