"""What the run file's `hist` encoding costs: schema version 2 (variable-length `list<int64>`, null
on light rows) against version 1 (`fixed_size_list<int32>[64]`), on segments as the writer builds
them: bytes on disk per step, the writer thread's time per segment (Arrow conversion and zstd
Parquet write), and the reader's time to decode the histograms into the analyses' matrix.

Segments hold `--steps` steps of `--params` parameter-gradient rows plus a step row, with full
statistics (a histogram) on every `--every`-th step and light rows (no histogram) on the others,
as `level="params"` records at its default cadence; `--every 1` is the all-full worst case.
The same rows go through the writer's own `Columns.to_table` in both encodings: version 2 with
today's `hist_array`, version 1 with the function the writer used before (`_v1_hist_array`, as it
was at commit f4c2999; `FixedSizeListArray.from_arrays(..., mask=...)` needs pyarrow >= 15).

    python benchmarks/run_format.py                      # every=100 and every=1
    python benchmarks/run_format.py --json benchmarks/results/run_format.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ampdoctor.run_file.hist_column import as_hist_column, hist_matrix
from ampdoctor.run_file.schema import HIST_BINS, run_schema
from ampdoctor.record import writer
from ampdoctor.record.writer import Columns


def segment_columns(steps: int, params: int, every: int, seed: int = 0) -> Columns:
    """One segment's rows in the writer's column blocks (one block per step, as records arrive)."""
    rng = np.random.default_rng(seed)
    cols = Columns()
    n = params + 1
    for step in range(steps):
        full = step % every == 0
        none = np.full(n, None, dtype=object)
        centre = rng.normal(-14, 2, n)
        if full:
            hist = np.zeros((n, HIST_BINS), np.int32)
            for i, c in enumerate(centre):
                lo = int(np.clip(c + 56 - 6, 0, HIST_BINS - 13))
                hist[i, lo:lo + 13] = rng.integers(0, 200_000, 13)
            stats = {"amin": np.exp2(centre - 20).astype(np.float32), "n_zero": rng.integers(0, 1000, n),
                     "n_subnormal": rng.integers(0, 100, n), "n_nan": np.zeros(n, np.int64),
                     "n_inf": np.zeros(n, np.int64), "hist": hist, "n_zero_lines": np.zeros(n, np.int64).astype(object)}
        else:
            stats = {"amin": none, "n_zero": none, "n_subnormal": none, "n_nan": none, "n_inf": none,
                     "hist": none, "n_zero_lines": none}
        block = {"step": np.full(n, step, np.int64), "rank": np.zeros(n, np.int32),
                 "kind": np.array(["step"] + ["param_grad"] * params, dtype=object),
                 "name": np.array([""] + [f"blocks.{i // 6}.p{i % 6}.weight" for i in range(params)], dtype=object),
                 "order": none, "dtype": np.array(["float32"] * n, dtype=object),
                 "numel": rng.integers(1_000, 3_000_000, n), "scale": np.full(n, 65536.0, np.float32),
                 "skipped": np.zeros(n, bool), "loss": np.array([2.0] + [None] * params, dtype=object),
                 "amax": np.exp2(centre).astype(np.float32), "l2": np.exp2(centre + 5).astype(np.float32),
                 "call": none, "parent": none, "inputs": none, "computed_inputs": none, "n_underflow": none,
                 **stats}
        cols.append(block, n)
    return cols


def _v1_hist_array(parts: list[np.ndarray], bins: int) -> pa.Array:
    """The writer's hist column before schema version 2 (writer._hist_array at f4c2999)."""
    flat, valid = [], []
    for block in parts:
        if block.ndim == 2:
            flat.append(block.reshape(-1).astype(np.int32))
            valid.append(np.ones(len(block), dtype=bool))
        else:
            flat.append(np.zeros(len(block) * bins, dtype=np.int32))
            valid.append(np.zeros(len(block), dtype=bool))
    values = pa.array(np.concatenate(flat) if flat else np.array([], np.int32), type=pa.int32())
    mask = pa.array(~np.concatenate(valid)) if valid else None
    return pa.FixedSizeListArray.from_arrays(values, bins, mask=mask)


def _table(cols: Columns, version: int) -> pa.Table:
    """The segment's table as the writer builds it, in schema ``version``'s hist encoding."""
    if version == 2:
        return cols.to_table(run_schema(), HIST_BINS)
    schema = run_schema()
    schema = schema.set(schema.get_field_index("hist"), pa.field("hist", pa.list_(pa.int32(), HIST_BINS)))
    original, writer.hist_array = writer.hist_array, _v1_hist_array
    try:
        return cols.to_table(schema, HIST_BINS)
    finally:
        writer.hist_array = original


def measure(steps: int, params: int, every: int, repeats: int) -> list[dict]:
    cols = segment_columns(steps, params, every)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for version in (1, 2):
            write, read, size = [], [], 0
            for r in range(repeats):
                path = Path(tmp) / f"v{version}-{r}.parquet"
                t = time.perf_counter()
                table = _table(cols, version)
                pq.write_table(table, path, compression="zstd")
                write.append(time.perf_counter() - t)
                size = path.stat().st_size
                t = time.perf_counter()
                column = pq.read_table(path, columns=["hist"]).column("hist")
                hist_matrix(as_hist_column(column, HIST_BINS), HIST_BINS)
                read.append(time.perf_counter() - t)
            out.append({"version": version, "every": every, "steps": steps, "params": params, "rows": cols.rows,
                        "bytes_per_step": size / steps, "segment_bytes": size,
                        "write_ms": 1000 * float(np.median(write)), "read_hist_ms": 1000 * float(np.median(read))})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="steps per segment (flush_every's default)")
    parser.add_argument("--params", type=int, default=197, help="parameter tensors (the GPT of docs/benchmarks.md's summary)")
    parser.add_argument("--every", type=int, nargs="*", default=[100, 1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = [r for every in args.every for r in measure(args.steps, args.params, every, args.repeats)]
    print(f"{'every':>5} {'version':>7} {'rows':>8} {'bytes/step':>11} {'write ms':>9} {'read hist ms':>13}")
    for r in results:
        print(f"{r['every']:>5} {r['version']:>7} {r['rows']:>8} {r['bytes_per_step']:>11,.0f} {r['write_ms']:>9.1f} "
              f"{r['read_hist_ms']:>13.1f}")
    if args.json:
        git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
        commit = git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--", "ampdoctor") else "")
        Path(args.json).write_text(json.dumps({
            "benchmark": "run_format", "machine": platform.machine(), "pyarrow": pa.__version__,
            "commit": commit, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
