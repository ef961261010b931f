"""The peak magnitude of many tensors of one dtype on one CUDA device, in two Triton launches and
one non-blocking copy of their addresses, whatever their number: the light module taps' batched
reduction (:func:`ampdoctor.stats.peaks.batch_peaks`, issue 39).

Kernel 1 reads a *chunk* (at most :data:`CHUNK` elements of one tensor) per program and writes
its largest magnitude to a partial result; kernel 2 takes the largest of each tensor's chunks, in
order. A NaN anywhere makes the tensor's peak NaN (a flag beside the maximum: the comparison
alone would drop it), an inf makes it inf: what the flight recorder must see. No atomics; the
results are exact and the same run to run.

The chunk table depends on the tensors' sizes alone, and is built once per set of sizes and kept
on the device (a model's taps see the same sizes every step); each call sends the tensors'
addresses from pinned memory. A non-contiguous tensor is copied first. Under
``TRITON_INTERPRET=1`` the kernels run on CPU tensors (the tests). Nothing here syncs.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 1024          # elements a program reads at a time
CHUNK = 64 * BLOCK    # elements of one tensor a program reduces: large tensors are read by many programs
ROWS = 256            # partial results a program of kernel 2 takes at a time

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read when the kernels are defined, as Triton does
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.int16,
              torch.float64: tl.float64}  # (bfloat16 read as int16 and widened: see _chunk_kernel)


@triton.jit
def _chunk_kernel(chunks, addresses, partial, DTYPE: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr,
                  FOR_LOOP: tl.constexpr):
    """partial[c] = the largest magnitude in chunk ``c`` (NaN if any element is NaN). A chunk is
    (tensor, first element, length) in ``chunks``."""
    c = tl.program_id(0)
    tensor = tl.load(chunks + 3 * c)
    first = tl.load(chunks + 3 * c + 1)
    length = tl.load(chunks + 3 * c + 2)
    base = tl.load(addresses + tensor).to(tl.pointer_type(DTYPE))
    lane = tl.arange(0, BLOCK)
    top = tl.zeros([BLOCK], dtype=tl.float32)
    nans = tl.zeros([BLOCK], dtype=tl.int32)
    steps = (length + BLOCK - 1) // BLOCK
    if FOR_LOOP:  # compiled: a for loop over a loaded bound is software-pipelined
        for k in range(0, steps):
            top, nans = _chunk_block(base, first, length, k, lane, top, nans, BLOCK, BF16)
    else:  # Triton's interpreter cannot take a loaded loop bound in range() under numpy 2
        k = steps * 0
        while k < steps:
            top, nans = _chunk_block(base, first, length, k, lane, top, nans, BLOCK, BF16)
            k += 1
    peak = tl.max(top, axis=0)
    tl.store(partial + c, tl.where(tl.sum(nans, axis=0) > 0, float("nan"), peak))


@triton.jit
def _chunk_block(base, first, length, k, lane, top, nans, BLOCK: tl.constexpr, BF16: tl.constexpr):
    at = k * BLOCK + lane
    inside = at < length
    if BF16:  # bfloat16 is the top half of a float32: widened by a shift (Triton's interpreter
        # flushed its subnormals when converting)
        raw = tl.load(base + first + at, mask=inside, other=0).to(tl.int32)
        magnitude = tl.abs((raw << 16).to(tl.float32, bitcast=True))
    else:
        magnitude = tl.abs(tl.load(base + first + at, mask=inside, other=0.0).to(tl.float32))
    nans += (magnitude != magnitude).to(tl.int32)
    top = tl.where(magnitude > top, magnitude, top)  # (a NaN compares false: counted above instead)
    return top, nans


@triton.jit
def _tensor_kernel(first_chunk, partial, out, ROWS: tl.constexpr, FOR_LOOP: tl.constexpr):
    """out[t] = the largest of tensor ``t``'s chunks' partial results, NaN if one is NaN."""
    t = tl.program_id(0)
    start = tl.load(first_chunk + t)
    end = tl.load(first_chunk + t + 1)
    lane = tl.arange(0, ROWS)
    top = tl.zeros([ROWS], dtype=tl.float32)
    nans = tl.zeros([ROWS], dtype=tl.int32)
    steps = (end - start + ROWS - 1) // ROWS
    if FOR_LOOP:
        for k in range(0, steps):
            top, nans = _tensor_block(partial, start, end, k, lane, top, nans, ROWS)
    else:
        k = steps * 0
        while k < steps:
            top, nans = _tensor_block(partial, start, end, k, lane, top, nans, ROWS)
            k += 1
    peak = tl.max(top, axis=0)
    tl.store(out + t, tl.where(tl.sum(nans, axis=0) > 0, float("nan"), peak))


@triton.jit
def _tensor_block(partial, start, end, k, lane, top, nans, ROWS: tl.constexpr):
    at = start + k * ROWS + lane
    value = tl.load(partial + at, mask=at < end, other=0.0)
    nans += (value != value).to(tl.int32)
    top = tl.where(value > top, value, top)
    return top, nans


def triton_peaks(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """float32 ``[len(tensors)]``: the largest magnitude of each (NaN if it holds a NaN), for
    non-empty tensors of one dtype on one device. Two launches and a non-blocking copy. No sync."""
    device, dtype = tensors[0].device, tensors[0].dtype
    flat = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    table, chunks, first_chunk, n_chunks = _table(tuple(t.numel() for t in flat)).on(device)
    host = torch.tensor([t.data_ptr() for t in flat], dtype=torch.int64,
                        pin_memory=device.type == "cuda")  # pageable memory would make the copy synchronous
    addresses = host.to(device, non_blocking=True)
    partial = torch.empty(n_chunks, dtype=torch.float32, device=device)
    out = torch.empty(len(flat), dtype=torch.float32, device=device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _chunk_kernel[(n_chunks,)](chunks, addresses, partial, DTYPE=_TL_DTYPES[dtype], BF16=dtype == torch.bfloat16,
                                   BLOCK=BLOCK, FOR_LOOP=not _INTERPRETED, num_warps=4)
        _tensor_kernel[(len(flat),)](first_chunk, partial, out, ROWS=ROWS, FOR_LOOP=not _INTERPRETED, num_warps=4)
    del flat  # the copies of non-contiguous tensors are freed stream-ordered: the kernels have them
    return out


class _Table:
    """The chunks of tensors of these sizes and each tensor's first chunk, as one int64 table
    kept on each device it is used on (copied once, without blocking)."""

    def __init__(self, numels: tuple[int, ...]) -> None:
        counts = np.array([-(-n // CHUNK) for n in numels], dtype=np.int64)
        first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        tensor = np.repeat(np.arange(len(numels), dtype=np.int64), counts)
        start = (np.arange(int(first[-1]), dtype=np.int64) - first[tensor]) * CHUNK
        length = np.minimum(CHUNK, np.asarray(numels, dtype=np.int64)[tensor] - start)
        self.n_chunks = int(first[-1])
        self._host = torch.from_numpy(np.concatenate([np.stack([tensor, start, length], axis=1).reshape(-1), first]))
        self._on: dict[torch.device, tuple] = {}

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        held = self._on.get(device)
        if held is None:
            host = self._host.pin_memory() if device.type == "cuda" else self._host
            table = host.to(device, non_blocking=True)
            held = self._on[device] = (table, table.narrow(0, 0, 3 * self.n_chunks),
                                       table.narrow(0, 3 * self.n_chunks, table.numel() - 3 * self.n_chunks),
                                       self.n_chunks)
        return held


@functools.lru_cache(maxsize=256)
def _table(numels: tuple[int, ...]) -> _Table:
    return _Table(numels)
