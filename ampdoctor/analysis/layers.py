"""``ampdoctor layers``'s data: the per-layer table of :func:`~ampdoctor.analysis.layer_scan.scan_layers`,
sorted and cut (:func:`layers_data`); the same rows are the ``layers`` of the report."""

from __future__ import annotations

import os

import pandas as pd

from ..run import Run
from .contract_fields import finite_or_none
from .findings import Finding
from .run_analysis import analyse

SORTS = {"underflow": ("underflow_rate", False), "headroom": ("headroom_log2", True), "amax": ("amax", False)}


def layers_data(run: Run | str | os.PathLike, sort: str = "underflow", top: int | None = None) -> dict:
    """``ampdoctor layers``'s data (docs/json-contracts.md)."""
    a = analyse(run)
    if a.scan.empty:
        return {"sort": sort, "layers": [], "missing": Finding("no_layer_rows_to_list")}
    layers = sort_layers(a.scan.layers, sort)
    if top is not None:
        layers = layers.head(top)
    return {"sort": sort, "layers": layer_records(layers), "missing": None}


def sort_layers(layers: pd.DataFrame, by: str = "underflow") -> pd.DataFrame:
    """Worst first: highest underflow rate, least headroom, or largest amax."""
    if by not in SORTS:
        raise ValueError(f"sort must be one of {sorted(SORTS)}, got {by!r}")
    column, ascending = SORTS[by]
    if column == "underflow_rate":
        # An unknown estimate sorts by its upper bound: worst possible first.
        layers = layers.assign(_key=layers["underflow_rate"].fillna(layers["underflow_rate_max"]))
        column = "_key"
    # Ties (e.g. no underflow anywhere) fall back to the least headroom, then the name.
    keys = [column, "headroom_log2", "name"] if column != "headroom_log2" else [column, "name"]
    orders = [ascending, True, True] if column != "headroom_log2" else [True, True]
    out = layers.sort_values(keys, ascending=orders, na_position="last", kind="stable").reset_index(drop=True)
    return out.drop(columns=["_key"], errors="ignore")


def layer_records(layers: pd.DataFrame) -> list[dict]:
    """The ``layers`` entries of the JSON contract."""
    out = []
    for r in layers.itertuples(index=False):
        out.append({"name": r.name, "kind": r.kind, "underflow_rate": finite_or_none(r.underflow_rate),
                    "underflow_rate_max": finite_or_none(r.underflow_rate_max),
                    "zero_rate": finite_or_none(r.zero_rate), "subnormal_rate": finite_or_none(r.subnormal_rate),
                    "headroom_log2": finite_or_none(r.headroom_log2), "amax": finite_or_none(r.amax),
                    "amin": finite_or_none(r.amin), "observations": int(r.observations),
                    "nonfinite": int(r.nonfinite)})
    return out
