"""How many gradient elements underflowed: estimated from the recorded binade histograms.

**Definition.** An element *underflows* at loss scale S in a format when its true value is nonzero
but ``|g| · S`` is below the format's rounding-to-zero threshold u (half the smallest subnormal:
2^-25 for float16), so it becomes exactly 0. The *underflow rate* is the number of such elements
over all elements observed. It is a subset of the zero rate: zeros are also structural (unused
embedding rows, dead ReLUs), and a zero in the record cannot say which kind it is.

**Estimate at the recorded scale.** A tensor whose recorded values reach into the subnormal range
(``n_subnormal > 0``) has a distribution that crosses the cut-off x₀ = u / S, and its zeros are
counted as underflow; so are the zeros of a gradient that is zero everywhere (a parameter that gets
no gradient at all has ``.grad = None`` and is not observed): most of them are not lost in the tensor's own rounding but upstream, where an
output gradient that underflowed zeroes whole rows of a weight gradient. A tensor with no subnormal
value has nothing within ten binades of the cut-off: its zeros are structural and count only as
far as the density estimate below allows (≈ 0). Where a tensor has both, the rate is an upper
bound. ``tests/test_underflow.py`` checks this against an fp32 reference on the same batch.

**At another scale.** Near zero, a gradient's distribution has a smooth, finite density ρ, so the
number of true magnitudes below a small x is ≈ ρ·x: each binade holds twice as many elements as the
one below it. At a cut-off below x₀ (a higher scale) the lost elements shrink in proportion to the
cut-off. At a cut-off above x₀ (a lower scale) the recorded elements between x₀ and the new
cut-off are added from the histogram, with a flat density within a binade. ρ itself (the floor of
the estimate at x₀) is read from the recorded histogram in :data:`DENSITY_BINADES`, the binades
from 4x to 64x the cut-off: the two just above it are skipped because rounding to the coarse
subnormal grid moves elements across them.

All functions work on arrays: one row per observation (a step row, a parameter at a step).
"""

from __future__ import annotations

import numpy as np

DENSITY_BINADES = (2, 3, 4, 5)  # binades above the cut-off the density is read from (x₀·2^k)


def density_near_zero(hist: np.ndarray, cut_log2: np.ndarray, min_exp: int) -> np.ndarray:
    """Elements per unit magnitude just above the cut-off 2^cut_log2, for each histogram row."""
    hist = np.asarray(hist)
    n, bins = hist.shape
    first = np.ceil(np.asarray(cut_log2, dtype=np.float64))
    counts = np.zeros(n)
    width = np.zeros(n)
    first = np.where(np.isfinite(first), first, min_exp)  # a scale of 0 or inf: no cut-off to speak of
    for k in DENSITY_BINADES:
        exponent = first + k
        index = (exponent - min_exp).astype(np.int64)
        # Bin 0 and the last bin are clamped (they hold everything beyond them): not a binade.
        ok = (index > 0) & (index < bins - 1)
        rows = np.nonzero(ok)[0]
        counts[rows] += hist[rows, index[rows]]
        width[rows] += np.exp2(exponent[rows])
    return np.divide(counts, width, out=np.zeros(n), where=width > 0)


def lost_at_cutoff(hist: np.ndarray, n_zero: np.ndarray, n_subnormal: np.ndarray, cut_log2: np.ndarray,
                   min_exp: int) -> np.ndarray:
    """Estimated elements that became 0 at the recorded cut-off: every zero of a tensor that has
    subnormal values or no nonzero value at all, else ρ·x₀; never more than the zeros seen."""
    zeros = np.asarray(n_zero, dtype=np.float64)
    rho = density_near_zero(hist, cut_log2, min_exp)
    floor = rho * np.exp2(np.asarray(cut_log2, dtype=np.float64))
    crossing = (np.asarray(n_subnormal) > 0) | ((zeros > 0) & (np.asarray(hist).sum(axis=1) == 0))
    lost = np.minimum(np.where(crossing, zeros, floor), zeros)
    return np.where(np.isfinite(lost), lost, 0.0)  # an invalid scale (0) judges nothing


def cumulative_below(cumsum: np.ndarray, x_log2: np.ndarray | float, min_exp: int) -> np.ndarray:
    """Recorded nonzero magnitudes below 2^x, from ``cumsum`` (the histogram's cumulative sum
    with a leading 0, shape [n, bins + 1]); flat density within a binade. ``x_log2`` broadcasts
    against the rows: shape [n] or [n, g]."""
    bins = cumsum.shape[1] - 1
    x = np.asarray(x_log2, dtype=np.float64)
    rel = x - min_exp
    j = np.clip(np.floor(rel), 0, bins - 1).astype(np.int64)
    frac = np.clip(np.exp2(rel - j) - 1.0, 0.0, 1.0)
    frac = np.where(rel <= 0, 0.0, frac)
    if x.ndim == 1:
        lo = np.take_along_axis(cumsum, j[:, None], axis=1)[:, 0]
        hi = np.take_along_axis(cumsum, j[:, None] + 1, axis=1)[:, 0]
    else:
        lo = np.take_along_axis(cumsum, j, axis=1)
        hi = np.take_along_axis(cumsum, j + 1, axis=1)
    below = lo + (hi - lo) * frac
    return np.where(rel <= 0, 0.0, below)


class UnderflowModel:
    """Per-observation estimate of the elements lost to underflow at any cut-off.

    ``lost(x)`` = ρ·2^x below the recorded cut-off x₀, and the estimate at x₀ plus the recorded
    elements between x₀ and 2^x above it."""

    def __init__(self, hist: np.ndarray, cut_log2: np.ndarray, at_cut: np.ndarray, min_exp: int) -> None:
        """``at_cut``: the elements lost at the recorded cut-off (:func:`lost_at_cutoff`)."""
        hist = np.asarray(hist, dtype=np.float64)
        self.min_exp = min_exp
        self.cut_log2 = np.asarray(cut_log2, dtype=np.float64)
        self.at_cut = np.asarray(at_cut, dtype=np.float64)
        self.cumsum = np.concatenate([np.zeros((len(hist), 1)), np.cumsum(hist, axis=1)], axis=1)
        self.below_cut = cumulative_below(self.cumsum, self.cut_log2, min_exp)

    def lost(self, x_log2: np.ndarray) -> np.ndarray:
        """Estimated elements below 2^x (that would round to 0 with that cut-off); ``x_log2`` of
        shape [n] or [n, g] (one column per candidate cut-off)."""
        x = np.asarray(x_log2, dtype=np.float64)
        cut = self.cut_log2 if x.ndim == 1 else self.cut_log2[:, None]
        at_cut = self.at_cut if x.ndim == 1 else self.at_cut[:, None]
        below_cut = self.below_cut if x.ndim == 1 else self.below_cut[:, None]
        under = at_cut * np.exp2(np.minimum(x - cut, 0.0))
        over = at_cut + np.maximum(cumulative_below(self.cumsum, x, self.min_exp) - below_cut, 0.0)
        return np.where(x <= cut, under, over)
