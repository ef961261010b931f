"""The per-step hand-off from the training thread to the writer thread: the step's scalars
packed on the device before ``update()`` changes the scale, and every device tensor of a
:class:`~ampdoctor.record.records.StepRecord` copied to pinned host memory without blocking, then
sealed with one fence (:mod:`ampdoctor.record.transfer`) that the writer waits on before it reads
them (:mod:`ampdoctor.record.rows`). None of this syncs."""

from __future__ import annotations

import torch

from ..stats import stats_to_host
from .records import ParamCheck, StepRecord, pack_scalars
from .transfer import HostCopies
from .underflow_probe import stack_counts


def step_scalars(scaler: torch.amp.GradScaler, loss: torch.Tensor | None,
                 params: list[ParamCheck]) -> torch.Tensor | None:
    """The step's scalars (:func:`~ampdoctor.record.records.pack_scalars`): scale, found-inf
    count, loss and the largest parameter peak of ``params`` (this iteration's parameter checks).
    None when there is nothing to record (``update()`` without ``step()``: torch raises next)."""
    scale = getattr(scaler, "_scale", None)
    if not scaler.is_enabled() or scale is None:
        if loss is None and not params:
            return None
        device = loss.device if loss is not None else params[0].peaks.device
        peak, has_params = _largest_param_peak(params, device)
        value = loss if loss is not None else torch.zeros((), device=device)
        return pack_scalars(torch.ones_like(value), torch.zeros_like(value), value, peak,
                            has_loss=loss is not None, has_params=has_params)
    found = [f.to(scale.device, non_blocking=True)
             for state in scaler._per_optimizer_states.values()
             for f in state["found_inf_per_device"].values()]
    if not found:
        return None
    value = loss.to(scale.device, non_blocking=True) if loss is not None else torch.zeros((), device=scale.device)
    peak, has_params = _largest_param_peak(params, scale.device)
    return pack_scalars(scale.float(), torch.stack(found).sum(), value, peak,
                        has_loss=loss is not None, has_params=has_params)


def start_copies(record: StepRecord, copies: HostCopies) -> None:
    """Start the host copies of every device tensor of ``record`` (in place) and seal them with
    one fence (``record.event``). The packed statistics of a device go in one copy."""
    copy = copies.to_host  # non-blocking copies into pinned memory; CPU tensors as they are
    if record.gemm is not None:
        record.gemm.peaks = copy(record.gemm.peaks)
        if record.gemm.hists is not None:
            record.gemm.hists, record.gemm.zeros = copy(record.gemm.hists), copy(record.gemm.zeros)
        if record.gemm.blocks is not None:
            record.gemm.blocks = copy(record.gemm.blocks)
    record.scalars = copy(record.scalars) if record.scalars is not None else None
    items = (*record.groups, *record.taps)
    lost = [item for item in items if item.lost is not None]
    copied = stats_to_host([item.stats for item in items] + [item.lost for item in lost], copy)
    for item, stats in zip(items, copied):
        item.stats = stats
    for item, stats in zip(lost, copied[len(items):]):
        item.lost = stats
    for group in record.groups:
        if group.measured is not None:
            group.measured = copy(group.measured)
    tap_measured = stack_counts([t.measured for t in record.taps])
    record.tap_measured = copy(tap_measured) if tap_measured is not None else None
    if record.params is not None:
        record.params.peaks = copy(record.params.peaks)
    record.event = copies.seal()


def _largest_param_peak(params: list[ParamCheck], device: torch.device) -> tuple[torch.Tensor, bool]:
    """The largest parameter peak of the iteration on ``device`` (NaN if any is NaN), and
    whether there was one."""
    maxima = [p.peaks.to(device, non_blocking=True).max() for p in params if len(p.names)]
    if not maxima:
        return torch.zeros((), device=device), False
    return torch.stack(maxima).max(), True
