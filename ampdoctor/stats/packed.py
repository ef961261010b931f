"""The results of one full-statistics call in one byte buffer: one allocation and one memset on
the device, and, for every call of a step together, one copy to the host.

A module-sampled step makes a few hundred :func:`~.full.full_stats` calls (one per tapped tensor).
With five result tensors each, they were five allocations a call on the device and five
allocation-and-copy pairs each into pinned host memory at the step's end: on an H100 some 1,000
copies a step, each a few µs of the training thread's time. Packed, a call allocates once and the
step copies once (:func:`~.full_results.stats_to_host` concatenates the buffers on the device first).

Layout, for ``n`` slots of ``stride`` counts, each field at a multiple of 8 bytes::

    counts     int64   [n * stride]   at 0
    amax       float32 [n]
    amin_code  int32   [n]
    sumsq      float64 [n]
    line_zeros int64   [n]

The kernels of :mod:`.full_triton_kernels` write into it through typed pointers at these offsets; the host
reads it through numpy views (:func:`arrays`), on the writer thread. Nothing here syncs.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Layout(NamedTuple):
    """Byte offsets of the fields after ``counts`` (at 0), and the buffer's size."""

    amax: int
    amin_code: int
    sumsq: int
    line_zeros: int
    size: int


def _up8(n: int) -> int:
    return (n + 7) // 8 * 8


def layout(n_slots: int, stride: int) -> Layout:
    """Where each field of a buffer of ``n_slots`` slots lies."""
    amax = n_slots * stride * 8
    amin = amax + _up8(4 * n_slots)
    sumsq = amin + _up8(4 * n_slots)
    lines = sumsq + 8 * n_slots
    return Layout(amax, amin, sumsq, lines, lines + 8 * n_slots)


def arrays(buffer: np.ndarray, n_slots: int, stride: int) -> tuple[np.ndarray, ...]:
    """``(counts, amax, amin_code, sumsq, line_zeros)``: numpy views of a host buffer (uint8, the
    first ``layout(...).size`` bytes read)."""
    at = layout(n_slots, stride)
    return (buffer[:at.amax].view(np.int64),
            buffer[at.amax:at.amax + 4 * n_slots].view(np.float32),
            buffer[at.amin_code:at.amin_code + 4 * n_slots].view(np.int32),
            buffer[at.sumsq:at.line_zeros].view(np.float64),
            buffer[at.line_zeros:at.size].view(np.int64))
