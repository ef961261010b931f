"""The peak magnitude of many tensors at once: the light module taps' reduction (issue 39).

A light step's module taps only hold their tensors (:mod:`ampdoctor.record.light_taps`); every so
many tensors, at the end of the backward and at the step's end, :func:`batch_peaks` reduces them
together: on CUDA two Triton launches for all of them, whatever their dtypes
(:mod:`.peaks_triton`); elsewhere one ``aminmax`` each and a few ops for all. Every algorithm
propagates NaN and inf (a NaN anywhere makes the tensor's peak NaN), which the flight recorder must
see. Not used, and why: CUDA's ``_foreach_norm`` of infinity order takes a plain maximum (a NaN is
dropped); on the CPU the infinity norm is ~22x slower than ``aminmax`` (20 bf16 tensors of 1 M
elements: 29 ms against 1.3 ms), and ``_foreach_max`` needs a negated copy for the minimum. No sync.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

from .algorithms import triton_available
from .light import extremes, peaks_of_pairs

PEAK_ALGORITHMS = ("triton", "each")
_TRITON_FAILED: list[str] = []  # why the Triton peaks stopped being used in this process, if they did


def peaks_algorithm(device: torch.device) -> str:
    """``"triton"`` on CUDA where Triton runs (and has not failed here), else ``"each"``."""
    return "triton" if device.type == "cuda" and not _TRITON_FAILED and triton_available() else "each"


def batch_peaks(tensors: Sequence[torch.Tensor], algorithm: str | None = None) -> torch.Tensor:
    """float32 ``[len(tensors)]`` on the first tensor's device: the largest magnitude of each
    (NaN where it holds a NaN, inf where an inf). ``tensors``: non-empty; of one dtype for
    ``"each"`` to stay cheap (mixed ones are cast value by value), of any float dtypes mixed for
    ``"triton"``. ``algorithm``: by default the device's (:func:`peaks_algorithm`). No sync."""
    device = tensors[0].device
    algorithm = algorithm or peaks_algorithm(device)
    if algorithm not in PEAK_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {PEAK_ALGORITHMS}, got {algorithm!r}")
    if algorithm == "triton" and all(t.device == device for t in tensors):
        try:
            from .peaks_triton import triton_peaks  # imports Triton: only where it runs
            return triton_peaks(tensors)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here: one aminmax each
            if _TRITON_FAILED or device.type != "cuda":
                raise
            _TRITON_FAILED.append(f"{type(exc).__name__}: {exc}".splitlines()[0])
            warnings.warn(f"ampdoctor: the Triton peak kernels failed here ({_TRITON_FAILED[0]}); the module taps' "
                          "peaks use one aminmax per tensor from now on", RuntimeWarning, stacklevel=2)
    return peaks_of_pairs(torch.stack([v.to(device, non_blocking=True) for t in tensors for v in extremes(t)]))
