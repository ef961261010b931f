"""Host cost of recording against the number of parameter tensors and tapped modules.

On a GPU every dispatched torch op is a kernel launch that the host must issue; when a step's
compute is short, that host work is what a recorder adds to the step. This benchmark trains
GPT-like models so small that compute is negligible (1, 4 and 16 blocks: 14, 50 and 194
parameter tensors) and reports, per steady step (one that is not sampled for full statistics):

* the torch ops dispatched per step (counted with a ``TorchDispatchMode``; views included),
  for the plain ``torch.amp.GradScaler`` and the extra ops of each recording level;
* the host time per step (median over interleaved rounds, all variants in one process) and the
  extra host time of each level; at ``level="full"``, the extra per tapped module (``full``'s
  extra over ``params``'s, divided by the modules: what the module taps cost).

Host time is the training thread's CPU time (``time.thread_time``; torch runs on one thread, so
its kernels are counted too): on a shared machine, wall time also counts the time other
processes held the core. ``--clock wall`` measures wall time instead.

The sampled steps (full statistics every ``every`` steps) are reported apart: they are 1 in 100.

    python benchmarks/host_cost.py                 # prints a table, writes benchmarks/results/host_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ampdoctor
try:
    from ampdoctor.cli.demo import TinyGPT
except ImportError:  # a tree before the three wings (issue 38): stats_bandwidth.py measures older trees too
    from ampdoctor.demo import TinyGPT

LAYERS = (1, 4, 16)
LEVELS = ("plain", "steps", "params", "full")
EVERY = 100          # full statistics on 1 step in EVERY; the measured steps avoid them


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active: on a GPU each is a kernel launch, except views
    (counted apart), which only make a new tensor header."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        self.views += func.is_view
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def launches(self) -> int:
        return self.total - self.views


class Trainer:
    def __init__(self, level: str, layers: int, workdir: Path) -> None:
        torch.manual_seed(0)
        self.model = TinyGPT(vocab=16, d=8, layers=layers, heads=2, context=4)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=True)
        if level == "plain":
            self.scaler = torch.amp.GradScaler("cpu")
        else:
            self.scaler = ampdoctor.GradScaler("cpu", model=self.model, path=workdir / f"{level}-{layers}.parquet",
                                               level=level, every=EVERY, flush_every=10_000, flush_seconds=3600)
        gen = torch.Generator().manual_seed(1)
        seq = torch.randint(0, 16, (1, 5), generator=gen)
        self.x, self.y = seq[:, :-1], seq[:, 1:]
        self.step = 0

    def train_step(self) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.model(self.x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), self.y.reshape(-1))
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

    def steady_step(self) -> None:
        """Train until the next step is not a sampled one."""
        while self.step % EVERY == 0:
            self.train_step()

    def close(self) -> None:
        if hasattr(self.scaler, "close"):
            self.scaler.close()


def count_ops(trainer: Trainer) -> int:
    trainer.steady_step()
    with OpCounter() as counter:
        trainer.train_step()
    return counter.total


def count_sampled_ops(trainer: Trainer) -> int:
    while trainer.step % EVERY:
        trainer.train_step()
    with OpCounter() as counter:
        trainer.train_step()
    return counter.total


def measure(rounds: int, layers_list=LAYERS, clock=time.thread_time) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for layers in layers_list:
            trainers = {level: Trainer(level, layers, Path(tmp)) for level in LEVELS}
            for t in trainers.values():  # warm-up, past the first sampled step
                for _ in range(5):
                    t.train_step()
            ops = {level: count_ops(t) for level, t in trainers.items()}
            sampled = {level: count_sampled_ops(t) for level, t in trainers.items()}
            times: dict[str, list[float]] = {level: [] for level in LEVELS}
            order = list(LEVELS)
            for r in range(rounds):
                order = order[1:] + order[:1]  # rotate: no level always runs first
                for level in order:
                    t = trainers[level]
                    t.steady_step()
                    start = clock()
                    t.train_step()
                    times[level].append(clock() - start)
            n_tensors = len(list(trainers["plain"].model.parameters()))
            n_modules = len(trainers["full"].scaler.recorder._taps.targets)
            for t in trainers.values():
                t.close()
            median = {level: statistics.median(v) * 1e3 for level, v in times.items()}
            rows.append({
                "layers": layers, "param_tensors": n_tensors, "tapped_modules": n_modules,
                "plain_ops": ops["plain"], "plain_ms": round(median["plain"], 3),
                **{f"{level}_extra_ops": ops[level] - ops["plain"] for level in LEVELS[1:]},
                **{f"{level}_extra_ms": round(median[level] - median["plain"], 3) for level in LEVELS[1:]},
                **{f"{level}_sampled_extra_ops": sampled[level] - sampled["plain"] for level in LEVELS[1:]},
                "full_us_per_module": round((median["full"] - median["params"]) / n_modules * 1e3, 1),
                "full_ops_per_module": round((ops["full"] - ops["params"]) / n_modules, 2),
            })
    return {"device": platform.processor() or platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "clock": clock.__name__, "rounds": rounds, "every": EVERY,
            "rows": rows}


def table(result: dict) -> str:
    lines = ["| tensors (modules) | plain: ops, ms | steps: +ops, +ms | params: +ops, +ms | full: +ops, +ms "
             "| full over params, per module: ops, µs | sampled step: +ops (steps/params/full) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        cells = [f"{r['param_tensors']} ({r['tapped_modules']})", f"{r['plain_ops']}, {r['plain_ms']:.2f}"]
        cells += [f"+{r[f'{lv}_extra_ops']}, {r[f'{lv}_extra_ms']:+.2f}" for lv in LEVELS[1:]]
        cells.append(f"{r['full_ops_per_module']:.2f}, {r['full_us_per_module']:.1f}")
        cells.append(" / ".join(str(r[f"{lv}_sampled_extra_ops"]) for lv in LEVELS[1:]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "host_cost_cpu.json"))
    parser.add_argument("--clock", choices=["thread", "wall"], default="thread",
                        help="the training thread's CPU time (default) or wall time")
    args = parser.parse_args()
    torch.set_num_threads(1)  # host cost, not kernel parallelism
    result = measure(args.rounds, clock=time.thread_time if args.clock == "thread" else time.perf_counter)
    print(table(result))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
