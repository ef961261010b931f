"""The recording options of :class:`ampdoctor.GradScaler` and :func:`ampdoctor.wrap`, checked once."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..float_formats import float_format
from .hooks import ModuleFilter
from ..run_file.schema import HIST_BINS, HIST_MIN_EXP, LEVELS

# Full statistics of the gradients every 100 steps; of the module taps (about ten times the
# elements of the gradients in a transformer) every 1000, unless ``every`` is set explicitly.
DEFAULT_EVERY = 100
DEFAULT_MODULE_EVERY = 1000

@dataclass(frozen=True)
class RecordOptions:
    """The keyword-only recording options of :class:`ampdoctor.GradScaler` and :func:`ampdoctor.wrap`."""

    path: str | os.PathLike | None = None
    level: str = "params"
    every: int | None = None          # None: DEFAULT_EVERY
    module_every: int | None = None   # None: ``every`` when given, else DEFAULT_MODULE_EVERY
    measure_every: int | None = None  # measured underflow (underflow_probe.py); None: module_every or 1000; 0: never
    strict: bool = False
    flush_every: int = 1000
    flush_seconds: float = 60.0
    amp_dtype: torch.dtype | str | None = None
    hist_min_exp: int = HIST_MIN_EXP
    hist_bins: int = HIST_BINS
    queue_size: int = 256
    rank: int | None = None
    modules: ModuleFilter = None
    flight_steps: int = 32
    escalate_steps: int = 20
    scale_floor: float | None = 1.0
    check_params: bool | str = True  # True: sampled steps, escalated steps and the end; "always"; False
    ranks: Any = None  # the ranks that record (an int or an iterable of ints); None: all
    fp8: bool = True  # at level="full": the GEMM operands that `ampdoctor fp8` reads (gemm_operands.py)

    @property
    def gradient_interval(self) -> int:
        return self.every or DEFAULT_EVERY

    @property
    def module_interval(self) -> int:
        return self.module_every or self.every or DEFAULT_MODULE_EVERY

    @property
    def measure_interval(self) -> int:
        """Steps between measured-underflow steps (0: none). By default ``module_every`` when
        given, else DEFAULT_MODULE_EVERY (not ``every``: a measured step costs several sampled
        ones), rounded up to a multiple of the gradient interval (a measured step is a sampled one)."""
        if self.measure_every is not None:
            return self.measure_every
        every = self.gradient_interval
        return -(-(self.module_every or DEFAULT_MODULE_EVERY) // every) * every

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level!r}")
        for name in ("every", "module_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.measure_every is not None and (not isinstance(self.measure_every, int)
                                               or isinstance(self.measure_every, bool) or self.measure_every < 0):
            raise ValueError(f"measure_every must be a non-negative int or None, got {self.measure_every!r}")
        for name in ("flush_every", "hist_bins", "queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("flight_steps", "escalate_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.scale_floor is not None and not self.scale_floor > 0:
            raise ValueError(f"scale_floor must be > 0 or None, got {self.scale_floor!r}")
        if not self.flush_seconds > 0:
            raise ValueError(f"flush_seconds must be > 0, got {self.flush_seconds!r}")
        if self.amp_dtype is not None:
            float_format(self.amp_dtype)  # ValueError for a non-float dtype
        if not isinstance(self.fp8, bool):
            raise TypeError(f"fp8 must be True or False, got {self.fp8!r}")
        if self.check_params not in (True, False, "always"):
            raise ValueError(f"check_params must be True, False or 'always', got {self.check_params!r}")
        if self.ranks is not None:
            ranks = (self.ranks,) if isinstance(self.ranks, int) else self.ranks
            try:
                ranks = tuple(ranks)
            except TypeError:
                raise TypeError(f"ranks must be an int, an iterable of ints or None, got {self.ranks!r}") from None
            if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
                raise ValueError(f"ranks must be non-negative ints, got {self.ranks!r}")
            object.__setattr__(self, "ranks", ranks)


def default_path() -> str:
    return f"ampdoctor-{time.strftime('%Y%m%d-%H%M%S')}.parquet"
