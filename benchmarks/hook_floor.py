"""The floor under the host cost of module taps: what torch's own hooks cost when they do nothing.

``benchmarks/host_cost.py`` reports the host time a light step at ``level="full"`` adds per tapped
module. Part of that is not ampdoctor's code but the mechanisms any module tap goes through. This
benchmark trains the same GPT-like model (16 blocks, the modules ampdoctor taps by default) with
the plain ``torch.amp.GradScaler`` and hooks that do nothing, and reports per tapped module and
steady step the host time over the plain step of:

* ``pre``: an empty forward pre-hook (``with_kwargs=True``), ``post``: an empty forward hook
  (``with_kwargs=True, always_call=True``), ``pre+post``: both (what the taps use);
* ``+node``: and, on each floating-point output that requires grad, a pre-hook on its autograd
  node (``grad_fn.register_prehook``) that returns ``None`` (a Python function); ``+node builtin``:
  the same with a C function as the hook (``set().discard``), so no Python frame runs in backward:
  what registering and calling a node pre-hook costs by itself;
* ``wrapper+node``: no module hooks, but ``module.forward`` replaced by a Python wrapper that calls
  the original and registers the node pre-hook (how accelerate patches modules; shown for scale:
  a DataParallel replica copies the wrapper and would run the original module's forward);
* ampdoctor ``full`` (light step, ``fp8`` at its default and off) over ampdoctor ``params``, per
  tapped module, as ``host_cost.py`` reports it.

All variants in one process, interleaved rounds, the median of the training thread's CPU time.

    python benchmarks/hook_floor.py     # prints a table, writes benchmarks/results/hook_floor_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch

import ampdoctor
from ampdoctor.record.hooks import float_tensors, select_modules
from host_cost import EVERY, Trainer

LAYERS = 16


def _noop(*args, **kwargs):
    return None


def _hooked(trainer: Trainer, variant: str) -> Trainer:
    """``trainer`` (plain scaler) with ``variant``'s empty hooks on the modules ampdoctor taps."""
    node_hook = set().discard if "builtin" in variant else _noop

    def register_node(output):
        for t in float_tensors(output):
            if t.grad_fn is not None and t.requires_grad:
                t.grad_fn.register_prehook(node_hook)

    def post(module, args, kwargs, output):
        if "node" in variant:
            register_node(output)

    for _, module in select_modules(trainer.model):
        if variant.startswith("wrapper"):
            def forward(*args, _forward=module.forward, **kwargs):
                output = _forward(*args, **kwargs)
                register_node(output)
                return output
            module.__dict__["forward"] = forward
            continue
        if "pre" in variant:
            module.register_forward_pre_hook(_noop, with_kwargs=True)
        if "post" in variant:
            module.register_forward_hook(post, with_kwargs=True, always_call=True)
    return trainer


HOOKS = ("pre", "post", "pre+post", "pre+post+node", "pre+post+node builtin", "wrapper+node")


def measure(rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainers = {"plain": Trainer("plain", LAYERS, Path(tmp))}
        trainers.update({v: _hooked(Trainer("plain", LAYERS, Path(tmp)), v) for v in HOOKS})
        trainers["params"] = Trainer("params", LAYERS, Path(tmp))
        trainers["full"] = Trainer("full", LAYERS, Path(tmp))
        no_fp8 = Trainer("plain", LAYERS, Path(tmp))
        no_fp8.scaler = ampdoctor.GradScaler("cpu", model=no_fp8.model, path=Path(tmp) / "nofp8.parquet",
                                             level="full", every=EVERY, fp8=False,
                                             flush_every=10_000, flush_seconds=3600)
        trainers["full fp8=False"] = no_fp8
        for t in trainers.values():  # warm-up, past the first sampled step
            for _ in range(5):
                t.train_step()
        times: dict[str, list[float]] = {name: [] for name in trainers}
        order = list(trainers)
        for _ in range(rounds):
            order = order[1:] + order[:1]
            for name in order:
                t = trainers[name]
                t.steady_step()
                start = time.thread_time()
                t.train_step()
                times[name].append(time.thread_time() - start)
        modules = len(trainers["full"].scaler.recorder._taps.targets)
        for t in trainers.values():
            t.close()
    median = {name: statistics.median(v) * 1e6 for name, v in times.items()}
    per_module = {v: round((median[v] - median["plain"]) / modules, 2) for v in HOOKS}
    per_module.update({v: round((median[v] - median["params"]) / modules, 2) for v in ("full", "full fp8=False")})
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    return {"device": platform.processor() or platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "clock": "thread_time", "rounds": rounds, "commit": commit,
            "layers": LAYERS, "tapped_modules": modules, "plain_step_us": round(median["plain"], 1),
            "us_per_module": per_module}


def table(result: dict) -> str:
    lines = ["| variant | host time per tapped module (µs) |", "| --- | --- |"]
    lines += [f"| {name} | {us:.1f} |" for name, us in result["us_per_module"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "hook_floor_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(args.rounds)
    print(table(result))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
