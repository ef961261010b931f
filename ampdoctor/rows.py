"""Rows of the run file from the records the training thread queued: the writer thread's side.

Each record becomes blocks of columns (every column of :func:`ampdoctor.schema.run_schema`): a
step row, a row per observed gradient, per module observation and per parameter check; or a
flight record's light rows (only ``amax``, the peak).
"""

from __future__ import annotations

import numpy as np

from .formats import float_format
from .records import FlightRecord, LightStep, ParamPeaks, ParamRecord, StepRecord, TapObservation, read_scalars
from .stats import HostStats


def materialize(record: StepRecord | FlightRecord | ParamRecord, *, hist_bins: int):
    """Rows of one record, as ``([(columns, n_rows), ...], anomaly)``: a step row, one row
    per observed gradient, one per module observation; or a flight record's light rows. On the
    writer thread: waits for the record's fence first (a host-side wait)."""
    if record.event is not None:
        record.event.synchronize()
    if isinstance(record, FlightRecord):
        for light in record.steps:  # their scalars came with their own step's copies
            if light.event is not None:
                light.event.synchronize()
        return [_light_rows(s, record.rank) for s in record.steps], True
    if isinstance(record, ParamRecord):
        scale, skipped, _, _ = read_scalars(record.scalars)
        common = dict(step=record.step, rank=record.rank, scale=scale, skipped=skipped)
        block = _param_rows(record.params, common, float_format(record.amp_dtype).max)
        return [block], not np.isfinite(block[0]["amax"][0])
    scale, skipped, loss, param_peak = read_scalars(record.scalars)
    parts = [HostStats.of(g.stats) for g in record.groups]
    if parts:
        merged = HostStats.concat(parts)
        total = merged.total()
    else:
        merged, total = None, _empty_stats(hist_bins)
    names = [""]
    dtypes = [record.amp_dtype]
    numels = [int(sum(g.numels.sum() for g in record.groups))]
    stats = [total]
    if record.per_tensor and merged is not None:
        for g in record.groups:
            names.extend(g.names)
            dtypes.extend([g.dtype] * len(g.names))
            numels.extend(g.numels.tolist())
        stats.append(merged)
    kinds = ["step"] + ["param_grad"] * (len(names) - 1)
    common = dict(step=record.step, rank=record.rank, scale=scale, skipped=skipped)
    blocks = [_block(**common, kinds=kinds, names=names, dtypes=dtypes, numels=numels,
                     stats=_stat_columns(HostStats.concat(stats)), losses=[loss])]
    if record.taps:
        taps = record.taps
        blocks.append(_block(
            **common, kinds=[t.kind for t in taps], names=[t.call.name for t in taps],
            dtypes=[t.dtype for t in taps], numels=[t.numel for t in taps],
            stats=_stat_columns(HostStats.concat([HostStats.of(t.stats) for t in taps])),
            **_call_columns(taps)))
    if record.params is not None:
        blocks.append(_param_rows(record.params, common, float_format(record.amp_dtype).max))
    anomaly = (skipped or (loss is not None and not np.isfinite(loss))
               or (param_peak is not None and not np.isfinite(param_peak)))
    return blocks, anomaly

def _light_rows(light: LightStep, rank: int) -> tuple[dict[str, np.ndarray], int]:
    """A flight-recorder step: only ``amax`` is measured, as the peak magnitude (NaN or inf
    when the tensor held one); the other statistics are null."""
    scale, skipped, _, _ = read_scalars(light.scalars)
    taps = light.taps
    peaks = light.peaks.numpy().astype(np.float32)
    inv = np.float32(1.0 / np.float64(scale))  # as torch's unscale_: fp32 1/scale
    grads = np.array([t.kind == "grad_output" for t in taps])
    with np.errstate(over="ignore", invalid="ignore"):
        amax = np.where(grads, peaks * inv, peaks).astype(np.float32)
    stats = _light_columns(amax)
    return _block(step=light.step, rank=rank, scale=scale, skipped=skipped,
                  kinds=[t.kind for t in taps], names=[t.call.name for t in taps],
                  dtypes=[t.dtype for t in taps], numels=[t.numel for t in taps], stats=stats,
                  **_call_columns(taps))


def _param_rows(params: ParamPeaks, common: dict, amp_max: float) -> tuple[dict[str, np.ndarray], int]:
    """``param`` rows: one for all parameters together (name ""), plus one per parameter that
    is not finite or is beyond the AMP format's max (autocast would cast it to inf). Light rows:
    only ``amax``, the peak ``max |w|`` (NaN or inf when it held one)."""
    peaks = params.peaks.numpy().astype(np.float32)
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero(~np.isfinite(peaks) | (peaks > amp_max))
    with np.errstate(invalid="ignore"):
        total = np.float32(np.nan) if np.isnan(peaks).any() else peaks.max()
    names = [""] + [params.names[i] for i in bad]
    numels = [int(sum(params.numels))] + [params.numels[i] for i in bad]
    amax = np.concatenate([[total], peaks[bad]]).astype(np.float32)
    n = len(names)
    return _block(**common, kinds=["param"] * n, names=names, dtypes=["float32"] * n, numels=numels,
                  stats=_light_columns(amax))


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


def _call_columns(taps: list[TapObservation]) -> dict[str, list]:
    return {"orders": [t.order for t in taps], "calls": [t.call.call for t in taps],
            "parents": [t.call.parent for t in taps], "inputs": [list(t.call.inputs) for t in taps]}


def _block(*, step: int, rank: int, scale: float, skipped: bool, kinds: list[str], names: list[str],
           dtypes: list[str], numels: list[int], stats: dict[str, np.ndarray], losses=None,
           orders=None, calls=None, parents=None, inputs=None) -> tuple[dict[str, np.ndarray], int]:
    """One block of rows with every column of the schema."""
    n = len(kinds)
    return {
        "step": np.full(n, step, dtype=np.int64),
        "rank": np.full(n, rank, dtype=np.int32),
        "kind": np.array(kinds, dtype=object),
        "name": np.array(names, dtype=object),
        "order": _objects(n, orders),
        "dtype": np.array(dtypes, dtype=object),
        "numel": np.array(numels, dtype=np.int64),
        "scale": np.full(n, scale, dtype=np.float32),
        "skipped": np.full(n, skipped, dtype=bool),
        "loss": _objects(n, losses),
        **stats,
        "call": _objects(n, calls),
        "parent": _objects(n, parents),
        "inputs": _objects(n, inputs),
    }, n


def _empty_stats(bins: int) -> HostStats:
    return HostStats(np.zeros(1, np.float32), np.full(1, np.nan, np.float32), np.zeros(1, np.float32),
                     *(np.zeros(1, np.int64) for _ in range(4)), np.zeros((1, bins), np.int32))
