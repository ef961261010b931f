"""A run read once for ``report``, ``simulate``, ``layers`` and ``postmortem``: the step series,
the layer scan and the calibrated replay (:func:`analyse`).

Reads only the columns each part needs: the step rows and every other row in one streaming pass
(:func:`~ampdoctor.analysis.layer_scan.scan_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ..float_formats import FLOAT16, FloatFormat, float_format
from ..read.run import Run, expect_run
from ..run_file.schema import (HIST_BINS, HIST_MIN_EXP, META_AMP_DTYPE, META_DEVICE, META_HIST_BINS, META_HIST_MIN_EXP,
                               META_LEVEL, META_SCALER_ENABLED, MODULE_KINDS, meta_number)
from .findings import Finding
from .layer_scan import LayerScan, scan_layers
from .replay import Replay, prepare
from .scaler_config import ScalerConfig, recorded_config
from .steps import StepSeries, attach_param_lost, attach_tails, load_steps


@dataclass
class Analysis:
    """Everything the commands share: read once."""

    run: Run
    amp: FloatFormat           # the format training ran in
    target: FloatFormat        # the format replayed: float16 (also for a bf16 or fp32 run)
    series: StepSeries
    scan: LayerScan
    prepared: Replay | None    # None without step rows
    current: ScalerConfig | None  # None without loss scaling (a disabled scaler, bf16, fp32)
    level: str
    own_warnings: list[Finding] = field(default_factory=list)  # the analysis's, not the run's

    @property
    def warnings(self) -> list[str | Finding]:
        """The run's warnings, then the analysis's. The run's are read live: a command that reads
        more rows after :func:`analyse` (simulate's per-layer rows, the postmortem's) may find a
        damaged segment, which the run then warns about."""
        return [*self.run.warnings, *self.own_warnings]

    @property
    def device(self) -> str:
        return (self.run.metadata.get(META_DEVICE) or "cuda").split(":")[0]

    @property
    def activation_peak(self) -> pd.DataFrame:
        """Per module: its largest finite activation (LayerScan.activation_peak)."""
        return self.scan.activation_peak

    @property
    def recorded_full(self) -> bool:
        """Whether the run was recorded at level='full' (runs written before the level was kept in
        the metadata say nothing: False)."""
        return self.run.metadata.get(META_LEVEL) == "full"


def analyse(run: Run) -> Analysis:
    """The step series, the layer scan and the calibrated replay of a read run."""
    expect_run(run, "analyse()")
    meta = run.metadata
    amp, min_exp, bins = recorded_binning(meta)
    scan = scan_layers(run, amp, min_exp=min_exp, bins=bins)
    own_warnings: list[Finding] = []
    scan.step_rows = with_valid_scale(scan.step_rows, own_warnings)
    if scan.unanswered_light_rows:
        own_warnings.append(Finding("light_rows_without_sample", {"rows": scan.unanswered_light_rows}))
    series = load_steps(scan.step_rows, amp, min_exp, bins)
    attach_tails(series, scan.tails)
    attach_param_lost(series, scan.param_lost)
    # fp16 is the format a scaler is for: a bf16/fp32 run is asked whether fp16 would work.
    target = amp if amp.name == "float16" else FLOAT16
    enabled = meta.get(META_SCALER_ENABLED, "true") == "true"
    current = (recorded_config(meta, float(series.scale[0])) if len(series) and enabled and amp.name == target.name
               else None)
    prepared = prepare(series, target, module_ratio=_module_ratio(series, scan)) if len(series) else None
    # The level the run was recorded at; older runs without it: inferred from the rows (module rows
    # of escalated steps then read as "full").
    level = meta.get(META_LEVEL) or ("full" if scan.layers["kind"].isin(MODULE_KINDS).any() else (
        "params" if len(scan.layers) else "steps"))
    return Analysis(run, amp, target, series, scan, prepared, current, level, own_warnings)


def recorded_binning(meta: dict[str, str]) -> tuple[FloatFormat, int, int]:
    """The run's AMP format and its histograms' ``min_exp`` and ``bins``, from the metadata; the
    defaults (float16, the schema's binning) where a value is absent or unusable."""
    def integer(key: str, default: int) -> int:
        value = meta_number(meta.get(key))
        return default if value is None else int(value)

    name = meta.get(META_AMP_DTYPE)
    try:
        amp = float_format(name) if name else FLOAT16
    except ValueError:
        amp = FLOAT16
    return amp, integer(META_HIST_MIN_EXP, HIST_MIN_EXP), integer(META_HIST_BINS, HIST_BINS)


def with_valid_scale(step_rows: pa.Table, warnings: list) -> pa.Table:
    """The step rows whose scale is a number (0 included: a collapsed scale); the others (a
    damaged or foreign file) are left out, with a warning."""
    if not step_rows.num_rows:
        return step_rows
    scale = step_rows.column("scale")
    valid = pc.fill_null(pc.and_(pc.is_finite(scale), pc.greater_equal(scale, 0)), False)
    bad = step_rows.num_rows - pc.sum(valid).as_py()
    if bad:
        warnings.append(Finding("step_rows_without_scale", {"rows": bad}))
        step_rows = step_rows.filter(valid)
    return step_rows


def _module_ratio(series: StepSeries, scan: LayerScan) -> float | None:
    """The largest ratio of a module output gradient to the parameter gradients on a good step."""
    if scan.module_peak.empty or not len(series):
        return None
    step_amax = pd.Series(series.amax, index=series.steps)[~series.skipped]
    ratio = (scan.module_peak / step_amax.where(step_amax > 0)).dropna()
    ratio = ratio[np.isfinite(ratio)]
    return float(ratio.max()) if len(ratio) else None
