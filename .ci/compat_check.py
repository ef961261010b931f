"""The compatibility job's checks, run by `.ci/compat` with each environment's interpreter.

    python compat_check.py write DIR [NAME…]   # train demo runs into DIR (healthy, nan, overflow)
    python compat_check.py read OUT.json DIR…  # every reading command on every run under DIR…
    python compat_check.py same A.json B.json  # two environments read the same runs alike
    python compat_check.py refuses RUN TEXT…   # every reading command exits 2 with one line holding TEXT
    python compat_check.py charts RUN TEXT     # the HTML report says TEXT where the charts would be

Each check exits non-zero, naming what failed, at the first problem. Commands run in-process
through click's test runner (one interpreter start per environment), except one real `ampdoctor`
console script per mode, so that the installed entry point is checked too.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from click.testing import CliRunner

from ampdoctor.cli.commands import main

RUNS = {"healthy": ["--steps", "40"], "nan": ["--scenario", "nan"], "overflow": ["--scenario", "overflow"]}
FORMATS = {"info": ["text", "json"], "report": ["text", "md", "json", "html"], "simulate": ["text", "md", "json"],
           "layers": ["text", "md", "json"], "postmortem": ["text", "md", "json", "html"]}


def versions() -> str:
    """The reading environment, from the installed distributions (importing none: in the broken
    environments the point is that some do not import)."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "none"
    return f"python {sys.version.split()[0]}, " + ", ".join(
        f"{name} {version(name)}" for name in ("torch", "numpy", "pandas", "pyarrow", "matplotlib"))


def fail(message: str) -> None:
    sys.exit(f"compat: FAILED in [{versions()}]: {message}")


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def write(out: Path, names: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for i, (name, args) in enumerate((n, RUNS[n]) for n in names or RUNS):
        path = out / f"{name}.parquet"
        if i == 0:  # the installed console script, once
            proc = subprocess.run(["ampdoctor", "demo", *args, "--out", str(path)], capture_output=True, text=True,
                                  timeout=600)
            code, output = proc.returncode, proc.stdout + proc.stderr
        else:
            code, output = invoke("demo", *args, "--out", path)
        if code != 0 or not path.is_dir():
            fail(f"demo {' '.join(args)} exited {code}: {output[-2000:]}")
    print(f"compat: wrote {', '.join(names or RUNS)} with {versions()}")


def _clean(output: str, command: str, fmt: str) -> object:
    if "Traceback" in output or "internal error" in output:
        fail(f"{command} --format {fmt}: {output[-2000:]}")
    if fmt == "json":
        return json.loads(output)
    if fmt == "html" and not output.lstrip().startswith("<!DOCTYPE html>"):
        fail(f"{command} --format html is not a page: {output[:200]}")
    if not output.strip():
        fail(f"{command} --format {fmt} printed nothing")
    return None


def read(out_json: Path, dirs: list[Path]) -> None:
    import ampdoctor

    runs = sorted(p for d in dirs for p in d.glob("*.parquet") if p.is_dir())
    if len(runs) < 2:
        fail(f"fewer than two runs under {dirs}")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            key = f"{run.parent.name}/{run.name}"
            got = results[key] = {}
            for command, formats in FORMATS.items():
                for fmt in formats:
                    target = Path(tmp) / f"out.{fmt}"
                    args = [command, run, "--format", fmt] + ([] if fmt in ("text", "json") else ["-o", target])
                    code, output = invoke(*args)
                    if code != 0:
                        fail(f"{' '.join(map(str, args))} exited {code}: {output[-2000:]}")
                    text = target.read_text() if fmt not in ("text", "json") else output
                    parsed = _clean(text, command, fmt)
                    if parsed is not None:
                        got[command] = parsed
            # fp8: every format on a run recorded at level="full" (its GEMM operand rows); one line
            # naming what it lacks, exit 2, on the others
            full_level = got["info"].get("kinds", {}).get("gemm_weight", 0) > 0
            for fmt in ("text", "md", "json", "html"):
                target = Path(tmp) / f"fp8.{fmt}"
                args = ["fp8", run, "--format", fmt] + ([] if fmt in ("text", "json") else ["-o", target])
                code, output = invoke(*args)
                if not full_level:
                    if code != 2 or "no FP8 operand statistics" not in output or "Traceback" in output:
                        fail(f"{' '.join(map(str, args))} on a run without GEMM rows exited {code}: {output[-2000:]}")
                    break
                if code != 0:
                    fail(f"{' '.join(map(str, args))} exited {code}: {output[-2000:]}")
                parsed = _clean(target.read_text() if fmt not in ("text", "json") else output, "fp8", fmt)
                if parsed is not None:
                    got["fp8"] = parsed
            code, output = invoke("watch", run, "--timeout", "30", "--format", "json")
            if code != 0:
                fail(f"watch {run} exited {code}: {output[-2000:]}")
            frame = ampdoctor.load(run)
            gemm = frame["kind"].astype(str).str.startswith("gemm_")
            full = frame["n_zero"].notna() & ~gemm
            lengths = {len(h) for h in frame.loc[full, "hist"]}
            bins = int(frame.attrs["metadata"]["hist.bins"])
            if lengths != {bins} or frame.loc[~full & (frame["kind"] != "param"), "hist"].notna().any():
                fail(f"load({run}): histogram lengths {lengths}, expected {bins} on full rows and none elsewhere")
            if "fine_hist" in frame.columns:  # (runs before 2026-11-27 have no such column)
                fine = frame.loc[gemm & frame["n_zero"].notna(), "fine_hist"]
                if {len(h) for h in fine} - {2048} or frame.loc[~gemm, "fine_hist"].notna().any():
                    fail(f"load({run}): fine histograms of {sorted({len(h) for h in fine})} bins, or off GEMM rows")
            elif gemm.any():
                fail(f"load({run}): GEMM operand rows without a fine_hist column")
            got["load"] = {"rows": len(frame), "hist_total": int(sum(int(h.sum()) for h in frame.loc[full, "hist"]))}
        a, b = runs[0], runs[-1]
        for fmt in ("text", "md", "json", "html"):
            target = Path(tmp) / f"compare.{fmt}"
            code, output = invoke("compare", a, b, "--format", fmt, *([] if fmt in ("text", "json") else ["-o", target]))
            if code != 0:
                fail(f"compare {a} {b} --format {fmt} exited {code}: {output[-2000:]}")
            _clean(target.read_text() if fmt in ("md", "html") else output, "compare", fmt)
        code, output = invoke("export", runs[0], "--tensorboard", Path(tmp) / "tb")
        if code not in (0, 2) or (code == 2 and "tensorboard" not in output):
            fail(f"export exited {code}: {output[-2000:]}")
    proc = subprocess.run(["ampdoctor", "info", str(runs[0])], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        fail(f"the ampdoctor console script: info exited {proc.returncode}: {proc.stderr[-2000:]}")
    out_json.write_text(json.dumps(_portable(results), indent=1, sort_keys=True))
    print(f"compat: read {len(runs)} runs with every command ({versions()})")


# Keys whose values name this machine's paths or the reading environment, not what the run holds.
# `schema_version`: the file's encoding (a migrated run is the same run).
_LOCAL = {"path", "size_bytes", "a_path", "b_path", "command", "schema_version"}


def _portable(value):
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items() if k not in _LOCAL}
    if isinstance(value, list):
        return [_portable(v) for v in value]
    if isinstance(value, str) and os.sep in value and value.startswith(os.sep):
        return Path(value).name
    return value


def _differences(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}/{k}: only in one" for k in set(a) ^ set(b)]
        for k in set(a) & set(b):
            out += _differences(a[k], b[k], f"{where}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, (int, float)) or isinstance(b, float) and isinstance(a, (int, float)):
        # Another numpy or pandas may sum in another order: the last bits of a float may differ.
        if math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b)):
            return []
    return [] if a == b else [f"{where}: {str(a)[:80]!r} vs {str(b)[:80]!r}"]


def same(a: Path, b: Path) -> None:
    diffs = _differences(json.loads(a.read_text()), json.loads(b.read_text()))
    if diffs:
        fail(f"{a.name} and {b.name} read the same runs differently: {'; '.join(diffs[:10])}")
    print(f"compat: {a.name} and {b.name} agree")


def refuses(run: Path, text: str) -> None:
    for command in (*FORMATS, "fp8"):
        code, output = invoke(command, run)
        lines = [line for line in output.splitlines() if line.strip()]
        if code != 2 or len(lines) != 1 or text not in lines[0] or "Traceback" in output:
            fail(f"{command} {run}: expected exit 2 and one line with {text!r}, got {code}: {output[-1000:]}")
    print(f"compat: every command refuses {run.name} in one line: {lines[0]}")


def charts(run: Path, text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for command in (["report", run], ["postmortem", run], ["compare", run, run]):
            page = Path(tmp) / "page.html"
            code, output = invoke(*command, "--format", "html", "-o", page)
            html = page.read_text() if page.exists() else ""
            if code != 0 or text not in html or "<svg" in html or "Traceback" in output:
                fail(f"{command[0]} --format html: expected {text!r} in the page, got exit {code}: {output[-500:]}")
    print(f"compat: the report, postmortem and compare pages say {text!r}")


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "write":
        write(Path(rest[0]), rest[1:])
    elif mode == "read":
        read(Path(rest[0]), [Path(p) for p in rest[1:]])
    elif mode == "same":
        same(Path(rest[0]), Path(rest[1]))
    elif mode == "refuses":
        refuses(Path(rest[0]), " ".join(rest[1:]))
    elif mode == "charts":
        charts(Path(rest[0]), " ".join(rest[1:]))
    else:
        sys.exit(f"unknown mode {mode}")
