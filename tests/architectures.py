"""Third-party architectures from tiny configs, and the ground truth a diagnosis is checked against.

Each builder returns an :class:`Arch`: the model, and ``batch(seed)`` → ``loss_fn(model)`` computing
the loss of one deterministic batch the way that architecture's users do (Hugging Face models with
``labels=``, so the loss is computed inside the model). Widths are tiny (fp16 matmuls are slow on
the CPU). Nothing is downloaded: every model is built from a config.

Ground truth is measured here, independently of ampdoctor: :func:`true_underflow` runs the same
batch on the same weights in float32 (autocast off) and counts, per parameter, the gradient
elements that are nonzero there but exactly zero in the fp16 AMP backward. An element whose float32
value is rounding noise (a float64 backward disagrees with it by more than half: a gradient that is
mathematically zero, such as an attention key bias's, where softmax ignores a shift per query) is
undecided: whether fp16 gives exactly 0 there is chance, not the loss scale, and an estimate may
count it either way.
Every backward of a batch draws the same dropout masks (the same seed), so the passes compare.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

transformers = None
try:  # the real-architecture tests skip without it (it is in the test extra)
    import transformers
    transformers.logging.set_verbosity_error()
except ImportError:  # pragma: no cover
    pass


@dataclass
class Arch:
    name: str
    model: nn.Module
    loss: Callable[[nn.Module, int], torch.Tensor]   # (model, step) → the loss of that step's batch


def _tokens(step: int, shape, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, shape, generator=gen)


def _images(step: int, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2000 + step)
    return torch.randn(shape, generator=gen)


def _causal_lm(name: str, model: nn.Module) -> Arch:
    """A causal language model's loss on its own next tokens (``labels=`` the inputs)."""
    vocab = model.config.vocab_size

    def loss(m, step):
        ids = _tokens(step, (2, 12), vocab)
        return m(input_ids=ids, labels=ids).loss

    return Arch(name, model, loss)


def gpt2() -> Arch:
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return _causal_lm("gpt2", transformers.GPT2LMHeadModel(cfg))


def t5() -> Arch:
    cfg = transformers.T5Config(d_model=32, d_ff=64, d_kv=8, num_heads=2, num_layers=2, num_decoder_layers=2,
                                vocab_size=96, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg)

    def loss(m, step):
        src = _tokens(step, (2, 10), cfg.vocab_size)
        tgt = _tokens(step + 500, (2, 6), cfg.vocab_size)
        return m(input_ids=src, labels=tgt).loss

    return Arch("t5", model, loss)


def vit() -> Arch:
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, num_labels=5,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.ViTForImageClassification(cfg)

    def loss(m, step):
        x = _images(step, (4, 3, 16, 16))
        y = _tokens(step, (4,), cfg.num_labels)
        return m(pixel_values=x, labels=y).loss

    return Arch("vit", model, loss)


def bert() -> Arch:
    cfg = transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=16, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForSequenceClassification(cfg)

    def loss(m, step):
        ids = _tokens(step, (4, 10), cfg.vocab_size)
        mask = torch.ones_like(ids)
        mask[:, 7:] = 0  # padding: masked attention
        y = _tokens(step, (4,), cfg.num_labels)
        return m(input_ids=ids, attention_mask=mask, labels=y).loss

    return Arch("bert", model, loss)


class ReluMLP(nn.Module):
    """A plain ReLU MLP (dead units give structural zeros)."""

    def __init__(self, d_in: int = 16, width: int = 48, d_out: int = 6, depth: int = 3, inplace: bool = False):
        super().__init__()
        dims = [d_in] + [width] * depth
        layers: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU(inplace=inplace)]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, d_out)

    def forward(self, x):
        return self.head(self.body(x))


def relu_mlp(inplace: bool = False) -> Arch:
    model = ReluMLP(inplace=inplace)

    def loss(m, step):
        x = _images(step, (16, 16))
        y = _tokens(step, (16,), 6)
        return F.cross_entropy(m(x).float(), y)

    return Arch("relu_mlp", model, loss)


class SmallCNN(nn.Module):
    """Conv → BatchNorm → ReLU twice, pooling, a linear classifier."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Linear(16, classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def cnn() -> Arch:
    model = SmallCNN()

    def loss(m, step):
        x = _images(step, (4, 3, 8, 8))
        y = _tokens(step, (4,), 5)
        return F.cross_entropy(m(x).float(), y)

    return Arch("cnn", model, loss)


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))


class NanoBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """karpathy's nanoGPT ``model.py`` in miniature: token + position embeddings, pre-LN blocks,
    weight-tied head, cross-entropy computed in the model's forward."""

    def __init__(self, vocab: int = 96, block: int = 16, d: int = 32, layers: int = 2, heads: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.h = nn.ModuleList(NanoBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def nanogpt() -> Arch:
    model = NanoGPT()

    def loss(m, step):
        ids = _tokens(step, (2, 13), 96)
        return m(ids[:, :-1], ids[:, 1:])

    return Arch("nanogpt", model, loss)


class LSTMLM(nn.Module):
    """A word-level LSTM language model, PyTorch's ``examples/word_language_model`` in miniature:
    embedding, 2 stacked LSTM layers, linear decoder. The layers are ``nn.LSTMCell`` stepped over
    time: ``nn.LSTM``'s fused CPU kernel (oneDNN) refuses float16 autocast."""

    def __init__(self, vocab: int = 96, d: int = 32, layers: int = 2):
        super().__init__()
        self.encoder = nn.Embedding(vocab, d)
        self.cells = nn.ModuleList(nn.LSTMCell(d, d) for _ in range(layers))
        self.decoder = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.encoder(idx)
        for cell in self.cells:
            h = c = x.new_zeros(x.shape[0], cell.hidden_size)
            outs = []
            for t in range(x.shape[1]):
                h, c = cell(x[:, t], (h, c))
                outs.append(h)
            x = torch.stack(outs, dim=1)
        return self.decoder(x)


def lstm() -> Arch:
    model = LSTMLM()

    def loss(m, step):
        ids = _tokens(step, (2, 13), 96)
        logits = m(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1))

    return Arch("lstm", model, loss)


def llama() -> Arch:
    """A LLaMA-style decoder (RMSNorm, SwiGLU, rotary positions), for the block formats' tests."""
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return _causal_lm("llama", transformers.LlamaForCausalLM(cfg))


HF = {"gpt2": gpt2, "t5": t5, "vit": vit, "bert": bert}
PLAIN = {"relu_mlp": relu_mlp, "cnn": cnn, "nanogpt": nanogpt, "lstm": lstm}
MORE = {"llama": llama}  # (not in the underflow tests' parametrisations)


def build(name: str, seed: int = 0) -> Arch:
    torch.manual_seed(seed)
    return {**HF, **PLAIN, **MORE}[name]()


def amp_grads(arch: Arch, step: int, scale: float, loss_factor: float = 1.0) -> dict[str, torch.Tensor]:
    """The fp16 autocast backward of ``step``'s batch at loss scale ``scale``, unscaled (as the
    optimizer would see it); zeros stay zeros."""
    grads, _ = _backward(arch.model, arch, step, loss_factor, scale)
    return {n: g / scale for n, g in grads.items()}


def fp32_grads(arch: Arch, step: int, loss_factor: float = 1.0) -> dict[str, torch.Tensor]:
    """The same batch on the same weights in float32: the reference."""
    return _backward(arch.model, arch, step, loss_factor)[0]


def fp64_grads(arch: Arch, step: int, loss_factor: float = 1.0) -> dict[str, torch.Tensor]:
    """The same batch on a float64 copy of the weights: tells the float32 reference's rounding
    noise from its values."""
    return _backward(_float64_copy(arch.model), arch, step, loss_factor)[0]


def _float64_copy(model: nn.Module) -> nn.Module:
    model = copy.deepcopy(model).double()

    def to_double(module, args, kwargs):
        cast = lambda v: v.double() if torch.is_tensor(v) and v.is_floating_point() else v  # noqa: E731
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    model.register_forward_pre_hook(to_double, with_kwargs=True)
    return model


def _backward(model: nn.Module, arch: Arch, step: int, loss_factor: float, scale: float | None = None,
              outputs: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]]]:
    """One backward of ``step``'s batch: fp16 autocast with the loss times ``scale``, or without
    autocast (``scale=None``). Returns the parameter gradients and, with ``outputs``, each
    module's output gradients (every floating output of every call, in forward order)."""
    captured: dict[str, list[list[torch.Tensor]]] = {}
    handles = []
    if outputs:
        for name, module in model.named_modules():
            handles.append(module.register_forward_hook(_capture_output_grads(captured.setdefault(name or "(model)", []))))
    model.zero_grad(set_to_none=True)
    try:
        with _same_dropout(step):
            with torch.autocast("cpu", dtype=torch.float16, enabled=scale is not None):
                loss = arch.loss(model, step) * loss_factor
            # Outside autocast, as training runs it: autocast would recast the backward's ops too.
            (loss.float() * scale if scale is not None else loss).backward()
    finally:
        for handle in handles:
            handle.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads, {name: [slot[0] if slot else None for slot in slots] for name, slots in captured.items()}


def _capture_output_grads(slots: list):
    def hook(module, args, output):
        for t in _floating(output):
            if t.requires_grad:
                slot: list[torch.Tensor] = []
                slots.append(slot)
                t.register_hook(lambda g, slot=slot: slot.append(g.detach().clone()))
    return hook


def _floating(value):
    if torch.is_tensor(value):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _floating(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _floating(v)


@contextlib.contextmanager
def _same_dropout(step: int):
    """The same random numbers for every backward of ``step``'s batch (dropout masks agree across
    dtypes for the same seed), without touching the caller's random state."""
    with torch.random.fork_rng():
        torch.manual_seed(10_000 + step)
        yield


@dataclass
class Truth:
    """One parameter's true underflow: ``lost`` elements nonzero in float32 but exactly 0 in the
    AMP backward, ``undecided`` elements 0 in the AMP backward whose float32 value is rounding noise
    (they may be counted either way), of ``numel``."""

    lost: int
    undecided: int
    numel: int

    @property
    def rate(self) -> float:
        return self.lost / self.numel

    @property
    def undecided_rate(self) -> float:
        return self.undecided / self.numel


def true_underflow(arch: Arch, step: int, amp: dict[str, torch.Tensor], loss_factor: float = 1.0) -> dict[str, Truth]:
    """Per parameter, the truth about the AMP backward ``amp`` of ``step``'s batch."""
    reference, exact = fp32_grads(arch, step, loss_factor), fp64_grads(arch, step, loss_factor)
    return {name: Truth(*_judge(amp.get(name), ref, exact[name]), ref.numel()) for name, ref in reference.items()}


def _judge(amp: torch.Tensor | None, ref: torch.Tensor, exact: torch.Tensor) -> tuple[int, int]:
    """(lost, undecided) elements of one tensor: 0 in the AMP backward ``amp`` (None: not
    computed), nonzero in float32 ``ref``; undecided where ``ref`` is rounding noise of ``exact``."""
    noise = (ref.double() - exact.double()).abs() > 0.5 * exact.double().abs()
    zero = (amp == 0) if amp is not None else torch.ones_like(ref, dtype=torch.bool)
    return int(((ref != 0) & ~noise & zero).sum()), int((noise & zero).sum())


def true_output_underflow(arch: Arch, step: int, scale: float, loss_factor: float = 1.0) -> dict[str, Truth]:
    """Per module: the truth about its output gradients (every floating output of every call) in
    the fp16 AMP backward of ``step``'s batch at ``scale``."""
    _, amp = _backward(arch.model, arch, step, loss_factor, scale, outputs=True)
    _, ref = _backward(arch.model, arch, step, loss_factor, outputs=True)
    _, exact = _backward(_float64_copy(arch.model), arch, step, loss_factor, outputs=True)
    out = {}
    for name, refs in ref.items():
        lost = undecided = numel = 0
        for a, r, e in zip(amp.get(name, []), refs, exact.get(name, [])):
            if r is None or e is None or a is None:
                continue  # that output got no gradient in some pass
            one = _judge(a, r, e)
            lost, undecided, numel = lost + one[0], undecided + one[1], numel + r.numel()
        if numel:
            out[name] = Truth(lost, undecided, numel)
    return out


def overall(truth: dict[str, Truth]) -> float:
    """The true underflow over all parameters: lost elements over all elements."""
    return sum(t.lost for t in truth.values()) / sum(t.numel for t in truth.values())


def true_rate(arch: Arch, step: int, scale: float, loss_factor: float = 1.0) -> float:
    """The true underflow of ``step``'s batch on the model's current weights at loss scale ``scale``."""
    return overall(true_underflow(arch, step, amp_grads(arch, step, scale, loss_factor), loss_factor))


@dataclass
class RunTruth:
    """What :func:`train_recorded` measured beside a recorded run.

    ``params[step]`` / ``outputs[step]``: per parameter / module, the truth of that step's AMP
    backward (:func:`true_underflow`, :func:`true_output_underflow`), on the steps the recorder gave
    full statistics (parameter gradients) and full module statistics (output gradients), leaving out
    a tensor that held an inf or NaN (the report does not judge those). ``applied[step]``: the lost
    and all elements over every parameter gradient of each applied (not skipped) step, where
    ``every_step_truth`` asked for it. ``scales[step]``: the loss scale the step's backward used."""

    params: dict[int, dict[str, Truth]]
    outputs: dict[int, dict[str, Truth]]
    applied: dict[int, tuple[int, int, int]]  # step -> (lost, undecided, numel)
    scales: dict[int, float]

    def averaged(self, kind: str = "param_grad") -> dict[str, Truth]:
        """Per tensor, the truth summed over the judged steps, as the report's layers table sums
        the rows of its sampled steps."""
        out: dict[str, Truth] = {}
        for per_step in (self.params if kind == "param_grad" else self.outputs).values():
            for name, t in per_step.items():
                s = out.setdefault(name, Truth(0, 0, 0))
                s.lost, s.undecided, s.numel = s.lost + t.lost, s.undecided + t.undecided, s.numel + t.numel
        return out

    def run_rate(self) -> tuple[float, float]:
        """(lost, lost + undecided) over all elements of the applied steps' parameter gradients."""
        lost = sum(v[0] for v in self.applied.values())
        undecided = sum(v[1] for v in self.applied.values())
        numel = sum(v[2] for v in self.applied.values()) or 1
        return lost / numel, (lost + undecided) / numel


def train_recorded(name: str, path, steps: int, *, init_scale: float, loss_factor: float = 1.0,
                   lr: float = 1e-3, seed: int = 0, outputs: bool = True, every_step_truth: bool = False,
                   loss_factor_at=None, **settings) -> RunTruth:
    """Train architecture ``name`` for ``steps`` fp16 AMP steps with Adam, recorded to ``path`` at
    ``level="full"`` with the recorder's defaults unless ``settings`` say otherwise (``every``,
    ``measure_every``, ...; the scale held unless ``growth_interval`` is given), and measure the
    truth beside it: before each step the recorder gives full statistics, a second copy of the
    model takes the training weights and runs the step's batch in float32 and float64 (and, for the
    module output gradients, in fp16 at the step's scale), with hooks of its own; the training
    model's AMP gradients are read after its backward. ``loss_factor_at(step)``, when given,
    multiplies the loss factor per step (gradients that shrink over the run)."""
    import ampdoctor

    arch, ref = build(name, seed), build(name, seed)
    model = arch.model
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    settings.setdefault("growth_interval", 10**6)
    scaler = ampdoctor.GradScaler("cpu", init_scale=init_scale, model=model, path=path, amp_dtype=torch.float16,
                                  level="full", **settings)
    plan = scaler.recorder._plan
    truth = RunTruth({}, {}, {}, {})
    try:
        for step in range(steps):
            factor = loss_factor * (loss_factor_at(step) if loss_factor_at is not None else 1.0)
            scale = float(scaler.get_scale())
            truth.scales[step] = scale
            full = plan.gradient_stats(step) == "full"
            module_full = outputs and plan.module_stats(step) == "full"
            refs = None
            if full or every_step_truth:
                ref.model.load_state_dict(model.state_dict())
                refs = fp32_grads(ref, step, factor), fp64_grads(ref, step, factor)
            if module_full:
                truth.outputs[step] = {n: t for n, t in _output_truth(ref, step, scale, factor).items()}
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = arch.loss(model, step) * factor
            scaler.scale(loss).backward()
            if refs is not None:
                amp = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
                judged = {n: Truth(*_judge(amp.get(n), r, refs[1][n]), r.numel()) for n, r in refs[0].items()}
                finite = {n for n, g in amp.items() if bool(torch.isfinite(g).all())}
                skipped = len(finite) < len(amp)
                if full:
                    truth.params[step] = {n: t for n, t in judged.items() if n in finite or n not in amp}
                if every_step_truth and not skipped:
                    truth.applied[step] = (sum(t.lost for t in judged.values()),
                                           sum(t.undecided for t in judged.values()),
                                           sum(t.numel for t in judged.values()))
            scaler.step(opt)
            scaler.update()
    finally:
        scaler.close()
    return truth


def _output_truth(arch: Arch, step: int, scale: float, loss_factor: float) -> dict[str, Truth]:
    """:func:`true_output_underflow`, leaving out modules whose AMP output gradient held an inf or
    NaN (not judged by the report)."""
    _, amp = _backward(arch.model, arch, step, loss_factor, scale, outputs=True)
    bad = {n for n, grads in amp.items() if any(g is not None and not bool(torch.isfinite(g).all()) for g in grads)}
    return {n: t for n, t in true_output_underflow(arch, step, scale, loss_factor).items() if n not in bad}


def record_one_step(arch: Arch, path, scale: float, factor: float, measure_every: int = 1) -> dict[str, torch.Tensor]:
    """One recorded fp16 step at ``level="full"``, every statistic on (weights unchanged: lr 0);
    returns the unscaled AMP parameter gradients."""
    import ampdoctor

    model = arch.model
    scaler = ampdoctor.GradScaler("cpu", init_scale=scale, growth_interval=10**6, model=model, path=path,
                                  amp_dtype=torch.float16, level="full", every=1, measure_every=measure_every)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = arch.loss(model, 0) * factor
    scaler.scale(loss).backward()
    grads = {n: p.grad.detach().clone() / scale for n, p in model.named_parameters() if p.grad is not None}
    scaler.step(torch.optim.SGD(model.parameters(), lr=0.0))
    scaler.update()
    scaler.close()
    return grads
