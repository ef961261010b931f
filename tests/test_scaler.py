"""Instrumented training is bit-for-bit the training of a plain torch.amp.GradScaler."""

from __future__ import annotations

import copy
import pickle
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampdoctor
from ampdoctor.read.run import read_run
from ampdoctor.run_file.schema import META_GROWTH_FACTOR
from models import MLP, SparseEmbeddingModel, TwoHeads, batches, mse

STEPS = 12
SCALER_ARGS = dict(init_scale=2.0**20, growth_interval=3)  # overflow at start, then growth and backoff


@dataclass
class Setup:
    model: nn.Module
    optimizers: list
    step: Callable  # step(scaler, i): forward, backward, unscale/clip, scaler.step for each optimizer


def _simple(model, opt, *, clip=False, accumulate=1, inject=None, dtype=torch.float16):
    data = batches(STEPS * accumulate, seed=1)

    def step(scaler, i):
        for k in range(accumulate):
            x, y = data[i * accumulate + k]
            scaler.scale(mse(model, x, y, dtype) / accumulate).backward()
        if inject and i in inject:
            model.fc1.weight.grad[0, 0] = inject[i]
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)

    return Setup(model, [opt], step)


def _case(name: str, dtype: torch.dtype) -> Setup:
    torch.manual_seed(0)
    if name in ("basic", "clip", "accumulation", "injected", "disabled"):
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return _simple(model, opt, clip=name == "clip", accumulate=2 if name == "accumulation" else 1,
                       inject={3: float("inf"), 6: float("nan")} if name == "injected" else None,
                       dtype=dtype)
    if name in ("fused", "foreach"):
        model = MLP()
        kw = {"fused": True} if name == "fused" else {"foreach": True}
        return _simple(model, torch.optim.AdamW(model.parameters(), lr=1e-2, **kw), dtype=dtype)
    if name == "two_optimizers":
        model = TwoHeads()
        opt_a = torch.optim.Adam([*model.trunk.parameters(), *model.head_a.parameters()], lr=1e-2)
        opt_b = torch.optim.SGD(model.head_b.parameters(), lr=0.1)
        data = batches(STEPS, seed=2)

        def step(scaler, i):
            x, y = data[i]
            with torch.autocast("cpu", dtype=dtype):
                a, b = model(x)
            la = F.mse_loss(a.float(), y)
            lb = F.mse_loss(b.float(), y[:, :2])
            scaler.scale(la).backward(retain_graph=True)
            scaler.scale(lb).backward()
            scaler.unscale_(opt_a)
            scaler.step(opt_a)
            scaler.step(opt_b)

        return Setup(model, [opt_a, opt_b], step)
    if name == "sparse":
        model = SparseEmbeddingModel()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(3)
        data = [(torch.randint(0, 50, (8, 5), generator=gen), torch.randn(8, 4, generator=gen))
                for _ in range(STEPS)]

        def step(scaler, i):
            idx, y = data[i]
            scaler.scale(mse(model, idx, y, dtype)).backward()
            scaler.step(opt)

        return Setup(model, [opt], step)
    raise ValueError(name)


@dataclass
class Outcome:
    params: list[torch.Tensor]
    scale: float
    tracker: int
    skipped: list[bool]


def train(case: str, make_scaler: Callable, *, dtype=torch.float16, mid_run: Callable | None = None) -> Outcome:
    setup = _case(case, dtype)
    scaler = make_scaler(setup.model)
    skipped = []
    for i in range(STEPS):
        if mid_run is not None:
            scaler = mid_run(scaler, i, setup.model)
        setup.step(scaler, i)
        skipped.append(scaler.is_enabled() and any(
            sum(v.item() for v in scaler._per_optimizer_states[id(o)]["found_inf_per_device"].values()) > 0
            for o in setup.optimizers))
        scaler.update()
        for o in setup.optimizers:
            o.zero_grad(set_to_none=True)
    if isinstance(scaler, ampdoctor.record.scaler._Recording):
        scaler.close()
    tracker = scaler._get_growth_tracker() if scaler.is_enabled() else 0
    return Outcome([p.detach().clone() for p in setup.model.parameters()], scaler.get_scale(), tracker,
                   skipped)


def assert_identical(a: Outcome, b: Outcome) -> None:
    assert len(a.params) == len(b.params)
    for pa, pb in zip(a.params, b.params):
        assert torch.equal(pa, pb)
    assert a.scale == b.scale
    assert a.tracker == b.tracker
    assert a.skipped == b.skipped


def assert_recorded(path, outcome: Outcome, steps: int = STEPS) -> None:
    """The run holds every step, and its skipped flags are the ones training really had."""
    frame = read_run(path).frame
    step_rows = frame[frame["kind"] == "step"].sort_values("step")
    assert step_rows["step"].tolist() == list(range(steps))
    assert step_rows["skipped"].tolist() == outcome.skipped[-steps:]
    assert (frame["kind"] == "param_grad").sum() > 0


def plain(enabled=True):
    return lambda model: torch.amp.GradScaler("cpu", enabled=enabled, **SCALER_ARGS)


def recording(path, enabled=True, **options):
    return lambda model: ampdoctor.GradScaler("cpu", enabled=enabled, model=model, path=path,
                                             **SCALER_ARGS, **options)


CASES = ["basic", "clip", "accumulation", "two_optimizers", "sparse", "injected", "fused", "foreach"]
DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _recorder_must_not_warn():
    """A recorder failure only warns; in these tests any such warning is a bug."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ampdoctor")
        yield


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_bit_for_bit(case, dtype, run_path):
    expected = train(case, plain(), dtype=dtype)
    got = train(case, recording(run_path), dtype=dtype)
    assert_identical(expected, got)
    assert_recorded(run_path, got)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_bit_for_bit_with_module_taps(case, dtype, run_path):
    """level="full": every module tapped, full statistics every 3rd step, peaks in between."""
    expected = train(case, plain(), dtype=dtype)
    got = train(case, recording(run_path, level="full", every=3), dtype=dtype)
    assert_identical(expected, got)
    assert_recorded(run_path, got)
    assert {"output", "grad_output"} <= set(read_run(run_path).frame.kind)


def test_cases_exercise_the_scaler():
    """Guard against a harness where nothing interesting happens: skips, growth, backoff."""
    out = train("injected", plain())
    assert out.skipped[3] and out.skipped[6]
    assert sum(out.skipped) >= 3
    assert out.scale != SCALER_ARGS["init_scale"]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_disabled_scaler(dtype, run_path):
    expected = train("basic", plain(enabled=False), dtype=dtype)
    got = train("basic", recording(run_path, enabled=False), dtype=dtype)
    assert_identical(expected, got)
    frame = read_run(run_path).frame
    steps = frame[frame.kind == "step"]
    assert len(steps) == STEPS and (steps.scale == 1.0).all() and not steps.skipped.any()
    assert (frame.kind == "param_grad").sum() == STEPS * 6


def test_wrap_is_bit_for_bit(run_path):
    expected = train("injected", plain())
    got = train("injected", lambda m: ampdoctor.wrap(plain()(m), model=m, path=run_path))
    assert_identical(expected, got)
    assert_recorded(run_path, got)


def test_state_dict_round_trip_mid_run(run_path):
    def reload(factory):
        def mid_run(scaler, i, model):
            if i != 5:
                return scaler
            state = scaler.state_dict()
            if isinstance(scaler, ampdoctor.record.scaler._Recording):
                scaler.close()
            fresh = factory(model)
            fresh.load_state_dict(state)
            return fresh
        return mid_run

    expected = train("injected", plain(), mid_run=reload(plain()))
    got = train("injected", recording(run_path), mid_run=reload(recording(run_path)))
    assert_identical(expected, got)
    assert_recorded(run_path, got)  # step numbering continues across the reload
    assert len(read_run(run_path).writers) == 2


def test_pickle_mid_run(run_path):
    def repickle(rewrap):
        def mid_run(scaler, i, model):
            if i != 5:
                return scaler
            clone = pickle.loads(pickle.dumps(scaler))
            if rewrap:
                assert clone.recorder is None  # a copy never writes into the same run by itself
                scaler.close()
                clone = ampdoctor.wrap(clone, model=model, path=run_path, start_step=i)
            return clone
        return mid_run

    expected = train("injected", plain(), mid_run=repickle(False))
    got = train("injected", recording(run_path), mid_run=repickle(True))
    assert_identical(expected, got)
    assert_recorded(run_path, got)


def test_wrap_mid_run_keeps_non_default_state(run_path):
    def wrap_at_5(scaler, i, model):
        if i == 5:
            assert scaler._get_growth_tracker() != 0 or scaler.get_scale() != SCALER_ARGS["init_scale"]
            return ampdoctor.wrap(scaler, model=model, path=run_path)
        return scaler

    expected = train("injected", plain())
    got = train("injected", plain(), mid_run=wrap_at_5)
    assert_identical(expected, got)
    assert_recorded(run_path, got, steps=STEPS - 5)


def test_wrap_keeps_identity_and_isinstance(run_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    holder = {"scaler": scaler}  # e.g. accelerator.scaler
    wrapped = ampdoctor.wrap(scaler, path=run_path)
    assert wrapped is scaler and holder["scaler"] is scaler
    assert isinstance(scaler, torch.amp.GradScaler)
    assert type(scaler).__name__ == "RecordingGradScaler"
    with pytest.raises(ValueError, match="already recording"):
        ampdoctor.wrap(scaler, path=run_path)
    ampdoctor.unwrap(scaler)
    assert type(scaler) is torch.amp.GradScaler
    assert scaler.get_scale() == 1024.0
    ampdoctor.unwrap(scaler)  # idempotent


def test_every_holder_records(run_path):
    """A framework that holds the scaler object records through it after wrap()."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    framework = type("Accelerator", (), {})()
    framework.scaler = torch.amp.GradScaler("cpu")
    ampdoctor.wrap(framework.scaler, model=model, path=run_path)
    for x, y in batches(3):
        framework.scaler.scale(mse(model, x, y)).backward()
        framework.scaler.step(opt)
        framework.scaler.update()
        opt.zero_grad()
    ampdoctor.unwrap(framework.scaler)
    frame = read_run(run_path).frame
    assert sorted(frame.loc[frame.kind == "param_grad", "name"].unique()) == sorted(
        n for n, _ in model.named_parameters())


def test_wrap_subclass_sharded_grad_scaler(run_path):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
    ampdoctor.wrap(scaler, path=run_path)
    assert isinstance(scaler, ShardedGradScaler)
    ampdoctor.unwrap(scaler)
    assert type(scaler) is ShardedGradScaler


@pytest.mark.parametrize("how", ["deepcopy"] + [f"protocol {p}" for p in range(pickle.HIGHEST_PROTOCOL + 1)]
                         + ["torch.save"])
def test_wrapped_scaler_pickles_as_plain_class(run_path, how):
    """Every protocol and torch.save (protocol 2's __newobj__ check once refused the generated
    subclass); the copy is the plain class with the same state and does not record."""
    import io

    def clone(obj):
        if how == "deepcopy":
            return copy.deepcopy(obj)
        if how == "torch.save":
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            buffer.seek(0)
            return torch.load(buffer, weights_only=False)
        return pickle.loads(pickle.dumps(obj, protocol=int(how.split()[1])))

    scaler = ampdoctor.wrap(torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=7), path=run_path / "w")
    copied = clone(scaler)
    assert type(copied) is torch.amp.GradScaler and copied.get_scale() == 8.0
    assert copied.get_growth_interval() == 7 and not hasattr(copied, "recorder")
    scaler.close()
    own = ampdoctor.GradScaler("cpu", init_scale=4.0, path=run_path / "g")
    copied = clone(own)
    assert type(copied) is ampdoctor.GradScaler and copied.get_scale() == 4.0 and copied.recorder is None
    own.close()


def test_copies_of_a_tapped_model_work_and_never_record(run_path):
    """EMA and SWA copies (deepcopy, AveragedModel), pickles and torch.save of a model that
    ampdoctor taps, taken before the first forward (the autocast sniffer is on) or mid-run: they
    work, and their forwards are never recorded as the original's."""
    import io

    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", model=model, path=run_path, level="full", every=1)
    early = copy.deepcopy(model)
    pickle.dumps(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    copies = [early]
    for i, (x, y) in enumerate(batches(4)):
        scaler.scale(mse(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if i == 1:
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            swa = torch.optim.swa_utils.AveragedModel(model)
            copies += [copy.deepcopy(model), swa, torch.load(buffer, weights_only=False),
                       pickle.loads(pickle.dumps(model))]
        if i >= 1:
            swa.update_parameters(model)
            with torch.no_grad():
                for c in copies:
                    c(x)
    scaler.close()
    frame = read_run(run_path).frame
    outputs = frame[frame.kind == "output"].groupby("step").size()
    assert outputs.nunique() == 1 and outputs.iloc[0] == outputs.loc[0]  # the copies added no rows
    torch.manual_seed(0)
    reference = MLP()
    _fit(torch.amp.GradScaler("cpu"), reference, 4, lr=0.01)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_context_manager_and_close_are_idempotent(run_path):
    with ampdoctor.GradScaler("cpu", path=run_path) as scaler:
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = batches(1)[0]
        scaler.scale(mse(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
    scaler.close()
    run = read_run(run_path)
    assert run.ended_cleanly and run.frame.step.max() == 0


def test_names_without_model(run_path):
    model = TwoHeads()
    opt = torch.optim.SGD([{"params": model.trunk.parameters()}, {"params": model.head_a.parameters()}],
                          lr=0.1)
    with ampdoctor.GradScaler("cpu", path=run_path) as scaler:
        x, y = batches(1)[0]
        with torch.autocast("cpu", dtype=torch.float16):
            a, _ = model(x)
        scaler.scale(F.mse_loss(a.float(), y)).backward()
        scaler.step(opt)
        scaler.update()
    names = set(read_run(run_path).frame.query("kind == 'param_grad'")["name"])
    assert names == {"group0.param0", "group0.param1", "group1.param0", "group1.param1"}


def test_every_and_level(tmp_path):
    def run(**options):
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.parquet"
        train("basic", recording(path, **options))
        return read_run(path).frame

    def full_stat_steps(frame, kind="param_grad"):
        rows = frame[(frame.kind == kind) & frame.n_zero.notna()]
        return set(rows.step)

    sampled = run(every=4, escalate_steps=0)
    # Every step has a row per parameter; only every 4th has the full statistics.
    assert set(sampled.query("kind == 'param_grad'").step) == set(range(STEPS))
    assert full_stat_steps(sampled) == full_stat_steps(sampled, "step") == {0, 4, 8}
    light = sampled[(sampled.kind == "param_grad") & sampled.n_zero.isna()]
    assert light["hist"].isna().all() and light.amin.isna().all()
    assert light[~light.skipped].l2.notna().all() and not np.isfinite(light[light.skipped].amax).all()
    assert (sampled.kind == "step").sum() == STEPS
    # After a skipped step, the next escalate_steps steps get the full statistics too.
    escalated = run(every=4, escalate_steps=2)
    frame = escalated.query("kind == 'step'")
    skipped = set(frame[frame.skipped].step)
    expected = {s for s in range(STEPS) if s % 4 == 0} | {s + k for s in skipped for k in (1, 2)}
    assert skipped and full_stat_steps(escalated) == expected & set(range(STEPS))
    steps_only = run(level="steps", every=1, escalate_steps=0)
    assert set(steps_only.kind) == {"step", "param"} and len(steps_only) == 2 * STEPS
    # The step row holds the whole model's gradient statistics at every level.
    full = run(every=1)
    a = full.query("kind == 'step'").set_index("step")
    b = steps_only.query("kind == 'step'").set_index("step")
    assert (a.numel == b.numel).all() and (a.n_zero == b.n_zero).all()
    assert (a.amax == b.amax).all()
    # Light rows measure the same peak and norm as the full statistics of the same training.
    full, sampled = (f.set_index(["step", "kind", "name"]) for f in (full, sampled))
    good = a.index[~a.skipped]
    rows = full.loc[(good, "param_grad", slice(None))]
    same = sampled.loc[rows.index]
    np.testing.assert_array_equal(same.amax.to_numpy(), rows.amax.to_numpy())
    np.testing.assert_allclose(same.l2.to_numpy(), rows.l2.to_numpy(), rtol=1e-5)


def test_loss_column_is_the_unscaled_loss(run_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with ampdoctor.GradScaler("cpu", model=model, path=run_path) as scaler:
        for x, y in batches(4):
            loss = mse(model, x, y)
            losses.append(loss.item())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    recorded = read_run(run_path).frame.query("kind == 'step'").sort_values("step")["loss"].tolist()
    assert recorded == pytest.approx(losses, rel=1e-6)


def test_invalid_options_raise_before_training():
    with pytest.raises(ValueError, match="level"):
        ampdoctor.GradScaler("cpu", path="x", level="everything")
    with pytest.raises(ValueError, match="every"):
        ampdoctor.GradScaler("cpu", path="x", every=0)
    with pytest.raises(ValueError, match="floating-point"):
        ampdoctor.GradScaler("cpu", path="x", amp_dtype=torch.int8)
    with pytest.raises(ValueError, match="check_params"):
        ampdoctor.GradScaler("cpu", path="x", check_params="sometimes")
    with pytest.raises(TypeError, match="GradScaler"):
        ampdoctor.wrap(object())


def test_parameter_check_is_sampled_unless_always(tmp_path):
    """check_params=True: after the sampled steps, the escalated steps after an anomaly, and at
    the end of the run; "always" and a disabled scaler: after every step. The values are each
    parameter's max |w| as the optimizer left it."""
    def param_steps(enabled=True, **options):
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.parquet"
        outcome = train("basic", recording(path, enabled=enabled, **options))
        frame = read_run(path).frame
        totals = frame[(frame.kind == "param") & (frame.name == "")]
        return sorted(totals.step), (totals.amax.iloc[-1] if len(totals) else None), outcome

    steps, last, outcome = param_steps(every=5, escalate_steps=0)
    assert steps == [0, 5, 10, STEPS - 1]
    assert last == max(float(p.detach().abs().max()) for p in outcome.params)
    assert param_steps(every=5, check_params="always")[0] == list(range(STEPS))
    assert param_steps(enabled=False, every=5)[0] == list(range(STEPS))
    assert param_steps(every=5, check_params=False)[0] == []


def test_module_statistics_are_sampled_less_often_by_default(tmp_path):
    """level="full": gradients get full statistics every 100 steps and module taps every 1000 by
    default; an explicit ``every`` applies to both unless ``module_every`` is given. Between
    module-sampled steps the taps keep only the flight recorder's peaks (written on anomalies)."""
    def full_stat_steps(frame, kinds):
        rows = frame[frame.kind.isin(kinds) & frame.n_zero.notna()]
        return sorted(set(rows.step))

    def record(**options):
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.parquet"
        train("basic", recording(path, level="full", escalate_steps=0, **options))
        return read_run(path).frame

    taps = ["output", "grad_output"]
    frame = record(start_step=95)  # steps 95..106: the gradient sample at 100, no module sample
    assert full_stat_steps(frame, ["param_grad"]) == [100] and full_stat_steps(frame, taps) == []
    frame = record(start_step=995)  # steps 995..1006: both at 1000
    assert full_stat_steps(frame, ["param_grad"]) == [1000] and full_stat_steps(frame, taps) == [1000]
    frame = record(every=5)
    assert full_stat_steps(frame, ["param_grad"]) == full_stat_steps(frame, taps) == [0, 5, 10]
    frame = record(every=5, module_every=4)
    assert full_stat_steps(frame, ["param_grad"]) == [0, 5, 10] and full_stat_steps(frame, taps) == [0, 4, 8]
    with pytest.raises(ValueError, match="module_every"):
        ampdoctor.GradScaler("cpu", path="x", module_every=0)


def _fit(scaler, model, steps: int, lr: float) -> None:
    """``steps`` plain SGD iterations of ``model`` through ``scaler`` on the shared batches."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches(steps):
        scaler.scale(mse(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


class MyScaler(ampdoctor.GradScaler):
    """A user's subclass (module level: pickle finds classes by name)."""

    def label(self):
        return "mine"


def test_a_subclass_of_ampdoctor_gradscaler_keeps_its_class_in_copies(run_path):
    scaler = MyScaler("cpu", init_scale=4.0, path=run_path)
    for clone in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        assert type(clone) is MyScaler and clone.label() == "mine" and clone.recorder is None
    ampdoctor.unwrap(scaler)
    assert type(scaler) is MyScaler


def test_a_disabled_scaler_writes_no_metadata_the_reader_must_ignore(run_path):
    """torch's disabled GradScaler has no growth settings: nothing empty is written, and the
    reader has nothing to warn about."""
    torch.manual_seed(0)
    model = MLP()
    scaler = ampdoctor.GradScaler("cpu", enabled=False, model=model, path=run_path)
    _fit(scaler, model, 3, lr=0.1)
    scaler.close()
    run = read_run(run_path)
    assert run.warnings == [] and META_GROWTH_FACTOR not in run.metadata
