"""The footer metadata of a run's segments (docs/run-file.md, Footer metadata), keys from
:mod:`ampdoctor.run_file.schema`. The writer adds its own (writer id, segment, final flag, rank)."""

from __future__ import annotations

import json
import time

import torch

from ..version import __version__
from .hooks import WRAPPER_CLASSES, clean_name
from .options import RecordOptions
from ..run_file.schema import (META_AMP_DTYPE, META_DEVICE, META_DROPPED_STEPS, META_HIST_BINS, META_HIST_MIN_EXP,
                               META_GEMM_LAYERS, META_INIT_SCALE, META_LEVEL, META_MODULE_TYPES, META_RUN_ID,
                               META_RUN_STARTED, META_SCALER_CLASS, META_SCALER_ENABLED, META_SCALER_FRAMEWORK,
                               META_SCHEMA_VERSION,
                               META_TORCH_VERSION, META_VERSION, META_WORLD_SIZE, SCALER_META, SCHEMA_VERSION)

# Every segment footer carries the module types: a cap keeps a model of thousands of indexed
# modules (a 2000-layer ModuleList) from making each footer hundreds of kilobytes.
MAX_MODULE_TYPES = 2000


class RunMetadata:
    """What a recording says about itself in every segment. Fixed when recording starts, except
    what the recorder learns later: the AMP dtype (at the first forward), the run id (a resumed
    run continues another) and the steps dropped so far."""

    def __init__(self, scaler: torch.amp.GradScaler, scaler_class: str, options: RecordOptions, *,
                 device_type: str, world_size: int, model: torch.nn.Module | None = None) -> None:
        """Reads the current scale once (a sync) when ``scaler`` has already been used. ``model``:
        the unwrapped model (:func:`~ampdoctor.record.hooks.unwrap_model`), whose indexed modules' types
        are recorded."""
        fixed = {META_SCHEMA_VERSION: str(SCHEMA_VERSION), META_VERSION: __version__,
                 META_TORCH_VERSION: torch.__version__, META_SCALER_CLASS: scaler_class,
                 META_SCALER_ENABLED: str(scaler.is_enabled()).lower(),
                 META_INIT_SCALE: str(_current_scale(scaler)), META_DEVICE: device_type}
        for name in ("growth_factor", "backoff_factor", "growth_interval"):  # a disabled torch scaler has none
            if hasattr(scaler, f"_{name}"):
                fixed[SCALER_META[name]] = str(getattr(scaler, f"_{name}"))
        if model is not None:
            fixed[META_MODULE_TYPES] = json.dumps(module_types(model), separators=(",", ":"))
            framework = framework_of(model)
            if framework is not None:
                fixed[META_SCALER_FRAMEWORK] = framework
        self._fixed = fixed
        self._world_size = str(world_size)
        self._options = options
        self.started = time.strftime("%Y-%m-%dT%H:%M:%S%z")

    def came_through(self, framework: str) -> None:
        """The run's scaler is set through ``framework``'s own arguments (``"lightning"``,
        ``"accelerate"``): said by the integrations, which know."""
        self._fixed[META_SCALER_FRAMEWORK] = framework

    def gemm_layers(self, layers: dict[str, str]) -> None:
        """The GEMM layers whose operands are recorded ({name: class name}; gemm_operands.py)."""
        self._fixed[META_GEMM_LAYERS] = json.dumps(layers, separators=(",", ":"))

    def __call__(self, *, amp_dtype: str, run_id: str, dropped_steps: int) -> dict[str, str]:
        """The metadata of a segment written now (on the writer thread)."""
        return {
            **self._fixed, META_AMP_DTYPE: amp_dtype, META_WORLD_SIZE: self._world_size,
            META_HIST_MIN_EXP: str(self._options.hist_min_exp), META_HIST_BINS: str(self._options.hist_bins),
            META_RUN_ID: run_id, META_RUN_STARTED: self.started, META_LEVEL: self._options.level,
            META_DROPPED_STEPS: str(dropped_steps),
        }


# Where a model's class comes from -> the framework that builds the scaler for it.
_FRAMEWORK_MODULES = (("lightning.pytorch.", "lightning"), ("pytorch_lightning.", "lightning"),
                      ("lightning.fabric.", "fabric"), ("lightning_fabric.", "fabric"))


def framework_of(model: torch.nn.Module) -> str | None:
    """``"lightning"`` when ``model`` is a LightningModule, ``"fabric"`` when it is Fabric's module
    wrapper: Lightning builds their scaler from its own arguments; else None. Reads class names
    only."""
    for cls in type(model).__mro__:
        module = f"{cls.__module__}."
        for prefix, framework in _FRAMEWORK_MODULES:
            if module.startswith(prefix):
                return framework
    return None


def module_types(model: torch.nn.Module, limit: int = MAX_MODULE_TYPES) -> dict[str, str]:
    """{qualified name, as the rows name it: class name} of the modules whose name ends in an
    integer (the children of ``nn.Sequential`` and ``nn.ModuleList``: ``blocks.0``, ``mlp.2``), where
    a bare index tells a reader nothing. The first ``limit`` of them, in ``named_modules()`` order.

    Wrapper levels are skipped (FSDP1's ``layers.0`` is a FullyShardedDataParallel holding the
    block at ``layers.0._fsdp_wrapped_module``; both clean to ``layers.0``, which is the block)."""
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        name = clean_name(name)
        if type(module).__name__ in WRAPPER_CLASSES or not name.rpartition(".")[2].isdigit():
            continue
        if name not in out and len(out) >= limit:
            break
        out[name] = type(module).__name__
    return out


def _current_scale(scaler: torch.amp.GradScaler) -> float:
    """The scale a recording starts from. Reads the device scale once (a sync) when wrapping a
    scaler that has already been used; free for a new scaler."""
    if not scaler.is_enabled():
        return 1.0
    if getattr(scaler, "_scale", None) is None:
        return float(scaler._init_scale)
    return float(scaler.get_scale())
