"""The scaler replay and `ampdoctor simulate`: predictions against what the recorded scenarios
did (:mod:`report_scenarios`), the replay against torch's own update rule and Megatron's
hysteresis, a bf16 run asked about fp16, and the settings torch cannot hold."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import ampdoctor
from ampdoctor.read.run import read_run
from ampdoctor.analysis.report import report_data
from ampdoctor.analysis.replay import prepare, replay
from ampdoctor.analysis.scaler_config import ScalerConfig
from ampdoctor.analysis.simulate import simulate_data
from ampdoctor.analysis.steps import StepSeries
from ampdoctor.cli.commands import main
from ampdoctor.render import contract
from models import MLP, train_recorded
from report_scenarios import SCENARIOS, scenarios, within  # noqa: F401 - the fixture


@pytest.mark.parametrize("name", SCENARIOS)
def test_replaying_the_recorded_settings_predicts_the_skipped_steps(scenarios, name):
    path, skipped, _ = scenarios[name]
    options = {k: v for k, v in SCENARIOS[name].items() if k != "loss_factor"}
    sim = simulate_data(read_run(path), **options)
    assert sim["actual"]["skipped_steps"] == skipped
    assert within(skipped, sim["skipped_steps"], 0.10), (sim["skipped_steps"], skipped)
    for bound in ("underflow_rate_min", "underflow_rate_max"):
        assert math.isclose(sim[bound], sim["actual"][bound], rel_tol=0.05, abs_tol=1e-9), bound


def test_bad_simulate_settings_are_usage_errors(scenarios):
    path = scenarios["underflow"][0]
    result = CliRunner().invoke(main, ["simulate", str(path), "--backoff-factor", "2"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["simulate", str(path), "--min-scale", "10", "--max-scale", "1"])
    assert result.exit_code == 2 and "min_scale" in result.output


@pytest.mark.parametrize("value", ["inf", "1e300"])
def test_scales_torch_cannot_hold_are_rejected(scenarios, value):
    result = CliRunner().invoke(main, ["simulate", str(scenarios["underflow"][0]), "--init-scale", value])
    assert result.exit_code == 2 and "float32" in result.output


# -- bf16: could this model train in fp16? -------------------------------------------------------

def test_bf16_run_is_asked_about_fp16(tmp_path):
    path = tmp_path / "bf16.parquet"
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ampdoctor.GradScaler("cpu", enabled=False, model=model, path=path, amp_dtype=torch.bfloat16)
    from models import batches
    for x, y in batches(30, seed=3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y) * 1e-6
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    scaler.close()
    sim = simulate_data(read_run(path), init_scale=1.0)
    assert sim["target_dtype"] == "float16" and sim["actual"]["config"] is None
    assert sim["underflow_rate_min"] > 0.01  # a 1e-6 loss at scale 1 loses gradients in fp16 ...
    high = simulate_data(read_run(path), init_scale=2.0**20)
    assert high["underflow_rate_max"] < sim["underflow_rate_min"] / 10  # ... not at 2^20
    assert sim["layers"] and sim["layers"][0]["underflow_rate"] > 0
    assert sim["threshold"]["source"].values["dtype"] == "float16"
    assert any("recorded in bfloat16" in n for n in contract(sim)["notes"])
    rec = report_data(read_run(path))["recommendation"]
    assert rec["target_dtype"] == "float16" and rec["init_scale"] >= 2.0**10


def test_every_step_skipped_replays_as_skipped(tmp_path):
    path = tmp_path / "all.parquet"
    skipped = train_recorded(path, steps=20, loss_factor=1e20)
    assert skipped == 20
    sim = simulate_data(read_run(path))
    assert sim["skipped_steps"] == 20 == sim["actual"]["skipped_steps"]
    assert report_data(read_run(path))["recommendation"]["verdict"] != "keep"


# -- the simulator against torch's own scaler update ---------------------------------------------

def test_replay_follows_torch_update_rule():
    """Replay a fixed overflow pattern and compare with torch.amp.GradScaler's update, step by step."""
    rng = np.random.default_rng(0)
    n = 300
    amax = np.exp2(rng.normal(-4, 1, n))
    critical = 15.0 - np.log2(amax)  # overflow where log2(amax * S) > 15
    series = _series(amax)
    prepared = prepare(series)
    prepared.critical_log2 = critical
    cfg = ScalerConfig(init_scale=2.0**20, growth_interval=7)
    out = replay(prepared, [cfg], keep_trajectory=True)[0]
    scaler = torch.amp.GradScaler("cpu", init_scale=cfg.init_scale, growth_interval=cfg.growth_interval)
    scale = torch.full((), cfg.init_scale)
    tracker = torch.zeros((), dtype=torch.int32)
    skipped = 0
    for t in range(n):
        assert out.trajectory[t] == math.log2(scale.item()), t
        found = float(math.log2(scale.item()) > critical[t])
        skipped += int(found)
        torch._amp_update_scale_(scale, tracker, torch.tensor(found), 2.0, 0.5, cfg.growth_interval)
    assert out.skipped_steps == skipped and skipped > 0
    del scaler


def test_hysteresis_follows_megatron():
    """Megatron's DynamicGradScaler: on overflow the hysteresis counter drops and the scale backs
    off once it is <= 0 (and on every further overflow); the counter resets only on growth."""
    n = 10
    prepared = prepare(_series(np.full(n, 1.0)))
    prepared.critical_log2 = np.full(n, -1000.0)  # every step overflows
    out = replay(prepared, [ScalerConfig(init_scale=2.0**16, growth_interval=1000, hysteresis=2)],
                 keep_trajectory=True)[0]
    scale, tracker, expected = 2.0**16, 2, []
    for _ in range(n):  # Megatron's update(found_inf=True)
        expected.append(math.log2(scale))
        tracker -= 1
        if tracker <= 0:
            scale *= 0.5
    assert out.trajectory.tolist() == expected
    assert expected[:4] == [16, 16, 15, 14]


def _series(amax):
    from ampdoctor.float_formats import FLOAT16
    n = len(amax)
    zeros = np.zeros(n)
    return StepSeries(steps=np.arange(n), scale=np.ones(n), recorded_scale=np.ones(n), skipped=np.zeros(n, bool),
                      forced=np.zeros(n, bool), nonfinite=np.zeros(n, bool), amax=np.asarray(amax, float),
                      l2=np.ones(n), loss=np.ones(n), loss_recorded=np.ones(n, bool), numel=np.full(n, 100.0),
                      n_zero=zeros, n_subnormal=zeros, hist=np.zeros((n, 64)), ranks=1, fmt=FLOAT16, min_exp=-56)
