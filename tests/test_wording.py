"""Findings and their wording: the analyses return data (:class:`~ampdoctor.analysis.findings.Finding`),
every sentence is in ``render/wording/``, and :func:`ampdoctor.render.contract` words a command's
data into its JSON contract."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ampdoctor import render
from ampdoctor.analysis.contract_fields import finite_or_none, underflow_fields
from ampdoctor.analysis.findings import Finding
from ampdoctor.analysis.scaler_config import ScalerConfig, recorded_config
from ampdoctor.render.wording import codes, word, worded

ANALYSIS = Path(__file__).resolve().parents[1] / "ampdoctor" / "analysis"


def _codes_in_analyses() -> set[str]:
    return {code for path in ANALYSIS.glob("*.py")
            for code in re.findall(r'Finding\(\s*"(\w+)"', path.read_text(encoding="utf-8"))}


def test_every_finding_has_a_sentence_and_every_sentence_a_finding():
    found = _codes_in_analyses()
    assert len(found) > 50
    assert found == codes(), (found - codes(), codes() - found)


def test_the_analyses_import_no_renderer():
    """Analyses return data; prose and number formatting are the renderers'."""
    for path in ANALYSIS.glob("*.py"):
        source = path.read_text(encoding="utf-8")
        assert not re.search(r"^\s*(from|import)\s+(\.\.render|ampdoctor\.render)", source, re.M), path.name


def test_a_sentence_formats_raw_numbers():
    code = Finding("scaler_code", {"device": "cuda", "settings": {"init_scale": 4096.0, "growth_interval": 500}})
    assert word(code) == 'torch.amp.GradScaler("cuda", init_scale=2**12, growth_interval=500)'
    underflow = underflow_fields(0.0, 0.5)
    assert word(Finding("current_settings_best", {"skipped": 3, "underflow": underflow})) == (
        "the current settings are the best found: 3 skipped step(s), between 0 and 50% underflow")
    source = Finding("threshold_from_overflows", {"overflows": 4})
    assert word(Finding("overflow_threshold", {"log2": 15.04, "source": source})) == (
        "overflow starts where the largest gradient times the scale reaches about 2**15.0 (from 4 observed "
        "overflow(s))")


def test_a_finding_without_a_sentence_is_an_error():
    with pytest.raises(KeyError, match="no_such_code"):
        word(Finding("no_such_code"))


def test_worded_replaces_findings_anywhere_and_leaves_the_rest():
    data = {"warnings": ["a reader's warning", Finding("no_step_rows")], "n": 3,
            "nested": {"x": (Finding("settings_fine"),)}, "rate": math.nan}
    out = worded(data)
    assert out["warnings"] == ["a reader's warning", "not enough data: the run has no step rows"]
    assert out["nested"]["x"] == ("the current GradScaler settings are fine for this run",)
    assert out["n"] == 3 and math.isnan(out["rate"])  # non-finite floats are the contract's to null
    again = worded(out)
    assert again["warnings"] == out["warnings"] and again["nested"] == out["nested"]  # words once


def test_the_contract_words_drops_the_charts_and_nulls_non_finite_floats():
    data = {"missing": {"scale": Finding("no_step_rows")}, "charts": {"steps": [1]}, "rate": math.inf,
            "layers": [{"amax": float("nan")}]}
    assert render.contract(data) == {"missing": {"scale": "not enough data: the run has no step rows"},
                                     "rate": None, "layers": [{"amax": None}]}
    assert '"scale": "not enough data' in render.to_json(data)


def test_finite_or_none_takes_every_missing_value():
    assert finite_or_none(None) is None and finite_or_none(pd.NA) is None
    assert finite_or_none(math.nan) is None and finite_or_none(-math.inf) is None
    value = finite_or_none(np.float32(1.5))
    assert value == 1.5 and type(value) is float


def test_the_settings_shown_are_init_scale_and_what_differs():
    assert ScalerConfig(init_scale=2.0**12).shown_settings() == {"init_scale": 2.0**12}
    current = ScalerConfig(growth_interval=100)
    assert ScalerConfig(init_scale=8.0, backoff_factor=0.25).shown_settings(current) == {
        "init_scale": 8.0, "backoff_factor": 0.25, "growth_interval": 2000}


def test_the_recorded_config_reads_the_metadata_numbers():
    meta = {"scaler.init_scale": "65536", "scaler.growth_factor": "2", "scaler.backoff_factor": "0.25",
            "scaler.growth_interval": "100"}
    cfg = recorded_config(meta, first_scale=1024.0)
    assert cfg == ScalerConfig(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=100)
    assert type(cfg.growth_factor) is float and type(cfg.growth_interval) is int  # as the contracts print them
    assert recorded_config({"scaler.growth_factor": ""}, first_scale=None) == ScalerConfig()
