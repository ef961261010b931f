"""The built-in demo: a small GPT-like transformer trained with fp16 AMP on synthetic data, in one
of a few scenarios that each show one problem the report or the postmortem explains."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ..analysis.scaler_config import TORCH_SETTINGS, ScalerConfig
from ..errors import AmpdoctorError, RecorderError, RunError
from ..run_file.names import is_written_by_ampdoctor
from .scenarios import CPU_STEPS, CUDA_STEPS, DEFAULT_PATH, SCENARIOS

STEPS_AFTER_FAULT = 4   # the nan scenario trains on this many steps after the event, as a real run would


class DemoError(AmpdoctorError, ValueError):
    """A demo that cannot run as asked: an unknown scenario, CUDA without a GPU, or an output path
    that holds something other than a run."""


class RecordingStopped(AmpdoctorError):
    """The demo trained but its run is not whole: the recorder failed (a full disk, an unwritable
    directory, a writer that died) or did not finish writing. The message names the step, the
    cause and the steps the run holds, so that nobody reads a report of a partial run as the demo's."""


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
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 64, layers: int = 2, heads: int = 4, context: int = 32):
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


def synthetic_batch(gen: torch.Generator, batch: int, context: int, vocab: int, device) -> tuple:
    """Sequences that count upward modulo ``vocab`` from a random start: learnable, so the loss falls."""
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    step = torch.randint(1, 4, (batch, 1), generator=gen)
    seq = (start + step * torch.arange(context + 1)) % vocab
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


@dataclass
class DemoResult:
    path: str
    steps: int
    device: str
    final_loss: float
    final_scale: float
    scenario: str = "healthy"
    fault_step: int | None = None       # the first step with the blown-up weight: its loss is the first NaN
    settings: dict | None = None        # the GradScaler settings it trained with


def resolve_device(device: str | None) -> str:
    """``"cuda"`` when available and not asked otherwise, else ``"cpu"``; refuses CUDA without a GPU."""
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise DemoError(f"device {device!r}: CUDA is not available on this machine")
    return device


def default_steps(device: str) -> int:
    return CPU_STEPS if device == "cpu" else CUDA_STEPS


def fault_step(scenario: str, steps: int) -> int | None:
    """The first step that trains with ``scenario``'s blown-up weight (None: no fault). The run goes
    on for STEPS_AFTER_FAULT more steps, as a real run does until someone stops it."""
    cfg = SCENARIOS[scenario]
    if not cfg.fault_module:
        return None
    return steps // 2 if cfg.fault_outlier else max(0, steps - 1 - STEPS_AFTER_FAULT)


def clear_previous_run(path: str | os.PathLike) -> None:
    """Remove the run a previous demo left at ``path`` (a scaler appends to an existing run, and two
    runs would mix). Anything else there is left alone: a DemoError, not a deleted directory."""
    if not os.path.lexists(path):
        return
    entries = os.listdir(path) if os.path.isdir(path) and not os.path.islink(path) else None
    if entries is None or not all(is_written_by_ampdoctor(name) for name in entries):
        raise DemoError(f"{os.fspath(path)}: exists and is not an ampdoctor run; choose another output path")
    shutil.rmtree(path)


@contextlib.contextmanager
def _restore_threads(threads: int):
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def scaler_settings(scenario: str, **overrides: float | None) -> dict[str, float]:
    """The four GradScaler settings ``scenario`` trains with, with the given non-None ``overrides``
    (``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``) in their place."""
    if scenario not in SCENARIOS:
        raise DemoError(f"unknown scenario {scenario!r}: choose one of {', '.join(SCENARIOS)}")
    unknown = set(overrides) - set(TORCH_SETTINGS)
    if unknown:
        raise DemoError(f"not a GradScaler setting: {', '.join(sorted(unknown))}")
    cfg = SCENARIOS[scenario]
    settings = {"init_scale": cfg.init_scale, "growth_factor": 2.0, "backoff_factor": 0.5,
                "growth_interval": cfg.growth_interval}
    settings.update({k: v for k, v in overrides.items() if v is not None})
    settings["growth_interval"] = int(settings["growth_interval"])
    try:  # torch's GradScaler takes any number; a scale of 0 or a backoff above 1 would train nonsense
        ScalerConfig(**settings)
    except ValueError as exc:
        raise DemoError(f"scaler settings: {exc}") from None
    return settings


def recommended_settings(run: str | os.PathLike, run_id: str | None = None) -> dict[str, float]:
    """The four GradScaler settings the report of ``run`` recommends (``--settings-from``): to
    train a scenario again with them and check the prediction with ``ampdoctor compare``."""
    from ..analysis.report import report_data
    from ..read.run import read_run

    recommendation = report_data(read_run(run, run_id))["recommendation"]
    if recommendation is None:
        raise DemoError(f"{os.fspath(run)}: its report has no recommendation (too few steps) to train with")
    return {key: recommendation[key] for key in TORCH_SETTINGS}


def run_demo(path: str | os.PathLike = DEFAULT_PATH, *, scenario: str = "healthy", steps: int | None = None,
             device: str | None = None, seed: int = 0,
             progress: Callable[[int], None] | None = None, **settings: float | None) -> DemoResult:
    """Train the demo model with ``ampdoctor.GradScaler`` in ``scenario`` (a key of SCENARIOS) and
    write a run to ``path``, replacing the run a previous demo wrote there.

    CUDA when available (fp16 autocast, a larger model), else the CPU (fp16 autocast, tiny model
    so that it finishes in seconds). ``progress(n)`` is called after every step. ``settings``:
    GradScaler settings (``init_scale``, ``growth_factor``, ``backoff_factor``,
    ``growth_interval``) that replace the scenario's, e.g. a report's recommendation
    (:func:`recommended_settings`); the model, data and fault stay the scenario's.

    Raises :class:`RecordingStopped` when the run written is not whole: the recorder failed
    (training stops there) or did not finish writing."""
    from ..record.scaler import GradScaler

    scaler_kwargs = scaler_settings(scenario, **settings)
    cfg = SCENARIOS[scenario]
    device = resolve_device(device)
    device_type = torch.device(device).type
    cpu = device_type == "cpu"
    steps = steps or default_steps(device)
    fault_at = fault_step(scenario, steps)
    clear_previous_run(path)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab, context = 64, (16 if cpu else 128)
    model = TinyGPT(vocab=vocab, d=32 if cpu else 256, layers=2 if cpu else 4, heads=4,
                    context=context).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 20))
    batch = 16 if cpu else 32
    loss = torch.tensor(math.nan)
    threads = torch.get_num_threads()
    step = None  # the step in progress (None: before the first; ``steps``: closing the run)
    try:
        # strict: the run is what the demo is for, so a recorder failure ends it at once and names
        # its cause (without strict it warns once, recording stops and training goes on).
        scaler = GradScaler(device_type, **scaler_kwargs, model=model, path=path, amp_dtype=torch.float16,
                            level=cfg.level, strict=True,
                            **({"module_every": cfg.module_every} if cfg.module_every else {}))
        if cpu:  # one thread: the same run, bit for bit, on any number of cores (reductions split alike)
            torch.set_num_threads(1)
        with scaler, warnings.catch_warnings(), _restore_threads(threads):
            # A step the scaler skips makes torch think the scheduler runs before the optimizer; it does not.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            for step in range(steps):
                if step == fault_at:
                    weight = model.get_submodule(cfg.fault_module).weight
                    with torch.no_grad():
                        if cfg.fault_outlier:  # its largest element only
                            flat = weight.view(-1)
                            top = flat.abs().argmax()
                            flat[top] = cfg.fault_peak * flat[top].sign()
                        else:
                            weight.mul_(cfg.fault_peak / weight.abs().max())
                x, y = synthetic_batch(gen, batch, context, vocab, device)
                with torch.autocast(device_type, dtype=torch.float16):
                    logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, vocab), y.reshape(-1))
                scaler.scale(loss * cfg.loss_factor).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                schedule.step()
                if progress is not None:
                    progress(1)
            step = steps  # what fails from here fails in close(), writing the last segment
            final_scale = scaler.get_scale()
    except RecorderError as exc:
        cause = exc.__cause__ or exc
        raise RecordingStopped(f"{_stopped_at(step, steps)}: {type(cause).__name__}: {cause}; "
                               f"{_held_steps(path, steps)}") from exc
    _check_whole(path, steps)
    # The cross-entropy, before the scenario's loss factor: comparable across scenarios.
    return DemoResult(os.fspath(path), steps, device, float(loss.detach()), final_scale, scenario, fault_at,
                      scaler_kwargs)


def _stopped_at(step: int | None, steps: int) -> str:
    if step is None:
        return "recording could not start"
    if step >= steps:
        return f"recording stopped when the run was closed, after step {steps - 1}"
    return f"recording stopped at step {step} of {steps}"


def _held_steps(path: str | os.PathLike, steps: int) -> str:
    """What the run at ``path`` holds after a failure, read back from its segments' footers."""
    from ..read.run import read_run

    try:
        span = read_run(path).step_range()
    except RunError:  # no finished segment: nothing, or only a segment still being written
        return f"nothing was written to {os.fspath(path)}"
    if span is None:
        return f"the run at {os.fspath(path)} holds no steps"
    held = f"step {span[0]}" if span[0] == span[1] else f"steps {span[0]}-{span[1]}"
    return f"the run at {os.fspath(path)} holds only {held} (of 0-{steps - 1})"


def _check_whole(path: str | os.PathLike, steps: int) -> None:
    """Refuse a run that does not hold every step trained, closed cleanly: the writer failing
    raises RecorderError above, but one that did not finish in time (a stalled disk) only warns."""
    from ..read.run import read_run

    try:
        run = read_run(path)
        whole = run.ended_cleanly and run.step_range() == (0, steps - 1)
    except RunError:
        whole = False
    if not whole:
        raise RecordingStopped(f"recording did not finish: the writer had not written the whole run when "
                               f"training ended; {_held_steps(path, steps)}")


class StepTimer:
    """The time left, estimated from the most recent steps: the first steps of a run include
    warm-up (allocations, kernel selection, the recorder's first segment), often more than the
    rest of a short run together, so an average since the start overestimates it several times
    over (click's own ETA said 38 s for a 5 s demo). Steps are timed between ``advance`` calls;
    the time before the first one (building the model, the first step's warm-up) counts for
    nothing."""

    WINDOW = 10        # the steps the rate is measured over
    MIN_INTERVALS = 2  # timed steps before an estimate is given

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.done = 0
        self._clock = clock
        self._marks: deque[tuple[float, int]] = deque(maxlen=self.WINDOW + 1)  # (time, steps done)

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._marks.append((self._clock(), self.done))

    def seconds_left(self) -> float | None:
        """Seconds to the last step at the recent rate; None until enough steps are timed."""
        if len(self._marks) <= self.MIN_INTERVALS:
            return None
        (t0, n0), (t1, n1) = self._marks[0], self._marks[-1]
        if n1 <= n0:
            return None
        return max(0, self.total - self.done) * (t1 - t0) / (n1 - n0)

    def eta(self) -> str:
        """``eta 00:00:04`` (as click writes times), or ``""`` while unknown."""
        left = self.seconds_left()
        if left is None:
            return ""
        t = int(round(left))
        return f"eta {t // 3600:02}:{t // 60 % 60:02}:{t % 60:02}"
