"""Rows of the run file from the records the training thread queued: the writer thread's side.

Each record becomes blocks of columns (every column of :func:`ampdoctor.run_file.schema.run_schema`): a
step row, a row per observed gradient, per module observation and per parameter check; or a
flight record's light rows (only ``amax``, the peak).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .call_graph import through_untapped
from ..float_formats import float_format
from .light_taps import observations
from .records import (FlightRecord, FlightStep, GemmRecord, ParamCheck, ParamRecord, StepRecord, StepScalars,
                      TapObservation, read_scalars)
from ..run_file.schema import GEMM_KINDS
from ..stats import HostStats

Block = tuple[dict[str, np.ndarray], int]  # every column of the schema, and its number of rows


def materialize(record: StepRecord | FlightRecord | ParamRecord, *, hist_bins: int) -> tuple[list[Block], bool]:
    """Rows of one record, as ``([(columns, n_rows), ...], anomaly)``: a step row, one row
    per observed gradient, one per module observation; or a flight record's light rows. On the
    writer thread: waits for the record's fence first (a host-side wait)."""
    if record.event is not None:
        record.event.synchronize()
    if isinstance(record, FlightRecord):
        for flight_step in record.steps:  # their scalars came with their own step's copies
            if flight_step.event is not None:
                flight_step.event.synchronize()
        return [_flight_rows(s, record.rank) for s in record.steps], True
    if isinstance(record, ParamRecord):
        step = _StepColumns.of(record.step, record.rank, read_scalars(record.scalars))
        block = _param_rows(step, record.params, float_format(record.amp_dtype).max)
        return [block], not np.isfinite(block[0]["amax"][0])
    scalars = read_scalars(record.scalars)
    step = _StepColumns.of(record.step, record.rank, scalars)
    parts = [g.stats.decode() for g in record.groups]
    merged = HostStats.concat(parts) if parts else None
    labels = _Labels(["step"], [""], [record.amp_dtype], [int(sum(g.numels.sum() for g in record.groups))])
    stats = [merged.total() if merged is not None else HostStats.empty(hist_bins)]
    if record.per_tensor and merged is not None:
        for g in record.groups:
            labels.extend("param_grad", g.names, g.dtype, g.numels.tolist())
        stats.append(merged)
    measured = _measured(record.groups)
    lost_hists = None
    if measured is not None:  # the step row: all of them, when every one was measured
        lost_hists = _lost_hists(record.groups, measured, hist_bins)
        every = (measured >= 0).all()
        lost_hists = [lost_hists.sum(axis=0) if every else None] + (
            [h if m >= 0 else None for h, m in zip(lost_hists, measured)] if record.per_tensor else [])
        measured = [int(measured.sum()) if every else -1] + (measured.tolist() if record.per_tensor else [])
    blocks = [step.block(labels, _stat_columns(HostStats.concat(stats)), losses=[scalars.loss], measured=measured,
                         lost_hists=lost_hists)]
    if record.taps:
        tap_stats = HostStats.concat([t.stats.decode() for t in record.taps])
        tap_lost = [_lost_rows(t.lost, 1)[0] if t.lost is not None else None for t in record.taps]
        blocks.append(step.block(_Labels.of_taps(record.taps), _stat_columns(tap_stats), taps=record.taps,
                                 measured=None if record.tap_measured is None else record.tap_measured.tolist(),
                                 lost_hists=tap_lost if any(h is not None for h in tap_lost) else None))
    if record.params is not None:
        blocks.append(_param_rows(step, record.params, float_format(record.amp_dtype).max))
    if record.gemm is not None:
        blocks.append(_gemm_rows(step, record.gemm))
    anomaly = (scalars.skipped or (scalars.loss is not None and not np.isfinite(scalars.loss))
               or (scalars.param_peak is not None and not np.isfinite(scalars.param_peak)))
    return blocks, anomaly


@dataclass
class _Labels:
    """What each row of a block describes: its ``kind``, ``name``, ``dtype`` and ``numel``."""

    kinds: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)

    @classmethod
    def of_taps(cls, taps: list[TapObservation]) -> "_Labels":
        return cls([t.kind for t in taps], [t.call.name for t in taps], [t.dtype for t in taps],
                   [t.numel for t in taps])

    def extend(self, kind: str, names: list[str], dtype: str, numels: list[int]) -> None:
        """Rows of one kind and dtype."""
        self.kinds.extend([kind] * len(names))
        self.names.extend(names)
        self.dtypes.extend([dtype] * len(names))
        self.numels.extend(numels)


@dataclass(frozen=True)
class _StepColumns:
    """The columns every row of one step repeats; builds its blocks."""

    step: int
    rank: int
    scale: float
    skipped: bool

    @classmethod
    def of(cls, step: int, rank: int, scalars: StepScalars) -> "_StepColumns":
        return cls(step, rank, scalars.scale, scalars.skipped)

    def block(self, labels: _Labels, stats: dict[str, np.ndarray], *, losses: list | None = None,
              taps: list[TapObservation] | None = None, measured: list[int] | None = None,
              lost_hists: list | None = None) -> Block:
        """One block of rows with every column of the schema; ``taps`` give the module rows'
        call structure (``order``, ``call``, ``parent``, ``inputs``, ``computed_inputs``), null on
        other rows;
        ``measured`` each row's measured underflow (-1 or None: not measured, null)."""
        n = len(labels.kinds)
        return {
            "step": np.full(n, self.step, dtype=np.int64),
            "rank": np.full(n, self.rank, dtype=np.int32),
            "kind": np.array(labels.kinds, dtype=object),
            "name": np.array(labels.names, dtype=object),
            "order": _objects(n, None if taps is None else [t.order for t in taps]),
            "dtype": np.array(labels.dtypes, dtype=object),
            "numel": np.array(labels.numels, dtype=np.int64),
            "scale": np.full(n, self.scale, dtype=np.float32),
            "skipped": np.full(n, self.skipped, dtype=bool),
            "loss": _objects(n, losses),
            **stats,
            "n_underflow": _objects(n, None if measured is None else [None if v < 0 else v for v in measured]),
            "underflow_hist": _objects(n, lost_hists),
            "call": _objects(n, None if taps is None else [t.call.call for t in taps]),
            "parent": _objects(n, None if taps is None else [t.call.parent for t in taps]),
            # (the call graph marks an input reached through computing code as ~call: two columns here)
            "inputs": _objects(n, None if taps is None else [[~i if through_untapped(i) else i for i in t.call.inputs]
                                                              for t in taps]),
            "computed_inputs": _objects(n, None if taps is None else [
                [~i for i in t.call.inputs if through_untapped(i)] for t in taps]),
            "fine_hist": _objects(n),
            "block_stats": _objects(n),
        }, n


def _flight_rows(flight_step: FlightStep, rank: int) -> Block:
    """A flight-recorder step: only ``amax`` is measured, as the peak magnitude (NaN or inf
    when the tensor held one); the other statistics are null."""
    step = _StepColumns.of(flight_step.step, rank, read_scalars(flight_step.scalars))
    taps = observations(flight_step.taps)
    amax = _unscaled_peaks(taps, flight_step.peaks, step.scale, "grad_output")
    return step.block(_Labels.of_taps(taps), _light_columns(amax), taps=taps)


def _unscaled_peaks(taps: list[TapObservation], peaks, scale: float, grad_kind: str) -> np.ndarray:
    """float32 peaks of light observations (a host tensor), those of kind ``grad_kind`` unscaled by
    ``scale`` as torch's ``unscale_`` does (times the float32 1/scale: the largest product is the
    product of the largest)."""
    peaks = peaks.numpy().astype(np.float32)
    inv = np.float32(1.0 / np.float64(scale))
    grads = np.array([t.kind == grad_kind for t in taps], dtype=bool)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(grads, peaks * inv, peaks).astype(np.float32)


def _gemm_rows(step: _StepColumns, gemm: GemmRecord) -> Block:
    """GEMM operand rows (gemm_operands.py): one per call's input and output gradient, one per
    called layer's weight; ``amax`` the peak (gradients unscaled), ``call`` and, on gradients, the
    backward ``order``; on module-sampled steps ``n_zero`` and ``fine_hist``, and on those of the
    cadence ``block_stats``."""
    grad_kind = GEMM_KINDS[2]
    taps = observations(gemm.taps)
    amax = _unscaled_peaks(taps, gemm.peaks, step.scale, grad_kind)
    block, n = step.block(_Labels.of_taps(taps), _light_columns(amax))
    block["call"] = _objects(n, [t.call.call for t in taps])
    block["order"] = _objects(n, [t.order if t.kind == grad_kind else None for t in taps])
    if gemm.hists is not None:
        where = {key: i for i, key in enumerate(gemm.hist_keys)}
        hists, zeros = gemm.hists.numpy(), gemm.zeros.numpy()
        index = [where.get((t.kind, t.call.call, t.order)) for t in taps]
        block["n_zero"] = _objects(n, [None if i is None else int(zeros[i]) for i in index])
        block["fine_hist"] = _objects(n, [None if i is None else hists[i] for i in index])
    if gemm.blocks is not None:
        where = {key: i for i, key in enumerate(gemm.block_keys)}
        blocks = gemm.blocks.numpy()
        block["block_stats"] = _objects(n, [None if (i := where.get((t.kind, t.call.call, t.order))) is None
                                            else blocks[i] for t in taps])
    return block, n


def _param_rows(step: _StepColumns, params: ParamCheck, amp_max: float) -> Block:
    """``param`` rows: one for all parameters together (name ""), plus one per parameter that
    is not finite or is beyond the AMP format's max (autocast would cast it to inf). Light rows:
    only ``amax``, the peak ``max |w|`` (NaN or inf when it held one)."""
    peaks = params.peaks.numpy().astype(np.float32)
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero(~np.isfinite(peaks) | (peaks > amp_max))
    with np.errstate(invalid="ignore"):
        total = np.float32(np.nan) if np.isnan(peaks).any() else peaks.max()
    labels = _Labels()
    labels.extend("param", [""] + [params.names[i] for i in bad], "float32",
                  [int(sum(params.numels))] + [params.numels[i] for i in bad])
    return step.block(labels, _light_columns(np.concatenate([[total], peaks[bad]]).astype(np.float32)))


def _measured(groups: list) -> np.ndarray | None:
    """int64 per parameter gradient of the record's groups, in row order: measured underflow
    (-1: not measured); None when the step was not measured."""
    if not any(g.measured is not None for g in groups):
        return None
    return np.concatenate([g.measured.numpy() if g.measured is not None else np.full(len(g.names), -1)
                           for g in groups]).astype(np.int64)


def _lost_hists(groups: list, measured: np.ndarray, bins: int) -> np.ndarray:
    """int64 [parameter gradients, bins]: each measured gradient's underflowed elements by binade
    (``underflow_hist``), in row order; zeros where not measured."""
    parts = [_lost_rows(g.lost, len(g.names)) if g.lost is not None else np.zeros((len(g.names), bins), dtype=np.int64)
             for g in groups]
    return np.concatenate(parts) if parts else np.zeros((len(measured), bins), dtype=np.int64)


def _lost_rows(lost, n: int) -> np.ndarray:
    """int64 [n, bins]: the histograms of ``n`` tensors' lost values (their copied statistics)."""
    return np.asarray(lost.decode().hist, dtype=np.int64).reshape(n, -1)


def _objects(n: int, values=None) -> np.ndarray:
    """An object column of ``n`` entries (None where ``values`` has none)."""
    out = np.full(n, None, dtype=object)
    if values is not None:
        for i, v in enumerate(values):
            out[i] = v
    return out


def _light_columns(amax: np.ndarray, l2: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The statistics columns of light rows: the peak magnitude as ``amax`` (NaN or inf when the
    tensor held one), the norm where measured; the rest null."""
    nulls = np.full(len(amax), None, dtype=object)
    return {"amax": amax, "amin": nulls, "l2": nulls if l2 is None else l2, "n_zero": nulls,
            "n_subnormal": nulls, "n_nan": nulls, "n_inf": nulls, "hist": nulls, "n_zero_lines": nulls}


def _stat_columns(s: HostStats) -> dict[str, np.ndarray]:
    if s.light:
        return _light_columns(s.amax, s.l2)
    return {"amax": s.amax, "amin": s.amin, "l2": s.l2, "n_zero": s.n_zero,
            "n_subnormal": s.n_subnormal, "n_nan": s.n_nan, "n_inf": s.n_inf, "hist": s.hist,
            "n_zero_lines": _objects(len(s.amax), [None if np.isnan(v) else int(v) for v in s.n_zero_lines])}
