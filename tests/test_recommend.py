"""The recommended GradScaler settings, on real CPU fp16 runs of tiny models: each scenario of
:mod:`report_scenarios` is re-trained from the same seed with the recommended settings; the reasons
and advice name what no setting fixes."""

from __future__ import annotations

import math

import pytest
import torch

from ampdoctor.read.run import read_run
from ampdoctor.analysis.findings import Finding
from ampdoctor.analysis.report import report_data
from ampdoctor.render import contract
from models import train_recorded
from report_scenarios import SCENARIOS, STEPS, scenarios, within  # noqa: F401 - the fixture


def test_the_scenarios_misbehave_as_intended(scenarios):
    assert scenarios["init_too_high"][1] >= 5
    assert scenarios["init_too_high"][2]["scale"]["settle_step"] >= 5
    current = scenarios["underflow"][2]["recommendation"]["current"]
    # The side branch's gradients are 0 everywhere (unknown): the rest underflows for sure.
    assert current["underflow_rate"] is None and current["underflow_rate_max"] > 0.05
    assert current["underflow_rate_min"] > 0.001
    assert scenarios["periodic_overflow"][1] >= 5


@pytest.mark.parametrize("name", SCENARIOS)
def test_recommended_settings_help_when_retrained(scenarios, name, tmp_path):
    path, skipped, report = scenarios[name]
    rec = report["recommendation"]
    assert rec["verdict"] == "change"
    settings = {k: rec[k] for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")}
    loss_factor = SCENARIOS[name].get("loss_factor", 1.0)
    retrained = tmp_path / "retrained.parquet"
    actual = train_recorded(retrained, steps=STEPS, loss_factor=loss_factor, **settings)
    predicted = rec["predicted"]["skipped_steps"]
    assert within(actual, predicted, 0.20), (actual, predicted)
    if skipped:
        assert actual < skipped
    else:
        assert actual <= skipped
    after = report_data(read_run(retrained))["recommendation"]["current"]
    assert after["underflow_rate"] is not None  # at the recommended scale every gradient has magnitudes
    after = after["underflow_rate"]
    before = rec["current"]["underflow_rate_min"]  # the lower bound: what underflowed for sure
    assert after <= before * 1.10 + 1e-6, (after, before)
    if name == "underflow":
        assert after < before / 10
    # The pasted line is the recommendation, and it constructs.
    code = contract(report)["recommendation"]["code"].replace('"cuda"', '"cpu"')
    scaler = eval(code, {"torch": torch})  # noqa: S307 - our own generated line
    assert scaler.get_scale() == rec["init_scale"]


def test_init_too_high_reasons_are_in_numbers(scenarios):
    rec = scenarios["init_too_high"][2]["recommendation"]
    # The analysis gives the numbers; the wording formats them.
    backoff = [r for r in rec["reasons"] if r.code == "start_up_backoff"]
    assert backoff and backoff[0].values["init_scale"] == 2.0**24 and backoff[0].values["skipped"] >= 5
    assert all(isinstance(r, Finding) for r in rec["reasons"] + rec["advice"])
    text = " ".join(contract(scenarios["init_too_high"][2])["recommendation"]["reasons"])
    assert "init_scale=2**24" in text and "skipped" in text
    assert f"{rec['predicted']['skipped_steps']} skipped step(s) instead of" in text
    assert rec["init_scale"] < 2.0**24


def test_periodic_overflow_is_explained_as_growth(scenarios):
    report = contract(scenarios["periodic_overflow"][2])
    rec = report["recommendation"]
    assert any("right after the scale grew" in r for r in rec["reasons"])
    assert rec["growth_interval"] > 10
    assert report["overflow_origins"], "the taps name where the overflow starts"
    assert sum(o["count"] for o in report["overflow_origins"]) == report["scale"]["skipped_steps"]


def test_window_too_narrow_for_fp16_advises_bfloat16(tmp_path):
    """Gradients 4000 and 1e-12 x smaller in the same model: any scale that saves the small ones
    overflows the large ones."""
    path = tmp_path / "narrow.parquet"
    train_recorded(path, steps=40, loss_factor=1e4, lr=0.0, init_scale=1.0, growth_interval=5,
                   model_factory=lambda: __import__("models").QuietMLP(quiet=1e-12))
    report = report_data(read_run(path))
    rec = report["recommendation"]
    # The side branch's gradients are 0 at every scale the run reached: the record cannot tell
    # underflow from no gradient, so no layer or setting is claimed to be fine.
    assert rec["verdict"] != "keep"
    side = [layer for layer in report["layers"] if layer["name"].startswith("side.")]
    assert side and all((layer["underflow_rate_max"] or 0.0) > 0.5 for layer in side)


def test_collapsing_scale_advises_lower_lr_or_clipping(tmp_path):
    path = tmp_path / "diverged.parquet"
    train_recorded(path, steps=60, loss_factor=100.0, init_scale=2.0**10, growth_interval=10)
    advice = " ".join(contract(report_data(read_run(path)))["recommendation"]["advice"])
    assert "learning rate" in advice and "clip_grad_norm_" in advice
    assert "ampdoctor postmortem" in advice  # the non-finite losses


def test_nan_losses_alone_do_not_mean_no_scale_works(tmp_path):
    from models import QuietMLP

    class NaNEvery10(QuietMLP):
        calls = 0

        def forward(self, x):
            type(self).calls += 1
            out = super().forward(x)
            return out * float("nan") if type(self).calls % 10 == 0 else out

    path = tmp_path / "nan.parquet"
    train_recorded(path, steps=40, init_scale=2.0**12, model_factory=NaNEvery10)
    rec = report_data(read_run(path))["recommendation"]
    assert rec["verdict"] != "no_scale_works"
    losses = [a for a in rec["advice"] if a.code == "nonfinite_losses"]
    assert losses and losses[0].values["steps"] == 4 and losses[0].values["first"] == 9
    assert any("non-finite loss" in a for a in contract({"advice": rec["advice"]})["advice"])


@pytest.mark.parametrize("options, collapsed", [
    (dict(steps=160, loss_factor=1e20, init_scale=1.0), True),       # backs off to 0: collapsed
    (dict(steps=12, init_scale=2.0**30), False),                     # only the start-up backoff
    (dict(steps=60, init_scale=2.0**16, growth_interval=3), False),  # grows back into overflow, again and again
])
def test_the_collapse_advice_is_given_only_for_a_collapse(tmp_path, options, collapsed):
    path = tmp_path / "run.parquet"
    skipped = train_recorded(path, **options)
    assert skipped >= 3
    advice = " ".join(contract(report_data(read_run(path)))["recommendation"]["advice"])
    assert ("the scale collapsed" in advice) == collapsed, advice


def test_the_scaler_code_holds_the_settings_as_numbers(scenarios):
    rec = scenarios["underflow"][2]["recommendation"]
    code = rec["code"]
    assert code.code == "scaler_code" and code.values["device"] == "cpu"
    assert all(isinstance(v, (int, float)) for v in code.values["settings"].values())
    assert math.isclose(code.values["settings"]["init_scale"], rec["init_scale"])


class SteadyScaler(torch.amp.GradScaler):
    """A user's own scaler class (the run's ``scaler.class`` is this module's path to it)."""


def _train_wrapped(path, scaler, steps: int = 12) -> None:
    import ampdoctor
    from models import QuietMLP, batches, mse

    torch.manual_seed(0)
    model = QuietMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ampdoctor.wrap(scaler, model=model, path=path, amp_dtype=torch.float16)
    for x, y in batches(steps, seed=1):
        scaler.scale(mse(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    scaler.close()


def test_the_line_to_paste_constructs_the_run_s_own_scaler_class(tmp_path):
    """A run recorded through a subclass of torch's scaler is advised in that class's words (issue
    40: an FSDP user must not be told to paste ``torch.amp.GradScaler``); the line constructs it."""
    import sys

    _train_wrapped(tmp_path / "run", SteadyScaler("cpu", init_scale=2.0**24))
    rec = contract(report_data(read_run(tmp_path / "run")))["recommendation"]
    module = __name__
    assert rec["code"].startswith(f'{module}.SteadyScaler("cpu", init_scale=2**'), rec["code"]
    scaler = eval(rec["code"], {module: sys.modules[module]})  # noqa: S307 - our own generated line
    assert type(scaler) is SteadyScaler and scaler.get_scale() == rec["init_scale"]


@pytest.mark.parametrize("recorded, expected", [
    (None, "torch.amp.GradScaler"), ("ampdoctor.GradScaler", "torch.amp.GradScaler"),
    ("torch.amp.grad_scaler.GradScaler", "torch.amp.GradScaler"),
    ("torch.cuda.amp.grad_scaler.GradScaler", "torch.amp.GradScaler"),  # (deprecated alias: torch's own)
    ("torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler",
     "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler"),
    ("__main__.MyScaler", "MyScaler"),
])
def test_the_constructed_class_is_the_run_s(recorded, expected):
    from ampdoctor.analysis.scaler_config import scaler_constructor
    assert scaler_constructor(recorded) == expected


def test_a_run_that_came_through_accelerate_is_advised_in_its_arguments(tmp_path):
    """``instrument(accelerator)`` says the run came through Accelerate (``came_through``, as the
    integration calls it; on the CPU Accelerate has no scaler to instrument): the line to paste is
    Accelerate's own constructor, and it builds an Accelerator whose scaler settings are the
    recommendation's."""
    accelerate = pytest.importorskip("accelerate")
    import ampdoctor
    from models import QuietMLP, batches, mse

    torch.manual_seed(0)
    model = QuietMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = ampdoctor.GradScaler("cpu", model=model, path=tmp_path / "run", amp_dtype=torch.float16,
                                  init_scale=2.0**24)
    scaler.recorder.came_through("accelerate")
    for x, y in batches(12, seed=1):
        scaler.scale(mse(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    scaler.close()
    rec = contract(report_data(read_run(tmp_path / "run")))["recommendation"]
    assert rec["code"].startswith('Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=2**')
    accelerator = eval(rec["code"], {"Accelerator": accelerate.Accelerator,  # noqa: S307
                                     "GradScalerKwargs": accelerate.utils.GradScalerKwargs})
    assert accelerator.scaler_handler.init_scale == rec["init_scale"]


def test_under_lightning_s_fsdp_the_line_sets_the_plugin_s_scaler():
    """Lightning's FSDPPrecision refuses a scaler passed to it, so for a Lightning (or Fabric) run
    with FSDP's ShardedGradScaler the line sets the precision plugin's scaler; executed on a
    Trainer, it puts a ShardedGradScaler with the settings there."""
    pl = pytest.importorskip("lightning.pytorch")
    import warnings

    import torch.distributed.fsdp.sharded_grad_scaler as sharded
    from lightning.pytorch.plugins import MixedPrecision
    from ampdoctor.analysis.scaler_config import SHARDED_SCALER
    from ampdoctor.render.wording.report import scaler_code

    code = scaler_code("cpu", {"init_scale": 2.0**12}, scaler=SHARDED_SCALER, framework="lightning")
    assert code == f'trainer.precision_plugin.scaler = {SHARDED_SCALER}("cpu", init_scale=2**12)  # before fit'
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, plugins=[MixedPrecision("16-mixed", "cpu")])
    exec(code, {"trainer": trainer, "torch": torch})  # noqa: S102 - our own generated line
    assert type(trainer.precision_plugin.scaler) is sharded.ShardedGradScaler
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**12
    assert scaler_code("cuda", {"init_scale": 2.0**12}, scaler=SHARDED_SCALER, framework="fabric").startswith(
        "fabric.strategy.precision.scaler = ")


def test_a_subclass_of_ampdoctor_s_scaler_is_the_user_s_class(tmp_path):
    import ampdoctor
    from models import QuietMLP

    class Mine(ampdoctor.GradScaler):
        pass

    scaler = Mine("cpu", model=QuietMLP(), path=tmp_path / "run")
    assert scaler.recorder._run_metadata._fixed["scaler.class"].endswith("<locals>.Mine")
    scaler.close()
    from ampdoctor.analysis.scaler_config import scaler_constructor
    assert scaler_constructor(f"{__name__}.test_a_subclass.<locals>.Mine") == "Mine"
