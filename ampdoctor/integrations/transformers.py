"""Hugging Face Transformers: a ``TrainerCallback`` that records the Trainer's fp16 GradScaler.

    trainer = Trainer(model, args, ..., callbacks=[AmpdoctorCallback(path="run")])
    trainer.train()

Needs ``pip install "ampdoctor[transformers]"`` (Transformers and Accelerate).
"""

from __future__ import annotations

import torch

from . import CallbackRun, require

_transformers = require("transformers", "transformers")

__all__ = ["AmpdoctorCallback"]


class AmpdoctorCallback(CallbackRun, _transformers.TrainerCallback):
    """Records the Trainer's GradScaler from ``on_train_begin`` to ``on_train_end``.

    The Trainer (4.40 and later) trains through Accelerate, whose prepared optimizer holds the
    GradScaler; callbacks receive that optimizer, so the scaler is found without a reference to
    the Trainer. It is wrapped in place (:func:`ampdoctor.wrap`, at most one sync: reading the
    current scale of a scaler restored from a checkpoint) with ``model=`` the Trainer's model, and
    unwrapped, which finishes the run, at ``on_train_end``.

    Step numbers are the Trainer's optimizer steps: the run starts at ``state.global_step`` (0, or
    the checkpoint's step when resuming) and ampdoctor counts ``scaler.update()`` calls, which
    Accelerate makes once per optimizer step, after the last micro-batch of gradient accumulation.
    Record options as for :func:`ampdoctor.wrap`; ``amp_dtype`` defaults to float16.

    ``on_train_begin`` raises ValueError when the Trainer has no GradScaler: one exists only with
    ``fp16=True`` on a GPU. On the CPU ``fp16=True`` trains in fp32 without a scaler; bf16 needs
    none; DeepSpeed scales the loss itself. A training that raises never reaches
    ``on_train_end`` (Transformers has no exception event): call :meth:`close`, or the run is
    flushed at interpreter exit.
    """

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.close()  # a second train() on the same Trainer starts a new recording
        scaler = getattr(optimizer, "scaler", None)
        if not isinstance(scaler, torch.amp.GradScaler):
            raise ValueError(
                f"AmpdoctorCallback: the Trainer has no GradScaler (fp16={args.fp16}, bf16={args.bf16}, "
                f"device={args.device.type!r}); ampdoctor records fp16 loss scaling, which the Trainer "
                "uses only with fp16=True on a GPU. On the CPU fp16=True trains in fp32, unscaled; "
                "DeepSpeed scales the loss itself.")
        self._record(scaler, model, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
