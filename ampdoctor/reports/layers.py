"""Per-layer statistics over a whole run, in one streaming pass (bounded memory at any length).

One *layer* is one (name, kind): a parameter's gradient (``param_grad``), a module's output
gradient (``grad_output``) or a module's output (``output``). Only full rows count (light
flight-recorder rows hold a peak and nothing else). Each row is judged in the format its values
lived in during training: parameter gradients in the run's AMP format at the step's loss scale,
module rows in their own dtype, gradients at the loss scale and activations unscaled.

* ``underflow_rate``: estimated elements lost to underflow over elements observed (see
  :mod:`ampdoctor.reports.underflow` for the definition and the estimate);
* ``zero_rate``, ``subnormal_rate``: recorded zeros and subnormals over elements observed;
* ``headroom_log2``: the smallest headroom seen, ``log2(format max / (amax · S))`` over the
  observations that were finite (negative: it overflowed the format);
* ``amax``, ``amin``: the largest and smallest nonzero finite magnitudes over the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa

from ..formats import FloatFormat, float_format
from ..run import Run
from .underflow import lost_at_cutoff

LAYER_KINDS = ("param_grad", "grad_output", "output")
SORTS = {"underflow": ("underflow_rate", False), "headroom": ("headroom_log2", True), "amax": ("amax", False)}
HEATMAP_BUCKETS = 200  # step columns of the heatmap at most
LOW_QUANTILE = 0.10    # the heatmap's "low" magnitude: this quantile of the nonzero elements

_COLUMNS = ["step", "rank", "kind", "name", "dtype", "scale", "numel", "amax", "amin", "n_zero",
            "n_subnormal", "n_nan", "n_inf", "hist"]


@dataclass
class LayerScan:
    """What the streaming pass over a run's non-step rows found."""

    layers: pd.DataFrame                       # one row per (name, kind), see the module docstring
    param_lost: pd.DataFrame                   # per step: lost and zeros over parameter gradients
    module_peak: pd.Series                     # per step: largest finite output-gradient amax
    activation_peak: pd.DataFrame              # per module: largest finite output amax (unscaled)
    heatmap_steps: np.ndarray                  # first step of each heatmap column
    heatmap: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # name → (high, low)

    @property
    def empty(self) -> bool:
        return self.layers.empty


def scan_layers(run: Run, amp: FloatFormat, *, first_step: int, last_step: int,
                min_exp: int, bins: int, batch_rows: int = 1 << 16) -> LayerScan:
    """Aggregate every full module and parameter row of ``run``. ``first_step``..``last_step``
    (from the step rows) fix the heatmap's columns before the pass."""
    span = max(1, last_step - first_step + 1)
    width = max(1, math.ceil(span / HEATMAP_BUCKETS))
    columns = math.ceil(span / width)
    parts, lost_parts, peak_parts, act_parts = [], [], [], []
    heat: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for batch in run.batches(_COLUMNS, kinds=LAYER_KINDS, batch_rows=batch_rows):
        batch = batch.filter(pa.compute.is_valid(batch.column("n_zero")))  # full rows only
        if not batch.num_rows:
            continue
        frame, hist = _frame_and_hist(batch, bins)
        _judge(frame, hist, amp, min_exp)
        parts.append(frame.groupby(["name", "kind"], observed=True, sort=False).agg(
            numel=("numel", "sum"), n_zero=("n_zero", "sum"), n_subnormal=("n_subnormal", "sum"),
            lost=("lost", "sum"), observations=("numel", "size"), nonfinite=("nonfinite", "sum"),
            amax=("amax_finite", "max"), amin=("amin", "min"), headroom_log2=("headroom", "min")))
        params = frame[frame["kind"] == "param_grad"]
        lost_parts.append(params.groupby("step").agg(lost=("lost", "sum"), n_zero=("n_zero", "sum")))
        grads = frame[frame["kind"] == "grad_output"]
        peak_parts.append(grads.groupby("step")["amax_finite"].max())
        outputs = frame[frame["kind"] == "output"]
        act_parts.append(outputs.groupby("name", observed=True).agg(
            amax=("amax", "max"), nonfinite=("nonfinite", "sum"), dtype=("dtype", "first")))
        if len(params):
            _heat(heat, params, frame.loc[params.index, "low_log2"], first_step, width, columns)
    layers = _combine(parts)
    param_lost = (pd.concat(lost_parts).groupby(level=0).sum() if lost_parts
                  else pd.DataFrame(columns=["lost", "n_zero"]))
    module_peak = pd.concat(peak_parts).groupby(level=0).max() if peak_parts else pd.Series(dtype=float)
    activation_peak = (pd.concat(act_parts).groupby(level=0).agg(
        {"amax": "max", "nonfinite": "sum", "dtype": "first"}) if act_parts
        else pd.DataFrame(columns=["amax", "nonfinite", "dtype"]))
    steps = first_step + width * np.arange(columns)
    return LayerScan(layers, param_lost, module_peak, activation_peak, steps, heat)


def _frame_and_hist(batch: pa.RecordBatch, bins: int) -> tuple[pd.DataFrame, np.ndarray]:
    hist_column = batch.column("hist")
    frame = pa.Table.from_batches([batch.drop_columns(["hist"])]).to_pandas()
    if hist_column.null_count == len(hist_column):
        hist = np.zeros((len(frame), bins))
    else:
        filled = hist_column.fill_null(pa.scalar([0] * bins, hist_column.type)) if hist_column.null_count else hist_column
        hist = np.asarray(filled.flatten(), dtype=np.float64).reshape(-1, bins)
    for c in ("name", "kind", "dtype"):
        frame[c] = frame[c].astype(str)
    return frame, hist


def _judge(frame: pd.DataFrame, hist: np.ndarray, amp: FloatFormat, min_exp: int) -> None:
    """Add, per row: the format, scale, cut-off, estimated lost elements and headroom."""
    own = frame["dtype"].map(_format_or_none)
    formats = np.where(frame["kind"] == "param_grad", amp, own.where(own.notna(), amp))
    fmax = np.array([f.max for f in formats])
    below = np.array([f.underflow_below for f in formats])
    scale = np.where(frame["kind"] == "output", 1.0, frame["scale"].to_numpy(dtype=np.float64))
    scale = np.where(scale > 0, scale, np.nan)  # a collapsed scale of 0 judges nothing
    with np.errstate(divide="ignore", invalid="ignore"):
        cut = np.log2(below / scale)
    frame["lost"] = lost_at_cutoff(hist, frame["n_zero"].to_numpy(), frame["n_subnormal"].to_numpy(), cut,
                                   min_exp)
    frame["nonfinite"] = (frame["n_nan"] + frame["n_inf"]) > 0
    amax = frame["amax"].to_numpy(dtype=np.float64)
    finite = ~frame["nonfinite"].to_numpy()
    frame["amax_finite"] = np.where(finite, amax, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        headroom = np.log2(fmax / (amax * scale))
    frame["headroom"] = np.where(finite & (amax > 0), headroom, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        frame["low_log2"] = _quantile_log2(hist, LOW_QUANTILE, min_exp) + np.log2(scale)
        frame["high_log2"] = np.where(amax > 0, np.log2(np.where(amax > 0, amax, 1.0) * scale), np.nan)


def _format_or_none(dtype: str) -> FloatFormat | None:
    try:
        return float_format(dtype)
    except ValueError:
        return None


def _quantile_log2(hist: np.ndarray, q: float, min_exp: int) -> np.ndarray:
    """log2 of the lower edge of the binade holding the q-quantile of each row's nonzero elements."""
    total = hist.sum(axis=1)
    cum = np.cumsum(hist, axis=1)
    index = (cum < (q * total)[:, None]).sum(axis=1)
    return np.where(total > 0, min_exp + index, np.nan).astype(np.float64)


def _heat(heat, params: pd.DataFrame, low: pd.Series, first_step: int, width: int, columns: int) -> None:
    column = ((params["step"].to_numpy() - first_step) // width).clip(0, columns - 1)
    frame = pd.DataFrame({"name": params["name"].to_numpy(), "col": column,
                          "high": params["high_log2"].to_numpy(), "low": low.to_numpy()})
    grouped = frame.groupby(["name", "col"]).agg(high=("high", "max"), low=("low", "min"))
    for (name, col), high_value, low_value in zip(grouped.index, grouped["high"], grouped["low"]):
        if name not in heat:
            heat[name] = (np.full(columns, np.nan), np.full(columns, np.nan))
        high, lowest = heat[name]
        high[col] = np.fmax(high[col], high_value)
        lowest[col] = np.fmin(lowest[col], low_value)


def _combine(parts: list[pd.DataFrame]) -> pd.DataFrame:
    if not parts:
        return pd.DataFrame(columns=["name", "kind", "underflow_rate", "zero_rate", "subnormal_rate",
                                     "headroom_log2", "amax", "amin", "observations", "nonfinite"])
    totals = pd.concat(parts).groupby(level=[0, 1], sort=False).agg(
        {"numel": "sum", "n_zero": "sum", "n_subnormal": "sum", "lost": "sum", "observations": "sum",
         "nonfinite": "sum", "amax": "max", "amin": "min", "headroom_log2": "min"})
    numel = totals["numel"].clip(lower=1)
    out = pd.DataFrame({
        "underflow_rate": totals["lost"] / numel,
        "zero_rate": totals["n_zero"] / numel,
        "subnormal_rate": totals["n_subnormal"] / numel,
        "headroom_log2": totals["headroom_log2"],
        "amax": totals["amax"],
        "amin": totals["amin"],
        "observations": totals["observations"].astype(int),
        "nonfinite": totals["nonfinite"].astype(int),
    }).reset_index()
    return out


def sort_layers(layers: pd.DataFrame, by: str = "underflow") -> pd.DataFrame:
    """Worst first: highest underflow rate, least headroom, or largest amax."""
    if by not in SORTS:
        raise ValueError(f"sort must be one of {sorted(SORTS)}, got {by!r}")
    column, ascending = SORTS[by]
    # Ties (e.g. no underflow anywhere) fall back to the least headroom, then the name.
    keys = [column, "headroom_log2", "name"] if column != "headroom_log2" else [column, "name"]
    orders = [ascending, True, True] if column != "headroom_log2" else [True, True]
    return layers.sort_values(keys, ascending=orders, na_position="last", kind="stable").reset_index(drop=True)


def layer_records(layers: pd.DataFrame) -> list[dict]:
    """The ``layers`` entries of the JSON contract."""
    out = []
    for r in layers.itertuples(index=False):
        out.append({"name": r.name, "kind": r.kind, "underflow_rate": float(r.underflow_rate),
                    "zero_rate": float(r.zero_rate), "subnormal_rate": float(r.subnormal_rate),
                    "headroom_log2": _finite_or_none(r.headroom_log2), "amax": _finite_or_none(r.amax),
                    "amin": _finite_or_none(r.amin), "observations": int(r.observations),
                    "nonfinite": int(r.nonfinite)})
    return out


def _finite_or_none(x) -> float | None:
    return float(x) if x is not None and np.isfinite(x) else None
