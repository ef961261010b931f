"""benchmarks/gpu_protocol.py and benchmarks/overhead.py: a CPU smoke run writes every part and check
(with a baseline tree, and with one that does not import); the checks on a synthetic CUDA report; the
amortised step's arithmetic; the step kinds the overhead benchmark times are the ones the scaler
records; without a GPU the protocol says so in one line. No timed assertions."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_protocol.py"
sys.path.insert(0, str(SCRIPT.parent))

import gpu_protocol  # noqa: E402
import overhead  # noqa: E402
import step_profile  # noqa: E402

SMOKE = ["--device", "cpu", "--sizes", "tiny", "--steps", "2", "--sampled-steps", "1", "--module-steps", "1",
         "--after", "1", "--baseline-steps", "2", "--warmup", "1", "--tests", "tests/test_cuda.py",
         # Triton's interpreter takes seconds per call (conftest sets it): a small set, a short budget
         "--stats-elements", "20000", "--stats-seconds", "0.5"]


def _protocol(tmp_path, *extra, expect_rc=0) -> dict:
    proc = subprocess.run([sys.executable, str(SCRIPT), *SMOKE, *extra, "--out-dir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect_rc, proc.stdout + proc.stderr
    (path,) = tmp_path.glob("gpu_protocol_cpu-*.json")
    return json.loads(path.read_text())


def test_cpu_smoke_run(tmp_path):
    # The current tree as its own baseline tree: the second run of the scripts, through PYTHONPATH.
    report = _protocol(tmp_path, "--baseline-tree", str(ROOT), "--baseline-commit", "abc1234")
    assert report["device"] and report["device_type"] == "cpu" and report["complete"] and report["passed"]
    assert report["torch"] == torch.__version__ and "cuda" in report and "triton" in report
    assert report["package_digest"] and report["commit_source"] in ("git", "command line", None)
    tests = report["parts"]["tests"]["result"]
    assert tests["skipped"] > 0 and tests["passed"] == tests["failed"] == 0  # the cuda tests skip on the CPU
    for group, variants in gpu_protocol.GROUPS.items():
        part = report["parts"]["overhead"]["tiny"][group]
        assert part["status"] == "ok" and [r["variant"] for r in part["result"]["results"]] == variants
        assert all(r["amortised_ratio"] > 0 and r["steady_ratio"] > 0 for r in part["result"]["results"])
    rows = {r["variant"]: r for r in report["parts"]["overhead"]["tiny"]["ampdoctor"]["result"]["results"]}
    assert rows["ampdoctor:full"]["module_sampled_n"] == 1 and rows["ampdoctor:full"]["sampled_n"] == 1
    assert rows["ampdoctor:params"]["sampled_n"] == 2 and "module_sampled_n" not in rows["ampdoctor:params"]
    stats = report["parts"]["stats"]["result"]
    assert stats["algorithms"][stats["default_algorithm"]]["gbps"] > 0
    profile = report["parts"]["profile"]["result"]
    assert [r["variant"] for r in profile["rows"]] == step_profile.VARIANTS
    for r in profile["rows"]:
        assert r["wall_ms"] > 0 and r["host_ms"] > 0 and r["ops"] > 0 and r.get("steady_only", True)
    base = report["baseline_tree"]
    assert base["path"] == str(ROOT) and base["package_digest"] == report["package_digest"] and base["git_commit"]
    assert base["parts"]["overhead"]["tiny"]["ampdoctor"]["status"] == "ok" and base["parts"]["stats"]["status"] == "ok"
    assert report["baseline_errors"] == 0
    names = [c["name"] for c in report["checks"]]
    assert len(names) == 8 and all(c["status"] == "skip" for c in report["checks"])
    assert any("ampdoctor:full amortised <= 1.05x" in n for n in names) and any("syncs per step" in n for n in names)
    assert any("peak bandwidth" in n for n in names)


def test_baseline_that_does_not_import_is_an_errored_part(tmp_path):
    broken = tmp_path / "base" / "ampdoctor"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('an old tree that does not import')\n")
    report = _protocol(tmp_path / "out", "--parts", "stats", "--baseline-tree", str(tmp_path / "base"), expect_rc=1)
    assert report["complete"] and report["passed"] and report["baseline_errors"] == 1
    assert report["parts"]["stats"]["status"] == "ok"
    part = report["baseline_tree"]["parts"]["stats"]
    assert part["status"] == "error" and "an old tree that does not import" in part["error"]


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
def test_scripts_measure_the_tree_of_commit_f4c2999(tmp_path):
    """The scripts use only the API of f4c2999 (the tree before issue 26's changes)."""
    tree = tmp_path / "base"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", "f4c2999", "ampdoctor"], cwd=ROOT, capture_output=True)
    if archive.returncode:
        pytest.skip("commit f4c2999 is not in this clone")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    report = _protocol(tmp_path / "out", "--parts", "overhead,stats", "--baseline-tree", str(tree),
                       "--baseline-commit", "f4c2999")
    base = report["baseline_tree"]
    assert base["git_commit"] == "f4c2999" and base["commit_source"] == "command line"
    result = base["parts"]["overhead"]["tiny"]["ampdoctor"]["result"]
    assert result["ampdoctor_file"] == str(tree / "ampdoctor" / "__init__.py")
    assert base["parts"]["stats"]["status"] == "ok"


def _rows(amortised=(1.01, 1.04), syncs=None, memory=(0.0, 2.0, 40.0), sampled=1.2, module=1.9):
    syncs = syncs or {"ampdoctor:full": {"steady": 1.0, "sampled": 1.0, "module_sampled": 1.0}}
    rows = [{"variant": "plain", "amortised_ratio": 1.0, "steady_ratio": 1.0, "paired_ratio": 1.0,
             "syncs_per_step": 1.14, "syncs_by_kind": {"steady": 1.14}, "peak_memory_mib": 10_000.0,
             "extra_memory_mib": 0.0}]
    for variant, ratio, extra in zip(gpu_protocol.LEVELS, (1.0, *amortised), memory):
        rows.append({"variant": variant, "amortised_ratio": ratio, "steady_ratio": ratio, "paired_ratio": ratio,
                     "syncs_per_step": 1.0, "syncs_by_kind": syncs.get(variant, {"steady": 1.0, "sampled": 1.0}),
                     "peak_memory_mib": 10_000.0 + extra, "extra_memory_mib": extra,
                     "sampled_ratio": sampled, "sampled_cost_ratio": sampled, "sampled_n": 8,
                     "module_sampled_ratio": module, "module_sampled_cost_ratio": module, "module_sampled_n": 4})
    return {"status": "ok", "result": {"results": rows}}


def _stats(share=0.3, status="ok"):
    algorithms = {"host": {"status": "unavailable", "error": "ValueError: not for cuda"},
                  "accelerator": {"status": status, "gbps": 3350 * share, "share_of_peak": share,
                                  "share_of_copy": share * 1.1, "error": "boom"}}
    return {"status": "ok", "result": {"default_algorithm": "accelerator", "algorithms": algorithms,
                                       "reference_gbps": 3350.0, "peak_source": "table (H100)"}}


def _report(**parts):
    tests = {"status": "ok", "result": {"returncode": 0, "passed": 8, "failed": 0, "errors": 0, "skipped": 0,
                                        "failures": []}}
    return {"device_type": "cuda", "settings": {"parts": ["tests", "overhead", "stats"]},
            "parts": {"tests": tests, "stats": parts.pop("stats", _stats()), **parts}}


def test_checks_on_cuda():
    report = _report(overhead={"gpt2": {"ampdoctor": _rows()},
                               "gpt2-medium": {"ampdoctor": {"status": "error", "error": "OOM"}}})
    status = {c["name"]: c["status"] for c in gpu_protocol.evaluate(report)}
    assert status == {"CUDA tests pass": "pass",
                      "ampdoctor:params amortised <= 1.02x plain (gpt2)": "pass",
                      "ampdoctor:full amortised <= 1.05x plain (gpt2)": "pass",
                      "ampdoctor:params sampled step <= 1.25x plain (gpt2)": "pass",
                      "ampdoctor:full module-sampled step <= 2.0x plain (gpt2)": "pass",
                      "syncs per step <= plain's (gpt2)": "pass",  # fewer than plain's 1.14 passes
                      "extra GPU memory <= 1% of plain's peak (gpt2)": "pass",
                      "syncs per step <= plain's (gpt2-medium)": "fail",
                      "extra GPU memory <= 1% of plain's peak (gpt2-medium)": "fail",
                      "full statistics >= 25% of peak bandwidth": "pass"}


@pytest.mark.parametrize("change, failing", [
    (dict(amortised=(1.03, 1.04)), "ampdoctor:params amortised <= 1.02x plain (gpt2)"),
    (dict(amortised=(1.01, 1.06)), "ampdoctor:full amortised <= 1.05x plain (gpt2)"),
    (dict(amortised=(1.01, None)), "ampdoctor:full amortised <= 1.05x plain (gpt2)"),  # not measured
    (dict(sampled=1.3), "ampdoctor:params sampled step <= 1.25x plain (gpt2)"),
    (dict(module=2.5), "ampdoctor:full module-sampled step <= 2.0x plain (gpt2)"),
    # one sync more on a module-sampled step than plain's per step
    (dict(syncs={"ampdoctor:full": {"steady": 1.0, "sampled": 1.0, "module_sampled": 2.0}}),
     "syncs per step <= plain's (gpt2)"),
    (dict(syncs={"ampdoctor:steps": {}}), "syncs per step <= plain's (gpt2)"),  # not counted
    (dict(memory=(0.0, 2.0, 101.0)), "extra GPU memory <= 1% of plain's peak (gpt2)"),
])
def test_each_check_fails_alone(change, failing):
    status = {c["name"]: c["status"] for c in gpu_protocol.evaluate(_report(overhead={"gpt2": {"ampdoctor": _rows(**change)}}))}
    assert [name for name, s in status.items() if s == "fail"] == [failing]


@pytest.mark.parametrize("stats, detail", [
    (_stats(share=0.2), "20.0% of"),
    (_stats(status="unavailable"), "boom"),
    ({"status": "error", "error": "RuntimeError: CUDA out of memory"}, "out of memory"),
])
def test_bandwidth_check_fails(stats, detail):
    checks = gpu_protocol.evaluate(_report(stats=stats, overhead={"gpt2": {"ampdoctor": _rows()}}))
    (check,) = [c for c in checks if "bandwidth" in c["name"]]
    assert check["status"] == "fail" and detail in check["detail"]


def test_amortised_step():
    """amortised = steady + E per kind x its share of a user's steps, E with the after-steps; each
    step counted once, as its most costly kind (by default every module-sampled step is measured)."""
    rows = [(0, ("steady", 0), 1.0), (1, ("sampled", 0), 3.0), (2, ("sampled", 1), 1.5), (3, ("sampled", 2), 1.0),
            (4, ("module_sampled", 0), 11.0), (5, ("module_sampled", 1), 2.0), (6, ("module_sampled", 2), 1.0),
            (7, ("steady", 0), 1.0), (8, ("steady", 0), 1.0),
            (9, ("measured", 0), 21.0), (10, ("measured", 1), 2.0), (11, ("measured", 2), 1.0)]
    samples = {"plain": overhead.Samples([(r, ("steady", 0), 0.5) for r in range(12)]),
               "ampdoctor:full": overhead.Samples(rows),
               "ampdoctor:params": overhead.Samples(rows[:4] + rows[7:])}
    full, params = overhead.summarize(["plain", "ampdoctor:full", "ampdoctor:params"], samples, set(), after=2)[1:]
    assert full["sampled_extra_ms"] == pytest.approx(2500) and full["module_sampled_extra_ms"] == pytest.approx(11000)
    assert full["measured_extra_ms"] == pytest.approx(21000)
    assert full["amortised_ratio"] == pytest.approx((1 + 2.5 * (1 / 100 - 1 / 1000) + 21 / 1000) / 0.5)
    assert params["amortised_ratio"] == pytest.approx((1 + 2.5 * (1 / 100 - 1 / 1000) + 21 / 1000) / 0.5)
    assert full["steady_ratio"] == pytest.approx(2.0) and full["module_sampled_ratio"] == pytest.approx(22.0)
    # Without its measured steps timed, an amortised figure is not given.
    partial = overhead.summarize(["plain", "ampdoctor:full"], {**samples, "ampdoctor:full": overhead.Samples(rows[:9])},
                                 set(), after=2)[1]
    assert partial["amortised_ratio"] is None
    # A skipped step's rounds are left out of every variant, plain's included.
    left_out = overhead.summarize(["plain", "ampdoctor:full"], samples, {7, 8}, after=2)[1]
    assert left_out["steady_n"] == 1


def test_cadences():
    full, params, every10 = (overhead.Cadence.of(overhead.OPTIONS[f"ampdoctor:{v}"]) for v in ("full", "params", "full-every10"))
    assert (full.every, full.module_every, params.module_every, every10.module_every) == (100, 1000, None, 10)
    assert (full.measure_every, params.measure_every, every10.measure_every) == (1000, 1000, 1000)
    assert full.next_step(5, "sampled") == 100 and full.next_step(901, "sampled") == 1100
    assert full.next_step(5, "module_sampled") == 1000 and full.next_step(100, "steady") == 101
    # The benchmark's scalers measure every other measured step of a user's (timing_measure_every).
    assert full.next_step(5, "measured") == 2000 and params.next_step(5, "measured") == 2000
    assert full.kind(1000) == "measured" and full.timed_kind(1000) == "module_sampled"
    assert params.available("module_sampled") == "sampled" and every10.available("sampled") == "steady"
    assert full.weights() == pytest.approx({"sampled": 0.009, "module_sampled": 0.0, "measured": 0.001})
    assert every10.weights() == pytest.approx({"sampled": 0.0, "module_sampled": 0.099, "measured": 0.001})
    units = overhead.schedule(3, 1, 1, 2, random.Random(0), measured=1)
    assert sorted(map(len, units)) == [1, 1, 1, 3, 3, 3]
    assert overhead.labels(units, None) == [("steady", 0)] * 12
    assert [k for k, _ in overhead.labels(units, every10)].count("module_sampled") == 3  # 1 event + 2 after


def test_overhead_times_the_step_kinds_the_scaler_records(tmp_path):
    """Moving the step counter (state_dict / load_state_dict) makes exactly the planned steps sampled,
    module-sampled and measured: read back from the run."""
    import ampdoctor

    (v,) = overhead.make_variants(["ampdoctor:full"], "tiny", "cpu", tmp_path)
    data = list(overhead.batches("tiny", "cpu", 9))
    plan = ["steady", "sampled", "steady", "module_sampled", "steady", "measured", "steady", "steady"]
    overhead.train_step(v, data[0], torch.bfloat16, "cpu")  # step 0: sampled and module-sampled
    steps = {}
    for kind, batch in zip(plan, data[1:]):
        v.move_to(kind)
        steps[v.step] = kind
        overhead.train_step(v, batch, torch.bfloat16, "cpu")
    v.check_step()
    v.scaler.close()
    run = ampdoctor.load(v.path)
    assert sorted(set(run["step"])) == [0, *steps]
    hist = run[run["kind"] == "param_grad"].groupby("step")["hist"].apply(lambda h: h.notna().all())
    modules = set(run.loc[run["kind"] == "grad_output", "step"])
    assert {s for s in steps if hist[s]} == {s for s, k in steps.items() if k != "steady"}
    assert modules == {0} | {s for s, k in steps.items() if k in ("module_sampled", "measured")}
    measured = set(run.loc[run["n_underflow"].notna(), "step"])
    assert measured == {0} | {s for s, k in steps.items() if k == "measured"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")
def test_no_gpu_is_one_line():
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "no CUDA GPU" in proc.stderr


def test_kernels_are_device_events_but_copies_memsets_and_annotations():
    from types import SimpleNamespace
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name="gemm", device_type=cuda), SimpleNamespace(name="aten::mm", device_type=cpu),
              SimpleNamespace(name="Memcpy HtoD", device_type=cuda), SimpleNamespace(name="Memset", device_type=cuda),
              SimpleNamespace(name="Optimizer.step#AdamW.step", device_type=cuda, is_user_annotation=True),
              SimpleNamespace(name="triton_tile", device_type=cuda, is_user_annotation=False)]
    assert [e.name for e in step_profile.kernel_events(events)] == ["gemm", "triton_tile"]


def test_busy_time_is_the_union_of_the_kernels_intervals():
    assert step_profile.busy_union([]) == 0
    assert step_profile.busy_union([(0, 2), (1, 3), (5, 6), (5.5, 5.7), (10, 10)]) == 4
    assert step_profile.busy_union([(3, 4), (0, 10)]) == 10


def test_a_full_steady_step_costs_more_ops_than_params_and_every_step_is_steady(tmp_path):
    """step_profile on the CPU: the steps it times are steady ones (the sampled step is kept out),
    and full's taps add ops per module over params (two aminmax per tapped module)."""
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(SCRIPT.parent / "step_profile.py"), "--device", "cpu", "--size", "tiny",
                           "--steps", "3", "--warmup", "1", "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["ampdoctor:params"]["steady_only"] and rows["ampdoctor:full"]["steady_only"]
    assert rows["ampdoctor:full"]["ops"] > rows["ampdoctor:params"]["ops"] > rows["plain"]["ops"]
    assert all(r["process_ms"] >= r["host_ms"] * 0.9 for r in rows.values())
    events = {r["variant"]: r for r in json.loads(out.read_text())["events"]}
    assert list(events) == ["ampdoctor:params (sampled)", "ampdoctor:full (sampled)", "ampdoctor:full (module-sampled)"]
    # full statistics cost ops on the sampled steps; the module taps' full statistics more still
    assert events["ampdoctor:full (module-sampled)"]["ops"] > events["ampdoctor:full (sampled)"]["ops"] > rows[
        "ampdoctor:full"]["ops"]
    assert "per steady step" in proc.stdout
