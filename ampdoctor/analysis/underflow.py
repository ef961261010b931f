"""How many gradient elements underflowed: estimated from the recorded zeros, zero lines, subnormals
and binade histograms.

**Definition.** An element *underflows* at loss scale S in a format when its true value is nonzero
but it arrives as exactly 0 because ``|g| · S`` (or a value upstream of it in the backward) fell
below the format's rounding-to-zero threshold u (half the smallest subnormal: 2^-25 for float16).
The *underflow rate* is the number of such elements over all elements observed. It is a subset of
the zero rate: zeros are also *structural*, exact zeros at any scale (unused embedding rows, dead
ReLU units, masked or ignored positions, a parameter the loss does not reach).

**The evidence**, per tensor on a step with full statistics: its zeros, its subnormals (scaled
values within ten binades above u), its histogram, and ``n_zero_lines``: the zeros that fill a
whole row or column of the tensor's 2-D view (``stats.zero_line_elements``).

* *Structural zeros come in lines.* An unused embedding row, a dead unit's row of the weight
  before it and column of the weight after it, an ignored position of a module output gradient:
  each zeroes a whole line, at any scale. Zeros in lines do not count as underflow.
* *Underflow needs values near the cut-off.* The zeros outside lines (*scattered*) count as
  underflow when the tensor's subnormals are at least :data:`SUBNORMAL_SUPPORT` times as many:
  then its values reach down to the cut-off in numbers that make the zeros their continuation.
  Otherwise (few subnormals next to many zeros: the scattered zeros of a ReLU network, where
  every input of a weight-gradient element was masked) the estimate is the density floor ρ·x₀:
  the elements per unit magnitude read from the histogram's binades 4x..64x above the cut-off
  (:data:`DENSITY_BINADES`), times the cut-off.
* *A pile-up at the cut-off is underflow, lines included* (:func:`piled_at_cutoff`). With the
  cut-off in the tail of the magnitudes, each binade holds about twice the one below it; when the
  binade just above the cut-off holds more than the next one, the cut-off lies in their bulk and
  most of them fell below it: every zero counts, lines included in a parameter gradient (an
  attention weight's gradient whose output-gradient columns underflowed loses whole lines), the
  scattered ones in an output gradient (whose zero lines are masked or ignored positions and dead
  units, as its own lines were never a weight's).
* *Upper bound.* A tensor deep in underflow can lose whole lines without a pile-up of its own
  (the column underflowed upstream, in the output gradient): so the upper bound is every zero of
  a tensor whose subnormals are at least :data:`UPPER_SHARE` of its nonzero elements, and the
  estimate otherwise. Reports give both; the zeros between the two are *undecided*.
* *Unknown.* A tensor with zeros and no nonzero finite value at all (every element 0) has no
  magnitude to judge by: its underflow is unknown (NaN; upper bound: all of it), never a guess;
  except where the cut-off lies below 2^:data:`NEGLIGIBLE_LOG2` (bfloat16 or float32 at a
  moderate scale): no real gradient is that small, so 0 everywhere is structure there. A tensor
  that held a NaN or inf is not judged at all (callers leave it out: its histogram lost the
  overflowed values).

**Limits.** Activations (``output`` rows) are not loss-scaled and get no underflow estimate. Lines
that underflowed upstream without a pile-up in the tensor itself (an fp32 embedding gradient; a
weight whose output gradient underflowed almost entirely) are counted as structure; the upper
bound covers them. The zeros of a 1-D gradient (a bias) have no lines: a dead unit's bias zero
counts as underflow when the tensor's other values are subnormal. Elements whose float32 value
is rounding noise of a mathematically zero gradient (an attention key bias) can be 0 in fp16 and
tiny in fp32; they count as underflow when subnormals support them.
``tests/test_real_models.py`` checks the estimate against an fp32 reference backward on Hugging
Face GPT-2, T5, ViT and BERT, a nanoGPT-like model, a ReLU MLP and a BatchNorm CNN, at torch's
default scale and in heavy underflow.

**At another scale.** Near zero, a gradient's distribution has a smooth, finite density ρ, so the
number of true magnitudes below a small x is ≈ ρ·x: each binade holds twice as many elements as the
one below it. At a cut-off below x₀ (a higher scale) the lost elements shrink in proportion to the
cut-off. At a cut-off above x₀ (a lower scale) the recorded elements between x₀ and the new
cut-off are added from the histogram, with a flat density within a binade. An unknown estimate
stays unknown at every scale.

All functions work on arrays: one row per observation (a step row, a parameter at a step).
"""

from __future__ import annotations

import numpy as np

DENSITY_BINADES = (2, 3, 4, 5)  # binades above the cut-off the density is read from (x₀·2^k)
SUBNORMAL_SUPPORT = 2.0         # subnormals per scattered zero that make those zeros underflow
PILE_MIN = 8                    # a pile-up at the cut-off needs this many elements in its binade ...
PILE_SHARE = 0.05               # ... and this share of the nonzero ones (piled_at_cutoff)
UPPER_SHARE = 0.01              # subnormals per nonzero element that put every zero in the upper bound
NEGLIGIBLE_LOG2 = -100          # no gradient is smaller than 2^-100: a cut-off below it judges nothing


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


def underflow_bounds(hist: np.ndarray, n_zero: np.ndarray, n_subnormal: np.ndarray, cut_log2: np.ndarray,
                     min_exp: int, n_zero_lines: np.ndarray | None = None,
                     pile_lines: np.ndarray | bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(estimate, upper bound) of the elements lost at the recorded cut-off, per row.
    ``pile_lines``: per row, whether a pile-up at the cut-off counts the zero lines too (parameter
    gradients), or only the scattered zeros (output gradients, whose zero lines are masked or
    ignored positions and dead units)."""
    hist = np.asarray(hist)
    zeros = np.asarray(n_zero, dtype=np.float64)
    subnormal = np.asarray(n_subnormal, dtype=np.float64)
    lines = np.zeros_like(zeros) if n_zero_lines is None else np.nan_to_num(
        np.asarray(n_zero_lines, dtype=np.float64), nan=0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        rho = density_near_zero(hist, cut_log2, min_exp)
        floor = np.minimum(rho * np.exp2(np.asarray(cut_log2, dtype=np.float64)), zeros)
    floor = np.where(np.isfinite(floor), floor, 0.0)  # an invalid scale (0) judges nothing
    scattered = np.maximum(zeros - lines, 0.0)
    crossing = subnormal > 0
    supported = crossing & (subnormal >= SUBNORMAL_SUPPORT * scattered)
    estimate = np.where(supported, np.maximum(scattered, floor), floor)
    piled = np.where(pile_lines, zeros, scattered)
    estimate = np.where(piled_at_cutoff(hist, cut_log2, min_exp), np.maximum(estimate, piled), estimate)
    # Any zero may have underflowed (lines too, upstream) when the tensor reaches the cut-off in numbers.
    reaches = crossing & (subnormal >= UPPER_SHARE * hist.sum(axis=1))
    upper = np.where(reaches, zeros, estimate)
    # Every element 0: no magnitude to judge by, unless the cut-off lies below any real gradient
    # (bfloat16 or float32 at a moderate scale), where 0 everywhere is structure.
    within_reach = np.asarray(cut_log2, dtype=np.float64) > NEGLIGIBLE_LOG2
    unknown = (zeros > 0) & (hist.sum(axis=1) == 0) & within_reach
    return np.where(unknown, np.nan, estimate), np.where(unknown, zeros, upper)


def piled_at_cutoff(hist: np.ndarray, cut_log2: np.ndarray, min_exp: int) -> np.ndarray:
    """Per row: the magnitudes pile up at the cut-off. The binade just above it (the smallest
    subnormal's) holds more elements than the binade above that, and at least :data:`PILE_MIN`
    elements and :data:`PILE_SHARE` of the nonzero ones; no element lies below the cut-off.

    Why: with the cut-off in the tail of a distribution each binade holds about twice the one
    below it; fewer going up means the cut-off lies in the bulk of the magnitudes, so most of them,
    whole lines included, fell below it. A tensor with elements below the cut-off was not
    computed in the format (an fp32 embedding gradient): its zeros did not underflow there."""
    hist = np.asarray(hist)
    n, bins = hist.shape
    cut = np.asarray(cut_log2, dtype=np.float64)
    first = np.where(np.isfinite(cut), np.floor(cut + 1.0), -np.inf) - min_exp
    ok = (first > 0) & (first + 1 < bins - 1)  # both binades real bins (not the clamped ends)
    rows = np.nonzero(ok)[0]
    index = first[rows].astype(np.int64)
    low, above = hist[rows, index], hist[rows, index + 1]
    below = np.cumsum(hist[rows], axis=1)[np.arange(len(rows)), index - 1]
    total = hist[rows].sum(axis=1)
    out = np.zeros(n, dtype=bool)
    out[rows] = (low > above) & (low >= PILE_MIN) & (low >= PILE_SHARE * total) & (below == 0)
    return out


def cumulative_below(cumsum: np.ndarray, x_log2: np.ndarray | float, min_exp: int,
                     rows: np.ndarray | None = None) -> np.ndarray:
    """Recorded nonzero magnitudes below 2^x, from ``cumsum`` (the histogram's cumulative sum
    with a leading 0, shape [n, bins + 1]); flat density within a binade. ``x_log2`` broadcasts
    against the rows: shape [n] or [n, g]. ``rows``: per observation, its row of ``cumsum`` (many
    observations sharing few histograms, read in place instead of copied per observation)."""
    bins = cumsum.shape[1] - 1
    x = np.asarray(x_log2, dtype=np.float64)
    # An unknown cut-off (NaN: a scale of 0) counts nothing below it; infinities clamp to the ends.
    rel = np.nan_to_num(x - min_exp, nan=-1.0, posinf=bins + 1.0, neginf=-1.0)
    j = np.clip(np.floor(rel), 0, bins - 1).astype(np.int64)
    frac = np.clip(np.exp2(rel - j) - 1.0, 0.0, 1.0)
    frac = np.where(rel <= 0, 0.0, frac)
    if rows is not None:
        # (one flat gather: faster than a 2-d fancy index, the same elements)
        flat = (rows if x.ndim == 1 else rows[:, None]) * cumsum.shape[1] + j
        lo, hi = (np.take(cumsum, at).astype(np.float64, copy=False) for at in (flat, flat + 1))
    elif x.ndim == 1:
        lo = np.take_along_axis(cumsum, j[:, None], axis=1)[:, 0]
        hi = np.take_along_axis(cumsum, j[:, None] + 1, axis=1)[:, 0]
    else:
        lo = np.take_along_axis(cumsum, j, axis=1)
        hi = np.take_along_axis(cumsum, j + 1, axis=1)
    below = lo + (hi - lo) * frac
    return np.where(rel <= 0, 0.0, below)


def with_measured(estimate: np.ndarray, upper: np.ndarray, measured: np.ndarray,
                  where: np.ndarray | bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(estimate, upper bound) with each row's measured count (``n_underflow``, NaN where not
    measured; ``where``: the rows it may stand for) in place of both: a measurement settles it."""
    use = where & ~np.isnan(measured)
    return np.where(use, measured, estimate), np.where(use, measured, upper)


class UnderflowModel:
    """Per-observation estimate of the elements lost to underflow at any cut-off.

    ``lost(x)`` = ρ·2^x below the recorded cut-off x₀, and the estimate at x₀ plus the recorded
    elements between x₀ and 2^x above it."""

    def __init__(self, hist: np.ndarray, cut_log2: np.ndarray, at_cut: np.ndarray, min_exp: int,
                 drift_log2: np.ndarray | None = None, tail: np.ndarray | None = None,
                 tail_cut_log2: np.ndarray | None = None, cumsum: np.ndarray | None = None,
                 tail_noise: np.ndarray | None = None, cumsum_rows: np.ndarray | None = None,
                 below_cut: np.ndarray | None = None) -> None:
        """``at_cut``: the elements lost at the recorded cut-off (the estimate of :func:`underflow_bounds`).
        ``drift_log2``: per observation, how many binades its magnitudes moved since the histogram
        was recorded (a step between samples whose gradient norm fell by 2^4: -4); a cut-off x then
        loses what the recorded magnitudes lose at x - drift.
        ``tail``: per observation, the binade histogram of what underflowed at a measured step (its
        float32 shadow's magnitudes, ``underflow_hist``) and ``tail_cut_log2`` that step's cut-off:
        below the cut-off, a lost element whose magnitude lay below the measured cut-off is still
        lost k binades lower when its magnitude lay k binades lower; one whose magnitude lay above
        it underflowed upstream, and those come back as a flat density would (2^-k; zeros where
        nothing was measured: all of them so, ρ·x). ``cumsum``: the histograms' cumulative
        sums with a leading 0 (``hist`` None), where the caller has them; ``cumsum_rows``: each
        observation's row of ``cumsum`` where observations share them (no tail then);
        ``below_cut``: what each one's row holds below 2^(cut + 1), where the caller has it."""
        self.drift_log2 = None if drift_log2 is None else np.asarray(drift_log2, dtype=np.float64)
        self.min_exp = min_exp
        self.cut_log2 = np.asarray(cut_log2, dtype=np.float64)
        self.at_cut = np.asarray(at_cut, dtype=np.float64)
        if cumsum is None:
            hist = np.asarray(hist, dtype=np.float64)
            cumsum = np.concatenate([np.zeros((len(hist), 1)), np.cumsum(hist, axis=1)], axis=1)
        self.cumsum, self.rows = cumsum, cumsum_rows
        self.below_cut = (cumulative_below(self.cumsum, self.cut_log2 + 1.0, min_exp, cumsum_rows) if below_cut is None
                          else below_cut)
        self.tail = None
        if tail is not None:
            tail = np.asarray(tail, dtype=np.float64)
            self.tail = np.concatenate([np.zeros((len(tail), 1)), np.cumsum(tail, axis=1)], axis=1)
            self.tail_cut = np.asarray(tail_cut_log2, dtype=np.float64)
            self.tail_at_cut = cumulative_below(self.tail, self.tail_cut, min_exp)
            self.tail_noise = np.zeros(len(tail)) if tail_noise is None else np.asarray(tail_noise, dtype=np.float64)

    def lost(self, x_log2: np.ndarray) -> np.ndarray:
        """Estimated elements below 2^x (that would round to 0 with that cut-off); ``x_log2`` of
        shape [n] or [n, g] (one column per candidate cut-off)."""
        x = np.asarray(x_log2, dtype=np.float64)
        if self.drift_log2 is not None:
            x = x - (self.drift_log2 if x.ndim == 1 else self.drift_log2[:, None])
        if x.ndim == 2:
            under = self._under(x, self.cut_log2[:, None], self.at_cut[:, None])
            return np.where(x <= self.cut_log2[:, None], under, self._over(x, None))
        # One cut-off per observation (the light rows of a whole run pass here): each takes one
        # branch, computed only where it is taken (element by element the same values).
        low = x <= self.cut_log2
        at = np.flatnonzero(low)
        if len(at) == len(x):
            return self._under(x, self.cut_log2, self.at_cut)
        if not len(at):
            return self._over(x, None)
        out = np.empty(len(x))
        out[at] = self._under(x[at], self.cut_log2[at], self.at_cut[at], at)
        high = np.flatnonzero(~low)
        out[high] = self._over(x[high], high)
        return out

    def _under(self, x: np.ndarray, cut: np.ndarray, at_cut: np.ndarray, at: np.ndarray | None = None) -> np.ndarray:
        """``lost`` at or below the recorded cut-off (``at``: of these observations; ``cut`` and
        ``at_cut`` theirs, shaped like ``x``)."""
        return at_cut * self._below_share(np.minimum(x - cut, 0.0), at)

    def _over(self, x: np.ndarray, at: np.ndarray | None) -> np.ndarray:
        """``lost`` above the recorded cut-off (``at``: of these observations, ``x`` 1-d; None: all)."""
        cut, at_cut, below_cut = (_pick(v, x.ndim == 2, at) for v in (self.cut_log2, self.at_cut, self.below_cut))
        # (the observations' rows of the cumsum, read in place)
        rows = self.rows if at is None else (at if self.rows is None else self.rows[at])
        # The recorded values lie on the format's grid at the recorded scale: near the cut-off u
        # (half the smallest subnormal) a recorded value r stands for the true values within u of
        # it (the subnormals' spacing is 2u), so the true values below x are the recorded ones
        # below x + u: the smallest subnormal's binade holds the true values from u to 3u.
        # Further up u is negligible against the values.
        with np.errstate(over="ignore"):
            shifted = np.log2(np.exp2(x) + np.exp2(cut))
        return at_cut + np.maximum(cumulative_below(self.cumsum, shifted, self.min_exp, rows) - below_cut, 0.0)

    def _below_share(self, offset: np.ndarray, at: np.ndarray | None = None) -> np.ndarray:
        """Of the elements lost at the cut-off, the share still lost ``-offset`` binades below it:
        the measured tail's, else 2^offset (a flat density near zero). ``at``: of these
        observations (``offset`` 1-d)."""
        flat = np.exp2(offset)
        if self.tail is None:
            return flat
        two_d = offset.ndim == 2
        tail_cut, at_tail_cut, clean, noise = (_pick(v, two_d, at) for v in (self.tail_cut, self.tail_at_cut,
                                                                             self.tail[:, -1], self.tail_noise))
        total = clean + noise
        below = cumulative_below(self.tail, tail_cut + offset, self.min_exp, at)
        # Elements lost above the cut-off underflowed upstream (their own magnitude is larger):
        # they come back as the scale lifts what fed them, taken as a flat density (2^offset); so
        # do those whose magnitude was rounding noise (Tails).
        share = below + (clean - at_tail_cut + noise) * flat
        return np.where(total > 0, np.divide(share, total, out=np.zeros_like(share), where=total > 0), flat)


def _pick(values: np.ndarray, two_d: bool, at: np.ndarray | None) -> np.ndarray:
    """Per-observation ``values`` against an [n, g] argument (``two_d``), or those of ``at``."""
    if two_d:
        return values[:, None]
    return values if at is None else values[at]
