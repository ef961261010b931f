"""The engine-neutral SQL (ampdoctor.read.partials): per-segment partial aggregates that combine
exactly, checked against what ``ampdoctor report`` says of the same run, on a real run of two
ranks in many segments; and docs/sql.md, which users copy, holds the same SQL."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from ampdoctor.analysis.report import report_data
from ampdoctor.analysis.run_analysis import analyse
from ampdoctor.read import partials
from ampdoctor.read.run import read_run
from models import train_ranks

DOCS = Path(__file__).resolve().parents[1] / "docs" / "sql.md"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Two ranks of one run, level "full", overflowing at first (skipped steps, non-finite rows),
    written in segments of 7 steps."""
    path = tmp_path_factory.mktemp("partials") / "run"
    train_ranks(path, "two-ranks", steps=40, init_scale=2.0**24, level="full", every=5, module_every=10, flush_every=7)
    return read_run(path)


def _same(a, b) -> bool:
    """Equal, None and NaN both meaning no value."""
    missing = lambda v: v is None or (isinstance(v, float) and math.isnan(v))  # noqa: E731
    return (missing(a) and missing(b)) or a == b


def test_the_run_has_what_the_sql_must_handle(two_ranks):
    assert len(two_ranks.segments) >= 10
    assert {s.metadata["rank"] for s in two_ranks.segments} == {"0", "1"}
    report = report_data(two_ranks)
    assert report["scale"]["skipped_steps"] > 0
    assert any(layer["nonfinite"] for layer in report["layers"])
    assert {layer["kind"] for layer in report["layers"]} >= {"param_grad", "grad_output", "output"}


@pytest.mark.parametrize("segments_per_part", [None, 3])
def test_combined_partials_are_the_reports_figures(two_ranks, segments_per_part):
    steps, layers = partials.combine(*partials.run_partials(two_ranks, segments_per_part))
    a = analyse(two_ranks)
    assert steps.column("step").to_pylist() == a.series.steps.tolist()
    assert steps.column("scale").to_pylist() == a.series.recorded_scale.tolist()
    assert steps.column("skipped").to_pylist() == a.series.skipped.tolist()
    report = report_data(two_ranks)
    skipped = np.array(steps.column("skipped").to_pylist())
    assert int(skipped.sum()) == report["scale"]["skipped_steps"]
    assert steps.column("scale")[0].as_py() == report["scale"]["initial"]
    assert min(steps.column("scale").to_pylist()) == report["scale"]["min"]
    by_layer = {(r["name"], r["kind"]): r for r in layers.to_pylist()}
    assert len(by_layer) == len(report["layers"])
    for layer in report["layers"]:
        sql = by_layer[(layer["name"], layer["kind"])]
        for field in ("observations", "zero_rate", "subnormal_rate", "nonfinite", "amax", "amin"):
            assert _same(sql[field], layer[field]), (layer["name"], layer["kind"], field, sql[field], layer[field])


def test_partials_of_any_split_combine_to_the_same(two_ranks):
    whole = partials.combine(*partials.run_partials(two_ranks))
    for split in (2, 5, 1000):
        assert partials.combine(*partials.run_partials(two_ranks, split)) == whole


def test_docs_hold_the_sql_users_run(two_ranks):
    text = DOCS.read_text()
    blocks = [b.strip() for b in re.findall(r"```sql\n(.*?)```", text, flags=re.S)]
    for name in ("STEP_PARTIALS", "LAYER_PARTIALS", "COMBINE_STEPS", "COMBINE_LAYERS"):
        assert getattr(partials, name).strip() in blocks, f"docs/sql.md lacks {name} as the code has it"
