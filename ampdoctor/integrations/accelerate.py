"""Hugging Face Accelerate: record the GradScaler an ``Accelerator`` made for fp16.

    accelerator = Accelerator(mixed_precision="fp16")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    scaler = ampdoctor.integrations.accelerate.instrument(accelerator, model=model, path="run")
    ...  # train as usual
    scaler.close()  # or ampdoctor.unwrap(scaler)

Needs ``pip install "ampdoctor[accelerate]"``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..record.scaler import wrap
from . import require

_accelerate = require("accelerate", "accelerate")

__all__ = ["instrument"]


def instrument(accelerator, *, model: torch.nn.Module | None = None,
               path: str | os.PathLike | None = None, **options: Any) -> torch.amp.GradScaler:
    """Instrument ``accelerator.scaler`` in place with :func:`ampdoctor.wrap` and return it.

    Call it before the first iteration, before or after ``accelerator.prepare()``: the prepared
    optimizer holds the same scaler object, so it records either way. ``model`` names the
    parameters and may be the prepared model (DDP and ``torch.compile`` wrappers are looked
    through). ``options`` are :func:`ampdoctor.wrap`'s; ``amp_dtype`` defaults to float16, since
    Accelerate makes a scaler only for fp16. Steps are counted per ``scaler.update()``, which
    Accelerate calls once per optimizer step (not per micro-batch under gradient accumulation).

    Syncs at most once: reading the current scale when the scaler has already been used.

    Raises ValueError when the accelerator has no GradScaler: Accelerate creates one only for
    ``mixed_precision="fp16"`` on a GPU (or another accelerator device). With bf16, fp8, no mixed
    precision, DeepSpeed (its own loss scaling) or on the CPU (where Accelerate 1.x accepts
    ``mixed_precision="fp16"`` but trains in fp32, without autocast or scaler) there is no loss
    scaling for ampdoctor to observe.
    """
    if not isinstance(accelerator, _accelerate.Accelerator):
        raise TypeError(f"instrument() expects an accelerate.Accelerator, got {type(accelerator).__name__}")
    scaler = getattr(accelerator, "scaler", None)
    if scaler is None:
        raise ValueError(
            f"this Accelerator has no GradScaler (mixed_precision={accelerator.mixed_precision!r}, "
            f"device={accelerator.device.type!r}, distributed_type={accelerator.distributed_type}); "
            "ampdoctor records fp16 loss scaling, which Accelerate uses only with "
            "mixed_precision='fp16' on a GPU. On the CPU Accelerate trains fp16 in fp32, unscaled; "
            "DeepSpeed scales the loss itself.")
    if accelerator.mixed_precision == "fp16":
        options.setdefault("amp_dtype", torch.float16)
    scaler = wrap(scaler, model=model, path=path, **options)
    recorder = getattr(scaler, "recorder", None)  # (none: a rank that does not record, a set-up it cannot use)
    if recorder is not None:
        recorder.came_through("accelerate")
    return scaler
