"""The results of :func:`~.full.full_stats`: :class:`FullStats`, per slot as an algorithm leaves
them on the device; :func:`stats_to_host`, which copies a step's of them to the host at once; and
:meth:`FullStats.decode`, which makes :class:`HostStats` of them on the writer thread. With them,
the layout of their counts (``SLOT_STRIDE`` entries per slot), which every algorithm writes.

Each element's unscaled float32 bit pattern gives, shifted right by 22, one integer *code*: its
exponent field and the top mantissa bit (which tells a quiet NaN from inf), so one count per slot
and code yields the histogram and the NaN and inf counts; :meth:`FullStats.decode` maps the
binades onto histogram bins on the host. The smallest nonzero and the largest finite magnitude
are exact.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .packed import arrays as packed_arrays
from .host_stats import HostStats, to_float32

_ABS_MASK = 0x7FFFFFFF
_CODES = 512              # float32 bits >> 22: exponent field (256) x top mantissa bit (2)
# Per slot after the codes: elements at or above the smallest normal (unused), nonzero ones below
# it (subnormal), zeros; so that base + _ABOVE + below + zero lands in the right one.
_ABOVE, _BELOW, _ZERO = _CODES, _CODES + 1, _CODES + 2
SLOT_STRIDE = _CODES + 3  # entries of FullStats.counts per slot
_NO_AMIN = 0x7F7FFFFF     # amin is kept as (bits - 1) & _ABS_MASK: zero and non-finite land at or above this


@dataclass
class FullStats:
    """Raw per-slot results of :func:`~.full.full_stats`, still on the device (or the host buffers
    they were copied into): either five tensors, or (the triton algorithm) one byte buffer that
    holds them (:mod:`.packed`), whose fields are then None."""

    counts: torch.Tensor | None      # int64 [slots * SLOT_STRIDE]: codes, n_zero, n_below_normal
    amax: torch.Tensor | None        # float32 [slots]: the largest finite magnitude
    amin_code: torch.Tensor | None   # int32 [slots]: smallest (bits - 1) & _ABS_MASK (see _NO_AMIN)
    sumsq: torch.Tensor | None       # float64 [slots]: sum of squares of finite unscaled values (host: float32
                                     # partial sums rescaled by a power of two; accelerator: float64 sums)
    line_zeros: torch.Tensor | None  # int64 [slots]: zeros lying in an all-zero row or column (zero_line_elements)
    hist_min_exp: int
    bins: int
    packed: torch.Tensor | None = None  # uint8: the five fields in packed.layout, from byte packed_at on
    packed_at: int = 0
    n_slots: int = 0                    # (of a packed buffer)

    @classmethod
    def of_packed(cls, buffer: torch.Tensor, n_slots: int, hist_min_exp: int, bins: int, at: int = 0) -> "FullStats":
        return cls(None, None, None, None, None, hist_min_exp, bins, buffer, at, n_slots)

    @property
    def device(self) -> torch.device:
        return (self.packed if self.packed is not None else self.counts).device

    def to_host(self, copy) -> "FullStats":
        """The same statistics, each tensor passed through ``copy`` (a
        :meth:`ampdoctor.record.transfer.HostCopies.to_host`): one copy when packed, else five.
        :func:`stats_to_host` copies many at once."""
        if self.packed is not None:
            return FullStats.of_packed(copy(self.packed), self.n_slots, self.hist_min_exp, self.bins, self.packed_at)
        return FullStats(copy(self.counts), copy(self.amax), copy(self.amin_code), copy(self.sumsq),
                         copy(self.line_zeros), self.hist_min_exp, self.bins)

    def _arrays(self) -> tuple[np.ndarray, ...]:
        """``(counts, amax, amin_code, sumsq, line_zeros)`` as numpy arrays. Host tensors only."""
        if self.packed is not None:
            return packed_arrays(self.packed.numpy()[self.packed_at:], self.n_slots, SLOT_STRIDE)
        return tuple(t.numpy() for t in (self.counts, self.amax, self.amin_code, self.sumsq, self.line_zeros))

    def decode(self) -> HostStats:
        """The statistics of each slot as :class:`HostStats`. Host tensors only (the writer
        thread, once their fence has passed)."""
        counts, amax, amin_code, sumsq, line_zeros = self._arrays()
        counts = counts.reshape(-1, SLOT_STRIDE)
        codes = counts[:, :_CODES].reshape(-1, 256, 2)            # [slot, exponent field, mantissa bit]
        n_zero = counts[:, _ZERO].copy()
        finite = codes[:, :255].sum(axis=2)                        # per exponent field
        finite[:, 0] -= n_zero                                     # zeros are exponent 0, not a binade
        amin = np.where(amin_code >= _NO_AMIN, np.int32(0x7FC00000), amin_code + 1).astype(np.int32)
        return HostStats(
            amax=amax.copy(),
            amin=amin.view(np.float32),
            l2=to_float32(np.sqrt(sumsq)),
            n_zero=n_zero,
            n_subnormal=counts[:, _BELOW].copy(),
            n_nan=codes[:, 255, 1].copy(),
            n_inf=codes[:, 255, 0].copy(),
            hist=finite @ _binade_to_bin(self.hist_min_exp, self.bins),  # int64
            n_zero_lines=line_zeros.astype(np.float64),
        )


def stats_to_host(stats: Sequence, copy) -> list:
    """Each of ``stats`` (:class:`FullStats`, or anything with a ``to_host(copy)``) passed to the
    host through ``copy``, in order; the same object twice (a repeated tap) is copied once. The
    packed :class:`FullStats` of each device are concatenated there and copied together: one
    ``cat`` and one copy for a module-sampled step's few hundred calls. No sync."""
    out: list = [None] * len(stats)
    first: dict[int, int] = {}
    packs: dict[torch.device, list[int]] = {}
    for i, s in enumerate(stats):
        if id(s) in first:
            continue
        first[id(s)] = i
        if isinstance(s, FullStats) and s.packed is not None:
            packs.setdefault(s.device, []).append(i)
        else:
            out[i] = s.to_host(copy)
    for members in packs.values():
        if len(members) == 1:
            out[members[0]] = stats[members[0]].to_host(copy)
            continue
        parts = [stats[i].packed.narrow(0, stats[i].packed_at, stats[i].packed.numel() - stats[i].packed_at)
                 if stats[i].packed_at else stats[i].packed for i in members]
        host = copy(torch.cat(parts))
        at = 0
        for i, part in zip(members, parts):
            s = stats[i]
            out[i] = FullStats.of_packed(host, s.n_slots, s.hist_min_exp, s.bins, at)
            at += part.numel()
    for i, s in enumerate(stats):
        if out[i] is None:
            out[i] = out[first[id(s)]]
    return out


@functools.lru_cache(maxsize=16)
def _binade_to_bin(min_exp: int, bins: int) -> np.ndarray:
    """int64 [255, bins]: exponent field e (binade e - 127; e = 0 holds the float32 subnormals)
    onto its histogram bin, clamped at both ends."""
    index = np.clip(np.arange(255) - 127 - min_exp, 0, bins - 1)
    index[0] = 0
    out = np.zeros((255, bins), dtype=np.int64)
    out[np.arange(255), index] = 1
    return out
