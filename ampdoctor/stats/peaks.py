"""The peak magnitude of many tensors at once: the light module taps' reduction (issue 39).

A light step's module taps only hold their tensors (:mod:`ampdoctor.record.light_taps`); every so
many tensors, and at the step's end, :func:`batch_peaks` reduces those of one dtype together:
on CUDA two Triton launches for all of them (:mod:`.peaks_triton`), on the CPU one
``_foreach_norm`` (infinity norm), elsewhere one ``aminmax`` each. Every algorithm propagates NaN
and inf (a NaN anywhere makes the tensor's peak NaN), which the flight recorder must see; CUDA's
``_foreach_norm`` is not used for that reason (its infinity norm takes a plain maximum). No sync.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

from .algorithms import triton_available
from .light import extremes, peaks_of_pairs

INF = float("inf")
_TRITON_FAILED: list[str] = []  # why the Triton peaks stopped being used in this process, if they did


def batch_peaks(tensors: Sequence[torch.Tensor], algorithm: str | None = None) -> torch.Tensor:
    """float32 ``[len(tensors)]`` on the first tensor's device: the largest magnitude of each
    (NaN where it holds a NaN, inf where an inf). ``tensors``: non-empty; of one dtype for
    ``"triton"`` (the others take mixed dtypes: the CPU's light taps reduce bf16 and float32 at once; keep each
    dtype's tensors together, as :class:`~ampdoctor.record.light_taps.Peaks` does, for fewer ops).
    ``algorithm``: ``"triton"``, ``"foreach"`` or ``"each"``; by default the device's (CUDA with
    Triton: ``"triton"``; the CPU: ``"foreach"``; else ``"each"``). No sync."""
    device = tensors[0].device
    if algorithm is None:
        algorithm = ("triton" if device.type == "cuda" and not _TRITON_FAILED and triton_available()
                     else "foreach" if device.type == "cpu" else "each")
    if algorithm == "triton" and all(t.device == device and t.dtype == tensors[0].dtype for t in tensors):
        try:
            from .peaks_triton import triton_peaks  # imports Triton: only where it runs
            return triton_peaks(tensors)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here: the torch algorithm runs
            if _TRITON_FAILED or device.type != "cuda":
                raise
            _TRITON_FAILED.append(f"{type(exc).__name__}: {exc}".splitlines()[0])
            warnings.warn(f"ampdoctor: the Triton peak kernels failed here ({_TRITON_FAILED[0]}); the module taps' "
                          "peaks use one aminmax per tensor from now on", RuntimeWarning, stacklevel=2)
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # (the tensors may require grad: no graph for a statistic)
    try:
        if algorithm == "foreach" and all(t.device == device for t in tensors):
            return _foreach_peaks(list(tensors))
        return peaks_of_pairs(torch.stack([v.to(device, non_blocking=True) for t in tensors for v in extremes(t)]))
    finally:
        torch._C._set_grad_enabled(grad)


def _foreach_peaks(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One ``_foreach_norm`` (infinity) for all ``tensors``, its results in float32 (its ``dtype=``,
    where this torch has it), stacked: two ops. The CPU's infinity norm propagates NaN."""
    if _NORM_DTYPE:
        try:
            return torch.stack(torch._foreach_norm(tensors, INF, dtype=torch.float32))
        except (TypeError, RuntimeError):  # a torch without _foreach_norm's dtype=
            _NORM_DTYPE.clear()
    return _by_dtype_runs(tensors, torch._foreach_norm(tensors, INF))


_NORM_DTYPE = [True]  # emptied where _foreach_norm takes no dtype=


def _by_dtype_runs(tensors: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> torch.Tensor:
    """``values`` (0-dim, each in its tensor's dtype) as one float32 vector: a stack per run of one
    dtype, then one cat (a stack across dtypes would cast each value: an op per tensor)."""
    runs, start = [], 0
    for i in range(1, len(tensors) + 1):
        if i == len(tensors) or tensors[i].dtype != tensors[start].dtype:
            runs.append(torch.stack(values[start:i]).to(torch.float32))
            start = i
    return runs[0] if len(runs) == 1 else torch.cat(runs)
