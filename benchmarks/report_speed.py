"""How fast the reading commands read a long multi-rank run, and how much memory they take.

Writes synthetic runs (valid segments of the real schema, as the recorder writes them at its default
options: step rows, parameter-gradient rows light between full ones every 100 steps, measured
underflow every 1000, a few overflows and a NaN loss at 90% of the run; for ``fp8`` a run at
level "full" whose rows are GEMM operands), then runs each command as a user does
(``ampdoctor COMMAND RUN --format json``) in a fresh process and measures its wall time and peak
resident memory (the child's ``ru_maxrss``). Prints a table and writes JSON.

    python benchmarks/report_speed.py                              # 1 M (4 ranks), 10 M (16), 40 M (64)
    python benchmarks/report_speed.py --sizes 400M:1024 --keep /data/runs   # the largest (6.5 GB of runs)
    python benchmarks/report_speed.py --sizes 1M:4 --every 1       # every row full: the heaviest per row
    python benchmarks/report_speed.py --schema-version 1 --json /tmp/v1.json   # the old hist encoding
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ampdoctor import __version__
from ampdoctor.read.run import read_run
from ampdoctor.run_file.hist_column import _lists as hist_lists
from ampdoctor.record.options import DEFAULT_EVERY, DEFAULT_MODULE_EVERY
from ampdoctor.run_file.fine_bins import FINE_SHIFT
from ampdoctor.run_file.schema import (FINE_BINS, GEMM_KINDS, HIST_BINS, HIST_MIN_EXP, META_AMP_DTYPE,
                                       META_BACKOFF_FACTOR, META_DEVICE, META_FINAL, META_GROWTH_FACTOR,
                                       META_GROWTH_INTERVAL, META_HIST_BINS, META_HIST_MIN_EXP, META_INIT_SCALE,
                                       META_LEVEL, META_RANK, META_RUN_ID, META_RUN_STARTED, META_SCALER_CLASS,
                                       META_SCALER_ENABLED, META_SCHEMA_VERSION, META_SEGMENT, META_TORCH_VERSION,
                                       META_VERSION, META_WORLD_SIZE, META_WRITER, SCHEMA_VERSION, run_schema)

PARAMS = 99            # parameter rows per step and rank (+1 step row: 100 rows per step and rank)
STEPS_PER_SEGMENT = 500


def write_synthetic_run(path: Path, rows: int, ranks: int, seed: int = 0, version: int = SCHEMA_VERSION,
                        every: int = DEFAULT_EVERY, measure_every: int = DEFAULT_MODULE_EVERY,
                        nan_at: float | None = None, gemm: bool = False) -> int:
    """A run of about ``rows`` rows; returns the number of steps. Gradients shrink slowly, the
    scale grows every 2000 steps and backs off on a few injected overflows.

    As the recorder writes at its default options: full rows (counts, histograms) every ``every``
    steps and on skipped ones, light rows (peak and norm only) on the others, measured underflow
    (``n_underflow``, ``underflow_hist``) every ``measure_every`` steps. ``every=1``: every row full,
    the heaviest a run can be per row. ``nan_at``: the loss turns NaN at that fraction of the run
    (every rank; the step skipped), the event ``postmortem`` explains. ``gemm``: a run at level
    "full" for ``ampdoctor fp8``: per step and rank a third of the rows are parameter gradients,
    the rest GEMM operands (input, weight, output gradient of :data:`GEMM_LAYERS` layers), light
    but on module-sampled steps (every ``measure_every``), where they hold a fine histogram."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    steps = max(1, rows // ((PARAMS + 1) * ranks))
    params = PARAMS - 3 * GEMM_LAYERS if gemm else PARAMS
    names = [f"blocks.{i // 6}.{['attn.qkv', 'attn.proj', 'mlp.fc1', 'mlp.fc2', 'ln1', 'ln2'][i % 6]}.weight"
             for i in range(params)]
    scale = np.empty(steps)
    skipped = rng.random(steps) < 0.002
    nan_step = None if nan_at is None else min(steps - 1, int(nan_at * steps))
    if nan_step is not None:
        skipped[nan_step] = True
    s, good = 2.0**16, 0
    for t in range(steps):
        scale[t] = s
        if skipped[t]:
            s, good = s / 2, 0
        else:
            good += 1
            if good == 2000:
                s, good = s * 2, 0
    numel = rng.integers(1_000, 3_000_000, params)
    for rank in range(ranks):
        writer = f"bench{rank}"
        for seg, start in enumerate(range(0, steps, STEPS_PER_SEGMENT)):
            stop = min(steps, start + STEPS_PER_SEGMENT)
            table = _segment(rng, names, numel, scale, skipped, start, stop, rank, version, every,
                             measure_every, nan_step)
            if gemm:
                table = pa.concat_tables([table, _gemm_rows(rng, scale, skipped, start, stop, rank, measure_every)]
                                         ).sort_by("step")  # (stable: each step's rows in the recorder's order)
            # (the keys the recorder writes: run_file.schema's, level included)
            meta = {META_SCHEMA_VERSION: str(version), META_VERSION: __version__, META_TORCH_VERSION: "bench",
                    META_SCALER_CLASS: "torch.amp.GradScaler", META_SCALER_ENABLED: "true",
                    META_INIT_SCALE: "65536.0", META_GROWTH_FACTOR: "2.0", META_BACKOFF_FACTOR: "0.5",
                    META_GROWTH_INTERVAL: "2000", META_AMP_DTYPE: "float16", META_DEVICE: "cuda",
                    META_WORLD_SIZE: str(ranks), META_LEVEL: "full" if gemm else "params",
                    META_HIST_MIN_EXP: str(HIST_MIN_EXP), META_HIST_BINS: str(HIST_BINS), META_RUN_ID: "bench",
                    META_RUN_STARTED: "", META_WRITER: writer, META_SEGMENT: str(seg),
                    META_FINAL: "true" if stop == steps else "false", META_RANK: str(rank)}
            table = table.replace_schema_metadata(meta)
            pq.write_table(table, path / f"part-r{rank:05d}-{writer}-{seg:06d}.parquet", compression="zstd")
    return steps


def _segment(rng, names, numel, scale, skipped, start, stop, rank, version, every, measure_every,
             nan_step=None) -> pa.Table:
    n_steps = stop - start
    p = len(names)
    per_step = p + 1
    n = n_steps * per_step
    step = np.repeat(np.arange(start, stop), per_step)
    kind_idx = np.tile(np.r_[0, np.ones(p, dtype=np.int32)], n_steps)
    name_idx = np.tile(np.r_[0, np.arange(1, p + 1)], n_steps)
    elements = np.tile(np.r_[numel.sum(), numel], n_steps)
    # log2 magnitude per row: a slow downward drift plus noise.
    centre = -12 - 3 * (step / max(1, scale.size)) + rng.normal(0, 1, n)
    amax = np.exp2(centre + 6)
    bins = np.clip((centre - HIST_MIN_EXP).astype(int)[:, None] + np.arange(-6, 7), 0, HIST_BINS - 1)
    hist = np.zeros((n, HIST_BINS), dtype=np.int32)
    weights = np.exp(-0.5 * (np.arange(-6, 7) / 2.5) ** 2)
    counts = (elements[:, None] * weights / weights.sum()).astype(np.int32)
    np.add.at(hist, (np.repeat(np.arange(n), bins.shape[1]), bins.ravel()), counts.ravel())
    zeros = (elements * 0.001).astype(np.int64)
    sk = np.repeat(skipped[start:stop], per_step)
    full = (step % every == 0) | sk
    measured = (step % measure_every == 0) & ~sk if measure_every else np.zeros(n, bool)
    lost = zeros // 2
    lost_hist = np.zeros((n, HIST_BINS), dtype=np.int64)
    lost_hist[:, 15] = lost
    schema = run_schema()
    dict_type = pa.dictionary(pa.int32(), pa.string())
    kinds = pa.DictionaryArray.from_arrays(pa.array(kind_idx, pa.int32()), pa.array(["step", "param_grad"]))
    names_arr = pa.DictionaryArray.from_arrays(pa.array(name_idx, pa.int32()), pa.array([""] + names))
    dtypes = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array(["float32"]))
    loss = np.where(kind_idx == 0, 2.0 + rng.normal(0, 0.1, n), np.nan)
    loss[(step == nan_step) & (kind_idx == 0)] = np.nan  # (a NaN loss: the step row's loss is recorded)
    light = ~full

    def nullable(values, mask=light):
        return pa.array(values, pa.int64(), mask=mask)

    def hists(matrix, mask):
        if version != 2:
            return pa.FixedSizeListArray.from_arrays(pa.array(matrix.ravel(), pa.int32()), HIST_BINS)
        # (null on the rows of ``mask``, as hist_array writes light rows)
        return hist_lists(np.where(mask, 0, HIST_BINS), pa.array(matrix[~mask].ravel(), pa.int64()))

    columns = {
        "step": pa.array(step, pa.int64()), "rank": pa.array(np.full(n, rank), pa.int32()),
        "kind": kinds.cast(dict_type), "name": names_arr.cast(dict_type), "order": pa.nulls(n, pa.int32()),
        "dtype": dtypes.cast(dict_type), "numel": pa.array(elements, pa.int64()),
        "scale": pa.array(np.repeat(scale[start:stop], per_step), pa.float32()), "skipped": pa.array(sk),
        "loss": pa.array(loss, pa.float32(), mask=kind_idx != 0),
        "amax": pa.array(np.where(sk, np.inf, amax), pa.float32()),
        "amin": pa.array(amax * 2.0**-20, pa.float32(), mask=light),
        "l2": pa.array(np.where(sk, np.inf, amax * 30), pa.float32()),
        "n_zero": nullable(zeros), "n_subnormal": nullable(zeros // 2),
        "n_nan": nullable(np.zeros(n, np.int64)), "n_inf": nullable(np.where(sk, 1, 0)),
        "hist": hists(hist, light),
        "n_zero_lines": nullable(np.zeros(n, np.int64)), "n_underflow": nullable(lost, ~measured),
        "underflow_hist": hists(lost_hist, ~measured) if version == 2 else pa.nulls(n, pa.list_(pa.int64())),
        "call": pa.nulls(n, pa.int32()), "parent": pa.nulls(n, pa.int32()),
        "inputs": pa.nulls(n, pa.list_(pa.int32())), "computed_inputs": pa.nulls(n, pa.list_(pa.int32())),
        "fine_hist": pa.nulls(n, pa.list_(pa.int64())), "block_stats": pa.nulls(n, pa.list_(pa.float64())),
    }
    if version == 1:  # schema version 1's fixed-size histograms, for comparison
        schema = schema.set(schema.get_field_index("hist"), pa.field("hist", columns["hist"].type))
    return pa.table([columns[f.name] for f in schema], schema=schema)


GEMM_LAYERS = 22  # GEMM layers of the fp8 run: 66 operand rows a step and rank


def _gemm_rows(rng, scale, skipped, start, stop, rank, measure_every) -> pa.Table:
    """The GEMM operand rows of steps ``start`` to ``stop`` of one rank (gemm_operands.py): per
    layer its input, weight and output gradient (their peaks, unscaled), light but on
    module-sampled steps, where they hold ``n_zero`` and a fine histogram (eight bins a binade)."""
    kinds = list(GEMM_KINDS)
    n_steps, per_step = stop - start, 3 * GEMM_LAYERS
    n = n_steps * per_step
    step = np.repeat(np.arange(start, stop), per_step)
    layer = np.tile(np.repeat(np.arange(GEMM_LAYERS), 3), n_steps)
    kind_idx = np.tile(np.arange(3), n_steps * GEMM_LAYERS)
    # Inputs near 1, weights near 2^-4, output gradients near 2^-20 (one layer in eleven with an outlier).
    centre = np.array([0.0, -4.0, -20.0])[kind_idx] + np.where(layer % 11 == 3, 9.0, 0.0) + rng.normal(0, 0.3, n)
    amax = np.exp2(centre + 3).astype(np.float32)
    sampled = (step % measure_every == 0) if measure_every else np.zeros(n, bool)
    top = (amax.view(np.int32) >> FINE_SHIFT).astype(np.int64)  # the peak's fine bin
    offsets = np.arange(-96, 1)  # twelve binades below the peak, falling off towards it from the bulk
    weights = np.exp(-0.5 * ((offsets + 40) / 14.0) ** 2)
    numel = np.where(kind_idx == 1, 1 << 20, 1 << 22).astype(np.int64)
    fine = np.zeros((int(sampled.sum()), FINE_BINS), dtype=np.int64)
    at = np.flatnonzero(sampled)
    counts = (numel[at, None] * weights / weights.sum()).astype(np.int64)
    np.add.at(fine, (np.repeat(np.arange(len(at)), len(offsets)), (top[at, None] + offsets).ravel()), counts.ravel())
    dict_type = pa.dictionary(pa.int32(), pa.string())
    names = [f"blocks.{i // 4}.{['attn.qkv', 'attn.proj', 'mlp.fc1', 'mlp.fc2'][i % 4]}" for i in range(GEMM_LAYERS)]
    lengths = np.where(sampled, FINE_BINS, 0)
    columns = {
        "step": pa.array(step, pa.int64()), "rank": pa.array(np.full(n, rank), pa.int32()),
        "kind": pa.DictionaryArray.from_arrays(pa.array(kind_idx, pa.int32()), pa.array(kinds)).cast(dict_type),
        "name": pa.DictionaryArray.from_arrays(pa.array(layer, pa.int32()), pa.array(names)).cast(dict_type),
        "order": pa.array(np.where(kind_idx == 2, GEMM_LAYERS - layer, 0), pa.int32(), mask=kind_idx != 2),
        "dtype": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array(["bfloat16"])
                                                ).cast(dict_type),
        "numel": pa.array(numel, pa.int64()),
        "scale": pa.array(np.repeat(scale[start:stop], per_step), pa.float32()),
        "skipped": pa.array(np.repeat(skipped[start:stop], per_step)),
        "amax": pa.array(amax, pa.float32()), "call": pa.array(layer, pa.int32()),
        "n_zero": pa.array(np.zeros(n, np.int64), pa.int64(), mask=~sampled),
        "fine_hist": hist_lists(lengths, pa.array(fine.ravel(), pa.int64())),
    }
    schema = run_schema()
    return pa.table([columns[f.name] if f.name in columns else pa.nulls(n, f.type) for f in schema], schema=schema)


COMMANDS = ("report", "postmortem", "layers", "info", "fp8")


def measure(path: Path, command: str) -> dict:
    """``ampdoctor COMMAND RUN --format json`` in a fresh process, as a user runs it: its wall
    time, peak resident memory (the child's ``ru_maxrss``) and exit code."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        started = time.perf_counter()
        with open(out, "w") as stdout:
            child = subprocess.run([sys.executable, "-c", _CHILD, command, str(path), "--format", "json"],
                                   stdout=stdout, stderr=subprocess.PIPE, text=True)
        seconds = time.perf_counter() - started
        lines = child.stderr.strip().splitlines()
        peak = json.loads(lines.pop())["peak_rss_mib"]
        return {"seconds": seconds, "peak_rss_mib": peak, "exit": child.returncode,
                **({"error": lines[-1]} if child.returncode and lines else {})}


# The command line in a child that says its own peak memory last (a forked child's ``ru_maxrss``
# would start from the parent's).
_CHILD = """
import json, resource, sys
from ampdoctor.cli import main
try:
    main()
finally:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    sys.stderr.write("\\n" + json.dumps({"peak_rss_mib": peak}) + "\\n")
"""


def _size(text: str) -> tuple[int, int]:
    """``ROWS:RANKS`` with ``ROWS`` as 40M, 400M, 1000000."""
    rows, _, ranks = text.partition(":")
    factor = {"K": 10**3, "M": 10**6, "G": 10**9}.get(rows[-1:].upper(), 1)
    return int(float(rows[:-1] if factor > 1 else rows) * factor), int(ranks or 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_size, nargs="+", default=[_size("1M:4"), _size("10M:16"), _size("40M:64")],
                        help="runs to write, as ROWS:RANKS (40M:64)")
    parser.add_argument("--commands", nargs="+", choices=COMMANDS, default=list(COMMANDS))
    parser.add_argument("--every", type=int, default=DEFAULT_EVERY,
                        help="steps between full rows (the recorder's default; 1: every row full)")
    parser.add_argument("--schema-version", type=int, choices=[1, SCHEMA_VERSION], default=SCHEMA_VERSION,
                        help="the hist encoding written: 1 (fixed-size lists) for comparison")
    parser.add_argument("--keep", help="write the runs under this directory and keep them (reused when there)")
    parser.add_argument("--json", default="benchmarks/results/report_speed.json")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        for rows, ranks in args.sizes:
            for gemm in sorted({c == "fp8" for c in args.commands}):
                path = root / f"run-{rows}-{ranks}-every{args.every}-v{args.schema_version}{'-gemm' if gemm else ''}"
                written = None  # (a kept run reused: not written here)
                if not path.exists():
                    t = time.perf_counter()
                    write_synthetic_run(path, rows, ranks, version=args.schema_version, every=args.every,
                                        nan_at=0.9, gemm=gemm)
                    written = time.perf_counter() - t
                steps = read_run(path).step_range()[1] + 1
                size = sum(f.stat().st_size for f in path.iterdir())
                for command in (c for c in args.commands if (c == "fp8") == gemm):
                    m = measure(path, command)
                    results.append({"command": command, "schema_version": args.schema_version, "rows": rows,
                                    "ranks": ranks, "steps": steps, "every": args.every, "gemm_rows": gemm,
                                    "size_mib": size / 2**20, "write_seconds": written, **m})
                    print(f"{command:<11} {rows:>12,} {ranks:>5} {m['seconds']:>7.1f}s {m['peak_rss_mib']:>7.0f}Mi "
                          f"exit {m['exit']}", flush=True)
    print(f"{'command':<11} {'rows':>12} {'ranks':>5} {'steps':>7} {'on disk':>9} {'time':>8} {'peak RSS':>10}")
    for r in results:
        print(f"{r['command']:<11} {r['rows']:>12,} {r['ranks']:>5} {r['steps']:>7} {r['size_mib']:>7.0f}Mi "
              f"{r['seconds']:>7.1f}s {r['peak_rss_mib']:>8.0f}Mi")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"benchmark": "report_speed", "machine": platform.machine(),
                                           "cpus": os.cpu_count(), "python": platform.python_version(),
                                           "ampdoctor": __version__, "commit": _commit(), "results": results},
                                          indent=2))
    print(f"wrote {args.json}")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
