"""``ampdoctor layers``'s data: the per-layer table of :func:`~ampdoctor.analysis.layer_scan.scan_layers`,
sorted and cut (:func:`layers_data`); the same rows are the ``layers`` of the report."""

from __future__ import annotations


import numpy as np
import pandas as pd

from ..read.run import Run
from ..run_file.schema import META_MODULE_TYPES, meta_names
from .contract_fields import finite_or_none
from .findings import Finding
from .run_analysis import analyse

SORTS = {"underflow": ("underflow_rate", False), "headroom": ("headroom_log2", True), "amax": ("amax", False)}


def layers_data(run: Run, sort: str = "underflow", top: int | None = None) -> dict:
    """``ampdoctor layers``'s data (docs/json-contracts.md)."""
    a = analyse(run)
    warnings = list(a.warnings)  # segments skipped, values ignored: rows the table does not hold
    if a.scan.empty:
        return {"sort": sort, "layers": [], "missing": Finding("no_layer_rows_to_list"), "warnings": warnings}
    layers = sort_layers(a.scan.layers, sort)
    if top is not None:
        layers = layers.head(top)
    return {"sort": sort, "layers": layer_records(layers, module_types(a.run)), "missing": None, "warnings": warnings}


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


def module_types(run: Run) -> dict[str, str]:
    """{module name: class name} from the run's ``model.module_types`` metadata (the modules whose
    name ends in an index); empty for runs without it, or with a value that is not such an object
    (the names then show as they are)."""
    return meta_names(run.metadata.get(META_MODULE_TYPES))


def module_type(name: str, kind: str, types: dict[str, str]) -> str | None:
    """The class of a layer's module where that module's name is only an index (``mlp.2`` of an
    ``nn.Sequential``; ``0`` of ``0.weight``), else None: a name such as ``attn.proj`` says enough."""
    module = name if kind != "param_grad" else name.rpartition(".")[0]
    if not module or not module.rpartition(".")[2].isdigit():
        return None
    return types.get(module)


def layer_records(layers: pd.DataFrame, types: dict[str, str] | None = None) -> list[dict]:
    """The ``layers`` entries of the JSON contract; ``types``: :func:`module_types`."""
    types = types or {}
    out = []
    for r in layers.itertuples(index=False):
        out.append({"name": r.name, "kind": r.kind, "module_type": module_type(r.name, r.kind, types),
                    "underflow_rate": finite_or_none(r.underflow_rate),
                    "underflow_rate_min": finite_or_none(r.underflow_rate_min),
                    "underflow_rate_max": finite_or_none(r.underflow_rate_max),
                    "underflow_measured": finite_or_none(r.underflow_measured),
                    "measure_distance": _steps_or_none(r.measure_distance),
                    "zero_rate": finite_or_none(r.zero_rate), "subnormal_rate": finite_or_none(r.subnormal_rate),
                    "headroom_log2": finite_or_none(r.headroom_log2), "amax": finite_or_none(r.amax),
                    "amin": finite_or_none(r.amin), "observations": int(r.observations),
                    "nonfinite": int(r.nonfinite)})
    return out


def _steps_or_none(value: float) -> int | None:
    return None if value is None or not np.isfinite(value) else int(value)
