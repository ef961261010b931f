"""The GEMM operand rows (``gemm_operands.py``, issue 29) against what the test's own hooks see:
each call's input, each layer's weight and each call's output gradient (``fp8_truth.OperandCapture``),
their peaks every step and their fine histograms on module-sampled steps, exactly; with gradient
accumulation, activation checkpointing, ``fp8=False`` and a weight under ``torch.nn.utils.parametrize``."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.utils.checkpoint import checkpoint

import ampdoctor
import fp8_truth as F
from ampdoctor.analysis.fp8 import predictions
from ampdoctor.cli.commands import main
from ampdoctor.run_file.schema import GEMM_KINDS, META_GEMM_LAYERS
from ampdoctor.stats.fine_hist import fine_hist

INPUT, WEIGHT, GRAD = GEMM_KINDS


class Net(nn.Module):
    """Linear → GELU → Linear → ReLU → Linear; ``checkpointed``: the middle block runs under
    activation checkpointing (its forward recomputed in backward)."""

    def __init__(self, checkpointed: str | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 24)
        self.mid = nn.Sequential(nn.GELU(), nn.Linear(24, 24), nn.ReLU())
        self.out = nn.Linear(24, 5)
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.inp(x)
        if self.checkpointed is not None:
            h = checkpoint(self.mid, h, use_reentrant=self.checkpointed == "reentrant")
        else:
            h = self.mid(h)
        return self.out(h)


def _train(model, path, *, steps=4, micro=1, dtype=torch.float16, **options):
    """fp16 (a real GradScaler) or bf16 (disabled) training with ampdoctor at level="full" and the
    truth's hooks; returns the capture and each step's scale."""
    fp16 = dtype == torch.float16
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = ampdoctor.GradScaler("cpu", enabled=fp16, path=path, level="full", model=model, module_every=2,
                                  init_scale=2.0**10, **options)
    capture = F.OperandCapture(model)
    scales = []
    gen = torch.Generator().manual_seed(0)
    try:
        for _ in range(steps):
            scales.append(float(scaler.get_scale()) if fp16 else 1.0)
            for _ in range(micro):
                x = torch.randn(6, 12, generator=gen)
                with torch.autocast("cpu", dtype=dtype):
                    loss = model(x).float().square().mean() / micro
                scaler.scale(loss).backward()
            _update(scaler, opt)
    finally:
        capture.remove()
        scaler.close()
    return capture, scales


def _update(scaler, opt) -> None:
    """The step's end, as a training loop does it."""
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def _rows(path):
    frame = ampdoctor.load(path)
    return frame[frame["kind"].isin(GEMM_KINDS)], frame.attrs["metadata"]


def _amax(t: torch.Tensor) -> float:
    return float(t.abs().max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_each_operand_peak_every_step_and_its_fine_histogram_on_sampled_steps_are_the_tensors(dtype, tmp_path):
    torch.manual_seed(0)
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        capture, scales = _train(model, tmp_path / "run", dtype=dtype)
    rows, meta = _rows(tmp_path / "run")
    assert meta[META_GEMM_LAYERS] == '{"inp":"Linear","mid.1":"Linear","out":"Linear"}'
    for layer, slots in capture.operands.items():
        for kind, operand in ((INPUT, "input"), (WEIGHT, "weight"), (GRAD, "grad_output")):
            mine = rows[(rows["name"] == layer) & (rows["kind"] == kind)].sort_values("step")
            assert mine["step"].tolist() == [0, 1, 2, 3]
            for (_, r), step in zip(mine.iterrows(), range(4)):
                tensor = slots[operand][step]
                if kind == GRAD:
                    tensor = tensor / scales[step]  # unscaled, as torch's unscale_ (a power of two: exact)
                assert r["amax"] == pytest.approx(_amax(tensor), rel=0, abs=0), (layer, kind, step)
                assert r["numel"] == tensor.numel()
                if step % 2 == 0:  # module-sampled: the fine histogram of the very tensor
                    counts, zeros = fine_hist(tensor)
                    assert np.array_equal(np.asarray(r["fine_hist"]), counts.numpy()), (layer, kind, step)
                    assert r["n_zero"] == int(zeros)
                else:
                    assert r["fine_hist"] is None and math.isnan(r["n_zero"])
    # the input the first layer received (float32: before autocast casts it) and the fp16/bf16 ones after
    assert set(rows.loc[rows["kind"] == INPUT, "dtype"]) == {"float32", str(dtype).removeprefix("torch.")}


def test_gradient_accumulation_gives_a_pass_per_micro_batch_and_one_weight_per_step(tmp_path):
    torch.manual_seed(0)
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        capture, scales = _train(model, tmp_path / "run", micro=3, steps=2)
    rows, _ = _rows(tmp_path / "run")
    mid = rows[rows["name"] == "mid.1"]
    assert mid.groupby("kind")["step"].count().to_dict() == {INPUT: 6, GRAD: 6, WEIGHT: 2}
    inputs = mid[mid["kind"] == INPUT].sort_values(["step", "call"])
    assert inputs["amax"].tolist() == [pytest.approx(_amax(t), abs=0) for t in capture.operands["mid.1"]["input"]]
    pred = predictions(ampdoctor.read_run(tmp_path / "run"))
    current = pred[(pred["layer"] == "mid.1") & (pred["operand"] == "input") & (pred["recipe"] == "current")]
    assert len(current) == 6  # a pass per call, as TransformerEngine's history advances per micro-batch
    # a history longer than the run clips only the unavoidable passes, counted in passes, not steps
    data = ampdoctor.fp8(tmp_path / "run")
    for layer in data["layers"]:
        for op in layer["operands"]:
            longest = op["recipes"][-1]
            assert longest["history"] == 1024 and longest["clipped_passes"] == op["unavoidable_clip_passes"]
    assert "default history of 1024 clips no more" in " ".join(data.text().split())


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_a_checkpoint_recomputation_adds_no_input_row(mode, tmp_path):
    """The forward's input is observed once, not again when backward recomputes it; a reentrant
    checkpoint runs its forward under no_grad, inside a training forward (grad mode is read at the
    outermost tapped call, which began with grad enabled): observed too."""
    torch.manual_seed(0)
    model = Net(checkpointed=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(model, tmp_path / "run", steps=2)
    rows, _ = _rows(tmp_path / "run")
    mid = rows[rows["name"] == "mid.1"]
    assert mid.groupby("kind")["step"].count().to_dict() == {INPUT: 2, GRAD: 2, WEIGHT: 2}
    assert ampdoctor.fp8(tmp_path / "run")["unknown"] == []


def test_a_validation_pass_under_no_grad_adds_no_input_row(tmp_path):
    """Validation forwards between steps (no_grad) are not training passes: their inputs would
    put validation data into the amax history."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = ampdoctor.GradScaler("cpu", path=tmp_path / "run", level="full", model=model, module_every=2)
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                for _ in range(3):
                    model(100 * torch.randn(6, 12, generator=gen))  # validation: far larger inputs
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(6, 12, generator=gen)).float().square().mean()
            scaler.scale(loss).backward()
            _update(scaler, opt)
        scaler.close()
    rows, _ = _rows(tmp_path / "run")
    inputs = rows[(rows["kind"] == INPUT) & (rows["name"] == "inp")]
    assert len(inputs) == 2 and inputs["amax"].max() < 10  # the training batches' only


def test_fp8_false_records_no_operands_and_the_command_says_what_the_run_lacks(tmp_path):
    torch.manual_seed(0)
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(model, tmp_path / "run", steps=2, fp8=False)
    frame = ampdoctor.load(tmp_path / "run")
    assert not frame["kind"].isin(GEMM_KINDS).any() and META_GEMM_LAYERS not in frame.attrs["metadata"]
    assert frame["kind"].isin(["output", "grad_output"]).any()  # the module taps themselves are on
    result = CliRunner().invoke(main, ["fp8", str(tmp_path / "run")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert "no FP8 operand statistics" in result.output and "level='full'" in result.output


def test_training_is_bit_for_bit_the_plain_scalers(tmp_path):
    """The operands' hooks and reductions change nothing: the same weights after fp16 training
    with a plain torch GradScaler and with ampdoctor recording them."""
    def weights(recording: bool):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = (ampdoctor.GradScaler("cpu", path=tmp_path / "run", level="full", model=model, module_every=2)
                  if recording else torch.amp.GradScaler("cpu"))
        gen = torch.Generator().manual_seed(0)
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(6, 12, generator=gen)).float().square().mean()
            scaler.scale(loss).backward()
            _update(scaler, opt)
        if recording:
            scaler.close()
        return [p.detach().clone() for p in model.parameters()]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain, recorded = weights(False), weights(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))
    assert ampdoctor.load(tmp_path / "run")["kind"].isin(GEMM_KINDS).any()


def test_a_parametrized_weight_is_not_read_and_training_is_unchanged(tmp_path):
    """``spectral_norm`` (a parametrization) runs a power iteration each time its weight is
    computed, updating its state in place: reading the weight outside the forward would change
    training. Its layer gets no weight rows (its input and gradient still), and training is bit for
    bit that of ``fp8=False``."""
    def train(fp8: bool):
        torch.manual_seed(0)
        model = Net()
        torch.nn.utils.parametrizations.spectral_norm(model.out)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _train(model, tmp_path / f"run-{fp8}", steps=4, fp8=fp8)
        return [p.detach().clone() for p in model.parameters()] + [b.clone() for b in model.buffers()]

    assert all(torch.equal(a, b) for a, b in zip(train(False), train(True)))
    rows, _ = _rows(tmp_path / "run-True")
    out = rows[rows["name"] == "out"]
    assert set(out["kind"]) == {INPUT, GRAD}


def test_the_accelerator_count_of_the_fine_histogram_is_the_hosts(monkeypatch):
    """Accelerators count bins by sorting (CUDA's bincount reads the maximum on the host: a sync);
    on the same tensor, unscaled by a non-power-of-two scale, with zeros, inf and NaN, both counts
    are the same."""
    from ampdoctor.stats import fine_hist as FH

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(70_000, generator=gen) * torch.exp(torch.randn(70_000, generator=gen) * 4)).half()
    x[:500] = 0
    x[500], x[501] = math.inf, math.nan
    inv = torch.tensor(1 / 3.0)
    host = FH.fine_hist(x, inv)
    monkeypatch.setattr(FH, "_on_host", lambda flat: False)
    monkeypatch.setattr(FH, "CHUNK", 1 << 14)  # several chunks
    sorted_ = FH.fine_hist(x, inv)
    assert torch.equal(host[0], sorted_[0]) and int(host[1]) == int(sorted_[1]) == int((x == 0).sum()) >= 500


def test_a_layer_never_called_as_a_module_is_named_not_assessed(tmp_path):
    """``nn.MultiheadAttention`` uses its ``out_proj`` weight inside its own forward: the Linear is
    a GEMM layer of the model that no module hook sees. It is listed as not called (and said so),
    not as a layer whose operands were never sampled."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = ampdoctor.GradScaler("cpu", path=tmp_path / "run", level="full", model=model, module_every=2)
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(2, 5, 16)).float().square().mean()
            scaler.scale(loss).backward()
            _update(scaler, opt)
        scaler.close()
    data = ampdoctor.fp8(tmp_path / "run")
    assert data["not_called"] == ["0.self_attn.out_proj"] and "not_called" in data["limits"]
    assert [layer["name"] for layer in data["layers"]] == ["0.linear1", "0.linear2", "1"]
    assert "never called as modules" in " ".join(data.text().split())


def test_peaks_beyond_the_per_step_limit_are_warned_not_dropped_silently(tmp_path, monkeypatch):
    """More GEMM observations in a step than the recorder keeps (a long loop of calls): the rest
    is counted with the module observations and warned about once."""
    from ampdoctor.record import recorder

    monkeypatch.setattr(recorder, "MAX_TAP_ROWS_PER_STEP", 10)
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="more than 10 module observations in one step"):
        _train(Net(), tmp_path / "run", steps=2, micro=4)


def test_with_the_flight_recorder_off_the_operands_are_still_recorded_every_step(tmp_path):
    """flight_steps=0: light steps keep no module peaks for the flight recorder, but the GEMM
    operands' peaks are still taken every step."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        capture, _ = _train(Net(), tmp_path / "run", steps=4, flight_steps=0)
    rows, _ = _rows(tmp_path / "run")
    weights = rows[(rows["kind"] == WEIGHT) & (rows["name"] == "out")].sort_values("step")
    assert weights["step"].tolist() == [0, 1, 2, 3]
    assert weights["amax"].tolist() == [pytest.approx(_amax(w), abs=0) for w in capture.operands["out"]["weight"]]

