"""The framework integrations record the framework's own GradScaler: one step per optimizer step
(gradient accumulation included), the model's parameter names, a cleanly closed run, and training
bit-for-bit that of the same run without ampdoctor.

No framework makes an fp16 GradScaler on the CPU by itself (Accelerate and the Trainer train fp16
in fp32 there; Lightning turns "16-mixed" into "bf16-mixed"), so the CPU tests give the framework
the scaler and autocast it would make on a GPU; everything else is the framework's own code path.
The ``cuda`` variants (skipped without a GPU) use the frameworks' own fp16 set-up, unaided.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampdoctor
from ampdoctor.integrations import require
from ampdoctor.read.run import describe, read_run

SCALER_ARGS = dict(init_scale=2.0**18, growth_interval=2)  # skips at first, then steps, grows, backs off
BATCH = 2
ACCUMULATE = 2
STEPS = 5  # optimizer steps: STEPS * ACCUMULATE micro-batches
FRAMEWORKS = ("accelerate", "transformers", "lightning")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]  # on CUDA, no stand-ins: the frameworks' own fp16

pytestmark = pytest.mark.filterwarnings("error:ampdoctor:RuntimeWarning")  # a recorder failure fails the test


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _data(n: int = STEPS * ACCUMULATE * BATCH):
    gen = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen))


def _check_run(path, model: nn.Module, steps: int) -> dict:
    """The run has ``steps`` step rows numbered from 0 (one per optimizer step), gradient rows named as the
    model's parameters, and was closed cleanly."""
    run = read_run(path)
    info = describe(run)
    frame = run.frame
    step_rows = frame[frame["kind"] == "step"]
    assert len(step_rows) == steps
    assert sorted(step_rows["step"]) == list(range(steps))
    names = {n for n, _ in model.named_parameters()}
    assert set(frame.loc[frame["kind"] == "param_grad", "name"]) == names
    assert info["ended_cleanly"] and info["amp_dtype"] == "float16"
    return info


def _same_params(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# -- import isolation ------------------------------------------------------------------------------

def test_import_ampdoctor_imports_no_framework_and_a_missing_one_names_its_extra():
    code = textwrap.dedent("""
        import importlib, sys
        import ampdoctor, ampdoctor.integrations
        print([m for m in ("accelerate", "transformers", "lightning", "pytorch_lightning") if m in sys.modules])

        class Absent:  # makes the frameworks uninstalled, whether they are or not
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("accelerate", "transformers", "lightning"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, Absent())
        for extra in ("accelerate", "transformers", "lightning"):
            try:
                importlib.import_module("ampdoctor.integrations." + extra)
            except ImportError as exc:
                print(type(exc).__name__, exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"}).stdout.splitlines()
    assert out[0] == "[]"
    assert out[1:] == [f'ImportError ampdoctor.integrations.{x} needs the {x!r} package: '
                       f'pip install "ampdoctor[{x}]"' for x in FRAMEWORKS]


def test_require_keeps_a_framework_s_own_missing_dependency_error(tmp_path, monkeypatch):
    (tmp_path / "fakeframework").mkdir()
    (tmp_path / "fakeframework" / "__init__.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as info:
        require("fakeframework", "fake")
    assert info.value.name == "not_installed_dependency_xyz"  # not "pip install ampdoctor[fake]"


# -- Accelerate ------------------------------------------------------------------------------------

@pytest.fixture
def accelerator_factory():
    accelerate = pytest.importorskip("accelerate", reason='needs Accelerate: pip install "ampdoctor[accelerate]"')
    from accelerate.state import AcceleratorState

    def make(device: str, *, gpu_like: bool = True, **kwargs):
        AcceleratorState._reset_state(True)  # Accelerate's state is process-wide
        if device == "cuda":
            handler = accelerate.utils.GradScalerKwargs(**SCALER_ARGS)
            return accelerate.Accelerator(mixed_precision="fp16", kwargs_handlers=[handler], **kwargs)
        accelerator = accelerate.Accelerator(mixed_precision="fp16", cpu=True, **kwargs)
        if gpu_like:
            # Accelerate 1.x makes neither scaler nor autocast for fp16 on the CPU (checked in
            # test_accelerate_cpu_fp16_has_no_scaler); give it what it makes on a GPU.
            accelerator.scaler = torch.amp.GradScaler("cpu", **SCALER_ARGS)
            accelerator.native_amp = True
        return accelerator

    yield make
    AcceleratorState._reset_state(True)


def _accelerate_train(accelerator, instrument_path=None):
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(_data(), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    scaler = None
    if instrument_path is not None:
        from ampdoctor.integrations.accelerate import instrument

        scaler = instrument(accelerator, model=model, path=instrument_path)
        assert scaler is accelerator.scaler and scaler is optimizer.scaler  # in place
    steps = 0
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)  # unscale_ first
                steps += 1
            optimizer.step()
            optimizer.zero_grad()
    if scaler is not None:
        scaler.close()
    return model, steps


@pytest.mark.parametrize("device", DEVICES)
def test_accelerate_instrument(accelerator_factory, run_path, device):
    plain, plain_steps = _accelerate_train(accelerator_factory(device, gradient_accumulation_steps=ACCUMULATE))
    accelerator = accelerator_factory(device, gradient_accumulation_steps=ACCUMULATE)
    model, steps = _accelerate_train(accelerator, run_path)
    assert steps == plain_steps == STEPS
    info = _check_run(run_path, model, STEPS)
    assert info["scaler"]["class"] == "torch.amp.grad_scaler.GradScaler" and info["device"] == device
    assert read_run(run_path).metadata["scaler.framework"] == "accelerate"  # advised in its arguments
    if device == "cpu":  # the high initial scale of SCALER_ARGS overflows at step 1 there
        assert info["skipped_steps"] >= 1
    _same_params(model, plain)


def test_accelerate_cpu_fp16_has_no_scaler(accelerator_factory, run_path):
    from ampdoctor.integrations.accelerate import instrument

    accelerator = accelerator_factory("cpu", gpu_like=False)
    assert accelerator.scaler is None and not accelerator.native_amp  # Accelerate's own choice
    with pytest.raises(ValueError, match="no GradScaler"):
        instrument(accelerator, path=run_path)
    with pytest.raises(TypeError, match="accelerate.Accelerator"):
        instrument(torch.amp.GradScaler("cpu"), path=run_path)
    assert not run_path.exists()


# -- Transformers ----------------------------------------------------------------------------------

class _Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": F.mse_loss(out.float(), labels), "logits": out}


class _Pairs(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.data = _data()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return {"x": x, "labels": y}


def _trainer(tmp_path, callbacks=(), *, device="cpu", gpu_like=True, max_steps=STEPS, save_steps=None):
    transformers = pytest.importorskip("transformers",
                                       reason='needs Transformers: pip install "ampdoctor[transformers]"')
    pytest.importorskip("accelerate", reason='the Trainer needs Accelerate: pip install "ampdoctor[transformers]"')
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"), fp16=True, use_cpu=device == "cpu", per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE, max_steps=max_steps, learning_rate=0.1, max_grad_norm=1.0,
        lr_scheduler_type="constant", report_to="none", disable_tqdm=True, logging_strategy="no",
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, seed=0)
    trainer = transformers.Trainer(model=_Regressor(), args=args, train_dataset=_Pairs(), callbacks=list(callbacks))
    if device == "cpu" and gpu_like:
        # The Trainer's Accelerator makes neither scaler nor autocast for fp16 on the CPU (see
        # test_transformers_cpu_fp16_has_no_scaler); give it what it makes on a GPU. train()
        # prepares the optimizer later, with this scaler.
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", **SCALER_ARGS)
        trainer.accelerator.native_amp = True
    return trainer


@pytest.mark.parametrize("device", DEVICES)
def test_transformers_callback(tmp_path, run_path, device):
    from ampdoctor.integrations.transformers import AmpdoctorCallback

    plain = _trainer(tmp_path, device=device)
    plain.train()
    callback = AmpdoctorCallback(path=run_path)
    trainer = _trainer(tmp_path, [callback], device=device)
    scaler = trainer.accelerator.scaler
    trainer.train()
    assert trainer.state.global_step == plain.state.global_step == STEPS
    info = _check_run(run_path, trainer.model, STEPS)
    assert info["device"] == device
    if device == "cpu":  # the stand-in scaler starts high (the Trainer's CUDA one cannot be told to)
        assert info["skipped_steps"] >= 1
    assert type(scaler) is torch.amp.GradScaler and callback.scaler is None  # unwrapped at train end
    _same_params(trainer.model, plain.model)


def test_transformers_resume_continues_the_step_numbers(tmp_path, run_path):
    from ampdoctor.integrations.transformers import AmpdoctorCallback

    first = _trainer(tmp_path, [AmpdoctorCallback(path=run_path)], max_steps=2, save_steps=2)
    first.train()
    resumed = _trainer(tmp_path, [AmpdoctorCallback(path=run_path)], max_steps=STEPS)
    resumed.train(resume_from_checkpoint=str(tmp_path / "trainer" / "checkpoint-2"))
    assert resumed.state.global_step == STEPS
    _check_run(run_path, resumed.model, STEPS)  # steps 0-1 from the first writer, 2-4 from the second
    assert len(read_run(run_path).writers) == 2


def test_transformers_cpu_fp16_has_no_scaler(tmp_path, run_path):
    from ampdoctor.integrations.transformers import AmpdoctorCallback

    trainer = _trainer(tmp_path, [AmpdoctorCallback(path=run_path)], gpu_like=False)
    assert trainer.accelerator.scaler is None  # fp16=True, use_cpu=True: the Trainer's own choice
    with pytest.raises(ValueError, match="no GradScaler"):
        trainer.train()
    with pytest.raises(ValueError, match="level"):
        AmpdoctorCallback(path=run_path, level="everything")  # options are checked at once


# -- Lightning -------------------------------------------------------------------------------------

@pytest.fixture
def lightning_fit():
    pl = pytest.importorskip("lightning.pytorch", reason='needs Lightning: pip install "ampdoctor[lightning]"')
    from lightning.pytorch.plugins import MixedPrecision

    class Module(pl.LightningModule):
        def __init__(self, fail_at: int | None = None) -> None:
            super().__init__()
            self.net = _net()
            self.fail_at = fail_at

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, index):
            if index == self.fail_at:
                raise KeyError("stop here")
            x, y = batch
            return F.mse_loss(self(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def fit(device="cpu", *, callbacks=(), flag=False, scaler=None, fail_at=None, max_steps=STEPS, ckpt_path=None):
        """``flag``: ``precision="16-mixed"``, Lightning's own choice of plugin. Else a
        ``MixedPrecision("16-mixed", device)`` plugin with ``scaler`` (a callable gets the module),
        by default a torch.amp.GradScaler: Lightning turns "16-mixed" on the CPU into
        "bf16-mixed" (test_lightning_refusals), the plugin itself keeps fp16."""
        module = Module(fail_at)
        if flag:
            plugin = dict(precision="16-mixed")
        else:
            scaler = scaler(module) if callable(scaler) else scaler or torch.amp.GradScaler(device, **SCALER_ARGS)
            plugin = dict(plugins=[MixedPrecision("16-mixed", device, scaler=scaler)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's tips and CPU notices, but not ours:
            warnings.filterwarnings("error", "ampdoctor", RuntimeWarning)
            trainer = pl.Trainer(accelerator="cpu" if device == "cpu" else "gpu", devices=1, max_steps=max_steps,
                                 accumulate_grad_batches=ACCUMULATE, gradient_clip_val=1.0, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 num_sanity_val_steps=0, callbacks=list(callbacks), **plugin)
            trainer.fit(module, torch.utils.data.DataLoader(_data(), batch_size=BATCH), ckpt_path=ckpt_path)
        return trainer, module

    return fit


@pytest.mark.parametrize("device", DEVICES)
def test_lightning_callback(lightning_fit, run_path, device):
    from ampdoctor.integrations.lightning import AmpdoctorCallback

    flag = device == "cuda"  # on CUDA, precision="16-mixed" as users write it
    _, plain = lightning_fit(device, flag=flag)
    callback = AmpdoctorCallback(path=run_path)
    trainer, module = lightning_fit(device, flag=flag, callbacks=[callback])
    assert trainer.global_step == STEPS
    info = _check_run(run_path, module, STEPS)
    assert info["device"] == device
    if device == "cpu":  # the stand-in scaler starts high; the CUDA one is Lightning's default
        assert info["skipped_steps"] >= 1
    assert type(trainer.precision_plugin.scaler) is torch.amp.GradScaler and callback.scaler is None
    _same_params(module, plain)


def test_lightning_recommendation_is_in_lightning_s_own_arguments(lightning_fit, run_path):
    """A run recorded through the callback is advised as a Lightning user sets a scaler: the
    precision plugin passed to the Trainer; pasted, it builds a Trainer whose scaler has the
    recommended settings (issue 40). The same for an ampdoctor.GradScaler given to the plugin:
    its model is a LightningModule."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins import MixedPrecision
    from ampdoctor.analysis.report import report_data
    from ampdoctor.integrations.lightning import AmpdoctorCallback
    from ampdoctor.render import contract

    lightning_fit(callbacks=[AmpdoctorCallback(path=run_path)])
    lightning_fit(scaler=lambda m: ampdoctor.GradScaler("cpu", model=m, path=run_path.parent / "own",
                                                         **SCALER_ARGS))
    for path in (run_path, run_path.parent / "own"):
        run = read_run(path)
        assert run.metadata["scaler.framework"] == "lightning"
        rec = contract(report_data(run))["recommendation"]
        assert rec["code"].startswith('Trainer(plugins=[MixedPrecision("16-mixed", "cpu", '
                                      'scaler=torch.amp.GradScaler("cpu", init_scale='), rec["code"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's notices about the CPU
            trainer = eval(rec["code"], {"Trainer": pl.Trainer, "MixedPrecision": MixedPrecision,  # noqa: S307
                                         "torch": torch})
        assert trainer.precision_plugin.scaler.get_scale() == rec["init_scale"]


def test_lightning_callback_closes_the_run_when_fit_fails(lightning_fit, run_path):
    from ampdoctor.integrations.lightning import AmpdoctorCallback

    callback = AmpdoctorCallback(path=run_path)
    with pytest.raises(KeyError, match="stop here"):
        lightning_fit(callbacks=[callback], fail_at=2 * ACCUMULATE)  # after two optimizer steps
    info = describe(read_run(run_path))
    assert info["steps"] == 2 and info["ended_cleanly"] and callback.scaler is None


def test_lightning_resume_continues_the_step_numbers(lightning_fit, run_path, tmp_path):
    from ampdoctor.integrations.lightning import AmpdoctorCallback

    first, _ = lightning_fit(callbacks=[AmpdoctorCallback(path=run_path)], max_steps=2)
    first.save_checkpoint(tmp_path / "fit.ckpt")  # the scaler's state and global_step
    resumed, module = lightning_fit(callbacks=[AmpdoctorCallback(path=run_path)], ckpt_path=tmp_path / "fit.ckpt")
    assert resumed.global_step == STEPS
    _check_run(run_path, module, STEPS)  # the second writer starts at the checkpoint's step 2
    assert len(read_run(run_path).writers) == 2


@pytest.mark.parametrize("device", DEVICES)
def test_lightning_ampdoctor_scaler_as_the_plugin_s(lightning_fit, run_path, device):
    _, plain = lightning_fit(device)
    trainer, module = lightning_fit(
        device, scaler=lambda m: ampdoctor.GradScaler(device, model=m, path=run_path, **SCALER_ARGS))
    trainer.precision_plugin.scaler.close()
    assert trainer.global_step == STEPS
    info = _check_run(run_path, module, STEPS)
    assert info["scaler"]["class"] == "ampdoctor.GradScaler"
    _same_params(module, plain)


def test_lightning_refusals(lightning_fit, run_path):
    from ampdoctor.integrations.lightning import AmpdoctorCallback

    with pytest.raises(ValueError, match="no GradScaler.*'bf16-mixed'"):  # Lightning's choice on the CPU
        lightning_fit(callbacks=[AmpdoctorCallback(path=run_path)], flag=True)
    scaler = ampdoctor.GradScaler("cpu", path=run_path)
    with pytest.raises(ValueError, match="already recording"):
        lightning_fit(callbacks=[AmpdoctorCallback(path=run_path)], scaler=scaler)
    scaler.close()
