"""A GEMM operand's block statistics on the device: what MXFP8, MXFP4 and NVFP4 would make of it
(docs/numerics.md, block formats; the bins: :mod:`ampdoctor.run_file.block_bins`).

Blocks run along the tensor's last dimension, the reduction dimension of the GEMM each operand
is read for first (a Linear's input and weight in the forward, its output gradient in the input
gradient's GEMM); a last dimension that is not a multiple of the block is padded with zeros, as
the recipes pad it (zeros change no block's amax and are not counted).

An operand of more than :data:`MAX_ELEMENTS` elements (its rows padded to whole blocks of 32) is
read at a systematic sample of its rows (every k-th row of its 2-D view, k odd, blocks whole): the
temporaries (about 50 bytes per element read on the torch path; the kernel's partial results, 15 KB
per tile of 1,024) stay bounded (~15 MB) and so does the cost per operand, whatever the model. The sample's figures are
those of the rows read (exact for them); NVFP4's tensor scale still comes from the whole operand's
amax, as the recipe takes it. The rows read and the operand's rows are recorded beside the counts.

Limits: on the torch path each operand costs some 330 small kernels (on CUDA the kernel of
:mod:`.block_triton` replaces them). Non-finite operands are not meant: their figures are
meaningless, and the reader leaves out the passes whose recorded amax is not finite.

Device work per operand: one float32 copy, the block amaxes (MX and NVFP4), the tensor amax, a few
elementwise passes per recipe (its scaled elements and their cast, summed: the measured figures)
and three counts per bin (on the CPU ``bincount``; on accelerators a sort and
``searchsorted``, :func:`~ampdoctor.stats.fine_hist.count_bins`). Deterministic; no sync: the
tensor amax stays on the device.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from ..run_file.block_bins import (E4M3_EPS, ELEMENTS, EXP_BINS, EXP_RANGE, KEY_SHIFT, MX_BLOCK, MX_CLASSES,
                                   NV_BLOCK, NV_TENSOR_DIVISOR, PER_BINADE, Q_BINS, Q_WINDOW, RATIO_BINS, RATIO_WINDOW,
                                   RECIPES, REL_BINS, REL_WINDOW)
from ..run_file.block_bins import BLOCK_VALUES, LAYOUT
from .algorithms import triton_available
from .fine_hist import count_bins

MAX_ELEMENTS = 1 << 18  # elements read per operand at most (a systematic sample of rows beyond)


@dataclass
class BlockStats:
    """int64 device tensors (see :mod:`ampdoctor.run_file.block_bins`)."""

    mx_rel: torch.Tensor      # [3, REL_BINS]: nonzero elements by their block's class and rel
    mx_blocks: torch.Tensor   # [2, 3, EXP_BINS]: blocks, then their nonzero elements, by class and exponent
    nv_q: torch.Tensor        # [Q_BINS]: nonzero elements by q
    nv_ratio: torch.Tensor    # [RATIO_BINS]: blocks by amax_block / amax_tensor
    nv_clamped: torch.Tensor  # [2]: blocks whose scale was clamped up, their nonzero elements
    measured: torch.Tensor    # float64 [len(RECIPES), 4]: per recipe, flushed and saturated elements,
                              # sum (q - Q(q))^2 and sum q^2, cast as torchao casts
    nonzero: torch.Tensor     # 0-dim: nonzero elements
    rows: tuple[int, int] = (1, 1)  # rows of the 2-D view read, and its rows


def block_stats(tensor: torch.Tensor, inv_scale: torch.Tensor | None = None,
                max_elements: int | None = None) -> BlockStats:
    """The block statistics of ``tensor`` (any float dtype; times ``inv_scale``, a 0-dim float32 on
    its device, as torch's ``unscale_`` multiplies), blocks along its last dimension, of a
    systematic sample of its rows when its rows padded to whole blocks hold more than
    ``max_elements`` (default :data:`MAX_ELEMENTS`; module docstring), by the torch path. Non-finite values are not meant (the caller observes finite operands). No sync."""
    with torch.no_grad():
        prepared = _prepared(tensor, inv_scale, max_elements)
        if prepared is None:  # (an expert that got no token: nothing counted)
            return _empty(tensor.device)
        t, tensor_amax, rows = prepared
        x = t.float()
        if inv_scale is not None:
            x = x * inv_scale
        x = x.abs()
        nonzero = (x != 0).sum()
        rel, blocks, mx_measured = _mx(x)
        q, ratio, clamped, nv_measured = _nvfp4(x, tensor_amax)
    return BlockStats(rel, blocks, q, ratio, clamped, torch.stack([*mx_measured, nv_measured]), nonzero, rows)


def packed_block_stats(tensor: torch.Tensor, inv_scale: torch.Tensor | None = None,
                       max_elements: int | None = None, algorithm: str | None = None) -> torch.Tensor:
    """:func:`pack` of :func:`block_stats`: on CUDA where Triton runs, by one kernel
    (:mod:`.block_triton`, the same numbers); ``algorithm`` ``"torch"`` or ``"triton"`` to choose
    (the tests run the kernel on CPU tensors under Triton's interpreter). A DTensor is read as
    this rank's local shard (what its GEMM casts). No sync."""
    to_local = getattr(tensor, "to_local", None)
    tensor = to_local() if to_local is not None else tensor
    if algorithm is None:
        algorithm = "triton" if tensor.device.type == "cuda" and not _TRITON_FAILED and triton_available() else "torch"
    if algorithm == "triton":
        with torch.no_grad():
            prepared = _prepared(tensor, inv_scale, max_elements)
            if prepared is not None:
                t, tensor_amax, rows = prepared
                try:
                    from .block_triton import triton_packed  # (imports Triton: only where it runs)

                    return triton_packed(t, tensor_amax, inv_scale, rows)
                except torch.cuda.OutOfMemoryError:
                    raise  # (not the kernel's failure: the caller stops the block statistics)
                except Exception as exc:  # noqa: BLE001 - the torch path computes the same numbers
                    _TRITON_FAILED.append(f"{type(exc).__name__}: {exc}".splitlines()[0])
                    warnings.warn(f"ampdoctor: the Triton block statistics kernel failed here ({_TRITON_FAILED[0]}); "
                                  "using the torch path instead", RuntimeWarning, stacklevel=2)
    return pack(block_stats(tensor, inv_scale, max_elements))


_TRITON_FAILED: list[str] = []  # why the kernel stopped being used in this process, if it did


def _prepared(tensor: torch.Tensor, inv_scale: torch.Tensor | None, max_elements: int | None
              ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None:
    """``tensor``'s 2-D view (blocks along its last dimension) at the rows to read, its amax
    (float32, unscaled: NVFP4's tensor scale is the whole operand's) and (rows read, rows); None
    for an empty tensor. Beyond ``max_elements`` (counted with each row padded to whole blocks of
    32: what the passes and the kernel's tiles cover) every k-th row is read, k odd, so that the
    sample does not alias with the power-of-two structure of the rows (sequence positions, heads);
    only those rows are gathered, whatever the tensor's strides."""
    t = tensor.detach()
    if not t.numel():
        return None
    if t.dim() < 2:  # (a vector or a scalar: one row)
        t = t.reshape(1, -1)
    k = t.shape[-1]
    rows = t.numel() // k
    tensor_amax = torch.linalg.vector_norm(t, float("inf")).float()  # (a reduction, no copy)
    if inv_scale is not None:
        tensor_amax = tensor_amax * inv_scale
    padded = -(-k // MX_BLOCK) * MX_BLOCK
    fits = max(1, (MAX_ELEMENTS if max_elements is None else max_elements) // padded)  # rows within the budget
    step = -(-rows // fits)  # (then ceil(rows / step) <= fits; a row wider than the budget is read whole)
    if step > 1:
        step += 1 - step % 2  # (odd)
        # (index_select per leading dimension: a fake CUDA tensor refuses strided slices, and a
        # view that reshape would copy whole is gathered at the sampled rows only)
        index = torch.arange(0, rows, step, device=t.device)
        lead = t.shape[:-1]
        if len(lead) == 1:
            t = t.index_select(0, index)
        else:
            coords = []
            for size in reversed(lead):
                coords.append(index % size)
                index = index // size
            t = t[tuple(reversed(coords))]
    else:
        t = t.reshape(rows, k)
    return t, tensor_amax, (t.shape[0], rows)


def pack(stats: BlockStats) -> torch.Tensor:
    """float64 ``[BLOCK_VALUES]`` on the statistics' device: the ``block_stats`` column's value
    (run_file.block_bins.LAYOUT). No sync."""
    parts = [getattr(stats, name).reshape(-1).double() for name, _ in LAYOUT[:-1]]
    # (fills on the device, not a copy from the host)
    parts += [stats.nonzero.new_full((1,), n, dtype=torch.float64) for n in stats.rows]
    flat = torch.cat(parts)
    assert flat.numel() == BLOCK_VALUES
    return flat


def _empty(device: torch.device) -> BlockStats:
    zeros = lambda *shape, dtype=torch.int64: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
    return BlockStats(zeros(3, REL_BINS), zeros(2, 3, EXP_BINS), zeros(Q_BINS), zeros(RATIO_BINS), zeros(2),
                      zeros(len(RECIPES), 4, dtype=torch.float64), zeros(), (0, 0))


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x`` [rows, k] as [rows · ceil(k / size), size], padded with zeros."""
    pad = (-x.shape[1]) % size
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(-1, size)


def _mx(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    b = _blocks(x, MX_BLOCK)
    amax = b.amax(dim=1)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa · 2^exponent, mantissa in [0.5, 1)
    floor = (exponent - 1).clamp(EXP_RANGE[0], EXP_RANGE[1])  # floor(log2 amax) (any of a zero block)
    klass = sum(((2 * mantissa) > m).to(torch.int64) for m in MX_CLASSES)
    # |x| / 2^floor, exact (a power of two; blocks below 2^-126 are scaled as at 2^-126: they are
    # the clamped-scale blocks, counted apart)
    rel = b * torch.exp2(-floor.clamp(min=-126).float()).unsqueeze(1)
    present = b != 0
    index = _window(rel, REL_WINDOW) + (klass * REL_BINS).unsqueeze(1)
    mx_rel = _count_where(index, present, 3 * REL_BINS).reshape(3, REL_BINS)
    cell = klass * EXP_BINS + (floor - EXP_RANGE[0])
    counts = present.sum(dim=1)
    per_block = count_bins(cell, 3 * EXP_BINS, weights=(amax > 0).to(torch.int64))
    per_element = count_bins(cell, 3 * EXP_BINS, weights=counts)
    zeros = b.numel() - counts.sum()
    measured = [_measure(_mx_scaled(b, mantissa, exponent - 1, element, scale), element, zeros)
                for _, element, scale in RECIPES if scale != "nvfp4"]
    return mx_rel, torch.stack([per_block, per_element]).reshape(2, 3, EXP_BINS), measured


def _mx_scaled(b: torch.Tensor, mantissa: torch.Tensor, floor: torch.Tensor, element: str, scale: str) -> torch.Tensor:
    """The blocks in their E8M0 scale's units, as torchao's ``to_mx`` scales them: floor, its scale
    raised to float32's smallest normal; round-up (RCEIL), the reciprocal of its scale, 1 for the
    smallest (2^-127). The round-up exponent is ``ceil(log2(amax / max))`` exactly, as the
    hardware's conversion (``cvt.rp``) takes it; torchao's eager float32 ``log2`` can round a float32
    amax a few ulps above 1.75 · 2^k down to the lower scale (bfloat16 and float16 amaxes never)."""
    emax = math.floor(math.log2(ELEMENTS[element][2]))
    top = ELEMENTS[element][2] / 2.0 ** emax
    if scale == "floor":
        return b / torch.clamp(torch.exp2((floor - emax).clamp(min=-127).float()), min=2.0 ** -126).unsqueeze(1)
    biased = (floor - emax + ((2 * mantissa) > top).to(floor.dtype)).clamp(-127, 127) + 127
    reciprocal = torch.exp2((127 - biased).float())
    return b * reciprocal.masked_fill(biased == 0, 1.0).unsqueeze(1)


def _measure(q: torch.Tensor, element: str, zeros: torch.Tensor) -> torch.Tensor:
    """float64 [4]: flushed and saturated nonzero elements, sum (q - Q)^2, sum q^2 (``q`` 0 where
    the element is; ``zeros``: how many are, padding included)."""
    cast = _cast(q, element)
    d = q - cast  # (exact: Q is 0 or within a factor of two of q)
    # (squares summed in float32 within each block, a few ulps, then in float64 over the blocks)
    return torch.stack([((cast == 0).sum() - zeros).double(), (q > ELEMENTS[element][2]).sum().double(),
                        (d * d).sum(dim=1).double().sum(), (q * q).sum(dim=1).double().sum()])


def _cast(q: torch.Tensor, element: str) -> torch.Tensor:
    """Non-negative ``q`` cast to the element format (nearest, ties to even, saturating), as float32."""
    fmax = ELEMENTS[element][2]
    q = q.clamp(max=fmax)
    if element == "e2m1":  # (spacing 0.5 below 2, 1 below 4, 2 up to 6; torch.round: ties to even)
        spacing = torch.where(q < 2, 0.5, torch.where(q < 4, 1.0, 2.0))
        return torch.round(q / spacing) * spacing
    return q.to(torch.float8_e4m3fn if element == "e4m3" else torch.float8_e5m2).float()


def _nvfp4(x: torch.Tensor, tensor_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """As torchao's ``nvfp4_quantize`` with a per-tensor scale from the tensor's amax."""
    b = _blocks(x, NV_BLOCK)
    amax = b.amax(dim=1)
    tensor_scale = tensor_amax / NV_TENSOR_DIVISOR
    scaled = (amax / 6.0) / tensor_scale
    clamped = scaled < E4M3_EPS
    block_scale = torch.clamp(scaled, min=E4M3_EPS, max=448.0).to(torch.float8_e4m3fn).to(torch.float32)
    q = b * ((1.0 / tensor_scale) / block_scale).unsqueeze(1)
    present = b != 0
    # (only the nonzero elements count: an all-zero tensor's scale is 0, its q NaN)
    q = q.masked_fill(present.logical_not(), 0.0)
    nv_q = _count_where(_window(q, Q_WINDOW), present, Q_BINS)
    seen = amax > 0
    nv_ratio = _count_where(_window(amax / tensor_amax, RATIO_WINDOW), seen, RATIO_BINS)
    blocks = clamped & seen
    nv_clamped = torch.stack([blocks.sum(), (present & blocks.unsqueeze(1)).sum()])
    return nv_q, nv_ratio, nv_clamped, _measure(q, "e2m1", b.numel() - present.sum())


def _count_where(index: torch.Tensor, where: torch.Tensor, bins: int) -> torch.Tensor:
    """The counts of ``index`` where ``where`` holds: the others go to one more bin, dropped (a
    boolean selection's size depends on the data: on an accelerator, a sync)."""
    return count_bins(index.masked_fill(where.logical_not(), bins).reshape(-1), bins + 1).narrow(0, 0, bins)


def _window(values: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """int64 window bins of non-negative float32 ``values`` (run_file.block_bins.window_index)."""
    low, high = window
    key = (values.view(torch.int32) >> KEY_SHIFT).to(torch.int64)
    return (key - ((low + 127) << 3) + 1).clamp(0, (high - low) * PER_BINADE + 1)
