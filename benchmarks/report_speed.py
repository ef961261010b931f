"""How fast `ampdoctor report` and `postmortem` read a long multi-rank run, and how much memory they take.

Writes a synthetic run (valid segments of the real schema: step rows, and parameter-gradient rows
with histograms, for several ranks), then runs the report in a fresh process per size and measures
its wall time and peak resident memory (``ru_maxrss`` of the child). Prints a table and writes JSON.

    python benchmarks/report_speed.py                  # 1 M and 10 M rows, 4 ranks
    python benchmarks/report_speed.py --rows 1000000   # one size
    python benchmarks/report_speed.py --schema-version 1 --json /tmp/v1.json   # the old hist encoding
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
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
from ampdoctor.run_file.hist_column import hist_array
from ampdoctor.run_file.schema import (HIST_BINS, HIST_MIN_EXP, META_FINAL, META_SCHEMA_VERSION, META_SEGMENT,
                                       META_VERSION, META_WRITER, SCHEMA_VERSION, run_schema)

PARAMS = 99            # parameter rows per step and rank (+1 step row: 100 rows per step and rank)
STEPS_PER_SEGMENT = 500


def write_synthetic_run(path: Path, rows: int, ranks: int, seed: int = 0, version: int = SCHEMA_VERSION) -> int:
    """A run of about ``rows`` rows; returns the number of steps. Gradients shrink slowly, the
    scale grows every 2000 steps and backs off on a few injected overflows."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    steps = max(1, rows // ((PARAMS + 1) * ranks))
    names = [f"blocks.{i // 6}.{['attn.qkv', 'attn.proj', 'mlp.fc1', 'mlp.fc2', 'ln1', 'ln2'][i % 6]}.weight"
             for i in range(PARAMS)]
    scale = np.empty(steps)
    skipped = rng.random(steps) < 0.002
    s, good = 2.0**16, 0
    for t in range(steps):
        scale[t] = s
        if skipped[t]:
            s, good = s / 2, 0
        else:
            good += 1
            if good == 2000:
                s, good = s * 2, 0
    numel = rng.integers(1_000, 3_000_000, PARAMS)
    for rank in range(ranks):
        writer = f"bench{rank}"
        for seg, start in enumerate(range(0, steps, STEPS_PER_SEGMENT)):
            stop = min(steps, start + STEPS_PER_SEGMENT)
            table = _segment(rng, names, numel, scale, skipped, start, stop, rank, version)
            meta = {META_SCHEMA_VERSION: str(version), META_VERSION: __version__, "torch.version": "bench",
                    "scaler.class": "torch.amp.GradScaler", "scaler.enabled": "true", "scaler.init_scale": "65536.0",
                    "scaler.growth_factor": "2.0", "scaler.backoff_factor": "0.5", "scaler.growth_interval": "2000",
                    "amp.dtype": "float16", "device": "cuda", "world_size": str(ranks),
                    "hist.min_exp": str(HIST_MIN_EXP), "hist.bins": str(HIST_BINS), "run.id": "bench",
                    "run.started": "", META_WRITER: writer, META_SEGMENT: str(seg),
                    META_FINAL: "true" if stop == steps else "false", "rank": str(rank)}
            table = table.replace_schema_metadata(meta)
            pq.write_table(table, path / f"part-r{rank:05d}-{writer}-{seg:06d}.parquet", compression="zstd")
    return steps


def _segment(rng, names, numel, scale, skipped, start, stop, rank, version) -> pa.Table:
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
    schema = run_schema()
    dict_type = pa.dictionary(pa.int32(), pa.string())
    kinds = pa.DictionaryArray.from_arrays(pa.array(kind_idx, pa.int32()), pa.array(["step", "param_grad"]))
    names_arr = pa.DictionaryArray.from_arrays(pa.array(name_idx, pa.int32()), pa.array([""] + names))
    dtypes = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array(["float32"]))
    loss = np.where(kind_idx == 0, 2.0 + rng.normal(0, 0.1, n), np.nan)
    columns = {
        "step": pa.array(step, pa.int64()), "rank": pa.array(np.full(n, rank), pa.int32()),
        "kind": kinds.cast(dict_type), "name": names_arr.cast(dict_type), "order": pa.nulls(n, pa.int32()),
        "dtype": dtypes.cast(dict_type), "numel": pa.array(elements, pa.int64()),
        "scale": pa.array(np.repeat(scale[start:stop], per_step), pa.float32()), "skipped": pa.array(sk),
        "loss": pa.array(loss, pa.float32(), mask=kind_idx != 0),
        "amax": pa.array(amax, pa.float32()), "amin": pa.array(amax * 2.0**-20, pa.float32()),
        "l2": pa.array(amax * 30, pa.float32()),
        "n_zero": pa.array(zeros, pa.int64()), "n_subnormal": pa.array(zeros // 2, pa.int64()),
        "n_nan": pa.array(np.zeros(n, np.int64)), "n_inf": pa.array(np.where(sk, 1, 0), pa.int64()),
        "hist": (hist_array([hist], HIST_BINS) if version == 2 else
                 pa.FixedSizeListArray.from_arrays(pa.array(hist.ravel(), pa.int32()), HIST_BINS)),
        "n_zero_lines": pa.array(np.zeros(n, np.int64)), "n_underflow": pa.nulls(n, pa.int64()),
        "underflow_hist": pa.nulls(n, pa.list_(pa.int64())),
        "call": pa.nulls(n, pa.int32()), "parent": pa.nulls(n, pa.int32()),
        "inputs": pa.nulls(n, pa.list_(pa.int32())), "computed_inputs": pa.nulls(n, pa.list_(pa.int32())),
        "fine_hist": pa.nulls(n, pa.list_(pa.int64())),
    }
    if version == 1:  # schema version 1's fixed-size histograms, for comparison
        schema = schema.set(schema.get_field_index("hist"), pa.field("hist", columns["hist"].type))
    return pa.table([columns[f.name] for f in schema], schema=schema)


_CHILD = """
import json, resource, sys, time
t = time.perf_counter()
from ampdoctor import render
if sys.argv[2] == "report":
    from ampdoctor.analysis.report import report_data
    data = report_data(read_run(sys.argv[1]))
    render.to_json(data)
else:
    from ampdoctor.analysis.postmortem import postmortem_data
    data = postmortem_data(read_run(sys.argv[1]))
    render.to_json(data)
print(json.dumps({"seconds": time.perf_counter() - t,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def measure(path: Path, command: str) -> dict:
    """``command`` (report or postmortem) on ``path`` in a fresh process: wall time, peak RSS."""
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), command], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--schema-version", type=int, choices=[1, SCHEMA_VERSION], default=SCHEMA_VERSION,
                        help="the hist encoding written: 1 (fixed-size lists) for comparison")
    parser.add_argument("--json", default="benchmarks/results/report_speed.json")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rows in args.rows:
            path = Path(tmp) / f"run{rows}.parquet"
            t = time.perf_counter()
            steps = write_synthetic_run(path, rows, args.ranks, version=args.schema_version)
            written = time.perf_counter() - t
            size = sum(f.stat().st_size for f in path.iterdir())
            for command in ("report", "postmortem"):
                m = measure(path, command)
                results.append({"command": command, "schema_version": args.schema_version, "rows": rows,
                                "ranks": args.ranks, "steps": steps,
                                "size_mib": size / 2**20, "write_seconds": written, **m})
    print(f"{'command':<11} {'rows':>12} {'ranks':>5} {'steps':>7} {'on disk':>9} {'time':>8} {'peak RSS':>10}")
    for r in results:
        print(f"{r['command']:<11} {r['rows']:>12,} {r['ranks']:>5} {r['steps']:>7} {r['size_mib']:>7.0f}Mi "
              f"{r['seconds']:>7.1f}s {r['peak_rss_mib']:>8.0f}Mi")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"benchmark": "report_speed", "machine": platform.machine(),
                                           "cpus": os.cpu_count(), "python": platform.python_version(),
                                           "ampdoctor": __version__, "results": results}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
