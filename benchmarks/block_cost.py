"""What the block statistics (issue 42) cost on one module-sampled step: the GEMM operands of one
training step of the overhead benchmark's model (benchmarks/overhead.py ``build_model``), captured
by hooks of this script's own, then their block statistics computed as the recorder does
(``packed_block_stats``), timed (best of 3) and their torch ops counted (on a GPU each is a launch),
beside the fine histograms the same step takes and a plain step.

    python benchmarks/block_cost.py [--size small] [--device cpu] [--json FILE]

On CUDA with Triton the kernel path runs (a dozen ops an operand besides the kernel); elsewhere the
torch path (some 330 an operand). docs/benchmarks.md, "Block statistics".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead as O  # noqa: E402
from host_cost import OpCounter  # noqa: E402

from ampdoctor.stats.block_stats import packed_block_stats  # noqa: E402
from ampdoctor.stats.fine_hist import fine_hist  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=sorted(O.SIZES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = args.device
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    torch.manual_seed(0)
    model = O.build_model(args.size).to(device)
    operands: list[torch.Tensor] = []
    handles = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            handles.append(m.register_forward_pre_hook(lambda m, a: operands.extend([a[0].detach(), m.weight.detach()])
                                                       and None))
            handles.append(m.register_full_backward_hook(lambda m, gi, go: operands.append(go[0].detach()) and None))
    x, y = next(O.batches(args.size, device, 1))

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def step():
        with torch.autocast(device, dtype=dtype):
            logits = model(x)
        F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        model.zero_grad(set_to_none=True)

    step()
    operands.clear()
    sync()
    start = time.perf_counter()
    for _ in range(3):
        step()
    sync()
    plain = (time.perf_counter() - start) / 3
    taken = operands[: len(operands) // 3]
    for h in handles:
        h.remove()

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(3):
            sync()
            start = time.perf_counter()
            for o in taken:
                fn(o)
            sync()
            best = min(best, time.perf_counter() - start)
        return best

    blocks, hists = timed(packed_block_stats), timed(fine_hist)
    with OpCounter() as block_ops:
        for o in taken:
            packed_block_stats(o)
    with OpCounter() as hist_ops:
        for o in taken:
            fine_hist(o)
    result = {"size": args.size, "device": device, "dtype": str(dtype), "operands": len(taken),
              "elements": int(sum(o.numel() for o in taken)), "plain_step_ms": plain * 1e3,
              "block_stats_ms": blocks * 1e3, "block_stats_launches": block_ops.launches,
              "fine_hist_ms": hists * 1e3, "fine_hist_launches": hist_ops.launches,
              "block_stats_in_plain_steps": blocks / plain,
              "amortised_at_module_every_1000": blocks / plain / 1000}
    print(f"{args.size} on {device}: {len(taken)} operands, {result['elements'] / 1e6:.1f} M elements; a plain step "
          f"{plain * 1e3:.0f} ms")
    print(f"block statistics: {block_ops.launches} launches ({block_ops.launches / len(taken):.0f} an operand), "
          f"{blocks * 1e3:.0f} ms a module-sampled step = {blocks / plain:.2f} plain steps: "
          f"+{blocks / plain / 10:.3f}% amortised at module_every=1000")
    print(f"fine histograms:  {hist_ops.launches} launches, {hists * 1e3:.0f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
