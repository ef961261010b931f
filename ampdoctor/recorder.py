"""The recorder: what one training iteration observed, handed from the training thread to the writer.

The scaler calls, per iteration, ``observe_loss`` (from ``scale``), ``observe_grads`` (from
``unscale_``/``step``, before torch unscales, so the values are the scaled ones backward produced),
``before_update`` and ``after_update``. None of them syncs: statistics stay on the device,
``after_update`` starts non-blocking copies into pinned memory, records an event and queues the
record; the writer thread waits on the event. Every method is guarded: an exception of ours warns
once and stops recording, and is raised (as :class:`RecorderError`) only with ``strict=True``.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

from . import __version__
from .errors import RecorderError
from .formats import dtype_name, float_format
from .schema import HIST_BINS, HIST_MIN_EXP, META_SCHEMA_VERSION, META_TORCH_VERSION, META_VERSION, SCHEMA_VERSION
from .stats import DeviceStats, HostStats, SlotLayouts, tensor_stats, to_host
from .writer import RunWriter, close_all_writers

LEVELS = ("steps", "params")


@dataclass(frozen=True)
class RecordOptions:
    """The keyword-only recording options of :class:`ampdoctor.GradScaler` and :func:`ampdoctor.wrap`."""

    path: str | os.PathLike | None = None
    level: str = "params"
    every: int = 1
    strict: bool = False
    flush_every: int = 1000
    flush_seconds: float = 60.0
    amp_dtype: torch.dtype | str | None = None
    hist_min_exp: int = HIST_MIN_EXP
    hist_bins: int = HIST_BINS
    queue_size: int = 256
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level!r}")
        for name in ("every", "flush_every", "hist_bins", "queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not self.flush_seconds > 0:
            raise ValueError(f"flush_seconds must be > 0, got {self.flush_seconds!r}")
        if self.amp_dtype is not None:
            float_format(self.amp_dtype)  # ValueError for a non-float dtype


def default_path() -> str:
    return f"ampdoctor-{time.strftime('%Y%m%d-%H%M%S')}.parquet"


@dataclass
class GroupRecord:
    """The observed gradients of one (device, dtype) group of one optimizer."""

    names: list[str]
    dtype: str
    numels: np.ndarray
    stats: DeviceStats


@dataclass
class StepRecord:
    step: int
    rank: int
    per_tensor: bool
    amp_dtype: str
    scalars: torch.Tensor | None      # float32 [scale, found_inf, loss] (None: scaling off, no loss)
    groups: list[GroupRecord] = field(default_factory=list)
    event: Any = None                 # torch.cuda.Event to wait on before reading


def _guarded(method):
    """Run a recorder method so that a failure never reaches the training loop (unless strict)."""

    @functools.wraps(method)
    def run(self: "Recorder", *args, **kwargs):
        if not self.active:
            return None
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a recorder bug must not stop training
            self.fail(exc)
            return None

    return run


class Recorder:
    """Collects one scaler's observations and feeds a :class:`RunWriter`."""

    def __init__(self, scaler: torch.amp.GradScaler, model: torch.nn.Module | None,
                 options: RecordOptions, *, scaler_class: str, start_step: int = 0) -> None:
        self.options = options
        self.active = True
        self.step = start_step
        self.path = os.fspath(options.path) if options.path is not None else default_path()
        self.device_type = torch.device(getattr(scaler, "_device", "cuda")).type
        self._names: dict[int, str] = {}
        self._optimizer_index: dict[int, int] = {}
        self._observed: set[int] = set()
        self._groups: list[GroupRecord] = []
        self._loss: torch.Tensor | None = None
        self._layouts = SlotLayouts()
        self._reported = False  # a failure has been warned about (or raised)
        self._sniff_handle = None
        self._amp_dtype = dtype_name(options.amp_dtype) if options.amp_dtype is not None else None
        self.rank, self.world_size = _rank_and_world(options.rank)
        self.run_id = os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex
        self.started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self._scaler_meta = {
            "scaler.class": scaler_class,
            "scaler.init_scale": str(_current_scale(scaler)),
            "scaler.growth_factor": str(getattr(scaler, "_growth_factor", "")),
            "scaler.backoff_factor": str(getattr(scaler, "_backoff_factor", "")),
            "scaler.growth_interval": str(getattr(scaler, "_growth_interval", "")),
            "device": self.device_type,
        }
        if model is not None:
            self._names = {id(p): n for n, p in model.named_parameters()}
            if self._amp_dtype is None:
                self._sniff_handle = model.register_forward_pre_hook(self._sniff_autocast)
        self.writer = RunWriter(
            self.path, metadata=self._metadata, materialize=self._materialize, rank=self.rank,
            hist_bins=options.hist_bins, flush_every=options.flush_every,
            flush_seconds=options.flush_seconds, queue_size=options.queue_size)
        _install_sigterm_handler()
        self._check_path()

    # -- lifecycle -------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """Stop recording after ``exc``: warn once, or raise in strict mode."""
        self.active = False
        self._remove_hooks()
        self.writer.close()
        first, self._reported = not self._reported, True
        if self.options.strict:
            raise RecorderError(f"ampdoctor recording failed: {type(exc).__name__}: {exc}") from exc
        if first:
            warnings.warn(f"ampdoctor: recording to {self.path} stopped ({type(exc).__name__}: "
                          f"{exc}); training continues unaffected", RuntimeWarning, stacklevel=4)

    def close(self) -> None:
        """Flush and finish the run. Idempotent. Waits for the writer thread (host-side only)."""
        self._remove_hooks()
        self.active = False
        self.writer.close()
        if self.writer.error is not None and not self._reported:
            self.fail(self.writer.error)

    def _remove_hooks(self) -> None:
        if self._sniff_handle is not None:
            self._sniff_handle.remove()
            self._sniff_handle = None

    @_guarded
    def _check_path(self) -> None:
        os.makedirs(self.path, exist_ok=True)

    # -- observations (training thread; none of these syncs) -------------------------------
    def _sniff_autocast(self, module, args) -> None:
        if torch.is_autocast_enabled(self.device_type):
            self._amp_dtype = dtype_name(torch.get_autocast_dtype(self.device_type))
            self._remove_hooks()

    @property
    def amp_dtype(self) -> str:
        return self._amp_dtype or "float16"

    @_guarded
    def observe_loss(self, outputs: torch.Tensor | Iterable) -> None:
        """Add the unscaled value(s) passed to ``scale()`` to this iteration's loss."""
        for t in _tensors(outputs):
            value = t.detach().float().sum()
            self._loss = value if self._loss is None else self._loss + value.to(self._loss.device)

    @_guarded
    def observe_grads(self, optimizer: torch.optim.Optimizer, scale: torch.Tensor | None) -> None:
        """Statistics of ``optimizer``'s gradients, still scaled by ``scale`` (None: unscaled).
        Once per optimizer per iteration. Does not sync."""
        if id(optimizer) in self._observed:
            return
        self._observed.add(id(optimizer))
        per_tensor = self._per_tensor_step()
        inv_scale = scale.double().reciprocal().float() if scale is not None else None
        below = float_format(self.amp_dtype).smallest_normal
        groups: dict[tuple, tuple[list, list]] = {}
        for name, grad in self._named_grads(optimizer):
            key = (grad.device, grad.dtype)
            names, tensors = groups.setdefault(key, ([], []))
            names.append(name)
            tensors.append(grad)
        for (device, dtype), (names, tensors) in groups.items():
            inv = inv_scale.to(device, non_blocking=True) if inv_scale is not None else None
            stats = tensor_stats(tensors, inv_scale=inv, subnormal_below=below, per_tensor=per_tensor,
                                 hist_min_exp=self.options.hist_min_exp,
                                 hist_bins=self.options.hist_bins, layouts=self._layouts)
            numels = np.array([t.numel() for t in tensors], dtype=np.int64)
            self._groups.append(GroupRecord(names, dtype_name(dtype), numels, stats))

    def _named_grads(self, optimizer: torch.optim.Optimizer):
        k = self._optimizer_index.setdefault(id(optimizer), len(self._optimizer_index))
        prefix = "" if k == 0 else f"optimizer{k}."
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    # Observed through the stored values; coalesced so that duplicates are summed
                    # as the optimizer will see them (torch coalesces fp16 ones in unscale_ too).
                    grad = (grad if grad.is_coalesced() else grad.coalesce())._values()
                yield self._names.get(id(p)) or f"{prefix}group{g}.param{i}", grad

    @_guarded
    def before_update(self, scaler: torch.amp.GradScaler) -> torch.Tensor | None:
        """Snapshot [scale, found_inf, loss] before ``update()`` changes the scale in place."""
        scale = getattr(scaler, "_scale", None)
        if not scaler.is_enabled() or scale is None:
            if self._loss is None:
                return None
            return torch.stack([torch.ones_like(self._loss), torch.zeros_like(self._loss), self._loss])
        found = [f.to(scale.device, non_blocking=True)
                 for state in scaler._per_optimizer_states.values()
                 for f in state["found_inf_per_device"].values()]
        if not found:
            return None  # update() without step(): torch raises next, and we record nothing
        loss = (self._loss.to(scale.device, non_blocking=True) if self._loss is not None
                else torch.full((), float("nan"), device=scale.device))
        return torch.stack([scale.float(), torch.stack(found).sum(), loss])

    @_guarded
    def after_update(self, scalars: torch.Tensor | None) -> None:
        """Hand this iteration to the writer: start the copies, record an event, queue."""
        if self.writer.failed:
            self.fail(self.writer.error)
            return
        record = StepRecord(step=self.step, rank=self.rank, per_tensor=self._per_tensor_step(),
                            amp_dtype=self.amp_dtype, scalars=scalars, groups=self._groups)
        on_device = scalars is not None and scalars.device.type != "cpu"
        if on_device or any(g.stats.counts.device.type != "cpu" for g in record.groups):
            record.scalars = to_host(scalars) if scalars is not None else None
            for g in record.groups:
                g.stats = g.stats.to_host(non_blocking=True)
            if torch.cuda.is_available():
                record.event = torch.cuda.Event()
                record.event.record()
        self._groups, self._loss, self._observed = [], None, set()
        self.step += 1
        self._remove_hooks()  # the autocast dtype is known after the first iteration or never
        self.writer.put(record)

    def _per_tensor_step(self) -> bool:
        return self.options.level == "params" and self.step % self.options.every == 0

    # -- worker thread -----------------------------------------------------------------------
    def _metadata(self) -> dict[str, str]:
        return {
            META_SCHEMA_VERSION: str(SCHEMA_VERSION), META_VERSION: __version__,
            META_TORCH_VERSION: torch.__version__, **self._scaler_meta,
            "amp.dtype": self.amp_dtype, "world_size": str(self.world_size),
            "hist.min_exp": str(self.options.hist_min_exp), "hist.bins": str(self.options.hist_bins),
            "run.id": self.run_id, "run.started": self.started,
        }

    def _materialize(self, record: StepRecord) -> tuple[dict[str, np.ndarray], int, bool]:
        """Rows of one iteration: a step row, then one row per observed gradient."""
        if record.event is not None:
            record.event.synchronize()
        if record.scalars is not None:
            scale, found_inf, loss = (float(v) for v in record.scalars.tolist())
        else:
            scale, found_inf, loss = 1.0, 0.0, None
        skipped = found_inf > 0
        parts = [HostStats.from_device(g.stats) for g in record.groups]
        if parts:
            merged = HostStats.concat(parts)
            total = merged.total()
        else:
            merged, total = None, _empty_stats(self.options.hist_bins)
        names = [""]
        dtypes = [record.amp_dtype]
        numels = [int(sum(g.numels.sum() for g in record.groups))]
        kinds = ["step"]
        stats = [total]
        if record.per_tensor and merged is not None:
            for g in record.groups:
                names.extend(g.names)
                dtypes.extend([g.dtype] * len(g.names))
                numels.extend(g.numels.tolist())
            kinds.extend(["param_grad"] * (len(names) - 1))
            stats.append(merged)
        n = len(names)
        s = HostStats.concat(stats)
        loss_col = np.empty(n, dtype=object)
        loss_col[0] = loss
        block = {
            "step": np.full(n, record.step, dtype=np.int64),
            "rank": np.full(n, record.rank, dtype=np.int32),
            "kind": np.array(kinds, dtype=object),
            "name": np.array(names, dtype=object),
            "order": np.full(n, None, dtype=object),
            "dtype": np.array(dtypes, dtype=object),
            "numel": np.array(numels, dtype=np.int64),
            "scale": np.full(n, scale, dtype=np.float32),
            "skipped": np.full(n, skipped, dtype=bool),
            "loss": loss_col,
            "amax": s.amax, "amin": s.amin, "l2": s.l2,
            "n_zero": s.n_zero, "n_subnormal": s.n_subnormal, "n_nan": s.n_nan, "n_inf": s.n_inf,
            "hist": s.hist,
        }
        anomaly = skipped or (loss is not None and not np.isfinite(loss))
        return block, n, anomaly


def _empty_stats(bins: int) -> HostStats:
    return HostStats(np.zeros(1, np.float32), np.full(1, np.nan, np.float32), np.zeros(1, np.float32),
                     *(np.zeros(1, np.int64) for _ in range(4)), np.zeros((1, bins), np.int32))


def _tensors(outputs) -> Iterable[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        yield outputs
    elif isinstance(outputs, (list, tuple)):
        for o in outputs:
            yield from _tensors(o)


def _current_scale(scaler: torch.amp.GradScaler) -> float:
    """The scale a recording starts from. Reads the device scale once (a sync) when wrapping a
    scaler that has already been used; free for a new scaler."""
    if not scaler.is_enabled():
        return 1.0
    if getattr(scaler, "_scale", None) is None:
        return float(scaler._init_scale)
    return float(scaler.get_scale())


def _rank_and_world(rank: int | None) -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return (dist.get_rank() if rank is None else rank), dist.get_world_size()
    return (int(os.environ.get("RANK", 0)) if rank is None else rank,
            int(os.environ.get("WORLD_SIZE", 1)))


_sigterm_installed = False


def _install_sigterm_handler() -> None:
    """Flush every open run on SIGTERM, then let the previous handler (or the default) act."""
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        close_all_writers()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
        _sigterm_installed = True
    except (ValueError, OSError):  # not allowed here (embedded interpreter); atexit still flushes
        pass
