"""The light taps' batched reduction (issue 39): taps hold their tensors, :class:`Peaks` reduces
them together (``stats.peaks.batch_peaks``), and every peak is the one an ``aminmax`` of the tensor
at its observation gives, NaN and inf included; a tensor changed in place before it was read has
no row, rather than a wrong one. The Triton kernels run under Triton's interpreter without a GPU."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.record import light_taps
from ampdoctor.record.call_graph import ModuleCall
from ampdoctor.record.light_taps import LightTaps, Peaks, observations
from ampdoctor.record.rows import _known
from ampdoctor.stats.peaks import batch_peaks

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from host_cost import OpCounter  # noqa: E402

CALL = ModuleCall("m", 0, None, (), 0)


def _truth(tensors) -> list[float]:
    """The peak of each tensor from its own float64 copy: NaN if it holds one, else max |x|."""
    out = []
    for t in tensors:
        x = t.detach().double()
        out.append(math.nan if torch.isnan(x).any() else x.abs().max().item())
    return out


def _tensors(gen, dtype):
    big = torch.randn(150_000, generator=gen)
    big[140_000] = math.nan                      # a NaN in the last chunk of a large tensor
    wide = torch.randn(300, 7, generator=gen).t()  # not contiguous
    tiny = torch.tensor([3e-41, -1e-40]) if dtype != torch.float16 else torch.tensor([1e-7, -2e-7])  # subnormal
    return [t.to(dtype) for t in (torch.tensor([1.0, math.nan, 3.0]), torch.tensor([-5.0, 2.0]),
                                  torch.tensor([math.inf, 1.0]), torch.tensor([-math.inf]), torch.zeros(3),
                                  torch.randn(200_000, generator=gen) * 1e3, wide, big, tiny)]


ALGORITHMS = ["foreach", "each"]
if importlib.util.find_spec("triton") is not None and (os.environ.get("TRITON_INTERPRET") == "1"
                                                       or torch.cuda.is_available()):
    ALGORITHMS.append("triton")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_batch_peaks_match_each_tensors_own_peak(algorithm, dtype):
    device = "cuda" if algorithm == "triton" and torch.cuda.is_available() else "cpu"
    tensors = [t.to(device) for t in _tensors(torch.Generator().manual_seed(0), dtype)]
    got = batch_peaks(tensors, algorithm)
    assert got.dtype == torch.float32 and got.shape == (len(tensors),)
    np.testing.assert_array_equal(got.cpu().numpy(), np.array(_truth(tensors), dtype=np.float32))


def test_the_cpu_reduces_mixed_dtypes_in_two_ops():
    tensors = [torch.randn(5).bfloat16(), torch.randn(3), torch.tensor([math.nan]).half(), torch.randn(4).bfloat16()]
    with OpCounter() as counter:
        got = batch_peaks(tensors)
    assert counter.total <= 2
    np.testing.assert_array_equal(got.numpy(), np.array(_truth(tensors), dtype=np.float32))


def test_peaks_are_reduced_in_batches_and_each_id_finds_its_own():
    """Reductions every ``batch`` tensors (and at the step's end); tensors of several dtypes; every
    id's place is its tensor's peak, also for a tensor held twice in a row (one id)."""
    gen = torch.Generator().manual_seed(1)
    taps = LightTaps(limit=1000, peaks=Peaks(batch=3))
    seen = []
    light_taps.CPU_BATCH, saved = 3, light_taps.CPU_BATCH
    try:
        for i in range(10):
            t = (torch.randn(4 + i, generator=gen) * 10 ** i).to(torch.bfloat16 if i % 3 else torch.float32)
            taps.add("output", CALL, i, t)
            seen.append(t)
            if i == 4:
                taps.add("output", CALL, 100, t)  # a repeat: the same id
                seen.append(t)
            if i == 6:
                assert len(taps.peaks._done) >= 2  # reduced while the step goes on
    finally:
        light_taps.CPU_BATCH = saved
    step = taps.flight_step(0, taps.peaks.finish())
    assert step.peaks.numel() == 10
    np.testing.assert_array_equal(step.peaks[step.index].numpy(), np.array(_truth(seen), dtype=np.float32))
    assert [o.order for o in observations(step.taps)] == [0, 1, 2, 3, 4, 100, 5, 6, 7, 8, 9]


def test_held_bytes_are_bounded(monkeypatch):
    """Holding a tensor keeps it alive a little longer: the bytes held are bounded (on CUDA a share
    of what the device has allocated; here the fixed bound), beyond which they are reduced."""
    monkeypatch.setattr(light_taps, "MIN_HOLD_BYTES", 1000)
    peaks = Peaks()
    peaks._budget = 1000  # (as the first reduction would set it on a device with 100 kB allocated)
    for _ in range(3):
        peaks.hold(torch.zeros(100))  # 400 bytes each
    assert len(peaks._done) == 1 and not peaks._held  # the third passed 1000 bytes: reduced
    peaks.finish()


def test_a_tensor_changed_in_place_while_held_has_no_peak_and_one_read_before_keeps_its_own():
    taps = LightTaps(limit=100, peaks=Peaks(batch=2))
    a, b, c = torch.tensor([1.0, -2.0]), torch.tensor([4.0]), torch.tensor([-8.0])
    light_taps.CPU_BATCH, saved = 2, light_taps.CPU_BATCH
    try:
        taps.add("output", CALL, 0, a)
        taps.add("output", CALL, 1, b)   # a batch of two: reduced now, before the change below
        a.mul_(100)                      # too late to matter: a's peak was read
        taps.add("output", CALL, 2, c)
        c.relu_()                        # changed while held: c's value at its observation is gone
    finally:
        light_taps.CPU_BATCH = saved
    step = taps.flight_step(0, taps.peaks.finish())
    assert step.index[2] == -1
    assert step.peaks[step.index[:2]].tolist() == [2.0, 4.0]


def test_taps_on_two_threads_lose_no_tensor():
    """Two autograd threads may tap at once: every id still finds its tensor's peak."""
    peaks = Peaks(batch=7)
    taps = [LightTaps(limit=10_000, peaks=peaks), LightTaps(limit=10_000, peaks=peaks)]
    tensors = [[torch.full((3,), float(1000 * k + i)) for i in range(500)] for k in range(2)]
    light_taps.CPU_BATCH, saved = 7, light_taps.CPU_BATCH
    try:
        threads = [threading.Thread(target=lambda k=k: [taps[k].add("output", CALL, i, t)
                                                       for i, t in enumerate(tensors[k])]) for k in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        light_taps.CPU_BATCH = saved
    done = peaks.finish()
    for k in range(2):
        step = taps[k].flight_step(0, done)
        assert step.peaks[step.index].tolist() == [float(1000 * k + i) for i in range(500)]


class _InPlace(nn.Module):
    """A Linear whose output a ReLU(inplace=True) changes after it returned (as ResNets do)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


def test_an_output_changed_in_place_is_read_at_once_from_the_next_step(tmp_path):
    """fc's output is changed by the in-place ReLU before the batch is read: on the first light
    step it has no row (its value is gone); from the next light step on it is read at once, and
    every row is the peak the test's own hooks measure at each module's return."""
    torch.manual_seed(0)
    model = _InPlace()
    truth: dict[str, float] = {}
    for name in ("fc", "act", "out"):
        getattr(model, name).register_forward_hook(
            lambda m, a, out, name=name: truth.__setitem__(name, out.detach().abs().max().item()))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    rows = {}
    with ampdoctor.GradScaler("cpu", model=model, path=tmp_path / "run", level="full", every=100,
                              flight_steps=4) as scaler:
        for step in range(3):  # step 0 is sampled (full statistics), 1 and 2 are light
            loss = model(x).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if not step:
                continue
            flight = scaler.recorder._anomalies.flight[-1]
            taps, index = _known(observations(flight.taps), flight.index)
            rows[step] = {t.call.name: float(flight.peaks[i]) for t, i in zip(taps, index) if t.kind == "output"}
            expected = dict(truth, **{"(model)": truth["out"]})  # the model returns out's output
            if step == 1:
                assert "fc" not in rows[1]
                expected.pop("fc")
            assert rows[step] == pytest.approx(expected)


def test_a_tensor_whose_memory_is_freed_while_held_is_not_read_and_is_read_at_once_next_step():
    """FSDP frees an unsharded weight's storage after its block's forward (``resize_(0)``): a held
    tensor whose memory went away is not read (that would read freed memory), its peak is unknown
    for this step, and from the next step on that observation is read at once, exactly."""
    taps = LightTaps(limit=100)
    for step in range(2):
        weight = torch.tensor([0.5, -4.0, 2.0]) * (step + 1)
        kept = torch.tensor([1.0])
        taps.add("gemm_weight", CALL, -1, weight)
        taps.add("output", CALL, 0, kept)
        weight.untyped_storage().resize_(0)  # as FSDP does after the forward
        result = taps.flight_step(step, taps.peaks.finish())
        if step == 0:
            assert result.index[0] == -1 and result.peaks[result.index[1]].item() == 1.0
        else:  # read at its observation, before the memory went
            assert result.peaks[result.index].tolist() == [8.0, 1.0]
    assert ("gemm_weight", "m", -1) in taps.peaks.at_once
