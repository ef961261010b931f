"""The two algorithms that compute the statistics, *host* and *accelerator*: which one runs, and
the exact norm the host algorithm of both kinds shares."""

from __future__ import annotations

from typing import Sequence

import torch

ALGORITHMS = ("host", "accelerator")


def algorithm_for(device: torch.device) -> str:
    """``"host"`` for CPU tensors, ``"accelerator"`` for every other device (cuda, xpu, mps, meta)."""
    return "host" if torch.device(device).type == "cpu" else "accelerator"


def choose_algorithm(algorithm: str | None, tensors: Sequence[torch.Tensor]) -> str:
    """``algorithm`` checked, or (None) the one for the tensors' device."""
    if algorithm is None:
        return algorithm_for(tensors[0].device)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    return algorithm


def rescaled_norm(values: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """float64 L2 norm of finite float32 ``values`` whose largest magnitude is ``top``. Squares
    in float32 overflow beyond 1.8e19 and vanish below 1e-19, and a float64 reduction copies the
    data to float64 first (6x the cost on the CPU); so the values are brought near 1 by a power of
    two (exact), summed in float32, and scaled back in float64."""
    exponent = torch.frexp(top).exponent.clamp(-125, 126)  # top < 2**exponent; 2**-exponent stays normal
    norm = torch.linalg.vector_norm(values * torch.exp2(-exponent.float()))
    return norm.double() * torch.exp2(exponent.double())
