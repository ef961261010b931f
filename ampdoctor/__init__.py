"""ampdoctor: debugging and diagnostics for PyTorch automatic mixed precision.

The names below load their modules on first use: ``import ampdoctor`` (and the ``ampdoctor``
command's ``--help`` and ``--version``) import neither torch nor pandas until they are needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

from .errors import AmpdoctorError, RecorderError, RunError  # noqa: E402

_LAZY = {"GradScaler": "scaler", "wrap": "scaler", "unwrap": "scaler", "load": "run", "read_run": "run",
         "Run": "run", "find_origins": "analysis.origins", "postmortem": "analysis.postmortem"}

if TYPE_CHECKING:
    from .analysis.origins import find_origins
    from .analysis.postmortem import postmortem
    from .run import Run, load, read_run
    from .scaler import GradScaler, unwrap, wrap

__all__ = ["GradScaler", "wrap", "unwrap", "load", "read_run", "Run", "find_origins", "postmortem",
           "AmpdoctorError", "RecorderError", "RunError", "__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ampdoctor' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
