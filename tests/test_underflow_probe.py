"""Measured underflow (issue 27): the float32 shadow of the backward on measured steps
(ampdoctor/record/underflow_probe.py), checked against ground truth measured here independently: an fp32
and a float64 backward of the same batch on the same weights (tests/architectures.py), for parameter
gradients and module output gradients of third-party architectures; and training bit for bit the
same with it (gradient accumulation, activation checkpointing both ways, another dispatch mode)."""

from __future__ import annotations

import warnings
from collections import defaultdict

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ampdoctor
import architectures as A
from ampdoctor.record.underflow_probe import UNMEASURED, ShadowBackward
from models import DeepNet, batches, checkpointed, mse


needs_transformers = pytest.mark.skipif(A.transformers is None, reason="needs transformers (test extra)")


def _record_one_step(arch: A.Arch, path, scale: float, factor: float):
    """One recorded fp16 step at ``level="full"``, measured (lr 0, weights unchanged); the run's
    frame and the AMP gradients (unscaled)."""
    grads = A.record_one_step(arch, path, scale, factor, measure_every=1)
    return ampdoctor.load(path), grads


def _within(measured: float, truth: A.Truth) -> bool:
    """The issue's tolerance: max(0.5 percentage points, 25% of the truth), plus the elements the
    reference cannot decide (rounding noise of a mathematically zero gradient)."""
    return abs(measured - truth.lost) <= max(0.005 * truth.numel, 0.25 * truth.lost) + truth.undecided


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_transformers) for n in A.HF] + list(A.PLAIN))
@pytest.mark.parametrize("scale,factor", [(1.0, 2.0**-8), (2.0**16, 1.0), (2.0**4, 2.0**-14)])
def test_measured_underflow_equals_the_truth(name, scale, factor, tmp_path):
    """Every parameter gradient and every module's output gradients are measured, and the measured
    count is the truth within tolerance for at least 95% of them (all but rounding-noise cases)."""
    arch = A.build(name)
    frame, amp = _record_one_step(arch, tmp_path / "run", scale, factor)
    rows = frame[frame.kind == "param_grad"].set_index("name")
    truth = A.true_underflow(arch, 0, amp, factor)
    assert rows["n_underflow"].notna().all()
    judged = [_within(rows.loc[n, "n_underflow"], t) for n, t in truth.items()]
    assert sum(judged) >= 0.95 * len(judged), [(n, rows.loc[n, "n_underflow"], t) for n, t in truth.items()
                                              if not _within(rows.loc[n, "n_underflow"], t)]
    if factor == 2.0**-14:  # deep underflow on every architecture: the comparison is not of zeros only
        assert sum(t.lost for t in truth.values()) > 0
    step = frame[frame.kind == "step"].iloc[0]
    assert step.n_underflow == rows.n_underflow.sum()
    # What underflowed, by magnitude (underflow_hist), parameter and module output gradients alike:
    # every counted element whose shadow value is finite and nonzero once unscaled.
    for kind in ("param_grad", "grad_output"):
        measured_rows = frame[(frame.kind == kind) & frame.n_underflow.notna()]
        hist_sums = measured_rows.underflow_hist.map(sum)
        assert len(measured_rows) and (hist_sums <= measured_rows.n_underflow).all()
        assert hist_sums.sum() >= 0.99 * measured_rows.n_underflow.sum()
    # Module output gradients: the truth per module sums every output of every call.
    out_truth = A.true_output_underflow(arch, 0, scale, factor)
    grads = frame[frame.kind == "grad_output"]
    measured = grads.groupby("name").n_underflow.sum(min_count=1)
    numel = grads.groupby("name").numel.sum()
    judged = [_within(measured[n], t) for n, t in out_truth.items() if n in measured and numel[n] == t.numel]
    # (90% here: the misses are 1 to 4 elements of tensors of 192 to 384, T5's attention in deep
    # underflow, where the fp32 reference's own forward makes exact zeros that the shadow of the
    # fp16 forward makes rounding noise; benchmarks/underflow_accuracy.py gives the shares.)
    assert len(judged) >= 0.8 * len(out_truth) and sum(judged) >= 0.9 * len(judged)


def _train(model, scaler, data, *, accumulate: int = 1, wrap_step=None) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in data:
        with (wrap_step() if wrap_step else _nothing()):
            for part in range(accumulate):
                xs, ys = x.chunk(accumulate)[part], y.chunk(accumulate)[part]
                scaler.scale(mse(model, xs, ys) / accumulate).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


class Counting(TorchDispatchMode):
    """A user's own dispatch mode around the whole step."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("variant", ["plain", "accumulate", "checkpoint", "reentrant", "user_mode"])
def test_training_is_bit_identical_with_measurement(variant, tmp_path):
    """Weights after 4 steps, every one measured, are exactly those of torch's own scaler; and the
    measured steps hold counts (none when a user's dispatch mode surrounds the step: warned)."""
    def model():
        torch.manual_seed(0)
        return checkpointed(variant == "reentrant") if variant in ("checkpoint", "reentrant") else DeepNet()

    data = batches(4, batch=8)
    options = dict(accumulate=2 if variant == "accumulate" else 1,
                   wrap_step=Counting if variant == "user_mode" else None)
    reference = model()
    _train(reference, torch.amp.GradScaler("cpu", init_scale=2.0**6), data, **options)
    measured = model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ampdoctor.GradScaler("cpu", init_scale=2.0**6, model=measured, path=tmp_path / "run", level="full",
                                  every=1, measure_every=1) as scaler:
            _train(measured, scaler, data, **options)
    for a, b in zip(reference.parameters(), measured.parameters()):
        assert torch.equal(a, b)
    rows = ampdoctor.load(tmp_path / "run")
    params = rows[rows.kind == "param_grad"]
    if variant == "user_mode":
        assert params.n_underflow.isna().all()
        assert sum("underflow is not measured" in str(w.message) for w in caught) == 1
    else:
        assert params.n_underflow.notna().all() and sorted(set(params.step)) == [0, 1, 2, 3]
        assert (rows[rows.kind == "grad_output"].n_underflow.notna()).any()
        assert not any("underflow" in str(w.message) for w in caught)


def test_a_default_run_measures_once_per_module_interval(tmp_path):
    """By default one step in 1000 is measured (``module_every`` when given), rounded up to a
    sampled step, whatever ``every``; ``measure_every=0`` measures none."""
    def measured_steps(**options):
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}"
        torch.manual_seed(0)
        m = DeepNet()
        with ampdoctor.GradScaler("cpu", model=m, path=path, **options) as scaler:
            _train(m, scaler, batches(12, batch=4))
        rows = ampdoctor.load(path)
        return sorted(set(rows[rows.n_underflow.notna()].step))

    assert measured_steps(every=5, module_every=4) == [0, 5, 10]
    assert measured_steps(every=1) == [0]
    assert measured_steps(every=2, measure_every=3) == [0, 3, 6, 9]
    assert measured_steps(every=1, measure_every=0) == []
    with pytest.raises(ValueError, match="measure_every"):
        ampdoctor.GradScaler("cpu", path="x", measure_every=-1)


def test_collectives_are_never_shadowed_and_what_follows_them_is_unmeasured():
    """A collective (here a stand-in op of the c10d namespace would be; the real ones need a
    process group: tests/test_distributed.py) leaves its outputs unmeasured, and the ops computed
    from them stay unmeasured; ops that give no floating tensor run once."""
    calls = defaultdict(int)

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    x = torch.randn(8, requires_grad=True)
    loss = (x.half() * 1e-6).float().sum() * 2.0**-20
    probe = ShadowBackward()
    with Spy(), probe:
        probe.seed(loss)
        loss.backward()
        g = x.grad
        nonzero = torch.count_nonzero(g)  # an integer output: not shadowed
        _ = g.sum().item()                # no second sync from the shadow
    assert probe.count(x.grad) is not None and int(probe.count(x.grad)) == 8  # 2^-26 underflows in fp16
    assert calls["_local_scalar_dense"] == 1 and calls["count_nonzero"] == 1 and int(nonzero) == 0
    # An op whose shadow is unmeasured propagates that.
    probe2 = ShadowBackward()
    y = torch.randn(4)
    with probe2:
        probe2._shadows[y] = UNMEASURED
        z = y * 2
        w = z + 1
    assert probe2._shadows.get(w) is UNMEASURED and probe2.count(w) is None
    assert probe2.unmeasured_ops == {"mul": 1, "add": 1}


def test_a_scaler_without_model_measures_its_parameter_gradients(tmp_path):
    """No ``model=``: no module taps, but the parameter gradients are measured all the same."""
    torch.manual_seed(0)
    m = DeepNet()
    with ampdoctor.GradScaler("cpu", path=tmp_path / "run", every=1, measure_every=1, init_scale=1.0) as scaler:
        _train(m, scaler, [(x * 1e-4, y) for x, y in batches(2, batch=8)])
    rows = ampdoctor.load(tmp_path / "run")
    params = rows[rows.kind == "param_grad"]
    assert params.n_underflow.notna().all() and params.name.str.startswith("group0.").all()
    assert (params.n_underflow > 0).any()


def test_hooks_run_once_on_a_measured_step(tmp_path):
    """The shadow runs below autograd: a tensor hook, a module full backward hook and a
    parameter's post-accumulate hook each run once per backward, as without measurement."""
    torch.manual_seed(0)
    m = DeepNet()
    calls = defaultdict(int)
    last = list(m.children())[-1]  # (its input requires grad: torch's full backward hook is quiet)
    last.register_full_backward_hook(lambda mod, gi, go: calls.__setitem__("module", calls["module"] + 1))
    p = next(m.parameters())
    p.register_post_accumulate_grad_hook(lambda t: calls.__setitem__("post", calls["post"] + 1))
    p.register_hook(lambda g: calls.__setitem__("param", calls["param"] + 1))
    with ampdoctor.GradScaler("cpu", model=m, path=tmp_path / "run", every=1, measure_every=1,
                              init_scale=1.0) as scaler:
        for x, y in batches(2, batch=8):
            with torch.autocast("cpu", dtype=torch.float16):
                out = m(x)
            out.register_hook(lambda g: calls.__setitem__("tensor", calls["tensor"] + 1))
            scaler.scale(torch.nn.functional.mse_loss(out.float(), y)).backward()
            scaler.step(torch.optim.SGD(m.parameters(), lr=0.0))
            scaler.update()
    assert dict(calls) == {"module": 2, "post": 2, "param": 2, "tensor": 2}
    rows = ampdoctor.load(tmp_path / "run")
    assert rows[rows.kind == "param_grad"].n_underflow.notna().all()


def test_a_shadow_op_never_writes_a_real_tensor():
    """``a.add_(b)`` with ``b`` shadowed and ``a`` not: the shadow op writes a copy of ``a``, so
    ``a`` gets ``b`` once (before the fix it got the shadow of ``b`` too); and a shadow that
    would alias a real tensor (a view of an unshadowed input) is a copy."""
    probe = ShadowBackward()
    a = torch.ones(4)
    b = torch.full((4,), 0.5, dtype=torch.float16)
    with probe:
        probe._shadows[b] = torch.full((4,), 0.25)
        a.add_(b)
        c = torch.ones(4) + b   # an output computed from a real tensor and a shadowed one
    assert torch.equal(a, torch.full((4,), 1.5)) and torch.equal(probe.shadow(a), torch.full((4,), 1.25))
    assert torch.equal(c, torch.full((4,), 1.5)) and torch.equal(probe.shadow(c), torch.full((4,), 1.25))


def test_what_a_collective_wrote_stays_unmeasured_through_views():
    """A collective's tensors and every tensor sharing their storage (DDP's bucket views, copied
    back into the gradients) are unmeasured, as is what is computed from them; DDP itself:
    tests/test_distributed.py."""
    probe = ShadowBackward()
    bucket = torch.zeros(6)
    view = bucket[:3]
    grad = torch.full((3,), 2.0, dtype=torch.float16)
    with probe:
        probe._shadows[grad] = torch.full((3,), 2.0)
        view.copy_(grad)
        probe._collective(torch.ops.aten.mul_.Tensor, (bucket, torch.tensor(0.5)), {}, [bucket])  # a stand-in
        out = torch.empty(3)
        out.copy_(view)
        doubled = out * 2
    assert probe.shadow(out) is None and probe.count(doubled) is None
    assert probe.unmeasured_ops["copy_"] == 1 and probe.unmeasured_ops["mul"] == 1


def test_closing_between_scale_and_step_leaves_the_shadow(tmp_path):
    """A run closed after ``scale()`` of a measured step (an exception, then ``close()``): the
    dispatch mode is left, so later ops do not go through it."""
    m = DeepNet()
    scaler = ampdoctor.GradScaler("cpu", model=m, path=tmp_path / "run", every=1)
    x, y = batches(1, batch=4)[0]
    scaler.scale(mse(m, x, y)).backward()
    assert torch._C._len_torch_dispatch_stack() == 1
    scaler.close()
    assert torch._C._len_torch_dispatch_stack() == 0


def test_running_out_of_memory_drops_the_shadows_not_the_training(tmp_path, monkeypatch):
    """A real op that runs out of memory while shadows are held (here: raised once by the test,
    as the allocator would) runs again after the shadows are freed: training goes on bit for bit,
    the step is unmeasured, one warning, and no later step is measured."""
    from ampdoctor.record import underflow_probe

    real_call = underflow_probe.ShadowBackward._call
    failed = []

    def call(self, func, args, kwargs):
        if failed or len(self._shadows) <= 4 or func is not torch.ops.aten.mm.default:
            return real_call(self, func, args, kwargs)

        def once(*a, **k):  # the op's first attempt runs out of memory, as the allocator raises it
            if not failed:
                failed.append(func)
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return func(*a, **k)
        once._schema, once.tags = func._schema, func.tags
        return real_call(self, once, args, kwargs)

    data = batches(3, batch=8)
    torch.manual_seed(0)
    reference = DeepNet()
    _train(reference, torch.amp.GradScaler("cpu", init_scale=2.0**6), data)
    monkeypatch.setattr(underflow_probe.ShadowBackward, "_call", call)
    torch.manual_seed(0)
    m = DeepNet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ampdoctor.GradScaler("cpu", init_scale=2.0**6, model=m, path=tmp_path / "run", every=1,
                                  measure_every=1) as scaler:
            _train(m, scaler, data)
    assert failed
    for a, b in zip(reference.parameters(), m.parameters()):
        assert torch.equal(a, b)
    rows = ampdoctor.load(tmp_path / "run")
    assert rows[rows.kind == "param_grad"].n_underflow.isna().all()
    assert sum("ran out of memory" in str(w.message) for w in caught) == 1


def test_shadow_ops_leave_real_tensors_random_state_and_custom_ops_alone():
    """The review's cases: an ``out=`` that is also an input, ``set_``, random ops, a custom op
    with a side effect, ``as_strided`` on a compact shadow: real values, the random stream and
    the op's body are as without the probe; what cannot be shadowed is unmeasured."""
    probe = ShadowBackward()
    g = torch.full((4,), 0.5, dtype=torch.float16)
    x, y, b = torch.ones(4), torch.ones(4), torch.ones(4)
    with probe:
        probe._shadows[g] = torch.full((4,), 0.25)
        torch.add(x, g, out=x)       # out= aliases an input without a shadow
        torch.mul(y, g, out=y)
        a = g.float() * 1            # a shadowed float32 tensor
        a.set_(b)                    # now b's alias: not shadowed
        a.add_(g)
    assert torch.equal(x, torch.full((4,), 1.5)) and torch.equal(probe.shadow(x), torch.full((4,), 1.25))
    assert torch.equal(y, torch.full((4,), 0.5)) and torch.equal(b, torch.full((4,), 1.5))
    assert probe.shadow(a) is None

    # The random stream: the same draws after random ops on shadowed tensors as without them.
    def draws(with_probe):
        torch.manual_seed(0)
        h = torch.full((64,), 0.5, dtype=torch.float16)
        p = ShadowBackward()
        with (p if with_probe else _nothing()):
            if with_probe:
                p._shadows[h] = torch.full((64,), 0.5)
            out = torch.nn.functional.dropout(h, 0.5) + torch.randn_like(h)
            return out, torch.rand(3)
    assert all(torch.equal(u, v) for u, v in zip(draws(True), draws(False)))

    calls = []

    @torch.library.custom_op("ampdoctor_test::halve", mutates_args=())
    def halve(t: torch.Tensor) -> torch.Tensor:
        calls.append(t.dtype)
        return t * 0.5

    probe = ShadowBackward()
    with probe:
        probe._shadows[g] = torch.full((4,), 0.25)
        h = halve(g)
    assert calls == [torch.float16] and probe.shadow(h) is None

    probe = ShadowBackward()
    buf = torch.zeros(10)
    view = buf[2:8]
    src = torch.arange(6.0)
    with probe:
        probe._shadows[src] = torch.arange(6.0) + 100
        view.copy_(src)                            # view's shadow: a compact copy
        w = view.as_strided((2,), (1,), 2)         # addresses buf's storage: [src[0], src[1]]
    assert probe.shadow(w) is None and w.tolist() == [0.0, 1.0]


def test_a_freed_collective_buffer_s_address_is_not_held_against_a_new_tensor(monkeypatch):
    """Storage addresses are reused once freed (the caching allocator does it all the time): a
    collective's storage taints what reads it only while one of its tensors lives. Address reuse
    is simulated by one address for every tensor."""
    from ampdoctor.record import underflow_probe

    monkeypatch.setattr(underflow_probe, "_storage", lambda t: 4096 if isinstance(t, torch.Tensor) else None)
    probe = ShadowBackward()
    bucket = torch.zeros(8)
    probe._taint(bucket)
    other = torch.ones(8)
    assert probe._from_collective(other)          # the same address while the bucket lives
    del bucket
    assert not probe._from_collective(other) and not probe._collective_storages


def test_a_recorder_failure_or_a_dropped_scaler_never_leaves_the_mode_behind(tmp_path, monkeypatch):
    """A tap that fails inside a measured step's backward stops recording (as any recorder
    failure): the mode is left at the scaler's next call. A scaler dropped between ``scale()``
    and ``step()`` (an exception) leaves a mode that passes ops through, and the next recording
    scaler leaves it before measuring."""
    import gc

    from ampdoctor.record.recorder import Recorder

    m = DeepNet()
    x, y = batches(1, batch=4)[0]
    real = Recorder.observe_tap

    def broken(self, kind, call, order, tensor):
        if kind == "grad_output":
            raise RuntimeError("a tap bug")
        return real(self, kind, call, order, tensor)

    monkeypatch.setattr(Recorder, "observe_tap", broken)
    scaler = ampdoctor.GradScaler("cpu", model=m, path=tmp_path / "a", level="full", every=1)
    with pytest.warns(RuntimeWarning, match="a tap bug"):
        scaler.scale(mse(m, x, y)).backward()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    scaler.step(opt)
    scaler.update()
    assert torch._C._len_torch_dispatch_stack() == 0
    scaler.close()
    monkeypatch.setattr(Recorder, "observe_tap", real)

    dropped = ampdoctor.GradScaler("cpu", model=m, path=tmp_path / "b", every=1)
    dropped.scale(mse(m, x, y))  # ... and an exception before backward
    del dropped
    gc.collect()
    assert torch._C._len_torch_dispatch_stack() == 1  # (its mode: passing everything through now)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not "another TorchDispatchMode is active"
        with ampdoctor.GradScaler("cpu", model=m, path=tmp_path / "c", every=1) as fresh:
            fresh.scale(mse(m, x, y)).backward()
            assert torch._C._len_torch_dispatch_stack() == 1
            fresh.step(opt)
            fresh.update()
    assert torch._C._len_torch_dispatch_stack() == 0
    rows = ampdoctor.load(tmp_path / "c")
    assert rows[rows.kind == "param_grad"].n_underflow.notna().all()


def test_a_compiled_region_in_the_backward_is_not_measured(tmp_path):
    """Code compiled by torch.compile inside the model: its kernels bypass the dispatcher and
    reuse buffers, so shadows would go stale; the step is not measured (warned once), and
    training is as without recording."""
    class WithCompiled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 4)  # (before the compiled region: its backward runs compiled code)
            self.act = torch.compile(lambda t: torch.nn.functional.gelu(t) * torch.sigmoid(t), backend="aot_eager")

        def forward(self, t):
            return self.act(self.fc(t))

    torch.manual_seed(0)
    m = WithCompiled()
    with pytest.warns(RuntimeWarning, match="compiled by torch.compile"):
        with ampdoctor.GradScaler("cpu", model=m, path=tmp_path / "run", every=1) as scaler:
            _train(m, scaler, batches(2, batch=4))
    rows = ampdoctor.load(tmp_path / "run")
    assert rows[rows.kind == "param_grad"].n_underflow.isna().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lost_values_are_a_copy_that_leaves_the_shadow_as_it_is(dtype):
    """A module output gradient's lost values (its underflow_hist) are taken while the backward
    still reads its shadow: a float32 shadow, or a bfloat16 one (an op that refuses float32)."""
    probe = ShadowBackward()
    real = torch.tensor([0.0, 1.0, 0.0, 2.0], dtype=torch.float16)
    shadow = torch.tensor([1e-9, 1.0, 0.0, 2.0], dtype=dtype)
    probe._shadows[real] = shadow
    kept = shadow.clone()
    lost = probe.lost_copy(real)
    assert torch.equal(shadow, kept) and lost.data_ptr() != shadow.data_ptr()
    assert lost.tolist() == pytest.approx([1e-9, 0.0, 0.0, 0.0], rel=1e-2)
