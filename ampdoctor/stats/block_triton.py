"""The block statistics of one GEMM operand in one Triton kernel (:func:`~.block_stats.packed_block_stats`
on CUDA where Triton runs): the same numbers as the torch path of :mod:`.block_stats`, which takes
some 330 kernel launches an operand; here one launch and a few small reductions.

Why a kernel: on a GPU the torch path's cost is its launches (a module-sampled step of GPT-2-small
has ~150 operands: ~50,000 launches), not its bytes. Each program reads a tile of :data:`TILE`
elements of the operand's 2-D view once, ``TR`` rows x ``TC`` columns (``TC`` a multiple of 32: whole
MX and NVFP4 blocks; columns past the end read as zeros, the recipes' padding), computes every block amax, the seven recipes'
casts and the window bins in registers, and writes its partial results: histograms
(``tl.histogram``, per program: no atomics), counts (int32) and sums of squares (float64). The
host adds the programs' partials (three reductions) and gathers them in the column's layout
(:data:`~ampdoctor.run_file.block_bins.LAYOUT`).

Exactness: the element and scale roundings are done in float32 arithmetic (nearest, ties to even,
by adding and subtracting 1.5 * 2^23; no floating-point contraction, which could fuse them),
divisions with ``div_rn`` (``div.rn.f32``, subnormals kept): the torch path's counts on the CPU
bit for bit; the sums of squares accumulate in float64 in another order (to ~1e-7 relative).
(PyTorch's CUDA division of a tensor by a Python number multiplies by its reciprocal: the torch
path run on a GPU, and torchao's casts there, can differ in the last bit of a block scale.) Under
``TRITON_INTERPRET=1`` the kernel runs on CPU tensors: that is how CI tests it against the torch
path. A bfloat16 operand is widened by a shift (the interpreter flushed its subnormals when
converting, as noted in :mod:`.full_triton_kernels`).
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch
import triton
import triton.language as tl

from ..run_file.block_bins import (E4M3_EPS, EXP_BINS, EXP_RANGE, LAYOUT, MX_BLOCK, NV_BLOCK, NV_TENSOR_DIVISOR,
                                   PER_BINADE, Q_BINS, Q_WINDOW, RATIO_BINS, RATIO_WINDOW, RECIPES, REL_BINS,
                                   REL_WINDOW)

TILE = 1024           # elements of a program's tile: TR rows x TC columns, TC the least of 32, 64, 128,
                      # 256 that holds a row (whole MX and NVFP4 blocks; at most 8 MX blocks a row), so
                      # that a narrow operand wastes few lanes; 4 x 256 compiles in 2 s (16 x 256: 7.7 s)
WARPS = 4
# The partial histograms of a program, side by side (each a power of two, its last bin the trash).
H_REL, H_BLOCKS, H_ELEMENTS, H_Q, H_RATIO = 0, 1024, 2048, 3072, 3200
HIST = 3712
N_COUNTS = 17         # 7 flushed, 7 saturated, nonzero, NVFP4 clamped blocks and elements
N_SUMS = 16           # 7 sums (q - Q)^2, 7 sums q^2, rows read, rows (float64: any row count)
assert 3 * REL_BINS < 1024 and 3 * EXP_BINS < 1024 and Q_BINS < 128 and RATIO_BINS < 512


@triton.jit
def _pow2(e):
    """2^e as float32, for integer ``e`` in [-149, 127] (subnormal below -126), from its bits."""
    bits = tl.where(e >= -126, (e + 127) << 23, 1 << tl.minimum(tl.maximum(e + 149, 0), 22))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round(q, MBITS: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr):
    """Non-negative ``q`` rounded to the element format (nearest, ties to even, saturating)."""
    q = tl.minimum(q, FMAX)
    e = tl.maximum(((q.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
    v = q * _pow2(MBITS - e)                      # exact: a power of two
    r = (v + 12582912.0) - 12582912.0             # nearest, ties to even (v < 2^22)
    return r * _pow2(e - MBITS)


@triton.jit
def _window(values, LOW: tl.constexpr, HIGH: tl.constexpr):
    """run_file.block_bins.window_index of non-negative float32 ``values``."""
    key = values.to(tl.int32, bitcast=True) >> 20
    return tl.minimum(tl.maximum(key - ((LOW + 127) << 3) + 1, 0), (HIGH - LOW) * 8 + 1)


@triton.jit
def _cast_figures(q, present, MBITS: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr):
    """(flushed, saturated, sum (q - Q)^2, sum q^2) of the elements ``q`` (0 where absent)."""
    cast = _round(q, MBITS, EMIN, FMAX)
    flushed = tl.sum(tl.sum((present & (cast == 0.0)).to(tl.int32), axis=1), axis=0)
    saturated = tl.sum(tl.sum((q > FMAX).to(tl.int32), axis=1), axis=0)
    d = (q - cast).to(tl.float64)
    wide = q.to(tl.float64)
    return flushed, saturated, tl.sum(tl.sum(d * d, axis=1), axis=0), tl.sum(tl.sum(wide * wide, axis=1), axis=0)


@triton.jit
def _mx_cast(x, present, floor_raw, klass, counts, sums, K: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
             FMAX: tl.constexpr, EMAX: tl.constexpr, TOP_CLASS: tl.constexpr, UP: tl.constexpr):
    """Recipe ``K`` (an MX one): the blocks in their E8M0 scale's units, as torchao's to_mx (see
    block_stats._mx_scaled), and their figures."""
    if UP:
        biased = tl.minimum(tl.maximum(floor_raw - EMAX + (klass >= TOP_CLASS).to(tl.int32), -127), 127) + 127
        reciprocal = tl.where(biased == 0, 1.0, _pow2(127 - biased))
    else:
        reciprocal = _pow2(-tl.maximum(floor_raw - EMAX, -126))
    q = x * reciprocal[:, None]
    flushed, saturated, err, ref = _cast_figures(q, present, MBITS, EMIN, FMAX)
    tl.store(counts + K, flushed)
    tl.store(counts + 7 + K, saturated)
    tl.store(sums + K, err)
    tl.store(sums + 7 + K, ref)


@triton.jit(do_not_specialize=["n_rows", "rows_read", "rows_total"])  # (one compilation for every row count)
def _block_kernel(data, n_rows, n_cols, row_stride, tensor_amax, inv_scale, rows_read, rows_total,
                  hist_out, counts_out, sums_out, HAS_INV: tl.constexpr, BF16: tl.constexpr,
                  TR: tl.constexpr, TC: tl.constexpr):
    # (column tiles on grid axis 0, which CUDA does not cap at 65,535; the row tiles are few: a
    # sample is at most MAX_ELEMENTS padded elements)
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    rows = tl.program_id(1) * TR + tl.arange(0, TR)
    cols = tl.program_id(0) * TC + tl.arange(0, TC)
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    at = rows[:, None].to(tl.int64) * row_stride + cols[None, :]
    if BF16:
        raw = tl.load(data + at, mask=inside, other=0).to(tl.int32)
        x = tl.abs((raw << 16).to(tl.float32, bitcast=True))
    else:
        x = tl.abs(tl.load(data + at, mask=inside, other=0.0).to(tl.float32))
    if HAS_INV:
        x = x * tl.load(inv_scale)
    hist = hist_out + pid.to(tl.int64) * 3712
    counts = counts_out + pid.to(tl.int64) * 17
    sums = sums_out + pid.to(tl.int64) * 16

    # -- MX: blocks of 32 --------------------------------------------------------------------
    b = tl.reshape(x, [TR * TC // 32, 32])
    present = b != 0.0
    amax = tl.max(b, axis=1)
    small = amax < 7.888609052210118e-31               # 2^-100: rescaled by 2^64 to read its exponent
    bits = tl.where(small, amax * 18446744073709551616.0, amax).to(tl.int32, bitcast=True)
    floor_raw = ((bits >> 23) & 0xFF) - 127 - tl.where(small, 64, 0)   # floor(log2 amax), exact
    fraction = bits & 0x7FFFFF
    klass = (fraction > 0x400000).to(tl.int32) + (fraction > 0x600000).to(tl.int32)  # mantissa > 1.5, > 1.75
    floor = tl.minimum(tl.maximum(floor_raw, -149), 127)
    rel = b * _pow2(-tl.maximum(floor, -126))[:, None]
    index = _window(rel, -40, 1) + (klass * 330)[:, None]
    index = tl.where(present, index, 1023)
    tl.store(hist + tl.arange(0, 1024), tl.histogram(tl.reshape(index, [TR * TC]), 1024))
    cell = klass * 277 + (floor + 149)
    seen = amax > 0.0
    tl.store(hist + 1024 + tl.arange(0, 1024), tl.histogram(tl.where(seen, cell, 1023), 1024))
    per_element = tl.where(present, cell[:, None] + tl.zeros([TR * TC // 32, 32], dtype=tl.int32), 1023)
    tl.store(hist + 2048 + tl.arange(0, 1024), tl.histogram(tl.reshape(per_element, [TR * TC]), 1024))
    # (the recipes, in run_file.block_bins.RECIPES' order)
    _mx_cast(b, present, floor_raw, klass, counts, sums, 0, 3, -6, 448.0, 8, 2, False)
    _mx_cast(b, present, floor_raw, klass, counts, sums, 1, 3, -6, 448.0, 8, 2, True)
    _mx_cast(b, present, floor_raw, klass, counts, sums, 2, 2, -14, 57344.0, 15, 2, False)
    _mx_cast(b, present, floor_raw, klass, counts, sums, 3, 2, -14, 57344.0, 15, 2, True)
    _mx_cast(b, present, floor_raw, klass, counts, sums, 4, 1, 0, 6.0, 2, 1, False)
    _mx_cast(b, present, floor_raw, klass, counts, sums, 5, 1, 0, 6.0, 2, 1, True)

    # -- NVFP4: blocks of 16 under a tensor scale ----------------------------------------------
    n = tl.reshape(x, [TR * TC // 16, 16])
    present = n != 0.0
    amax = tl.max(n, axis=1)
    top = tl.load(tensor_amax)
    tensor_scale = tl.math.div_rn(top, 2688.0)
    scaled = tl.math.div_rn(tl.math.div_rn(amax, 6.0), tensor_scale)
    seen = amax > 0.0
    clamped = (scaled < 0.015625) & seen
    block_scale = _round(tl.minimum(tl.maximum(scaled, 0.015625), 448.0), 3, -6, 448.0)
    q = n * tl.math.div_rn(tl.math.div_rn(1.0, tensor_scale), block_scale)[:, None]
    q = tl.where(present, q, 0.0)
    index = tl.where(present, _window(q, -12, 3), 127)
    tl.store(hist + 3072 + tl.arange(0, 128), tl.histogram(tl.reshape(index, [TR * TC]), 128))
    ratio = tl.where(seen, _window(tl.math.div_rn(amax, top), -48, 1), 511)
    tl.store(hist + 3200 + tl.arange(0, 512), tl.histogram(ratio, 512))
    flushed, saturated, err, ref = _cast_figures(q, present, 1, 0, 6.0)
    tl.store(counts + 6, flushed)
    tl.store(counts + 13, saturated)
    tl.store(sums + 6, err)
    tl.store(sums + 13, ref)
    tl.store(counts + 14, tl.sum(tl.sum(present.to(tl.int32), axis=1), axis=0))
    tl.store(counts + 15, tl.sum(clamped.to(tl.int32), axis=0))
    tl.store(counts + 16, tl.sum(tl.sum((present & clamped[:, None]).to(tl.int32), axis=1), axis=0))
    first = (pid == 0).to(tl.float64)
    tl.store(sums + 14, rows_read.to(tl.float64) * first)
    tl.store(sums + 15, rows_total.to(tl.float64) * first)


def _check_constants() -> None:
    """The kernel's literals are the bins' constants (Triton wants them literal)."""
    assert (MX_BLOCK, NV_BLOCK, PER_BINADE, REL_WINDOW, Q_WINDOW, RATIO_WINDOW, EXP_RANGE) == (
        32, 16, 8, (-40, 1), (-12, 3), (-48, 1), (-149, 127))
    assert (REL_BINS, EXP_BINS, NV_TENSOR_DIVISOR, E4M3_EPS) == (330, 277, 2688.0, 0.015625)
    assert [r[0] for r in RECIPES] == ["mxfp8_e4m3_floor", "mxfp8_e4m3_round_up", "mxfp8_e5m2_floor",
                                       "mxfp8_e5m2_round_up", "mxfp4_floor", "mxfp4_round_up", "nvfp4"]


_check_constants()


@functools.lru_cache(maxsize=None)
def _layout_index(device: torch.device) -> torch.Tensor:
    """Where each value of the column's layout lies in the summed partials ``[hist | counts | sums]``."""
    c, s = HIST, HIST + N_COUNTS
    parts = {
        "mx_rel": np.arange(3 * REL_BINS),
        "mx_blocks": np.concatenate([H_BLOCKS + np.arange(3 * EXP_BINS), H_ELEMENTS + np.arange(3 * EXP_BINS)]),
        "nv_q": H_Q + np.arange(Q_BINS),
        "nv_ratio": H_RATIO + np.arange(RATIO_BINS),
        "nv_clamped": np.array([c + 15, c + 16]),
        "measured": np.stack([c + np.arange(7), c + 7 + np.arange(7), s + np.arange(7), s + 7 + np.arange(7)],
                             axis=1).reshape(-1),
        "nonzero": np.array([c + 14]),
        "rows": np.array([s + 14, s + 15]),
    }
    index = torch.from_numpy(np.concatenate([parts[name] for name, _ in LAYOUT]).astype(np.int64))
    if device.type == "cuda":  # (from pinned memory, not blocking: a pageable copy would sync)
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def _on(device: torch.device):
    """``device`` current while the kernel launches (a no-op off CUDA: the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def triton_packed(t2: torch.Tensor, tensor_amax: torch.Tensor, inv_scale: torch.Tensor | None,
                  rows: tuple[int, int]) -> torch.Tensor:
    """The packed block statistics (float64 ``[BLOCK_VALUES]``) of the 2-D operand view ``t2`` (its
    rows to read, in its own dtype), ``tensor_amax`` (0-dim float32, unscaled) and ``inv_scale``.
    No sync."""
    if t2.stride(1) != 1:
        t2 = t2.contiguous()
    n_rows, n_cols = t2.shape
    tc = min(256, max(32, triton.next_power_of_2(n_cols)))
    tr = TILE // tc
    grid = (triton.cdiv(n_cols, tc), triton.cdiv(n_rows, tr))
    programs = grid[0] * grid[1]
    device = t2.device
    hist = torch.empty(programs, HIST, dtype=torch.int32, device=device)
    counts = torch.empty(programs, N_COUNTS, dtype=torch.int32, device=device)
    sums = torch.empty(programs, N_SUMS, dtype=torch.float64, device=device)
    bf16 = t2.dtype == torch.bfloat16
    data = t2.view(torch.int16) if bf16 else t2
    with _on(device):  # (Triton launches on the current device: a hook may run with another one current)
        _block_kernel[grid](data, n_rows, n_cols, t2.stride(0), tensor_amax,
                            inv_scale if inv_scale is not None else tensor_amax, rows[0], rows[1], hist, counts, sums,
                            HAS_INV=inv_scale is not None, BF16=bf16, TR=tr, TC=tc, num_warps=WARPS,
                            enable_fp_fusion=False)
    totals = torch.cat([hist.sum(0, dtype=torch.int64).double(), counts.sum(0, dtype=torch.int64).double(),
                        sums.sum(0)])
    return totals.index_select(0, _layout_index(device))
