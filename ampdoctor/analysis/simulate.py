"""``ampdoctor simulate``'s data: one scaler configuration replayed on a run
(:mod:`~ampdoctor.analysis.replay`), next to what the run did; per parameter, the underflow
predicted at the replayed scales."""

from __future__ import annotations


import numpy as np
import pandas as pd

from ..errors import RunError
from ..run_file.hist_column import hist_matrix
from ..read.run import Run
from ..run_file.schema import HIST_BINS
from .contract_fields import underflow_fields
from .replay import Outcome, actual_outcome, replay
from .run_analysis import Analysis, analyse
from .scaler_config import with_defaults
from .underflow import UnderflowModel, underflow_bounds, with_measured

LAYER_COLUMNS = ["step", "rank", "kind", "name", "scale", "numel", "n_zero", "n_subnormal", "n_nan", "n_inf", "hist",
                 "n_zero_lines", "n_underflow"]


def simulate_data(run: Run, **settings) -> dict:
    """``ampdoctor simulate``'s data (docs/json-contracts.md): the replay of one configuration
    next to what the run did. ``settings``: init_scale, growth_factor, backoff_factor,
    growth_interval, hysteresis, min_scale, max_scale; the ones not given are the run's own
    (torch's defaults for a run without scaling). A setting torch cannot hold is a ValueError."""
    a = analyse(run)
    if a.prepared is None or not len(a.series):
        raise RunError(f"{a.run.path}: not enough data to simulate: the run has no step rows")
    config = with_defaults(a.current, **settings)
    outcome = replay(a.prepared, [config], keep_trajectory=True)[0]
    n = len(a.series)
    result = {"config": config.to_dict(), "target_dtype": a.target.name, "steps": n}
    result.update({k: v for k, v in outcome.to_dict(n).items() if k != "config"})
    result["actual"] = actual_outcome(a.series, a.current)
    result["threshold"] = a.prepared.threshold.to_dict()
    result["layers"] = _predicted_layers(a, outcome)
    result["notes"] = list(a.prepared.notes) + list(a.warnings)
    return result


def _predicted_layers(a: Analysis, outcome: Outcome) -> list[dict]:
    """Per parameter: the underflow predicted at the simulated scale of its sampled steps, as a
    range where the record leaves zeros undecided (see :mod:`~ampdoctor.analysis.replay`)."""
    table = a.run.table(LAYER_COLUMNS, kinds=["param_grad"])
    if not table.num_rows:
        return []
    table = table.filter(table.column("n_zero").is_valid())
    bins = a.series.hist.shape[1] if len(a.series) else HIST_BINS
    hist = hist_matrix(table.column("hist"), bins)
    frame = table.drop_columns(["hist"]).to_pandas()
    frame["name"] = frame["name"].astype(str)
    finite = (frame["n_nan"].fillna(0) + frame["n_inf"].fillna(0)).to_numpy() == 0  # overflowed rows: not judged
    scale = frame["scale"].to_numpy(dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        cut = np.log2(a.amp.underflow_below / np.where(scale > 0, scale, np.nan))
        estimate, upper = underflow_bounds(hist, frame["n_zero"].to_numpy(dtype=np.float64),
                                           frame["n_subnormal"].to_numpy(dtype=np.float64), cut, a.series.min_exp,
                                           frame["n_zero_lines"].to_numpy(dtype=np.float64, na_value=np.nan))
        # A measured step's count is the loss at its recorded scale (underflow_probe.py); the
        # other rows of a measured tensor are calibrated by it, as the layers table's are.
        measured = frame["n_underflow"].to_numpy(dtype=np.float64, na_value=np.nan)
        lines = frame["n_zero_lines"].to_numpy(dtype=np.float64, na_value=np.nan)
        estimate = np.where(np.isnan(measured), a.scan.calibrate(
            frame["name"].to_numpy(), "param_grad", frame["rank"].to_numpy(), frame["step"].to_numpy(),
            frame["n_zero"].to_numpy(dtype=np.float64), frame["numel"].to_numpy(dtype=np.float64), estimate, upper,
            lines), estimate)
        estimate, upper = with_measured(estimate, upper, measured)
        model = UnderflowModel(hist, np.nan_to_num(cut, nan=0.0), np.nan_to_num(estimate, nan=0.0), a.series.min_exp)
        log2s = pd.Series(outcome.trajectory, index=a.series.steps).reindex(frame["step"]).to_numpy()
        lost = model.lost(np.log2(a.target.underflow_below) - log2s)
    frame["lost"] = np.where(finite, np.where(np.isnan(estimate), np.nan, lost), 0.0)  # NaN: 0 everywhere
    frame["upper"] = np.where(finite, np.nan_to_num(lost) + upper - np.nan_to_num(estimate), 0.0)
    frame["numel"] = np.where(finite, frame["numel"], 0)
    by = frame.groupby("name").agg(lost=("lost", lambda c: c.sum(min_count=len(c))), upper=("upper", "sum"),
                                   numel=("numel", "sum"))
    numel = by["numel"].clip(lower=1)
    by["underflow_rate"] = by["lost"] / numel
    by["underflow_rate_max"] = by["upper"] / numel
    by = by.sort_values(["underflow_rate_max", "underflow_rate"], ascending=False, na_position="first")
    return [{"name": n, "kind": "param_grad", **underflow_fields(r["underflow_rate"], r["underflow_rate_max"])}
            for n, r in by.iterrows()]
