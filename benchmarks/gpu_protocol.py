"""The GPU protocol (issue 17) in one command: the CUDA tests, the sync check and the overhead benchmark
on a GPT-2-small-like and a GPT-2-medium-like model, beside transformers' DebugUnderflowOverflow and
torch.autograd.detect_anomaly; prints a table and PASS/FAIL per check, and writes
``benchmarks/results/gpu_protocol_<device>_<date>.json``.

    python benchmarks/gpu_protocol.py                 # on a CUDA GPU: about 7 minutes on an H100
    python benchmarks/gpu_protocol.py --device cpu --sizes tiny --steps 2 --baseline-steps 2 \\
        --tests tests/test_cuda.py                    # smoke run of the script itself

Parts, each in its own process (GPU memory is freed between them, and a crash or OOM costs one part,
recorded in the JSON, not the others' results):

- tests: ``python -m pytest -m cuda -q`` over the files that hold cuda tests, with a JUnit XML report: passed/failed/skipped, failures by name.
- overhead, per size, in two groups that each measure plain in the same interleaved rounds:
  "ampdoctor" (plain and the three levels) with ``--steps`` in blocks of 100, so that the sampled steps
  of every=100 count at their share; "baselines" (plain, hf-debug, detect-anomaly) with only
  ``--baseline-steps``: they are several times slower than plain and make many syncs, so their cost is
  to be shown, not measured to the percent, and in one group with ampdoctor they would spend most of
  the time. full-every10 is left out (no acceptance bound; ``benchmarks/overhead.py`` measures it).

Checks: the CUDA tests pass; on the first size (GPT-2-small by default) ampdoctor:params <= 1.02x and
ampdoctor:full <= 1.05x plain's mean step; per size, the syncs per steady step of every level equal
plain's, and the extra peak GPU memory is reported. On the CPU these are reported as skipped. The exit
status is 1 if a check fails or a part errors. The JSON is rewritten after every part, so that a run
cut off (the GPU machine allows 10 minutes a command) keeps what finished: point --out-dir where the
files come back from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import torch

from overhead import SIZES  # this script's folder is on sys.path when it is run

ROOT = Path(__file__).resolve().parent.parent
GROUPS = {"ampdoctor": ["plain", "ampdoctor:steps", "ampdoctor:params", "ampdoctor:full"],
          "baselines": ["plain", "hf-debug", "detect-anomaly"]}
# Measured steps per variant of the "ampdoctor" group. At ~0.1 s a step (GPT-2-small, fp16, 8x1024,
# H100) and ~0.3 s (medium), 4 variants: ~85 s and ~125 s plus warm-up, model builds and sync counts.
STEPS = {"gpt2": 200, "gpt2-medium": 100}
BOUNDS = {"ampdoctor:params": 1.02, "ampdoctor:full": 1.05}  # on the first size's mean step ratio


def run_tests(args, tmp: Path) -> dict:
    xml = tmp / "cuda-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           *args.tests]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if not xml.exists():  # usage or internal error: no report to read
        raise RuntimeError(f"pytest exited {proc.returncode} without a report: {_tail(proc)}")
    counts, failures = Counter(), []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        counts[outcome] += 1
        if outcome in ("failure", "error"):
            failures.append(f"{case.get('classname')}::{case.get('name')}")
    return {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "passed": counts["passed"],
            "failed": counts["failure"], "errors": counts["error"], "skipped": counts["skipped"],
            "failures": failures, "summary": (proc.stdout.strip().splitlines() or [""])[-1]}


def run_overhead(args, size: str, group: str, tmp: Path) -> dict:
    steps = args.baseline_steps if group == "baselines" else args.steps or STEPS.get(size, 100)
    out = tmp / f"overhead_{size}_{group}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--device", args.device, "--size", size,
           "--variants", ",".join(GROUPS[group]), "--steps", str(steps), "--blocks", str(max(1, steps // 100)),
           "--warmup", str(args.warmup), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"overhead.py exited {proc.returncode}: {_tail(proc)}")
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["results"]}
    # overhead.py's memory fraction is of a peak that holds every variant's model and optimizer: the
    # difference of peaks to plain's is the extra memory during a step (what a level keeps between
    # steps is in every variant's base, plain's included, and is not in it).
    for r in rows.values():
        if "peak_memory_mib" in r:
            r["extra_memory_mib"] = r["peak_memory_mib"] - rows["plain"]["peak_memory_mib"]
    return result


def _tail(proc: subprocess.CompletedProcess, lines: int = 15) -> str:
    return "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-lines:])


def _part(fn, *fn_args) -> dict:
    """Runs one part; an exception is its recorded result, and the protocol goes on."""
    start = time.perf_counter()
    try:
        part = {"status": "ok", "result": fn(*fn_args)}
    except Exception as exc:  # noqa: BLE001
        part = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    part["seconds"] = round(time.perf_counter() - start, 1)
    return part


def evaluate(report: dict) -> list[dict]:
    """The checks: pass, fail, or skip (part not run, or a CPU run: the bounds are for CUDA), each with a detail."""
    on_cpu = None if report["device_type"] == "cuda" else "CPU run"
    checks = []

    def check(name, ok, detail, skip=None):
        checks.append({"name": name, "status": "skip" if skip else "pass" if ok else "fail",
                       "detail": f"{skip}: {detail}" if skip else detail})

    tests = report["parts"].get("tests")
    if tests is None or tests["status"] == "error":
        check("CUDA tests pass", False, tests["error"] if tests else "", skip=tests is None and "not run")
    else:
        t = tests["result"]
        bad = t["failed"] or t["errors"] or t["returncode"] not in (0, 5)  # 5: none collected
        check("CUDA tests pass", not bad and t["passed"] > 0,
              f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"
              + "".join(f"; {f}" for f in t["failures"]), skip=not bad and on_cpu)

    for i, (size, groups) in enumerate(report["parts"].get("overhead", {}).items()):
        part = groups.get("ampdoctor")
        rows = {r["variant"]: r for r in part["result"]["results"]} if part and part["status"] == "ok" else {}
        missing = "not run" if part is None else None if rows else f"part errored: {part['error']}"
        skip = part is None and "not run" or on_cpu
        for variant, bound in BOUNDS.items() if i == 0 else ():
            r = rows.get(variant, {})
            check(f"{variant} <= {bound}x plain ({size})", r.get("ratio", math.inf) <= bound,
                  missing or f"{r['ratio']:.3f}x plain's mean step (paired {r['paired_ratio']:.3f}x)", skip)
        syncs = {v: rows.get(v, {}).get("syncs_per_step") for v in GROUPS["ampdoctor"]}
        check(f"syncs per step equal plain's ({size})",
              syncs["plain"] is not None and len(set(syncs.values())) == 1,
              missing or ", ".join(f"{v}: {s}" for v, s in syncs.items()), skip)
        extra = {v: rows.get(v, {}).get("extra_memory_mib") for v in GROUPS["ampdoctor"][1:]}
        check(f"extra GPU memory reported ({size})", None not in extra.values(),
              missing or ", ".join(f"{v}: {'none' if m is None else f'{m:+.0f} MiB'}" for v, m in extra.items()),
              skip)
    return checks


def write(report: dict, path: Path) -> None:
    report["checks"] = evaluate(report)
    report["passed"] = not any(c["status"] == "fail" for c in report["checks"]) and not any(
        p["status"] == "error" for p in _parts(report))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


def _parts(report: dict) -> list[dict]:
    parts = report["parts"]
    return ([parts["tests"]] if "tests" in parts else []) + [
        p for groups in parts.get("overhead", {}).values() for p in groups.values()]


def print_summary(report: dict) -> None:
    print(f"\n{report['device']} ({report['device_type']}), torch {report['torch']}, commit {report['git_commit']}")
    print(f"{'size':<12} {'variant':<18} {'mean ms':>8} {'ratio':>7} {'paired':>7} {'syncs/step':>10} {'extra MiB':>9}")
    for size, groups in report["parts"].get("overhead", {}).items():
        for group, part in groups.items():
            if part["status"] == "error":
                print(f"{size:<12} ({group}: error, see the JSON)")
                continue
            for r in part["result"]["results"]:
                syncs, extra = r.get("syncs_per_step"), r.get("extra_memory_mib")
                print(f"{size:<12} {r['variant']:<18} {r['mean_ms']:>8.1f} {r['ratio']:>6.3f}x {r['paired_ratio']:>6.3f}x "
                      f"{'—' if syncs is None else f'{syncs:.1f}':>10} {'—' if extra is None else f'{extra:+.0f}':>9}")
    for c in report["checks"]:
        print(f"{c['status'].upper():<5} {c['name']}: {c['detail']}")
    for p in _parts(report):
        if p["status"] == "error":
            print(f"ERROR {p['error']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a smoke run of the protocol (the CUDA tests skip, no checks apply)")
    parser.add_argument("--parts", type=lambda s: s.split(","), default=["tests", "overhead"],
                        help="comma-separated: tests, overhead (default both)")
    parser.add_argument("--sizes", type=lambda s: s.split(","), default=None,
                        help=f"comma-separated of {', '.join(SIZES)}; the step bounds are checked on the first "
                             "(default: gpt2,gpt2-medium on cuda, tiny on cpu)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"measured steps per variant of the ampdoctor group (default: {STEPS}, else 100)")
    parser.add_argument("--baseline-steps", type=int, default=20,
                        help="measured steps per variant of the baselines group (hf-debug, detect-anomaly)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per block")
    # The files that hold cuda-marked tests: collecting all of tests/ would import hypothesis and
    # transformers, which the GPU machine's image lacks.
    parser.add_argument("--tests", nargs="+", default=["tests/test_cuda.py", "tests/test_integrations.py"],
                        help="what pytest collects (-m cuda)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"gpu_protocol: no CUDA GPU available (torch {torch.__version__}); "
                 "--device cpu runs a smoke test of the protocol instead")
    args.sizes = args.sizes or (["gpt2", "gpt2-medium"] if args.device == "cuda" else ["tiny"])
    if unknown := set(args.sizes) - set(SIZES) or set(args.parts) - {"tests", "overhead"}:
        parser.error(f"unknown: {', '.join(sorted(unknown))}")

    name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    slug = re.sub(r"[^a-z0-9]+", "-", (name if args.device == "cuda" else f"cpu {name}").lower()).strip("-")
    today = datetime.date.today().isoformat()
    path = args.out_dir / f"gpu_protocol_{slug}_{today}.json"
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True)
    report = {"protocol": "gpu (issue 17)", "date": today, "device": name, "device_type": args.device,
              "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
              "git_commit": git.stdout.strip() if git.returncode == 0 else None,
              "git_dirty": bool(dirty.stdout.strip()) if git.returncode == 0 else None,
              "command": " ".join(sys.argv), "settings": {k: v for k, v in vars(args).items() if k != "out_dir"},
              "complete": False, "parts": {}}

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ampdoctor-protocol-") as tmp:
        if "tests" in args.parts:
            print(f"[tests] pytest -m cuda {' '.join(args.tests)}", flush=True)
            report["parts"]["tests"] = part = _part(run_tests, args, Path(tmp))
            print(f"[tests] {part['result']['summary'] if part['status'] == 'ok' else part['error']} "
                  f"({part['seconds']:.0f} s)", flush=True)
            write(report, path)
        for size in args.sizes if "overhead" in args.parts else ():
            for group in GROUPS:
                print(f"[overhead {size} {group}] {', '.join(GROUPS[group])}", flush=True)
                part = _part(run_overhead, args, size, group, Path(tmp))
                report["parts"].setdefault("overhead", {}).setdefault(size, {})[group] = part
                print(f"[overhead {size} {group}] {part['status']} ({part['seconds']:.0f} s)", flush=True)
                write(report, path)
    report["complete"], report["seconds"] = True, round(time.perf_counter() - start, 1)
    write(report, path)
    print_summary(report)
    print(f"{'PASS' if report['passed'] else 'FAIL'}; wrote {path}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
