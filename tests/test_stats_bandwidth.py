"""benchmarks/stats_bandwidth.py: a CPU smoke run measures every algorithm and light_stats and writes
its JSON; the gradient set is shaped as asked; the peak comes from the device properties or the
table. No timed assertions."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "stats_bandwidth.py"
sys.path.insert(0, str(SCRIPT.parent))

import stats_bandwidth  # noqa: E402

import ampdoctor.stats  # noqa: E402


def test_cpu_smoke_run(tmp_path):
    out = tmp_path / "stats.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--elements", "20000", "--repeats", "2",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["elements"] == 20_000 and result["bytes"] == 80_000 and result["tensors"] > 10
    assert result["device_type"] == "cpu" and result["torch"] == torch.__version__ and result["package_digest"]
    assert result["default_algorithm"] == "host" and result["peak_source"] == "measured copy"
    assert set(result["algorithms"]) == set(ampdoctor.stats.ALGORITHMS) | set(getattr(ampdoctor.stats, "FULL_ALGORITHMS", ()))
    for row in [*result["algorithms"].values(), result["light_stats"]]:
        # an algorithm may refuse the CPU (recorded with its error); the host one may not
        assert row["status"] == "ok" or row["error"]
        if row["status"] == "ok":
            assert row["gbps"] > 0 and row["share_of_copy"] > 0 and row["ops"] > 0 and row["repeats"] == 2
    assert result["algorithms"]["host"]["status"] == "ok"
    assert "GB/s" in proc.stdout and "full_stats host (default)" in proc.stdout


@pytest.mark.parametrize("elements", [100_000_000, 200_000, 1000, 7])
def test_shapes_add_up(elements):
    shapes = stats_bandwidth.transformer_shapes(elements)
    assert sum(math.prod(s) for s in shapes) == elements
    if elements == 100_000_000:  # GPT-2-small's widths, with many small vectors among the matrices
        assert shapes[0] == (49152, 768) and sum(len(s) == 1 for s in shapes) > 40


def test_gradients_look_scaled():
    grads = stats_bandwidth.make_gradients(stats_bandwidth.transformer_shapes(200_000), "cpu")
    flat = torch.cat([g.flatten() for g in grads])
    zeros, tiny = (flat == 0).float().mean(), ((flat != 0) & (flat.abs() < stats_bandwidth.SUBNORMAL_BELOW)).any()
    assert 0 < zeros < 0.5 and tiny and torch.isfinite(flat).all()


def test_peak_from_properties_or_table():
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", memory_clock_rate=2_619_000, memory_bus_width=5120)
    gbps, source = stats_bandwidth.peak_of(props)
    assert gbps == pytest.approx(3352, rel=1e-3) and "properties" in source
    assert stats_bandwidth.peak_of(SimpleNamespace(name="NVIDIA H100 80GB HBM3")) == (3350.0, "table (H100)")
    assert stats_bandwidth.peak_of(SimpleNamespace(name="NVIDIA H100 PCIe"))[0] == 2000.0
    assert stats_bandwidth.peak_of(SimpleNamespace(name="NVIDIA H200"))[0] == 4800.0
    assert stats_bandwidth.peak_of(SimpleNamespace(name="Some GPU")) == (None, None)
