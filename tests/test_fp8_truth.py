"""The FP8 ground truth of issue 29 (``fp8_truth.py``) against facts worked out by hand: where the
formats flush and saturate, what each recipe's scale is, and which operands the hooks capture."""

from __future__ import annotations

import pytest
import torch

import fp8_truth as F


@pytest.mark.parametrize("dtype, smallest", [(F.E4M3, 2.0**-9), (F.E5M2, 2.0**-16)])
def test_a_cast_flushes_at_half_the_smallest_subnormal_and_saturates_past_the_maximum(dtype, smallest):
    # half the smallest subnormal ties to even (0); just above it rounds up to the subnormal
    x = torch.tensor([smallest / 2, smallest / 2 * 1.01, smallest, 0.0, F.MAX[dtype] * 1.5, -F.MAX[dtype] * 3])
    c = F.cast(x, dtype, scale=1.0, allowed=F.MAX[dtype])
    assert (c.nonzero, c.flushed, c.saturated, c.clipped) == (5, 1, 2, True)
    assert c.flushed_share == 1 / 5 and c.saturated_share == 2 / 5


def test_current_scaling_maps_each_steps_amax_to_the_maximum_and_never_saturates():
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(1000, generator=gen) * torch.exp(torch.randn(1000, generator=gen) * 4)  # many binades
    steps = [spread * 10.0**k for k in (-6, 0, 6)]
    casts = F.current_scaling(steps, F.E4M3)
    assert all(c.saturated == 0 and not c.clipped for c in casts)
    # the same elements flush whatever the magnitude (the scale follows the amax; float32
    # rounding of the scaled values may move one or two across the threshold)
    assert casts[1].flushed > 0 and max(abs(c.flushed - casts[1].flushed) for c in casts) <= 2


def test_delayed_scaling_scales_by_the_previous_steps_and_clips_a_spike():
    """Amaxes 1, 1, 4, 1, 1 in E4M3 with histories 1 and 16: step 0 casts with scale 1 (nothing
    beyond 448 there); step 2's spike exceeds the history (1) and saturates what lies above 1;
    after it, history 1 forgets the spike (scale 448 again), history 16 keeps it (scale 112)."""
    base = torch.arange(-100, 101) / 100  # (0 exactly in the middle; the nonzero ones from 0.01)
    steps = [base, base, base * 4, base, base]
    above = int((base.abs() * 4 > 1).sum())
    one = F.delayed_scaling(steps, F.E4M3, history=1)
    sixteen = F.delayed_scaling(steps, F.E4M3, history=16)
    assert [c.clipped for c in one] == [False, False, True, False, False]
    assert [c.clipped for c in sixteen] == [False, False, True, False, False]
    assert one[2].saturated == above and sixteen[2].saturated == above
    assert all(c.saturated == 0 for i, c in enumerate(one) if i != 2)
    # step 0 at scale 1: E4M3 flushes |x| <= 2^-10 (none of base's nonzero values: step 0.01)
    assert one[0].flushed == 0
    # history 16 keeps the spike, so more small values flush after it
    # two steps after a spike: history 1 scales by 448 / 1, history 16 by 448 / 4; 2^-17 * 448
    # is above 2^-10 (kept), 2^-17 * 112 below (flushed); 2^-14 is kept by both
    tiny = torch.tensor([2.0**-17, 2.0**-14])
    small = F.delayed_scaling([base * 4, base, tiny], F.E4M3, history=16)[2]
    small_one = F.delayed_scaling([base * 4, base, tiny], F.E4M3, history=1)[2]
    assert (small.flushed, small_one.flushed) == (1, 0)


def test_a_history_without_a_finite_amax_keeps_the_previous_scale():
    zero = torch.zeros(10)
    x = torch.full((10,), 2.0)
    casts = F.delayed_scaling([x, zero, x * 2], F.E4M3, history=1)
    assert not casts[0].clipped and casts[1].nonzero == 0
    assert casts[2].clipped  # scale kept from step 0's amax (2): 4 exceeds it


def test_the_hooks_capture_every_gemm_operand_of_a_transformers_model():
    pytest.importorskip("transformers")
    import architectures as A

    arch = A.build("gpt2")
    layers = F.gemm_layers(arch.model)
    assert any(type(m).__name__ == "Conv1D" for m in layers.values())
    capture = F.OperandCapture(arch.model)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = arch.loss(arch.model, 0)
        loss.backward()
    finally:
        capture.remove()
    assert set(capture.operands) == set(layers)
    for name, ops in capture.operands.items():
        assert len(ops["input"]) == len(ops["weight"]) == len(ops["grad_output"]) >= 1, name
        layer = layers[name]
        w = layer.weight
        assert torch.equal(ops["weight"][0], w.detach().float())
        # the input's last dimension is the layer's input width (Conv1D stores its weight transposed)
        width = w.shape[0] if type(layer).__name__ == "Conv1D" else w.shape[1]
        assert ops["input"][0].shape[-1] == width
