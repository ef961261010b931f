"""The triton algorithm of the full statistics (issue 26) beyond the shared reference tests of
test_stats.py: zero lines and histogram geometries, the fallback where Triton fails, the host-side
op count, and the kernels compiled for a Hopper GPU without one. Without a GPU the kernels run
under Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from ampdoctor.float_formats import BFLOAT16, FLOAT16
from ampdoctor.stats import HostStats, algorithm_for, full_stats
from ampdoctor.stats import algorithms as algorithms_module, full as full_module

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or (os.environ.get("TRITON_INTERPRET") != "1"
                                                   and not torch.cuda.is_available()),
    reason="needs Triton (its interpreter without a GPU)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from host_cost import OpCounter  # noqa: E402


def _assert_same(got: HostStats, expected: HostStats, context: str = "", l2_rtol: float = 1e-6) -> None:
    for field in HostStats.__dataclass_fields__:
        a, b = getattr(got, field), getattr(expected, field)
        if field == "l2":  # float64 sums of squares in another order (the host's: float32 partial sums)
            np.testing.assert_allclose(a, b, rtol=l2_rtol, err_msg=f"{field} {context}")
        else:
            np.testing.assert_array_equal(a, b, err_msg=f"{field} {context}")


def _triton_and_host(tensors, **kw) -> tuple[HostStats, HostStats]:
    """The statistics of ``tensors`` by the triton algorithm (on DEVICE, as the host sees them
    after the copy) and by the host algorithm (on the CPU): what every test here compares."""
    inv = kw.get("inv_scale")
    got = full_stats([t.to(DEVICE) for t in tensors], algorithm="triton",
                     **{**kw, "inv_scale": None if inv is None else inv.to(DEVICE)})
    return got.to_host(lambda t: t.cpu()).decode(), full_stats(tensors, algorithm="host", **kw).decode()


def _shaped_tensors(gen):
    a = torch.randn(6, 5, 4, generator=gen)
    a[1] = 0            # a zero row
    a[:, :, 2] = 0      # a zero feature
    a[3, 2, 1] = math.nan
    b = torch.randn(7, 9, generator=gen) * 1e-6
    b[:, 3] = 0         # a zero column
    return [a, b, torch.zeros(3, 3), torch.randn(11, generator=gen), torch.zeros(0, 4),
            torch.randn(4, 6, generator=gen).t()]  # non-contiguous: copied first


@pytest.mark.parametrize("lines", ["rows", "features"])
@pytest.mark.parametrize("geometry", [(-56, 64), (-20, 10), (-140, 300), (100, 8)],
                         ids=["default", "narrow", "beyond-float32", "above-everything"])
@pytest.mark.parametrize("per_tensor", [True, False])
def test_zero_lines_and_histogram_geometries_equal_the_host_algorithm(lines, geometry, per_tensor):
    """Zero rows, columns and features, NaN as nonzero, empty and 1-D tensors; histograms whose
    bins start below, inside and above float32's binades (bins outside them stay empty)."""
    gen = torch.Generator().manual_seed(1)
    tensors = _shaped_tensors(gen)
    min_exp, bins = geometry
    kw = dict(inv_scale=torch.tensor(2.0**-7), subnormal_below=FLOAT16.smallest_normal, per_tensor=per_tensor,
              lines=lines, hist_min_exp=min_exp, hist_bins=bins)
    _assert_same(*_triton_and_host(tensors, **kw), f"{lines} {geometry} {per_tensor}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lines", ["rows", "features"])
def test_zero_lines_across_tiles_with_and_without_zeros(lines, dtype, monkeypatch):
    """A tile with fewer zeros than a row (a column) of it has marks all its rows (columns) without
    reading them again; otherwise it reads its blocks again. Tensors of several tiles: a zero row
    inside one tile, a column zero in one tile's rows only (not a zero line: other tiles mark it),
    a true zero column through every tile, a dense tensor, a wide one (three column blocks a tile)
    with a zero row, a zero column and scattered zeros, and one whose only zeros are a row and a
    column: the zeros outside the zero row are exactly what a zero column takes."""
    from ampdoctor.stats import full_triton

    monkeypatch.setattr(full_triton, "MIN_TILE", 1024)  # 24 rows of 40 a tile: several tiles per tensor
    full_triton._plan.cache_clear()
    gen = torch.Generator().manual_seed(3)
    zero_row = torch.randn(70, 40, generator=gen)
    zero_row[30] = 0
    partly_zero_column = torch.randn(70, 40, generator=gen)
    partly_zero_column[:20, 7] = 0
    zero_column = torch.randn(70, 40, generator=gen)
    zero_column[:, 11] = 0
    dense = torch.randn(70, 2, 20, generator=gen)
    wide = torch.randn(40, 300, generator=gen)
    wide[torch.rand(40, 300, generator=gen) < 0.01] = 0  # scattered: fewer than a row's, more than a column's
    wide[13] = 0
    wide[:, 257] = 0
    row_and_column = torch.randn(70, 40, generator=gen)  # the counting bound exactly: no zero but these
    row_and_column[30] = 0
    row_and_column[:, 5] = 0
    tensors = [t.to(dtype) for t in (zero_row, partly_zero_column, zero_column, dense, wide, row_and_column)]
    try:
        for per_tensor in (True, False):
            kw = dict(inv_scale=None, subnormal_below=FLOAT16.smallest_normal, per_tensor=per_tensor, lines=lines)
            decoded, expected = _triton_and_host(tensors, **kw)
            plan = full_triton._plan(tuple(t.shape for t in tensors), per_tensor, lines)
            assert plan.n_tiles >= 4 * 3 + 5 + 3, plan.n_tiles
            _assert_same(decoded, expected, f"{lines} {per_tensor}", l2_rtol=1e-5)  # 12,000 elements a tensor
            if per_tensor:  # the truth, counted here: rows x columns of each tensor's 2-D view
                views = [t.reshape(t.shape[0], -1) if lines == "rows" else t.reshape(-1, t.shape[-1])
                         for t in tensors]
                truth = [int(((v == 0).all(1)[:, None] | (v == 0).all(0)[None, :]).sum()) for v in views]
                assert truth[:3] == [40, 0, 70] and truth[4] == 300 + 40 - 1 and truth[5] == 40 + 70 - 1
                np.testing.assert_array_equal(decoded.n_zero_lines, truth)
    finally:
        full_triton._plan.cache_clear()


@pytest.mark.parametrize("lines", ["rows", "features"])
def test_tiles_of_several_row_and_column_blocks(lines):
    """Tiles of 48 rows x 300 columns (6 row blocks x 3 column blocks, walked row-major with the
    block's row and column carried by hand): every statistic and zero line as the host algorithm
    has them, alone and together with another tensor."""
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(100, 300, generator=gen) * 1e-4
    a[torch.rand(100, 300, generator=gen) < 0.3] = 0  # enough zeros to read the tiles again
    a[61] = 0
    a[:, 129] = 0
    a[7, 255] = math.nan
    a[99, 299] = math.inf
    b = torch.randn(30, 200, generator=gen)
    for tensors in ([a], [a, b]):
        kw = dict(inv_scale=torch.tensor(2.0**-3), subnormal_below=FLOAT16.smallest_normal, per_tensor=True,
                  lines=lines)
        _assert_same(*_triton_and_host(tensors, **kw), f"{lines} {len(tensors)}", l2_rtol=1e-5)


def test_partial_buffers_are_reused_by_calls_of_the_same_shape_and_bounded():
    """The tiles' partial results are kept per shape (a module-sampled step repeats a few shapes
    hundreds of times): a second call of the same shape on other data gets its own results, not
    the first call's; at most PARTIALS_KEPT sets are kept, and none for a call of many tiles."""
    from ampdoctor.stats import full_triton

    gen = torch.Generator().manual_seed(7)
    kw = dict(inv_scale=None, subnormal_below=FLOAT16.smallest_normal, lines="features")
    first, second = torch.randn(20, 30, generator=gen), torch.randn(20, 30, generator=gen) * 1e-3
    second[3] = 0
    for t in (first, second):
        _assert_same(*_triton_and_host([t], **kw))
    kept = [k for k in full_triton._PARTIALS if k[3] == 1]
    assert kept, "a one-tile call's buffers are kept"
    for n in range(full_triton.PARTIALS_KEPT + 3):  # more shapes than are kept
        full_stats([torch.randn(3 + n, 5, generator=gen).to(DEVICE)], algorithm="triton", **kw)
    assert len(full_triton._PARTIALS) <= full_triton.PARTIALS_KEPT
    assert all(k[3] <= full_triton.PARTIALS_MAX_TILES for k in full_triton._PARTIALS)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_every_dtype_and_no_scale(dtype):
    gen = torch.Generator().manual_seed(2)
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, 6e-5, 3e-8, 65504.0, -2.0])
    tensors = [t.to(dtype) for t in (torch.randn(3000, generator=gen) * 1e-4, special, torch.randn(5, 7, generator=gen))]
    fmt = BFLOAT16 if dtype == torch.bfloat16 else FLOAT16
    for inv in (None, torch.tensor(2.0**-12)):
        kw = dict(inv_scale=inv, subnormal_below=fmt.smallest_normal)
        _assert_same(*_triton_and_host(tensors, **kw), f"{dtype} {inv}")


def test_host_side_ops_do_not_grow_with_the_tensors():
    """The kernels are not torch ops: what the host dispatches per call (allocations, the table's
    copy, the memset) is the same for 10 or 200 tensors."""
    from ampdoctor.stats import full_triton

    class Stub:  # a kernel that is not run: the interpreter copies its arguments with torch ops
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    gen = torch.Generator().manual_seed(0)
    totals = []
    for n in (10, 200):
        tensors = [(torch.randn(3, 5, generator=gen) * 1e-3).to(DEVICE) for _ in range(n)]
        inv = torch.tensor(2.0**-10, device=DEVICE)
        with OpCounter() as counter, pytest.MonkeyPatch.context() as patch:
            if DEVICE == "cpu":
                for name in ("_tile_kernel", "_slot_kernel"):
                    patch.setattr(full_triton, name, Stub())
            full_stats(tensors, inv_scale=inv, subnormal_below=FLOAT16.smallest_normal, algorithm="triton")
        totals.append(counter.launches - counter.ops["empty"])  # allocations launch nothing
        with OpCounter() as counter, pytest.MonkeyPatch.context() as patch:  # a second call of these shapes
            if DEVICE == "cpu":
                for name in ("_tile_kernel", "_slot_kernel"):
                    patch.setattr(full_triton, name, Stub())
            full_stats(tensors, inv_scale=inv, subnormal_below=FLOAT16.smallest_normal, algorithm="triton")
        # One allocation a call (the packed results and the marks; the partial buffers are kept),
        # on a GPU a second for the addresses' copy.
        assert counter.ops["empty"] + counter.ops["zeros"] <= 2, counter.ops
    # the memset, and on a GPU the addresses' copy (the table is copied once)
    assert totals[0] == totals[1] and totals[0] <= 2, totals


def test_results_are_packed_and_a_step_copies_each_devices_at_once():
    """A call's five results lie in one byte buffer; :func:`stats_to_host` copies the packed
    results of many calls with one copy (after one ``cat``), the others as before, a repeated
    object once; and each decodes to what it decodes to copied alone."""
    from ampdoctor.stats import FullStats, light_stats, stats_to_host

    gen = torch.Generator().manual_seed(3)
    kw = dict(inv_scale=torch.tensor(2.0**-4, device=DEVICE), subnormal_below=FLOAT16.smallest_normal)
    tensors = [torch.randn(5, 7, generator=gen), torch.randn(40, generator=gen) * 1e-5, torch.randn(2, 3, 4, generator=gen)]
    tensors[0][2] = 0
    packed = [full_stats([t.to(DEVICE)], algorithm="triton", **kw) for t in tensors]
    packed.append(full_stats([t.to(DEVICE) for t in tensors[:2]], algorithm="triton", per_tensor=False, **kw))
    assert all(s.packed is not None and s.counts is None and s.packed.dtype == torch.uint8 for s in packed)
    host_one = full_stats([tensors[0]], algorithm="host", **{**kw, "inv_scale": kw["inv_scale"].cpu()})
    light = light_stats([tensors[1]], inv_scale=None)
    items = [packed[0], packed[1], packed[0], host_one, packed[2], light, packed[3]]

    copied = []

    def copy(t):
        copied.append(tuple(t.shape))
        return t.cpu().clone()

    out = stats_to_host(items, copy)
    n_packed = sum(s.packed.numel() for s in packed)
    assert sorted(copied) == sorted([(n_packed,)] + [tuple(t.shape) for t in (
        host_one.counts, host_one.amax, host_one.amin_code, host_one.sumsq, host_one.line_zeros, light.peaks, light.norms)])
    assert out[2] is out[0]
    for got, item in zip(out, items):
        if isinstance(item, FullStats):
            _assert_same(got.decode(), item.to_host(lambda t: t.cpu()).decode())
    for got, t in zip((out[0], out[1], out[4]), tensors):  # and what the host algorithm finds
        _assert_same(got.decode(), full_stats([t], algorithm="host", **{**kw, "inv_scale": kw["inv_scale"].cpu()}).decode())
    np.testing.assert_array_equal(out[5].decode().amax, light.to_host(lambda t: t.cpu()).decode().amax)
    assert stats_to_host([packed[1]], copy)[0].packed.numel() == packed[1].packed.numel()  # alone: no cat


def test_a_failing_triton_falls_back_to_the_torch_algorithm_with_one_warning(monkeypatch):
    """A Triton too old or broken to compile the kernels: the torch algorithm computes the same
    numbers, one warning says so, and recording goes on."""
    from ampdoctor.stats import full_triton

    def broken(*args, **kwargs):
        raise RuntimeError("PTX assembly failed\nmore lines")

    monkeypatch.setattr(full_triton, "triton_full_stats", broken)
    monkeypatch.setattr(full_module, "_TRITON_FAILED", [])
    tensors = [torch.randn(100), torch.randn(4, 5)]
    kw = dict(inv_scale=torch.tensor(2.0**-10), subnormal_below=FLOAT16.smallest_normal)
    with pytest.warns(RuntimeWarning, match="Triton statistics kernels failed here .RuntimeError: PTX assembly failed.; "
                                            "using the slower torch algorithm"):
        first = full_stats(tensors, algorithm="triton", **kw).decode()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = full_stats(tensors, algorithm="triton", **kw).decode()
    _assert_same(first, full_stats(tensors, algorithm="accelerator", **kw).decode())
    _assert_same(second, first)


def test_cuda_chooses_triton_only_where_it_runs(monkeypatch):
    monkeypatch.setattr(algorithms_module, "triton_available", lambda: True)
    assert algorithm_for(torch.device("cuda"), full=True) == "triton"
    assert algorithm_for(torch.device("cuda")) == "accelerator"  # the light statistics
    assert algorithm_for(torch.device("cpu"), full=True) == "host"
    assert algorithm_for(torch.device("meta"), full=True) == "accelerator"
    monkeypatch.setattr(algorithms_module, "triton_available", lambda: False)
    assert algorithm_for(torch.device("cuda"), full=True) == "accelerator"


def test_kernels_compile_for_hopper():
    """What the interpreter lets pass (a plain global in a kernel, a type the compiler refuses)
    fails here: the kernels compiled for sm_90 with the ptxas that Triton ships, no GPU needed,
    in a process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_triton_kernels.py"), "--quick"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 8 and all(line.startswith("ok") and "no global atomics" in line for line in lines), lines
    assert sum(line.startswith("ok   block") for line in lines) == 2  # (the block statistics' kernel, issue 42)


def test_a_collapsed_scale_is_clamped_in_the_kernel():
    """A scale of 0 gives an inverse of inf; 0 * inf would make every zero NaN. The torch
    algorithms clamp it before the pass; the kernel clamps it as it loads it."""
    tensors = [torch.tensor([0.0, 1e-3, -2.0, 0.0]), torch.tensor([0.0])]
    kw = dict(inv_scale=torch.tensor(math.inf), subnormal_below=FLOAT16.smallest_normal)
    decoded, expected = _triton_and_host(tensors, **kw)
    _assert_same(decoded, expected)
    assert decoded.n_nan.sum() == 0 and decoded.n_zero.tolist() == [2, 1]


def test_a_module_sampled_step_with_the_triton_algorithm_copies_its_statistics_at_once(tmp_path, monkeypatch):
    """Whole runs at ``level="full"``, every step module-sampled, with the triton algorithm
    (interpreted, on CPU tensors) and with the host one: the same rows; and the triton run copies
    a step's module statistics, whatever their number, with one copy."""
    import ampdoctor
    from ampdoctor.record import recorder as recorder_module

    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
    frames, copies = {}, {}
    for algorithm in ("host", "triton"):
        monkeypatch.setattr(algorithms_module, "algorithm_for", lambda device, full=False, a=algorithm: a if full else "host")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        path = tmp_path / f"{algorithm}.parquet"
        counted = copies[algorithm] = []
        with ampdoctor.GradScaler("cpu", model=model, path=path, level="full", every=1, module_every=1,
                                  init_scale=2.0**6) as scaler:
            real = scaler.recorder._copies.to_host
            monkeypatch.setattr(scaler.recorder._copies, "to_host", lambda t: counted.append(t.dtype) or real(t))
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
        frame = ampdoctor.load(path)
        frames[algorithm] = frame[frame.kind.isin(["output", "grad_output"])].sort_values(
            ["step", "kind", "order"]).reset_index(drop=True)
    host, tri = frames["host"], frames["triton"]
    assert len(tri) == 2 * 2 * 5 and (tri.n_zero > 0).any()  # (the ReLUs' zeros)
    stats = ["step", "name", "numel", "amax", "amin", "n_zero", "n_subnormal", "n_nan", "n_inf", "n_zero_lines"]
    assert tri[stats].equals(host[stats])
    np.testing.assert_allclose(tri.l2, host.l2, rtol=1e-6)
    assert all(list(a) == list(b) for a, b in zip(tri["hist"], host["hist"]))
    # Per step: the scalars, the gradients' packed statistics and the taps' in one uint8 copy
    # (host: five copies per tap, and per gradient group).
    assert copies["triton"].count(torch.uint8) == 2, copies["triton"]
    assert len(copies["host"]) - len(copies["triton"]) >= 2 * (5 * 2 * 5 - 1)
