"""CUDA: bit-for-bit training and no extra host-device sync (marker ``cuda``; skipped without a GPU)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import ampdoctor
from ampdoctor.float_formats import FLOAT16
from ampdoctor.analysis.origins import find_origins
from ampdoctor.read.run import read_run
from ampdoctor.record.scaler import _Recording  # (ampdoctor.record.scaler is an attribute only once imported)
from ampdoctor.stats import full_stats, light_stats
from ampdoctor.record.transfer import HostCopies
from models import MLP, DeepNet, batches, mse

pytestmark = pytest.mark.cuda


def _train(make_scaler, optimizer_kw, steps=12, inject=None):
    torch.manual_seed(0)
    model = MLP().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **optimizer_kw)
    scaler = make_scaler(model)
    skipped = []
    for i, (x, y) in enumerate(batches(steps)):
        scaler.scale(mse(model, x.cuda(), y.cuda(), device="cuda")).backward()
        if inject and i in inject:
            model.fc1.weight.grad[0, 0] = inject[i]
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        skipped.append(sum(v.item() for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()) > 0)
        scaler.update()
        opt.zero_grad()
    if isinstance(scaler, _Recording):
        scaler.close()
    return [p.detach().cpu() for p in model.parameters()], scaler.get_scale(), scaler._get_growth_tracker(), skipped


@pytest.mark.parametrize("optimizer_kw", [{}, {"foreach": True}, {"fused": True}], ids=["default", "foreach", "fused"])
@pytest.mark.parametrize("level", ["params", "full"])
def test_bit_for_bit_on_cuda(optimizer_kw, level, run_path):
    kw = dict(init_scale=2.0**20, growth_interval=3)
    inject = {3: float("inf"), 6: float("nan")}
    expected = _train(lambda m: torch.amp.GradScaler("cuda", **kw), optimizer_kw, inject=inject)
    got = _train(lambda m: ampdoctor.GradScaler("cuda", model=m, path=run_path, level=level, every=2, **kw),
                 optimizer_kw, inject=inject)
    for a, b in zip(expected[0], got[0]):
        assert torch.equal(a, b)
    assert expected[1:] == got[1:]
    steps = read_run(run_path).frame.query("kind == 'step'").sort_values("step")
    assert steps.skipped.tolist() == got[3]


def _syncs_per_step(make_scaler, steps=6, warmup=3):
    """Host-device syncs counted by CUDA's sync debug mode over steady-state steps."""
    torch.manual_seed(0)
    model = MLP().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = make_scaler(model)
    data = [(x.cuda(), y.cuda()) for x, y in batches(warmup + steps)]
    counts = []
    for i, (x, y) in enumerate(data):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                scaler.scale(mse(model, x, y, device="cuda")).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if i >= warmup:
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
    if isinstance(scaler, _Recording):
        scaler.close()
    return counts


def test_no_extra_sync_per_step(tmp_path):
    plain = _syncs_per_step(lambda m: torch.amp.GradScaler("cuda"))
    for level in ("steps", "params", "full"):
        recorded = _syncs_per_step(lambda m: ampdoctor.GradScaler(
            "cuda", model=m, path=tmp_path / f"{level}.parquet", level=level, every=2))
        assert recorded == plain, (level, recorded, plain)
    assert all(c >= 1 for c in plain)  # torch's own found_inf read is seen, so the counter works


def test_overflow_origin_on_cuda(run_path):
    """The CPU origin test on the GPU: anomalies are seen one step late there (event.query)."""
    torch.manual_seed(0)
    model = DeepNet().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    boom = model.blocks[1].inner.boom
    with ampdoctor.GradScaler("cuda", model=model, path=run_path, level="full", every=100,
                              init_scale=2.0**10) as scaler:
        for i, (x, y) in enumerate(batches(8)):
            boom.factor = 1e8 if i == 5 else 1.0
            scaler.scale(mse(model, x.cuda(), y.cuda(), device="cuda")).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    (o,) = find_origins(ampdoctor.load(run_path))
    assert o.step == 5 and o.detail == "light" and o.overflow.name == "blocks.1.inner.boom"


def _mixed_tensors(dtype):
    """A tensor of more than 64 Ki elements beside small ones (CUDA's _foreach_max before torch
    2.11 got the small ones wrong for negative values), zeros, and non-finite values."""
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([math.inf, math.nan, 1e-30, -2.0, 0.0, 1e-40, -3e-39])  # float32 subnormals too
    return [t.to(dtype) for t in (torch.randn(70_000, generator=gen), torch.randn(100, generator=gen) * 1e-3,
                                  torch.zeros(5), special, torch.zeros(0))]


@pytest.mark.parametrize("algorithm", [None, "accelerator"])  # None: the default, triton where it runs
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_tensor", [True, False])
def test_accelerator_statistics_on_cuda_equal_the_host_ones(dtype, per_tensor, algorithm):
    """Issue 17: the accelerator algorithms on a real GPU, also under deterministic algorithms
    (scatter_reduce raised there), against the host algorithm on the same values."""
    tensors = _mixed_tensors(dtype)
    inv = torch.tensor(2.0**-10)
    kw = dict(subnormal_below=FLOAT16.smallest_normal, per_tensor=per_tensor)
    host = full_stats(tensors, inv_scale=inv, algorithm="host", **kw).decode()
    for deterministic in (False, True):
        torch.use_deterministic_algorithms(deterministic)
        try:
            raw = full_stats([t.cuda() for t in tensors], inv_scale=inv.cuda(), algorithm=algorithm, **kw)
            light = light_stats([t.cuda() for t in tensors], inv_scale=inv.cuda())
        finally:
            torch.use_deterministic_algorithms(False)
        got = raw.to_host(lambda t: t.cpu()).decode()
        for field in ("amax", "amin", "n_zero", "n_subnormal", "n_nan", "n_inf", "hist", "n_zero_lines"):
            np.testing.assert_array_equal(getattr(got, field), getattr(host, field), err_msg=field)
        np.testing.assert_allclose(got.l2, host.l2, rtol=1e-5)
        expected = light_stats(tensors, inv_scale=inv, algorithm="host")
        np.testing.assert_array_equal(light.peaks.cpu().numpy(), expected.peaks.numpy())
        np.testing.assert_allclose(light.norms.cpu().numpy(), expected.norms.numpy(), rtol=1e-5)


def test_fences_on_cuda_cover_every_source_device():
    """Copies from every GPU land before their fence passes; events are blocking ones."""
    copies = HostCopies()
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    sources = [torch.full((1 << 20,), float(i + 1), device=d) for i, d in enumerate(devices)]
    hosts = [copies.to_host(t) for t in sources]
    fence = copies.seal()
    assert len(fence._events) == len(devices)
    fence.synchronize()
    assert all(h.is_pinned() and bool((h == i + 1).all()) for i, h in enumerate(hosts))


def test_measured_underflow_on_cuda(run_path):
    """The float32 shadow of the backward on CUDA (autograd's device thread runs under the mode):
    every parameter gradient measured, within tolerance of an fp32 reference backward counted
    here, and training bit for bit torch's."""
    import copy

    torch.manual_seed(0)
    model = DeepNet().cuda()
    reference = copy.deepcopy(model)
    x, y = (t.cuda() * s for t, s in zip(batches(1, batch=8)[0], (1e-3, 1.0)))
    with ampdoctor.GradScaler("cuda", model=model, path=run_path, level="full", every=1, init_scale=1.0) as scaler:
        scaler.scale(mse(model, x, y, device="cuda")).backward()
        amp = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        scaler.step(torch.optim.SGD(model.parameters(), lr=0.0))
        scaler.update()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    rows = read_run(run_path).frame.query("kind == 'param_grad'").set_index("name")
    for name, p in reference.named_parameters():
        truth = int(((amp[name] == 0) & (p.grad != 0)).sum())
        assert abs(rows.loc[name, "n_underflow"] - truth) <= max(0.005 * p.numel(), 0.25 * truth), name
    assert rows.n_underflow.sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_block_statistics_kernel_on_cuda_equals_the_torch_path(dtype):
    """The Triton kernel of the block statistics (issue 42) on a real GPU gives the torch path's
    counts (on the CPU) bit for bit, and the sums of squares to 1e-6: what the interpreter checks on
    every CI run, here with the hardware's own conversions and divisions."""
    from ampdoctor.run_file.block_bins import unpack
    from ampdoctor.stats.block_stats import packed_block_stats

    torch.manual_seed(0)
    cases = [torch.randn(512, 1000) * torch.exp(torch.randn(512, 1000) * 3),
             torch.cat([torch.randn(64, 32) * 2.0 ** -124, torch.randn(64, 32)], dim=1),
             torch.zeros(8, 48), torch.randn(3000)]
    for x in cases:
        x = x.to(dtype)
        for inv in (None, torch.tensor(2.0 ** -10)):
            cpu = unpack(packed_block_stats(x, inv, algorithm="torch").numpy())
            gpu = unpack(packed_block_stats(x.cuda(), None if inv is None else inv.cuda(),
                                            algorithm="triton").cpu().numpy())
            for name in cpu:
                if name == "measured":
                    np.testing.assert_array_equal(cpu[name][:, :2], gpu[name][:, :2])
                    np.testing.assert_allclose(cpu[name][:, 2:], gpu[name][:, 2:], rtol=1e-6, atol=1e-30)
                else:
                    np.testing.assert_array_equal(cpu[name], gpu[name], err_msg=name)
