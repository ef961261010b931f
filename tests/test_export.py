"""``ampdoctor export RUN --tensorboard DIR``: every scalar and histogram read back with TensorBoard's
own reader and checked, step by step, against the run's rows (``ampdoctor.load``)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import ampdoctor
from ampdoctor.read.run import read_run
from ampdoctor.analysis.underflow import underflow_bounds
from ampdoctor.cli.commands import main
from ampdoctor.float_formats import FLOAT16
from models import batches, mse

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

STEPS = 12


def _record(path, *, rank=None, seed=0, level="full", init_scale=2.0**24):
    """Train an nn.Sequential MLP with fp16 autocast on the CPU: init_scale 2**24 skips the first
    steps; every=3 plus the escalated steps give several steps with full statistics."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    options = {} if rank is None else {"rank": rank}
    scaler = ampdoctor.GradScaler("cpu", init_scale=init_scale, model=model, path=path, level=level, every=3,
                                  escalate_steps=2, **options)
    for x, y in batches(STEPS, seed=seed):
        scaler.scale(mse(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    scaler.close()


def _export(run_path, logdir, *args):
    result = CliRunner().invoke(main, ["export", str(run_path), "--tensorboard", str(logdir), *args])
    assert result.exit_code == 0, result.output
    return result


def _read(directory):
    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def _same(got: list[float], want: list[float]) -> bool:
    """Equal as TensorBoard stores them (float32), NaN equal to NaN."""
    got, want = np.asarray(got, dtype=np.float32), np.asarray(want, dtype=np.float32)
    return got.shape == want.shape and bool(np.all((got == want) | (np.isnan(got) & np.isnan(want))))


def _check_rank(acc, frame, rank):
    """Every scalar and histogram of one rank's event files against that rank's rows."""
    meta = frame.attrs["metadata"]
    min_exp, bins = int(meta["hist.min_exp"]), int(meta["hist.bins"])
    rows = frame[frame["rank"] == rank]
    steps = rows[rows["kind"] == "step"].sort_values("step")
    tags = acc.Tags()

    def series(tag):
        events = acc.Scalars(tag)
        return [e.step for e in events], [e.value for e in events]

    expected_steps = steps["step"].tolist()
    for tag, column in (("steps/scale", "scale"), ("steps/grad_norm", "l2")):
        got_steps, values = series(tag)
        assert got_steps == expected_steps, tag
        assert _same(values, steps[column].astype(float).tolist()), tag
    got_steps, values = series("steps/skipped")
    assert got_steps == expected_steps and values == [float(s) for s in steps["skipped"]]
    got_steps, values = series("steps/skipped_total")
    assert got_steps == expected_steps and values == np.cumsum(steps["skipped"].astype(float)).tolist()
    assert values[-1] > 0  # init_scale 2**24 overflows: the check covers skipped steps
    recorded = steps[steps["loss"].notna()]
    got_steps, values = series("steps/loss")
    assert got_steps == recorded["step"].tolist()
    assert _same(values, recorded["loss"].astype(float).tolist())

    # Histograms: one per (step, kind, name) with full statistics and a nonzero element; the calls of
    # a module summed; buckets from the first to the last nonzero binade, upper edges 2**(min_exp+i+1).
    layer = rows[rows["kind"].isin(["param_grad", "grad_output", "output"]) & rows["n_zero"].notna()]
    expected = {}
    for (step, kind, name), group in layer.groupby(["step", "kind", "name"], observed=True):
        counts = np.sum(np.stack(group["hist"].to_list()), axis=0)
        if counts.sum():
            expected.setdefault(f"{kind}/{name}", {})[int(step)] = (counts, group)
    assert set(tags["histograms"]) == set(expected)
    assert any(t.startswith("grad_output/") for t in expected) and any(t.startswith("output/") for t in expected)
    for tag, by_step in expected.items():
        events = acc.Histograms(tag)
        assert [e.step for e in events] == sorted(by_step), tag
        for event in events:
            counts, group = by_step[event.step]
            h = event.histogram_value
            nonzero = np.flatnonzero(counts)
            lo, hi = nonzero[0], nonzero[-1]
            assert h.bucket == counts[lo:hi + 1].tolist()
            edges = [2.0 ** (min_exp + i + 1) for i in range(lo, hi + 1)]
            if hi == bins - 1:
                edges[-1] = sys.float_info.max
            assert h.bucket_limit == edges
            assert h.num == counts.sum()
            assert h.max == pytest.approx(group["amax"].max(), rel=1e-6)
            assert h.min == pytest.approx(group["amin"][group["amin"] > 0].min(), rel=1e-6)
            assert h.sum_squares == pytest.approx(float((group["l2"].astype(float) ** 2).sum()), rel=1e-5)
            assert h.min <= h.bucket_limit[0] and h.max <= h.bucket_limit[-1]  # min and max in the end buckets
            # The edges are in true-gradient units: the largest recorded magnitude (amax, unscaled)
            # lies inside the top bucket, not one binade (or a scale's worth) away from it.
            if hi < bins - 1 and len(edges) > 1:
                assert edges[-2] <= h.max < edges[-1], (tag, h.max, edges[-2:])

    # Underflow: parameter gradients recomputed from their rows with the estimate of analysis/underflow.py
    # (one row per parameter and step); a layer that held a NaN or inf in a step has no point.
    params = layer[layer["kind"] == "param_grad"]
    for name, group in params.groupby("name", observed=True):
        judged = group[(group["n_nan"] + group["n_inf"]) == 0].sort_values("step")
        hist = np.stack(judged["hist"].to_list()).astype(np.float64)
        cut = np.log2(FLOAT16.underflow_below / judged["scale"].to_numpy(np.float64))
        estimate, upper = underflow_bounds(hist, judged["n_zero"].to_numpy(np.float64),
                                           judged["n_subnormal"].to_numpy(np.float64), cut, min_exp,
                                           judged["n_zero_lines"].to_numpy(np.float64), pile_lines=True)
        numel = judged["numel"].to_numpy(np.float64)
        for prefix, value in (("underflow_min", estimate), ("underflow_max", upper)):
            known = ~np.isnan(value)
            got_steps, values = series(f"{prefix}/param_grad/{name}")
            assert got_steps == judged["step"][known].tolist(), (prefix, name)
            assert _same(values, (value[known] / numel[known]).tolist()), (prefix, name)
    module_tags = [t for t in tags["scalars"] if t.startswith("underflow_min/grad_output/")]
    assert module_tags  # module output gradients get rates too ...
    for tag in module_tags:
        low = dict(zip(*series(tag)))
        high = dict(zip(*series(tag.replace("underflow_min", "underflow_max", 1))))
        assert all(0 <= low[s] <= high[s] <= 1 for s in low)
    assert not [t for t in tags["scalars"] if "/output/" in t]  # ... activations none (not loss-scaled)
    assert set(tags["scalars"]) == ({"steps/scale", "steps/skipped", "steps/skipped_total", "steps/loss",
                                     "steps/grad_norm"} | {t for t in tags["scalars"] if t.startswith("underflow_")})


def test_export_writes_every_scalar_and_histogram_of_the_run(tmp_path):
    run_path, logdir = tmp_path / "run.parquet", tmp_path / "tb"
    _record(run_path)
    result = _export(run_path, logdir)
    assert f"tensorboard --logdir {logdir}" in result.output
    assert sorted(p.name for p in logdir.iterdir()) == ["rank0"]
    frame = ampdoctor.load(run_path)
    _check_rank(_read(logdir / "rank0"), frame, 0)


def test_export_of_two_ranks_writes_one_directory_per_rank(tmp_path, monkeypatch):
    """Two ranks' rows in one run (recorded with rank=0 and rank=1 into one path, one run id), on
    different data: each rank's directory holds exactly that rank's points."""
    monkeypatch.setenv("AMPDOCTOR_RUN_ID", "two-ranks")
    run_path, logdir = tmp_path / "run.parquet", tmp_path / "tb"
    _record(run_path, rank=0, seed=0)
    _record(run_path, rank=1, seed=1)
    result = CliRunner().invoke(main, ["export", str(run_path), "--tensorboard", str(logdir), "--format", "json"])
    assert result.exit_code == 0, result.output
    written = json.loads(result.output)
    assert [r["rank"] for r in written["ranks"]] == [0, 1] and written["run_id"] == "two-ranks"
    assert all(r["steps"] == STEPS and r["histograms"] > 0 for r in written["ranks"])
    frame = ampdoctor.load(run_path)
    assert sorted(frame["rank"].unique()) == [0, 1]
    for rank in (0, 1):
        _check_rank(_read(logdir / f"rank{rank}"), frame, rank)
    losses = [[e.value for e in _read(logdir / f"rank{r}").Scalars("steps/loss")] for r in (0, 1)]
    assert losses[0] != losses[1]  # the ranks are not mixed


def test_export_of_a_params_run_and_run_selection(tmp_path):
    """A level='params' run has no module histograms; ``--run ID`` exports the run asked for."""
    run_path = tmp_path / "run.parquet"
    _record(run_path, level="params", init_scale=2.0**10)
    first = ampdoctor.read_run(run_path).metadata["run.id"]
    _record(run_path, level="params", seed=3)  # a second run at the same path: the latest by default
    logdir = tmp_path / "tb"
    _export(run_path, logdir, "--run", first)
    acc = _read(logdir / "rank0")
    assert acc.Tags()["histograms"] and all(t.startswith("param_grad/") for t in acc.Tags()["histograms"])
    frame = ampdoctor.load(run_path, first)
    _check_rank_scalars_only(acc, frame)


def _check_rank_scalars_only(acc, frame):
    steps = frame[frame["kind"] == "step"].sort_values("step")
    events = acc.Scalars("steps/loss")
    assert [e.step for e in events] == steps["step"].tolist()
    assert _same([e.value for e in events], steps["loss"].astype(float).tolist())
    assert [e.value for e in acc.Scalars("steps/skipped_total")][-1] == 0  # 2**10: nothing skipped


def test_export_refuses_a_directory_with_an_earlier_export(tmp_path):
    run_path, logdir = tmp_path / "run.parquet", tmp_path / "tb"
    _record(run_path, level="steps")
    _export(run_path, logdir)
    result = CliRunner().invoke(main, ["export", str(run_path), "--tensorboard", str(logdir)])
    assert result.exit_code == 2
    assert "already holds TensorBoard event files" in result.output and len(result.output.splitlines()) == 1


def test_export_without_tensorboard_names_the_extra(tmp_path, monkeypatch):
    run_path = tmp_path / "run.parquet"
    _record(run_path, level="steps")
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard raises ImportError
    for name in [m for m in sys.modules if m.startswith("torch.utils.tensorboard")]:
        monkeypatch.delitem(sys.modules, name)
    result = CliRunner().invoke(main, ["export", str(run_path), "--tensorboard", str(tmp_path / "tb")])
    assert result.exit_code == 2
    assert result.output.startswith("Error: ") and len(result.output.splitlines()) == 1
    assert 'pip install "ampdoctor[tensorboard]"' in result.output
    assert not (tmp_path / "tb").exists()


def test_export_needs_a_target(tmp_path):
    run_path = tmp_path / "run.parquet"
    _record(run_path, level="steps")
    result = CliRunner().invoke(main, ["export", str(run_path)])
    assert result.exit_code == 2 and "--tensorboard" in result.output


def test_a_failed_export_leaves_no_event_files_so_a_retry_works(tmp_path, monkeypatch):
    """An export that fails half way (here: reading the layer rows) removes its event files, so
    the directory is not refused as holding an earlier export when the user retries."""
    import ampdoctor.export.tensorboard as tensorboard_export
    from ampdoctor.export.tensorboard import export_tensorboard

    from test_run import record

    path = record(tmp_path / "run.parquet", steps=4)
    logdir = tmp_path / "tb"

    def broken(*args, **kwargs):
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(tensorboard_export, "layer_points", broken)
        with pytest.raises(OSError, match="disk full"):
            export_tensorboard(read_run(path), logdir)
    assert not list(logdir.glob("rank*/events.out.tfevents*"))
    assert export_tensorboard(read_run(path), logdir)["ranks"][0]["steps"] == 4
