"""How right ``ampdoctor fp8`` is on third-party architectures: its predicted FP8 flushes, saturations
and clipped steps against real ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` casts of the operands
captured by the test's own hooks (``tests/fp8_truth.py``, ``tests/test_fp8_readiness.py``).

For GPT-2, BERT, ViT (transformers' tiny configs) and a CNN, in bf16 (scaler disabled) and fp16 (a
GradScaler), ``--steps`` steps are recorded at ``level="full"`` with module-sampled steps every
``--module-every``; every (layer, operand, format, recipe) cell at the sampled steps is compared:
within max(0.5 percentage points, 25% of the truth), for the flushed and the saturated share, and
the clipped flag of every pass exactly. Writes ``benchmarks/results/fp8_accuracy.json``.

    python benchmarks/fp8_accuracy.py [--steps 24] [--module-every 4] [--out FILE]

Needs the test extra (transformers). About a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import architectures as A  # noqa: E402
from test_fp8_readiness import compare, train, truth  # noqa: E402

CASES = [(name, dtype) for name in ("gpt2", "bert", "vit", "cnn") for dtype in (torch.bfloat16, torch.float16)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--module-every", type=int, default=4)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fp8_accuracy.json"))
    args = parser.parse_args()
    rows, started = [], time.time()
    for name, dtype in CASES:
        arch = A.build(name)
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            capture, scales = train(arch, dtype, f"{tmp}/run", steps=args.steps, module_every=args.module_every)
            result = compare(f"{tmp}/run", truth(capture, scales))
        worst = max(result["misses"], key=lambda m: abs(m[7] - m[8]), default=None)
        rows.append({"arch": name, "dtype": str(dtype).removeprefix("torch."), "cells": result["cells"],
                     "within": result["within"], "share_within": round(result["within"] / result["cells"], 4),
                     "truth_nonzero_cells": result["nonzero"], "clipped_mismatches": len(result["clips"]),
                     "worst_miss": None if worst is None else {
                         "layer": worst[0], "operand": worst[1], "format": worst[2], "recipe": worst[3],
                         "history": worst[4], "step": worst[5], "share": worst[6],
                         "predicted": round(float(worst[7]), 6), "true": round(float(worst[8]), 6)}})
        print(f"{name:5} {rows[-1]['dtype']:9} {result['within']}/{result['cells']} within "
              f"({rows[-1]['share_within']:.2%}), {result['nonzero']} true shares > 0, "
              f"{len(result['clips'])} clipped flags wrong", flush=True)
    cells = sum(r["cells"] for r in rows)
    within = sum(r["within"] for r in rows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = {"commit": commit, "torch": torch.__version__, "device": "cpu", "steps": args.steps,
           "module_every": args.module_every, "cells": cells, "within": within,
           "share_within": round(within / cells, 4), "clipped_mismatches": sum(r["clipped_mismatches"] for r in rows),
           "seconds": round(time.time() - started, 1), "cases": rows}
    print(f"all: {within}/{cells} within ({within / cells:.2%}); clipped flags wrong: {out['clipped_mismatches']}")
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
