"""fp16 underflow really happens on the CPU, and the run shows it on the layers where it happens."""

import pytest
import torch

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
    return {r["name"]: r for r in layers_data(path)["layers"] if r["kind"] == "param_grad"}


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
