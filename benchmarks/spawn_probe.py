"""Spawn many two-process gloo DDP runs and count how their ranks end (issue 40: the SIGABRT at exit).

Each job is ``torch.multiprocessing.start_processes(nprocs=2, start_method="spawn")`` from this
process, gloo, world size 2, a few DDP steps under ``autocast("cpu", float16)``; a job past
``--timeout`` seconds has its ranks killed. Exit codes are counted per mode (-6: SIGABRT,
"terminate called without an active exception"). Modes, per rank:

  plain     torch only, ampdoctor never imported
  bare      ``import ampdoctor`` only (lazy: nothing of the recording side is loaded)
  imported  ampdoctor's recording side loaded (``ampdoctor.GradScaler`` looked up, with its exit
            handler), torch's GradScaler used
  record    ``ampdoctor.GradScaler(..., path=tmp, level="full")`` records, ``close()`` at the end
  fixture   tests/test_distributed.py's sequence: plain, recording, ``wrap(ranks=[0])``

What the aborting ranks' cores showed (gdb, ``thread apply all bt``), plain torch and ampdoctor
alike: gloo's ``pt_gloo_runloop`` thread, destroying a finished all-reduce's work object whose
saved thread-local state holds the ``contextvars.Context`` torch stashes for each backward, needs
the GIL after the interpreter began finalizing, is ended by ``pthread_exit`` inside that noexcept
destructor, and ``std::terminate`` aborts the process. ampdoctor's exit handler lets go of the
GIL last (``record/shutdown.py``, ``NATIVE_RELEASE_SECONDS``) in processes with torch.distributed
loaded; a process that never loads ampdoctor's recording side (``plain``, ``bare``) keeps torch's
odds.

    python benchmarks/spawn_probe.py --modes plain,imported,record -n 200 [-j 2] [--budget S] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor


STEPS = int(os.environ.get("AMPDOCTOR_PROBE_STEPS", "6"))


def _rank(rank: int, port: int, root: str, mode: str) -> None:
    if mode != "plain":
        import ampdoctor  # noqa: F401
        if mode != "bare":
            ampdoctor.GradScaler  # loads ampdoctor.record (pyarrow, writer, shutdown's atexit handler)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    close = os.environ.get("AMPDOCTOR_PROBE_CLOSE", "1") == "1"

    def run(kind: str) -> None:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 4)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if kind == "plain":
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        elif kind == "record":
            scaler = ampdoctor.GradScaler("cpu", model=model, path=os.path.join(root, f"{kind}.parquet"),
                                          init_scale=2.0**10, level="full", every=1)
        else:  # rank0
            scaler = ampdoctor.wrap(torch.amp.GradScaler("cpu", init_scale=2.0**10), model=model,
                                    path=os.path.join(root, "rank0.parquet"), ranks=[0])
        gen = torch.Generator().manual_seed(10 + rank)
        for _ in range(STEPS):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(F.mse_loss(out.float(), y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        if close and kind != "plain" and getattr(scaler, "recorder", None) is not None:
            scaler.close()

    kinds = {"plain": ["plain"], "bare": ["plain"], "imported": ["plain"], "record": ["record"],
             "fixture": ["plain", "record", "rank0"]}[mode]
    for kind in kinds:
        run(kind)
    if os.environ.get("AMPDOCTOR_PROBE_DESTROY", "1") == "1":
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(mode: str, i: int, timeout: float, logdir: str | None) -> tuple[str, str, dict]:
    """One two-process run (spawned from this process), bounded by ``timeout`` seconds."""
    import torch.multiprocessing as mp
    t0 = time.monotonic()
    root = tempfile.mkdtemp(prefix="probe-", dir=os.environ.get("AMPDOCTOR_PROBE_TMP"))
    ctx = mp.start_processes(_rank, args=(_free_port(), root, mode), nprocs=2, join=False, start_method="spawn")
    error = None
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() - t0 > timeout:
                error = "timeout"
                for p in ctx.processes:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGKILL)
                for p in ctx.processes:
                    p.join(5)
                break
    except Exception as exc:  # ProcessExitedException / ProcessRaisedException (the other rank gets SIGTERM)
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        for p in ctx.processes:
            p.join(20)
    codes = [p.exitcode for p in ctx.processes]
    shutil.rmtree(root, ignore_errors=True)
    if error == "timeout":
        outcome = "timeout"
    elif -signal.SIGABRT in codes:
        outcome = "SIGABRT"
    elif all(c == 0 for c in codes):
        outcome = "ok"
    else:
        outcome = f"exit{codes}"
    info = {"exitcodes": codes, "pids": [p.pid for p in ctx.processes], "error": error,
            "seconds": round(time.monotonic() - t0, 2)}
    if logdir and outcome != "ok":
        with open(os.path.join(logdir, f"{mode}-{i:04d}-{outcome.replace(' ', '')}.log"), "w") as f:
            f.write(json.dumps(info) + "\n")
    info["i"] = i
    return mode, outcome, info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="imported,record")
    ap.add_argument("-n", type=int, default=200, help="jobs per mode")
    ap.add_argument("-j", type=int, default=1, help="jobs at once")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per job")
    ap.add_argument("--budget", type=float, default=3600.0, help="seconds for the whole probe")
    ap.add_argument("--log", default=None, help="directory for the logs of jobs that did not end ok")
    ap.add_argument("--out", default=None, help="write the counts as JSON here")
    a = ap.parse_args()
    if a.log:
        os.makedirs(a.log, exist_ok=True)
    modes = a.modes.split(",")
    tasks = [(m, i) for i in range(a.n) for m in modes]  # interleaved: modes see the same machine load
    counts: dict[str, Counter] = defaultdict(Counter)
    start = time.monotonic()
    done = 0
    with ThreadPoolExecutor(a.j) as pool:
        futures = []
        for m, i in tasks:
            futures.append(pool.submit(lambda m=m, i=i: None if time.monotonic() - start > a.budget
                                       else run_one(m, i, a.timeout, a.log)))
        for f in futures:
            r = f.result()
            if r is None:
                continue
            mode, outcome, info = r
            counts[mode][outcome] += 1
            done += 1
            if outcome != "ok":
                print(f"[{time.monotonic() - start:7.1f}s] {mode} #{info['i']}: {outcome} {info['exitcodes']} "
                      f"pids={info['pids']} ({info['error']})", flush=True)
            if done % 50 == 0:
                print(f"[{time.monotonic() - start:7.1f}s] {done} jobs: " +
                      "; ".join(f"{m} {dict(c)}" for m, c in counts.items()), flush=True)
    if a.out:
        import platform
        import subprocess
        import torch
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        with open(a.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "commit": commit, "torch": torch.__version__,
                       "machine": f"{platform.machine()}, {os.cpu_count()} cores", "jobs_at_once": a.j,
                       "seconds": round(time.monotonic() - start), "counts": {m: dict(counts[m]) for m in modes}},
                      f, indent=2)
            f.write("\n")
    print(f"SUMMARY after {time.monotonic() - start:.0f}s ({done} jobs):")
    for m in modes:
        c = counts[m]
        print(f"  {m:9s} runs={sum(c.values()):4d} ok={c['ok']:4d} SIGABRT={c['SIGABRT']:3d} "
              f"other={ {k: v for k, v in c.items() if k not in ('ok', 'SIGABRT')} }")


if __name__ == "__main__":
    main()
