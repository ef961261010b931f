"""Integrations with training frameworks, one optional extra each.

``ampdoctor.integrations.accelerate``, ``.transformers`` and ``.lightning`` import their framework
when they are imported themselves; this package and ``import ampdoctor`` import none of them.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

import torch

from ..record.options import RecordOptions
from ..record.scaler import unwrap, wrap

__all__ = ["require", "CallbackRun"]


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


class CallbackRun:
    """What the framework callbacks share: options checked when the callback is made, the
    framework's scaler wrapped in place for the length of training, and ``close()``."""

    framework: str | None = None  # whose arguments set the scaler (run-file ``scaler.framework``)

    def __init__(self, path: str | os.PathLike | None = None, **options: Any) -> None:
        options = dict(options)
        self.start_step = options.pop("start_step", None)
        RecordOptions(path=path, **options)  # bad options fail here, not at the start of training
        self.path = path
        self.options = options
        self.scaler: torch.amp.GradScaler | None = None

    def _record(self, scaler: torch.amp.GradScaler, model, start_step: int) -> None:
        """Wrap ``scaler`` (at most one sync: reading the scale of a restored scaler), numbering
        steps from ``start_step`` unless the callback was given one. A scaler means fp16."""
        self.close()
        options = dict(self.options)
        options.setdefault("amp_dtype", torch.float16)
        start = start_step if self.start_step is None else self.start_step
        self.scaler = wrap(scaler, model=model, path=self.path, start_step=start, **options)
        recorder = getattr(self.scaler, "recorder", None)  # (none: a rank not recording, a set-up it cannot use)
        if self.framework is not None and recorder is not None:
            recorder.came_through(self.framework)

    def close(self) -> None:
        """Finish the run and give the scaler its plain class back. Idempotent."""
        scaler, self.scaler = self.scaler, None
        if scaler is not None:
            unwrap(scaler)
