"""Integrations with training frameworks, one optional extra each.

``ampdoctor.integrations.accelerate``, ``.transformers`` and ``.lightning`` import their framework
when they are imported themselves; this package and ``import ampdoctor`` import none of them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str) -> ModuleType:
    """Import ``module``, or raise an ImportError that names the extra to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        # Only the framework itself being absent is our message; a dependency missing inside an
        # installed framework is the framework's own error and must stay visible as it is.
        if exc.name is None or exc.name.split(".")[0] != top:
            raise
        raise ImportError(f"ampdoctor.integrations.{extra} needs the {top!r} package: "
                          f'pip install "ampdoctor[{extra}]"', name=top) from exc
