"""`ampdoctor postmortem`: one scenario per cause, on real CPU fp16 runs of tiny models with faults
injected at known steps; plus a healthy run, a run killed right after the event, and a run recorded
at level="params"."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ampdoctor
from ampdoctor.read.run import read_run
from ampdoctor.cli.commands import main
from ampdoctor import render
from ampdoctor.analysis.nonfinite_cause import CAUSES
from ampdoctor.analysis.postmortem import postmortem_data
from models import MLP, DeepNet, NaNWritingSGD, set_at, train_with_faults

FAULT = 12  # the step every fault is injected at


def _nan_batch(i, x, y):
    if i == FAULT:
        x = x.clone()
        x[0, 0] = float("nan")
    return x, y


def _big_weights():
    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        model.fc1.weight.mul_(1e6)  # as a checkpoint trained in bf16/fp32 might hold
    return model


def _deep():
    torch.manual_seed(0)
    return DeepNet()


def _mlp():
    torch.manual_seed(0)
    return MLP()


def scenario(name, path, **extra):
    """Train the scenario's model with its fault; returns the model."""
    if name == "forward_overflow":
        m = _deep()
        return train_with_faults(path, m, before_step=set_at(m.blocks[1].inner.gain, "gain", 1e6, FAULT), **extra)
    if name == "backward_overflow":
        m = _deep()
        return train_with_faults(path, m, before_step=set_at(m.blocks[1].inner.boom, "factor", 1e4,
                                                             range(FAULT, 100)), **extra)
    if name == "nonfinite_input":
        return train_with_faults(path, _deep(), corrupt_batch=_nan_batch, **extra)
    if name == "divergence":
        return train_with_faults(path, _mlp(), lr=3.0, steps=60, **extra)
    if name == "big_weights":
        return train_with_faults(path, _big_weights(), steps=5, **extra)
    if name == "nonfinite_weights":
        return train_with_faults(path, _mlp(), optimizer=lambda ps: NaNWritingSGD(ps, bad_step=FAULT), **extra)
    if name == "healthy":
        return train_with_faults(path, _mlp(), **extra)
    raise ValueError(name)


EXPECTED = {  # scenario: (cause, origin name, origin step, a phrase the advice must contain)
    "forward_overflow": ("forward_overflow", "blocks.1.inner.gain", FAULT, "float32"),
    "backward_overflow": ("backward_overflow", "blocks.1.inner.boom", FAULT, "blocks.1.inner.boom"),
    "nonfinite_input": ("nonfinite_input", "inp", FAULT, f"batch of step {FAULT}"),
    "divergence": ("divergence", None, None, "learning rate"),
    "big_weights": ("forward_overflow", "fc1", 0, "bfloat16"),
    "nonfinite_weights": ("nonfinite_weights", "fc2.weight", FAULT, "optimizer"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("postmortem")
    out = {}
    for name in list(EXPECTED) + ["healthy"]:
        path = root / f"{name}.parquet"
        scenario(name, path, level="full")
        out[name] = path
    return out


@pytest.mark.parametrize("name", EXPECTED)
def test_cause_origin_and_advice(runs, name):
    pm = ampdoctor.postmortem(runs[name])
    cause, origin, step, phrase = EXPECTED[name]
    assert pm["status"] == "nonfinite"
    assert pm["cause"] == cause, pm
    assert pm["origin"]["rank"] == 0
    if origin is not None:
        assert pm["origin"]["name"] == origin and pm["origin"]["step"] == step, pm["origin"]
    else:  # divergence: where the growth finally overflowed, at the event
        assert pm["origin"]["name"] and pm["origin"]["step"] == pm["first_nonfinite_step"], pm["origin"]
    assert any(phrase in a for a in pm["advice"]), pm["advice"]
    assert pm["timeline"] and pm["timeline"][-1]["step"] == pm["first_nonfinite_step"]


def test_divergence_evidence_is_in_numbers(runs):
    pm = ampdoctor.postmortem(runs["divergence"])
    trend = pm["evidence"]["trend"]
    assert trend["loss_to"] >= 2 * trend["loss_from"] and trend["grad_norm_to"] >= 10 * trend["grad_norm_from"]
    assert any("clip_grad_norm_" in a for a in pm["advice"])


def test_big_weights_name_the_parameter(runs):
    pm = ampdoctor.postmortem(runs["big_weights"])
    assert pm["evidence"]["large_parameters"][0]["name"] == "fc1.weight"
    assert pm["evidence"]["large_parameters"][0]["amax"] > 65504


def test_nonfinite_weights_is_an_anomaly_with_param_rows(runs, tmp_path):
    """The sampled check sees the NaN weight once the NaN loss escalates recording; the steps in
    between were skipped (the weight unchanged), so the postmortem traces it back to FAULT. With
    check_params="always" the row is at FAULT itself."""
    frame = ampdoctor.load(runs["nonfinite_weights"])
    rows = frame[(frame.kind == "param") & (frame.name == "fc2.weight")]
    first = rows.step.min()
    steps = frame[frame.kind == "step"].set_index("step")
    assert FAULT < first <= FAULT + 3 and rows.amax.isna().all()
    assert steps.loc[FAULT + 1:first, "skipped"].all() and not steps.loc[FAULT, "skipped"]
    data = postmortem_data(read_run(runs["nonfinite_weights"]))
    description = data["event"]["description"]  # a finding: the steps as numbers, worded by the renderers
    assert description.code == "params_nonfinite_after_step" and description.values["checked"] == first
    pm = render.contract(data)
    assert pm["event"]["step"] == FAULT and f"check at step {first}" in pm["event"]["description"]
    always = tmp_path / "always.parquet"
    scenario("nonfinite_weights", always, level="params", check_params="always")
    frame = ampdoctor.load(always)
    rows = frame[(frame.kind == "param") & (frame.name == "")]
    assert list(rows.step) == list(range(30))
    assert rows.set_index("step").amax.isna().loc[FAULT:].all() and rows.amax.iloc[:FAULT].notna().all()
    assert ampdoctor.postmortem(always)["origin"]["step"] == FAULT


def test_healthy_run_says_healthy(runs):
    pm = ampdoctor.postmortem(runs["healthy"])
    assert pm["status"] == "healthy" and pm["cause"] is None and pm["advice"] == []
    assert "healthy" in render.postmortem(pm, "text")


POSTMORTEM_CONTRACT = {"status": str, "first_nonfinite_step": int, "cause": str,
                       "origin": {"name": (str, type(None)), "kind": (str, type(None)), "rank": int, "step": int},
                       "timeline": [dict], "advice": [str]}


@pytest.mark.parametrize("name", list(EXPECTED) + ["healthy"])
def test_every_format(runs, name, tmp_path):
    from contract_check import check_contract

    for fmt in ("text", "md", "json", "html"):
        out = tmp_path / f"pm.{fmt}"
        result = CliRunner().invoke(main, ["postmortem", str(runs[name]), "--format", fmt, "-o", str(out)])
        assert result.exit_code == 0, result.output
        text = out.read_text()
        if fmt == "json":
            data = json.loads(text)
            if name != "healthy":
                check_contract(data, POSTMORTEM_CONTRACT)
                assert data["cause"] in CAUSES
        if fmt == "text":
            assert max(len(line) for line in text.splitlines()) <= 100
        if fmt == "html":
            assert text.startswith("<!DOCTYPE html>")


def test_params_level_gives_the_cause_and_says_what_is_missing(tmp_path):
    """Without module rows at the event (escalation comes after it), the cause still follows from
    the step rows, and the output says the module detail is missing and how to get it."""
    path = tmp_path / "params.parquet"
    scenario("backward_overflow", path, level="params", escalate_steps=0)
    pm = ampdoctor.postmortem(path)
    assert pm["cause"] == "backward_overflow" and pm["origin"]["step"] == FAULT
    assert any("level='full'" in n for n in pm["notes"])
    path = tmp_path / "diverge.parquet"
    scenario("divergence", path, level="params", escalate_steps=0)
    assert ampdoctor.postmortem(path)["cause"] == "divergence"


def test_a_run_of_skips_whose_first_step_has_no_module_rows_says_where_its_origin_is_from(tmp_path):
    """At level='params' the escalation records module rows from the step after the first skip:
    the origin is that step's, and a note says the first skipped step's is not known."""
    path = tmp_path / "params.parquet"
    scenario("backward_overflow", path, level="params")
    frame = ampdoctor.load(path)
    with_rows = sorted(frame.loc[(frame.kind == "grad_output") & (frame.step >= FAULT), "step"].unique())
    assert with_rows and with_rows[0] > FAULT  # the run has no module rows at its first skipped step
    pm = ampdoctor.postmortem(path)
    assert (pm["cause"], pm["first_nonfinite_step"]) == ("backward_overflow", FAULT)
    assert (pm["origin"]["name"], pm["origin"]["step"]) == ("blocks.1.inner.boom", with_rows[0])
    assert any(f"the origin is from step {with_rows[0]}" in n and f"step {FAULT} has no module rows" in n
               for n in pm["notes"]), pm["notes"]
    assert all(o["first_step"] > with_rows[0] for o in pm["evidence"].get("later_origins", []))


@pytest.mark.parametrize("how", ["sigkill", "raise"])
def test_a_run_that_dies_right_after_the_event_still_explains_it(tmp_path, how):
    path = tmp_path / "dead.parquet"
    tests = Path(__file__).resolve().parent
    # SIGKILL right after the optimizer wrote the NaN leaves no later step to see it: only a
    # check after every step records it. An exception still closes the run at exit, which checks.
    die = f"kill_at={FAULT}, check_params='always'" if how == "sigkill" else "before_step=boom"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tests)!r})
        import torch
        from models import MLP, NaNWritingSGD, train_with_faults
        def boom(i):
            if i == {FAULT} + 1:
                raise RuntimeError("the training process dies")
        torch.manual_seed(0)
        train_with_faults({str(path)!r}, MLP(), optimizer=lambda ps: NaNWritingSGD(ps, bad_step={FAULT}),
                          flush_every=1000, flush_seconds=600, {die})
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    pm = ampdoctor.postmortem(path)
    assert pm["cause"] == "nonfinite_weights" and pm["origin"]["name"] == "fc2.weight"
    assert pm["origin"]["step"] == FAULT
    if how == "sigkill":
        assert any("did not end with close()" in n for n in pm["notes"])


def test_scale_collapse(tmp_path):
    """Gradients beyond fp16's range themselves: every scale down to below 1 overflows."""
    from models import train_recorded

    path = tmp_path / "collapse.parquet"
    train_recorded(path, steps=30, loss_factor=1e12, init_scale=2.0**4)
    pm = ampdoctor.postmortem(path)
    assert pm["cause"] == "scale_collapse", pm
    assert pm["evidence"]["min_scale"] < 1
    assert any("learning rate" in a or "clip" in a for a in pm["advice"])


def test_postmortem_html_opens_in_headless_chromium(runs, tmp_path):
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    page = tmp_path / "pm.html"
    page.write_text(render.postmortem(ampdoctor.postmortem(runs["forward_overflow"]), "html"))
    result = subprocess.run([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                             "--v=0", "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0 and "blocks.1.inner.gain" in result.stdout and "<svg" in result.stdout
    assert "CONSOLE" not in result.stderr and "Uncaught" not in result.stderr, result.stderr[-2000:]


def test_a_run_of_skipped_steps_waits_for_the_disk_once(tmp_path, monkeypatch):
    from ampdoctor.record.writer import RunWriter
    from models import train_recorded

    calls = []
    original = RunWriter.sync
    monkeypatch.setattr(RunWriter, "sync", lambda self, timeout=30.0: calls.append(1) or original(self, timeout))
    assert train_recorded(tmp_path / "skips.parquet", steps=20, loss_factor=1e20) == 20
    assert len(calls) == 1
    calls.clear()
    train_with_faults(tmp_path / "nan.parquet", _mlp(), corrupt_batch=lambda i, x, y: (x * float("nan"), y)
                      if i >= 5 else (x, y), steps=10)
    assert len(calls) == 5  # a non-finite loss always waits


EXIT_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import torch
import ampdoctor
from models import MLP, NaNWritingSGD, batches, mse
torch.manual_seed(0)
model = MLP()
opt = NaNWritingSGD(model.parameters(), bad_step={bad})
abandoned = ampdoctor.GradScaler("cpu", model=model, path={abandoned!r}, amp_dtype=torch.float16)
for x, y in batches(3):  # a run that is dropped, not closed: its scaler is gone at exit
    abandoned.scale(mse(model, x, y)).backward(); abandoned.step(opt); abandoned.update(); opt.zero_grad()
del abandoned
scaler = ampdoctor.GradScaler("cpu", model=model, path={path!r}, amp_dtype=torch.float16, start_step=3)
for i, (x, y) in enumerate(batches(20), start=3):
    scaler.scale(mse(model, x, y)).backward()
    scaler.step(opt)  # at step {bad} the optimizer writes a NaN into fc2.weight
    if i == {bad}:
        raise RuntimeError("the job dies between step() and update()")
    scaler.update()
    opt.zero_grad()
"""


def test_exit_checks_the_parameters_once_more(tmp_path):
    """Training dies between ``step()`` and ``update()`` of an unsampled step whose optimizer wrote
    a NaN: the check at interpreter exit records it at that step, and the postmortem names it.
    A scaler dropped earlier gets no check at exit (its run must not describe the later weights)."""
    bad = 7
    path, abandoned = tmp_path / "run.parquet", tmp_path / "abandoned.parquet"
    script = EXIT_SCRIPT.format(tests=str(Path(__file__).resolve().parent), bad=bad, path=str(path),
                                abandoned=str(abandoned))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "between step() and update()" in result.stderr
    assert "Exception ignored" not in result.stderr and "closing" not in result.stderr
    frame = ampdoctor.load(path)
    totals = frame[(frame.kind == "param") & (frame.name == "")]
    assert list(totals.step) == [bad] and totals.amax.isna().all()  # step 3 is not sampled (every=100)
    pm = ampdoctor.postmortem(path)
    assert pm["cause"] == "nonfinite_weights" and pm["origin"] == {"name": "fc2.weight", "kind": "param",
                                                                    "rank": 0, "step": bad}
    old = ampdoctor.load(abandoned)
    assert list(old[old.kind == "param"].step) == [0]  # the sampled step only


class AmplifyBackward(torch.nn.Module):
    """Identity forward; its backward multiplies the gradient by ``factor`` (in float16: 1e8 overflows)."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x):
        from models import Amplify

        return Amplify.apply(x, self.factor)


class GAN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.G = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
        self.D = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LeakyReLU(0.2), AmplifyBackward(),
                                     torch.nn.Linear(16, 1))


class GradientWatch:
    """The test's own ground truth, per step: whether ``D.2``'s backward turned a finite gradient
    into a non-finite one, and whether ``D.0``'s weight gradient went non-finite while every
    gradient w.r.t. its output was finite (an overflow in its own reduction)."""

    def __init__(self, gan: GAN) -> None:
        self.step = 0
        self.d2_made: set[int] = set()
        self.d0_weight_bad: set[int] = set()
        self.d0_output_bad: set[int] = set()
        gan.D[2].register_forward_hook(self._around_d2)
        gan.D[0].register_forward_hook(self._on_d0_output)
        gan.D[0].weight.register_hook(self._flag(self.d0_weight_bad))

    def _flag(self, steps: set):
        def hook(grad):
            if not torch.isfinite(grad).all():
                steps.add(self.step)
        return hook

    def _on_d0_output(self, module, args, out):
        out.register_hook(self._flag(self.d0_output_bad))

    def _around_d2(self, module, args, out):
        seen = {}
        step = self.step

        def keep(what):
            def hook(grad):
                seen[what] = bool(torch.isfinite(grad).all())
                if seen.get("output") and seen.get("input") is False:
                    self.d2_made.add(step)
            return hook

        out.register_hook(keep("output"))
        args[0].register_hook(keep("input"))

    def d0_own_overflow(self) -> set[int]:
        return self.d0_weight_bad - self.d0_output_bad


def test_a_run_of_skipped_steps_names_its_first_steps_origin(tmp_path):
    """Two optimizers, one scaler (a GAN). From step 6 the discriminator's backward overflows:
    first in ``D.2``'s backward (steps 6-7), then, as the scale falls, in ``D.0``'s weight
    gradient (a batch 2e4 times larger from step 8), which is the more frequent origin. The
    postmortem names the first skipped step's origin, and the later one as data."""
    from ampdoctor.analysis.report import report_data

    torch.manual_seed(0)
    gan = GAN()
    with torch.no_grad():
        gan.D[0].weight.mul_(0.01)  # the large batch makes large weight gradients, not activations
    watch = GradientWatch(gan)
    opt_d = torch.optim.SGD(gan.D.parameters(), lr=1e-4)
    opt_g = torch.optim.SGD(gan.G.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    path = tmp_path / "gan.parquet"
    skipped = []
    with ampdoctor.GradScaler("cpu", model=gan, path=path, level="full", init_scale=2.0**10) as scaler:
        for step in range(13):
            watch.step = step
            gan.D[2].factor = 1e8 if step in (6, 7) else 1.0
            real = (1 + 0.1 * torch.randn(8, 16, generator=gen)) * (2e4 if step >= 8 else 1.0)
            z = torch.randn(8, 8, generator=gen)
            opt_d.zero_grad()
            opt_g.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                fake = gan.G(z)
                loss_d = gan.D(fake.detach()).float().mean() - gan.D(real).float().mean()
                loss_g = -gan.D(fake).float().mean()
            scaler.scale(loss_d).backward()
            scaler.scale(loss_g).backward()
            before = scaler.get_scale()
            scaler.step(opt_d)
            scaler.step(opt_g)
            scaler.update()
            skipped.append(scaler.get_scale() < before)
    # Ground truth from the test's own hooks.
    first_steps, later_steps = sorted(watch.d2_made), sorted(watch.d0_own_overflow() - watch.d2_made)
    assert first_steps == [6, 7] and later_steps == list(range(8, 13))
    assert [s for s in range(13) if skipped[s]] == list(range(6, 13))

    pm = ampdoctor.postmortem(path)
    assert (pm["cause"], pm["event"]["kind"], pm["first_nonfinite_step"]) == ("backward_overflow", "skip_run", 6)
    assert pm["origin"] == {"name": "D.2", "kind": "grad_output", "rank": 0, "step": first_steps[0]}
    (later,) = pm["evidence"]["later_origins"]
    assert (later["name"], later["kind"], later["first_step"], later["last_step"], later["count"]) == (
        "D.0", "param_grad", later_steps[0], later_steps[-1], len(later_steps))
    assert any("`D.2`" in a for a in pm["advice"]), pm["advice"]
    # Every format says both; the report counts the same two origins.
    text = pm.text()
    assert "origin: D.2 (grad_output), step 6, rank 0" in text
    assert "later origins: D.0 (param_grad), 5 steps from 8 to 12, rank 0" in text
    assert "**later origins**: `D.0` (param\\_grad), 5 steps from 8 to 12, rank 0" in pm.markdown()
    assert "<dt>later origins</dt><dd><code>D.0</code> (param_grad), 5 steps from 8 to 12, rank 0" in pm.html()
    counted = {(o["name"], o["kind"]): (o["first_step"], o["last_step"])
               for o in render.contract(report_data(read_run(path)))["overflow_origins"]}
    assert counted == {("D.2", "grad_output"): (6, 7), ("D.0", "param_grad"): (8, 12)}
