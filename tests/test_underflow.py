"""fp16 underflow really happens on the CPU, and the run shows it on the layers where it happens."""

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
