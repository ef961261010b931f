"""The passes that :mod:`ampdoctor.analysis.fp8` predicts from: a run's GEMM operand rows
(``schema.GEMM_KINDS``) gathered per (layer, row kind) into *passes*, one per (step, call) in that
order, each with its amax and, on module-sampled steps, its fine histogram
(:mod:`ampdoctor.stats.fine_hist`). Several ranks make one pass of the largest amax and the summed
counts, as TransformerEngine reduces the amax over ranks. No torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..run_file.schema import FINE_BINS, GEMM_KINDS

INPUT, WEIGHT, GRAD = GEMM_KINDS
COLUMNS = ["step", "rank", "kind", "name", "call", "amax", "fine_hist"]


@dataclass
class Passes:
    """Every (layer, row kind)'s passes, concatenated: sequence ``s`` holds the passes
    ``starts[s]:starts[s + 1]`` in (step, call) order, each the rows of one (step, call) over the
    ranks (a weight: one per step). The passes ``sampled`` (ascending) have fine histograms:
    :meth:`histograms` sums their ranks' rows when asked, a chunk at a time, so that a long run's
    histograms are not all copied at once."""

    layer: list[str]          # per sequence
    kind: list[str]           # per sequence
    starts: np.ndarray        # int64 [S + 1]
    step: np.ndarray          # int64 [N]
    call: np.ndarray          # int64 [N], -1 where the row did not say
    amax: np.ndarray          # float64 [N]: NaN if a rank's tensor held a NaN, else inf if an inf, else max |x|
    sampled: np.ndarray       # int64 [M]
    ranks: int
    calls_per_step: np.ndarray  # int64 [S]: the most passes of the sequence in one step
    _hists: np.ndarray        # object: the frame's fine_hist column
    _sources: np.ndarray      # int64: rows of _hists, sampled pass by sampled pass ...
    _offsets: np.ndarray      # int64 [M + 1]: ... pass j's rows at _sources[_offsets[j]:_offsets[j + 1]]

    def sequences(self, kind: str) -> list[int]:
        return [s for s, k in enumerate(self.kind) if k == kind]

    def histograms(self, j0: int, j1: int) -> np.ndarray:
        """float64 [j1 - j0, FINE_BINS]: the rank-summed histograms of sampled passes j0..j1-1."""
        if j1 <= j0:
            return np.zeros((0, FINE_BINS))
        a, b = self._offsets[j0], self._offsets[j1]
        stacked = np.stack([np.asarray(self._hists[i], dtype=np.float64) for i in self._sources[a:b]])
        return np.add.reduceat(stacked, self._offsets[j0:j1] - a, axis=0)


def gemm_passes(frame: pd.DataFrame) -> Passes | None:
    """The passes of the GEMM rows of ``frame`` (columns :data:`COLUMNS`; ``fine_hist`` a list or
    array per row, or None), or None when it has none."""
    rows = frame[frame["kind"].isin(GEMM_KINDS)]
    if not len(rows):
        return None
    n = len(rows)
    names, name_codes = _codes(rows["name"])
    kinds, kind_codes = _codes(rows["kind"])
    kind_codes = np.array([GEMM_KINDS.index(k) for k in kinds], dtype=np.int64)[kind_codes]
    step = rows["step"].to_numpy(dtype=np.int64)
    rank = rows["rank"].to_numpy(dtype=np.int64) if "rank" in rows else np.zeros(n, np.int64)
    call = (pd.to_numeric(rows["call"]).fillna(-1).to_numpy(dtype=np.int64) if "call" in rows
            else np.full(n, -1, np.int64))
    # (a null amax reads as NaN: not clipped, never a window's maximum)
    amax = pd.to_numeric(rows["amax"]).to_numpy(dtype=np.float64, na_value=np.nan)
    hists = rows["fine_hist"].to_numpy(dtype=object) if "fine_hist" in rows else np.full(n, None, object)

    # Sequences kind-major, so that those of one kind lie together (cells() takes them in chunks).
    seq = kind_codes * len(names) + name_codes
    # A weight is one pass per step (its rows say the layer's first call, which ranks need not share).
    pass_call = np.where(kind_codes == GEMM_KINDS.index(WEIGHT), -1, call)
    order = np.lexsort((rank, pass_call, step, seq))
    seq, step, pass_call, call, amax = seq[order], step[order], pass_call[order], call[order], amax[order]
    new = np.ones(n, dtype=bool)
    new[1:] = (seq[1:] != seq[:-1]) | (step[1:] != step[:-1]) | (pass_call[1:] != pass_call[:-1])
    first = np.flatnonzero(new)
    group = np.cumsum(new) - 1
    if len(first) == n:  # one row per pass (one rank): nothing to reduce
        pass_amax, pass_call_min = amax, call
    else:
        # np.maximum propagates NaN: a pass is NaN if any rank's tensor held one, else inf if any did
        pass_amax = np.maximum.reduceat(amax, first)
        known = np.where(call >= 0, call, np.iinfo(np.int64).max)
        pass_call_min = np.minimum.reduceat(known, first)
        pass_call_min = np.where(pass_call_min == np.iinfo(np.int64).max, -1, pass_call_min)

    # The histograms: summed over the ranks that sampled the pass (all of them on module-sampled
    # steps, which every rank shares; the shares are then those of the elements counted).
    with_hist = np.flatnonzero(pd.notna(hists))
    with_hist = with_hist[[len(hists[i]) == FINE_BINS for i in with_hist]]  # (another length: not read)
    sorted_at = np.empty(n, np.int64)
    sorted_at[order] = np.arange(n)
    rows_with = np.sort(sorted_at[with_hist])    # their places in the sorted rows
    g = group[rows_with]
    offsets = np.flatnonzero(np.r_[True, g[1:] != g[:-1]]) if len(g) else np.zeros(0, np.int64)
    sampled = g[offsets]

    pass_seq = seq[first]
    seq_first = np.flatnonzero(np.r_[True, pass_seq[1:] != pass_seq[:-1]])
    starts = np.r_[seq_first, len(first)].astype(np.int64)
    pass_step = step[first]
    # The most passes of a sequence in one step: the longest run of one step within it.
    step_first = np.flatnonzero(np.r_[True, (pass_seq[1:] != pass_seq[:-1]) | (pass_step[1:] != pass_step[:-1])])
    per_step = np.diff(np.r_[step_first, len(first)])
    calls_per_step = np.maximum.reduceat(per_step, np.searchsorted(step_first, seq_first))
    codes = pass_seq[seq_first]
    return Passes(layer=[names[c % len(names)] for c in codes],
                  kind=[GEMM_KINDS[c // len(names)] for c in codes],
                  starts=starts, step=pass_step, call=pass_call_min, amax=pass_amax,
                  sampled=sampled.astype(np.int64), ranks=int(pd.Series(rank).nunique()),
                  calls_per_step=calls_per_step, _hists=hists, _sources=order[rows_with],
                  _offsets=np.r_[offsets, len(rows_with)].astype(np.int64))


def run_passes(run) -> Passes | None:
    """:func:`gemm_passes` of a read run's GEMM rows, reduced over ranks by the query engine
    (:mod:`ampdoctor.read.engine`) instead of read whole: the same passes, in the same order, with
    the same amaxes, calls and summed histograms (a run of 1024 ranks is 1024 times fewer rows
    here). None when the run has none. :class:`~ampdoctor.read.engine.EngineCannot` for a run the
    engine cannot read so (version 1's lists, a segment failing part way): the caller reads its
    rows instead."""
    from ..read.engine import NoLists, Session, lists_here

    if not lists_here(run):
        raise NoLists()
    kinds = ", ".join(f"'{k}'" for k in GEMM_KINDS)
    # A pass: a (kind, layer, step, call) over the ranks (a weight: one per step). Its amax is NaN
    # if a rank's was NaN or missing, else the largest (np.maximum's reduction in gemm_passes).
    pass_call = f"CASE WHEN kind = '{WEIGHT}' THEN -1 ELSE coalesce(call, -1) END AS pass_call"
    passes_sql = f"""
        SELECT kind, name, step, {pass_call},
               CASE WHEN bool_or(amax IS NULL OR isnan(amax)) THEN CAST('NaN' AS DOUBLE)
                    ELSE max(amax)::DOUBLE END AS amax,
               coalesce(min(call) FILTER (WHERE call >= 0), -1) AS call,
               min(position) AS position
        FROM rows WHERE kind IN ({kinds}) GROUP BY kind, name, step, pass_call"""
    # The sampled rows' histograms, streamed and summed per pass here (integer sums: exact in any
    # order); a long run's are gigabytes together, a pass's sum is 16 KiB.
    hists_sql = f"""
        SELECT kind, name, step, {pass_call}, fine_hist
        FROM rows WHERE kind IN ({kinds}) AND len(fine_hist) = {FINE_BINS}"""
    with Session(run, lists=True) as session:
        found = session.query(passes_sql)
        if not found.num_rows:
            return None
        ranks = session.query(f"SELECT count(DISTINCT rank) AS n FROM rows WHERE kind IN ({kinds})").column("n")[0]
        sums: dict[tuple, np.ndarray] = {}
        for batch in session.batches(hists_sql):
            keys = list(zip(*(batch.column(c).to_pylist() for c in ("kind", "name", "step", "pass_call"))))
            column = batch.column("fine_hist")
            counts = np.asarray(column.values.slice(column.offsets[0].as_py(),
                                                    len(batch) * FINE_BINS)).reshape(len(batch), FINE_BINS)
            for key, row in zip(keys, counts):
                total = sums.get(key)
                sums[key] = row.copy() if total is None else total + row
    position = found.column("position").to_numpy()
    # Layers in the order their first row appears (gemm_passes factorizes the rows as read).
    name = np.asarray(found.column("name").to_pylist(), dtype=object)
    first_of = pd.Series(position).groupby(name).min()
    names = list(first_of.sort_values(kind="stable").index)
    name_codes = pd.Index(names).get_indexer(name).astype(np.int64)
    kind_codes = pd.Index(list(GEMM_KINDS)).get_indexer(found.column("kind").to_pylist()).astype(np.int64)
    seq = kind_codes * len(names) + name_codes
    step = found.column("step").to_numpy().astype(np.int64)
    pass_call = found.column("pass_call").to_numpy().astype(np.int64)
    order = np.lexsort((pass_call, step, seq))
    seq, step, pass_call = seq[order], step[order], pass_call[order]
    amax = found.column("amax").to_numpy(zero_copy_only=False).astype(np.float64)[order]
    call = found.column("call").to_numpy().astype(np.int64)[order]
    kinds_of = np.asarray(found.column("kind").to_pylist(), dtype=object)[order]
    names_of = name[order]
    # The passes with histograms, matched to their sums by key (in pass order).
    keys = list(sums)
    found_at = (pd.MultiIndex.from_tuples(keys, names=("kind", "name", "step", "call")).get_indexer(
        pd.MultiIndex.from_arrays([kinds_of, names_of, step, pass_call])) if keys else np.full(len(order), -1))
    sampled = np.flatnonzero(found_at >= 0).astype(np.int64)
    summed = np.empty(len(sampled), dtype=object)
    for j, k in enumerate(found_at[sampled]):
        summed[j] = sums[keys[k]]
    seq_first = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    starts = np.r_[seq_first, len(seq)].astype(np.int64)
    step_first = np.flatnonzero(np.r_[True, (seq[1:] != seq[:-1]) | (step[1:] != step[:-1])])
    per_step = np.diff(np.r_[step_first, len(seq)])
    calls_per_step = np.maximum.reduceat(per_step, np.searchsorted(step_first, seq_first))
    codes = seq[seq_first]
    return Passes(layer=[names[c % len(names)] for c in codes], kind=[GEMM_KINDS[c // len(names)] for c in codes],
                  starts=starts, step=step, call=call, amax=amax, sampled=sampled.astype(np.int64),
                  ranks=int(ranks.as_py()), calls_per_step=calls_per_step, _hists=summed,
                  _sources=np.arange(len(sampled), dtype=np.int64),
                  _offsets=np.arange(len(sampled) + 1, dtype=np.int64))


def _codes(column: pd.Series) -> tuple[list[str], np.ndarray]:
    """The distinct values of a (dictionary-encoded) string column as str, and each row's index
    into them (a categorical's codes: no string per row is made)."""
    codes, uniques = pd.factorize(column, sort=False)
    return [str(u) for u in uniques], codes.astype(np.int64)
