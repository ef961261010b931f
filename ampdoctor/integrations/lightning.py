"""Lightning (``lightning.pytorch``): a ``Callback`` that records the precision plugin's GradScaler.

    trainer = L.Trainer(precision="16-mixed", callbacks=[AmpdoctorCallback(path="run")])
    trainer.fit(model, loader)

Without the callback, an ``ampdoctor.GradScaler`` can be handed to the plugin instead:
``plugins=[MixedPrecision("16-mixed", "cuda", scaler=ampdoctor.GradScaler("cuda", model=model,
path="run"))]`` (then ``close()`` it after ``fit``). Needs ``pip install "ampdoctor[lightning]"``.
"""

from __future__ import annotations

import torch

from . import CallbackRun, require

_pl = require("lightning.pytorch", "lightning")

__all__ = ["AmpdoctorCallback"]


def _scaler(trainer) -> torch.amp.GradScaler | None:
    # MixedPrecision and FSDPPrecision both keep theirs at ``.scaler`` (None for bf16).
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


class AmpdoctorCallback(CallbackRun, _pl.Callback):
    """Records ``trainer.precision_plugin.scaler`` during ``fit``.

    ``on_fit_start`` checks that there is a GradScaler to record; ``on_train_start`` wraps it in
    place (:func:`ampdoctor.wrap`, at most one sync: reading the current scale of a restored
    scaler) with ``model=`` the LightningModule. Wrapping waits for ``on_train_start`` because
    Lightning restores a checkpoint's scaler state and step count after ``on_fit_start``. The run
    is finished (the scaler unwrapped) in ``on_fit_end``, and in ``on_exception`` when fit fails
    or is interrupted.

    Step numbers start at ``trainer.global_step`` (the checkpoint's when resuming) and advance
    per ``scaler.update()``, which Lightning calls once per optimizer step: after the last
    micro-batch under ``accumulate_grad_batches``. Record options as for :func:`ampdoctor.wrap`;
    ``amp_dtype`` defaults to float16 (a Lightning scaler means ``"16-mixed"``).

    Raises ValueError at ``on_fit_start`` when there is no GradScaler: only ``precision="16-mixed"``
    on a GPU has one (Lightning turns ``"16-mixed"`` on the CPU into ``"bf16-mixed"``; use
    ``plugins=[MixedPrecision("16-mixed", "cpu")]`` to keep fp16 there), or when the scaler is
    already recording (an ``ampdoctor.GradScaler`` passed to the plugin: use one or the other).
    """

    framework = "lightning"  # the report's recommendation is a MixedPrecision plugin to pass

    def on_fit_start(self, trainer, pl_module) -> None:
        scaler = _scaler(trainer)
        if scaler is None:
            plugin = trainer.precision_plugin
            raise ValueError(
                f"AmpdoctorCallback: the precision plugin has no GradScaler ({type(plugin).__name__}, "
                f"precision={getattr(plugin, 'precision', None)!r}); ampdoctor records fp16 loss "
                "scaling: precision='16-mixed' on a GPU, or plugins=[MixedPrecision('16-mixed', "
                "'cpu')] on the CPU, where Lightning turns precision='16-mixed' into 'bf16-mixed'.")
        if getattr(scaler, "recorder", None) is not None:
            raise ValueError("AmpdoctorCallback: the precision plugin's scaler is already recording "
                             "(an ampdoctor.GradScaler); use either it or the callback")

    def on_train_start(self, trainer, pl_module) -> None:
        self.close()
        scaler = _scaler(trainer)
        if scaler is None:  # on_fit_start raised already; a plugin swapped in between
            raise ValueError("AmpdoctorCallback: the precision plugin has no GradScaler")
        self._record(scaler, pl_module, trainer.global_step)

    def on_fit_end(self, trainer, pl_module) -> None:
        self.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.close()
