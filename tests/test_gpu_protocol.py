"""benchmarks/gpu_protocol.py: a CPU smoke run writes every part and check; without a GPU it says so in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_protocol.py"
sys.path.insert(0, str(SCRIPT.parent))

import gpu_protocol  # noqa: E402


def test_cpu_smoke_run(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--sizes", "tiny", "--steps", "2",
                           "--baseline-steps", "2", "--warmup", "1", "--tests", "tests/test_cuda.py",
                           "--out-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = tmp_path.glob("gpu_protocol_cpu-*.json")
    report = json.loads(path.read_text())
    assert report["device"] and report["device_type"] == "cpu" and report["complete"] and report["passed"]
    tests = report["parts"]["tests"]["result"]
    assert tests["skipped"] > 0 and tests["passed"] == tests["failed"] == 0  # the cuda tests skip on the CPU
    for group, variants in gpu_protocol.GROUPS.items():
        part = report["parts"]["overhead"]["tiny"][group]
        assert part["status"] == "ok" and [r["variant"] for r in part["result"]["results"]] == variants
    names = [c["name"] for c in report["checks"]]
    assert len(names) == 5 and all(c["status"] == "skip" for c in report["checks"])
    assert any("ampdoctor:full <= 1.05x" in n for n in names) and any("syncs per step" in n for n in names)


def test_checks_on_cuda():
    rows = [{"variant": "plain", "ratio": 1.0, "syncs_per_step": 1.0, "extra_memory_mib": 0.0},
            {"variant": "ampdoctor:steps", "ratio": 1.001, "syncs_per_step": 1.0, "extra_memory_mib": 0.0},
            {"variant": "ampdoctor:params", "ratio": 1.01, "syncs_per_step": 1.0, "extra_memory_mib": 2.0},
            {"variant": "ampdoctor:full", "ratio": 1.07, "syncs_per_step": 2.0, "extra_memory_mib": 40.0}]
    for r in rows:
        r["paired_ratio"] = r["ratio"]
    ok = {"status": "ok", "result": {"results": rows}}
    report = {"device_type": "cuda", "parts": {
        "tests": {"status": "ok", "result": {"returncode": 0, "passed": 8, "failed": 0, "errors": 0, "skipped": 0,
                                             "failures": []}},
        "overhead": {"gpt2": {"ampdoctor": ok}, "gpt2-medium": {"ampdoctor": {"status": "error", "error": "OOM"}}}}}
    status = {c["name"]: c["status"] for c in gpu_protocol.evaluate(report)}
    assert status == {"CUDA tests pass": "pass", "ampdoctor:params <= 1.02x plain (gpt2)": "pass",
                      "ampdoctor:full <= 1.05x plain (gpt2)": "fail", "syncs per step equal plain's (gpt2)": "fail",
                      "extra GPU memory reported (gpt2)": "pass",
                      "syncs per step equal plain's (gpt2-medium)": "fail",
                      "extra GPU memory reported (gpt2-medium)": "fail"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")
def test_no_gpu_is_one_line():
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "no CUDA GPU" in proc.stderr
