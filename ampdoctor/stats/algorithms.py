"""The algorithms that compute the statistics: *host* and *accelerator* (pure torch), and for the
full statistics on CUDA *triton* (two fused kernels, :mod:`.full_triton`); which one runs, and the
exact norm the host algorithm of both kinds shares."""

from __future__ import annotations

from typing import Sequence

import functools

import torch

ALGORITHMS = ("host", "accelerator")           # of the light statistics
FULL_ALGORITHMS = ALGORITHMS + ("triton",)     # of the full statistics


def algorithm_for(device: torch.device, full: bool = False) -> str:
    """``"host"`` for CPU tensors; for the full statistics on CUDA ``"triton"`` where Triton runs
    on the device (:func:`triton_available`); else ``"accelerator"`` (cuda, xpu, mps, meta)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return "host"
    if full and kind == "cuda" and triton_available():
        return "triton"
    return "accelerator"


def choose_algorithm(algorithm: str | None, tensors: Sequence[torch.Tensor], full: bool = False) -> str:
    """``algorithm`` checked, or (None) the one for the tensors' device."""
    if algorithm is None:
        return algorithm_for(tensors[0].device, full)
    allowed = FULL_ALGORITHMS if full else ALGORITHMS
    if algorithm not in allowed:
        raise ValueError(f"algorithm must be one of {allowed}, got {algorithm!r}")
    return algorithm


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether Triton is installed and can compile for this machine's CUDA devices (torch's own
    test: compute capability 7.0 or newer). Imports Triton the first time (about a second)."""
    try:
        from torch.utils._triton import has_triton
        if not has_triton():
            return False
        from . import full_triton  # noqa: F401 - compiles nothing; fails where Triton is broken
    except Exception:  # noqa: BLE001 - a broken Triton is an absent one: the torch algorithm runs
        return False
    return True


def rescaled_norm(values: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """float64 L2 norm of finite float32 ``values`` whose largest magnitude is ``top``. Squares
    in float32 overflow beyond 1.8e19 and vanish below 1e-19, and a float64 reduction copies the
    data to float64 first (6x the cost on the CPU); so the values are brought near 1 by a power of
    two (exact), summed in float32, and scaled back in float64."""
    exponent = torch.frexp(top).exponent.clamp(-125, 126)  # top < 2**exponent; 2**-exponent stays normal
    norm = torch.linalg.vector_norm(values * torch.exp2(-exponent.float()))
    return norm.double() * torch.exp2(exponent.double())
