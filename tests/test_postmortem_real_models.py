"""`ampdoctor postmortem` on third-party architectures (Hugging Face GPT-2, BERT and T5 from tiny
configs, and a nanoGPT-like model written here) with faults injected at known steps: a NaN in the
batch that reaches the model through an embedding sum, a NaN written into a weight between two
steps, weights that are NaN before the first step (a bad checkpoint), and runs that never go
non-finite but skip or underflow a lot.

The truth each diagnosis is checked against is measured here, independently of ampdoctor: the
first module whose output is non-finite comes from this file's own forward hooks on every
module (in execution order), the step from the injection and from the losses the loop saw, the
skipped steps from the scale the loop read back, and the underflow from a float32 backward of the
same batch compared with the fp16 one.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor import render
from architectures import Arch, NanoGPT, true_rate

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

INJECT = 5   # the step every fault is injected at (or after)
STEPS = 10
VOCAB = 64
SEQ = 12
TOKEN = 3    # the embedding row the weight faults write into; every batch holds it


# -- architectures -------------------------------------------------------------------------------

def gpt2(**config) -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32, **config)
    return transformers.GPT2LMHeadModel(cfg)


def bert() -> nn.Module:
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=VOCAB, max_position_embeddings=32)
    return transformers.BertForMaskedLM(cfg)


def t5() -> nn.Module:
    cfg = transformers.T5Config(d_model=32, d_ff=64, d_kv=8, num_heads=2, num_layers=2, num_decoder_layers=2,
                                vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg)


def nanogpt() -> nn.Module:
    """nanoGPT's shape (``architectures.NanoGPT``): token and position embeddings, pre-norm
    blocks, a head tied to the token embedding, the loss on float32 logits."""
    return NanoGPT(vocab=VOCAB, block=32)


ARCHS = {"gpt2": gpt2, "bert": bert, "t5": t5, "nanogpt": nanogpt}
EMBEDDING = {"gpt2": "transformer.wte.weight", "nanogpt": "wte.weight"}


def tokens(step: int, shape=(2, SEQ)) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(100 + step))
    ids[:, 0] = TOKEN
    return ids


def embeddings(step: int, nan: bool) -> torch.Tensor:
    x = torch.randn(2, SEQ, 32, generator=torch.Generator().manual_seed(200 + step)) * 0.02
    if nan:
        x[1, 4, 7] = float("nan")  # one feature of one position
    return x


def token_loss(model: nn.Module, step: int) -> torch.Tensor:
    ids = tokens(step)
    if isinstance(model, NanoGPT):
        return model(ids, ids)
    return model(input_ids=ids, labels=ids).loss


def embeds_loss(model: nn.Module, step: int) -> torch.Tensor:
    """The batch comes in as ``inputs_embeds``, with a NaN feature at step INJECT."""
    emb = embeddings(step, nan=step == INJECT)
    labels = tokens(step, (2, 8) if isinstance(model, transformers.T5ForConditionalGeneration) else (2, SEQ))
    return model(inputs_embeds=emb, labels=labels).loss


# -- the truth, measured with our own hooks ----------------------------------------------------------

def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


class FirstNonFinite:
    """Forward hooks on every module: the first (step, module) in execution order whose output
    holds a NaN or an inf."""

    def __init__(self, model: nn.Module) -> None:
        self.step = 0
        self.first: tuple[int, str] | None = None
        for name, module in model.named_modules():
            module.register_forward_hook(self._hook(name or "(model)"))

    def _hook(self, name):
        def hook(module, args, output):
            if self.first is None and any(t.is_floating_point() and not torch.isfinite(t).all()
                                          for t in _tensors(output)):
                self.first = (self.step, name)
        return hook


def train(path, model, loss, *, before_step=None, after_step=None, steps=STEPS, **options):
    """fp16 AMP on the CPU with AdamW and an ``ampdoctor.GradScaler``. Returns (the first
    non-finite module as our hooks saw it, the losses, the steps the scaler skipped)."""
    torch.set_num_threads(1)
    truth = FirstNonFinite(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = ampdoctor.GradScaler("cpu", model=model, path=path, amp_dtype=torch.float16, **options)
    start = options.get("start_step", 0)
    losses, skipped = [], []
    for i in range(start, start + steps):
        truth.step = i
        if before_step is not None:
            before_step(i)
        with torch.autocast("cpu", dtype=torch.float16):
            value = loss(model, i)
        losses.append(float(value.detach()))
        scaler.scale(value).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < before:
            skipped.append(i)
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(i)
    scaler.close()
    return truth.first, losses, skipped


def first_bad_loss(losses, start=0) -> int:
    return next(start + i for i, v in enumerate(losses) if not math.isfinite(v))


def check_advice(pm: dict, level: str) -> None:
    """Advice a user can act on: never to record at a level the run already had, and every
    format renders it."""
    if level == "full":
        assert not any("level='full'" in a for a in pm["advice"] + pm["notes"]), pm
    for fmt in ("text", "md", "html", "json"):
        assert render.postmortem(pm, fmt)
    assert max(len(line) for line in render.postmortem(pm, "text").splitlines()) <= 100


# -- a NaN in the batch -------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["gpt2", "bert", "t5"])
def test_nan_in_inputs_embeds_is_nonfinite_input(tmp_path, arch):
    """GPT-2 adds its position embedding (BERT also the token-type one) to ``inputs_embeds``
    before the first tapped module sees it; T5 feeds it to a dropout directly. Either way the
    NaN came with the batch."""
    torch.manual_seed(0)
    path = tmp_path / "run.parquet"
    (step, module), losses, _ = train(path, ARCHS[arch](), embeds_loss, level="full")
    assert step == INJECT == first_bad_loss(losses)
    pm = ampdoctor.postmortem(path)
    assert pm["cause"] == "nonfinite_input", pm
    assert pm["first_nonfinite_step"] == INJECT
    assert pm["origin"]["name"] == module and pm["origin"]["step"] == INJECT, (pm["origin"], module)
    assert any(f"the batch of step {INJECT}" in a for a in pm["advice"]), pm["advice"]
    assert not any("float32" in a or "bfloat16" in a for a in pm["advice"]), pm["advice"]
    check_advice(pm, "full")


def test_nan_in_the_batch_at_level_params_asks_for_module_rows(tmp_path):
    """At level="params" the flight recorder has no taps: nothing tells a NaN in the batch from
    an activation that overflowed, and the advice (rightly, here) is to record at level='full'."""
    torch.manual_seed(0)
    path = tmp_path / "run.parquet"
    _, losses, _ = train(path, gpt2(), embeds_loss)
    assert first_bad_loss(losses) == INJECT
    pm = ampdoctor.postmortem(path)
    assert pm["cause"] == "unknown" and pm["first_nonfinite_step"] == INJECT
    assert any("level='full'" in a for a in pm["advice"]), pm["advice"]


def test_an_attention_overflow_from_finite_modules_is_not_the_batch(tmp_path):
    """The other side of the rule above: a NaN made by untapped code (GPT-2's eager attention,
    its fp16 scores overflowing) from the finite outputs of deep modules is an overflow."""
    torch.manual_seed(0)
    model = gpt2()
    model.config._attn_implementation = "eager"
    current = [0]

    def before_step(i):
        current[0] = i

    # q and k 1000x larger at step INJECT: their fp16 dot products overflow inside the attention.
    model.transformer.h[1].attn.c_attn.register_forward_hook(
        lambda m, args, out: out * 1000.0 if current[0] == INJECT else out)

    path = tmp_path / "run.parquet"
    (step, module), losses, _ = train(path, model, token_loss, before_step=before_step, level="full")
    assert step == INJECT == first_bad_loss(losses)
    pm = ampdoctor.postmortem(path)
    assert pm["cause"] == "forward_overflow", pm
    assert pm["origin"]["name"] == module and pm["first_nonfinite_step"] == INJECT
    check_advice(pm, "full")


def test_a_full_run_without_module_rows_at_the_event_never_asks_for_level_full(tmp_path):
    """level="full" with the flight recorder off (flight_steps=0) has no module rows at an
    unsampled step: the advice says how to get them at the level the run already had."""
    torch.manual_seed(0)
    path = tmp_path / "run.parquet"
    _, losses, _ = train(path, gpt2(), embeds_loss, level="full", flight_steps=0)
    assert first_bad_loss(losses) == INJECT
    pm = ampdoctor.postmortem(path)
    assert pm["cause"] == "unknown" and pm["first_nonfinite_step"] == INJECT
    assert any("flight_steps" in a for a in pm["advice"]), pm["advice"]
    check_advice(pm, "full")


# -- a NaN written into a weight between steps ----------------------------------------------------------

def _write_nan_after(model, name, step, seen):
    """An ``after_step`` callback: after step ``step``'s update, check that every weight is still
    finite (the truth the run's check must agree with), then write a NaN into row TOKEN of
    ``name``, as user code or a bad load would."""
    param = dict(model.named_parameters())[name]

    def after_step(i):
        if i == step:
            seen.append(all(bool(torch.isfinite(p).all()) for p in model.parameters()))
            with torch.no_grad():
                param[TOKEN, 5] = float("nan")
    return after_step


@pytest.mark.parametrize("arch", ["gpt2", "nanogpt"])
def test_nan_written_into_an_embedding_row_between_steps(tmp_path, arch):
    """With a parameter check after every step, the weights were finite after step INJECT's
    optimizer step and non-finite from step INJECT + 1: written outside ``optimizer.step()``."""
    torch.manual_seed(0)
    model, name, finite = ARCHS[arch](), EMBEDDING[arch], []
    path = tmp_path / "run.parquet"
    (step, module), losses, _ = train(path, model, token_loss, after_step=_write_nan_after(model, name, INJECT, finite),
                                      level="full", check_params="always")
    assert finite == [True] and step == INJECT + 1 == first_bad_loss(losses)
    pm = ampdoctor.postmortem(path)
    assert pm["cause"] == "nonfinite_weights", pm
    assert pm["first_nonfinite_step"] == INJECT + 1
    assert pm["origin"] == {"name": name, "kind": "param", "rank": 0, "step": INJECT + 1}
    assert pm["evidence"]["written_by"] == "outside_optimizer" and pm["evidence"]["finite_at"] == INJECT
    assert module == name.rsplit(".", 1)[0]  # the embedding that reads the row is the first NaN output
    advice = " ".join(pm["advice"])
    assert "outside `optimizer.step()`" in advice and f"step {INJECT}" in advice
    assert "eps" not in advice and "optimizer wrote" not in advice
    check_advice(pm, "full")


def test_nan_written_between_steps_with_sampled_checks_says_what_it_cannot_tell(tmp_path):
    """With the default (sampled) check, no check ran between step INJECT's optimizer step and
    step INJECT + 1's forward: either wrote it, and the advice says both and how to tell."""
    torch.manual_seed(0)
    model, name, finite = gpt2(), EMBEDDING["gpt2"], []
    path = tmp_path / "run.parquet"
    _, losses, _ = train(path, model, token_loss, after_step=_write_nan_after(model, name, INJECT, finite),
                         level="full")
    assert first_bad_loss(losses) == INJECT + 1
    pm = ampdoctor.postmortem(path)
    assert pm["cause"] == "nonfinite_weights" and pm["origin"]["name"] == name
    assert pm["first_nonfinite_step"] == INJECT  # the last optimizer step that could have written it
    assert pm["evidence"]["written_by"] == "optimizer_or_outside"
    advice = " ".join(pm["advice"])
    assert "check_params='always'" in advice and "your code writes into the weights" in advice
    assert "optimizer wrote non-finite values" not in advice
    check_advice(pm, "full")


# -- weights that were NaN before the first step ------------------------------------------------------------

CHECKPOINT_FAULTS = {"gpt2": "transformer.wte.weight", "nanogpt": "h.0.mlp.0.weight"}


@pytest.mark.parametrize("arch", ["gpt2", "nanogpt"])
@pytest.mark.parametrize("level", ["full", "params"])
@pytest.mark.parametrize("start_step", [0, 100])
def test_weights_nan_before_the_first_step_are_a_bad_checkpoint(tmp_path, arch, level, start_step):
    torch.manual_seed(0)
    model, name = ARCHS[arch](), CHECKPOINT_FAULTS[arch]
    with torch.no_grad():  # as a checkpoint saved after its weights went NaN would load
        dict(model.named_parameters())[name][TOKEN, 5] = float("nan")
    path = tmp_path / "run.parquet"
    (step, _), losses, _ = train(path, model, token_loss, level=level, start_step=start_step, steps=6)
    assert step == start_step == first_bad_loss(losses, start_step)
    pm = ampdoctor.postmortem(path)
    assert pm["cause"] == "nonfinite_checkpoint", pm
    assert pm["first_nonfinite_step"] == start_step
    assert pm["origin"] == {"name": name, "kind": "param", "rank": 0, "step": start_step}
    advice = " ".join(pm["advice"])
    assert "before the first step" in advice and "checkpoint" in advice and name in advice
    assert "level='full'" not in advice and "eps" not in advice
    check_advice(pm, level)
    assert "non-finite checkpoint" in render.postmortem(pm, "text")


def test_weights_nan_without_parameter_checks_say_what_they_cannot_tell(tmp_path):
    """Without parameter checks a NaN embedding row looks like a NaN in the batch: the notes say so."""
    torch.manual_seed(0)
    model = gpt2()
    with torch.no_grad():
        model.transformer.wte.weight[TOKEN, 5] = float("nan")
    path = tmp_path / "run.parquet"
    train(path, model, token_loss, level="full", check_params=False, steps=3)
    pm = ampdoctor.postmortem(path)
    assert pm["origin"]["name"] == "transformer.wte"
    assert any("check_params=False" in n and "transformer.wte" in n for n in pm["notes"]), pm["notes"]


# -- healthy runs that still train badly -------------------------------------------------------------------------

def test_a_healthy_run_that_skips_many_steps_points_at_report(tmp_path):
    """A scale that grows every 2 steps overflows and backs off again and again: no run of 5
    skips, nothing non-finite, but many steps lost."""
    torch.manual_seed(0)
    path = tmp_path / "run.parquet"
    _, losses, skipped = train(path, gpt2(), token_loss, steps=30, init_scale=2.0**20, growth_interval=2)
    assert all(math.isfinite(v) for v in losses)
    assert len(skipped) / 30 >= 0.1, skipped
    pm = ampdoctor.postmortem(path)
    assert pm["status"] == "healthy" and pm["cause"] is None
    assert pm["evidence"]["skipped_steps"] == len(skipped)
    assert len(pm["advice"]) == 1 and f"ampdoctor report {path}" in pm["advice"][0], pm["advice"]
    assert f"{len(skipped)} of its 30 steps" in pm["advice"][0]
    text = render.postmortem(pm, "text")
    assert "healthy" in text and "ampdoctor report" in text
    assert "ampdoctor report" in render.postmortem(pm, "md") and "ampdoctor report" in render.postmortem(pm, "html")


def test_a_healthy_run_with_heavy_underflow_points_at_report(tmp_path):
    """A tiny loss at scale 1 that never grows: most gradient elements flush to zero in fp16."""
    torch.manual_seed(0)
    model = gpt2()
    factor = 1e-5
    truth = true_rate(Arch("gpt2", model, token_loss), 0, 1.0, factor)
    assert truth > 0.5, truth
    path = tmp_path / "run.parquet"
    train(path, model, lambda m, i: token_loss(m, i) * factor, steps=8, init_scale=1.0, growth_interval=10**6)
    pm = ampdoctor.postmortem(path)
    assert pm["status"] == "healthy"
    assert any("underflowed to zero" in a and "ampdoctor report" in a for a in pm["advice"]), pm


def test_a_healthy_run_that_trains_well_has_no_advice(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "run.parquet"
    _, _, skipped = train(path, gpt2(), token_loss)
    pm = ampdoctor.postmortem(path)
    assert skipped == [] and pm["status"] == "healthy" and pm["advice"] == []
