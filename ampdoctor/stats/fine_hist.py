"""The fine histogram of a GEMM operand on the device: eight bins per binade, what FP8 readiness
needs (docs/numerics.md, FP8 readiness); its bins, for readers: :mod:`ampdoctor.run_file.fine_bins`.

The binade histogram of the other rows (``hist``) places a threshold only to within a factor of
two; an FP8 cast's flush threshold (the format's half-subnormal over a scale made from an amax)
and its saturation threshold (an earlier amax) fall anywhere inside a binade, and a binade can
hold a large share of a tensor. Here each nonzero element is counted by the top 12 bits of its
float32 magnitude (``bits >> 20``: 2048 bins, eight per binade, over every float32 value, no range
to choose).

Device work: per chunk of :data:`CHUNK` elements one cast to float32 (and the unscaling multiply),
one integer view and shift, the counts per bin (on the CPU ``bincount``; on accelerators a sort
and ``searchsorted``: ``bincount`` on CUDA reads the maximum on the host, a sync, and atomics into a
few addresses serialise), and the exact zeros counted. Temporaries are bounded by the chunk. Deterministic; no sync. Only on
module-sampled steps.
"""

from __future__ import annotations

import torch

from ..run_file.fine_bins import FINE_SHIFT
from ..run_file.schema import FINE_BINS

CHUNK = 1 << 24            # elements per pass: bounds the temporaries (float32 and int32 copies, 64 MiB each; the
                           # accelerators' sort adds its int32 values and int64 indices, 192 MiB, and its scratch)
_ABS = 0x7FFFFFFF


def fine_hist(tensor: torch.Tensor, inv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts, n_zero)`` of ``tensor`` (times ``inv_scale``, a 0-dim float32 on its device, as
    torch's ``unscale_`` multiplies): int64 ``[FINE_BINS]`` counts of its nonzero elements (inf and
    NaN in the top bins) by fine bin, and the 0-dim int64 count of exact zeros. No sync."""
    flat = tensor.detach().reshape(-1)
    counts = torch.zeros(FINE_BINS, dtype=torch.int64, device=flat.device)
    zeros = torch.zeros((), dtype=torch.int64, device=flat.device)
    count = _bincount if _on_host(flat) else _sorted_count
    with torch.no_grad():
        for start in range(0, flat.numel(), CHUNK):
            x = flat.narrow(0, start, min(CHUNK, flat.numel() - start)).float()  # (narrow: fake CUDA refuses slices)
            if inv_scale is not None:
                x = x * inv_scale
            bits = x.view(torch.int32) & _ABS
            counts += count(bits >> FINE_SHIFT)
            zeros += (bits == 0).sum()
        counts.narrow(0, 0, 1).sub_(zeros)  # (+0 and -0 have bits 0: bin 0; they are not counted as nonzero)
    return counts, zeros


def _on_host(flat: torch.Tensor) -> bool:
    """Whether ``torch.bincount`` serves: on the CPU only. On CUDA it reads the input's maximum on
    the host to size its output (a sync per call); the sorted count has static shapes and no sync."""
    return flat.device.type == "cpu"


def _bincount(index: torch.Tensor) -> torch.Tensor:
    return torch.bincount(index, minlength=FINE_BINS)


def _sorted_count(index: torch.Tensor) -> torch.Tensor:
    return count_bins(index, FINE_BINS)


def count_bins(index: torch.Tensor, bins: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[bins]``: how many of ``index`` (each in ``[0, bins)``) fall in each bin, or the sum
    of their integer ``weights``. On the CPU ``bincount``; elsewhere from the sorted indices: where
    each bin's run begins (``searchsorted``), differenced (no atomics, no sync, static shapes)."""
    if _on_host(index):
        if weights is None:
            return torch.bincount(index, minlength=bins)
        return torch.bincount(index, weights.to(torch.float64), minlength=bins).to(torch.int64)
    ordered, order = torch.sort(index)
    edges = torch.searchsorted(ordered, torch.arange(bins + 1, dtype=index.dtype, device=index.device))
    if weights is None:
        return edges.diff().to(torch.int64)
    total = torch.cat([weights.new_zeros(1), weights.index_select(0, order).cumsum(0)]).to(torch.int64)
    return total.index_select(0, edges).diff()
