"""A loss-scaler configuration: torch's four ``GradScaler`` settings, plus the hysteresis and
scale bounds of Megatron and DeepSpeed; the one a run was recorded with."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from ..run_file.schema import (META_BACKOFF_FACTOR, META_GROWTH_FACTOR, META_GROWTH_INTERVAL, META_INIT_SCALE,
                               SCALER_META, meta_number)

FLOAT32_MAX = float(np.finfo(np.float32).max)
TORCH_SETTINGS = tuple(SCALER_META)  # GradScaler's keywords: init_scale, growth_factor, backoff_factor, growth_interval


@dataclass(frozen=True)
class ScalerConfig:
    """A dynamic loss-scaler configuration (torch's four settings, plus hysteresis and bounds)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1           # overflows in a row before backing off (Megatron, DeepSpeed); 1: torch
    min_scale: float = 0.0
    max_scale: float = math.inf

    def __post_init__(self) -> None:
        # torch keeps the scale in float32 and never grows it to a non-finite value.
        for name in ("init_scale", "growth_factor", "min_scale"):
            value = getattr(self, name)
            if not math.isfinite(value) or value > FLOAT32_MAX:
                raise ValueError(f"{name} must be finite and at most float32's max, got {value}")
        if not self.init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {self.init_scale}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if int(self.growth_interval) < 1 or int(self.hysteresis) < 1:
            raise ValueError("growth_interval and hysteresis must be >= 1")
        if self.min_scale > self.max_scale:
            raise ValueError(f"min_scale {self.min_scale} > max_scale {self.max_scale}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["max_scale"] = None if math.isinf(self.max_scale) else self.max_scale
        return d

    def shown_settings(self, current: ScalerConfig | None = None) -> dict[str, float]:
        """The torch settings worth writing out, in keyword order: ``init_scale``, and those that
        differ from torch's defaults or from ``current``."""
        default = ScalerConfig()
        return {name: getattr(self, name) for name in TORCH_SETTINGS
                if name == "init_scale" or getattr(self, name) != getattr(default, name)
                or (current is not None and getattr(self, name) != getattr(current, name))}


# Recorded scaler classes that the line to paste names as torch's scaler: torch's own (its
# deprecated per-device aliases too) and ampdoctor's drop-in, which is torch's while not recording.
_TORCH_SCALERS = frozenset({"torch.amp.grad_scaler.GradScaler", "torch.cuda.amp.grad_scaler.GradScaler",
                            "torch.cpu.amp.grad_scaler.GradScaler", "ampdoctor.GradScaler",
                            "ampdoctor.record.scaler.GradScaler"})
SHARDED_SCALER = "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler"
FRAMEWORKS = ("lightning", "fabric", "accelerate")  # whose own arguments the line to paste can use


def scaler_constructor(recorded_class: str | None) -> str:
    """The class the recommendation's line constructs: the run's own (FSDP's ``ShardedGradScaler``,
    a subclass), by the module path it was recorded with (a class defined in the script itself, or
    inside a function, by its name alone: no path imports it), and ``torch.amp.GradScaler`` for
    torch's and ampdoctor's scalers and for runs that do not say."""
    if not recorded_class or recorded_class in _TORCH_SCALERS:
        return "torch.amp.GradScaler"
    if "<locals>" in recorded_class:
        return recorded_class.rpartition(".")[2]
    return recorded_class.removeprefix("__main__.")


def with_defaults(base: ScalerConfig | None, **overrides) -> ScalerConfig:
    """``base`` (or torch's defaults) with the given non-None settings replaced."""
    cfg = base or ScalerConfig()
    changes = {k: v for k, v in overrides.items() if v is not None}
    return replace(cfg, **changes)


def recorded_config(metadata: dict[str, str], first_scale: float | None) -> ScalerConfig:
    """The configuration a run was recorded with: ``init_scale`` is the first recorded step's
    scale (the metadata's when there is none), the other settings the metadata's, else torch's
    defaults."""
    default = ScalerConfig()

    def setting(key: str, fallback: float) -> float:
        value = meta_number(metadata.get(key))
        return fallback if value is None else float(value)

    init = first_scale if first_scale is not None else setting(META_INIT_SCALE, default.init_scale)
    return ScalerConfig(init_scale=float(init), growth_factor=setting(META_GROWTH_FACTOR, default.growth_factor),
                        backoff_factor=setting(META_BACKOFF_FACTOR, default.backoff_factor),
                        growth_interval=int(setting(META_GROWTH_INTERVAL, default.growth_interval)))
