"""Memory bandwidth of ampdoctor's full statistics (issue 26: at least 25% of the device's peak).

What it measures. A gradient set shaped like a transformer's (GPT-2-small's tensor shapes: the
token and position embeddings, then blocks of LayerNorm vectors, biases and weight matrices,
repeated up to ``--elements``; 100 M float32 elements, 400 MB, by default), holding *scaled*
gradients as a sampled step sees them (loss scale 2**16; per tensor a magnitude between 1e-10 and
1e-2, so that some tensors are mostly fp16-subnormal; the embedding rows of unused tokens zero, and
scattered zeros). For every algorithm of the full statistics (``ampdoctor.stats.ALGORITHMS``, and
``FULL_ALGORITHMS`` where the tree has it, with "triton"; one that refuses the device is recorded
with its error), and for ``light_stats`` as a reference, the time of one call
``full_stats(tensors, inv_scale=..., subnormal_below=6.1035e-05, per_tensor=True, algorithm=A)``:
median of ``--repeats`` after warm-up, each call between two synchronizations (the wall time of
one call, launches included) and, on CUDA, also between two CUDA events; and calls back to back
with one synchronization at the end (*pipelined*: as on a sampled step, where the host prepares
launches while the device still runs backward, so what is left is the device's pace). Bandwidth = bytes
read once (numel x element size) / time, beside the device's peak: on CUDA from the device
properties (memory clock x bus width) where torch exposes them, else a table of known GPUs, else a
measured device-to-device copy, which is printed in any case (on the CPU it is the reference). The
ops one call dispatches (a ``TorchDispatchMode`` count, views apart) and, on CUDA, the kernels it
launches (``torch.profiler``; a Triton kernel is a launch the dispatch count does not see).

How long: about 30 s on an H100 (most of it CUDA start-up and building the set; each algorithm's
repeats stop at ``--seconds`` per algorithm); a second on the CPU with ``--elements 200000``.

    python benchmarks/stats_bandwidth.py                                   # CUDA, 100 M elements
    python benchmarks/stats_bandwidth.py --device cpu --elements 200000    # smoke run, host algorithm
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from ampdoctor import stats

from host_cost import OpCounter  # noqa: E402 - this script's folder is on sys.path when it is run
from overhead import package_provenance  # noqa: E402
from step_profile import kernel_events  # noqa: E402

SCALE = 2.0**16          # torch's default initial loss scale
SUBNORMAL_BELOW = 6.1035e-05  # fp16's smallest normal
# Peak memory bandwidth in GB/s by device name, where torch does not expose clock and bus width
# (vendor data sheets). The H100 SXM reports itself as "H100 80GB HBM3".
PEAKS = [("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0),
         ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0)]


# -- the gradient set ----------------------------------------------------------------------------
def transformer_shapes(elements: int) -> list[tuple[int, ...]]:
    """Tensor shapes of a GPT-2-like model, layers repeated until exactly ``elements`` elements;
    d_model 768 where the set holds the embeddings and a block, narrower for small sets."""
    d = next((d for d in (768, 384, 192, 96, 48, 24, 12, 6) if 78 * d * d <= elements), 4)
    layer = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    shapes, total = [], 0
    for shape in [(64 * d, d), (4 * d // 3, d)] + layer * (elements // (12 * d * d) + 1):
        numel = math.prod(shape)
        if total + numel > elements:
            break
        shapes.append(shape)
        total += numel
    rest = elements - total  # the last tensor cut short: rows of a matrix, then a vector
    shapes += [s for s in ((rest // d, d), (rest % d,)) if math.prod(s)]
    return shapes


def make_gradients(shapes, device: str, seed: int = 0) -> list[torch.Tensor]:
    """Scaled float32 gradients, one tensor each (as an optimizer holds them)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    host = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(shapes):
        magnitude = 10 ** (-10 + 8 * torch.rand((), generator=host).item())
        g = torch.randn(shape, device=device, generator=gen).mul_(magnitude * SCALE)
        g.masked_fill_(torch.rand(shape, device=device, generator=gen) < 1e-3, 0.0)  # scattered zeros
        if i == 0:  # the token embedding: rows of tokens not in the batch get no gradient
            g[torch.rand(shape[0], device=device, generator=gen) < 0.2] = 0.0
        out.append(g)
    return out


# -- timing ------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_calls(fn, device: str, repeats: int, seconds: float, warmup: int = 2) -> dict:
    """Median wall time of ``fn()`` between two synchronizations and, on CUDA, its GPU time between
    two events; the repeats stop early once ``seconds`` are spent (a slow algorithm)."""
    for _ in range(warmup):  # first calls: caches of index tensors, Triton compilation
        fn()
    _sync(device)
    walls, gpus, spent = [], [], 0.0
    while len(walls) < repeats and (spent < seconds or not walls):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        if device == "cuda":
            start.record()
        fn()
        if device == "cuda":
            end.record()
        _sync(device)
        walls.append(time.perf_counter() - t)
        spent += walls[-1]
        if device == "cuda":
            gpus.append(start.elapsed_time(end) / 1e3)
    return {"seconds": statistics.median(walls), "gpu_seconds": statistics.median(gpus) if gpus else None,
            "repeats": len(walls)}


def pipelined_seconds(fn, device: str, one_call: float, seconds: float) -> float:
    """Seconds per call of ``fn()`` called back to back (one synchronization after all of them):
    as many calls as fit in ``seconds`` by ``one_call``'s time, 3 to 20."""
    calls = max(3, min(20, int(seconds / max(one_call, 1e-6))))
    _sync(device)
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / calls


def count_ops(fn) -> dict:
    with OpCounter() as counter:
        fn()
    total = sum(counter.ops.values())
    return {"ops": total - counter.views, "views": counter.views, "top_ops": dict(counter.ops.most_common(8))}


def count_kernels(fn) -> dict:
    """CUDA: the kernels (and memory copies/sets) one call puts on the device, as the profiler sees them."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    memory = sum(e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith(("Memcpy", "Memset"))
                 for e in events)
    return {"kernels": len(kernel_events(events)), "memcpy_memset": memory}


# -- the reference bandwidths ----------------------------------------------------------------------
def spec_peak(device: str) -> tuple[float | None, str | None]:
    """The device's peak memory bandwidth in GB/s, and where the figure comes from."""
    if device != "cuda":
        return None, None
    return peak_of(torch.cuda.get_device_properties(torch.cuda.current_device()))


def peak_of(props) -> tuple[float | None, str | None]:
    """From CUDA device properties: memory clock and bus width where this torch and CUDA expose
    them, else the device's name in PEAKS."""
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:  # double data rate: two transfers per clock
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "device properties (2 x memory clock x bus width)"
    name = props.name
    for key, gbps in PEAKS:
        if all(word in name for word in key.split()):
            return gbps, f"table ({key})"
    return None, None


def copy_bandwidth(device: str, elements: int) -> dict:
    """A device-to-device float32 copy (read + write): what the memory sustains. At least 64 MiB on
    the CPU, so that a small smoke set does not measure the caches."""
    n = max(elements, (16 << 20) if device == "cpu" else (64 << 20))
    src = torch.empty(n, device=device).uniform_()
    dst = torch.empty_like(src)
    timing = time_calls(lambda: dst.copy_(src), device, repeats=5, seconds=2.0)
    moved = 2 * n * src.element_size()
    return {"bytes_moved": moved, "gbps": moved / timing["seconds"] / 1e9, **timing}


# -- the benchmark ------------------------------------------------------------------------------
def full_algorithms() -> list[str]:
    """The algorithms of the full statistics: ``ALGORITHMS`` and, where the tree names them apart
    (``FULL_ALGORITHMS``, with "triton"), those too; an older tree has only the first."""
    names = list(stats.ALGORITHMS)
    return names + [n for n in getattr(stats, "FULL_ALGORITHMS", ()) if n not in names]


def default_full_algorithm(device: str) -> str | None:
    """What ``full_stats`` runs on ``device`` without ``algorithm=`` (the one a step pays for)."""
    try:
        return stats.algorithm_for(torch.device(device), full=True)
    except TypeError:  # a tree whose algorithm_for has one algorithm for both kinds
        return stats.algorithm_for(torch.device(device))
    except Exception:  # noqa: BLE001 - a tree without algorithm_for
        return None


def measure_call(fn, nbytes: int, device: str, args, peak: float | None, copy_gbps: float) -> dict:
    # The first call's warnings are recorded: an algorithm that falls back to another (Triton that
    # cannot run here) says so in a warning, and its figures are then the other's.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    timing = time_calls(fn, device, args.repeats, args.seconds)
    gbps = nbytes / timing["seconds"] / 1e9
    row = {"status": "ok", "warnings": sorted({str(w.message) for w in caught}), **timing, "gbps": gbps,
           "gpu_gbps": nbytes / timing["gpu_seconds"] / 1e9 if timing["gpu_seconds"] else None,
           "share_of_peak": gbps / peak if peak else None, "share_of_copy": gbps / copy_gbps}
    # Back to back, as on a sampled step, where the GPU is still busy with backward while the host
    # prepares the next launches: the host's time per call hides behind the device's, and what is
    # left is how fast the device goes through the data.
    pipelined = pipelined_seconds(fn, device, timing["seconds"], args.seconds)
    row.update(pipelined_seconds=pipelined, pipelined_gbps=nbytes / pipelined / 1e9,
               pipelined_share_of_peak=nbytes / pipelined / 1e9 / peak if peak else None,
               pipelined_share_of_copy=nbytes / pipelined / 1e9 / copy_gbps)
    # The counts cost the count, not the timing, if they fail (a profiler that cannot start).
    for counter, key in [(count_ops, "ops_error")] + ([(count_kernels, "kernels_error")] if device == "cuda" else []):
        try:
            row.update(counter(fn))
        except Exception as exc:  # noqa: BLE001
            row[key] = f"{type(exc).__name__}: {exc}"
    return row


def run(args) -> dict:
    device = args.device
    shapes = transformer_shapes(args.elements)
    tensors = make_gradients(shapes, device)
    _sync(device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    inv = torch.tensor(1.0 / SCALE, device=device)
    peak, peak_source = spec_peak(device)
    copy = copy_bandwidth(device, args.elements)
    reference = peak or copy["gbps"]
    default = default_full_algorithm(device)
    algorithms = {}
    for name in full_algorithms():
        def call(name=name):
            return stats.full_stats(tensors, inv_scale=inv, subnormal_below=SUBNORMAL_BELOW, per_tensor=True,
                                    algorithm=name)
        try:
            if name == "triton" and device != "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
                call()  # it runs (the CI's path), but an interpreter's speed says nothing: seconds a call
                algorithms[name] = {"status": "not timed", "error": "Triton's interpreter (TRITON_INTERPRET=1)"}
                continue
            algorithms[name] = measure_call(call, nbytes, device, args, peak, copy["gbps"])
        except Exception as exc:  # noqa: BLE001 - an algorithm that refuses this device (or fails) is recorded
            algorithms[name] = {"status": "unavailable", "error": f"{type(exc).__name__}: {exc}"}
    light = measure_call(lambda: stats.light_stats(tensors, inv_scale=inv), nbytes, device, args, peak, copy["gbps"])
    return {"benchmark": "stats_bandwidth", "device": _device_name(device), "device_type": device,
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            **package_provenance(),
            "elements": sum(t.numel() for t in tensors), "tensors": len(tensors), "bytes": nbytes,
            "smallest_tensor": min(t.numel() for t in tensors), "largest_tensor": max(t.numel() for t in tensors),
            "peak_gbps": peak, "peak_source": peak_source or "measured copy", "reference_gbps": reference,
            "copy": copy, "default_algorithm": default, "algorithms": algorithms, "light_stats": light,
            "settings": {"repeats": args.repeats, "seconds": args.seconds, "scale": SCALE,
                         "subnormal_below": SUBNORMAL_BELOW}}


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()


def print_result(result: dict) -> None:
    peak = result["peak_gbps"]
    print(f"{result['device']}: {result['elements'] / 1e6:.1f} M float32 elements in {result['tensors']} tensors "
          f"({result['bytes'] / 1e6:.0f} MB); peak {'—' if peak is None else f'{peak:,.0f} GB/s'} "
          f"({result['peak_source']}), device copy {result['copy']['gbps']:,.0f} GB/s")
    print(f"{'call':<28} {'ms':>9} {'GB/s':>9} {'of peak':>8} {'of copy':>8} {'pipelined':>10} {'of peak':>8} "
          f"{'ops':>6} {'kernels':>8}")
    rows = [(f"full_stats {name}" + (" (default)" if name == result["default_algorithm"] else ""), r)
            for name, r in result["algorithms"].items()] + [("light_stats", result["light_stats"])]
    for label, r in rows:
        if r["status"] != "ok":
            print(f"{label:<28} {r['status']}: {r['error']}")
            continue
        share = "—" if r["share_of_peak"] is None else f"{r['share_of_peak']:.1%}"
        piped = "—" if r.get("pipelined_share_of_peak") is None else f"{r['pipelined_share_of_peak']:.1%}"
        print(f"{label:<28} {1e3 * r['seconds']:>9.3f} {r['gbps']:>9.4g} {share:>8} {r['share_of_copy']:>7.1%} "
              f"{r['pipelined_gbps']:>10.4g} {piped:>8} {r.get('ops', '—'):>6} {r.get('kernels', '—'):>8}")
        for message in r["warnings"]:
            print(f"{'':<28} warned: {message}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--elements", type=int, default=100_000_000, help="float32 elements in the gradient set")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per algorithm (median)")
    parser.add_argument("--seconds", type=float, default=5.0, help="time per algorithm after which repeats stop")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("stats_bandwidth: no CUDA GPU available; --device cpu measures the host algorithm")
    if args.elements < 1 or args.repeats < 1:
        parser.error("--elements and --repeats must be positive")
    result = run(args)
    print_result(result)
    path = args.json or Path(f"benchmarks/results/stats_bandwidth_{args.device}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
