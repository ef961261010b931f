"""Step-time overhead of ampdoctor's recording levels against the plain torch.amp.GradScaler, as a
user pays it at the default cadence, and of the tools people use today (transformers'
DebugUnderflowOverflow, torch.autograd.detect_anomaly).

What it measures. An ampdoctor step is one of four kinds (``ampdoctor/record/plan.py``): *steady* (light
statistics), *sampled* (full statistics of the gradients; every ``every`` = 100 steps by default),
at ``level="full"`` *module-sampled* (full statistics of the module taps too; every
``module_every`` = 1000), and *measured* (the underflow measured by a float32 shadow of the
backward; every ``measure_every``, by default the module interval: at ``level="full"`` a user's
module-sampled steps are all measured ones). Each kind is timed apart, several of each, and the
**amortised** step is

    amortised = steady + sum over kinds of E_kind * (the share of a user's steps of that kind)

E_kind: the extra time of a step of that kind, plus that of the ``--after`` steps that follow it
(work it leaves behind, on the writer thread for one), over as many steady steps. Each step counts
once, as its most costly kind (measured, then module-sampled, then sampled): by default
amortised = steady + E_sampled * (1/100 - 1/1000) + E_measured / 1000, where at ``level="full"``
E_measured includes the module statistics. So that module-sampled steps without the measurement
can still be timed, the benchmark's scalers measure every other one of a user's measured steps
(``measure_every`` twice the default); the module-sampled figure is then reported, at weight 0. ``amortised_ratio`` is that over
plain's mean step; ``steady_ratio``, ``sampled_ratio``, ``module_sampled_ratio`` and
``measured_ratio`` are single steps of each kind over plain's, ``paired_ratio`` the median per-round ratio of the steady steps.

How. Every variant trains its own copy of the same GPT-like model (same initial weights, same
batches) in one process, one step each per round in a shuffled order (after warm-up), so that drift
in clock speed or load hits all alike; the rounds are split into blocks with freshly built variants,
so that no variant keeps a lucky or unlucky memory placement. A shuffled schedule says which kind
each round's ampdoctor steps are; before such a step, outside the timed region, the scaler's step
counter is moved to the next step number of that kind through ``state_dict()`` /
``load_state_dict()`` (as a resumed run continues its numbering), so a sampled step is exactly what
the scaler does at step 100 of a run, not a variant with other options. A round in which the loss
scale fell (a skipped step, which escalates the next 20 steps to full statistics) and the rounds
escalated after it are left out for every variant. On CUDA every timed step is synchronized before
and after; afterwards, each variant alone (freshly built, not timed) counts its host-device syncs
per step of each kind (``torch.cuda.set_sync_debug_mode``) and the peak GPU memory of its steps.
Only ampdoctor's public API is used (``ampdoctor.GradScaler`` and its options, ``state_dict``,
``close``), so this script also measures an older checkout: ``PYTHONPATH=<old tree>``.

How long: ~(steady + (1 + after) x events) rounds x variants x a step, plus the events' own cost;
the CPU default (small GPT, 7 variants, 400 steady rounds, 8 + 4 events with 4 steps after each)
about 6-7 minutes on 2 idle cores.

    python benchmarks/overhead.py                         # CPU, bf16 autocast, small GPT
    python benchmarks/overhead.py --device cuda --size gpt2   # GPT-2-small-like, fp16, batch 8x1024
    python benchmarks/overhead.py --variants plain,hf-debug,detect-anomaly --steps 20 --blocks 1
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import ampdoctor

SIZES = {  # layers, d_model, heads, context, batch, vocab
    "small": (4, 256, 4, 128, 8, 512),
    "gpt2": (12, 768, 12, 1024, 8, 50257),
    "gpt2-medium": (24, 1024, 16, 1024, 8, 50257),
    "tiny": (1, 16, 2, 8, 2, 32),  # smoke tests of the scripts, not a measurement
}
# plain comes first: every ratio is to plain's step, so it is measured with any selection of the others.
VARIANTS = ["plain", "ampdoctor:steps", "ampdoctor:params", "ampdoctor:full", "ampdoctor:full-every10",
            "ampdoctor:full-no-fp8", "hf-debug", "detect-anomaly"]
DEFAULT_VARIANTS = [v for v in VARIANTS if v != "ampdoctor:full-no-fp8"]  # (that one on request: --variants)
OPTIONS = {"ampdoctor:steps": dict(level="steps"), "ampdoctor:params": dict(level="params"),
           "ampdoctor:full": dict(level="full"), "ampdoctor:full-every10": dict(level="full", every=10),
           # (what the FP8 operands cost at full: not in trees before the fp8 option, 2026-11-27)
           "ampdoctor:full-no-fp8": dict(level="full", fp8=False)}
# ampdoctor's defaults (docs/guide.md, "API"; ampdoctor/record/options.py), written out because an older tree may not
# export them; _check_defaults compares them with the imported ampdoctor's where it has them.
DEFAULT_EVERY, DEFAULT_MODULE_EVERY, ESCALATE_STEPS = 100, 1000, 20
# state_dict's step number and run id (documented in ampdoctor.GradScaler.state_dict)
STEP_KEY, RUN_KEY = "ampdoctor.step", "ampdoctor.run_id"
KINDS = ("steady", "sampled", "module_sampled", "measured")
EVENTS = KINDS[1:]


def _measures() -> bool:
    """Whether the imported ampdoctor measures underflow (``measure_every``): an older tree does not."""
    options = _options_module()
    return options is not None and "measure_every" in getattr(options.RecordOptions, "__dataclass_fields__", {})


def _options_module():
    """The imported ampdoctor's options module: ``ampdoctor.record.options``, or ``ampdoctor.options``
    in a tree before the three wings (issue 38); None where neither exists."""
    return tree_module("ampdoctor.record.options", "ampdoctor.options")


def tree_module(*names: str):
    """The first of ``names`` that the imported ampdoctor's own tree holds, or None. A module from
    another tree does not count: an editable install's import hook finds ``ampdoctor.record`` in the
    checkout even when ``ampdoctor`` itself is an older tree put first on ``PYTHONPATH``."""
    import importlib
    from pathlib import Path
    root = Path(ampdoctor.__file__).resolve().parent
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if root in Path(module.__file__).resolve().parents:
            return module
    return None


# -- the model: a copy of ampdoctor.cli.demo.TinyGPT, so that an older tree trains the same workload --
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        # is_causal, not a -inf mask: DebugUnderflowOverflow aborts on infs in activations
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(size: str) -> GPT:
    layers, d, heads, context, _, vocab = SIZES[size]
    return GPT(vocab=vocab, d=d, layers=layers, heads=heads, context=context)


# -- which steps are which ---------------------------------------------------------------------
@dataclass(frozen=True)
class Cadence:
    """Which step numbers get full statistics (ampdoctor/record/plan.py, escalation aside), for the
    user's cadence (``kind``, ``weights``) and for the timed one (``timed_kind``): the benchmark's
    scalers measure underflow on every other measured step of the user's cadence
    (``timing_measure_every``), so that at ``level="full"`` the module-sampled steps that are not
    measured exist to be timed apart (by default a user's module-sampled steps are all measured)."""

    every: int
    module_every: int | None  # None: no module statistics (levels below full)
    measure_every: int = 0    # the user's measured steps (0: none, or an older ampdoctor)

    @classmethod
    def of(cls, options: dict) -> Cadence:
        every = options.get("every") or DEFAULT_EVERY
        module_every = options.get("module_every") or options.get("every") or DEFAULT_MODULE_EVERY
        measure = options.get("measure_every")
        if measure is None:  # (RecordOptions.measure_interval: module_every or 1000, rounded up to a sampled step)
            base = options.get("module_every") or DEFAULT_MODULE_EVERY
            measure = -(-base // every) * every if _measures() else 0
        return cls(every, module_every if options.get("level") == "full" else None, measure)

    @property
    def timing_measure_every(self) -> int:
        return 2 * self.measure_every

    def _kind(self, step: int, measure: int) -> str:
        if measure and step % measure == 0:
            return "measured"
        if self.module_every and step % self.module_every == 0:
            return "module_sampled"
        return "sampled" if step % self.every == 0 else "steady"

    def kind(self, step: int) -> str:
        """What ``step`` is in a user's run."""
        return self._kind(step, self.measure_every)

    def timed_kind(self, step: int) -> str:
        """What ``step`` is for the benchmark's scalers."""
        return self._kind(step, self.timing_measure_every)

    def next_step(self, step: int, kind: str) -> int | None:
        """The first step number >= ``step`` of ``kind`` for the benchmark's scalers; None if
        this cadence has none."""
        stride = {"steady": 1, "sampled": self.every, "module_sampled": self.module_every,
                  "measured": self.timing_measure_every}[kind]
        if not stride:
            return None
        first = -(-step // stride) * stride
        period = math.lcm(self.every, self.module_every or 1, self.timing_measure_every or 1)
        return next((n for n in range(first, first + period + 1, stride) if self.timed_kind(n) == kind), None)

    def available(self, kind: str) -> str:
        """``kind``, or what the cadence has instead: every=10 at full makes every sampled step a
        module-sampled one, and a level below full has only sampled (and measured) steps."""
        while self.next_step(1, kind) is None:
            kind = KINDS[KINDS.index(kind) - 1]
        return kind

    def weights(self) -> dict[str, float]:
        """The share of the steps of each event kind in a user's long run. A timed measured step
        holds what a user's does (at ``level="full"`` also its module statistics: both cadences'
        measured steps are module-sampled ones)."""
        period = math.lcm(self.every, self.module_every or 1, self.measure_every or 1)
        counts = {kind: 0 for kind in EVENTS}
        for n in range(period):
            kind = self.kind(n)
            if kind != "steady":
                counts[kind] += 1
        return {kind: c / period for kind, c in counts.items()}


@dataclass
class Variant:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    cadence: Cadence | None = None  # None: not ampdoctor
    path: Path | None = None
    anomaly: bool = False
    hook: object = None
    step: int = 0                   # the scaler's step number of the next step (ampdoctor only)

    def move_to(self, kind: str) -> None:
        """Number the next step so that it is of ``kind`` (outside the timed step: this syncs)."""
        target = self.cadence.next_step(self.step, kind)
        if target != self.step:
            state = self.scaler.state_dict()
            state.pop(RUN_KEY, None)  # the same run goes on (no continue_run): only its numbering jumps
            state[STEP_KEY] = target
            self.scaler.load_state_dict(state)
            self.step = target

    def check_step(self) -> None:
        """The step numbering is what this script assumed (one per update(), jumps as asked)."""
        recorded = self.scaler.state_dict().get(STEP_KEY)
        if recorded != self.step:
            raise RuntimeError(f"{self.name}: the scaler is at step {recorded}, the benchmark assumed {self.step}: "
                               "its step kinds would be mislabelled")


def make_variants(names, size, device, workdir: Path, seed: int = 0) -> list[Variant]:
    out = []
    for name in names:
        torch.manual_seed(seed)
        model = build_model(size).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        path, hook, cadence = None, None, None
        if name.startswith("ampdoctor"):
            path = workdir / f"{name.replace(':', '-')}.parquet"
            cadence = Cadence.of(OPTIONS[name])
            timing = {"measure_every": cadence.timing_measure_every} if cadence.measure_every else {}
            scaler = ampdoctor.GradScaler(device, model=model, path=path, **OPTIONS[name], **timing)
        else:
            scaler = torch.amp.GradScaler(device)
        if name == "hf-debug":
            from transformers.debug_utils import DebugUnderflowOverflow
            hook = DebugUnderflowOverflow(model)
        out.append(Variant(name, model, opt, scaler, cadence, path, anomaly=name == "detect-anomaly", hook=hook))
    return out


def train_step(v: Variant, batch, dtype, device) -> None:
    x, y = batch
    ctx = torch.autograd.detect_anomaly() if v.anomaly else contextlib.nullcontext()
    with ctx:
        with torch.autocast(device, dtype=dtype):
            logits = v.model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        v.scaler.scale(loss).backward()
    v.scaler.unscale_(v.optimizer)
    torch.nn.utils.clip_grad_norm_(v.model.parameters(), 1.0)
    v.scaler.step(v.optimizer)
    v.scaler.update()
    v.optimizer.zero_grad(set_to_none=True)
    v.step += 1


def batches(size, device, n, seed=1):
    _, _, _, context, batch, vocab = SIZES[size]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        seq = torch.randint(0, vocab, (batch, context + 1), generator=gen)
        yield seq[:, :-1].to(device), seq[:, 1:].to(device)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def schedule(steady: int, sampled: int, module: int, after: int, rng: random.Random,
             measured: int = 0) -> list[list[str]]:
    """A block's measured rounds as units in a shuffled order: a steady round alone, or an event
    round with the ``after`` rounds that follow it (which a later unit never interrupts)."""
    units = [["steady"]] * steady + [["sampled"] + ["after"] * after] * sampled + \
            [["module_sampled"] + ["after"] * after] * module + [["measured"] + ["after"] * after] * measured
    rng.shuffle(units)
    return units


def labels(units: list[list[str]], cadence: Cadence | None) -> list[tuple[str, int]]:
    """Per round, what a variant's step is: (kind, 0) or (event kind, k) for the k-th step after an
    event. Without a cadence (not ampdoctor), or where the cadence has no such event, steady."""
    out = []
    for unit in units:
        kind = "steady" if cadence is None else cadence.available(unit[0])
        out += [("steady", 0)] * len(unit) if kind == "steady" else [(kind, k) for k in range(len(unit))]
    return out


def _share(total: int, blocks: int, block: int) -> int:
    return total // blocks + (block < total % blocks)


@dataclass
class Samples:
    """One variant's timed steps: (round, label, seconds)."""

    rows: list[tuple[int, tuple[str, int], float]] = field(default_factory=list)


def measure(args) -> dict:
    device = args.device
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    defaults = _check_defaults()
    names = [n for n in VARIANTS if n == "plain" or n in (args.variants or DEFAULT_VARIANTS)]
    skipped_variants = {}
    if "hf-debug" in names:
        try:
            import transformers.debug_utils  # noqa: F401
        except ImportError as exc:
            names.remove("hf-debug")
            skipped_variants["hf-debug"] = f"transformers is not installed ({exc})"
    workdir = Path(tempfile.mkdtemp(prefix="ampdoctor-bench-"))
    samples = {name: Samples() for name in names}
    written = {name: 0 for name in names}
    recorded_steps = 0
    excluded: set[int] = set()   # rounds left out for all: a skipped step and its escalated steps
    skipped_steps = 0
    rng = random.Random(0)
    round_no = 0
    for block in range(args.blocks):
        units = schedule(_share(args.steps, args.blocks, block), _share(args.sampled_steps, args.blocks, block),
                         _share(args.module_steps, args.blocks, block), args.after, rng,
                         _share(args.measured_steps, args.blocks, block))
        # Fresh models, optimizers and scalers per block: where a variant's tensors land in memory
        # (cache sets, pages) shifts its step time by a percent or two for the life of the
        # allocation; new allocations per block average that out instead of fixing it per variant.
        variants = make_variants(names, args.size, device, workdir / f"block{block}", seed=0)
        plan = {v.name: labels(units, v.cadence) for v in variants}
        rounds = len(plan["plain"])
        data = list(batches(args.size, device, args.warmup + rounds, seed=1 + block))
        plain = next(v for v in variants if v.name == "plain")
        scale = plain.scaler.get_scale()
        for i, batch in enumerate(data):
            r = i - args.warmup  # the measured round in this block (< 0: warm-up, natural numbering)
            # A fresh order each round: no variant always runs right after another (cache state).
            for v in rng.sample(variants, len(variants)):
                label = plan[v.name][r] if r >= 0 else ("steady", 0)
                if v.cadence is not None and r >= 0:
                    v.move_to(label[0] if label[1] == 0 else "steady")
                _sync(device)
                t = time.perf_counter()
                train_step(v, batch, dtype, device)
                _sync(device)
                if r >= 0:
                    samples[v.name].rows.append((round_no + r, label, time.perf_counter() - t))
            # A fall of the scale is a skipped step (the same in every variant: same weights, same
            # batches): ampdoctor escalates the steps after it, which is not a healthy run's cost.
            new_scale = plain.scaler.get_scale()
            if new_scale < scale:
                skipped_steps += 1  # (+3: the skip's own round, and checks that land a step late)
                excluded.update(range(round_no + max(r, 0), round_no + r + ESCALATE_STEPS + 3))
            scale = new_scale
        round_no += rounds
        recorded_steps += len(data)
        for v in variants:
            if v.cadence is not None:
                v.check_step()
                v.scaler.close()
                written[v.name] += sum(f.stat().st_size for f in v.path.glob("*.parquet"))
        del variants, v, plain
        gc.collect()  # closed recorders sit in reference cycles: free the block's models (GPU memory) now
    counts = cuda_counts(names, args, dtype, workdir / "counts") if device == "cuda" else {}
    shutil.rmtree(workdir, ignore_errors=True)
    results = summarize(names, samples, excluded, args.after)
    for row in results:
        if row["variant"].startswith("ampdoctor"):
            row["bytes_per_recorded_step"] = written[row["variant"]] / recorded_steps
        row.update(counts.get(row["variant"], {}))
    layers, d, heads, context, batch, vocab = SIZES[args.size]
    params = sum(p.numel() for p in build_model(args.size).parameters())
    return {"benchmark": "overhead", "method": "amortised (steady, sampled, module-sampled and measured steps timed apart)",
            "device": _device_name(device), "device_type": device,
            "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "cuda": torch.version.cuda,
            "ampdoctor": ampdoctor.__version__, **package_provenance(), "ampdoctor_defaults": defaults,
            "python": platform.python_version(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "size": args.size, "model": {"layers": layers, "d_model": d, "heads": heads, "context": context,
                                         "batch": batch, "vocab": vocab, "parameters": params},
            "warmup": args.warmup, "steps": args.steps, "sampled_steps": args.sampled_steps,
            "module_steps": args.module_steps, "measured_steps": args.measured_steps, "after": args.after,
            "blocks": args.blocks,
            "skipped_steps": skipped_steps, "excluded_rounds": len(excluded),
            "results": results, "skipped_variants": skipped_variants}


def summarize(names, samples: dict[str, Samples], excluded: set[int], after: int) -> list[dict]:
    """Per variant: the mean step of each kind, its ratio to plain's mean, the extra cost of each
    event kind (with its after-steps), and the amortised step at the variant's cadence."""
    plain_rounds = {r: t for r, _, t in samples["plain"].rows if r not in excluded}
    plain = statistics.fmean(plain_rounds.values())
    results = []
    for name in names:
        rows = [(r, label, t) for r, label, t in samples[name].rows if r not in excluded]
        by_label: dict[tuple[str, int], list[float]] = {}
        for _, label, t in rows:
            by_label.setdefault(label, []).append(t)
        steady = by_label.get(("steady", 0))
        if not steady:
            raise RuntimeError(f"{name}: no steady step left to measure ({len(excluded)} rounds left out after "
                               "skipped steps)")
        s = statistics.fmean(steady)
        # paired: the median over steady rounds of this variant's step over plain's in the same
        # round; robust to drift and outliers.
        paired = [t / plain_rounds[r] for r, label, t in rows if label == ("steady", 0)]
        row = {"variant": name, "steady_ms": 1e3 * s, "steady_median_ms": 1e3 * statistics.median(steady),
               "steady_n": len(steady), "steady_ratio": s / plain, "paired_ratio": statistics.median(paired)}
        cadence = OPTIONS.get(name) and Cadence.of(OPTIONS[name])
        amortised = s
        for kind in EVENTS if cadence else ():
            weight = cadence.weights()[kind]
            event = by_label.get((kind, 0), [])
            afters = [by_label.get((kind, k), []) for k in range(1, after + 1)]
            if not event or not all(afters):
                amortised = amortised if weight == 0 else None  # not measured, and it counts
                continue
            extra = sum(map(statistics.fmean, [event, *afters])) - (1 + after) * s
            row.update({f"{kind}_ms": 1e3 * statistics.fmean(event), f"{kind}_n": len(event),
                        f"{kind}_ratio": statistics.fmean(event) / plain,
                        f"{kind}_after_ms": [1e3 * statistics.fmean(a) for a in afters],
                        f"{kind}_extra_ms": 1e3 * extra, f"{kind}_cost_ratio": (s + extra) / plain})
            if amortised is not None:
                amortised += weight * extra
        if cadence:
            row.update({"every": cadence.every, "module_every": cadence.module_every,
                        "measure_every": cadence.measure_every})
        row["amortised_ms"] = None if amortised is None else 1e3 * amortised
        row["amortised_ratio"] = None if amortised is None else amortised / plain
        results.append(row)
    return results


# Per variant, after the timed blocks: steady steps, then one of each event kind with a steady step after it.
COUNT_SEQUENCE = ["steady"] * 5 + ["sampled", "steady", "module_sampled", "steady", "measured", "steady"]


def cuda_counts(names, args, dtype, workdir: Path) -> dict:
    """Per variant, built alone (so that its peak is its own model's, as in a user's process): the
    host-device syncs per step of each kind and the peak GPU memory over those steps (model,
    optimizer state, the steps' temporaries and what the recorder keeps). Not timed."""
    data = list(batches(args.size, "cuda", 2 + len(COUNT_SEQUENCE), seed=99))
    out = {}
    for name in names:
        # What is resident before the variant is built (the batches; anything an earlier variant
        # left) is not its own: its peak is counted from there.
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        (v,) = make_variants([name], args.size, "cuda", workdir, seed=0)
        for batch in data[:2]:  # every lazy init done (step 0 is sampled, and module-sampled at full)
            train_step(v, batch, dtype, "cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        syncs: dict[str, list[int]] = {}
        for kind, batch in zip(COUNT_SEQUENCE, data[2:]):
            kind = v.cadence.available(kind) if v.cadence else "steady"
            if v.cadence:
                v.move_to(kind)
            torch.cuda.synchronize()
            syncs.setdefault(kind, []).append(_count_syncs(train_step, v, batch, dtype, "cuda"))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - resident
        if v.cadence:
            v.scaler.close()
        del v
        gc.collect()
        torch.cuda.empty_cache()
        out[name] = {"syncs_per_step": statistics.fmean(syncs["steady"]),
                     "syncs_by_kind": {k: statistics.fmean(n) for k, n in syncs.items()},
                     "peak_memory_mib": peak / 2**20}
    plain = out["plain"]["peak_memory_mib"]
    for row in out.values():
        row["extra_memory_mib"] = row["peak_memory_mib"] - plain
        row["memory_overhead_fraction"] = row["peak_memory_mib"] / plain - 1.0
    return out


def _count_syncs(fn, *args) -> int:
    """The host-device syncs ``fn(*args)`` makes, as torch's sync debug mode warns of them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def _check_defaults() -> dict:
    """The cadence this script assumes, checked against the imported ampdoctor's where it says."""
    options = _options_module()
    found = {"every": getattr(options, "DEFAULT_EVERY", None), "module_every": getattr(options, "DEFAULT_MODULE_EVERY", None)}
    assumed = {"every": DEFAULT_EVERY, "module_every": DEFAULT_MODULE_EVERY}
    for key, value in found.items():
        if value is not None and value != assumed[key]:
            raise RuntimeError(f"ampdoctor's default {key} is {value}, this benchmark assumes {assumed[key]}")
    return assumed


def git_state(tree: Path) -> tuple[str | None, bool | None]:
    """The commit checked out at ``tree`` and whether tracked files differ from it; (None, None)
    where ``tree`` is not the top of a git work tree (an exported copy, a machine without git: a
    folder inside another checkout must not report the outer one's commit)."""
    def git(*cmd):
        try:
            return subprocess.run(["git", "-C", str(tree), *cmd], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
    top = git("rev-parse", "--show-toplevel")
    if top is None or top.returncode or Path(top.stdout.strip()).resolve() != Path(tree).resolve():
        return None, None
    head, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    if head is None or head.returncode or status is None:
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip())


def package_digest(package: Path) -> str:
    """sha256 of the package's Python sources (paths and contents): names the code measured even
    where git cannot (recompute it on a checkout to match a result to its commit)."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def package_provenance() -> dict:
    """Where the imported ampdoctor comes from: its file, the commit of its tree, a digest of its sources."""
    if ampdoctor.__file__ is None:  # a folder without __init__.py: a namespace package, not ampdoctor
        raise ImportError(f"ampdoctor at {list(ampdoctor.__path__)} is not a package (no __init__.py)")
    package = Path(ampdoctor.__file__).resolve().parent
    commit, dirty = git_state(package.parent)
    return {"ampdoctor_file": str(package / "__init__.py"), "git_commit": commit, "git_dirty": dirty,
            "package_digest": package_digest(package)}


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default=None)
    parser.add_argument("--steps", type=int, default=400, help="measured steady rounds, over all blocks")
    parser.add_argument("--sampled-steps", type=int, default=8,
                        help="measured sampled steps (full statistics of the gradients), over all blocks")
    parser.add_argument("--module-steps", type=int, default=4,
                        help="measured module-sampled steps (level=full), over all blocks")
    parser.add_argument("--measured-steps", type=int, default=None,
                        help="measured steps (underflow measured by the float32 shadow of the backward), over all "
                             "blocks; default: as --module-steps")
    parser.add_argument("--after", type=int, default=4,
                        help="steps after each sampled or module-sampled step counted into its cost (the writer "
                             "thread's work on its record slows them: the JSON's *_after_ms show it fade)")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps per block")
    parser.add_argument("--blocks", type=int, default=4,
                        help="the rounds are split into blocks, each with freshly built variants")
    parser.add_argument("--variants", type=lambda s: s.split(","), default=None,
                        help=f"comma-separated subset of {','.join(VARIANTS)} (plain is always measured); "
                             "default: all")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.size = args.size or ("gpt2" if args.device == "cuda" else "small")
    args.measured_steps = args.module_steps if args.measured_steps is None else args.measured_steps
    if unknown := set(args.variants or ()) - set(VARIANTS):
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")
    if (args.steps < args.blocks or min(args.sampled_steps, args.module_steps, args.measured_steps, args.after) < 0
            or args.warmup < 1):
        parser.error("--steps must be at least --blocks; --warmup at least 1; the others not negative")
    result = measure(args)
    print(f"{result['device']} ({result['dtype']}), {args.size}: {result['model']['parameters'] / 1e6:.1f} M "
          f"parameters, batch {result['model']['batch']}x{result['model']['context']}; {args.steps} steady rounds, "
          f"{args.sampled_steps} sampled, {args.module_steps} module-sampled and {args.measured_steps} measured steps "
          f"(each with {args.after} after), "
          f"in {args.blocks} blocks of fresh variants, each after {args.warmup} of warm-up; "
          f"{result['excluded_rounds']} rounds left out after {result['skipped_steps']} skipped steps")
    print_table(result["results"])
    for name, why in result["skipped_variants"].items():
        print(f"(skipped {name}: {why})")
    path = Path(args.json or f"benchmarks/results/overhead_{args.device}_{args.size}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


def print_table(results: list[dict], prefix: str = "") -> None:
    """ratios to plain's mean step: steady, paired (median per round), a sampled and a
    module-sampled step alone, and the amortised step at the default cadence."""
    print(f"{prefix}{'variant':<24} {'steady ms':>9} {'steady':>7} {'paired':>7} {'sampled':>8} {'module':>8} "
          f"{'amortised':>9} {'syncs/step':>10} {'mem MiB':>8}")
    for r in results:
        print(f"{prefix}{r['variant']:<24} {r['steady_ms']:>9.1f} {_fmt(r['steady_ratio'], '{:.3f}x'):>7} "
              f"{_fmt(r['paired_ratio'], '{:.3f}x'):>7} {_fmt(r.get('sampled_ratio'), '{:.2f}x'):>8} "
              f"{_fmt(r.get('module_sampled_ratio'), '{:.2f}x'):>8} {_fmt(r.get('amortised_ratio'), '{:.3f}x'):>9} "
              f"{_fmt(r.get('syncs_per_step'), '{:.1f}'):>10} {_fmt(r.get('extra_memory_mib'), '{:+.0f}'):>8}")


def _fmt(value, spec: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else spec.format(value)


if __name__ == "__main__":
    main()
