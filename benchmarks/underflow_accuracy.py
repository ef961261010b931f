"""How right the per-layer underflow is on third-party architectures, measured and estimated,
against an fp32 and a float64 reference backward of the same batch on the same weights
(``tests/architectures.py``).

For each architecture (Hugging Face GPT-2, T5, ViT, BERT from tiny configs, a nanoGPT-like model,
a ReLU MLP, a BatchNorm CNN, an LSTM language model), loss scale {1, 2^4, 2^8, 2^16} and loss
factor {1, 2^-8, 2^-14}, one fp16 AMP step is recorded at ``level="full"``, once measured (a float32
shadow of the backward: ``measure_every=1``) and once estimated (``measure_every=0``), and read
back with ``report_data``; every parameter gradient and module output gradient row is compared with
the truth: within tolerance (max(0.5 percentage points, 25% of the truth), plus the elements the
reference cannot decide), and the truth within the reported range [underflow, at most] (same
tolerance). A row whose rate is unknown (0 everywhere) is counted apart and judged by its range
only. Per mode and kind: the share of rows within tolerance, the share of elements undecided (at
most minus underflow), the rows outside the range. Writes
``benchmarks/results/underflow_accuracy.json``.

    python benchmarks/underflow_accuracy.py [--archs gpt2,bert] [--modes measured,estimated] [--out FILE]

Needs the test extra (transformers). About three minutes on 2 CPU cores.
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

import ampdoctor  # noqa: E402
from ampdoctor.analysis.report import report_data  # noqa: E402

SCALES = (1.0, 2.0**4, 2.0**8, 2.0**16)
FACTORS = (1.0, 2.0**-8, 2.0**-14)
MODES = {"measured": 1, "estimated": 0}  # measure_every


def record_one_step(arch: A.Arch, path: Path, scale: float, factor: float, measure_every: int = 1
                    ) -> dict[str, torch.Tensor]:
    """One recorded fp16 step (weights unchanged); returns the unscaled AMP parameter gradients."""
    model = arch.model
    scaler = ampdoctor.GradScaler("cpu", init_scale=scale, growth_interval=10**6, model=model, path=path,
                                  amp_dtype=torch.float16, level="full", every=1, measure_every=measure_every)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = arch.loss(model, 0) * factor
    scaler.scale(loss).backward()
    grads = {n: p.grad.detach().clone() / scale for n, p in model.named_parameters() if p.grad is not None}
    scaler.step(torch.optim.SGD(model.parameters(), lr=0.0))
    scaler.update()
    scaler.close()
    return grads


def judge(rows: dict[str, dict], truth: dict[str, A.Truth]) -> list[dict]:
    out = []
    for name in sorted(set(rows) & set(truth)):
        row, t = rows[name], truth[name]
        estimate, upper = row["underflow_rate"], row["underflow_rate_max"]
        tolerance = max(0.005, 0.25 * t.rate) + t.undecided_rate
        within = None if estimate is None else bool(  # None: unknown (0 everywhere), judged by its range
            abs(estimate - t.rate) <= tolerance and not (t.rate < 0.001 and estimate > 0.01 + t.undecided_rate))
        in_range = (estimate or 0.0) - tolerance <= t.rate <= (upper or 0.0) + tolerance
        out.append({"name": name, "estimate": estimate, "at_most": upper, "truth": t.rate,
                    "undecided": t.undecided_rate, "within_tolerance": within, "in_range": bool(in_range),
                    "numel": t.numel, "measured": row.get("underflow_measured"),
                    "undecided_elements": ((upper or 0.0) - (estimate if estimate is not None else 0.0)) * t.numel})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default="gpt2,t5,vit,bert,nanogpt,relu_mlp,cnn,lstm")
    parser.add_argument("--modes", default="measured,estimated")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "underflow_accuracy.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.archs.split(","):
            for scale in SCALES:
                for factor in FACTORS:
                    for mode in args.modes.split(","):
                        arch = A.build(name)
                        path = Path(tmp) / f"{name}-{scale:g}-{factor:g}-{mode}.parquet"
                        grads = record_one_step(arch, path, scale, factor, MODES[mode])
                        layers = report_data(path)["layers"]
                        for kind, truth in (("param_grad", A.true_underflow(arch, 0, grads, factor)),
                                            ("grad_output", A.true_output_underflow(arch, 0, scale, factor))):
                            rows = {r["name"]: r for r in layers if r["kind"] == kind}
                            cases.append({"arch": name, "scale": scale, "loss_factor": factor, "kind": kind,
                                          "mode": mode, "rows": judge(rows, truth)})
    summary = {}
    for mode in args.modes.split(","):
        for kind in ("param_grad", "grad_output"):
            rows = [(c, r) for c in cases if c["kind"] == kind and c["mode"] == mode for r in c["rows"]]
            healthy = [r for c, r in rows if c["scale"] == 2.0**16 and c["loss_factor"] == 1.0]
            numel = sum(r["numel"] for _, r in rows) or 1
            summary[f"{mode} {kind}"] = {
                "rows": len(rows), "unknown": sum(r["within_tolerance"] is None for _, r in rows),
                "within_tolerance_share": round(sum(r["within_tolerance"] is True for _, r in rows) / max(len(rows), 1), 4),
                "outside_tolerance": sum(r["within_tolerance"] is False for _, r in rows),
                "outside_range": sum(not r["in_range"] for _, r in rows),
                "undecided_element_share": round(sum(r["undecided_elements"] for _, r in rows) / numel, 4),
                "measured_rows": sum(bool(r["measured"]) for _, r in rows),
                "healthy_rows": len(healthy),
                "healthy_outside_tolerance": sum(r["within_tolerance"] is False for r in healthy)}
    result = {"torch": torch.__version__, "seconds": round(time.time() - started, 1), "summary": summary,
              # Every measured row outside the tolerance, and every estimated one outside its range.
              "misses": [{**{k: c[k] for k in ("arch", "scale", "loss_factor", "kind", "mode")}, **r}
                         for c in cases for r in c["rows"]
                         if (r["within_tolerance"] is not True if c["mode"] == "measured" else not r["in_range"])]}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
