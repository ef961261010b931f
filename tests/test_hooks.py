"""Module taps: selection, the rows they write, odd module shapes, cost control, lifetime, compile."""

from __future__ import annotations

import gc
import re
import sys
import warnings
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.record.hooks import ROOT_NAME, select_modules
from ampdoctor.run_file.schema import GEMM_KINDS
from ampdoctor.analysis.origins import find_origins
from models import MLP, DeepNet, SharedNet, WithHead, batches, checkpointed, fit, mse, set_at

QUIET = dict(init_scale=2.0**10)


def record(model, path, data, **options):
    options = {"level": "full", **QUIET, **options}
    with ampdoctor.GradScaler("cpu", model=model, path=path, **options) as scaler:
        fit(model, scaler, data)
    return ampdoctor.load(path)


def final_params(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_same_training(make_model, data, path, **options):
    torch.manual_seed(0)
    plain_model = make_model()
    fit(plain_model, torch.amp.GradScaler("cpu", **QUIET), data)
    torch.manual_seed(0)
    model = make_model()
    frame = record(model, path, data, **options)
    for a, b in zip(final_params(plain_model), final_params(model)):
        assert torch.equal(a, b)
    return model, frame


def hooked_modules(model):
    return [name for name, m in model.named_modules()
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks]


# -- selection ---------------------------------------------------------------------------------

def test_default_selection_is_leaves_and_blocks_not_containers():
    names = [n for n, _ in select_modules(DeepNet())]
    assert ROOT_NAME in names and "blocks.0" in names and "blocks.1.inner.boom.lin" in names
    assert "blocks" not in names  # the ModuleList
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    assert [n for n, _ in select_modules(seq)] == ["0", "1"]


def test_selection_filters():
    model = DeepNet()
    assert [n for n, _ in select_modules(model, r"blocks\.\d+")] == ["blocks.0", "blocks.1"]
    assert [n for n, _ in select_modules(model, re.compile(r".*\.pre"))] == [
        "blocks.0.inner.pre", "blocks.1.inner.pre"]
    linears = [n for n, _ in select_modules(model, nn.Linear)]
    assert linears[0] == "inp" and linears[-1] == "head" and len(linears) == 6
    assert [n for n, _ in select_modules(model, ["inp", nn.LayerNorm])] == [
        "inp", "blocks.0.norm", "blocks.1.norm"]
    assert [n for n, _ in select_modules(model, lambda name, m: name.endswith("act"))] == [
        "blocks.0.act", "blocks.1.act"]
    with pytest.raises(TypeError):
        select_modules(model, 3)
    with pytest.raises(TypeError):
        select_modules(model, ["inp", 3])


def test_filtered_taps_write_only_selected_modules(run_path):
    frame = record(DeepNet(), run_path, batches(2), modules=nn.LayerNorm)
    assert set(frame[frame.kind.isin(["output", "grad_output"])].name) == {"blocks.0.norm", "blocks.1.norm"}


def test_full_level_needs_a_model(run_path):
    with pytest.raises(ValueError, match="model="):
        ampdoctor.GradScaler("cpu", path=run_path, level="full")
    plain = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="model="):
        ampdoctor.wrap(plain, path=run_path, level="full")
    assert type(plain) is torch.amp.GradScaler  # left untouched


# -- rows --------------------------------------------------------------------------------------

def test_rows_carry_order_call_parent_inputs(run_path):
    torch.manual_seed(0)
    frame = record(DeepNet(), run_path, batches(2))
    step0 = frame[(frame.step == 0) & ~frame.kind.isin(["param", *GEMM_KINDS])]  # param rows: peaks only; GEMM operands: their own
    out = step0[step0.kind == "output"].sort_values("order")
    grads = step0[step0.kind == "grad_output"].sort_values("order")
    assert out.order.tolist() == list(range(len(out))) and grads.order.tolist() == list(range(len(grads)))
    by_name = out.set_index("name")
    # Children return before their block; a block's call begins before its children's.
    assert by_name.loc["blocks.0.inner.pre", "order"] < by_name.loc["blocks.0", "order"]
    assert by_name.loc["blocks.0", "call"] < by_name.loc["blocks.0.inner.pre", "call"]
    assert by_name.loc["blocks.0.inner", "parent"] == by_name.loc["blocks.0", "call"]
    assert pd_isnull(by_name.loc[ROOT_NAME, "parent"])
    # inputs: direct (gain took pre's output) and through in-place ops (act took inner's output
    # after the in-place residual add).
    assert list(by_name.loc["blocks.0.inner.gain", "inputs"]) == [by_name.loc["blocks.0.inner.pre", "call"]]
    assert by_name.loc["blocks.0.inner.boom", "call"] in list(by_name.loc["blocks.0.act", "inputs"])
    # Backward runs in reverse: the head's output gradient is first, inp's last.
    assert grads.name.iloc[0] == "head" and grads.name.iloc[-1] == "inp"
    # Dtypes as autocast produced them; output statistics are not scaled, gradients are unscaled.
    assert by_name.loc["inp", "dtype"] == "float16"
    assert (step0.numel > 0).all() and step0["hist"].notna().all()


def _module_rows_with_and_without_repeats(monkeypatch, record_run) -> list[tuple]:
    """``record_run(reuse)`` (a recorded run's frame) with the repeat reused, then with every tensor
    reduced anew: per run, its module rows in step, kind and order, and its full_stats calls."""
    from ampdoctor.record import light_taps, recorder

    frames, calls = [], []
    real = recorder.full_stats
    monkeypatch.setattr(recorder, "full_stats", lambda tensors, **kw: calls.append(kw.get("lines")) or real(tensors, **kw))
    for reuse in (True, False):
        if not reuse:
            monkeypatch.setattr(light_taps.Repeat, "of", lambda self, tensor, compute: compute(tensor))
        calls.clear()
        frame = record_run(reuse)
        frames.append((frame[frame.kind.isin(["output", "grad_output"])].sort_values(["step", "kind", "order"])
                       .reset_index(drop=True), calls.count("features")))
    return frames


def test_a_tensor_two_modules_return_is_reduced_once_with_the_same_rows(tmp_path, monkeypatch):
    """A tensor seen twice in a row (DeepNet returns its head's output; a block returns its
    last child's) gets one full_stats call, and every row is what it is when each tensor is
    reduced anew."""
    def record_run(reuse):
        torch.manual_seed(0)
        return record(DeepNet(), tmp_path / f"{reuse}.parquet", batches(1))

    (reused, n_reused), (anew, n_anew) = _module_rows_with_and_without_repeats(monkeypatch, record_run)
    assert n_anew == len(anew) and n_reused <= n_anew - 2  # the model's output and its gradient at least
    stats = ["name", "numel", "amax", "amin", "n_zero", "n_nan", "n_inf", "l2"]
    assert reused[stats].equals(anew[stats])
    assert all(list(a) == list(b) for a, b in zip(reused["hist"], anew["hist"]))
    for kind in ("output", "grad_output"):
        rows = reused[reused.kind == kind].set_index("name")
        assert rows.loc[ROOT_NAME, stats[1:]].tolist() == rows.loc["head", stats[1:]].tolist()


def test_a_transformers_gpt2s_logits_are_reduced_once_with_the_same_rows(tmp_path, monkeypatch):
    """A third-party model: transformers' GPT-2 returns its lm_head's logits inside its output
    (checked here with a hook of the test's own). With the repeat reused, the rows of every module
    sampled step are those of each tensor reduced anew, with fewer full_stats calls."""
    pytest.importorskip("transformers")
    import architectures

    arch = architectures.build("gpt2")
    seen = []
    handle = arch.model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out))
    assert arch.model(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits is seen[0]
    handle.remove()

    def record_run(reuse):
        arch = architectures.build("gpt2")
        path = tmp_path / f"{reuse}.parquet"
        opt = torch.optim.SGD(arch.model.parameters(), lr=0.01)
        with ampdoctor.GradScaler("cpu", model=arch.model, path=path, level="full", every=1, module_every=1,
                                  init_scale=2.0**8) as scaler:
            for step in range(2):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = arch.loss(arch.model, step)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
        return ampdoctor.load(path)

    (reused, n_reused), (anew, n_anew) = _module_rows_with_and_without_repeats(monkeypatch, record_run)
    assert n_anew == len(anew) and n_reused <= n_anew - 2 * 2  # the logits, forward and backward, each step
    stats = ["step", "name", "numel", "amax", "amin", "n_zero", "n_nan", "n_inf", "l2"]
    assert reused[stats].equals(anew[stats])
    assert all(list(a) == list(b) for a, b in zip(reused["hist"], anew["hist"]))


def pd_isnull(value):
    return value is None or (isinstance(value, float) and np.isnan(value))


def test_gradient_rows_are_unscaled(run_path, tmp_path):
    """The same training at two loss scales records the same (unscaled) gradient magnitudes."""
    frames = []
    for k, scale in enumerate((2.0**4, 2.0**8)):
        torch.manual_seed(0)
        path = tmp_path / f"{k}.parquet"
        with ampdoctor.GradScaler("cpu", model=(m := MLP()), path=path, level="full",
                                  init_scale=scale, growth_interval=10**6) as scaler:
            fit(m, scaler, batches(1))
        frame = ampdoctor.load(path)
        frames.append(frame[frame.kind == "grad_output"].set_index("order"))
    a, b = frames
    assert (a.scale * 16 == b.scale).all()
    np.testing.assert_allclose(a.amax, b.amax, rtol=2e-3)  # fp16 rounding differs, units do not


def test_light_peaks_equal_full_amax(tmp_path):
    """A flight-recorder row's amax is exactly the full statistics' amax of the same tensor."""
    frames = []
    for every in (1, 100):
        torch.manual_seed(0)
        model = DeepNet()
        data = batches(4)
        before = amplify_at(model, {2})
        path = tmp_path / f"{every}.parquet"
        with ampdoctor.GradScaler("cpu", model=model, path=path, level="full", every=every,
                                  **QUIET) as scaler:
            fit(model, scaler, data, before_step=before)
        frame = ampdoctor.load(path)
        frames.append(frame[(frame.step == 1) & frame.kind.isin(["output", "grad_output"])]
                      .sort_values(["kind", "order"]).reset_index(drop=True))
    full, light = frames
    assert light.n_nan.isna().all() and full.n_nan.notna().all()
    assert (full.name == light.name).all()
    np.testing.assert_array_equal(full.amax.to_numpy(), light.amax.to_numpy())


class Structured(nn.Module):
    """Returns a tuple, a list, a dict, ints, integer tensors and None."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        return (h, [h * 2, 3]), {"h": h.tanh(), "idx": h.argmax(-1), "n": 7, "none": None}


class StructuredNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Structured()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        (h, (h2, _)), d = self.body(x)
        return self.head(h + h2 + d["h"] + d["idx"].unsqueeze(-1).float())


def test_structured_outputs_non_tensors_and_integer_tensors(run_path):
    _, frame = assert_same_training(StructuredNet, batches(3), run_path)
    body = frame[(frame.step == 0) & (frame.name == "body")]
    # Three floating-point tensors out (h, h*2, tanh(h)); the integer argmax, ints and None skipped.
    assert (body.kind == "output").sum() == 3 and (body.kind == "grad_output").sum() == 3
    assert body.call.nunique() == 1


def test_shared_module_calls_are_numbered_separately(run_path):
    frame = record(SharedNet(), run_path, batches(2))
    shared = frame[(frame.step == 0) & (frame.name == "shared")]
    assert (shared.kind == "output").sum() == 2 and (shared.kind == "grad_output").sum() == 2
    assert shared[shared.kind == "output"].call.nunique() == 2
    out = shared[shared.kind == "output"].sort_values("order")
    mid_call = frame[(frame.step == 0) & (frame.name == "mid") & (frame.kind == "output")].call.iloc[0]
    assert list(out.inputs.iloc[1]) == [mid_call]  # the second call took mid's output


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing(reentrant, run_path):
    _, frame = assert_same_training(lambda: checkpointed(reentrant), batches(3), run_path)
    step0 = frame[frame.step == 0]
    outputs = step0[step0.kind == "output"]
    # Recomputation in backward does not repeat forward rows.
    assert outputs.name.value_counts().max() == 1
    assert "blocks.1.inner.pre" in set(step0[step0.kind == "grad_output"].name)


def test_no_grad_and_eval_passes_record_forward_only(run_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    (x, y), (vx, _) = batches(2)
    with ampdoctor.GradScaler("cpu", model=model, path=run_path, level="full", **QUIET) as scaler:
        scaler.scale(mse(model, x, y)).backward()
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            model(vx)
        model.train()
        scaler.step(opt)
        scaler.update()
    frame = ampdoctor.load(run_path)
    counts = frame.groupby("kind").size()
    assert counts["output"] == 2 * counts["grad_output"]  # two forwards, one backward


@pytest.mark.parametrize("level", ["full", "params"])
def test_an_inference_mode_pass_is_not_tapped_and_recording_goes_on(run_path, level):
    """Inference tensors have no version counter: a validation pass under inference_mode between
    (and inside) steps, on module-sampled and light steps, is skipped, not a recorder failure."""
    torch.manual_seed(0)
    model = MLP()
    data = batches(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a recorder failure warns
        with ampdoctor.GradScaler("cpu", model=model, path=run_path, level=level, every=2, module_every=2,
                                  flight_steps=4, **QUIET) as scaler:
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for x, y in data:
                with torch.inference_mode():
                    model(x)  # before the step's own forward
                scaler.scale(mse(model, x, y)).backward()
                with torch.inference_mode(), torch.autocast("cpu", dtype=torch.float16):
                    model(x)  # between backward and step
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    frame = ampdoctor.load(run_path)
    assert sorted(frame.step.unique()) == [0, 1, 2, 3]
    if level == "full":  # module-sampled steps 0 and 2: one forward's rows, one backward's
        taps = frame[frame.step.isin([0, 2])].groupby("kind").size()
        assert taps["output"] == taps["grad_output"] > 0


# -- cost control: flight recorder and escalation ---------------------------------------------

def amplify_at(model, steps):
    return set_at(model.blocks[1].inner.boom, "factor", 1e8, steps)


def test_flight_recorder_writes_the_window_before_each_anomaly(run_path):
    torch.manual_seed(0)
    model = DeepNet()
    with ampdoctor.GradScaler("cpu", model=model, path=run_path, level="full", every=1000,
                              flight_steps=3, escalate_steps=2, **QUIET) as scaler:
        fit(model, scaler, batches(14), before_step=amplify_at(model, {6, 12}))
    frame = ampdoctor.load(run_path)
    modules = frame[frame.kind.isin(["output", "grad_output"])]
    light = modules[modules.n_nan.isna()]
    full = modules[modules.n_nan.notna()]
    # Step 0 is a sampled step (every=1000); the windows end at the anomalies; the two steps
    # after each anomaly are escalated to full detail.
    assert sorted(full.step.unique()) == [0, 7, 8, 13]
    assert sorted(light.step.unique()) == [4, 5, 6, 10, 11, 12]
    assert [o.step for o in find_origins(frame)] == [6, 12]


def test_escalation_at_params_level_installs_taps_only_for_a_while(run_path):
    torch.manual_seed(0)
    model = DeepNet()
    with ampdoctor.GradScaler("cpu", model=model, path=run_path, level="params", escalate_steps=3,
                              **QUIET) as scaler:
        assert hooked_modules(model) == [""]  # only the autocast-dtype sniffer on the model itself
        fit(model, scaler, batches(10), before_step=amplify_at(model, {2}))
        assert hooked_modules(model) == []  # escalation over: taps removed
    frame = ampdoctor.load(run_path)
    assert sorted(frame[frame.kind == "output"].step.unique()) == [3, 4, 5]
    assert find_origins(frame)[0].detail is None  # the anomaly itself had no module rows


def test_scale_floor_is_an_anomaly(run_path):
    torch.manual_seed(0)
    model = MLP()
    with ampdoctor.GradScaler("cpu", model=model, path=run_path, level="params", init_scale=2.0,
                              growth_interval=10**6, scale_floor=4.0, escalate_steps=2) as scaler:
        fit(model, scaler, batches(6))
    frame = ampdoctor.load(run_path)
    # Nothing was skipped, yet steps 1 and 2 are escalated (scale 2 < floor 4 at step 0, once).
    assert not frame.skipped.any()
    assert sorted(frame[frame.kind == "output"].step.unique()) == [1, 2]


# -- lifetime and failures ---------------------------------------------------------------------

def test_close_removes_every_hook_and_keeps_no_step_tensor(run_path):
    torch.manual_seed(0)
    model = DeepNet()
    refs = []

    def keep_weak(module, args, output):
        refs.append(weakref.ref(output))
        if output.requires_grad:
            output.register_hook(lambda g: refs.append(weakref.ref(g)))

    spies = [m.register_forward_hook(keep_weak) for m in model.modules()
             if isinstance(m, (nn.Linear, nn.LayerNorm))]
    scaler = ampdoctor.GradScaler("cpu", model=model, path=run_path, level="full", **QUIET)
    assert len(hooked_modules(model)) > 10
    fit(model, scaler, batches(3))
    for spy in spies:
        spy.remove()
    gc.collect()
    assert len(refs) > 20 and all(r() is None for r in refs)  # nothing outlives its step
    scaler.close()
    assert hooked_modules(model) == []
    assert ampdoctor.unwrap(scaler) is scaler


def test_unwrap_removes_the_taps(run_path):
    model = MLP()
    scaler = ampdoctor.wrap(torch.amp.GradScaler("cpu"), model=model, path=run_path, level="full")
    assert hooked_modules(model)
    ampdoctor.unwrap(scaler)
    assert hooked_modules(model) == []


def test_a_failing_tap_warns_once_and_training_is_unchanged(run_path, monkeypatch):
    import ampdoctor.record.hooks as hooks_module

    def broken(value):
        raise RuntimeError("boom in the tap")

    monkeypatch.setattr(hooks_module, "float_tensors", broken)
    data = batches(3)
    torch.manual_seed(0)
    expected = final_params(fit(DeepNet(), torch.amp.GradScaler("cpu", **QUIET), data))
    torch.manual_seed(0)
    model = DeepNet()
    with pytest.warns(RuntimeWarning, match="boom in the tap") as caught:
        with ampdoctor.GradScaler("cpu", model=model, path=run_path, level="full", **QUIET) as scaler:
            fit(model, scaler, data)
    assert len([w for w in caught if "ampdoctor" in str(w.message)]) == 1
    for a, b in zip(expected, final_params(model)):
        assert torch.equal(a, b)
    assert hooked_modules(model) == []


def test_a_failing_tap_raises_in_strict_mode(run_path, monkeypatch):
    import ampdoctor.record.light_taps as light_taps_module

    monkeypatch.setattr(light_taps_module, "extremes", lambda t: 1 / 0)
    model = DeepNet()
    with pytest.raises(ampdoctor.RecorderError, match="ZeroDivisionError"):
        with ampdoctor.GradScaler("cpu", model=model, path=run_path, level="full", every=5,
                                  strict=True, **QUIET) as scaler:
            fit(model, scaler, batches(3))


# -- torch.compile -----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_model_falls_back_to_params(backend, run_path):
    data = batches(3)
    torch.manual_seed(0)
    plain_model = MLP()
    compiled_plain = torch.compile(plain_model, backend=backend)
    fit(compiled_plain, torch.amp.GradScaler("cpu", **QUIET), data)
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend=backend)
    with pytest.warns(RuntimeWarning, match="torch.compile") as caught:
        frame = record(compiled, run_path, data)
    assert len([w for w in caught if "ampdoctor" in str(w.message)]) == 1
    for a, b in zip(final_params(plain_model), final_params(model)):
        assert torch.equal(a, b)
    assert set(frame.kind) == {"step", "param_grad", "param"}
    assert "fc1.weight" in set(frame.name)  # named without the _orig_mod. prefix


def test_model_compiled_after_the_scaler_is_detected(run_path):
    data = batches(3)
    torch.manual_seed(0)
    plain_model = MLP()
    fit(torch.compile(plain_model, backend="eager"), torch.amp.GradScaler("cpu", **QUIET), data)
    torch.manual_seed(0)
    model = MLP()
    with pytest.warns(RuntimeWarning, match="no module tap fired") as caught:
        with ampdoctor.GradScaler("cpu", model=model, path=run_path, level="full", **QUIET) as scaler:
            fit(torch.compile(model, backend="eager"), scaler, data)
    assert len([w for w in caught if "ampdoctor" in str(w.message)]) == 1
    for a, b in zip(final_params(plain_model), final_params(model)):
        assert torch.equal(a, b)
    assert hooked_modules(model) == []
    frame = ampdoctor.load(run_path)
    assert (frame.kind == "param_grad").any() and not (frame.kind == "output").any()


def test_interrupted_forward_leaves_no_stale_call_stack(run_path):
    """A KeyboardInterrupt inside forward skips always_call hooks; the next step starts clean."""
    class Interrupting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.interrupt = False

        def forward(self, x):
            if self.interrupt:
                raise KeyboardInterrupt
            return self.lin(x)

    torch.manual_seed(0)
    model = WithHead(Interrupting())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches(4)
    with ampdoctor.GradScaler("cpu", model=model, path=run_path, level="full", every=1, **QUIET) as scaler:
        for i, (x, y) in enumerate(data):
            model.body.interrupt = i == 1
            try:
                loss = mse(model, x, y)
            except KeyboardInterrupt:
                loss = mse(model.head, x, y)  # the user carries on with something else
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    frame = ampdoctor.load(run_path)
    roots = frame[(frame.kind == "output") & (frame.name == ROOT_NAME) & (frame.step >= 2)]
    assert len(roots) == 2 and roots.parent.isna().all()
    assert find_origins(frame) == []


def test_returned_parameters_get_no_lasting_hooks(run_path):
    class Returns(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(16))

        def forward(self):
            return self.w

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = Returns()
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(x * self.scale())

    model = Net()
    record(model, run_path, batches(5))
    assert not model.scale.w._backward_hooks


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_submodules_are_not_tapped(run_path):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ampdoctor")
        frame = record(WithHead(torch.jit.script(nn.Linear(16, 16))), run_path, batches(2))
    assert set(frame[frame.kind == "output"].name) == {"head", ROOT_NAME}


def test_rolling_back_drops_the_abandoned_flight_window(run_path):
    torch.manual_seed(0)
    model = DeepNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    boom = model.blocks[1].inner.boom
    data = batches(9)
    with ampdoctor.GradScaler("cpu", model=model, path=run_path, level="full", every=100,
                              flight_steps=8, **QUIET) as scaler:
        for i, (x, y) in enumerate(data):
            if i == 2:
                checkpoint_state = scaler.state_dict()
            if i == 6:
                scaler.load_state_dict(checkpoint_state)  # back to step 2
            boom.factor = 1e8 if i == 7 else 1.0  # recorded as step 3
            scaler.scale(mse(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    frame = ampdoctor.load(run_path)
    light = frame[frame.kind.isin(["output", "grad_output"]) & frame.n_nan.isna()]
    assert sorted(light.step.unique()) == [2, 3]
    assert not light.duplicated(["step", "kind", "order"]).any()
    assert [o.step for o in find_origins(frame)] == [3]


@pytest.mark.parametrize("steps_before", [0, 2])
def test_a_scaler_dropped_without_close_stops_its_taps(tmp_path, steps_before):
    """A recording scaler dropped without ``close()`` (a notebook cell run again) leaves its hooks
    on the model, and they hold its recorder: before the fix it went on recording every forward
    and backward of the model that a new scaler trains, at full statistics forever when it was
    dropped before its first ``update()``. Now its taps stop when the scaler is collected: the
    new scaler's steps dispatch the ops of a scaler alone on a fresh copy of the model, and the
    old recorder keeps nothing."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from host_cost import OpCounter

    def ops_per_step(model, scaler, x, y):
        with OpCounter() as counter:
            fit(model, scaler, [(x, y)])
        return counter.launches

    torch.manual_seed(0)
    model = MLP()
    data = batches(4)
    old = ampdoctor.GradScaler("cpu", model=model, path=tmp_path / "old.parquet", level="full", **QUIET)
    fit(model, old, data[:steps_before])
    recorder = weakref.ref(old.recorder)
    del old
    gc.collect()
    assert recorder() is not None  # (kept alive by its hooks on the model)
    twin = MLP()
    twin.load_state_dict(model.state_dict())
    with ampdoctor.GradScaler("cpu", model=model, path=tmp_path / "new.parquet", level="full", **QUIET) as new, \
            ampdoctor.GradScaler("cpu", model=twin, path=tmp_path / "twin.parquet", level="full", **QUIET) as alone:
        for x, y in data[:2]:  # past the first (module-sampled) step
            fit(model, new, [(x, y)])
            fit(twin, alone, [(x, y)])
        x, y = data[2]
        shared, fresh = ops_per_step(model, new, x, y), ops_per_step(twin, alone, x, y)
        assert shared == fresh  # without the fix: 512 against 72 (dropped at step 0), 80 (at step 2)
    old_recorder = recorder()
    assert not old_recorder._tap_obs and old_recorder._light_taps._count == 0
    assert old_recorder.step == steps_before
