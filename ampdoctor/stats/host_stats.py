"""Statistics as numpy arrays on the host, one entry per slot: what rows are built from.

:meth:`FullStats.decode <ampdoctor.stats.full_results.FullStats.decode>` and
:meth:`LightStats.decode <ampdoctor.stats.light.LightStats.decode>` make them from host copies;
reading a tensor that lives on an accelerator would sync, so only the writer thread builds these.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np


@dataclass
class HostStats:
    """Per-slot statistics, ready to become run-file columns. Light statistics hold only ``amax``
    (the peak) and ``l2``; their other fields are NaN (null in the run file) and ``hist`` has no
    bins."""

    amax: np.ndarray         # float32 [slots]
    amin: np.ndarray         # float32 [slots], NaN where no nonzero finite element
    l2: np.ndarray           # float32 [slots]
    n_zero: np.ndarray       # int64 [slots]
    n_subnormal: np.ndarray  # int64 [slots]
    n_nan: np.ndarray        # int64 [slots]
    n_inf: np.ndarray        # int64 [slots]
    hist: np.ndarray         # int64 [slots, bins]
    # zeros in all-zero rows or columns (float: NaN where unknown, light rows and old runs)
    n_zero_lines: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.n_zero_lines is None:
            self.n_zero_lines = np.full(len(self.amax), np.nan)

    @classmethod
    def light_only(cls, peaks: np.ndarray, norms: np.ndarray) -> "HostStats":
        """Light statistics: ``amax`` is the peak (NaN/inf when the tensor held one), ``l2`` the
        norm; the rest is unknown."""
        n = len(peaks)
        unknown = np.full(n, np.nan)
        return cls(amax=peaks, amin=np.full(n, np.nan, np.float32), l2=norms, n_zero=unknown,
                   n_subnormal=unknown, n_nan=unknown, n_inf=unknown, hist=np.zeros((n, 0), np.int64))

    @classmethod
    def empty(cls, bins: int) -> "HostStats":
        """One slot of full statistics over no elements (a step that observed no gradient)."""
        return cls(np.zeros(1, np.float32), np.full(1, np.nan, np.float32), np.zeros(1, np.float32),
                   *(np.zeros(1, np.int64) for _ in range(4)), np.zeros((1, bins), np.int64))

    @property
    def light(self) -> bool:
        return self.hist.shape[1] == 0

    def total(self) -> "HostStats":
        """All slots combined into one (for step rows). Light: the peak over all slots (non-finite
        if any slot was) and the norm over the slots that were finite (so a skipped step keeps a
        lower bound of its gradient norm, as full statistics keep the norm of the finite elements)."""
        if self.light:
            with np.errstate(invalid="ignore"):  # a NaN peak makes the total NaN, as it should
                peak = self.amax.max(initial=0.0)
            norms = self.l2.astype(np.float64)
            norm = np.sqrt(np.square(norms[np.isfinite(norms)]).sum(keepdims=True))
            return HostStats.light_only(np.array([peak], np.float32), to_float32(norm))
        finite_min = self.amin[~np.isnan(self.amin)]
        return HostStats(
            amax=np.array([self.amax.max(initial=0.0)], dtype=np.float32),
            amin=np.array([finite_min.min() if finite_min.size else np.nan], dtype=np.float32),
            l2=to_float32(np.sqrt(np.square(self.l2.astype(np.float64)).sum(keepdims=True))),
            n_zero=np.array([self.n_zero.sum()]), n_subnormal=np.array([self.n_subnormal.sum()]),
            n_nan=np.array([self.n_nan.sum()]), n_inf=np.array([self.n_inf.sum()]),
            hist=self.hist.sum(axis=0, keepdims=True, dtype=np.int64),  # int32 wrapped past 2**31 elements
            n_zero_lines=np.array([self.n_zero_lines.sum()]),
        )

    @staticmethod
    def concat(parts: Sequence["HostStats"]) -> "HostStats":
        return HostStats(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(HostStats)))


def to_float32(values: np.ndarray) -> np.ndarray:
    """float64 → float32; a norm beyond float32's range honestly becomes inf."""
    with np.errstate(over="ignore"):
        return values.astype(np.float32)
