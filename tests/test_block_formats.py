"""Block formats (issue 42): the block statistics of a GEMM operand (stats.block_stats) and what
MXFP8, MXFP4 and NVFP4 would make of it (analysis.block_formats), against torchao's reference
casts of the same operands (tests/block_truth.py) on hand-worked blocks and on the operands of
third-party architectures captured by the tests' own hooks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("torchao")

import block_truth as T  # noqa: E402
from ampdoctor.analysis.block_formats import (E2M1, E4M3, E5M2, RECIPES, BlockStatsHost,  # noqa: E402
                                              measured, predict)
from ampdoctor.run_file.block_bins import REL_WINDOW, window_index  # noqa: E402
from ampdoctor.stats.block_stats import block_stats, pack  # noqa: E402

RECIPE = {r.name: r for r in RECIPES}


def host(tensor: torch.Tensor, **kwargs) -> BlockStatsHost:
    """Through the column's value, as a run is read back."""
    return BlockStatsHost.from_values(pack(block_stats(tensor, **kwargs)).numpy())


def truth(x: torch.Tensor, recipe) -> T.BlockCast:
    return T.cast(x, recipe.element.name, recipe.scale, recipe.block, recipe.element.max)


def within(predicted: float, true: float) -> bool:
    """Issue 42's tolerance: max(0.5 percentage points, 25%) of the truth."""
    return abs(predicted - true) <= max(0.005, 0.25 * true)


@pytest.mark.parametrize("fmt,dtype", [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)])
def test_the_element_rounding_is_torchs_cast(fmt, dtype):
    """Nearest, ties to even (the grid's midpoints included), saturating at the maximum."""
    exponents = np.arange(fmt.emin - fmt.mbits - 2, int(np.log2(fmt.max)) + 2)
    steps = np.arange(0, 2 ** (fmt.mbits + 2)) / 2 ** (fmt.mbits + 2)
    q = np.unique(np.concatenate([np.ldexp(1.0 + steps, e) for e in exponents] + [[0.0, fmt.max * 1.3]]))
    cast = torch.tensor(q, dtype=torch.float32).clamp(max=fmt.max).to(dtype).double().numpy()
    np.testing.assert_array_equal(fmt.round(q), cast)


def test_the_e2m1_rounding_is_torchaos():
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked

    q = np.arange(0, 7.25, 0.125)
    cast = f4_unpacked_to_f32(f32_to_f4_unpacked(torch.tensor(q, dtype=torch.float32).clamp(max=6.0)))
    np.testing.assert_array_equal(E2M1.round(q), cast.double().numpy())


def test_a_hand_worked_mx_block():
    """One block of 32 whose amax is 15 = 1.875 · 2^3 (class: above 1.75), so rel = |x| / 8: at
    E4M3 under a floor scale (2^(3-8)) 15 becomes 480 and saturates, 13.5 (rel 1.6875) is 432 and
    does not, 2^-16 (rel 2^-19, below half E4M3's smallest subnormal) flushes, 2^-12 (rel 2^-15)
    does not. A round-up scale (2^(3-8+1)) halves them all: nothing saturates, and 2^-16 still
    flushes."""
    values = torch.tensor([15.0, 13.5, 1.0, 2.0 ** -12, 2.0 ** -16] + [0.0] * 27)
    stats = host(values)
    rel = values[values != 0].numpy() / 8.0
    expected = np.bincount(window_index(rel, REL_WINDOW), minlength=stats.mx_rel.shape[1])
    np.testing.assert_array_equal(stats.mx_rel[2], expected)
    assert stats.mx_rel[:2].sum() == 0 and stats.nonzero == 5
    for name, flushed, saturated in (("mxfp8_e4m3_floor", 1 / 5, 1 / 5), ("mxfp8_e4m3_round_up", 1 / 5, 0.0)):
        p, m, t = predict(stats, RECIPE[name]), measured(stats, RECIPE[name]), truth(values, RECIPE[name])
        assert (p.flushed, p.saturated) == (m.flushed, m.saturated) == (t.flushed, t.saturated) == (flushed, saturated)


def test_a_hand_worked_nvfp4_tensor():
    """Two blocks of 16: the tensor's amax 6 makes the tensor scale 6 / 2688, so a block scale is
    ``amax_block / 6 · 448 / 6`` in E4M3 (first block: 448, exactly), and q = |x| · 6 / amax_block
    rounded by that E4M3 scale. The second block's amax, 6 · 2^-20, asks for a scale of
    448 · 2^-20, below E4M3's smallest normal (2^-6): it is clamped up to that, which puts its
    element at q = 2688 · 2^6 · 2^-20 = 0.16, flushed."""
    first = torch.tensor([6.0, 3.0, 0.24, 0.26] + [0.0] * 12)
    second = torch.tensor([6.0 * 2.0 ** -20] + [0.0] * 15)
    values = torch.cat([first, second])
    stats = host(values)
    assert list(stats.nv_clamped) == [1, 1]
    p, m, t = predict(stats, RECIPE["nvfp4"]), measured(stats, RECIPE["nvfp4"]), truth(values, RECIPE["nvfp4"])
    # 0.24 flushes (q below 0.25); 0.26 becomes 0.5; the clamped block's element flushes too
    assert p.flushed == m.flushed == t.flushed == 2 / 5
    assert p.saturated == m.saturated == t.saturated == 0.0
    assert p.clamped_blocks == m.clamped_blocks == 1 / 2


def test_zero_and_unaligned_operands():
    """An all-zero operand has no figures (NaN); a last dimension that is not a whole number of
    blocks is padded with zeros, as the casts pad it."""
    assert np.isnan(predict(host(torch.zeros(4, 32)), RECIPE["nvfp4"]).flushed)
    for empty in (torch.zeros(4, 32), torch.zeros(4, 0), torch.zeros(0, 64)):  # (an expert without tokens)
        stats = host(empty)
        assert stats.nonzero == 0 and not np.isnan(stats.measured).any() and not stats.mx_rel.any()
    x = torch.randn(3, 40) * torch.exp(torch.randn(3, 40) * 4)
    stats = host(x)
    assert stats.nonzero == 120 and stats.mx_rel.sum() == 120 and stats.nv_q.sum() == 120
    for recipe in RECIPES:
        p, m, t = predict(stats, recipe), measured(stats, recipe), truth(x, recipe)
        assert within(p.flushed, t.flushed) and within(p.saturated, t.saturated), recipe.name
        assert (m.flushed, m.saturated) == (t.flushed, t.saturated), recipe.name


def _operands(name: str, dtype: torch.dtype, planted: bool) -> list[tuple[str, torch.Tensor]]:
    import architectures as A
    import fp8_truth as F8

    return F8.one_step_operands(A.build(name), dtype, planted)


@pytest.mark.parametrize("planted", [False, True], ids=["plain", "outliers"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "vit", "llama"])
def test_predictions_match_the_casts_of_real_operands(name, dtype, planted):
    """Every GEMM operand of one training step (the tests' own hooks), every recipe: the shares
    predicted from the histograms within issue 42's tolerance of torchao's casts for at least 95%
    of (operand, recipe) pairs; the measured figures (flushed, saturated, relative error) the
    casts' own."""
    pytest.importorskip("transformers")
    operands = _operands(name, dtype, planted)
    assert len(operands) >= 12
    pairs = misses = 0
    flushing = 0
    for label, x in operands:
        stats = host(x)
        for recipe in RECIPES:
            p, m, t = predict(stats, recipe), measured(stats, recipe), truth(x, recipe)
            pairs += 1
            misses += not (within(p.flushed, t.flushed) and within(p.saturated, t.saturated))
            # the measured figures are the cast's (the same arithmetic; sums in another order)
            assert (m.flushed, m.saturated) == (t.flushed, t.saturated), (label, recipe.name)
            assert m.error == pytest.approx(t.error, rel=1e-6, abs=1e-12), (label, recipe.name)
            flushing += t.flushed > 0.01
    assert misses <= 0.05 * pairs, (misses, pairs)
    assert flushing  # (some recipe loses elements on these operands: the comparison is not of zeros)


def test_operands_in_their_own_grid():
    """A bfloat16 operand's elements lie on its grid (16 points an eighth of a binade, ties to the
    format's midpoints among them): told the source format, the prediction takes them there."""
    torch.manual_seed(3)
    x = (torch.randn(64, 256) * 1e-6).bfloat16()
    stats = host(x)
    for recipe in RECIPES:
        p, t = predict(stats, recipe, source_mbits=7), truth(x, recipe)
        assert within(p.flushed, t.flushed) and within(p.saturated, t.saturated), recipe.name
        assert abs(p.saturated - t.saturated) <= 0.0005, recipe.name


def test_blocks_whose_scale_is_clamped_bound_the_flushed_share():
    """A block whose amax is below 2^(emax - 126) needs an E8M0 scale below what torchao's floor
    cast allows (it raises the scale to 2^-126): which of its elements still flush the histograms
    cannot tell, so the prediction is a range holding the truth; the measured figure is exact."""
    torch.manual_seed(5)
    tiny = torch.randn(4, 32) * 2.0 ** -124   # amax about 2^-122: clamped at E4M3 (emax 8)
    normal = torch.randn(4, 32)
    x = torch.cat([tiny, normal], dim=1)
    stats = host(x)
    recipe = RECIPE["mxfp8_e4m3_floor"]
    p, m, t = predict(stats, recipe), measured(stats, recipe), truth(x, recipe)
    assert p.clamped_blocks == m.clamped_blocks == 0.5
    assert p.flushed <= t.flushed <= p.flushed_max and p.flushed_max > p.flushed
    assert (m.flushed, m.saturated) == (t.flushed, t.saturated)


def test_the_accelerators_counts_are_the_cpus(monkeypatch):
    """On accelerators the counts come from a sort (stats.fine_hist.count_bins): the same counts."""
    from ampdoctor.stats import fine_hist

    torch.manual_seed(7)
    x = torch.randn(16, 80) * torch.exp(torch.randn(16, 80) * 3)
    on_cpu = block_stats(x)
    monkeypatch.setattr(fine_hist, "_on_host", lambda t: False)
    sorted_ = block_stats(x)
    for field in ("mx_rel", "mx_blocks", "nv_q", "nv_ratio", "nv_clamped", "measured"):
        assert torch.equal(getattr(on_cpu, field), getattr(sorted_, field)), field
