"""Multi-process runs on the CPU (gloo): DDP, FSDP2 with ShardedGradScaler, per-rank recording.

Each scenario spawns two ranks once (``torch.multiprocessing``); the ranks train with fp16
autocast, record into one run directory, and leave what the assertions need in files.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ampdoctor
from ampdoctor.run_file.schema import META_RUN_ID, META_WORLD_SIZE
from models import MLP, batches, mse

WORLD = 2
STEPS = 8
FAULT = 5         # rank 1's batch at this step overflows fc1's fp16 output
QUIET = dict(init_scale=2.0**10, level="full", every=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(worker, root: Path, *args) -> None:
    mp.spawn(worker, args=(str(root), _free_port(), *args), nprocs=WORLD, join=True)


def _init(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)


def _data(rank: int):
    data = batches(STEPS, seed=10 + rank)
    if rank == 1:
        x, y = data[FAULT]
        data[FAULT] = (x * 1e5, y)  # fc1's output exceeds 65504 in fp16 on rank 1 only
    return data


def _train(model, scaler, data, opt) -> None:
    for x, y in data:
        scaler.scale(mse(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def _params(model) -> list[list[float]]:
    return [p.detach().float().flatten().tolist() for p in model.parameters()]


# -- DDP -------------------------------------------------------------------------------------

def _ddp_worker(rank: int, root: str, port: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    _init(rank, port)
    root = Path(root)
    finals = {}
    for name in ("plain", "ampdoctor", "rank0-only"):
        torch.manual_seed(0)
        model = DDP(MLP())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if name == "plain":
            scaler = torch.amp.GradScaler("cpu", init_scale=QUIET["init_scale"])
        elif name == "ampdoctor":
            scaler = ampdoctor.GradScaler("cpu", model=model, path=root / "ddp.parquet", **QUIET)
        else:
            scaler = ampdoctor.wrap(torch.amp.GradScaler("cpu", init_scale=QUIET["init_scale"]), model=model,
                                    path=root / "rank0.parquet", ranks=[0])
        _train(model, scaler, _data(rank), opt)
        if isinstance(scaler, ampdoctor.GradScaler) or getattr(scaler, "recorder", None) is not None:
            scaler.close()
        finals[name] = _params(model)
    (root / f"ddp-rank{rank}.json").write_text(json.dumps(finals))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    _spawn(_ddp_worker, root)
    return root


def test_ddp_report_names_the_rank_module_and_step_where_the_overflow_began(ddp_run):
    report = ampdoctor.report(ddp_run / "ddp.parquet")
    assert report["run"]["ranks"] == WORLD
    first = report["overflow_origins"][0]
    assert (first["name"], first["kind"], first["rank"], first["first_step"]) == ("fc1", "output", 1, FAULT)
    # Rank 0 only received the non-finite gradients through the all-reduce: it is no origin.
    assert all(o["rank"] == 1 for o in report["overflow_origins"])
    # DDP all-reduces gradients, so every rank skipped the same steps: no disagreement warning.
    assert not any("disagree" in w for w in report["warnings"])


def test_ddp_ranks_write_one_run(ddp_run):
    run = ampdoctor.read_run(ddp_run / "ddp.parquet")
    frame = run.frame
    assert set(frame["rank"]) == {0, 1}
    for rank in (0, 1):
        steps = frame[(frame["kind"] == "step") & (frame["rank"] == rank)]
        assert sorted(steps["step"]) == list(range(STEPS))
        assert bool(steps.set_index("step")["skipped"][FAULT])
    files = sorted((ddp_run / "ddp.parquet").glob("*.parquet"))
    metas = [pq.read_schema(f).metadata for f in files]
    assert len({m[META_RUN_ID.encode()] for m in metas}) == 1  # one run id, broadcast from rank 0
    assert {m[META_WORLD_SIZE.encode()] for m in metas} == {b"2"}
    assert {f.name.split("-")[1] for f in files} == {"r00000", "r00001"}
    # Names are the model's own, not DDP's "module." ones.
    assert "fc1.weight" in set(frame.loc[frame["kind"] == "param_grad", "name"])


def test_ddp_training_is_unchanged_and_ranks_option_limits_recording(ddp_run):
    for rank in (0, 1):
        finals = json.loads((ddp_run / f"ddp-rank{rank}.json").read_text())
        assert finals["ampdoctor"] == finals["plain"] == finals["rank0-only"]
    # Every step was measured (every=1): the shadow backward never runs a collective, so the
    # all-reduced parameter gradients are unmeasured (the estimate stands in), while the module
    # output gradients, computed on each rank before the reduction, are measured.
    frame = ampdoctor.load(ddp_run / "ddp.parquet")
    assert frame[frame.kind == "param_grad"].n_underflow.isna().all()
    assert frame[frame.kind == "grad_output"].n_underflow.notna().any()
    ranks = set(ampdoctor.load(ddp_run / "rank0.parquet")["rank"])
    assert ranks == {0}


# -- ranks that disagree on found_inf --------------------------------------------------------

def _local_worker(rank: int, root: str, port: int) -> None:
    """No DDP: each rank steps on its own gradients, so only rank 1 skips the fault step."""
    _init(rank, port)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = ampdoctor.GradScaler("cpu", model=model, path=Path(root) / "local.parquet", **QUIET)
    _train(model, scaler, _data(rank), opt)
    scaler.close()
    dist.destroy_process_group()


def test_ranks_that_skip_different_steps_are_warned_about(tmp_path):
    _spawn(_local_worker, tmp_path)
    report = ampdoctor.report(tmp_path / "local.parquet")
    warning = [w for w in report["warnings"] if "disagree on found_inf" in w]
    assert warning and f"step {FAULT}" in warning[0]


# -- FSDP2 + ShardedGradScaler -----------------------------------------------------------------

def _fsdp_worker(rank: int, root: str, port: int) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    _init(rank, port)
    root = Path(root)
    finals = {}
    for name in ("plain", "ampdoctor"):
        torch.manual_seed(0)
        model = MLP()
        for module in (model.fc1, model.fc2):
            fully_shard(module)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = ShardedGradScaler("cpu", init_scale=QUIET["init_scale"])
        if name == "ampdoctor":
            scaler = ampdoctor.wrap(scaler, model=model, path=root / "fsdp.parquet", level="full", every=1)
        _train(model, scaler, batches(STEPS, seed=10 + rank), opt)
        if name == "ampdoctor":
            ampdoctor.unwrap(scaler)
        finals[name] = [p.to_local().detach().flatten().tolist() for p in model.parameters()]
    (root / f"fsdp-rank{rank}.json").write_text(json.dumps(finals))
    dist.destroy_process_group()


def test_fsdp2_sharded_scaler_records_original_names_and_trains_identically(tmp_path):
    _spawn(_fsdp_worker, tmp_path)
    for rank in (0, 1):
        finals = json.loads((tmp_path / f"fsdp-rank{rank}.json").read_text())
        assert finals["ampdoctor"] == finals["plain"]
    frame = ampdoctor.load(tmp_path / "fsdp.parquet")
    grads = frame[frame["kind"] == "param_grad"]
    assert set(grads["name"]) == {n for n, _ in MLP().named_parameters()}
    # Each rank observed its own shard: together they cover every element once.
    per_rank = grads[grads["step"] == 0].groupby("name")["numel"].sum()
    assert per_rank.to_dict() == {n: p.numel() for n, p in MLP().named_parameters()}
    assert set(frame["rank"]) == {0, 1}
    modules = set(frame.loc[frame["kind"] == "output", "name"])
    assert {"fc1", "fc2", "(model)"} <= modules and not any("fsdp" in m.lower() for m in modules)
    # The advice is in the run's own scaler class: an FSDP user pastes a ShardedGradScaler (issue 40)
    import torch.distributed.fsdp.sharded_grad_scaler as sharded
    from ampdoctor.analysis.report import report_data
    from ampdoctor.read.run import read_run
    from ampdoctor.render import contract
    report = contract(report_data(read_run(tmp_path / "fsdp.parquet")))
    assert report["run"]["scaler"]["class"] == "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler"
    rec = report["recommendation"]
    assert rec["code"].startswith('torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler("cpu", '), rec["code"]
    scaler = eval(rec["code"], {"torch": torch})  # noqa: S307 - our own generated line
    assert type(scaler) is sharded.ShardedGradScaler and scaler.get_scale() == rec["init_scale"]
