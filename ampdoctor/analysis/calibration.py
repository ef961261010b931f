"""Measurements calibrate the underflow estimates around them; the magnitudes recorded every step
carry a sampled step's figures to the steps between samples.

**Why.** At the default cadence one sampled step in ten is measured (a float32 shadow of its
backward: :mod:`ampdoctor.record.underflow_probe`); the others have only zeros, zero lines, subnormals
and a binade histogram, from which :func:`~ampdoctor.analysis.underflow.underflow_bounds` cannot
tell structure (an unused embedding row, a dead unit) from underflow where the cut-off lies in the
bulk of the magnitudes. A measured step can: tensor by tensor its zeros split into
``n_underflow`` that underflowed and the rest, structure. Structure is a property of the model and
the data, not of the loss scale, so a tensor's structural share carries to its other sampled
steps (:class:`Measurements`): there the underflow is the zeros recorded at that step less the
structural share of the nearest measurement before it (the first one after, before any), kept
within the heuristic's bounds (never above its upper bound, which only counts zeros that may have
underflowed: a tensor whose values do not reach the cut-off loses no more than the estimate says,
whatever its zeros do). Where the measurement found no line underflowed and lines held most of
the structure, lines are structure at every step (a unit that dies later is not underflow).

**What underflowed, by magnitude** (:class:`Tails`): the measured steps' ``underflow_hist`` says
how far below the cut-off the lost elements lay, which a prediction at a higher scale reads
(:class:`~ampdoctor.analysis.underflow.UnderflowModel`'s tail), rounding noise apart.

**Between samples** (:class:`Samples`) only the peak and the norm of each gradient are recorded.
A light step takes its tensor's latest sampled figures (their calibrated underflow, structure and
histogram) with the magnitudes moved by the drift of that tensor's own norm since then:
``log2(l2 / l2 at the sample)``; gradients that shrank by 2^4 lose below the cut-off what the
sample's lost 4 binades higher (:class:`~ampdoctor.analysis.underflow.UnderflowModel`). The zeros
of the step are the sample's structural zeros plus what it loses. A gradient computed from output
gradients that underflowed upstream loses more than its own histogram shows: the loss at
:data:`DRIFT_RANGE` times the drift is the other end of the step's range.

**Limits.** A tensor whose structure changes between its measurement and a sampled step (a dead
unit revived, other embedding rows unused by another batch) moves the estimate by the change; the
upper bound still holds every zero that may have underflowed, and the lower end of the range
(:func:`calibrated_low`) lets the change be structure. Between samples one factor (the
norm's drift) moves a tensor's whole histogram: a tensor whose small values drift apart from its
norm is misjudged there. Each figure says how far it is from a measurement (``measure_distance``,
in steps).

Keys are (layer, rank): structure is per tensor and per rank (a rank's data); a layer never
measured has a negative layer id here. Everything here is
numpy on arrays of rows; nothing reads the run (the caller streams it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .underflow import UnderflowModel, cumulative_below

RANK_BITS = 20  # key = layer id << RANK_BITS | rank
DRIFT_RANGE = 3.0  # between samples, the small values may drift up to this many times the norm's drift
MAX_PENDING_ROWS = 1 << 20  # light rows held until their tensor's first sample (a resumed run's first steps)


def keys(layer: np.ndarray, rank: np.ndarray) -> np.ndarray:
    return (np.asarray(layer, dtype=np.int64) << RANK_BITS) | np.asarray(rank, dtype=np.int64)


class Measurements:
    """Every measured step's structural share per key: read in a first, narrow pass over the run
    (:meth:`add` per batch of measured rows), then looked up for each estimated row."""

    def __init__(self, bins: int = 0) -> None:
        self.bins = bins
        self._parts: list[pd.DataFrame] = []
        # The rows' underflow_hist, kept only where something underflowed (most tensors lose nothing
        # at a sane scale): (the rows' positions among all rows added, their histograms).
        self._hists: list[tuple[np.ndarray, np.ndarray]] = []
        self._rows = 0
        self._points: pd.DataFrame | None = None
        self._table: tuple | None = None  # (points, its columns as arrays) for nearest()
        self._hist: np.ndarray = np.zeros((1, bins), dtype=np.float32)  # per (key, step) that lost: summed; row 0 zeros

    def add(self, key: np.ndarray, step: np.ndarray, n_zero: np.ndarray, n_underflow: np.ndarray,
            numel: np.ndarray, n_zero_lines: np.ndarray | None = None, hist: np.ndarray | None = None,
            l2: np.ndarray | None = None) -> None:
        """Measured rows: their zeros, their measured underflow, their elements and the zeros in
        all-zero lines (NaN or None: not recorded); their ``underflow_hist`` (a row of NaN, or
        None: not recorded) and norm."""
        if len(key):
            self._points = None  # (computed anew on the next look-up)
            n = len(key)
            lines = np.full(n, np.nan) if n_zero_lines is None else np.asarray(n_zero_lines, dtype=np.float64)
            hist = np.full((n, self.bins), np.nan) if hist is None else np.asarray(hist, dtype=np.float64)
            l2 = np.full(n, np.nan) if l2 is None else np.asarray(l2, dtype=np.float64)
            self._parts.append(pd.DataFrame({"key": key, "step": np.asarray(step, dtype=np.int64),
                                             "structure": np.maximum(n_zero - n_underflow, 0.0),
                                             "lost": np.asarray(n_underflow, dtype=np.float64),
                                             # zeros outside lines that did not underflow: negative
                                             # when lines underflowed too (upstream)
                                             "scattered": n_zero - np.nan_to_num(lines, nan=np.inf) - n_underflow,
                                             "numel": np.asarray(numel, dtype=np.float64),
                                             # rows without a histogram (their group has none) and norms
                                             "no_hist": np.isnan(hist).any(axis=1).astype(np.float64)
                                             if hist.shape[1] else np.ones(n),
                                             "l2sq": np.square(l2)}))
            hist = np.nan_to_num(hist)
            lost = np.nonzero(hist.any(axis=1))[0] if hist.shape[1] else np.zeros(0, dtype=np.int64)
            self._hists.append((self._rows + lost, hist[lost].astype(np.float32)))
            self._rows += n

    @property
    def points(self) -> pd.DataFrame:
        """Per (key, measured step): the structural share of its elements, sorted by step."""
        if self._points is None:
            if self._parts:
                rows = pd.concat(self._parts)
                grouped = rows.groupby(["key", "step"])
                frame = grouped.sum().reset_index()
                group = grouped.ngroup().to_numpy()
                at = np.concatenate([p for p, _ in self._hists])
                lost = np.unique(group[at])  # the groups that lost something, each a histogram row
                hist = np.zeros((len(lost) + 1, self.bins), dtype=np.float32)
                if len(at):
                    np.add.at(hist, 1 + np.searchsorted(lost, group[at]), np.concatenate([h for _, h in self._hists]))
                self._hist = hist
                frame["_h"] = 0
                frame.loc[lost, "_h"] = 1 + np.arange(len(lost))
                frame["share"] = frame["structure"] / frame["numel"].where(frame["numel"] > 0)
                # Where no line underflowed (the measured underflow fits in the scattered zeros)
                # and lines hold most of the structure, lines are structure at any step (dead
                # units, unused rows, masked or ignored positions) and the scattered
                # structure is what carries: a unit that dies later is not read as underflow.
                # (A ReLU's scattered mask makes lines only by chance: not those.)
                lines = frame["structure"] - frame["scattered"]
                lines_structural = (np.isfinite(frame["scattered"]) & (frame["scattered"] >= 0)
                                    & (lines >= np.maximum(1.0, frame["structure"] / 2)))
                frame["scattered_share"] = np.where(lines_structural, frame["scattered"], np.nan) / frame["numel"].where(
                    frame["numel"] > 0)
                frame["lost_share"] = frame["lost"] / frame["numel"].where(frame["numel"] > 0)
                self._parts = [frame[["key", "step", "structure", "lost", "scattered", "numel", "no_hist", "l2sq"]]]
                self._hists, self._rows = [(lost, hist[1:])], len(frame)
                self._points = frame.dropna(subset=["share"]).sort_values("step", kind="stable")
            else:
                self._points = pd.DataFrame({"key": pd.Series([], dtype=np.int64),
                                             "step": pd.Series([], dtype=np.int64),
                                             "share": pd.Series([], dtype=np.float64)})
                self._hist = np.zeros((0, self.bins), dtype=np.float32)
        return self._points

    def __bool__(self) -> bool:
        return bool(self._parts) or (self._points is not None and len(self._points) > 0)

    def nearest(self, key: np.ndarray, step: np.ndarray) -> "Nearest":
        """Per row, the nearest measurement of its key at or before its step, or the first after
        it before any (NaN where its key was never measured)."""
        n = len(key)
        out = Nearest(*(np.full(n, np.nan) for _ in range(5)), hist=np.zeros((n, self.bins), dtype=np.float32))
        points = self.points
        if not n or not len(points):
            return out
        if self._table is None or self._table[0] is not points:
            self._table = (points, {c: points[c].to_numpy() for c in ("key", "step", "share", "scattered_share",
                                                                       "lost_share", "no_hist", "l2sq", "numel", "_h")})
        table = self._table[1]
        key, step = np.asarray(key, dtype=np.int64), np.asarray(step, dtype=np.int64)
        # The latest measurement of the key at or before the step, else the first after it (as
        # pandas' merge_asof by key, backward then forward): one row per (key, step) in ``points``.
        found = _as_of(table, key, step, backward=True)
        ahead = np.flatnonzero(found < 0)
        found[ahead] = _as_of(table, key[ahead], step[ahead], backward=False)
        i = np.flatnonzero(found >= 0)
        got = {c: v[found[i]] for c, v in table.items()}
        out.share[i] = got["share"]
        out.scattered[i] = got["scattered_share"].astype(np.float64)
        out.lost[i] = got["lost_share"].astype(np.float64)
        out.distance[i] = np.abs(step[i] - got["step"])
        with_hist = got["no_hist"] == 0
        # Per element: a module called twice in a step, or with several outputs, has as many
        # rows (summed here) as the estimated step has, each compared on its own.
        numel = np.maximum(got["numel"].astype(np.float64), 1.0)
        out.rms[i] = np.where(with_hist, np.sqrt(got["l2sq"].astype(np.float64) / numel), np.nan)
        out.hist[i] = self._hist[got["_h"].astype(np.int64)] / numel[:, None].astype(np.float32)
        return out


@dataclass
class Nearest:
    """What :meth:`Measurements.nearest` finds per row: the measurement's structural share of the
    elements; its scattered structural share (NaN where lines underflowed there); the share that
    underflowed; the distance in steps; the gradient's root mean square then (NaN where its
    ``underflow_hist`` was not recorded) and that ``underflow_hist`` per element (float32)."""

    share: np.ndarray
    scattered: np.ndarray
    lost: np.ndarray
    distance: np.ndarray
    rms: np.ndarray
    hist: np.ndarray


def calibrated(n_zero: np.ndarray, numel: np.ndarray, share: np.ndarray, estimate: np.ndarray,
               upper: np.ndarray, scattered: np.ndarray | None = None,
               n_zero_lines: np.ndarray | None = None) -> np.ndarray:
    """The underflow of estimated rows whose tensor was measured (``share``: its structural share,
    NaN where none): the zeros less that share of the elements, within [0, the upper bound];
    elsewhere ``estimate``. Where the measurement found no line underflowed (``scattered``: its
    scattered structural share, else NaN) and the row's lines are recorded, its lines are
    structure and only its scattered zeros less that share can have underflowed."""
    cal = n_zero - share * numel
    if scattered is not None and n_zero_lines is not None:
        lines = np.asarray(n_zero_lines, dtype=np.float64)
        by_lines = ~np.isnan(scattered) & ~np.isnan(lines)
        cal = np.where(by_lines, n_zero - np.nan_to_num(lines) - np.nan_to_num(scattered) * numel, cal)
    cal = np.clip(cal, 0.0, np.nan_to_num(upper, nan=0.0))
    return np.where(np.isnan(share), estimate, cal)


def still_lost(hist: np.ndarray, min_exp: int, cut_log2: np.ndarray, drift_log2: np.ndarray) -> np.ndarray:
    """Per row: the elements its measurement lost (``hist``: that ``underflow_hist``) that a
    cut-off of 2^``cut_log2`` loses still after the gradient's norm moved by ``drift_log2``
    binades, at the least: a growing gradient's small values taken to grow :data:`DRIFT_RANGE`
    times as fast, a shrinking one's not to shrink; only the binades wholly below count. NaN where
    the drift is unknown."""
    shift = np.maximum(0.0, DRIFT_RANGE * np.asarray(drift_log2, dtype=np.float64))
    edge = min_exp + np.arange(1, hist.shape[1] + 1)  # each bin's upper edge (log2)
    count = np.where(edge[None, :] <= (np.asarray(cut_log2, dtype=np.float64) - shift)[:, None], hist, 0.0).sum(axis=1)
    return np.where(np.isnan(shift), np.nan, count)


def calibrated_low(numel: np.ndarray, cal: np.ndarray, heuristic: np.ndarray, lost: np.ndarray,
                   still: np.ndarray | None = None) -> np.ndarray:
    """The lower end of a calibrated row's range. Its point (``cal``) counts every zero its tensor
    gained since the measurement as underflow, but structure changes too (other positions ignored
    in this batch, a unit that died): the lower end is the lesser of that point and what the
    measurement lost that is lost still (``still``: :func:`still_lost`). Without the
    measurement's ``underflow_hist`` (``still`` NaN or None), the least of the point, the
    heuristic's estimate from the row's own magnitudes (``heuristic``, NaN: unknown) and the
    measurement's underflowed share ``lost`` of the row's elements."""
    without = np.fmin(np.fmin(cal, heuristic), lost * numel)
    if still is None:
        return without
    return np.where(np.isnan(still), without, np.fmin(cal, np.nan_to_num(still)))


NOISE_LOG2 = -24  # a lost element below its gradient's peak times 2^-24 is float32 rounding noise


def lost_below(hist: np.ndarray, peak: np.ndarray, min_exp: int) -> np.ndarray:
    """Per row of ``underflow_hist``: the lost elements in the binades wholly below ``peak`` times
    2^:data:`NOISE_LOG2` (rounding noise of sums of terms that size; none where ``peak`` is 0 or
    NaN). A measured module output gradient, whose terms are of its own size, leaves out those
    below its own peak (the first query position's gradient in causal attention is exactly 0 in
    float32 from float32 activations, and ~2^-30 of its peak in the shadow of half-precision ones)."""
    peak = np.nan_to_num(np.asarray(peak, dtype=np.float64), nan=0.0)
    with np.errstate(divide="ignore"):
        floor = np.where(peak > 0, np.floor(np.log2(np.where(peak > 0, peak, 1.0))) + NOISE_LOG2, -np.inf)
    edge = min_exp + np.arange(1, hist.shape[1] + 1)  # each bin's upper edge (log2)
    return np.where(edge[None, :] <= floor[:, None], hist, 0.0).sum(axis=1)


class Tails:
    """Per measured step, what underflowed in its parameter gradients by magnitude (their
    ``underflow_hist`` summed). Tiny lost values may be rounding noise, not gradient: an element
    lost below its gradient's peak times 2^:data:`NOISE_LOG2` is below float32's resolution of a
    sum of terms that size (the shadow computed it from half-precision saved values; a float32
    reference backward gives it no better, and the truth calls such elements undecided). Below the
    step's largest peak times 2^:data:`NOISE_LOG2` an element *may* be noise (a mathematically
    zero gradient, such as a bias before a BatchNorm, is noise whatever its own peak): the lower
    tail counts it as noise, the upper one as gradient. Memory: per measured step, one histogram
    per binade of the gradients' peaks."""

    def __init__(self, bins: int, min_exp: int) -> None:
        self.bins, self.min_exp = bins, min_exp
        self._hists: dict[tuple[int, int], np.ndarray] = {}   # (step, floor of log2 peak) -> summed histogram
        self._top: dict[int, float] = {}                      # step -> largest peak
        self._cut: dict[int, float] = {}                      # step -> its cut-off (log2)

    def add(self, step: np.ndarray, hist: np.ndarray, amax: np.ndarray, cut_log2: np.ndarray) -> None:
        """Measured parameter-gradient rows: their ``underflow_hist``, (unscaled) peak and cut-off."""
        with np.errstate(divide="ignore", invalid="ignore"):
            floor = np.floor(np.log2(np.where(amax > 0, amax, np.nan)))
        floor = np.nan_to_num(floor, nan=-(1 << 30)).astype(np.int64)
        step = np.asarray(step, dtype=np.int64)
        if not len(step):
            return
        # (grouped by step, then floor, rows in their order within each: as pandas' groupby)
        order = np.lexsort((floor, step))
        s, f = step[order], floor[order]
        starts = np.flatnonzero(np.concatenate([[True], (s[1:] != s[:-1]) | (f[1:] != f[:-1])]))
        sums = np.add.reduceat(np.asarray(hist, dtype=np.float64)[order], starts, axis=0)
        for i, at in enumerate(starts):
            key = (int(s[at]), int(f[at]))
            self._hists[key] = self._hists.get(key, 0.0) + sums[i]
        # (per step, rows in their order: the first cut-off that is a number, as pandas' first)
        order = np.argsort(step, kind="stable")
        s = step[order]
        by_step = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1]]))
        top = np.maximum.reduceat(np.nan_to_num(np.asarray(amax, dtype=np.float64), nan=0.0)[order], by_step)
        cut = np.asarray(cut_log2, dtype=np.float64)[order]
        for i, at in enumerate(by_step):
            t = int(s[at])
            self._top[t] = max(self._top.get(t, 0.0), float(top[i]))
            end = by_step[i + 1] if i + 1 < len(by_step) else len(s)
            known = cut[at:end][~np.isnan(cut[at:end])]
            self._cut.setdefault(t, float(known[0]) if len(known) else float("nan"))

    def maybe_noise(self, step: np.ndarray, hist: np.ndarray) -> np.ndarray:
        """Per measured parameter-gradient row (its step, its ``underflow_hist``): the lost
        elements that may be rounding noise, below its step's largest peak times
        2^:data:`NOISE_LOG2` (what the lower tail counts as noise). A measured figure's range
        leaves them out at its lower end."""
        top = np.array([self._top.get(int(t), 0.0) for t in step], dtype=np.float64)
        return lost_below(hist, top, self.min_exp)

    def frame(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(the measured steps, by step; their ``tail`` and ``noise`` as the lower figures read
        them, ``tail_hi`` and ``noise_hi`` as the upper ones do, and each one's ``cut``)."""
        steps = np.array(sorted(self._top), dtype=np.int64)
        if not len(steps):
            return steps, {}
        edge = self.min_exp + np.arange(1, self.bins + 1)  # each bin's upper edge (log2)
        index = {int(t): i for i, t in enumerate(steps)}
        out = {"tail": np.zeros((len(steps), self.bins)), "noise": np.zeros(len(steps)),
               "tail_hi": np.zeros((len(steps), self.bins)), "noise_hi": np.zeros(len(steps)),
               "cut": np.array([self._cut[int(t)] for t in steps])}
        for (t, f), hist in self._hists.items():
            i, top = index[t], self._top[t]
            own = f + NOISE_LOG2                         # a bin wholly below is noise
            step_floor = np.floor(np.log2(top)) + NOISE_LOG2 if top > 0 else -np.inf
            noise = edge <= own
            maybe = (edge <= step_floor) & ~noise        # below the step's floor only
            clean = ~noise & ~maybe
            out["tail"][i] += np.where(clean, hist, 0.0)
            out["noise"][i] += np.where(~clean, hist, 0.0).sum()
            out["tail_hi"][i] += np.where(~noise, hist, 0.0)
            out["noise_hi"][i] += np.where(noise, hist, 0.0).sum()
        return steps, out


class Samples:
    """Per key, the latest sampled step's figures, carried to the light rows after it (streamed in
    each rank's step order; light rows before their key's first sample wait for it).

    Numpy on columns (a dict of arrays per table): at the default cadence 99 rows in 100 are light,
    so this runs on nearly every row of a run; no frame per batch."""

    def __init__(self, bins: int, min_exp: int) -> None:
        self.bins, self.min_exp = bins, min_exp
        self._last: dict | None = None               # one row per key: its latest sample before this batch
        self._buffer = np.zeros((64, bins + 1), dtype=np.uint32)  # row i: the histogram cumsum of sample i,
        self._rows = 0                               # of the first _rows (_store)
        self._batch: dict | None = None              # the samples of the batch being read
        self._first: dict | None = None              # one row per key: its first sample (for rows before it)
        self._pending: list[dict] = []
        self._pending_rows = 0
        self.dropped = 0                             # light rows that found no sample (beyond MAX_PENDING_ROWS)

    def add_samples(self, key, step, cumsum, cut, lost, n_zero, undecided, l2, numel) -> None:
        """Full, judged rows of one batch (a step's several rows of one key are summed); called for
        every batch, before :meth:`carry`. The previous batch's samples become the latest ones
        before this batch."""
        if self._batch is not None:
            self._last = self._batch if self._last is None else _per_key(_concat([self._last, self._batch]), last=True)
        self._batch = None
        if not len(key):
            return
        merged, sums = _merged_samples(np.asarray(key, dtype=np.int64), np.asarray(step, dtype=np.int64),
                                       {"cut": cut, "lost": lost, "n_zero": n_zero, "undecided": undecided,
                                        "l2sq": np.square(l2), "numel": numel}, cumsum, self.bins)
        merged["_c"] = self._store(sums) + np.arange(len(merged["key"]))
        # (what the sample's recorded magnitudes hold below its cut-off: per sample, not per row)
        merged["below_cut"] = cumulative_below(sums, merged["cut"] + 1.0, self.min_exp)
        self._batch = merged
        first = _per_key(merged, last=False)
        self._first = first if self._first is None else _per_key(_concat([self._first, first]), last=False)

    def _store(self, sums: np.ndarray) -> int:
        """Append cumsums to the buffer; returns the row of the first. Out of room, the rows no
        sample points at any more are dropped first, and the buffer is then at most twice what
        is kept and added (memory: about four cumsums per tensor and rank). Integer counts below
        2^32 are held as uint32 (half the memory; read back exactly), others as float64."""
        if self._rows + len(sums) > len(self._buffer):
            self._compact()
            if self._rows + len(sums) > len(self._buffer):
                grown = np.zeros((max(64, 2 * (self._rows + len(sums))), self.bins + 1), dtype=self._buffer.dtype)
                grown[:self._rows] = self._buffer[:self._rows]
                self._buffer = grown
        if self._buffer.dtype != np.float64 and len(sums) and not (
                (sums >= 0).all() and (sums < 2.0**32).all() and (sums == np.floor(sums)).all()):
            self._buffer = self._buffer.astype(np.float64)
        start = self._rows
        self._buffer[start:start + len(sums)] = sums
        self._rows += len(sums)
        return start

    def _compact(self) -> None:
        """Keep only the cumsums the samples still point at (the latest of each key, the first)."""
        tables = [t for t in (self._last, self._batch, self._first) if t is not None]
        keep = np.unique(np.concatenate([t["_c"] for t in tables])) if tables else np.zeros(0, dtype=np.int64)
        if len(keep) == self._rows:
            return
        remap = np.full(self._rows, -1)
        remap[keep] = np.arange(len(keep))
        self._buffer[:len(keep)] = self._buffer[keep]  # (rows move down: a copy of the kept ones only)
        self._rows = len(keep)
        self._last, self._batch, self._first = (
            None if t is None else {**t, "_c": remap[t["_c"]]} for t in (self._last, self._batch, self._first))

    @property
    def _cumsum(self) -> np.ndarray:
        return self._buffer[:self._rows]

    def carry(self, key, step, l2, numel, cut) -> tuple[np.ndarray, ...]:
        """Light rows (one per key and step; ``cut``: log2 of each one's cut-off): (step, lost,
        lost at the other end of the drift's range, zeros, undecided) of the rows answered, held
        ones of earlier calls included. Each takes its key's latest sample at or before its step
        (the first after it, before any); a row whose key has no sample yet waits for one."""
        rows = {"key": np.asarray(key, dtype=np.int64), "step": np.asarray(step, dtype=np.int64),
                "l2": np.asarray(l2, dtype=np.float64), "numel": np.asarray(numel, dtype=np.float64),
                "cutq": np.asarray(cut, dtype=np.float64)}
        if self._pending:
            rows = _concat([*self._pending, rows])
            self._pending, self._pending_rows = [], 0
        empty = np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0)
        parts = [t for t in (self._last, self._batch) if t is not None]
        if not parts or not len(rows["key"]):
            self._hold(rows)
            return empty
        # (in the rows' order: the per-step sums add each step's rows in it, answered ones first)
        table = _dedup_last(_concat(parts))
        found = _as_of(table, rows["key"], rows["step"], backward=True)
        missing = found < 0
        if missing.any():
            # Before the key's first sample: that sample (the first after the row).
            ahead_rows = _take(rows, np.flatnonzero(missing))
            ahead = _as_of(self._first, ahead_rows["key"], ahead_rows["step"], backward=False)
            held = ahead < 0
            self._hold(_take(ahead_rows, np.flatnonzero(held)))
            answered = np.flatnonzero(~missing)
            rows = _concat([_take(rows, answered), _take(ahead_rows, np.flatnonzero(~held))])
            table = _concat([table, self._first])
            found = np.concatenate([found[answered], len(table["key"]) - len(self._first["key"]) + ahead[~held]])
        return (rows["step"], *self._evaluate(rows, table, found))

    def _evaluate(self, rows: dict, table: dict, found: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The light ``rows``' figures, each from its sample (row ``found`` of ``table``)."""
        # (what depends on the sample alone, per sample: a few hundred of them, then each row's)
        numel_s = np.maximum(table["numel"].astype(float), 1.0)
        lost_s = table["lost"].astype(float)
        undecided = table["undecided"].astype(float)
        structure = np.maximum(table["n_zero"].astype(float) - lost_s - undecided, 0.0)
        numel_s, l2s, lost_s, cut_s, below_cut, c, structure, undecided = (
            v[found] for v in (numel_s, np.sqrt(table["l2sq"].astype(float)), lost_s, table["cut"].astype(float),
                               table["below_cut"], table["_c"].astype(np.int64), structure, undecided))
        ratio = rows["numel"] / numel_s
        with np.errstate(divide="ignore", invalid="ignore"):
            drift = np.log2(rows["l2"] / l2s)
        drift = np.where(np.isfinite(drift), drift, 0.0)  # a zero or non-finite norm: no drift to read
        model = UnderflowModel(None, cut_s, lost_s, self.min_exp, cumsum=self._cumsum, cumsum_rows=c,
                               below_cut=below_cut)
        # No more lost than the sample's elements that are not structure.
        cut = rows["cutq"]
        # The small values may move faster than the norm, either way: a gradient computed from
        # output gradients that underflowed upstream loses (or, growing, regains) elements its own
        # histogram does not show. The loss at DRIFT_RANGE times the drift is the range's other end.
        at = lambda d: np.clip(model.lost(cut - d), 0.0, numel_s - structure)  # noqa: E731
        one, two = at(drift), at(DRIFT_RANGE * drift)
        lost, lost_hi = np.minimum(one, two), np.maximum(one, two)
        return lost * ratio, lost_hi * ratio, (structure + undecided + lost) * ratio, undecided * ratio

    def _hold(self, rows: dict) -> None:
        n = len(rows["key"])
        if not n:
            return
        if self._pending_rows + n > MAX_PENDING_ROWS:
            self.dropped += n  # (their steps count nothing for them: docs/numerics.md)
            return
        self._pending.append(rows)
        self._pending_rows += n

    def finish(self) -> tuple[np.ndarray, ...]:
        """The held light rows, answered by whatever samples were read (after the last batch)."""
        return self.carry(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0))

    @property
    def unanswered(self) -> int:
        """Light rows that count nothing: beyond :data:`MAX_PENDING_ROWS`, or (after :meth:`finish`)
        of a tensor never sampled (a parameter that got gradients on light steps only)."""
        return self.dropped + self._pending_rows


def _concat(tables: list[dict]) -> dict:
    return {c: np.concatenate([t[c] for t in tables]) for c in tables[0]}


def _take(table: dict, index: np.ndarray) -> dict:
    return {c: v[index] for c, v in table.items()}


def _per_key(table: dict, last: bool) -> dict:
    """Each key's row of the largest step (``last``; of equal steps the later row) or of the
    smallest (the earlier row), in the order of the table sorted by step (stable)."""
    order = np.argsort(table["step"], kind="stable")
    keys_sorted = table["key"][order]
    if last:
        _, first_reversed = np.unique(keys_sorted[::-1], return_index=True)
        chosen = len(keys_sorted) - 1 - first_reversed
    else:
        _, chosen = np.unique(keys_sorted, return_index=True)
    return _take(table, order[np.sort(chosen)])


def _dedup_last(table: dict) -> dict:
    """The table less rows whose (key, step) a later row repeats (the later one stands)."""
    n = len(table["key"])
    order = np.lexsort((np.arange(n), table["step"], table["key"]))  # by key, step, then row
    key, step = table["key"][order], table["step"][order]
    last = np.ones(n, dtype=bool)  # the last row of each (key, step)
    last[:-1] = (key[1:] != key[:-1]) | (step[1:] != step[:-1])
    if last.all():
        return table
    return _take(table, np.sort(order[last]))


def _as_of(table: dict, key: np.ndarray, step: np.ndarray, backward: bool) -> np.ndarray:
    """Per (key, step): the row of ``table`` (one per (key, step)) of the same key with the largest
    step at or before it (``backward``), or the smallest at or after it; -1 where none."""
    out = np.full(len(key), -1, dtype=np.int64)
    if not len(key) or not len(table["key"]):
        return out
    t_key, t_step = table["key"], table["step"]
    base = int(t_step.min())
    span = int(t_step.max()) - base + 2
    if t_key.min() >= 0 and int(t_key.max()) < (1 << 62) // span:
        q = None
        if key.min() < 0 or key.max() > t_key.max():
            q = np.flatnonzero((key >= 0) & (key <= t_key.max()))  # (no other key is in the table)
            key, step = key[q], step[q]
        # Keys and steps as one code (key x span + step offset; a query's offset clipped to
        # [-1, span - 1], which no row's reaches): one sort, one search.
        code = t_key * span + (t_step - base)
        order = np.argsort(code, kind="stable")
        code = code[order]
        query = key * span + np.clip(step - base, -1, span - 1)
        if backward:
            pos = np.searchsorted(code, query, side="right") - 1
            ok = pos >= 0
        else:
            pos = np.searchsorted(code, query, side="left")
            ok = pos < len(code)
        row = order[np.clip(pos, 0, len(code) - 1)]
        found = np.where(ok & (t_key[row] == key), row, -1)
        if q is None:
            return found
        out[q] = found
        return out
    known = np.unique(table["key"])
    dense_t = np.searchsorted(known, table["key"])
    dense_q = np.searchsorted(known, key)
    present = (dense_q < len(known)) & (known[np.minimum(dense_q, len(known) - 1)] == key)
    order = np.lexsort((table["step"], dense_t))  # by key, then step
    k_sorted, s_sorted = dense_t[order], table["step"][order]
    starts = np.searchsorted(k_sorted, np.arange(len(known)), side="left")
    ends = np.searchsorted(k_sorted, np.arange(len(known)), side="right")
    q = np.flatnonzero(present)
    kq = dense_q[q]
    # Within each key's run of steps (sorted), a search offset by the run's start.
    lo, hi = starts[kq], ends[kq]
    span = s_sorted.max() - s_sorted.min() + 2 if len(s_sorted) else 1
    base = s_sorted.min()
    code = dense_t[order].astype(np.int64) * span + (s_sorted - base)
    target = np.clip(step[q] - base, -1, span - 1)
    codes_q = kq.astype(np.int64) * span + target
    if backward:
        pos = np.searchsorted(code, codes_q, side="right") - 1
        ok = pos >= lo
    else:
        pos = np.searchsorted(code, codes_q, side="left")
        ok = pos < hi
    out[q[ok]] = order[pos[ok]]
    return out


def _merged_samples(key: np.ndarray, step: np.ndarray, values: dict, cumsum: np.ndarray,
                    bins: int) -> tuple[dict, np.ndarray]:
    """The rows of each (key, step) summed (``cut``: the first non-missing), in the order the pairs
    first appear; and their cumsums summed. As pandas' ``groupby(sort=False)`` sums (its
    compensated sums, NaN as nothing): a pair of one row is that row; others go through pandas."""
    order = np.lexsort((step, key))
    repeated = ((key[order][1:] == key[order][:-1]) & (step[order][1:] == step[order][:-1])).any()
    finite = all(np.isfinite(np.asarray(v, dtype=np.float64)[~np.isnan(np.asarray(v, dtype=np.float64))]).all()
                 for v in values.values())
    if not repeated and finite:  # (then the pairs appear in the rows' order)
        merged = {"key": key, "step": step, "cut": np.asarray(values["cut"], dtype=np.float64)}
        for c in ("lost", "n_zero", "undecided", "l2sq", "numel"):
            v = np.asarray(values[c], dtype=np.float64)
            merged[c] = np.where(np.isnan(v), 0.0, v) + 0.0  # (pandas' sum of one: 0 for NaN, +0 for -0)
        return merged, np.zeros((len(key), bins + 1)) + cumsum
    frame = pd.DataFrame({"key": key, "step": step, **{c: values[c] for c in values}})
    grouped = frame.groupby(["key", "step"], sort=False)
    agg = grouped.agg(cut=("cut", "first"), lost=("lost", "sum"), n_zero=("n_zero", "sum"),
                      undecided=("undecided", "sum"), l2sq=("l2sq", "sum"), numel=("numel", "sum")).reset_index()
    sums = np.zeros((len(agg), bins + 1))
    np.add.at(sums, grouped.ngroup().to_numpy(), cumsum)
    return {c: agg[c].to_numpy() for c in agg.columns}, sums


