"""PyTorch's own GradScaler tests, ported to pytest and run in three modes.

The tests below re-implement, on the CPU, what PyTorch checks in ``test/test_torch.py``
(``TestTorchDeviceType.test_grad_scaling_*``, ``test_grad_scale_will_not_overflow``,
``test_grad_scaler_*``, ``test_params_invalidated_with_grads_invalidated_between_unscale_and_step``
and ``test_pickle_gradscaler``, all device-generic) and in ``test/test_cuda.py``
(``test_grad_scaling_autocast_fused_optimizers``, ``test_grad_scaling_scale``). Each docstring names
the upstream test it corresponds to. The code is written for this repository; the checks and their
tolerances are upstream's.

Every test runs with three scalers (the ``mode`` fixture):

* ``plain``: ``torch.amp.GradScaler("cpu", ...)``, the reference;
* ``ampdoctor``: ``ampdoctor.GradScaler("cpu", ..., path=..., model=...)``;
* ``wrapped``: ``ampdoctor.wrap(torch.amp.GradScaler("cpu", ...), path=..., model=...)``.

Acceptance: the same pass/skip count in the three modes. A recording scaler that stops recording
fails its test (its warning is made an error below). (The port found one: recording stopped at the
first float64 gradient; fixed in ``stats.light._float32_norms``.) Recording
scalers are closed (a wrapped one unwrapped) when the test ends. Models are tiny (8x8 linears, four
iterations), as upstream's.
"""

from __future__ import annotations

import contextlib
import copy
import math
import pickle
import warnings
from itertools import chain

import pytest
import torch
from torch import nn
from torch.amp.grad_scaler import _refresh_per_optimizer_state

import ampdoctor

MODES = ("plain", "ampdoctor", "wrapped")
DEVICE = "cpu"

# A recording scaler that gives up recording ("ampdoctor: recording to PATH stopped (...); training
# continues unaffected") has not run the test as a recording scaler: make that warning an error, so
# that the test fails where recording broke. (The "." stands for the colon, which the filter syntax
# reserves.)
pytestmark = pytest.mark.filterwarnings("error:ampdoctor. recording to .* stopped:RuntimeWarning")


# -- scalers in the three modes ------------------------------------------------------------------

def build_scaler(mode: str, path, *, model: nn.Module | None = None, **kwargs) -> torch.amp.GradScaler:
    """A scaler on the CPU in ``mode``; ``kwargs`` are torch's constructor arguments."""
    if mode == "plain":
        return torch.amp.GradScaler(DEVICE, **kwargs)
    if mode == "ampdoctor":
        scaler = ampdoctor.GradScaler(DEVICE, **kwargs, model=model, path=path)
    elif mode == "wrapped":
        scaler = ampdoctor.wrap(torch.amp.GradScaler(DEVICE, **kwargs), model=model, path=path)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    assert scaler.recorder is not None, "a recording scaler must record"
    return scaler


def close_scaler(mode: str, scaler: torch.amp.GradScaler) -> None:
    if mode == "ampdoctor":
        scaler.close()
    elif mode == "wrapped":
        ampdoctor.unwrap(scaler)
        assert type(scaler) is torch.amp.GradScaler


@pytest.fixture(params=MODES)
def mode(request) -> str:
    return request.param


class ScalerFactory:
    """``make_scaler(**kwargs)``: a scaler in the test's mode (``mode=`` picks another), each with
    its own run directory under ``tmp_path``; all are closed when the test ends."""

    def __init__(self, mode: str, tmp_path) -> None:
        self.mode = mode
        self.tmp_path = tmp_path
        self.made: list[tuple[str, torch.amp.GradScaler]] = []

    def __call__(self, *, mode: str | None = None, **kwargs) -> torch.amp.GradScaler:
        mode = mode or self.mode
        name = "run" if not self.made else f"run-{len(self.made)}"
        scaler = build_scaler(mode, self.tmp_path / name, **kwargs)
        self.made.append((mode, scaler))
        return scaler

    def close_all(self) -> None:
        made, self.made = self.made, []
        for mode, scaler in made:
            close_scaler(mode, scaler)


@pytest.fixture
def make_scaler(mode, tmp_path):
    factory = ScalerFactory(mode, tmp_path)
    yield factory
    factory.close_all()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# -- shared helpers (upstream: _create_scaling_models_optimizers / _create_scaling_case /
#    TestTorchDeviceType._run_scaling_case) ---------------------------------------------------------

def scaling_models(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """Two identical two-layer models with an optimizer each: a control trained without the scaling
    API and one trained with it."""
    control = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    scaling = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    scaling.load_state_dict(control.state_dict())
    kwargs = {"lr": 1.0, **(optimizer_kwargs or {})}
    return (control, scaling, optimizer_ctor(control.parameters(), **kwargs),
            optimizer_ctor(scaling.parameters(), **kwargs))


def scaling_case(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """scaling_models() plus four (input, target) batches, an MSE loss and the iteration to skip."""
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    return (*scaling_models(optimizer_ctor, optimizer_kwargs), data, nn.MSELoss(), 2)


def assert_close(actual, expected, **tolerances) -> None:
    """Upstream's TestCase.assertEqual for what a model or optimizer holds (tensors, None, numbers)."""
    if expected is None or actual is None:
        assert actual is None and expected is None, (actual, expected)
    elif isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        torch.testing.assert_close(torch.as_tensor(actual), torch.as_tensor(expected),
                                   equal_nan=True, check_dtype=False, **tolerances)
    else:
        assert actual == pytest.approx(expected), (actual, expected)


def run_scaling_case(make_scaler, run, unskipped, skipped, atol=1e-7, optimizer_ctor=torch.optim.SGD,
                     optimizer_kwargs=None):
    """Trains the control model without the scaling API and the other one with it, for an enabled
    and a disabled scaler, then compares the scale (grown ``unskipped`` times, backed off ``skipped``
    times), the gradients, the optimizer states and the parameters."""
    for enabled in (True, False):
        control, scaling, opt_control, opt_scaling, data, loss_fn, skip_iter = scaling_case(
            optimizer_ctor, optimizer_kwargs)
        # A modest initial scale and a large growth factor magnify growth-handling mistakes.
        scaler = make_scaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1,
                             model=scaling)

        run(data, control, opt_control, scaler, loss_fn, skip_iter, False)
        returned = run(data, scaling, opt_scaling, scaler, loss_fn, skip_iter, True)
        scaler = returned if returned is not None else scaler  # run() may hand back another scaler

        if enabled:
            growth = scaler.get_growth_factor() ** unskipped if unskipped > 0 else 1.0
            backoff = scaler.get_backoff_factor() ** skipped if skipped > 0 else 1.0
            assert scaler.get_scale() == 128.0 * growth * backoff
        else:
            assert scaler.get_scale() == 1.0

        for c, s in zip(control.parameters(), scaling.parameters()):
            assert_close(s.grad, c.grad, atol=atol, rtol=1e-5)
            c_state, s_state = opt_control.state[c], opt_scaling.state[s]
            for key in c_state:
                assert_close(s_state[key], c_state[key], atol=atol, rtol=1e-5, msg=key)
            assert_close(s, c, atol=atol, rtol=1e-5)


def fused_supported(optimizer_ctor) -> str | None:
    """None when ``optimizer_ctor(fused=True)`` steps on a CPU float32 parameter, else the reason."""
    param = nn.Parameter(torch.zeros(2))
    param.grad = torch.ones(2)
    try:
        optimizer_ctor([param], lr=0.1, fused=True).step()
    except (RuntimeError, ValueError, TypeError) as exc:
        return f"fused {optimizer_ctor.__name__} is not supported on the CPU by this torch build: {exc}"
    return None


# -- unscaling and scale updates -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float, torch.double])
def test_grad_scaling_unscale(make_scaler, dtype):
    """Upstream: test_torch.py ``test_grad_scaling_unscale``: the foreach check-and-unscale kernel
    on dense, transposed and sliced gradients, with and without an inf or a NaN, then the scaler's
    ``_unscale_grads_`` over gradients of mixed dtypes and layouts, with an inf injected into each."""
    inv_scale = torch.full((1,), 0.25)
    found_inf = torch.full((1,), 0.0)
    size = 20
    g = torch.full((size, size), 4.0, dtype=dtype)
    ginf = g.clone()
    ginf[2, 2] = float("inf")
    gnan = g.clone()
    gnan[2, 2] = float("nan")

    # Dense (contiguous or transposed) grads take the multi-tensor path, the slices the fallback.
    cases = [
        ([g.clone(), g.clone()], False),
        ([g.clone(), g.clone().t()], False),
        ([g.clone(), g.clone()[:, :5]], False),
        ([g.clone()[:, :5], g.clone()[:, :5]], False),
        ([g.clone(), ginf.clone()], True),
        ([g.clone(), gnan.clone()], True),
        ([g.clone(), ginf.clone()[:, :5]], True),
        ([g.clone(), gnan.clone()[:, :5]], True),
        ([ginf.clone(), g.clone()[:, :5]], True),
        ([ginf.clone()[:, :5], g.clone()[:, :5]], True),
    ]
    for grads, has_inf in cases:
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        if has_inf:
            assert found_inf.item() == 1.0
        else:
            assert found_inf.item() == 0.0
            for grad in grads:
                torch.testing.assert_close(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)

    # Mismatched dtypes in one raw call fall back to the per-tensor kernel.
    grads = [g.clone(), g.to(torch.float16)]
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    for grad in grads:
        torch.testing.assert_close(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)

    def perfect_storm_grads(inject_inf):
        grads = [g.clone(), g.clone()[:, :5], g.to(torch.float16), g.to(torch.float16)]
        if inject_inf >= 0:
            grads[inject_inf][2, 2] = float("inf")
        return grads

    scaler = make_scaler()
    params = [torch.empty_like(t) for t in perfect_storm_grads(-1)]
    optimizer = torch.optim.SGD(params, lr=1.0)
    for inject_inf in range(-1, len(params)):
        found_inf = torch.full((1,), 0.0)
        grads = perfect_storm_grads(inject_inf)
        for p, grad in zip(params, grads):
            p.grad = grad
        per_device = scaler._unscale_grads_(optimizer, inv_scale, found_inf, True)
        if inject_inf < 0:
            assert sum(v.item() for v in per_device.values()) == 0
            for grad in grads:
                torch.testing.assert_close(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)
        else:
            assert sum(v.item() for v in per_device.values()) == 1


@pytest.mark.parametrize("dtypes", [(torch.float,), (torch.double,), (torch.float, torch.double)],
                         ids=["float32", "float64", "float32+float64"])
def test_grad_scaling_unscale_public_api(make_scaler, mode, dtypes):
    """Upstream: test_torch.py ``test_grad_scaling_unscale`` (its "perfect storm" half), driven
    through the public ``scale``/``unscale_``/``step``/``update`` so that a recording scaler
    observes the dense and sliced gradients of one or two dtypes: the inf is found wherever it is
    injected, clean gradients are unscaled exactly, and the step is skipped and the scale backed
    off on an inf. (The public ``unscale_`` refuses fp16 gradients, which upstream's private call
    allows, so the second dtype is fp64 here; the refusal is checked at the end.)"""
    first, second = dtypes[0], dtypes[-1]
    g = torch.full((20, 20), 4.0)

    def perfect_storm_grads(inject_inf):
        grads = [g.to(dt, copy=True) for dt in (first, second)]
        grads = [grads[0], grads[0].clone()[:, :5], grads[1], grads[1].clone()[:, :5]]
        if inject_inf >= 0:
            grads[inject_inf][2, 2] = float("inf")
        return grads

    scaler = make_scaler(init_scale=4.0, growth_interval=1000)
    params = [nn.Parameter(torch.zeros_like(t)) for t in perfect_storm_grads(-1)]
    optimizer = torch.optim.SGD(params, lr=1.0)
    expected_scale = 4.0
    for inject_inf in range(-1, len(params)):
        scaler.scale(torch.ones(1))  # lazily creates the scale on the first iteration
        grads = perfect_storm_grads(inject_inf)
        for p, grad in zip(params, grads):
            p.grad = grad
        before = [p.detach().clone() for p in params]
        scaler.unscale_(optimizer)
        found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        assert sum(v.item() for v in found.values()) == (0 if inject_inf < 0 else 1)
        if inject_inf < 0:
            for grad in grads:
                torch.testing.assert_close(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)
        scaler.step(optimizer)
        scaler.update()
        if inject_inf < 0:
            for p, b in zip(params, before):
                torch.testing.assert_close(p.detach(), b - 1.0)
        else:
            expected_scale *= 0.5
            for p, b in zip(params, before):
                assert torch.equal(p.detach(), b)  # skipped step
        assert scaler.get_scale() == expected_scale

    half = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    half.grad = torch.ones(4, dtype=torch.float16)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(torch.optim.SGD([half], lr=1.0))


def test_grad_scaling_update_scale(make_scaler):
    """Upstream: test_torch.py ``test_grad_scaling_update_scale``: ``_amp_update_scale_`` grows the
    scale after ``growth_interval`` clean iterations and backs it off (resetting the tracker) on an
    inf. The same sequence is then run through the scaler's own ``update()``."""
    growth, backoff, growth_interval = 2.0, 0.25, 2
    scale = torch.full((1,), 4.0)
    growth_tracker = torch.full((1,), 0, dtype=torch.int32)
    found_inf = torch.full((1,), 0.0)

    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, growth_interval)
    assert growth_tracker.item() == 1 and scale.item() == 4.0
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, growth_interval)
    assert growth_tracker.item() == 0 and scale.item() == 8.0
    found_inf.fill_(1.0)
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, growth_interval)
    assert growth_tracker.item() == 0 and scale.item() == 2.0

    scaler = make_scaler(init_scale=4.0, growth_factor=growth, backoff_factor=backoff,
                         growth_interval=growth_interval)
    param = nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    for overflow, tracker, expected in ((False, 1, 4.0), (False, 0, 8.0), (True, 0, 2.0)):
        optimizer.zero_grad()
        weight = float("inf") if overflow else 1.0
        scaler.scale((param * weight).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        assert scaler._get_growth_tracker() == tracker
        assert scaler.get_scale() == expected


@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")
def test_grad_scaling_unscale_sparse(make_scaler):
    """Upstream: test_torch.py ``test_grad_scaling_unscale_sparse``: ``_unscale_grads_`` on sparse
    COO gradients (fp32 and fp16): exact unscaling, infs and NaNs found, and an uncoalesced fp16
    gradient whose coalesced sum would overflow reported as an overflow."""
    scaler = make_scaler()
    inv_scale = torch.full((1,), 0.25)
    found_inf = torch.empty((1,))
    cur = found_inf.device

    i = torch.tensor([[0, 1, 1], [2, 0, 2]], dtype=torch.int64)
    v = torch.tensor([16.0, 32.0, 64.0])
    s = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]))

    p = s.clone()
    assert p.is_sparse
    opt = torch.optim.SGD([p], lr=1.0)

    p.grad = s.clone()
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
    assert found_inf.item() == 0.0
    torch.testing.assert_close(p.grad.to_dense(), (s / 4).to_dense())

    for bad in (float("inf"), float("nan")):
        p.grad = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, bad]), torch.Size([2, 3]))
        found_inf.zero_()
        found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
        assert found_inf.item() == 1.0

    p = s.clone().half()
    assert p.is_sparse
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = s.clone().half()
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, True)[cur]
    assert found_inf.item() == 0.0
    torch.testing.assert_close(p.grad.to_dense(), (s.half() / 4).to_dense())

    # Uncoalesced: 64000 twice at one index fits in fp16, their sum does not.
    i = torch.tensor([[0, 1, 0], [2, 0, 2]])
    v = torch.tensor([64000.0, 32.0, 64000.0])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), dtype=torch.float16)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, True)[cur]
    assert found_inf.item() == 1.0


@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")
def test_grad_scaling_unscale_sparse_public_api(make_scaler):
    """Upstream: test_torch.py ``test_grad_scaling_unscale_sparse``, through the public
    ``unscale_``/``step``/``update`` so that a recording scaler observes sparse gradients: a clean
    sparse gradient is unscaled and applied, an inf in one is found and the step skipped."""
    scaler = make_scaler(init_scale=4.0)
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    s = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, 64.0]), torch.Size([2, 3]))
    p = s.clone()
    opt = torch.optim.SGD([p], lr=1.0)

    scaler.scale(torch.ones(1))
    p.grad = s.clone()
    scaler.unscale_(opt)
    torch.testing.assert_close(p.grad.to_dense(), (s / 4).to_dense())
    scaler.step(opt)
    scaler.update()
    torch.testing.assert_close(p.to_dense(), (s - s / 4).to_dense())

    before = p.detach().clone()
    scaler.scale(torch.ones(1))
    p.grad = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, float("inf")]), torch.Size([2, 3]))
    scaler.unscale_(opt)
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    assert sum(v.item() for v in found.values()) == 1
    scaler.step(opt)
    scaler.update()
    torch.testing.assert_close(p.to_dense(), before.to_dense())
    assert scaler.get_scale() == 2.0


def test_grad_scaling_scale(make_scaler):
    """Upstream: test_cuda.py ``test_grad_scaling_scale`` (single device here): ``scale()`` walks
    nested tuples and lists of tensors, multiplies each by the scale, and keeps the scale on the
    outputs' device."""
    scaler = make_scaler(init_scale=2.0)
    t = torch.full((1,), 4.0)
    outputs = (t.clone(), (t.clone(), t.clone()), [t.clone(), (t.clone(), t.clone())])
    outputs = scaler.scale(outputs)
    assert isinstance(outputs, tuple) and isinstance(outputs[1], tuple) and isinstance(outputs[2], list)
    flat = [outputs[0], outputs[1][0], outputs[1][1], outputs[2][0], outputs[2][1][0], outputs[2][1][1]]
    assert all(o.item() == 8.0 for o in flat)
    assert scaler._scale.device == t.device


# -- state_dict and pickling ---------------------------------------------------------------------

@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_grad_scaling_state_dict(make_scaler, lazy_init_scale):
    """Upstream: test_torch.py ``test_grad_scaling_state_dict``: ``load_state_dict`` overwrites the
    scale (whether or not its tensor exists yet), the factors, the interval and the tracker."""
    s0 = make_scaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = make_scaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    s1._init_growth_tracker = 7  # for load_state_dict to overwrite
    if lazy_init_scale:
        s1.scale(torch.full((1,), 4.0))
        assert isinstance(s1._scale, torch.Tensor)
        assert s1._scale.dtype == torch.float32 and s1._scale.device.type == DEVICE

    s1.load_state_dict(s0.state_dict())

    assert s1.get_scale() == 3.0
    assert s1.get_growth_factor() == 4.0
    assert s1.get_backoff_factor() == 0.5
    assert s1.get_growth_interval() == 2
    assert s1._init_growth_tracker == 0


TORCH_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


@pytest.mark.parametrize("source_mode", MODES)
def test_grad_scaling_state_dict_across_modes(make_scaler, source_mode):
    """Upstream: test_torch.py ``test_grad_scaling_state_dict``, with a state saved mid-run by a
    scaler of ``source_mode`` (non-default scale and growth tracker) loaded into one of the test's
    mode: torch's keys round-trip, and both scalers then evolve identically."""
    kwargs = dict(init_scale=2.0**10, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    params = [nn.Parameter(torch.ones(4)) for _ in range(2)]
    optimizers = [torch.optim.SGD([p], lr=0.1) for p in params]

    def iteration(scaler, k, overflow):
        optimizers[k].zero_grad()
        weight = float("inf") if overflow else 1.0
        scaler.scale((params[k] * weight).sum()).backward()
        scaler.step(optimizers[k])
        scaler.update()

    source = make_scaler(mode=source_mode, **kwargs)
    for overflow in (False, True, False, False):
        iteration(source, 0, overflow)
    state = source.state_dict()
    assert state["scale"] == 2.0**10 * 0.25 and state["_growth_tracker"] == 2  # mid-interval

    target = make_scaler(init_scale=1.0, growth_factor=3.0, backoff_factor=0.9, growth_interval=7)
    target.load_state_dict(copy.deepcopy(state))
    target_state = target.state_dict()
    for key in TORCH_STATE_KEYS:
        assert target_state[key] == state[key], key

    for overflow in (False, False, True, False):
        iteration(source, 0, overflow)
        iteration(target, 1, overflow)
        assert target.get_scale() == source.get_scale()
        assert target._get_growth_tracker() == source._get_growth_tracker()


@pytest.mark.parametrize("protocol", sorted({0, 2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL}))
@pytest.mark.parametrize("enabled", [True, False])
def test_pickle_gradscaler(make_scaler, mode, protocol, enabled):
    """Upstream: test_torch.py ``test_pickle_gradscaler``: a pickled scaler (fresh, or with its scale
    tensor lazily created) unpickles with the same enabled flag, scale, factors, interval and tracker,
    a working per-optimizer-state default, and a working ``scale()``. As ampdoctor documents, the copy
    does not record: an ``ampdoctor.GradScaler`` comes back as one without a recorder, a wrapped
    scaler as its plain class. (``enabled=False`` stands for upstream's "CUDA not available" case.)"""
    expected_class = ampdoctor.GradScaler if mode == "ampdoctor" else torch.amp.GradScaler
    for lazy_init_scale in (True, False):
        a = make_scaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2,
                        enabled=enabled)
        assert a.is_enabled() == enabled
        if lazy_init_scale:
            a.scale(torch.tensor([4.0]))
            if enabled:
                assert a._scale.device.type == DEVICE
        b = pickle.loads(pickle.dumps(a, protocol=protocol))
        assert type(b) is expected_class
        assert getattr(b, "recorder", None) is None
        assert b.is_enabled() == a.is_enabled()
        if a.is_enabled():
            assert b.get_scale() == 3.0
            assert b.get_growth_factor() == 4.0
            assert b.get_backoff_factor() == 0.5
            assert b.get_growth_interval() == 2
            assert b._init_growth_tracker == 0
            assert b._per_optimizer_states["fdsa"] == _refresh_per_optimizer_state()
            if lazy_init_scale:
                assert b.scale(torch.tensor([4.0])).item() == 12.0


# -- training loops compared with an unscaled reference ------------------------------------------

AUTOCAST_OPTIMIZERS = [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD]


@pytest.mark.parametrize("foreach, fused", [(None, None), (True, None), (None, True)])
@pytest.mark.parametrize("optimizer_ctor", AUTOCAST_OPTIMIZERS, ids=lambda c: c.__name__)
def test_grad_scaling_autocast(make_scaler, optimizer_ctor, foreach, fused):
    """Upstream: test_torch.py ``test_grad_scaling_autocast`` (SGD, Adam, AdamW; default, foreach
    and fused): fp16 autocast with the scaler against fp32 without it, atol 1e-3, with an inf
    injected at the skipped iteration, once as is and once pickling the scaler after every
    iteration. Upstream expects Adam and AdamW to miss the tolerance (its NOTE: "torch.optim.Adam is
    failing in spite of foreach and fused"), so it asserts an AssertionError for them; so do we."""
    if fused and (reason := fused_supported(optimizer_ctor)):
        pytest.skip(reason)
    try_pickle = False

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (inp, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast(device_type=DEVICE, dtype=torch.half, enabled=try_scaling_api):
                loss = loss_fn(model(inp), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    with torch.no_grad():
                        model[1].weight.grad.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                unscaled_step(loss, optimizer, scaler, i, skip_iter)
        return scaler

    kwargs = {"foreach": foreach, "fused": fused}
    expect_mismatch = optimizer_ctor in (torch.optim.Adam, torch.optim.AdamW)
    context = pytest.raises(AssertionError, match="not close") if expect_mismatch else contextlib.nullcontext()
    with context:
        run_scaling_case(make_scaler, run, unskipped=3, skipped=1, atol=1e-3,
                         optimizer_ctor=optimizer_ctor, optimizer_kwargs=kwargs)
        try_pickle = True
        run_scaling_case(make_scaler, run, unskipped=3, skipped=1, atol=1e-3,
                         optimizer_ctor=optimizer_ctor, optimizer_kwargs=kwargs)


INVALIDATION_OPTIMIZERS = [
    (torch.optim.SGD, {}),
    (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.1, "foreach": True}),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True, "fused": True}),
    (torch.optim.Adam, {}),
    (torch.optim.Adam, {"amsgrad": True, "foreach": True}),
    (torch.optim.Adam, {"weight_decay": 0.1, "fused": True}),
    (torch.optim.AdamW, {}),
    (torch.optim.AdamW, {"maximize": True, "foreach": True}),
    (torch.optim.AdamW, {"amsgrad": True, "fused": True}),
]


@pytest.mark.parametrize("optimizer_ctor, optimizer_kwargs", INVALIDATION_OPTIMIZERS,
                         ids=[f"{c.__name__}-{'-'.join(k) or 'default'}" for c, k in INVALIDATION_OPTIMIZERS])
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(
        make_scaler, optimizer_ctor, optimizer_kwargs):
    """Upstream: test_torch.py ``test_params_invalidated_with_grads_invalidated_between_unscale_and_step``
    (SGD, Adam, AdamW; a sample of upstream's optimizer inputs): gradients broken after a clean
    ``unscale_`` are not re-checked by ``step``, so the parameters become inf/NaN."""
    if optimizer_kwargs.get("fused") and (reason := fused_supported(optimizer_ctor)):
        pytest.skip(reason)
    model, _, optimizer, _, data, loss_fn, _ = scaling_case(optimizer_ctor, optimizer_kwargs)
    scaler = make_scaler(init_scale=128.0, model=model)
    for inp, target in data:
        optimizer.zero_grad()
        with torch.autocast(device_type=DEVICE, dtype=torch.half):
            loss = loss_fn(model(inp), target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        for j, param in enumerate(model.parameters()):  # deliberately break the grads
            param.grad.copy_(torch.inf if j % 2 else torch.nan)
        scaler.step(optimizer)
        scaler.update()
    assert all(p.isnan().any() or p.isinf().any() for p in model.parameters())


def unscaled_step(loss, optimizer, scaler, i, skip_iter, before_step=None) -> None:
    """The reference iteration of the training-loop tests: a plain backward, ``before_step`` (a
    clipping), and the step skipped where the scaled run skips it."""
    loss.backward()
    if before_step is not None:
        before_step()
    if not scaler.is_enabled() or i != skip_iter:
        optimizer.step()


def test_grad_scale_will_not_overflow(make_scaler):
    """Upstream: test_torch.py ``test_grad_scale_will_not_overflow``: growing a scale of 1e38 by 16
    must not leave an inf or NaN scale."""
    model = nn.Linear(5, 1)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = make_scaler(growth_interval=1, growth_factor=2**4, init_scale=1e38, model=model)
    optimizer.zero_grad()
    x = torch.randn(1, 5)
    y = 1e-30 * torch.randn(1, 1)
    loss = ((model(x) - y) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert math.isfinite(scaler._scale.item())


def test_grad_scaling_clipping(make_scaler):
    """Upstream: test_torch.py ``test_grad_scaling_clipping``: clipping the still-scaled gradients at
    ``max_norm * scale`` matches clipping unscaled ones at ``max_norm`` (atol 1e-5)."""
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (inp, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(inp), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                unscaled_step(loss, optimizer, scaler, i, skip_iter,
                              lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    run_scaling_case(make_scaler, run, unskipped=3, skipped=1, atol=1e-5)


def test_grad_scaling_clipping_separate_unscale(make_scaler):
    """Upstream: test_torch.py ``test_grad_scaling_clipping_separate_unscale``: ``unscale_`` then
    clipping (non-finite norms allowed at the skipped iteration) matches unscaled clipping."""
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (inp, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(inp), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                unscaled_step(loss, optimizer, scaler, i, skip_iter,
                              lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    run_scaling_case(make_scaler, run, unskipped=3, skipped=1)


def test_grad_scaling_penalty(make_scaler):
    """Upstream: test_torch.py ``test_grad_scaling_penalty``: a gradient-norm penalty computed from
    ``autograd.grad`` of the scaled loss, unscaled by hand, matches the unscaled computation."""
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (inp, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(inp), target)
            if try_scaling_api:
                grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                inv_scale = 1.0 / scaler.get_scale()
                grads = [g * inv_scale for g in grads]
            else:
                grads = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            grad_norm = 0
            for g in grads:
                grad_norm = grad_norm + g.pow(2).sum()
            loss = loss + grad_norm.sqrt()
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                unscaled_step(loss, optimizer, scaler, i, skip_iter)

    run_scaling_case(make_scaler, run, unskipped=3, skipped=1)


def test_grad_scaling_accumulation(make_scaler):
    """Upstream: test_torch.py ``test_grad_scaling_accumulation``: gradients accumulated over two
    scaled backward passes per step match unscaled accumulation (two steps, no skip)."""
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        iters_to_accumulate = 2
        for i, (inp, target) in enumerate(data):
            loss = loss_fn(model(inp), target) / iters_to_accumulate
            if try_scaling_api:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    run_scaling_case(make_scaler, run, unskipped=2, skipped=0)


def test_grad_scaling_multiple(make_scaler):
    """Upstream: test_torch.py ``test_grad_scaling_multiple``: two models, two optimizers and two
    losses that both reach both models, one optimizer unscaled separately; the scale grows three
    times and backs off once, and every parameter matches the unscaled run."""
    for enabled in (True, False):
        mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = scaling_case()
        mod_control1, mod_scaling1, opt_control1, opt_scaling1 = scaling_models()
        both = nn.ModuleList([mod_scaling0, mod_scaling1])
        scaler = make_scaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1,
                             model=both)

        def run(model0, model1, optimizer0, optimizer1, try_scaling_api):
            for i, (inp, target) in enumerate(data):
                optimizer0.zero_grad()
                optimizer1.zero_grad()
                out0, out1 = model0(inp), model1(inp)
                loss0 = loss_fn(0.3 * out0 + 0.7 * out1, target)
                loss1 = loss_fn(0.6 * out0 - 0.4 * out1, target)
                if try_scaling_api:
                    scaler.scale(loss0).backward(retain_graph=True)
                    scaler.scale(loss1).backward()
                    if i == skip_iter and scaler.is_enabled():
                        model1[1].weight.grad.data.fill_(float("inf"))
                    scaler.unscale_(optimizer0)  # extra stress: one optimizer unscaled apart
                    scaler.step(optimizer0)
                    scaler.step(optimizer1)
                    scaler.update()
                else:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    optimizer0.step()
                    if not scaler.is_enabled() or i != skip_iter:
                        optimizer1.step()

        run(mod_control0, mod_control1, opt_control0, opt_control1, False)
        run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)

        expected = 128.0 * scaler.get_growth_factor() ** 3 * scaler.get_backoff_factor() if enabled else 1.0
        assert scaler.get_scale() == expected
        for c, s in zip(chain(mod_control0.parameters(), mod_control1.parameters()),
                        chain(mod_scaling0.parameters(), mod_scaling1.parameters())):
            torch.testing.assert_close(s, c, rtol=1e-5, atol=1e-7)


def test_grad_scaling_disabled_is_a_no_op(make_scaler):
    """Upstream: the ``enabled=False`` half of ``_run_scaling_case`` (every test above runs it), on
    its own: a disabled scaler returns the loss unchanged, never unscales, steps unconditionally
    (infs included), keeps a scale of 1.0, and has an empty state_dict."""
    model = nn.Linear(8, 8)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    scaler = make_scaler(init_scale=128.0, enabled=False, model=model)
    assert not scaler.is_enabled()
    for _ in range(3):
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        scaled = scaler.scale(loss)
        assert scaled is loss
        scaled.backward()
        scaler.unscale_(optimizer)  # a no-op
        scaler.step(optimizer)
        scaler.update()
        nn.functional.mse_loss(reference(x), y).backward()
        ref_optimizer.step()
        for p, r in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p, r)
    assert scaler.get_scale() == 1.0
    assert scaler.state_dict() == {}
    optimizer.zero_grad()
    nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 8)).backward()
    model.weight.grad[0, 0] = float("inf")
    scaler.step(optimizer)  # not skipped: nothing checks for infs
    assert not torch.isfinite(model.weight).all()


def test_grad_scaler_pass_itself(make_scaler):
    """Upstream: test_torch.py ``test_grad_scaler_pass_itself``: an optimizer that supports AMP
    scaling gets the scaler itself as ``grad_scaler=`` (with a FutureWarning) when its ``step``
    takes that keyword, else ``grad_scale`` and ``found_inf`` attributes."""

    class _Placeholder(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})
            self._step_supports_amp_scaling = True

    seen = []

    class TakesScaler(_Placeholder):
        def step(self, closure=None, *, grad_scaler=None):
            assert isinstance(grad_scaler, torch.amp.GradScaler)
            assert not hasattr(self, "grad_scale") and not hasattr(self, "found_inf")
            seen.append("grad_scaler")

    class TakesAttributes(_Placeholder):
        def step(self, closure=None):
            assert isinstance(self.grad_scale, torch.Tensor)
            assert isinstance(self.found_inf, torch.Tensor)
            seen.append("attributes")

    x = torch.randn(4, 4)
    m = nn.Linear(4, 1)
    o1, o2 = TakesScaler(m.parameters()), TakesAttributes(m.parameters())
    scaler = make_scaler(init_scale=2.0, model=m)
    with torch.autocast(device_type=DEVICE, dtype=torch.half):
        loss = m(x).mean()
    scaler.scale(loss).backward()
    with pytest.warns(FutureWarning):
        scaler.step(o1)
    scaler.step(o2)
    scaler.update()
    assert seen == ["grad_scaler", "attributes"]


def test_grad_scaler_deprecated_warning(make_scaler, mode):
    """Upstream: test_torch.py ``test_grad_scaler_deprecated_warning``: ``torch.cpu.amp.GradScaler``
    warns that it is deprecated. Here also: the scaler under test (``torch.amp.GradScaler``, or
    ampdoctor's over it) is built without that warning."""
    with pytest.warns(FutureWarning, match=r"`torch.cpu.amp.GradScaler\(args...\)` is deprecated."):
        torch.cpu.amp.GradScaler(init_scale=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        scaler = make_scaler(init_scale=2.0)
    assert isinstance(scaler, torch.amp.GradScaler)


# -- fused optimizers (test_cuda.py) -------------------------------------------------------------

FUSED_INPUTS = {
    torch.optim.Adam: [{}, {"weight_decay": 0.1}, {"amsgrad": True}, {"maximize": True},
                       {"lr": 0.01, "betas": (0.8, 0.99)}],
    torch.optim.AdamW: [{}, {"weight_decay": 0.1}, {"amsgrad": True}, {"maximize": True},
                        {"lr": 0.01, "betas": (0.8, 0.99)}],
    torch.optim.SGD: [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
                      {"momentum": 0.9, "dampening": 0.5}, {"maximize": True}],
    torch.optim.Adagrad: [{}, {"weight_decay": 0.1}, {"lr_decay": 0.5}, {"maximize": True}],
}


def _check_and_align(expected: torch.Tensor, actual: torch.Tensor, **tolerances) -> None:
    """Upstream's TensorTracker.pop_check_set: compare, then copy the reference into ``actual`` so
    that a tolerated difference does not grow over the following iterations."""
    if expected is None:
        assert actual is None
        return
    torch.testing.assert_close(actual, expected, **tolerances)
    with torch.no_grad():
        actual.copy_(expected)


@pytest.mark.parametrize("optimizer_ctor", list(FUSED_INPUTS), ids=lambda c: c.__name__)
def test_grad_scaling_autocast_fused_optimizers(make_scaler, optimizer_ctor):
    """Upstream: test_cuda.py ``test_grad_scaling_autocast_fused_optimizers`` (on the CPU, for the
    optimizers with a fused CPU kernel; a sample of upstream's optimizer inputs): under fp16
    autocast, a fused optimizer (which unscales inside its kernel) stepped by the scaler under test,
    with and without a separate ``unscale_``, matches the for-loop optimizer stepped by a plain
    scaler: loss, gradients, parameters and optimizer state after every iteration."""
    if reason := fused_supported(optimizer_ctor):
        pytest.skip(reason)
    for optim_kwargs in FUSED_INPUTS[optimizer_ctor]:
        for separate_unscale in (True, False):
            torch.manual_seed(20)
            kwargs = {**optim_kwargs, "fused": True}
            mod_control, mod_scaling, _, opt_scaling, data, loss_fn, _ = scaling_case(optimizer_ctor, kwargs)
            control_kwargs = {"lr": 1.0, **optim_kwargs, "fused": False}
            opt_control = optimizer_ctor(mod_control.parameters(), **control_kwargs)
            scaler_scaling = make_scaler(init_scale=128.0, model=mod_scaling)
            scaler_control = torch.amp.GradScaler(DEVICE, init_scale=128.0)
            # Float betas differ between the fused (float) and for-loop (double) arithmetic.
            loose = {}
            if "betas" in opt_control.param_groups[0] and not torch.is_tensor(
                    opt_control.param_groups[0]["betas"][0]):
                loose = {"atol": 2e-5, "rtol": 2e-5}
            for inp, target in data:
                opt_control.zero_grad()
                with torch.autocast(device_type=DEVICE, dtype=torch.half):
                    loss_control = loss_fn(mod_control(inp), target)
                scaler_control.scale(loss_control).backward()
                scaler_control.step(opt_control)
                scaler_control.update()

                opt_scaling.zero_grad()
                with torch.autocast(device_type=DEVICE, dtype=torch.half):
                    loss_scaling = loss_fn(mod_scaling(inp), target)
                scaler_scaling.scale(loss_scaling).backward()
                if separate_unscale:
                    scaler_scaling.unscale_(opt_scaling)
                scaler_scaling.step(opt_scaling)
                scaler_scaling.update()

                torch.testing.assert_close(loss_scaling, loss_control)
                for p_control, p_scaling in zip(mod_control.parameters(), mod_scaling.parameters()):
                    _check_and_align(p_control.grad, p_scaling.grad)
                    _check_and_align(p_control, p_scaling, **loose)
                    state_control, state_scaling = opt_control.state[p_control], opt_scaling.state[p_scaling]
                    for key in state_control:
                        actual = state_scaling[key]
                        if key == "step":
                            actual = actual.squeeze()
                        _check_and_align(state_control[key], actual,
                                         **(loose if key in ("exp_avg_sq", "max_exp_avg_sq") else {}))
            assert scaler_scaling.get_scale() == scaler_control.get_scale()
