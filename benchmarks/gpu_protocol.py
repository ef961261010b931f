"""The GPU protocol (issues 17 and 26) in one command: the CUDA tests, the overhead a user pays at the
default cadence (amortised over steady, sampled and module-sampled steps, ``benchmarks/overhead.py``),
syncs and memory, and the memory bandwidth of the full statistics (``benchmarks/stats_bandwidth.py``);
optionally the same overhead and bandwidth measured on an older checkout in the same run. Prints
tables and PASS/FAIL per check, and writes ``gpu_protocol_<device>_<date>[_<commit>].json``.

    python benchmarks/gpu_protocol.py --out-dir "$OUT"        # on a CUDA GPU: about 4-5 minutes on an H100
    python benchmarks/gpu_protocol.py --out-dir "$OUT" --baseline-tree .base   # + the old tree: about 7-8
    python benchmarks/gpu_protocol.py --device cpu --sizes tiny --steps 2 --sampled-steps 1 --module-steps 1 \\
        --after 1 --baseline-steps 2 --warmup 1 --tests tests/test_cuda.py   # smoke run of the script itself

Parts, each in its own process (GPU memory is freed between them, and a crash, OOM or timeout costs
one part, recorded in the JSON, not the others' results), in this order:

- tests: ``python -m pytest -m cuda -q`` over the files that hold cuda tests (JUnit XML: passed,
  failed, skipped, failures by name).
- overhead, per size (GPT-2-small-like by default; ``--sizes gpt2,gpt2-medium`` adds the medium one),
  group "ampdoctor": plain and the three levels in the same interleaved rounds; steady steps, sampled
  steps and module-sampled steps timed apart, several of each, and the amortised ratio at the default
  every=100 / module_every=1000 (its definition: overhead.py's docstring); then, each variant alone,
  syncs per step of each kind and peak GPU memory.
- baseline tree (``--baseline-tree PATH``, an older checkout whose ``ampdoctor`` package is imported
  instead, through ``PYTHONPATH``): the same overhead group and stats part with this tree's scripts,
  recorded beside the current results with that tree's commit. Not checked; an error there (an import
  error, an API the script needs and the tree lacks) is an errored part.
- stats: the bandwidth micro-benchmark (100 M float32 gradient elements on CUDA).
- profile: where a step's time goes on the first size, host or device, for plain, params and
  full, steady steps and one sampled and one module-sampled step (``benchmarks/step_profile.py``:
  wall, host CPU and kernel time per step, the top kernels). Not checked: it says what to change
  when a check fails.
- overhead group "baselines" (plain, hf-debug, detect-anomaly; ``--baseline-steps`` each): several
  times slower than plain with many syncs, so shown, not measured to the percent; last, since no
  check needs it.

Checks (CUDA; on the CPU they are reported as skipped): the CUDA tests pass; on the first size
ampdoctor:params amortised <= 1.02x and ampdoctor:full <= 1.05x plain's mean step, a sampled step at
params <= 1.25x and a module-sampled step at full <= 2x (each with the work it leaves to the next
steps); per size, the syncs per step of every level and step kind no more than plain's, and the extra
peak GPU memory of every level <= 1% of plain's peak; the default algorithm's full statistics >= 25% of
the device's peak memory bandwidth. The exit status is 1 if a check fails or a part errors (the
baseline tree's included). The JSON records the device, torch, CUDA and Triton versions and the
commit (``git``, else ``--commit``; and a digest of the ``ampdoctor`` sources), and is rewritten after
every part, so that a run cut off keeps what finished; every part's process stops at ``--budget``
seconds from the start (the GPU machine allows 10 minutes a command). Point ``--out-dir`` where the
files come back from.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
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

from overhead import SIZES, git_state, package_digest  # this script's folder is on sys.path when it is run

ROOT = Path(__file__).resolve().parent.parent
GROUPS = {"ampdoctor": ["plain", "ampdoctor:steps", "ampdoctor:params", "ampdoctor:full"],
          "baselines": ["plain", "hf-debug", "detect-anomaly"]}
LEVELS = GROUPS["ampdoctor"][1:]
# Measured rounds of the "ampdoctor" group per size: steady rounds, sampled and module-sampled steps
# (each with --after steps after it), blocks of fresh variants. At ~55 ms a step (GPT-2-small, fp16,
# 8x1024, H100), 4 variants, (150 + 5 x 12) rounds: ~50 s, plus warm-up, model builds, the events'
# own cost (a module-sampled step at full took ~5 s before issue 26) and the syncs/memory pass.
STEPS = {"gpt2": dict(steps=150, sampled_steps=8, module_steps=4, blocks=2),
         "gpt2-medium": dict(steps=80, sampled_steps=6, module_steps=3, blocks=2)}
SMOKE_STEPS = dict(steps=100, sampled_steps=4, module_steps=2, blocks=1)  # other sizes (CPU)
AMORTISED_BOUNDS = {"ampdoctor:params": 1.02, "ampdoctor:full": 1.05}  # first size, x plain's mean step
STEP_BOUNDS = {"ampdoctor:params": ("sampled", 1.25), "ampdoctor:full": ("module_sampled", 2.0)}
MEMORY_BOUND = 0.01       # extra peak GPU memory, as a fraction of plain's peak
BANDWIDTH_BOUND = 0.25    # full statistics, as a fraction of the device's peak memory bandwidth


# -- running a part in its own process -----------------------------------------------------------
class Budget:
    """The protocol's wall-clock budget: each part's process gets what is left."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left < 5:
            raise RuntimeError("not run: the protocol's time budget (--budget) was spent")
        return left


def tree_env(tree: Path) -> dict:
    """The environment of a part that must import ``tree``'s ampdoctor: ``tree`` first on
    PYTHONPATH, and no entry that names the repository root (``.``, which holds the current
    ampdoctor) unless ``tree`` is it; other entries (a carried-in wheel's folder) stay."""
    env = dict(os.environ)
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(ROOT, p).resolve() not in (ROOT, tree.resolve())]
    env["PYTHONPATH"] = os.pathsep.join([str(tree.resolve()), *keep])
    return env


def run_script(script: str, script_args: list[str], tree: Path, budget: Budget, tmp: Path, name: str) -> dict:
    """Runs ``benchmarks/<script>`` of this checkout against ``tree``'s ampdoctor; its JSON result,
    after checking that it imported the ampdoctor asked for."""
    expected = (tree / "ampdoctor" / "__init__.py").resolve()
    _check_import(tree, expected, budget)
    out = tmp / f"{name}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *script_args, "--json", str(out)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=tree_env(tree), capture_output=True, text=True,
                              timeout=budget.left())
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{script} stopped at the time budget after {exc.timeout:.0f} s") from None
    if proc.returncode:
        raise RuntimeError(f"{script} exited {proc.returncode}: {_tail(proc)}")
    result = json.loads(out.read_text())
    if Path(result.get("ampdoctor_file", "")).resolve() != expected:
        raise RuntimeError(f"{script} imported {result.get('ampdoctor_file')}, not {expected}")
    return result


def _check_import(tree: Path, expected: Path, budget: Budget) -> None:
    """Before a long part: ``tree``'s ampdoctor imports, and it is the one imported (not an
    installed copy found first); a second or two, as ``import ampdoctor`` loads neither torch nor pandas."""
    code = "import ampdoctor; print(ampdoctor.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "benchmarks", env=tree_env(tree),
                          capture_output=True, text=True, timeout=min(120.0, budget.left()))
    if proc.returncode:
        raise RuntimeError(f"import ampdoctor from {tree} failed: {_tail(proc, 3)}")
    found = proc.stdout.strip()
    if found == "None" or Path(found).resolve() != expected:
        raise RuntimeError(f"import ampdoctor with {tree} first on PYTHONPATH found {found}, not {expected}")


def run_tests(args, budget: Budget, tmp: Path) -> dict:
    xml = tmp / "cuda-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           *args.tests]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=tree_env(ROOT), capture_output=True, text=True,
                              timeout=budget.left())
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"pytest stopped at the time budget after {exc.timeout:.0f} s") from None
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


def overhead_args(args, size: str, group: str) -> list[str]:
    if group == "baselines":
        rounds = dict(steps=args.baseline_steps, sampled_steps=0, module_steps=0, blocks=1)
    else:
        rounds = {**STEPS.get(size, SMOKE_STEPS),
                  **{k: v for k, v in vars(args).items() if k in SMOKE_STEPS and v is not None}}
    rounds["blocks"] = max(1, min(rounds["blocks"], rounds["steps"]))
    return ["--device", args.device, "--size", size, "--variants", ",".join(GROUPS[group]),
            "--after", str(args.after), "--warmup", str(args.warmup),
            *[f"--{k.replace('_', '-')}={v}" for k, v in rounds.items()]]


def stats_args(args) -> list[str]:
    elements = args.stats_elements or (100_000_000 if args.device == "cuda" else 200_000)
    return ["--device", args.device, "--elements", str(elements), "--seconds", str(args.stats_seconds)]


def profile_args(args) -> list[str]:
    steps = ["--steps", "2", "--warmup", "1", "--profile-steps", "1"] if args.device != "cuda" else []
    return ["--device", args.device, "--size", args.sizes[0], *steps]


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


# -- the checks ----------------------------------------------------------------------------------
def evaluate(report: dict) -> list[dict]:
    """The checks: pass, fail, or skip (part not run, or a CPU run: the bounds are for CUDA), each with a detail."""
    on_cpu = None if report["device_type"] == "cuda" else "CPU run"
    checks = []

    def check(name, ok, detail, skip=None):
        checks.append({"name": name, "status": "skip" if skip else "pass" if ok else "fail",
                       "detail": (f"{skip}: {detail}" if detail else skip) if skip else detail})

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
        for variant, bound in AMORTISED_BOUNDS.items() if i == 0 else ():
            r = rows.get(variant, {})
            ratio = r.get("amortised_ratio")
            check(f"{variant} amortised <= {bound}x plain ({size})", ratio is not None and ratio <= bound,
                  missing or (f"{_x(ratio)} plain's mean step (steady {_x(r['steady_ratio'])}, "
                              f"paired {_x(r['paired_ratio'])})"), skip)
        for variant, (kind, bound) in STEP_BOUNDS.items() if i == 0 else ():
            r = rows.get(variant, {})
            ratio = r.get(f"{kind}_cost_ratio")
            check(f"{variant} {kind.replace('_', '-')} step <= {bound}x plain ({size})",
                  ratio is not None and ratio <= bound,
                  missing or (f"{_x(ratio)} with the steps after it, {_x(r.get(f'{kind}_ratio'))} alone "
                              f"(n={r.get(f'{kind}_n', 0)})"), skip)
        check(f"syncs per step <= plain's ({size})", *_syncs(rows, missing), skip)
        check(f"extra GPU memory <= {MEMORY_BOUND:.0%} of plain's peak ({size})", *_memory(rows, missing), skip)

    stats = report["parts"].get("stats")
    if stats is not None or "stats" in report.get("settings", {}).get("parts", ()):
        ok, detail = _bandwidth(stats)
        check(f"full statistics >= {BANDWIDTH_BOUND:.0%} of peak bandwidth", ok, detail,
              stats is None and "not run" or on_cpu)
    return checks


def _x(ratio) -> str:
    return "—" if ratio is None else f"{ratio:.3f}x"


def _syncs(rows: dict, missing: str | None) -> tuple[bool, str]:
    """Every level's syncs per step, of every step kind, no more than plain's."""
    plain = rows.get("plain", {}).get("syncs_per_step")
    if missing or plain is None:
        return False, missing or "plain's syncs were not counted"
    worst = {v: rows.get(v, {}).get("syncs_by_kind") or {} for v in LEVELS}
    ok = all(kinds and max(kinds.values()) <= plain for kinds in worst.values())
    return ok, f"plain: {plain:.2f}; " + "; ".join(
        f"{v}: " + (", ".join(f"{k} {n:.2f}" for k, n in kinds.items()) or "not counted") for v, kinds in worst.items())


def _memory(rows: dict, missing: str | None) -> tuple[bool, str]:
    plain = rows.get("plain", {}).get("peak_memory_mib")
    if missing or not plain:
        return False, missing or "plain's peak was not measured"
    extra = {v: rows.get(v, {}).get("extra_memory_mib") for v in LEVELS}
    ok = all(m is not None and m <= MEMORY_BOUND * plain for m in extra.values())
    return ok, f"plain's peak {plain:,.0f} MiB; " + ", ".join(
        f"{v}: {'—' if m is None else f'{m:+.0f} MiB ({m / plain:+.2%})'}" for v, m in extra.items())


def _bandwidth(part: dict | None) -> tuple[bool, str]:
    if part is None:
        return False, ""
    if part["status"] == "error":
        return False, f"part errored: {part['error']}"
    result = part["result"]
    name = result.get("default_algorithm")
    row = result["algorithms"].get(name) or {"status": "unavailable", "error": f"no default algorithm ({name})"}
    if row["status"] != "ok":
        return False, f"{name}: {row['error']}"
    # The device's pace: calls back to back, as on a sampled step (the host's time per call, shown
    # beside, hides behind backward there). A tree without the pipelined figure: one call's.
    gbps = row.get("pipelined_gbps", row["gbps"])
    share = gbps / result["reference_gbps"] if result.get("reference_gbps") else row["share_of_copy"]
    warned = "".join(f"; warned: {w}" for w in row.get("warnings", ()))
    return share >= BANDWIDTH_BOUND, (f"{name}: {_gbps(gbps)} back to back ({_gbps(row['gbps'])} for one call "
                                      f"alone), {share:.1%} of {_gbps(result['reference_gbps'])} "
                                      f"({result['peak_source']}){warned}")


def _gbps(value: float) -> str:
    return f"{value:,.0f} GB/s" if value >= 100 else f"{value:.3g} GB/s"


# -- the report ----------------------------------------------------------------------------------
def write(report: dict, path: Path) -> None:
    report["checks"] = evaluate(report)
    report["passed"] = not any(c["status"] == "fail" for c in report["checks"]) and not any(
        p["status"] == "error" for p in _parts(report["parts"]))
    report["baseline_errors"] = sum(p["status"] == "error" for p in _parts(report.get("baseline_tree", {}).get("parts", {})))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))


def _parts(parts: dict) -> list[dict]:
    return [parts[k] for k in ("tests", "stats", "profile") if k in parts] + [
        p for groups in parts.get("overhead", {}).values() for p in groups.values()]


def print_summary(report: dict) -> None:
    base = report.get("baseline_tree")
    print(f"\n{report['device']} ({report['device_type']}), torch {report['torch']}, CUDA {report['cuda']}, "
          f"commit {report['git_commit']}{' (dirty)' if report['git_dirty'] else ''}"
          + (f"; baseline tree {base['path']} at {base['git_commit']}" if base else ""))
    from overhead import print_table
    trees = [("", report["parts"])] + ([("baseline tree: ", base["parts"])] if base else [])
    for size in report["parts"].get("overhead", {}):
        for group in GROUPS:
            for label, parts in trees:
                part = parts.get("overhead", {}).get(size, {}).get(group)
                if part is None:
                    continue
                print(f"\n[{label}{size} {group}]" + ("" if part["status"] == "ok" else " error, see the JSON"))
                if part["status"] == "ok":
                    print_table(part["result"]["results"], prefix="  ")
    for label, parts in trees:
        part = parts.get("stats")
        if part and part["status"] == "ok":
            r = part["result"]
            rows = [f"{name} {_gbps(a['gbps'])}" + (f" ({a['share_of_peak']:.1%} of peak)" if a["share_of_peak"] else "")
                    + (" (warned, see the JSON)" if a.get("warnings") else "")
                    if a["status"] == "ok" else f"{name} {a['status']}" for name, a in r["algorithms"].items()]
            print(f"\n[{label}stats] {r['elements'] / 1e6:.1f} M elements, peak {_gbps(r['reference_gbps'])} "
                  f"({r['peak_source']}), copy {_gbps(r['copy']['gbps'])}: " + "; ".join(rows))
    part = report["parts"].get("profile")
    if part and part["status"] == "ok":
        print()
        from step_profile import print_rows
        print_rows(part["result"])
    print()
    for c in report["checks"]:
        print(f"{c['status'].upper():<5} {c['name']}: {c['detail']}")
    for label, parts in trees:
        for p in _parts(parts):
            if p["status"] == "error":
                print(f"ERROR {label}{p['error']}")


def device_info(device: str) -> dict:
    info = {"device_type": device, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version()}
    try:
        info["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        info["triton"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count,
                    cudnn=torch.backends.cudnn.version())
    else:
        info["device"] = platform.processor() or platform.machine()
    return info


def provenance(tree: Path, commit: str | None) -> dict:
    """The commit of ``tree`` (``commit`` as given, else git's), and a digest of its ampdoctor
    sources. A given commit wins: the GPU machine's copy of the checkout may carry a ``.git`` of
    another commit than its working tree (seen: the session's first commit)."""
    found, dirty = (None, None) if commit else git_state(tree)
    package = tree / "ampdoctor"
    return {"path": str(tree), "git_commit": commit or found, "git_dirty": dirty,
            "commit_source": "command line" if commit else "git" if found else None,
            "package_digest": package_digest(package) if package.is_dir() else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a smoke run of the protocol (the CUDA tests skip, no checks apply)")
    parser.add_argument("--parts", type=lambda s: s.split(","), default=["tests", "overhead", "stats", "profile"],
                        help="comma-separated: tests, overhead, stats, profile (default all)")
    parser.add_argument("--sizes", type=lambda s: s.split(","), default=None,
                        help=f"comma-separated of {', '.join(SIZES)}; the step bounds are checked on the first "
                             "(default: gpt2 on cuda, tiny on cpu)")
    parser.add_argument("--steps", type=int, default=None, help=f"steady rounds of the ampdoctor group (default: {STEPS})")
    parser.add_argument("--sampled-steps", type=int, default=None, help="sampled steps timed per variant")
    parser.add_argument("--module-steps", type=int, default=None, help="module-sampled steps timed (level full)")
    parser.add_argument("--blocks", type=int, default=None, help="blocks of freshly built variants")
    parser.add_argument("--after", type=int, default=4, help="steps after each event counted into its cost")
    parser.add_argument("--baseline-steps", type=int, default=20,
                        help="measured steps per variant of the baselines group (hf-debug, detect-anomaly)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per block")
    # The files that hold cuda-marked tests: collecting all of tests/ would import hypothesis and
    # transformers, which the GPU machine's image lacks.
    parser.add_argument("--tests", nargs="+", default=["tests/test_cuda.py", "tests/test_integrations.py"],
                        help="what pytest collects (-m cuda)")
    parser.add_argument("--stats-elements", type=int, default=None,
                        help="gradient elements of the bandwidth benchmark (default: 100 M on cuda, 200 k on cpu)")
    parser.add_argument("--stats-seconds", type=float, default=5.0, help="timed seconds per algorithm at most")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="an older checkout (holding ampdoctor/) measured by the same overhead and stats scripts")
    parser.add_argument("--baseline-parts", type=lambda s: s.split(","), default=["overhead", "stats"],
                        help="what runs on the baseline tree: overhead, stats (default both)")
    parser.add_argument("--commit", default=None, help="this checkout's commit where git cannot tell (no .git)")
    parser.add_argument("--baseline-commit", default=None, help="the baseline tree's commit where git cannot tell")
    parser.add_argument("--budget", type=float, default=570.0,
                        help="seconds from the start after which a part's process is stopped (default 570)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"gpu_protocol: no CUDA GPU available (torch {torch.__version__}); "
                 "--device cpu runs a smoke test of the protocol instead")
    args.sizes = args.sizes or (["gpt2"] if args.device == "cuda" else ["tiny"])
    if unknown := (set(args.sizes) - set(SIZES) or set(args.parts) - {"tests", "overhead", "stats", "profile"}
                   or set(args.baseline_parts) - {"overhead", "stats"}):
        parser.error(f"unknown: {', '.join(sorted(unknown))}")
    if args.baseline_tree is not None:
        args.baseline_tree = args.baseline_tree.resolve()
        if not (args.baseline_tree / "ampdoctor").is_dir():
            parser.error(f"--baseline-tree {args.baseline_tree} holds no ampdoctor/ package")

    info = device_info(args.device)
    today = datetime.date.today().isoformat()
    current = provenance(ROOT, args.commit)
    slug = re.sub(r"[^a-z0-9]+", "-", (info["device"] if args.device == "cuda" else f"cpu {info['device']}").lower()).strip("-")
    suffix = f"_{current['git_commit'][:7]}" if current["git_commit"] else ""
    path = args.out_dir / f"gpu_protocol_{slug}_{today}{suffix}.json"
    report = {"protocol": "gpu (issues 17, 26)", "date": today, **info, "git_commit": current["git_commit"],
              "git_dirty": current["git_dirty"], "commit_source": current["commit_source"],
              "package_digest": current["package_digest"], "command": " ".join(sys.argv),
              "settings": {k: v for k, v in vars(args).items() if k != "out_dir"}, "complete": False, "parts": {}}
    if args.baseline_tree is not None:
        report["baseline_tree"] = {**provenance(args.baseline_tree, args.baseline_commit), "parts": {}}

    budget, start = Budget(args.budget), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ampdoctor-protocol-") as tmp:
        for label, parts, fn, fn_args in jobs(args, budget, Path(tmp), report):
            print(f"[{label}]", flush=True)
            part = _part(fn, *fn_args)
            parts(part)
            print(f"[{label}] {_status_line(part)} ({part['seconds']:.0f} s)", flush=True)
            write(report, path)
    report["complete"], report["seconds"] = True, round(time.perf_counter() - start, 1)
    write(report, path)
    print_summary(report)
    ok = report["passed"] and not report["baseline_errors"]
    print(f"{'PASS' if report['passed'] else 'FAIL'}"
          + (f"; but {report['baseline_errors']} part(s) of the baseline tree errored (exit status 1)"
             if report["baseline_errors"] else "")
          + f"; wrote {path}")
    return 0 if ok else 1


def jobs(args, budget: Budget, tmp: Path, report: dict):
    """The parts in order, each as (label, where its result goes, function, arguments): what a
    check needs first, so that a run cut off by the budget loses the least."""
    def into(tree: dict, *keys):
        def put(part):
            node = tree
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            node[keys[-1]] = part
        return put

    current, base = report["parts"], report.get("baseline_tree", {}).get("parts")
    if "tests" in args.parts:
        yield "tests", into(current, "tests"), run_tests, (args, budget, tmp)
    for size in args.sizes if "overhead" in args.parts else ():
        cmd = overhead_args(args, size, "ampdoctor")
        yield (f"overhead {size} ampdoctor", into(current, "overhead", size, "ampdoctor"), run_script,
               ("overhead.py", cmd, ROOT, budget, tmp, f"overhead_{size}"))
        if base is not None and "overhead" in args.baseline_parts:
            yield (f"baseline tree: overhead {size} ampdoctor", into(base, "overhead", size, "ampdoctor"), run_script,
                   ("overhead.py", cmd, args.baseline_tree, budget, tmp, f"base_overhead_{size}"))
    if "stats" in args.parts:
        yield "stats", into(current, "stats"), run_script, ("stats_bandwidth.py", stats_args(args), ROOT, budget, tmp, "stats")
        if base is not None and "stats" in args.baseline_parts:
            yield ("baseline tree: stats", into(base, "stats"), run_script,
                   ("stats_bandwidth.py", stats_args(args), args.baseline_tree, budget, tmp, "base_stats"))
    if "profile" in args.parts:
        yield "profile", into(current, "profile"), run_script, ("step_profile.py", profile_args(args), ROOT, budget, tmp,
                                                                "profile")
    for size in args.sizes if "overhead" in args.parts else ():
        yield (f"overhead {size} baselines", into(current, "overhead", size, "baselines"), run_script,
               ("overhead.py", overhead_args(args, size, "baselines"), ROOT, budget, tmp, f"overhead_{size}_baselines"))


def _status_line(part: dict) -> str:
    if part["status"] == "error":
        return f"error: {part['error'].splitlines()[-1] if part['error'] else ''}"
    result = part["result"]
    if "summary" in result:
        return result["summary"]
    return "ok"


if __name__ == "__main__":
    sys.exit(main())
