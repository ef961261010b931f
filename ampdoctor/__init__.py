"""ampdoctor: debugging and diagnostics for PyTorch automatic mixed precision.

The names below load their modules on first use: ``import ampdoctor`` (and the ``ampdoctor``
command's ``--help`` and ``--version``) import neither torch nor pandas until they are needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import AmpdoctorError, RecorderError, RunError
from .version import __version__

# name → (module, its attribute)
_LAZY = {"GradScaler": ("record.scaler", "GradScaler"), "wrap": ("record.scaler", "wrap"),
         "unwrap": ("record.scaler", "unwrap"),
         "load": ("read.run", "load"), "read_run": ("read.run", "read_run"), "Run": ("read.run", "Run"),
         "find_origins": ("analysis.origins", "find_origins"),
         "report": ("commands", "report"), "postmortem": ("commands", "postmortem"),
         "compare": ("commands", "compare"), "simulate": ("commands", "simulate"),
         "layers": ("commands", "layers"), "fp8": ("commands", "fp8")}

if TYPE_CHECKING:
    from .analysis.origins import find_origins
    from .commands import compare, fp8, layers, postmortem, report, simulate
    from .read.run import Run, load, read_run
    from .record.scaler import GradScaler, unwrap, wrap

__all__ = ["GradScaler", "wrap", "unwrap", "load", "read_run", "Run", "find_origins", "report", "postmortem",
           "compare", "simulate", "layers", "fp8", "AmpdoctorError", "RecorderError", "RunError", "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ampdoctor' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    from .dependencies import check, dependency_error, failed_import
    check()  # a pyarrow that cannot import with this numpy: one line, before its own traceback
    try:
        value = getattr(importlib.import_module(f".{module}", __name__), attribute)
    except Exception as exc:
        if not failed_import(exc):
            raise
        raise dependency_error(exc) from exc  # one line naming the cause, not the traceback alone
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
