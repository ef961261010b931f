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


def _plant(model: torch.nn.Module) -> None:
    """Outliers as real models have them: one large weight (the first GEMM layer's, x1000) and a
    massive activation channel (channel 3 of the input embedding, x100, carried by the residual)."""
    import fp8_truth as F8

    first = next(iter(F8.gemm_layers(model).values()))
    with torch.no_grad():
        first.weight.view(-1)[0] *= 1000.0
        embedding = model.get_input_embeddings()
        if isinstance(embedding, torch.nn.Embedding):
            embedding.weight[:, 3] *= 100.0
        else:  # (ViT: the patch embedding's convolution)
            embedding.projection.bias[3] += 100.0


def _operands(name: str, dtype: torch.dtype, planted: bool) -> list[tuple[str, torch.Tensor]]:
    import architectures as A
    import fp8_truth as F8

    arch = A.build(name)
    if planted:
        _plant(arch.model)
    capture = F8.OperandCapture(arch.model)
    try:
        with torch.autocast("cpu", dtype=dtype):
            loss = arch.loss(arch.model, 0)
        loss.float().backward()
    finally:
        capture.remove()
    return [(f"{layer}.{kind}", x) for layer, ops in capture.operands.items() for kind, xs in ops.items()
            for x in xs if x.numel() and bool(torch.isfinite(x).all()) and bool((x != 0).any())]


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


# -- the Triton kernel (stats/block_triton.py): the torch path's numbers in a few launches --------------

class _AnyGrid(dict):
    """A stand-in for a Triton kernel: ``kernel[grid](...)`` calls ``fn`` whatever the grid."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def __missing__(self, grid):
        return self.fn


def _kernel_ready() -> bool:
    import importlib.util
    import os
    return importlib.util.find_spec("triton") is not None and (os.environ.get("TRITON_INTERPRET") == "1"
                                                               or torch.cuda.is_available())


needs_kernel = pytest.mark.skipif(not _kernel_ready(), reason="needs Triton (its interpreter without a GPU)")
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _both(x: torch.Tensor, inv: torch.Tensor | None = None, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    import warnings

    from ampdoctor.stats.block_stats import packed_block_stats

    x = x.to(KERNEL_DEVICE)
    inv = None if inv is None else inv.to(KERNEL_DEVICE)
    torch_path = packed_block_stats(x, inv, algorithm="torch", **kwargs).cpu().numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the interpreter's numpy on 0/0 in an all-zero tile)
        kernel = packed_block_stats(x, inv, algorithm="triton", **kwargs).cpu().numpy()
    return torch_path, kernel


def _assert_same(torch_path: np.ndarray, kernel: np.ndarray, label: str = "") -> None:
    """Every count equal; the sums of squares (float64 in the kernel, float32 squares summed per
    block on the torch path) to 1e-6 relative, or below 1e-30 (a square under float32's range)."""
    from ampdoctor.run_file.block_bins import unpack

    a, b = unpack(torch_path), unpack(kernel)
    for name in a:
        if name == "measured":
            np.testing.assert_array_equal(a[name][:, :2], b[name][:, :2], err_msg=f"{label} flushed/saturated")
            np.testing.assert_allclose(a[name][:, 2:], b[name][:, 2:], rtol=1e-6, atol=1e-30, err_msg=label)
        else:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"{label} {name}")


@needs_kernel
@pytest.mark.parametrize("name, dtype, planted", [("gpt2", torch.bfloat16, True), ("llama", torch.float16, False),
                                                  ("vit", torch.bfloat16, False)])
def test_the_kernel_gives_the_torch_paths_numbers_on_real_operands(name, dtype, planted):
    pytest.importorskip("transformers")
    operands = _operands(name, dtype, planted)
    for label, x in operands[:: max(1, len(operands) // 6)]:
        _assert_same(*_both(x.to(dtype)), label)


@needs_kernel
def test_the_kernel_on_edge_operands():
    """Unaligned and tiny shapes, float32 / float16 / bfloat16 (its subnormals too), an unscaling
    factor, blocks whose scale is clamped, zeros, an all-zero operand, a sample of rows, a
    transposed view."""
    torch.manual_seed(13)
    wide = torch.randn(40, 100) * torch.exp(torch.randn(40, 100) * 3)
    cases = {
        "float32": (wide, {}),
        "bfloat16 unaligned": (wide[:, :77].bfloat16(), {}),
        "float16 unscaled": ((torch.randn(20, 48) * 1e3).half(), {"inv": torch.tensor(2.0 ** -12)}),
        "clamped scales": (torch.cat([torch.randn(4, 32) * 2.0 ** -124, torch.randn(4, 32)], dim=1), {}),
        "bfloat16 subnormals": (torch.tensor([[1e-39, 3e-40, 0.5, 0.0] * 8] * 3).bfloat16(), {}),
        "zeros": (torch.zeros(5, 48), {}),
        "sampled": (wide, {"max_elements": 1000}),
        "transposed": (wide.t(), {}),
        "one row": (torch.randn(1, 33), {}),
        "vector": (torch.randn(300), {}),
    }
    for label, (x, kw) in cases.items():
        inv = kw.pop("inv", None)
        _assert_same(*_both(x, inv, **kw), label)


@needs_kernel
def test_the_kernel_is_a_few_launches_an_operand(monkeypatch):
    """The kernel path dispatches a dozen torch ops an operand besides the kernel (the amax, the
    launch's buffers, three reductions, the gather), where the torch path dispatches some 330.
    (The launch itself is stood in for: the interpreter's own copies are not a GPU's.)"""
    import sys
    from pathlib import Path

    from ampdoctor.stats import block_triton
    from ampdoctor.stats.block_stats import packed_block_stats

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from host_cost import OpCounter

    x = torch.randn(64, 256, device=KERNEL_DEVICE).bfloat16()
    launched = []
    monkeypatch.setattr(block_triton, "_block_kernel", _AnyGrid(lambda *a, **k: launched.append(a)))
    with OpCounter() as kernel:
        packed_block_stats(x, algorithm="triton")
    assert len(launched) == 1
    with OpCounter() as torch_path:
        packed_block_stats(x, algorithm="torch")
    assert kernel.launches <= 12 and torch_path.launches >= 250, (kernel.ops, torch_path.launches)
