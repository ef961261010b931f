"""rows.py on its own: the rows the writer builds from each kind of record."""

from __future__ import annotations

import math

import numpy as np
import torch

from ampdoctor.float_formats import FLOAT16
from ampdoctor.record.hooks import ModuleCall
from ampdoctor.record.light_taps import LightTaps
from ampdoctor.record.records import (FlightRecord, GroupRecord, ParamCheck, ParamRecord, StepRecord, TapObservation,
                                      pack_scalars, read_scalars)
from ampdoctor.record.rows import materialize
from ampdoctor.run_file.schema import HIST_BINS, run_schema
from ampdoctor.stats import full_stats, light_stats

SCHEMA_COLUMNS = set(run_schema({}).names)


def _scalars(*, scale=1024.0, skipped=False, loss=2.5, param_peak=3.0):
    return pack_scalars(torch.tensor(scale), torch.tensor(float(skipped)), torch.tensor(loss), torch.tensor(param_peak),
                        has_loss=True, has_params=True)


def test_a_step_s_scalars_read_back_as_packed():
    assert read_scalars(_scalars(scale=8.0, skipped=True, loss=0.5, param_peak=2.0)) == (8.0, True, 0.5, 2.0)
    scalars = read_scalars(pack_scalars(torch.tensor(1.0), torch.tensor(0.0), torch.tensor(7.0), torch.tensor(0.0),
                                        has_loss=False, has_params=False))
    assert scalars.loss is None and scalars.param_peak is None and not scalars.skipped
    assert read_scalars(None) == (1.0, False, None, None)  # a step without scalars (nothing to scale)


def _rows(record):
    blocks, anomaly = materialize(record, hist_bins=HIST_BINS)
    for columns, n in blocks:
        assert set(columns) == SCHEMA_COLUMNS and all(len(v) == n for v in columns.values())
    return [dict(zip(columns, values)) for columns, n in blocks for values in zip(*columns.values())], anomaly


def test_a_sampled_step_gives_a_step_row_gradient_rows_tap_rows_and_parameter_rows():
    grads = [torch.tensor([1.0, 0.0, -3.0]), torch.tensor([[2.0**-20]])]
    inv = torch.tensor(1 / 1024)
    stats = full_stats(grads, inv_scale=inv, subnormal_below=FLOAT16.smallest_normal)
    call = ModuleCall("fc1", 0, None, (), 0)
    tap = TapObservation("output", call, 0, "float16", 3,
                         full_stats([torch.tensor([1.0, 2.0, 4.0])], inv_scale=None, subnormal_below=1e-5))
    params = ParamCheck(["w", "b"], [3, 1], torch.tensor([0.5, math.inf]))
    record = StepRecord(step=7, rank=1, per_tensor=True, amp_dtype="float16", scalars=_scalars(param_peak=math.inf),
                        groups=[GroupRecord(["w", "b"], "float32", np.array([3, 1]), stats)], taps=[tap], params=params)
    rows, anomaly = _rows(record)
    assert [r["kind"] for r in rows] == ["step", "param_grad", "param_grad", "output", "param", "param"]
    step, w, b, out, all_params, bad = rows
    assert step["numel"] == 4 and step["loss"] == 2.5 and step["scale"] == 1024 and not step["skipped"]
    assert w["amax"] == np.float32(3 / 1024) and w["n_zero"] == 1 and b["n_zero"] == 0
    assert out["name"] == "fc1" and out["call"] == 0 and out["amax"] == 4.0
    assert all_params["name"] == "" and math.isinf(all_params["amax"]) and bad["name"] == "b"
    assert anomaly  # the step's scalars carry the largest parameter peak: inf
    # ... a light step: peak and norm only, the rest null
    light = StepRecord(step=8, rank=1, per_tensor=True, amp_dtype="float16", scalars=_scalars(param_peak=1.0),
                       groups=[GroupRecord(["w", "b"], "float32", np.array([3, 1]), light_stats(grads, inv_scale=inv))])
    rows, anomaly = _rows(light)
    assert [r["kind"] for r in rows] == ["step", "param_grad", "param_grad"] and not anomaly
    assert rows[1]["n_zero"] is None and rows[1]["hist"] is None and rows[1]["l2"] > 0


def test_flight_and_parameter_records():
    call = ModuleCall("blocks.0", 3, None, (1,), 0)
    light = LightTaps(limit=10)  # the flight recorder's buffer, as the taps fill it on a light step
    light.add("output", call, 0, torch.tensor([70000.0, -1.0]))
    light.add("grad_output", call, 1, torch.tensor([3.0, -2048.0, 0.5], dtype=torch.float16))
    flight_step = light.flight_step(5)
    flight_step.scalars = _scalars(scale=2048.0, skipped=True)
    rows, anomaly = _rows(FlightRecord(0, [flight_step]))
    assert anomaly and [r["kind"] for r in rows] == ["output", "grad_output"]
    assert rows[0]["amax"] == 70000.0 and rows[1]["amax"] == 1.0  # a gradient's peak is unscaled
    assert [r["dtype"] for r in rows] == ["float32", "float16"] and [r["numel"] for r in rows] == [2, 3]
    assert rows[0]["inputs"] == [1] and rows[0]["skipped"] and rows[0]["n_zero"] is None
    assert light.flight_step(6) is None  # the buffer starts the next step empty
    rows, anomaly = _rows(ParamRecord(9, 0, "float16", _scalars(), ParamCheck(["w"], [4], torch.tensor([math.nan]))))
    assert anomaly and len(rows) == 2 and math.isnan(rows[0]["amax"]) and rows[1]["name"] == "w"
