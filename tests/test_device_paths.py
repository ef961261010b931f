"""The accelerator paths of the recorder, run in CI on the CPU.

* ``FakeTensorMode`` fakes ``cuda`` tensors on this CPU-only build: statistics, module taps, the
  parameter check and the copies run through their CUDA branches; a host read of device data
  (``.item()``, a sync) raises, and so does an op on tensors of two devices. Backward on fake
  CUDA tensors is not possible on a CPU-only build (autograd asks for a CUDA device guard and
  aborts the process), so those steps run forward under ``no_grad`` and set the gradients;
  gradient taps run on ``meta`` tensors instead.
* Late events: fences whose events complete a few steps after they were recorded exercise the
  paths that only real accelerators take (anomalies read steps late, waits with deadlines).
"""

from __future__ import annotations

import math
import sys
import threading
import time
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import ampdoctor
from ampdoctor.record.records import FlightRecord, StepRecord
from ampdoctor.record.run_identity import broadcast_device
from ampdoctor.read.run import read_run
from ampdoctor.stats import FullStats, LightStats
from ampdoctor.record.transfer import Fence, HostCopies
from models import MLP, batches, mse

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from host_cost import OpCounter  # noqa: E402

# Ops that sync (a host read of device data), whose CUDA kernels are nondeterministic (float
# atomics), or that raise under torch.use_deterministic_algorithms(True) on CUDA. (cumsum raises
# there for floating types only: the accelerator algorithm's is on integers.)
FORBIDDEN = {"_local_scalar_dense", "item", "nonzero", "masked_select", "bincount", "histc", "scatter_reduce",
             "scatter_add", "index_put", "put", "unique", "_unique2"}


class LateEvent:
    """An event that completes once ``lag`` more events have been recorded after it (the device
    is ``lag`` steps behind), or when waited on."""

    made = 0  # events recorded so far, in all tests: the fake device's clock

    def __init__(self, device, lag: int = 2) -> None:
        self.device, self.done_at, self.waits = torch.device(device), LateEvent.made + 1 + lag, 0
        LateEvent.made += 1

    def query(self) -> bool:
        return LateEvent.made >= self.done_at

    def synchronize(self) -> None:
        self.waits += 1
        self.done_at = 0


class Split(nn.Module):
    """Two linear layers, each on its own device (a model split over GPUs in one process)."""

    def __init__(self, devices) -> None:
        super().__init__()
        self.devices = devices
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.to(self.devices[0]))).to(self.devices[-1]))


def _fake(model: nn.Module, mode: FakeTensorMode, device_of) -> nn.Module:
    """``model`` with fake parameters on ``device_of(module_name)``."""
    for name, m in model.named_modules():
        for key, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[key] = nn.Parameter(FakeTensor(mode, p.detach().to("meta"), device_of(name)))
    return model


def _fake_cuda_run(level: str, devices=("cuda:0",), steps: int = 4, inject: int | None = None):
    """Train ``steps`` iterations on fake CUDA tensors; returns (records, recorder, op counter)."""
    mode = FakeTensorMode()
    devices = [torch.device(d) for d in devices]
    model = _fake(Split(devices), mode, lambda name: devices[-1] if name == "b" else devices[0])
    records, counter = [], OpCounter()
    with mode:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with mock.patch("torch.cuda.is_available", return_value=True):  # else torch disables the scaler
            scaler = ampdoctor.GradScaler("cuda", model=model, path="unused.parquet", level=level, every=2,
                                          strict=True, amp_dtype=torch.float16)
        rec = scaler.recorder
        # Fake tensors hold no data to write: the test reads the records instead (the writer's
        # thread starts at its first record, which never reaches it)
        rec.writer.close = lambda *args, **kwargs: True
        rec.writer.put = lambda record: records.append(record) or True
        rec.writer.sync = lambda: True
        # Fake host copies hold no data either: their fences never pass, so nothing reads them.
        rec.use_copies(HostCopies(lambda device: LateEvent(device, lag=10**9)))
        # torch's step() reads found_inf on the host (its own sync, which fake tensors refuse)
        scaler._maybe_opt_step = lambda optimizer, state, *a, **k: optimizer.step(*a, **k)
        with counter:
            for i in range(steps):
                x = torch.randn(8, 16, device=devices[0])
                with torch.no_grad():  # the autograd engine of a CPU-only build has no CUDA device guard
                    loss = model(x).float().square().mean()
                scaler.scale(loss)
                for p in model.parameters():
                    p.grad = torch.randn_like(p)
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        rec._anomalies.pending.clear()
        scaler.close()
    return records, rec, counter


@pytest.mark.parametrize("level", ["steps", "params", "full"])
def test_every_level_runs_its_cuda_branches_without_a_sync(level):
    records, rec, counter = _fake_cuda_run(level)
    assert not rec._reported and rec.step == 4
    steps = [r for r in records if isinstance(r, StepRecord)]
    assert [r.step for r in steps] == [0, 1, 2, 3]
    for r in steps:
        sampled = r.step % 2 == 0
        (group,) = r.groups
        assert isinstance(group.stats, FullStats if sampled else LightStats)
        assert group.stats.device.type == "cpu"  # copied to the host ...
        assert isinstance(r.event, Fence) and {e.device for e in r.event._events} == {torch.device("cuda:0")}
        assert r.scalars.device.type == "cpu"
        assert (r.params is not None) == sampled  # the parameter check on sampled steps
        if level == "full" and sampled:
            assert {t.kind for t in r.taps} == {"output"} and len(r.taps) == 3  # a, b, the model
    if level == "full":  # light steps: module peaks stay on the device, in the flight recorder
        assert [e.step for e in rec._anomalies.flight] == [1, 3] and rec._anomalies.flight[0].peaks.device.type == "cuda"
    assert not FORBIDDEN & set(counter.ops), FORBIDDEN & set(counter.ops)


def test_a_model_split_over_two_gpus_gets_an_event_per_device():
    """Issue 17, item 2: one event on the current device's stream does not cover the copies
    that run on the other GPU's stream."""
    records, rec, _ = _fake_cuda_run("full", devices=("cuda:0", "cuda:1"), steps=2)
    first = next(r for r in records if isinstance(r, StepRecord))
    assert {g.stats.device.type for g in first.groups} == {"cpu"} and len(first.groups) == 2
    assert {e.device for e in first.event._events} == {torch.device("cuda:0"), torch.device("cuda:1")}
    assert {t.call.name for t in first.taps} == {"a", "b", "(model)"}


def test_empty_local_shards_on_cuda():
    """Issue 17, item 1: an empty shard (FSDP, small parameters on many ranks) made the fused
    inf-norm raise on CUDA and recording stopped at step 0."""
    mode = FakeTensorMode()
    with mode:
        from ampdoctor.stats import light_stats, tensor_peaks
        tensors = [torch.randn(5, device="cuda"), torch.empty(0, device="cuda")]
        assert tensor_peaks(tensors).shape == (2,)
        assert light_stats(tensors, inv_scale=None).norms.shape == (2,)


def test_sparse_gradients_on_cuda_are_not_coalesced():
    """Issue 17, item 6: coalescing syncs on CUDA (its output size depends on the data)."""
    mode = FakeTensorMode()
    with mode, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse invariant checks
        emb = nn.Parameter(torch.randn(50, 8, device="cuda"))
        emb.grad = torch.sparse_coo_tensor(torch.tensor([[3, 3, 7]], device="cuda"),
                                           torch.randn(3, 8, device="cuda"), (50, 8))
        opt = torch.optim.SGD([emb], lr=0.1)
        with mock.patch("torch.cuda.is_available", return_value=True):
            scaler = ampdoctor.GradScaler("cuda", path="unused.parquet", strict=True, every=1)
        rec = scaler.recorder
        rec.writer.close = lambda *args, **kwargs: True  # (no data to write: no thread is started)
        with OpCounter() as counter:
            rec.observe_grads(opt, scaler._lazy_init_scale_growth_tracker(torch.device("cuda")) or scaler._scale)
    assert "coalesce" not in counter.ops and "_coalesce" not in counter.ops
    assert rec._groups[0].numels.tolist() == [24]  # the stored values, duplicates apart


def test_gradient_taps_run_on_meta_tensors():
    """Backward on meta tensors: the gradient taps and full statistics of module gradients take
    the accelerator branches."""
    torch.manual_seed(0)
    model = MLP().to("meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampdoctor.GradScaler("meta", model=model, path="unused.parquet", level="full", every=1,
                                  strict=True, amp_dtype=torch.float16)
    rec = scaler.recorder
    rec.writer.close = lambda *args, **kwargs: True  # (no data to write: no thread is started)
    records = []
    rec.writer.put = lambda record: records.append(record) or True

    class KeepOnDevice(HostCopies):  # meta tensors have no data to copy
        def to_host(self, t):
            self._devices[t.device] = None
            return t

    rec.use_copies(KeepOnDevice(LateEvent))
    scaler._maybe_opt_step = lambda optimizer, state, *a, **k: optimizer.step(*a, **k)
    x, y = torch.randn(8, 16, device="meta"), torch.randn(8, 4, device="meta")
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    (record,) = [r for r in records if isinstance(r, StepRecord)]
    kinds = {(t.kind, t.call.name) for t in record.taps}
    assert ("grad_output", "fc1") in kinds and ("output", "fc2") in kinds
    assert all(t.stats.counts.device.type == "meta" for t in record.taps)


# -- late events on the CPU -------------------------------------------------------------------------
def _late_run(path, *, fused: bool, late: bool, level="full", steps=10, inject_at=4):
    torch.manual_seed(0)
    model = MLP()
    kw = {"fused": True} if fused else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kw)
    scaler = ampdoctor.GradScaler("cpu", model=model, path=path, level=level, every=100, escalate_steps=3,
                                  init_scale=2.0**10)
    if late:
        scaler.recorder.use_copies(HostCopies(lambda device: LateEvent(device, lag=2), fence_host=True))
    for i, (x, y) in enumerate(batches(steps)):
        scaler.scale(mse(model, x, y)).backward()
        if i == inject_at:
            model.fc1.weight.grad[0, 0] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    scaler.close()
    return read_run(path).frame


def _full_stat_steps(frame):
    return sorted(frame.query("kind == 'param_grad' and n_zero.notna()").step.unique().tolist())


def test_late_events_change_nothing_when_torch_saw_the_skip(tmp_path):
    """Issue 17, item 9: with copies that land two steps late, a skip that torch's step()
    saw on the host still escalates from the next step (it started a step later before) and the
    run holds the same rows as with immediate copies."""
    now = _late_run(tmp_path / "now.parquet", fused=False, late=False)
    late = _late_run(tmp_path / "late.parquet", fused=False, late=True)
    assert _full_stat_steps(now) == _full_stat_steps(late) == [0, 5, 6, 7]
    columns = ["step", "kind", "name", "amax", "n_zero", "skipped"]
    key = ["step", "kind", "name", "order"]
    assert now.sort_values(key)[columns].reset_index(drop=True).equals(late.sort_values(key)[columns].reset_index(drop=True))
    assert sorted(late.query("kind == 'output' and amin.isna()").step.unique()) == [1, 2, 3, 4]  # the flight window


def test_fused_optimizers_see_the_skip_when_the_copy_lands(tmp_path):
    """A fused optimizer runs whatever found_inf says (it skips on the device): the skip is
    known when the step's scalars have landed, here two steps later; the flight window still
    ends at the anomalous step."""
    late = _late_run(tmp_path / "late.parquet", fused=True, late=True)
    full = _full_stat_steps(late)
    assert full[0] == 0 and 5 not in full and full[1] > 5
    assert late.query("kind == 'step' and skipped").step.tolist() == [4]
    assert max(late.query("kind == 'output' and amin.isna()").step) == 4


def test_close_waits_for_late_copies_within_its_timeout(tmp_path):
    """A copy that does not land (a hung device) must not hang close(): it returns after its
    timeout and warns; when the device comes back, the writer still finishes the run."""
    release = threading.Event()

    class Hung(LateEvent):
        def query(self):
            return False

        def synchronize(self):
            release.wait(30)

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = ampdoctor.GradScaler("cpu", model=model, path=tmp_path / "run.parquet", level="params")
    for x, y in batches(2):
        scaler.scale(mse(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    scaler.recorder.use_copies(HostCopies(Hung, fence_host=True))
    x, y = next(iter(batches(1)))
    scaler.scale(mse(model, x, y)).backward()
    scaler.step(opt)
    scaler.update()
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="did not finish"):
        scaler.recorder.close(timeout=0.5)
    assert time.monotonic() - start < 5
    release.set()  # the device comes back: the writer finishes the run after all
    scaler.recorder.writer._thread.join(10)
    assert sorted(read_run(tmp_path / "run.parquet").frame.query("kind == 'step'").step) == [0, 1, 2]


def test_the_run_id_broadcast_uses_the_rank_s_own_gpu(monkeypatch):
    """Issue 17, item 7: under NCCL broadcast_object_list defaults to current_device(), GPU 0 on
    every rank that never called set_device."""
    from ampdoctor.record import run_identity
    dist = torch.distributed
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert broadcast_device(MLP()) == torch.device("cuda", 3)
    assert broadcast_device(MLP().to("meta")) == torch.device("cuda", 3)  # deferred init: not meta
    monkeypatch.setenv("LOCAL_RANK", "5")  # one GPU per process: LOCAL_RANK is not its ordinal
    assert broadcast_device(None) == torch.device("cuda", 0)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    assert broadcast_device(None) is None
    # ... and the broadcast is given it
    monkeypatch.delenv("AMPDOCTOR_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda box, src, device=None: seen.update(device=device))
    monkeypatch.setattr(run_identity, "broadcast_device", lambda model: torch.device("cuda", 2))
    run_identity.shared_run_id(2, None, MLP())
    assert seen == {"device": torch.device("cuda", 2)}


# -- the host-seen skip: optimizers of every kind ----------------------------------------------------
def _skips_run(path, make_optimizers, *, enabled=True, inject_at=3, steps=8):
    torch.manual_seed(0)
    model = MLP()
    optimizers = make_optimizers(model)
    scaler = ampdoctor.GradScaler("cpu", model=model, path=path, every=100, escalate_steps=2,
                                  init_scale=2.0**10, enabled=enabled)
    scaler.recorder.use_copies(HostCopies(lambda device: LateEvent(device, lag=3), fence_host=True))
    for i, (x, y) in enumerate(batches(steps)):
        scaler.scale(mse(model, x, y)).backward()
        if i == inject_at:
            model.fc2.weight.grad[0, 0] = math.inf
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for opt in optimizers:
            opt.zero_grad()
    scaler.close()
    return _full_stat_steps(read_run(path).frame)


class NoInit(torch.optim.SGD):
    """An optimizer wrapper that never runs Optimizer.__init__ (torch's PostLocalSGDOptimizer is one)."""

    def __init__(self, inner):  # noqa: super-init-not-called
        self.inner = inner

    param_groups = property(lambda self: self.inner.param_groups)
    state = property(lambda self: self.inner.state)
    defaults = property(lambda self: self.inner.defaults)

    def step(self, closure=None):
        return self.inner.step(closure)

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none)


def test_the_host_seen_skip_with_two_optimizers_a_hookless_one_and_a_disabled_scaler(tmp_path, monkeypatch):
    # A LateEvent lands when waited on: a writer that polls would wait on step 3's fence before
    # step 6 on a slow machine and make the skip known early. It sleeps until a sync or close here.
    from ampdoctor.record import writer
    monkeypatch.setattr(writer, "POLL_SECONDS", 60.0)
    two = lambda m: [torch.optim.SGD(m.fc1.parameters(), lr=1e-3), torch.optim.SGD(m.fc2.parameters(), lr=1e-3)]
    # fc2's optimizer skips at step 3 (its found_inf), fc1's runs: the step is anomalous, seen at once
    assert _skips_run(tmp_path / "two.parquet", two) == [0, 4, 5]
    # no hooks on it: the skip is read when its copy lands (lag 3), and recording goes on
    hookless = lambda m: [NoInit(torch.optim.SGD(m.parameters(), lr=1e-3))]
    assert _skips_run(tmp_path / "hookless.parquet", hookless) == [0, 7]
    # a disabled scaler never skips: its optimizer always runs; nothing escalates
    one = lambda m: [torch.optim.SGD(m.parameters(), lr=1e-3)]
    assert _skips_run(tmp_path / "disabled.parquet", one, enabled=False, inject_at=-1) == [0]


def test_a_new_optimizer_with_a_freed_one_s_id_is_watched(tmp_path):
    """Our step hook is found by the optimizer itself, not by an id a freed optimizer had: a
    stale entry made every step look skipped."""
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=tmp_path / "run.parquet", every=100, check_params=False)
    rec = scaler.recorder
    for x, y in batches(4):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # a new optimizer every step
        scaler.scale(mse(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        del opt
    assert rec._anomalies.handled < 0 and rec._plan.escalate_until == 0
    scaler.close()


def test_fake_cuda_skip_seen_on_the_host_dumps_the_flight_window_and_escalates():
    """The anomaly path on CUDA tensors: a skip torch's step() saw (here: a fake that skips at
    step 2) writes the flight recorder's light steps, copied under a fence, and details the next."""
    mode = FakeTensorMode()
    model = _fake(Split([torch.device("cuda:0")]), mode, lambda name: torch.device("cuda:0"))
    records = []
    with mode:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with mock.patch("torch.cuda.is_available", return_value=True):
            scaler = ampdoctor.GradScaler("cuda", model=model, path="unused.parquet", level="full", every=100,
                                          escalate_steps=2, strict=True, amp_dtype=torch.float16)
        rec = scaler.recorder
        rec.writer.close = lambda *args, **kwargs: True  # (no data to write: no thread is started)
        rec.writer.put = lambda record: records.append(record) or True
        rec.writer.sync = lambda: True
        rec.use_copies(HostCopies(lambda device: LateEvent(device, lag=10**9)))
        step = [0]
        scaler._maybe_opt_step = lambda optimizer, state, *a, **k: None if step[0] == 2 else optimizer.step(*a, **k)
        for step[0] in range(5):
            with torch.no_grad():
                loss = model(torch.randn(8, 16, device="cuda")).float().square().mean()
            scaler.scale(loss)
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        rec._anomalies.pending.clear()
        scaler.close()
    (flight,) = [r for r in records if isinstance(r, FlightRecord)]
    assert [e.step for e in flight.steps] == [1, 2] and flight.steps[0].peaks.device.type == "cpu"
    assert {e.device for e in flight.event._events} == {torch.device("cuda:0")}
    full = [r.step for r in records if isinstance(r, StepRecord) and isinstance(r.groups[0].stats, FullStats)]
    assert full == [0, 3, 4]


def test_a_parameter_whose_dtype_changes_mid_run_is_regrouped(tmp_path):
    """The gradient grouping is planned once; a model converted after a few steps (``p.data``
    replaced) is planned again at the next step with full statistics, so its rows say the new dtype."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    path = tmp_path / "run.parquet"
    scaler = ampdoctor.GradScaler("cpu", model=model, path=path, every=2, amp_dtype=torch.float16)
    for i, (x, y) in enumerate(batches(6)):
        if i == 3:
            model.double()
        x, y = (x, y) if i < 3 else (x.double(), y.double())
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    scaler.close()
    rows = read_run(path).frame.query("kind == 'param_grad'")
    assert set(rows.query("step < 3").dtype) == {"float32"} and set(rows.query("step >= 4").dtype) == {"float64"}


def test_block_statistics_on_cuda_neither_sync_nor_use_atomics():
    """Issue 42: the block statistics of a GEMM operand (stats.block_stats) on an accelerator:
    counts by sorting (no bincount, no atomics), no boolean selection (its size would be read on
    the host), the tensor amax kept on the device."""
    from ampdoctor.run_file.block_bins import EXP_BINS, Q_BINS, RATIO_BINS, RECIPES, REL_BINS
    from ampdoctor.stats.block_stats import block_stats

    with FakeTensorMode():
        x = torch.randn(64, 100, device="cuda", dtype=torch.bfloat16)
        with OpCounter() as counter:
            stats = block_stats(x)
    assert not FORBIDDEN & set(counter.ops), FORBIDDEN & set(counter.ops)
    assert stats.mx_rel.shape == (3, REL_BINS) and stats.mx_blocks.shape == (2, 3, EXP_BINS)
    assert stats.nv_q.shape == (Q_BINS,) and stats.nv_ratio.shape == (RATIO_BINS,)
    assert stats.measured.shape == (len(RECIPES), 4) and stats.mx_rel.device.type == "cuda"
