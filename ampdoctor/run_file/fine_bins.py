"""The bins of the fine histogram (the ``fine_hist`` column; :mod:`ampdoctor.stats.fine_hist`
computes it on the device), for readers: torch-free, like everything that reads a run.

Each nonzero element is counted by the top 12 bits of its float32 magnitude without the sign,
``bits >> 20``: its 8 exponent bits and the first 3 of its mantissa. So bin ``b`` (of 2048) holds
``[2^(e-127) (1 + m/8), 2^(e-127) (1 + (m+1)/8))`` with ``e = b >> 3``, ``m = b & 7`` (``e = 0``: float32
subnormals, ``m 2^-129`` wide; ``e = 255``: inf in bin 2040 with the NaNs whose top 3 mantissa bits
are 0, other NaNs above it). A bin is at most an eighth of a binade wide: a threshold inside one
splits at most that much of a tensor, which the counts below assume flat.
"""

from __future__ import annotations

import numpy as np

from .schema import FINE_BINS

FINE_SHIFT = 20        # float32 bits >> 20: 8 exponent bits and 3 mantissa bits
NONFINITE_BIN = 2040   # bins from here hold inf and NaN ...
NAN_ONLY_BIN = 2041    # ... and from here NaN only


def bin_edges() -> np.ndarray:
    """float64 ``[FINE_BINS + 1]``: the lower edge of each bin, then 2^128 (above float32's
    maximum: where the inf and NaN bins begin)."""
    b = np.arange(FINE_BINS + 1, dtype=np.int64)
    e, m = b >> 3, (b & 7).astype(np.float64)
    return np.where(e == 0, m * 2.0**-129, np.ldexp(1.0 + m / 8.0, (e - 127).astype(np.int64)))


EDGES = bin_edges()


def bin_of(values: np.ndarray) -> np.ndarray:
    """The bin of each magnitude (as float32)."""
    return (np.asarray(values).astype(np.float32).view(np.int32) & 0x7FFFFFFF) >> FINE_SHIFT


def count_below(hist: np.ndarray, threshold: np.ndarray) -> np.ndarray:
    """How many of each row of ``hist``'s counted magnitudes lie below its own threshold: every
    bin whose upper edge is at or below it, plus the share of the width of the bin that holds it
    (a flat density within an eighth of a binade). inf and NaN are never below a threshold."""
    hist = np.asarray(hist, dtype=np.float64)
    threshold = np.asarray(threshold, dtype=np.float64)
    cum = np.concatenate([np.zeros((len(hist), 1)), np.cumsum(hist, axis=1)], axis=1)
    return below(hist, cum, threshold)


def below(hist: np.ndarray, cum: np.ndarray, threshold: np.ndarray) -> np.ndarray:
    """:func:`count_below` given ``cum``, the cumulative sums of ``hist``'s rows with a leading 0."""
    rows = np.arange(len(hist))
    with np.errstate(invalid="ignore", over="ignore"):
        valid = threshold > 0  # (NaN: nothing below it)
        top = threshold >= EDGES[NONFINITE_BIN]  # above every finite value: inf and NaN are not below it
        x = np.where(valid & ~top, threshold, 0.0)
        i = np.clip(np.searchsorted(EDGES, x, side="right") - 1, 0, NONFINITE_BIN - 1)
        lo, hi = EDGES[i], EDGES[i + 1]
        inside = cum[rows, i] + hist[rows, i] * (x - lo) / (hi - lo)
    return np.where(valid, np.where(top, cum[:, NONFINITE_BIN], inside), 0.0)
