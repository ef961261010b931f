"""The three recorded scenarios that the report, replay, recommendation and layer tests share:
init_scale far too high, init_scale far too low with a tiny loss (underflow), and a growth_interval
so short that the scale keeps growing back into overflow. Trained once per test session; a test
module uses them by importing the ``scenarios`` fixture."""

from __future__ import annotations

import pytest

from ampdoctor.read.run import read_run
from ampdoctor.analysis.report import report_data
from models import train_recorded

SCENARIOS = {
    "init_too_high": dict(init_scale=2.0**24),
    "underflow": dict(init_scale=1.0, loss_factor=1e-4),
    "periodic_overflow": dict(init_scale=2.0**16, growth_interval=10),
}
STEPS = 150


@pytest.fixture(scope="session")
def scenarios(tmp_path_factory):
    """name → (run path, skipped steps, report data)."""
    root = tmp_path_factory.mktemp("scenarios")
    out = {}
    for name, options in SCENARIOS.items():
        path = root / f"{name}.parquet"
        skipped = train_recorded(path, steps=STEPS, **options)
        out[name] = (path, skipped, report_data(read_run(path)))
    return out


def within(actual: int, predicted: int, rel: float) -> bool:
    return abs(actual - predicted) <= max(2, rel * max(actual, predicted))
