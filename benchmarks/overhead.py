"""Step-time overhead of ampdoctor's recording levels against the plain torch.amp.GradScaler, and of
the tools people use today (transformers' DebugUnderflowOverflow, torch.autograd.detect_anomaly).

Every variant trains its own copy of the same GPT-like model (same initial weights, same batches)
in one process, one step each per round in a shuffled order (after warm-up), so that drift in clock
speed or background load hits all of them alike; the rounds are split into blocks with freshly
built variants, so that no variant keeps a lucky or unlucky memory placement. Reports the mean step
time, its ratio to plain's and the median per-round ratio, bytes written per step, and on CUDA the host-device syncs per step (``torch.cuda.set_sync_debug_mode``)
and the extra GPU memory. Prints a table and writes JSON.

    python benchmarks/overhead.py                         # CPU, bf16 autocast, small GPT
    python benchmarks/overhead.py --device cuda --size gpt2   # GPT-2-small-like, fp16, batch 8x1024
    python benchmarks/overhead.py --variants plain,hf-debug,detect-anomaly --steps 20 --blocks 1
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import ampdoctor
from ampdoctor.demo import TinyGPT  # causal attention via is_causal: no -inf mask that
                                    # DebugUnderflowOverflow would abort on

SIZES = {  # layers, d_model, heads, context, batch, vocab
    "small": (4, 256, 4, 128, 8, 512),
    "gpt2": (12, 768, 12, 1024, 8, 50257),
    "gpt2-medium": (24, 1024, 16, 1024, 8, 50257),
    "tiny": (1, 16, 2, 8, 2, 32),  # smoke tests of the scripts, not a measurement
}
# plain comes first: every ratio is to plain's step, so it is measured with any selection of the others.
VARIANTS = ["plain", "ampdoctor:steps", "ampdoctor:params", "ampdoctor:full", "ampdoctor:full-every10",
            "hf-debug", "detect-anomaly"]


@dataclass
class Variant:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    path: Path | None = None
    anomaly: bool = False
    hook: object = None


def make_variants(names, size, device, workdir: Path, seed: int = 0) -> list[Variant]:
    layers, d, heads, context, _, vocab = SIZES[size]
    out = []
    for name in names:
        torch.manual_seed(seed)
        model = TinyGPT(vocab=vocab, d=d, layers=layers, heads=heads, context=context).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        path, hook = None, None
        if name.startswith("ampdoctor"):
            path = workdir / f"{name}.parquet"
            options = {"steps": dict(level="steps"), "params": dict(level="params"),
                       "full": dict(level="full"), "full-every10": dict(level="full", every=10)}[name.split(":")[1]]
            scaler = ampdoctor.GradScaler(device, model=model, path=path, **options)
        else:
            scaler = torch.amp.GradScaler(device)
        if name == "hf-debug":
            from transformers.debug_utils import DebugUnderflowOverflow
            hook = DebugUnderflowOverflow(model)
        out.append(Variant(name, model, opt, scaler, path, anomaly=name == "detect-anomaly", hook=hook))
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


def batches(size, device, n, seed=1):
    _, _, _, context, batch, vocab = SIZES[size]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        seq = torch.randint(0, vocab, (batch, context + 1), generator=gen)
        yield seq[:, :-1].to(device), seq[:, 1:].to(device)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(args) -> dict:
    device = args.device
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    names = [n for n in VARIANTS if n == "plain" or n in (args.variants or VARIANTS)]
    skipped_variants = {}
    if "hf-debug" in names:
        try:
            import transformers.debug_utils  # noqa: F401
        except ImportError as exc:
            names.remove("hf-debug")
            skipped_variants["hf-debug"] = f"transformers is not installed ({exc})"
    workdir = Path(tempfile.mkdtemp(prefix="ampdoctor-bench-"))
    times: dict[str, list[float]] = {name: [] for name in names}
    written: dict[str, int] = {name: 0 for name in names}
    recorded_steps = 0
    order = random.Random(0)
    per_block = -(-args.steps // args.blocks)
    if per_block % 100:
        warnings.warn(f"{per_block} measured steps per block is not a multiple of 100: the sampled steps of "
                      "every=100 are not counted at their share", RuntimeWarning)
    extra = {}
    for block in range(args.blocks):
        # Fresh models, optimizers and scalers per block: where a variant's tensors land in memory
        # (cache sets, pages) shifts its step time by a percent or two for the life of the
        # allocation; new allocations per block average that out instead of fixing it per variant.
        rounds = min(per_block, args.steps - block * per_block)
        variants = make_variants(names, args.size, device, workdir / f"block{block}", seed=0)
        data = list(batches(args.size, device, args.warmup + rounds, seed=1 + block))
        for i, batch in enumerate(data):
            # A fresh order each round: no variant always runs right after another (cache state).
            for v in order.sample(variants, len(variants)):
                _sync(device)
                t = time.perf_counter()
                train_step(v, batch, dtype, device)
                _sync(device)
                if i >= args.warmup:
                    times[v.name].append(time.perf_counter() - t)
        recorded_steps += len(data)
        if device == "cuda" and block == args.blocks - 1:
            extra = cuda_counts(variants, data[:8], dtype, device)
            recorded_steps += 8
        for v in variants:
            if isinstance(v.scaler, ampdoctor.GradScaler):
                v.scaler.close()
                written[v.name] += sum(f.stat().st_size for f in v.path.glob("*.parquet"))
        del variants, v
        gc.collect()  # closed recorders sit in reference cycles: free the block's models (GPU memory) now
    plain = statistics.fmean(times["plain"])
    results = []
    for name in names:
        mean = statistics.fmean(times[name])
        # ratio: of mean step times, so that the sampled steps count at their share;
        # paired_ratio: the median over rounds of this variant's step over plain's in the same
        # round, which is robust to drift and outliers but blind to the sampled steps.
        paired = [t / p for t, p in zip(times[name], times["plain"])]
        row = {"variant": name, "mean_ms": 1e3 * mean, "median_ms": 1e3 * statistics.median(times[name]),
               "ratio": mean / plain, "paired_ratio": statistics.median(paired)}
        if name.startswith("ampdoctor"):
            row["bytes_per_step"] = written[name] / recorded_steps
        row.update(extra.get(name, {}))
        results.append(row)
    shutil.rmtree(workdir, ignore_errors=True)
    layers, d, heads, context, batch, vocab = SIZES[args.size]
    params = sum(p.numel() for p in TinyGPT(vocab=vocab, d=d, layers=layers, heads=heads, context=context).parameters())
    return {"benchmark": "overhead", "device": _device_name(device), "device_type": device,
            "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "ampdoctor": ampdoctor.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "size": args.size, "model": {"layers": layers, "d_model": d, "heads": heads, "context": context,
                                         "batch": batch, "vocab": vocab, "parameters": params},
            "warmup": args.warmup, "steps": args.steps, "blocks": args.blocks, "results": results, "skipped_variants": skipped_variants}


def cuda_counts(variants, data, dtype, device) -> dict:
    """Per variant: syncs per steady-state step and peak memory over plain's."""
    out = {}
    for v in variants:
        train_step(v, data[0], dtype, device)  # steady state: every lazy init done
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for batch in data[1:]:
                    train_step(v, batch, dtype, device)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        out[v.name] = {"syncs_per_step": syncs / (len(data) - 1),
                       "peak_memory_mib": (torch.cuda.max_memory_allocated() - base) / 2**20 + base / 2**20}
    plain = out["plain"]["peak_memory_mib"]
    for name, row in out.items():
        row["memory_overhead_fraction"] = row["peak_memory_mib"] / plain - 1.0
    return out


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default=None)
    parser.add_argument("--steps", type=int, default=400,
                        help="measured steps per variant, over all blocks; with 100 per block (a multiple of the "
                             "default every=100) each block includes the sampled steps at their share")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps per block")
    parser.add_argument("--blocks", type=int, default=4,
                        help="the rounds are split into blocks, each with freshly built variants")
    parser.add_argument("--variants", type=lambda s: s.split(","), default=None,
                        help=f"comma-separated subset of {','.join(VARIANTS)} (plain is always measured); "
                             "default: all")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.size = args.size or ("gpt2" if args.device == "cuda" else "small")
    if unknown := set(args.variants or ()) - set(VARIANTS):
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")
    result = measure(args)
    print(f"{result['device']} ({result['dtype']}), {args.size}: {result['model']['parameters'] / 1e6:.1f} M "
          f"parameters, batch {result['model']['batch']}x{result['model']['context']}, {args.steps} alternating "
          f"rounds in {args.blocks} blocks of fresh variants, each after {args.warmup} of warm-up; ratio: of mean step times; paired: median of per-round ratios")
    print(f"{'variant':<24} {'mean ms':>8} {'ratio':>7} {'paired':>7} {'bytes/step':>11} {'syncs/step':>11} "
          f"{'mem +%':>7}")
    for r in result["results"]:
        print(f"{r['variant']:<24} {r['mean_ms']:>8.1f} {r['ratio']:>6.3f}x {r['paired_ratio']:>6.3f}x "
              f"{_fmt(r.get('bytes_per_step'), '{:,.0f}'):>11} {_fmt(r.get('syncs_per_step'), '{:.1f}'):>11} "
              f"{_fmt(r.get('memory_overhead_fraction'), '{:+.1%}'):>7}")
    for name, why in result["skipped_variants"].items():
        print(f"(skipped {name}: {why})")
    path = Path(args.json or f"benchmarks/results/overhead_{args.device}_{args.size}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


def _fmt(value, spec: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else spec.format(value)


if __name__ == "__main__":
    main()
