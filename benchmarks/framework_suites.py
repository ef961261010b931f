"""Frameworks' own test suites, run plain, with ampdoctor's scaler substituted, and with every
scaler wrapped: ampdoctor must pass exactly what torch's scaler passes (issue 40).

    python benchmarks/framework_suites.py [--frameworks lightning,accelerate] [--modes plain,substituted,wrapped]

* Lightning: the AMP precision-plugin tests of Lightning 2.6.5 (fabric and pytorch,
  ``plugins/precision/test_amp*.py`` and ``tests_pytorch/plugins/test_amp_plugins.py``: 26 tests,
  18 run on a CPU), vendored unchanged under ``benchmarks/framework_suites/lightning/`` with their
  conftest fixtures (``thread_police`` among them), their licence and the commit they come from
  (Lightning's PyPI sdists carry no tests).
* Accelerate: the tests of accelerate 1.15.0 that make an Accelerator build a GradScaler, from its
  sdist (which carries ``tests/``), downloaded on first use. Accelerate builds a scaler only on an
  accelerator device: on a CPU they are collected and skip.

Modes (``benchmarks/framework_suites/ampdoctor_swap.py``, a pytest plugin loaded with ``-p``):
``substituted`` replaces ``torch.amp.GradScaler`` with a subclass of ``ampdoctor.GradScaler`` that
records to a fresh directory; ``wrapped`` passes every torch scaler, once constructed, through
``ampdoctor.wrap``. The scalers are never closed by the harness, and the frameworks' fixtures stay.

Each suite runs in a virtual environment made on first use under ``benchmarks/framework_suites/.cache/``
(``--system-site-packages``: torch and ampdoctor are the outer environment's; the frameworks pinned
as above). A failing test is run up to twice more (``--lf``); one that then passes is reported
FLAKY and counted as passed (on a 2-core CPU Lightning's DDP-spawn tests sometimes lose a child,
plain too). Exits 1 when a test that passes plain fails in another mode; ``--out`` writes the
table as JSON (benchmarks/results/framework_suites.json).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent / "framework_suites"
CACHE = HERE / ".cache"  # the virtual environment and the downloaded sdist (not in git)
VENV = CACHE / "venv"
PY = VENV / "bin" / "python"
PINS = ["lightning==2.6.5", "accelerate==1.15.0"]
TEST_NEEDS = ["parameterized", "pytest-order"]  # accelerate's test_prod extra, less xdist/subtests
ACCELERATE_SDIST = "accelerate==1.15.0"
ACCELERATE_TESTS = [  # every test in accelerate 1.15.0 that makes Accelerator build a scaler (fp16)
    "tests/test_kwargs_handlers.py::KwargsHandlerTester::test_grad_scaler_kwargs",
    "tests/test_kwargs_handlers.py::KwargsHandlerTester::test_autocast_kwargs",
    "tests/test_optimizer.py::OptimizerTester",
    "tests/test_accelerator.py::AcceleratorTester::test_can_unwrap_model_fp16",
]
RERUNS = 2  # DDP-spawn children on CPU abort now and then (SIGABRT), plain too
LIGHTNING = HERE / "lightning" / "tests"
SUITES = {  # name: (framework, cwd or callable giving it, pytest args)
    "lightning-fabric": ("lightning", lambda: LIGHTNING, ["tests_fabric/plugins/precision/test_amp.py",
                                                         "tests_fabric/plugins/precision/test_amp_integration.py"]),
    "lightning-pytorch": ("lightning", lambda: LIGHTNING, ["tests_pytorch/plugins/precision/test_amp.py",
                                                          "tests_pytorch/plugins/precision/test_amp_integration.py",
                                                          "tests_pytorch/plugins/test_amp_plugins.py"]),
    "accelerate": ("accelerate", lambda: accelerate_tests(), ACCELERATE_TESTS),
}


def sh(*cmd: str | Path) -> None:
    subprocess.run([str(c) for c in cmd], check=True, stdout=subprocess.DEVNULL)


def ensure_venv() -> None:
    if not PY.exists():
        sh(sys.executable, "-m", "venv", "--system-site-packages", VENV)
        sh(PY, "-m", "pip", "install", "-q", "--ignore-installed", "--no-deps", *PINS)
        sh(PY, "-m", "pip", "install", "-q", *TEST_NEEDS)


def accelerate_tests() -> Path:
    root = CACHE / "src" / f"accelerate-{ACCELERATE_SDIST.split('==')[1]}"
    if not (root / "tests").is_dir():
        sd = CACHE / "sd"
        sh(PY, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", sd, ACCELERATE_SDIST)
        with tarfile.open(sd / f"{root.name}.tar.gz") as tar:
            tar.extractall(root.parent, filter="data")
    return root


def run(suite: str, mode: str) -> tuple[dict[str, tuple[str, str]], float, int]:
    """{test id: (outcome, one-line reason)}, wall seconds, scalers recorded."""
    _, cwd, args = SUITES[suite]
    with tempfile.TemporaryDirectory(prefix=f"{suite}-{mode}-") as tmp:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
        extra = []
        if mode != "plain":
            env.update(AMPDOCTOR_SWAP=mode, AMPDOCTOR_SWAP_DIR=tmp)
            extra = ["-p", "ampdoctor_swap"]
        def pytest(junit: Path, *more: str) -> dict[str, tuple[str, str]]:
            subprocess.run([str(PY), "-m", "pytest", "-q", "-o", f"cache_dir={tmp}/cache", *extra, *more,
                            f"--junitxml={junit}", *args], cwd=cwd(), env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return parse(junit)

        start = time.perf_counter()
        results = pytest(Path(tmp) / "junit.xml")
        scalers = sum(p.is_dir() for p in Path(tmp).glob("scaler-*"))  # first run's only
        for attempt in range(RERUNS):  # failures again (--lf): tell flaky from failing
            if not any(o == "failed" for o, _ in results.values()):
                break
            for test_id, (outcome, _) in pytest(Path(tmp) / f"rerun{attempt}.xml", "--lf").items():
                if outcome == "passed" and results.get(test_id, ("",))[0] == "failed":
                    results[test_id] = ("flaky", results[test_id][1])
        wall = time.perf_counter() - start
        return results, wall, scalers


def parse(junit: Path) -> dict[str, tuple[str, str]]:
    results = {}
    for case in ET.parse(junit).iter("testcase"):
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped") and outcome != "failed":
                outcome = "skipped" if child.tag == "skipped" else "failed"
                reason = ((child.get("message") or child.text or "").strip() + "\n").splitlines()[0][:160]
        results[f"{case.get('classname')}::{case.get('name')}"] = (outcome, reason)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", default="lightning,accelerate")
    parser.add_argument("--modes", default="plain,substituted,wrapped")
    parser.add_argument("--out", help="write the results as JSON here")
    opts = parser.parse_args()
    frameworks, modes = opts.frameworks.split(","), opts.modes.split(",")
    ensure_venv()
    print(f"{'suite':18} {'mode':12} {'passed':>6} {'failed':>6} {'skipped':>7} {'scalers':>7} {'wall s':>7}")
    regressions = []
    table = []
    for suite, (framework, _, _) in SUITES.items():
        if framework not in frameworks:
            continue
        plain = None
        for mode in modes:
            results, wall, scalers = run(suite, mode)
            counts = {k: sum(o == k for o, _ in results.values()) for k in ("passed", "failed", "skipped", "flaky")}
            print(f"{suite:18} {mode:12} {counts['passed'] + counts['flaky']:6} {counts['failed']:6} {counts['skipped']:7} "
                  f"{scalers if mode != 'plain' else '-':>7} {wall:7.1f}")
            table.append({"suite": suite, "mode": mode, "passed": counts["passed"] + counts["flaky"],
                          "failed": counts["failed"], "skipped": counts["skipped"], "flaky": counts["flaky"],
                          "scalers": scalers if mode != "plain" else None, "wall_s": round(wall, 1),
                          "failures": sorted(t for t, (o, _) in results.items() if o == "failed")})
            if mode == "plain":
                plain = {k: ("passed" if o == "flaky" else o, r) for k, (o, r) in results.items()}
            for test_id, (outcome, reason) in results.items():
                if outcome in ("failed", "flaky"):
                    print(f"    {outcome.upper()} {test_id}: {reason}")
                if outcome != "failed":
                    continue
                if mode != "plain" and (plain is None or plain.get(test_id, ("",))[0] == "passed"):
                    regressions.append(f"{suite} {mode} {test_id}")
    if opts.out:
        import json
        import platform
        import torch
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=HERE).stdout.strip()
        Path(opts.out).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "commit": commit, "machine": platform.machine(),
            "torch": torch.__version__, "pins": PINS, "rows": table, "regressions": regressions}, indent=2) + "\n")
    if regressions:
        print(f"\n{len(regressions)} test(s) that pass plain fail with ampdoctor:")
        print("\n".join("  " + r for r in regressions))
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
