"""How right the per-layer underflow the report prints is, at the recorder's default cadence, on
third-party architectures, against an fp32 and a float64 reference backward of the same batch on the
same weights (``tests/architectures.py``).

For each architecture (Hugging Face GPT-2, T5, ViT, BERT from tiny configs, a nanoGPT-like model,
a ReLU MLP, a BatchNorm CNN, an LSTM language model), loss scale {1, 2^4, 2^8, 2^16} (held) and
loss factor {1, 2^-8, 2^-14}, a run is trained with Adam and recorded at ``level="full"`` with the
default ``measure_every`` (``architectures.train_recorded``): runs of 12 steps at the default
``every`` (one sampled step, measured) and at ``every=1`` (one measured, eleven estimated), of 100
steps at ``every=10`` (one measured, nine estimated), and of 2000 steps at the defaults (20
sampled, 2 measured). Before every step the recorder samples, the truth is measured beside it.
Each parameter gradient and module output gradient row of ``report_data``'s layers table (averaged
over the sampled steps) is compared with the truth averaged the same way: within tolerance
(max(0.5 percentage points, 25% of the truth), plus the elements the reference cannot decide),
and the truth within the reported range [``underflow_rate_min``, ``underflow_rate_max``] (same
tolerance); the summary gives how far, on average, each end lies from the point. Rows are counted
apart by whether all their steps were measured (``measured``) or some were estimated
(``estimated``). A row whose rate is unknown (0 everywhere) is judged by its range only.

    python benchmarks/underflow_accuracy.py [--archs gpt2,bert] [--runs 12:,12:1,100:10,2000:]
        [--scales 1,256] [--factors 1,0.00390625] [--out FILE]

``--runs``: STEPS:EVERY pairs (EVERY empty: the default). Needs the test extra (transformers).
The 12- and 100-step runs take about 10 minutes on 2 CPU cores; the 2000-step runs about an hour.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import architectures as A  # noqa: E402

from ampdoctor.read.run import read_run
from ampdoctor.analysis.report import report_data  # noqa: E402

ARCHS = "gpt2,t5,vit,bert,nanogpt,relu_mlp,cnn,lstm"
SCALES = (1.0, 2.0**4, 2.0**8, 2.0**16)
FACTORS = (1.0, 2.0**-8, 2.0**-14)
RUNS = "12:,12:1,100:10,2000:"


def judge(rows: dict[str, dict], truth: dict[str, A.Truth]) -> list[dict]:
    """Each reported row against its truth (both summed over the same steps)."""
    out = []
    for name in sorted(set(rows) & set(truth)):
        row, t = rows[name], truth[name]
        if not t.numel:
            continue
        estimate, lower, upper = row["underflow_rate"], row["underflow_rate_min"], row["underflow_rate_max"]
        tolerance = max(0.005, 0.25 * t.rate) + t.undecided_rate
        within = None if estimate is None else bool(abs(estimate - t.rate) <= tolerance)
        in_range = (lower or 0.0) - tolerance <= t.rate <= (upper if upper is not None else 1.0) + tolerance
        out.append({"name": name, "estimate": estimate, "at_least": lower, "at_most": upper, "truth": round(t.rate, 6),
                    "undecided": round(t.undecided_rate, 6), "within_tolerance": within, "in_range": bool(in_range),
                    "numel": t.numel, "measured": row.get("underflow_measured"),
                    "measure_distance": row.get("measure_distance")})
    return out


def one_run(name: str, steps: int, every: int | None, scale: float, factor: float, tmp: Path) -> list[dict]:
    path = tmp / f"{name}-{steps}-{every}-{scale:g}-{factor:g}.parquet"
    settings = {} if every is None else {"every": every}
    truth = A.train_recorded(name, path, steps, init_scale=scale, loss_factor=factor, **settings)
    layers = report_data(read_run(path))["layers"]
    cases = []
    for kind in ("param_grad", "grad_output"):
        rows = {r["name"]: r for r in layers if r["kind"] == kind}
        for r in judge(rows, truth.averaged(kind)):
            cases.append({"arch": name, "steps": steps, "every": every, "scale": scale, "loss_factor": factor,
                          "kind": kind, **r})
    return cases


def summarise(cases: list[dict]) -> dict:
    summary = {}
    groups = sorted({(c["steps"], c["every"] or 0, c["kind"]) for c in cases})
    for steps, every, kind in groups:
        for mode in ("measured", "estimated", "all"):
            rows = [c for c in cases if (c["steps"], c["every"] or 0, c["kind"]) == (steps, every, kind)
                    and (mode == "all" or (mode == "measured") == (c["measured"] == 1))]
            if not rows:
                continue
            known = [r for r in rows if r["within_tolerance"] is not None]
            summary[f"{steps} steps, every {every or 'default'}, {kind}, {mode}"] = {
                "rows": len(rows), "unknown": len(rows) - len(known),
                "within_tolerance_share": round(sum(r["within_tolerance"] for r in known) / max(len(known), 1), 4),
                "outside_tolerance": sum(r["within_tolerance"] is False for r in rows),
                "outside_range": sum(not r["in_range"] for r in rows),
                # How wide the ranges are: the mean distance from the point to each end (pp).
                "mean_below_point_pp": _mean_pp([r["estimate"] - r["at_least"] for r in known
                                                 if r["at_least"] is not None]),
                "mean_above_point_pp": _mean_pp([r["at_most"] - r["estimate"] for r in known
                                                 if r["at_most"] is not None])}
    return summary


def _mean_pp(values: list[float]) -> float | None:
    return round(100 * sum(values) / len(values), 3) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default=ARCHS)
    parser.add_argument("--runs", default=RUNS, help="STEPS:EVERY,... (EVERY empty: the default)")
    parser.add_argument("--scales", default=",".join(f"{x:g}" for x in SCALES))
    parser.add_argument("--factors", default=",".join(repr(x) for x in FACTORS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "underflow_accuracy.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    runs = [(int(s), int(e) if e else None) for s, e in (r.split(":") for r in args.runs.split(","))]
    cases: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for steps, every in runs:
            for name in args.archs.split(","):
                for scale in (float(x) for x in args.scales.split(",")):
                    for factor in (float(x) for x in args.factors.split(",")):
                        cases += one_run(name, steps, every, scale, factor, Path(tmp))
                print(f"{steps}:{every} {name} done at {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    result = {"torch": torch.__version__, "runs": args.runs, "archs": args.archs, "scales": args.scales,
              "factors": args.factors, "seconds": round(time.time() - started, 1), "summary": summarise(cases),
              # Every row outside the tolerance or its range.
              "misses": [c for c in cases if c["within_tolerance"] is False or not c["in_range"]]}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
