"""The block statistics' Triton kernel (stats/block_triton.py, issue 42) against the torch path of
stats/block_stats.py: the same counts bit for bit (the sums of squares to 1e-6) on real operands
and edge cases, its launches counted, its fallback. Without a GPU the kernel runs under Triton's
interpreter (tests/conftest.py); no torchao needed (the floor environment of .ci/compat runs it with
torch 2.6's Triton 3.2)."""

from __future__ import annotations

import importlib.util
import os
import warnings

import numpy as np
import pytest
import torch

class _AnyGrid(dict):
    """A stand-in for a Triton kernel: ``kernel[grid](...)`` calls ``fn`` whatever the grid."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def __missing__(self, grid):
        return self.fn


def _kernel_ready() -> bool:
    return importlib.util.find_spec("triton") is not None and (os.environ.get("TRITON_INTERPRET") == "1"
                                                               or torch.cuda.is_available())


needs_kernel = pytest.mark.skipif(not _kernel_ready(), reason="needs Triton (its interpreter without a GPU)")
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _both(x: torch.Tensor, inv: torch.Tensor | None = None, **kwargs) -> tuple[np.ndarray, np.ndarray]:
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
    import architectures as A
    import fp8_truth as F8

    operands = F8.one_step_operands(A.build(name), dtype, planted)
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


@needs_kernel
def test_the_kernel_falls_back_to_the_torch_path_once_warned(monkeypatch):
    from ampdoctor.stats import block_stats as module
    from ampdoctor.stats import block_triton

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(block_triton, "triton_packed", broken)
    monkeypatch.setattr(module, "_TRITON_FAILED", [])
    x = torch.randn(16, 64)
    with pytest.warns(RuntimeWarning, match="Triton block statistics kernel failed here .RuntimeError: no compiler"):
        first = module.packed_block_stats(x, algorithm="triton")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module.packed_block_stats(x)  # (the torch path from then on, without a word)
    assert torch.equal(first, module.packed_block_stats(x, algorithm="torch"))


@needs_kernel
def test_a_narrow_operand_is_sampled_by_its_padded_size(monkeypatch):
    """A value head's output gradient [rows, 1] pads every row to a block of 32: the sample counts
    the padded elements, and the kernel's tiles (32 x 32 there) stay few, its partial results small."""
    from ampdoctor.stats import block_triton
    from ampdoctor.stats.block_stats import MAX_ELEMENTS, packed_block_stats

    grids = []

    class Grid(dict):
        def __missing__(self, grid):
            grids.append(grid)
            return lambda *a, **k: None

    monkeypatch.setattr(block_triton, "_block_kernel", Grid())
    packed_block_stats(torch.randn(1 << 20, 1), algorithm="triton")
    [(cols, rows)] = grids  # (column tiles on axis 0)
    assert cols == 1 and rows * block_triton.TILE <= 2 * MAX_ELEMENTS
    from ampdoctor.analysis.block_formats import BlockStatsHost

    stats = BlockStatsHost.from_values(packed_block_stats(torch.randn(1 << 20, 1), algorithm="torch").numpy())
    assert stats.rows[0] * 32 <= MAX_ELEMENTS and stats.rows[1] == 1 << 20
