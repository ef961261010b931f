"""The *triton* algorithm of the full statistics (:func:`ampdoctor.stats.full_stats` on CUDA when
Triton is there): two kernel launches and a memset for any number of tensors, each element read
once, no atomics into global memory, temporaries that do not grow with the data.

Why a kernel: the statistics are a histogram (counts per binade and slot). Torch has no sync-free,
deterministic histogram op that does not send every element of a tensor to the same few
addresses: ``index_add_`` on integers serialises its atomics there (on an H200 a GPT-2-small
sampled step spent 173 ms of 228 in it), ``bincount`` reads its maximum to the host (a sync), and
``histc`` refuses deterministic mode. Here each program reduces a *tile* of one tensor into a
private histogram in registers (``tl.histogram``), and the tiles' partial results are combined per
slot by a second kernel in a fixed order: the results are the same run to run, and exact.

How. The kernels are in :mod:`.full_triton_kernels` (what each reads and writes); this module
launches them. A tile is whole rows of a tensor's 2-D view, read in blocks of ``RB`` rows x ``CB``
columns. The tile table (:class:`_Plan`) depends on the shapes alone: it is built once and kept on
the device; a call sends its tensors' addresses (or, for one tensor, the tensor itself). Kernel 1
writes each tile's partial results into buffers kept per shape (:func:`_partials`); kernel 2 adds
them per slot into one byte buffer (:mod:`.packed`).

Limits. Tensors of one dtype and device (as :func:`full_stats` requires); a non-contiguous tensor
is copied first (a module output seen through a transposed view, say). A tensor of very few
columns (a 3x3 convolution over 3 channels: 27) leaves most of a block's lanes idle: correct,
slower. The first call per dtype in a process compiles the kernels (about a second each; Triton
caches them on disk for later runs). Under ``TRITON_INTERPRET=1`` the same kernels run on CPU
tensors: that is how CI tests them, and ``scripts/compile_triton_kernels.py`` compiles them for
sm_90 without a GPU. Nothing here syncs: the addresses go to the device as a non-blocking copy
from pinned memory.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch
import triton.language as tl

from .full_triton_kernels import _slot_kernel, _tile_kernel
from .packed import layout

RB, CB = 8, 128      # a block of a program: rows x columns of a tensor's 2-D view, held in registers;
                     # 1024 elements: of 1024, 2048 and 4096 the fastest on an H200, and of 8 shapes
                     # the fastest with 4 warps on an H100 (benchmarks/results/stats_kernels_h*.json)
TILE_WARPS = 4       # warps of a tile program: 4 read GPT-2's gradients 17% faster than 8 on an H100
                     # (benchmarks/results/stats_kernels_h100_2026-11-26.json)
MIN_TILE = 1 << 14   # elements per tile (one program), unless a call is large
MAX_TILES = 1 << 13  # tiles a call aims for at most (plus one partial tile per tensor): the
                     # partial results are ~300 bytes per tile, so ~2.5 MiB at most, whatever the model
_SLOT_ROWS = 64      # tiles added per iteration of kernel 2 (16 took 0.26 ms for GPT-2's 2,300-tile embedding)
_LINE_BLOCK = 1024   # marks summed per iteration of kernel 3
_TABLE = 8           # int64 per tile: its tensor, its first element there, rows, columns, elements,
                     # whether its lines are marked, its row and column marks' offsets

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read when the kernels are defined, as Triton does

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.int16,
              torch.float64: tl.float64}  # (bfloat16 as int16: see full_triton_kernels._block)


def triton_full_stats(tensors: Sequence[torch.Tensor], *, per_tensor: bool, inv_scale: torch.Tensor | None,
                      threshold: float, hist_min_exp: int, hist_bins: int, lines: str, slot_stride: int,
                      above_at: int):
    """``(buffer, slots)``: the results of ``tensors`` packed in one byte buffer as :mod:`.packed`
    lays them out, ``counts`` as :class:`~.full_results.FullStats` holds them (``slot_stride`` entries per
    slot: the codes, then above/below/zero from ``above_at``; the histogram of ``hist_bins`` bins from binade ``hist_min_exp`` filed as
    :mod:`.full_triton_kernels` describes). ``inv_scale`` as torch's unscale_ takes it (a collapsed
    scale's inf is clamped here). One allocation, a memset and two launches; several tensors add a non-blocking
    copy of their addresses. Does not sync."""
    device, dtype = tensors[0].device, tensors[0].dtype
    flat = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    plan = _plan(tuple(t.shape for t in flat), per_tensor, lines)
    table, tiles, first_tile, line_table = plan.on(device)
    single = len(flat) == 1
    if single:  # the tensor itself is the kernel's argument (bfloat16 read as int16: see full_triton_kernels._block)
        addresses, data = table, flat[0].view(torch.int16) if dtype == torch.bfloat16 else flat[0]
    else:
        host = torch.tensor([t.data_ptr() for t in flat], dtype=torch.int64,
                            pin_memory=device.type == "cuda")  # pageable memory would make the copy synchronous
        addresses, data = host.to(device, non_blocking=True), table
    n_tiles, n_slots = plan.n_tiles, plan.n_slots

    # One zeroed buffer (one allocation, one memset): the results (packed.layout, written by kernel 2
    # through typed pointers at these offsets), then a byte per row and column of the 2-D views.
    at = layout(n_slots, slot_stride)
    zeroed = torch.zeros(at.size + max(plan.n_marks, 1), dtype=torch.uint8, device=device)
    marks = zeroed.narrow(0, at.size, zeroed.numel() - at.size)
    nbins = max(2, 1 << (hist_bins - 1).bit_length())  # (triton.next_power_of_2: a slow constexpr function call)
    rows = max(n_tiles, 1)
    partial_hist, partial_extra, partial_amax, partial_amin, partial_sumsq = _partials(device, rows, nbins)
    scale = inv_scale if inv_scale is not None else partial_amax  # any float32 pointer: not read
    first_e = 127 + hist_min_exp
    with _on(device):
        if n_tiles:
            _tile_kernel[(n_tiles,)](tiles, addresses, data, scale, partial_hist, partial_extra, partial_amax,
                                     partial_amin, partial_sumsq, marks, float(threshold), DTYPE=_TL_DTYPES[dtype],
                                     ESIZE=flat[0].element_size(), SINGLE=single, HAS_SCALE=inv_scale is not None,
                                     RB=RB, CB=CB, FIRST_E=first_e, LAST_BIN=hist_bins - 1, NBINS=nbins,
                                     WIDE=plan.wide, FOR_LOOP=not _INTERPRETED, BF16=dtype == torch.bfloat16,
                                     num_warps=TILE_WARPS)
        _slot_kernel[(n_slots,)](first_tile, partial_hist, partial_extra, partial_amax, partial_amin, partial_sumsq,
                                 line_table, marks, len(flat), zeroed, at.amax, at.amin_code, at.sumsq, at.line_zeros,
                                 STRIDE=slot_stride, ABOVE_AT=above_at, ROWS=_SLOT_ROWS, FIRST_E=first_e,
                                 BINS=hist_bins, NBINS=nbins, PER_TENSOR=per_tensor, LINE_BLOCK=_LINE_BLOCK,
                                 FOR_LOOP=not _INTERPRETED, num_warps=4)
    del flat  # the copies of non-contiguous tensors are freed stream-ordered: the kernels have them
    return zeroed.narrow(0, 0, at.size), n_slots


_PARTIALS: OrderedDict = OrderedDict()  # (device, stream, thread, tiles, bins) -> the partial results' buffers
PARTIALS_KEPT = 16         # sets kept (the most recently used), each of at most PARTIALS_MAX_TILES tiles
PARTIALS_MAX_TILES = 4096  # ~1.2 MB a set at 64 bins: larger calls allocate theirs
_current_stream = getattr(torch._C, "_cuda_getCurrentStream", None)


def _partials(device: torch.device, rows: int, nbins: int) -> tuple[torch.Tensor, ...]:
    """The buffers of the tiles' partial results for a call of ``rows`` tiles. Kernel 1 writes
    them whole and kernel 2 reads them, in stream order, so one set serves every call of the same
    shape on the same stream: five allocations fewer per call (3.5 µs of host time each on an
    H100), most of what a module-sampled step's ~300 calls allocate. Kept per stream and thread
    (two threads launching on one stream could interleave their two kernels). No sync."""
    stream = _current_stream(device.index)[0] if device.type == "cuda" and _current_stream else 0
    key = (device, stream, threading.get_ident(), rows, nbins)
    held = _PARTIALS.get(key)
    if held is None:
        held = (torch.empty((rows, nbins), dtype=torch.int32, device=device),
                torch.empty((rows, 8), dtype=torch.int32, device=device),
                torch.empty(rows, dtype=torch.float32, device=device),
                torch.empty(rows, dtype=torch.int32, device=device),
                torch.empty(rows, dtype=torch.float64, device=device))
        if rows > PARTIALS_MAX_TILES:
            return held
        _PARTIALS[key] = held
        while len(_PARTIALS) > PARTIALS_KEPT:
            _PARTIALS.popitem(last=False)
    else:
        _PARTIALS.move_to_end(key)
    return held


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class _Plan:
    """What does not change between calls on tensors of the same shapes: the tiles, each slot's
    first tile and each tensor's line geometry, as one int64 table kept on each device it is used
    on (copied once, without blocking). A model's shapes rarely change, so each plan is built once.

    A tensor of 2 or more dimensions is tiled by whole rows of its 2-D view (rows of ``n_cols``
    elements, ``RB`` rows a block at least), so that its line marks need no division; one of
    fewer is read as rows of ``CB`` elements, the last one partial, with no marks."""

    def __init__(self, shapes: tuple[tuple[int, ...], ...], per_tensor: bool, lines: str) -> None:
        numels = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        target = max(MIN_TILE, -(-sum(numels) // MAX_TILES))  # elements per tile, about
        geometry = np.zeros((len(shapes), 4), dtype=np.int64)  # rows, columns, row marks, column marks
        entries, ends = [], []
        at = 0
        for i, (shape, n) in enumerate(zip(shapes, numels)):
            if n and len(shape) >= 2:
                n_rows = shape[0] if lines == "rows" else n // shape[-1]
                n_cols = n // n_rows
                geometry[i] = (n_rows, n_cols, at, at + n_rows)
                step = max(RB, target // n_cols // RB * RB)  # rows per tile
                for first in range(0, n_rows, step):
                    rows = min(step, n_rows - first)
                    entries.append((i, first * n_cols, rows, n_cols, rows * n_cols, 1, at + first, at + n_rows))
                at += n_rows + n_cols
            elif n:
                step = -(-target // CB) * CB
                for first in range(0, n, step):
                    length = min(step, n - first)
                    entries.append((i, first, -(-length // CB), CB, length, 0, 0, 0))
            ends.append(len(entries))
        self.n_tiles = len(entries)
        self.n_marks = at
        table = np.array(entries, dtype=np.int64).reshape(-1, _TABLE)
        self.wide = bool(self.n_tiles and table[:, 4].max() >= 2**31 - RB * CB)
        first = np.array([0] + ends, dtype=np.int64) if per_tensor else np.array([0, self.n_tiles], dtype=np.int64)
        self.n_slots = len(first) - 1
        self._host = torch.from_numpy(np.concatenate([table.reshape(-1), first, geometry.reshape(-1)]))
        self._on: dict[torch.device, tuple] = {}

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The table on ``device`` (copied the first time, without blocking), and its parts: the
        tiles, each slot's first tile, and the tensors' line geometry (views made once: a call
        pays no op for them)."""
        held = self._on.get(device)
        if held is None:
            host = self._host.pin_memory() if device.type == "cuda" else self._host
            table = host.to(device, non_blocking=True)
            tiles = table.narrow(0, 0, _TABLE * self.n_tiles)
            first = table.narrow(0, _TABLE * self.n_tiles, self.n_slots + 1)
            lines = table.narrow(0, _TABLE * self.n_tiles + self.n_slots + 1,
                                 table.numel() - _TABLE * self.n_tiles - self.n_slots - 1)
            held = self._on[device] = (table, tiles, first, lines)
        return held


@functools.lru_cache(maxsize=256)
def _plan(shapes: tuple[tuple[int, ...], ...], per_tensor: bool, lines: str) -> _Plan:
    return _Plan(shapes, per_tensor, lines)
