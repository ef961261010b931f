"""Where a steady step's time goes, per variant: host or device. For each of plain, ampdoctor at
``params`` and at ``full`` (``benchmarks/overhead.py``'s model, optimizer and step), on steady steps
(no full statistics: the scaler's step is moved just past a sampled one, as overhead.py does, and a
few steps are left for the writer's work; ``steady_only`` is false if the loss scale moved, since a
skipped step escalates the next ones), every variant timed before any is profiled:

* ``wall_ms``: a step's wall time, steps back to back (one sync at the end of all of them, besides
  the scaler's own each step);
* ``host_ms``: the training thread's CPU time per step over the same steps (``time.thread_time``):
  when it comes near ``wall_ms``, the step is host-bound and the device waits for launches. On CUDA
  autograd runs backward, gradient hooks included, on a device thread of its own: ``process_ms``
  (``time.process_time``, every thread, the writer's too) counts it;
* on CUDA, from ``torch.profiler`` over a few more steps: ``kernel_ms`` (the sum of the kernels'
  durations per step), ``busy_ms`` (the time at least one kernel ran: the union of their
  intervals), ``kernels`` per step, and the ``top`` kernels by time; ``idle_ms = wall - busy`` is
  what the device spent waiting (for the host, or for the sync);
* on any device, the torch ops dispatched per step (a ``TorchDispatchMode``, views apart);
* ``events``: the same for one sampled step of each ampdoctor variant and one module-sampled step at
  ``full`` (what the protocol's sampled and module-sampled checks pay), each timed alone.

It answers what overhead.py's ratios cannot: whether ``full``'s extra time is the module hooks'
host work (``host_ms`` and ``idle_ms`` grow) or the device's reductions (``busy_ms`` grows), and
which kernels. Only ampdoctor's public API is used, as in overhead.py.

    python benchmarks/step_profile.py --device cuda --size gpt2      # under a minute on an H100 (estimated)
    python benchmarks/step_profile.py --device cpu --size tiny       # a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

import ampdoctor
from host_cost import OpCounter  # this script's folder is on sys.path when it is run
from overhead import SIZES, _device_name, _sync, batches, make_variants, package_provenance, train_step

VARIANTS = ["plain", "ampdoctor:params", "ampdoctor:full"]
TOP = 12  # kernels listed per variant


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: the time at least one ran."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def kernel_events(events) -> list:
    """The kernels among a profile's events: on the device, not a copy or a memset, and not a
    user annotation (an ``Optimizer.step`` range has a device-side span too, which torch's own
    totals leave out)."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset")) and not getattr(e, "is_user_annotation", False)]


def device_profile(step, steps: int) -> dict:
    """CUDA: the kernels of ``steps`` calls of ``step()`` (per step), by ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = kernel_events(prof.events())
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e.name].append(e.time_range.elapsed_us())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    return {"kernel_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / steps,
            "busy_ms": busy_union(intervals) / 1e3 / steps, "kernels": len(kernels) / steps,
            "top": [{"name": name[:120], "calls": len(times) / steps, "ms": sum(times) / 1e3 / steps}
                    for name, times in top]}


def measure(args) -> dict:
    device = args.device
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        variants = make_variants(args.variants, args.size, device, Path(tmp))
        data = list(batches(args.size, device, 4))
        steps = {v.name: _stepper(v, data, dtype, device) for v in variants}
        rows, sampled_at = {}, {}
        for v in variants:  # every variant timed before any is profiled (a profiler can slow what follows)
            step = steps[v.name]
            for _ in range(args.warmup):
                step()
            scale = None
            if v.cadence is not None:
                # A sampled step, untimed, then a few steady ones (the writer thread's work for the
                # sampled step): the every - 1 steps after it are steady (module_every is a multiple
                # of every). Moving the step number syncs: here, not between timed steps.
                v.move_to("sampled")
                sampled_at[v.name] = v.step
                for _ in range(1 + args.settle):
                    step()
                scale = v.scaler.get_scale()
            _sync(device)
            wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
            for _ in range(args.steps):
                step()
            _sync(device)
            rows[v.name] = {"variant": v.name, "wall_ms": (time.perf_counter() - wall) / args.steps * 1e3,
                            "host_ms": (time.thread_time() - thread) / args.steps * 1e3,
                            "process_ms": (time.process_time() - process) / args.steps * 1e3}
            with OpCounter() as counter:
                step()
            rows[v.name].update(ops=counter.launches, views=counter.views)
            if scale is not None:
                # A skipped step escalates the next ones to full statistics: then they were not steady.
                rows[v.name]["steady_only"] = v.scaler.get_scale() == scale
        if device == "cuda":
            for v in variants:
                row = rows[v.name]
                scale = v.scaler.get_scale() if v.cadence is not None else None
                row.update(device_profile(steps[v.name], args.profile_steps))
                row["idle_ms"] = row["wall_ms"] - row["busy_ms"]
                if scale is not None:
                    row["steady_only"] = row["steady_only"] and v.scaler.get_scale() == scale
        for v in variants:
            if v.cadence is not None:
                row = rows[v.name]
                # every step after the sampled one is before the next sampled one
                row["steady_only"] = row["steady_only"] and v.step - sampled_at[v.name] <= v.cadence.every
        events = [event_step(v, kind, steps[v.name], args) for v in variants if v.cadence is not None
                  for kind in ("sampled", "module_sampled") if v.cadence.available(kind) == kind]
        for v in variants:
            if v.cadence is not None:
                v.scaler.close()
    return {"benchmark": "step_profile", "device": _device_name(device), "device_type": device,
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            **package_provenance(), "size": args.size, "steps": args.steps, "profile_steps": args.profile_steps,
            "rows": [rows[v.name] for v in variants], "events": events}


def event_step(v, kind: str, step, args) -> dict:
    """One step of ``kind`` ("sampled": full statistics of the gradients; "module_sampled": of the
    module taps too), timed alone, then on CUDA another one profiled; then ``args.settle`` steps
    for the work it leaves to the writer, before anything else is measured."""
    device = args.device
    v.move_to(kind)  # (syncs: before the timed step)
    _sync(device)
    wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
    step()
    _sync(device)
    row = {"variant": f"{v.name} ({kind.replace('_', '-')})", "kind": kind,
           "wall_ms": (time.perf_counter() - wall) * 1e3, "host_ms": (time.thread_time() - thread) * 1e3,
           "process_ms": (time.process_time() - process) * 1e3}
    with OpCounter() as counter:
        v.move_to(kind)
        step()
    row.update(ops=counter.launches, views=counter.views)
    if device == "cuda":
        v.move_to(kind)
        row.update(device_profile(step, 1))
        row["idle_ms"] = row["wall_ms"] - row["busy_ms"]
    for _ in range(args.settle):
        step()
    return row


def _stepper(v, data, dtype, device):
    """One training step of variant ``v`` per call, through the batches in turn."""
    count = 0

    def step():
        nonlocal count
        train_step(v, data[count % len(data)], dtype, device)
        count += 1
    return step


def print_rows(result: dict) -> None:
    print(f"{result['device']}, size {result['size']}: per steady step, then single sampled and module-sampled steps")
    print(f"  {'variant':<34} {'wall ms':>8} {'host ms':>8} {'all CPU':>8} {'ops':>6} {'busy ms':>8} {'idle ms':>8} "
          f"{'kernels':>8}")
    for r in result["rows"] + result.get("events", []):
        dev = (f"{r['busy_ms']:>8.2f} {r['idle_ms']:>8.2f} {r['kernels']:>8.0f}" if "busy_ms" in r else "")
        print(f"  {r['variant']:<34} {r['wall_ms']:>8.2f} {r['host_ms']:>8.2f} {r['process_ms']:>8.2f} {r['ops']:>6} {dev}")
    for r in result["rows"] + result.get("events", []):
        for k in r.get("top", [])[:6]:
            print(f"    {r['variant']:<32} {k['ms']:7.2f} ms {k['calls']:6.0f}x  {k['name'][:70]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="gpt2")
    parser.add_argument("--variants", type=lambda s: s.split(","), default=VARIANTS)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steady steps per variant")
    parser.add_argument("--settle", type=int, default=3, help="untimed steady steps after the sampled one")
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps per variant (CUDA)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = measure(args)
    result["ampdoctor_file"] = ampdoctor.__file__
    print_rows(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
