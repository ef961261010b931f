"""The FP8 readiness analysis (``ampdoctor/analysis/fp8.py``, issue 29) on GEMM operand rows made
from real tensors: each row's amax and fine histogram (``stats.fine_hist``) as the recorder writes
them, the analysis's predictions against ``fp8_truth``'s float8 casts of the same tensors (flushed
and saturated shares within max(0.5 percentage points, 25%), clipped passes exactly), the verdicts,
the shortest history against a brute-force search, non-finite amaxes, several calls and ranks,
torchao's filter, and a run without GEMM rows."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import fp8_truth as F
import ampdoctor
from ampdoctor.run_file import fine_bins
from ampdoctor.analysis import fp8
from ampdoctor.errors import RunError
from ampdoctor.run_file.schema import META_GEMM_LAYERS, META_LEVEL, META_RUN_ID, META_SCHEMA_VERSION, SCHEMA_VERSION
from ampdoctor.stats import fine_hist as FH
from contract_check import FP8_CONTRACT, check_contract

INPUT, WEIGHT, GRAD = "gemm_input", "gemm_weight", "gemm_grad_output"
# (operand, row kind, format key, torch dtype) as the analysis predicts them
VARIANTS = (("input", INPUT, "e4m3", F.E4M3), ("weight", WEIGHT, "e4m3", F.E4M3),
            ("grad_output", GRAD, "e5m2", F.E5M2), ("grad_output", GRAD, "e4m3", F.E4M3))
HISTORIES = (1, 16, 1024)
FORMAT_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def _within(predicted: float, true: float) -> bool:
    """The issue's tolerance: max(0.5 percentage points, 25% of the truth)."""
    return abs(predicted - true) <= max(0.005, 0.25 * true)


def _amax(x: torch.Tensor) -> np.float32:
    """The recorder's amax: NaN if the tensor holds one, else inf if it holds one, else max |x|."""
    return np.float32(x.abs().max()) if x.numel() else np.float32(0.0)


def _row(name, kind, x, step, call=0, rank=0, sampled=True) -> dict:
    counts, zeros = FH.fine_hist(x)
    return {"step": step, "rank": rank, "kind": kind, "name": name, "call": call, "amax": _amax(x),
            "n_zero": int(zeros) if sampled else None, "fine_hist": counts.numpy() if sampled else None}


def _frame(rows) -> pd.DataFrame:
    frame = pd.DataFrame(rows)
    frame["amax"] = frame["amax"].astype(np.float32)
    return frame


def _layer_rows(name, ops: dict[str, list[torch.Tensor]], sampled=lambda step: True) -> list[dict]:
    """One pass per step of each operand given ({row kind: tensors})."""
    return [_row(name, kind, x, step, sampled=sampled(step)) for kind, xs in ops.items() for step, x in enumerate(xs)]


def _truth(xs, dtype, recipe, history):
    return F.current_scaling(xs, dtype) if recipe == "current" else F.delayed_scaling(xs, dtype, history)


def _cells(pred: pd.DataFrame, layer, operand, fmt, recipe, history) -> pd.DataFrame:
    rows = pred[(pred["layer"] == layer) & (pred["operand"] == operand) & (pred["format"] == fmt)
                & (pred["recipe"] == recipe)]
    rows = rows[rows["history"].isna()] if history is None else rows[rows["history"] == history]
    return rows.sort_values(["step", "call"])


RECIPES = [("current", None)] + [("delayed", h) for h in HISTORIES]


def _compare(pred, layer, operand, fmt, dtype, xs) -> tuple[int, list]:
    """Every sampled cell of one operand in one format against the truth: (cells, misses); the
    clipped flags are asserted exactly on every pass."""
    cells, misses = 0, []
    for recipe, history in RECIPES:
        rows = _cells(pred, layer, operand, fmt, recipe, history)
        casts = _truth(xs, dtype, recipe, history)
        assert len(rows) == len(casts)
        assert rows["clipped"].tolist() == [c.clipped for c in casts], (layer, operand, fmt, recipe, history)
        for (_, r), cast in zip(rows.iterrows(), casts):
            if math.isnan(r["flushed"]):
                continue
            for what, p, t in (("flushed", r["flushed"], cast.flushed_share),
                               ("saturated", r["saturated"], cast.saturated_share)):
                cells += 1
                if not _within(p, t):
                    misses.append((operand, fmt, recipe, history, int(r["step"]), what, p, t))
    return cells, misses


# -- the fine histogram's host helpers, mirrored without torch -------------------------------------------

def test_the_fine_histogram_counts_what_lies_below_a_threshold_to_within_its_bin():
    """``stats.fine_hist`` (device) and ``fine_bins`` (readers) against the elements themselves:
    every bin's edges hold exactly the elements counted in it, and the count below a threshold
    is exact at a bin edge and off by less than the threshold's own bin elsewhere."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, generator=gen) * torch.exp(torch.randn(200_000, generator=gen) * 3)
    x[:100] = 0.0
    x[100], x[101] = math.inf, math.nan
    counts, zeros = FH.fine_hist(x)
    counts = counts.numpy()
    assert int(zeros) == 100 and counts.sum() == x.numel() - 100
    mags = x.abs().double().numpy()
    finite = mags[np.isfinite(mags) & (mags > 0)]
    edges = fine_bins.EDGES
    per_bin = np.histogram(finite, bins=edges[:fine_bins.NONFINITE_BIN + 1])[0]
    assert np.array_equal(per_bin, counts[:fine_bins.NONFINITE_BIN])
    assert counts[fine_bins.NONFINITE_BIN:].sum() == 2
    rng = np.random.default_rng(1)
    thresholds = np.concatenate([np.exp2(rng.uniform(-40, 20, 30)), edges[[900, 1016, 1100]],
                                 [0.0, -1.0, math.nan, math.inf, 448.0 / 3, 2.0**-10, 2.0**-17]])
    got = fine_bins.count_below(np.tile(counts, (len(thresholds), 1)), thresholds)
    for t, g in zip(thresholds, got):
        true = int((finite < t).sum()) if t > 0 else 0
        if t in edges or not np.isfinite(t) or t <= 0:
            assert g == true, t
        else:
            b = fine_bins.bin_of(np.array([t]))[0]
            assert abs(g - true) < counts[b] + 1e-9, t

def test_reading_fp8_data_imports_no_torch():
    code = ("import sys\nimport ampdoctor.analysis.fp8\n"
            "assert 'torch' not in sys.modules, 'ampdoctor.analysis.fp8 imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- predictions against the casts of real tensors --------------------------------------------------------

def _tensors(case: str, n: int, size: int, gen: torch.Generator, scale: float) -> list[torch.Tensor]:
    out = []
    for t in range(n):
        x = torch.randn(size, generator=gen) * scale * (1 + 0.05 * t)
        if case == "heavy_tailed":  # a scale mixture over many binades
            x = x * torch.exp(2.0 * torch.randn(size, generator=gen))
        elif case == "outliers":
            x[torch.randint(0, size, (3,), generator=gen)] *= 300.0
        elif case == "zeros":
            x[torch.rand(size, generator=gen) < 0.3] = 0.0
            if t == 5:
                x = torch.zeros(size)  # an all-zero pass: amax 0, the delayed scale is kept
        elif case == "jump" and t in (8, 9):
            x = x * 50.0  # the amax jumps past every history, then falls back
        out.append(x)
    return out


@pytest.mark.parametrize("case", ["normal", "heavy_tailed", "outliers", "zeros", "jump", "tiny"])
def test_the_predictions_match_the_float8_casts(case):
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    n = 18
    # operand scales as in training: activations ~1, weights ~0.02, gradients small ("tiny": the
    # gradients of a bf16 run without loss scaling, near E5M2's flush threshold at scale 1)
    grad_scale = 1e-7 if case == "tiny" else 1e-3
    ops = {INPUT: _tensors(case, n, 8192, gen, 1.0), WEIGHT: _tensors(case, n, 8192, gen, 0.02),
           GRAD: _tensors(case, n, 8192, gen, grad_scale)}
    pred = fp8.frame_predictions(_frame(_layer_rows("fc", ops, sampled=lambda step: step % 3 != 1)))
    assert set(pred.columns) >= {"layer", "operand", "format", "variant", "recipe", "history", "step", "call",
                                 "amax", "scale", "allowed", "clipped", "flushed", "saturated"}
    cells, misses = 0, []
    for operand, kind, fmt, dtype in VARIANTS:
        c, m = _compare(pred, "fc", operand, fmt, dtype, ops[kind])
        cells += c
        misses += m
    assert cells == 4 * 4 * 12 * 2
    assert not misses, misses[:10]


def test_the_cells_flush_and_saturate_where_the_casts_do():
    """Not a vacuous agreement: the cases above include cells far from 0 on both counts."""
    gen = torch.Generator().manual_seed(3)
    xs = _tensors("jump", 12, 8192, gen, 1.0)
    xs[0] = xs[0] * 1e-3  # at scale 1 (the first delayed pass) E4M3 flushes |x| <= 2^-10: a good share
    pred = fp8.frame_predictions(_frame(_layer_rows("fc", {INPUT: xs})))
    truth = F.delayed_scaling(xs, F.E4M3, 16)
    rows = _cells(pred, "fc", "input", "e4m3", "delayed", 16)
    assert truth[0].flushed_share > 0.2 and _within(rows["flushed"].iloc[0], truth[0].flushed_share)
    assert truth[8].saturated_share > 0.5 and _within(rows["saturated"].iloc[8], truth[8].saturated_share)
    assert truth[10].flushed_share > 0 and _within(rows["flushed"].iloc[10], truth[10].flushed_share)
    current = _cells(pred, "fc", "input", "e4m3", "current", None)
    assert (current["saturated"] == 0).all() and not current["clipped"].any()


def test_a_clipped_pass_saturates_at_least_its_amax_element():
    """The amax 1.1 just beyond the history's 1.09, in the same fine bin [1, 1.125): a flat density
    over the bin would put a tenth of an element above 1.09; the amax element itself is."""
    small = torch.linspace(0.1, 0.5, 15)
    xs = [torch.cat([small, torch.tensor([1.09])]), torch.cat([small, torch.tensor([1.1])])]
    pred = fp8.frame_predictions(_frame(_layer_rows("fc", {INPUT: xs})))
    cells, misses = _compare(pred, "fc", "input", "e4m3", F.E4M3, xs)
    assert cells and not misses, misses
    assert _cells(pred, "fc", "input", "e4m3", "delayed", 1)["saturated"].iloc[1] == 1 / 16


def test_several_calls_per_step_are_passes_of_their_own_and_the_weight_one_per_step():
    gen = torch.Generator().manual_seed(4)
    steps, calls = 6, 3
    inputs = [[torch.randn(4096, generator=gen) * (1 + c + (4 if (s, c) == (3, 1) else 0)) for c in range(calls)]
              for s in range(steps)]
    weights = [torch.randn(4096, generator=gen) * 0.02 for _ in range(steps)]
    rows = [_row("attn", INPUT, x, s, call=10 + c) for s in range(steps) for c, x in enumerate(inputs[s])]
    rows += [_row("attn", WEIGHT, w, s, call=10) for s, w in enumerate(weights)]
    rows += [_row("attn", GRAD, x * 1e-3, s, call=10 + c) for s in range(steps) for c, x in enumerate(inputs[s])]
    frame = _frame(rows).sample(frac=1.0, random_state=0)  # (the order of the rows does not matter)
    pred = fp8.frame_predictions(frame)
    flat = [x for per_step in inputs for x in per_step]  # passes in (step, call) order
    for operand, fmt, dtype, xs in (("input", "e4m3", F.E4M3, flat), ("weight", "e4m3", F.E4M3, weights),
                                    ("grad_output", "e5m2", F.E5M2, [x * 1e-3 for x in flat])):
        cells, misses = _compare(pred, "attn", operand, fmt, dtype, xs)
        assert cells and not misses, misses[:5]
    input_rows = _cells(pred, "attn", "input", "e4m3", "delayed", 1)
    assert input_rows["call"].tolist() == [10, 11, 12] * steps
    data = fp8.frame_data(frame)
    layer = data["layers"][0]
    assert layer["calls_per_step"] == 3 and "several_calls_per_step" in data["limits"]
    inp = layer["operands"][0]
    assert inp["passes"] == steps * calls and layer["operands"][1]["passes"] == steps
    assert 3 in inp["recipes"][1]["clipped_steps"]  # (the spike at step 3, call 1, under history 1)


def test_several_ranks_make_one_pass_of_the_largest_amax_and_the_summed_counts():
    """Each tensor split over two ranks predicts what the whole tensor does (TransformerEngine
    reduces the amax over ranks): the same shares, scales and clips."""
    gen = torch.Generator().manual_seed(5)
    xs = _tensors("jump", 10, 8192, gen, 1.0)
    whole = fp8.frame_predictions(_frame(_layer_rows("fc", {INPUT: xs})))
    rows = []
    for step, x in enumerate(xs):
        a, b = x[:3000], x[3000:]
        rows += [_row("fc", INPUT, a, step, rank=0), _row("fc", INPUT, b, step, rank=1)]
    split = fp8.frame_predictions(_frame(rows))
    for column in ("amax", "scale", "allowed", "flushed", "saturated"):
        assert np.allclose(split[column], whole[column], rtol=1e-12, atol=0, equal_nan=True), column
    assert split["clipped"].tolist() == whole["clipped"].tolist()
    # a NaN on one rank makes the pass's amax NaN; an inf on the other, inf
    rows[0]["amax"] = np.float32(math.nan)
    rows[3]["amax"] = np.float32(math.inf)
    amax = _cells(fp8.frame_predictions(_frame(rows)), "fc", "input", "e4m3", "current", None)["amax"]
    assert math.isnan(amax.iloc[0]) and math.isinf(amax.iloc[1])
    assert "several_ranks" in fp8.frame_data(_frame(rows))["limits"]


# -- verdicts ---------------------------------------------------------------------------------------------

def _model_rows(gen, steps=8, sampled=lambda step: step % 2 == 0) -> tuple[list[dict], dict]:
    """Three layers: ``fc1`` ordinary, ``head`` whose weight holds one huge element (every step),
    ``fc2`` never sampled. Returns the rows and the head's weights."""
    rows, tensors = [], {}
    for name in ("fc1", "head", "fc2"):
        ops = {INPUT: [torch.randn(4096, generator=gen) for _ in range(steps)],
               WEIGHT: [torch.randn(4096, generator=gen) * 0.02 for _ in range(steps)],
               GRAD: [torch.randn(4096, generator=gen) * 1e-4 for _ in range(steps)]}
        if name == "head":
            for w in ops[WEIGHT]:
                w[7] = 1e4  # tensorwise scaling maps it to 448: most of the rest (~0.02) flushes in E4M3
        tensors[name] = ops
        rows += _layer_rows(name, ops, sampled=(lambda step: False) if name == "fc2" else sampled)
    return rows, tensors


def test_a_pass_that_overflowed_in_the_amp_dtype_itself_keeps_no_layer():
    """An input whose sampled pass holds infs (the fp16 run overflowed there: its report says so)
    saturates them under any recipe; the verdict leaves such passes out. The same layer with a
    finite outlier at that pass instead is kept."""
    gen = torch.Generator().manual_seed(12)
    xs = [torch.randn(4096, generator=gen) for _ in range(4)]
    overflowed = [x.clone() for x in xs]
    overflowed[2][:1000] = math.inf
    data = fp8.frame_data(_frame(_layer_rows("fc", {INPUT: overflowed})))
    layer = data["layers"][0]
    current = layer["operands"][0]["recipes"][0]
    assert current["saturated_max"] > 0.2  # (the shares still say what a cast would do)
    assert layer["verdict"] == "unknown" and layer["reasons"] == []  # (unknown: no weight or gradient rows here)
    outlier = [x.clone() for x in xs]
    outlier[2][0] = 1e7  # finite: most of the rest flushes in E4M3
    assert fp8.frame_data(_frame(_layer_rows("fc", {INPUT: outlier})))["layers"][0]["verdict"] == "keep"


def test_verdicts_keep_an_outlier_weight_ready_the_ordinary_and_unknown_the_unsampled():
    gen = torch.Generator().manual_seed(6)
    rows, tensors = _model_rows(gen)
    meta = {META_GEMM_LAYERS: json.dumps({"fc1": "Linear", "head": "Linear", "fc2": "Linear"})}
    data = fp8.frame_data(_frame(rows), meta)
    assert [layer["name"] for layer in data["layers"]] == ["fc1", "head", "fc2"]
    assert (data["keep"], data["ready"], data["unknown"]) == (["head"], ["fc1"], ["fc2"])
    head = data["layers"][1]
    assert head["verdict"] == "keep" and [r["operand"] for r in head["reasons"]] == ["weight"]
    reason = head["reasons"][0]
    assert (reason["format"], reason["recipe"], reason["saturated"]) == ("e4m3", "current", 0.0)
    true = F.current_scaling([tensors["head"][WEIGHT][reason["step"]]], F.E4M3)[0]
    assert true.flushed_share > 0.5 and _within(reason["flushed"], true.flushed_share)
    # every reason is the worst sampled pass of its operand under current scaling
    weight = head["operands"][1]
    current = weight["recipes"][0]
    assert (reason["flushed"], reason["step"]) == (current["flushed_max"], current["flushed_max_step"])
    # the ordinary layer: the truth agrees that nothing near the limit flushes
    for kind, dtype in ((INPUT, F.E4M3), (WEIGHT, F.E4M3), (GRAD, F.E5M2)):
        assert max(c.flushed_share for c in F.current_scaling(tensors["fc1"][kind][::2], dtype)) < 0.01
    fc2 = data["layers"][2]
    assert fc2["reasons"] == [] and all(op["sampled_passes"] == 0 for op in fc2["operands"])
    assert all(r["flushed_mean"] is None for op in fc2["operands"] for r in op["recipes"])
    assert fc2["shortest_history"] is not None  # (from the amaxes: every pass has one)
    assert data["module_filter_fn"] == "lambda mod, fqn: fqn not in {'head'}"
    assert data["sampled_steps"] == [0, 2, 4, 6] and data["steps"] == {"first": 0, "last": 7, "passes": 8}
    # the run's shortest history leaves the kept layer out
    assert data["shortest_history"] == max(data["layers"][i]["shortest_history"] for i in (0, 2))
    # a higher limit keeps nothing
    relaxed = fp8.frame_data(_frame(rows), meta, flush_limit=0.9)
    assert relaxed["keep"] == [] and relaxed["module_filter_fn"] is None


def test_a_layer_missing_an_operand_is_unknown_and_a_listed_layer_without_rows_is_not_called():
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(1024, generator=gen) for _ in range(3)]
    rows = _layer_rows("frozen", {INPUT: xs, WEIGHT: xs})  # no backward through it: no grad_output
    meta = {META_GEMM_LAYERS: json.dumps({"unused": "Linear", "frozen": "Linear"})}
    data = fp8.frame_data(_frame(rows), meta)
    assert [layer["name"] for layer in data["layers"]] == ["frozen"]
    assert data["unknown"] == ["frozen"] and data["ready"] == []
    assert data["not_called"] == ["unused"] and "not_called" in data["limits"]
    frozen = data["layers"][0]
    grad = frozen["operands"][2]
    assert (grad["passes"], grad["shortest_history"], grad["amax_max"]) == (0, None, None)
    assert frozen["shortest_history"] == max(op["shortest_history"] for op in frozen["operands"][:2])


def test_the_module_filter_fn_is_python_that_leaves_out_exactly_the_kept_layers():
    gen = torch.Generator().manual_seed(8)
    names = ["blocks.1.mlp", "blocks.10.mlp", "odd'name", "stem"]
    rows = []
    for name in names:
        keep = name != "blocks.10.mlp"
        ws = [torch.randn(2048, generator=gen) * 0.02 for _ in range(2)]
        if keep:
            for w in ws:
                w[0] = 1e3
        rows += _layer_rows(name, {INPUT: [torch.randn(2048, generator=gen) for _ in range(2)], WEIGHT: ws,
                                   GRAD: [torch.randn(2048, generator=gen) * 1e-3 for _ in range(2)]})
    meta = {META_GEMM_LAYERS: json.dumps({"blocks.1.mlp": "Linear", "blocks.10.mlp": "Linear", "odd'name": "Conv1D",
                                          "stem": "Conv2d"})}
    data = fp8.frame_data(_frame(rows), meta)
    assert data["keep"] == ["blocks.1.mlp", "odd'name", "stem"]
    stem = data["layers"][3]
    assert stem["converted"] is False and data["layers"][2]["converted"] is True  # (Conv1D is a linear layer)
    assert "convolutions_not_converted" in data["limits"]
    fn = eval(data["module_filter_fn"])
    assert fn(None, "blocks.1.mlp") is False and fn(None, "odd'name") is False
    # not a substring match (torchao's own filter_fqns is one): blocks.10.mlp stays converted
    assert fn(None, "blocks.10.mlp") is True and fn(None, "blocks.1") is True and fn(None, "") is True
    assert fn(None, "stem") is True  # (no recipe converts a convolution: nothing to leave out)
    # TransformerEngine's debug config: YAML whose one section disables FP8 on exactly those layers
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load(data["te_debug_config"])
    section = config["ampdoctor_keep_out_of_fp8"]
    assert section["enabled"] is True and section["transformer_engine"] == {"DisableFP8Layer": {"enabled": True}}
    # (nvdlfw-inspect names the layers "model." and their qualified names, the model "model", and
    # searches each name with the expression)
    pattern = re.compile(section["layers"]["layer_name_regex_pattern"])
    inferred = ["model"] + ["model." + n for n in names + ["blocks.1", "blocks.1.mlp.fc"]]
    matched = [n for n in inferred if pattern.search(n)]
    assert matched == ["model.blocks.1.mlp", "model.odd'name"]  # (stem: a convolution, which TE leaves)
    assert not pattern.search("blocks.1.mlp")  # (a bare qualified name is not a name nvdlfw-inspect gives)


# -- delayed scaling: windows, shortest history, non-finite amaxes ------------------------------------------

def _contract_allowed(amaxes, fmax, history):
    """The recipe as ampdoctor defines it (and tests/fp8_truth.py), replayed pass by pass in plain
    Python: per pass (allowed, clipped). Non-finite amaxes are left out: never in a window, never
    clipped; a window without a positive amax keeps the scale before."""
    out, allowed = [], fmax
    for t, a in enumerate(amaxes):
        if history is None:  # current
            allowed = a if math.isfinite(a) and a > 0 else fmax
        elif t > 0:
            window = [x for x in amaxes[max(0, t - history):t] if math.isfinite(x)]
            if window and max(window) > 0:
                allowed = max(window)
        out.append((allowed, math.isfinite(a) and a > allowed))
    return out


def _single(amaxes, kind=INPUT) -> pd.DataFrame:
    return _frame([{"step": t, "rank": 0, "kind": kind, "name": "fc", "call": 0, "amax": np.float32(a),
                    "fine_hist": None} for t, a in enumerate(amaxes)])


def test_windows_over_a_long_run_match_a_plain_replay():
    """3000 passes with zeros, NaN and inf among them: every history's scale and clips as
    TransformerEngine's recipe gives them, pass by pass."""
    rng = np.random.default_rng(9)
    amaxes = np.exp(rng.normal(0, 2, 3000)).astype(np.float32)
    amaxes[rng.random(3000) < 0.02] = 0.0
    amaxes[rng.random(3000) < 0.01] = np.nan
    amaxes[rng.random(3000) < 0.01] = np.inf
    amaxes[:40] = 0.0  # a start without a positive amax: scale 1 kept
    amaxes = amaxes.astype(np.float64).tolist()
    pred = fp8.frame_predictions(_single(amaxes, GRAD))
    for fmt in ("e5m2", "e4m3"):
        for recipe, history in RECIPES:
            rows = _cells(pred, "fc", "grad_output", fmt, recipe, history)
            want = _contract_allowed(amaxes, FORMAT_MAX[fmt], history)
            assert rows["allowed"].tolist() == [w[0] for w in want], (fmt, recipe, history)
            assert rows["clipped"].tolist() == [w[1] for w in want], (fmt, recipe, history)
            # scale 1 where the format's maximum stands (no amax yet); else max / allowed in float32
            made = np.array([w[0] for w in want])
            fmax = np.float32(FORMAT_MAX[fmt])
            with np.errstate(divide="ignore"):
                scale = np.where(made == FORMAT_MAX[fmt], 1.0, (fmax / made.astype(np.float32)).astype(np.float64))
            assert rows["scale"].tolist() == scale.tolist(), (fmt, recipe, history)


def test_non_finite_amaxes_are_left_out_of_the_windows_and_never_clip():
    """A pass whose amax is inf or NaN overflowed in the AMP dtype itself (an fp16 step the scaler
    skipped): it clips under no recipe and enters no window (the next pass is scaled from the
    finite amaxes before). Its cast still saturates its inf elements (NaN ones are not counted)."""
    gen = torch.Generator().manual_seed(10)
    xs = [torch.randn(4096, generator=gen) for _ in range(6)]
    xs[2][5] = math.inf
    xs[4][9] = math.nan
    frame = _frame(_layer_rows("fc", {INPUT: xs}))
    pred = fp8.frame_predictions(frame)
    amaxes = [float(_amax(x)) for x in xs]
    for recipe, history in RECIPES:
        rows = _cells(pred, "fc", "input", "e4m3", recipe, history)
        assert rows["clipped"].tolist() == [c for _, c in _contract_allowed(amaxes, 448.0, history)]
        assert rows["clipped"].tolist()[2] is False and rows["clipped"].tolist()[4] is False
        # and the truth's casts agree, pass by pass
        assert rows["clipped"].tolist() == [c.clipped for c in _truth(xs, F.E4M3, recipe, history)]
    current = _cells(pred, "fc", "input", "e4m3", "current", None)
    assert current["scale"].iloc[2] == 1.0 and current["scale"].iloc[4] == 1.0
    assert current["saturated"].iloc[2] == pytest.approx(1 / 4096) and current["saturated"].iloc[4] == 0.0
    delayed = _cells(pred, "fc", "input", "e4m3", "delayed", 1)
    assert delayed["allowed"].iloc[3] == delayed["allowed"].iloc[2] == amaxes[1]  # the inf kept out
    sixteen = _cells(pred, "fc", "input", "e4m3", "delayed", 16)
    assert sixteen["allowed"].iloc[5] == max(amaxes[i] for i in (0, 1, 3))
    data = fp8.frame_data(frame)
    op = data["layers"][0]["operands"][0]
    assert op["amax_max"] == math.inf and op["unavoidable_clip_steps"] == [
        t for t in range(1, 6) if math.isfinite(amaxes[t]) and amaxes[t] > max(a for a in amaxes[:t] if math.isfinite(a))]
    for recipe in op["recipes"]:
        assert 2 not in recipe["clipped_steps"] and 4 not in recipe["clipped_steps"]


def _shortest_by_brute_force(xs, dtype) -> tuple[int, list[int]]:
    """The least L whose ``delayed_scaling`` clips exactly what an unbounded history clips, and
    those passes, replaying the truth's casts for every L."""
    n = len(xs)
    unbounded = [c.clipped for c in F.delayed_scaling(xs, dtype, n + 1)]
    for history in range(1, n + 1):
        if [c.clipped for c in F.delayed_scaling(xs, dtype, history)] == unbounded:
            return history, [t for t, c in enumerate(unbounded) if c]
    raise AssertionError("history n clips as an unbounded one")


def _amax_sequences():
    rng = np.random.default_rng(11)
    yield [1.0, 2.0, 0.5, 1.5, 1.9, 3.0]                        # the textbook rise and fall
    yield [5.0, 3.0, 0.0, 4.0]                                   # a zero pass keeps the scale of 3
    yield [0.0, 0.0, 2.0, 1.0]                                   # nothing positive before pass 2
    yield [600.0, 1.0, 1.0, 500.0, 2.0]                          # pass 0 beyond E4M3's max
    yield [1.0] * 5 + [9.0] + [1.0] * 14 + [8.0, 8.5, 8.9]       # a spike long before near-spikes
    for _ in range(14):
        n = int(rng.integers(4, 26))
        values = np.round(rng.uniform(0, 4, n), 0 if rng.random() < 0.5 else 3)  # ties half the time
        values[rng.random(n) < 0.15] = 0.0
        yield values.tolist()
    yield [1.0, math.inf, 3.0, 2.0, 3.0]                         # an overflowed pass: left out
    for _ in range(10):                                          # inf and NaN among them
        n = int(rng.integers(4, 26))
        values = np.round(rng.uniform(0, 4, n), 1)
        values[rng.random(n) < 0.15] = math.inf
        values[rng.random(n) < 0.1] = math.nan
        yield values.tolist()


@pytest.mark.parametrize("kind, fmt, dtype", [(WEIGHT, "e4m3", F.E4M3), (GRAD, "e5m2", F.E5M2)])
def test_the_shortest_history_is_what_a_brute_force_search_over_histories_finds(kind, fmt, dtype):
    operand = "weight" if kind == WEIGHT else "grad_output"
    for amaxes in _amax_sequences():
        xs = [torch.tensor([a, a / 3, -a / 7, 0.0]) for a in amaxes]
        want, unavoidable = _shortest_by_brute_force(xs, dtype)
        data = fp8.frame_data(_frame(_layer_rows("fc", {kind: xs}, sampled=lambda step: False)))
        op = next(o for o in data["layers"][0]["operands"] if o["operand"] == operand and o["format"] == fmt)
        assert (op["shortest_history"], op["unavoidable_clip_steps"]) == (want, unavoidable), amaxes
        # and the clips of history 1 and 16 are the truth's
        for recipe in op["recipes"][1:3]:
            casts = F.delayed_scaling(xs, dtype, recipe["history"])
            assert recipe["clipped_steps"] == [t for t, c in enumerate(casts) if c.clipped], amaxes


def test_the_shortest_history_of_a_long_run_is_found_without_trying_each_history():
    """A spike at pass 100 and, 200000 passes later, a pass just below it: only a history reaching
    back to the spike clips nothing there. 400000 passes in all, two layers; fast, whatever L."""
    n = 200_000
    rng = np.random.default_rng(12)
    amaxes = rng.uniform(0.5, 1.0, n)
    amaxes[100] = 9.0
    amaxes[150_100] = 8.0
    rows = pd.concat([_single(amaxes.tolist(), INPUT).assign(name=name) for name in ("a", "b")], ignore_index=True)
    rows.loc[rows["name"] == "b", "amax"] = np.float32(1.0)
    start = time.perf_counter()
    data = fp8.frame_data(rows)
    elapsed = time.perf_counter() - start
    a, b = data["layers"]
    assert a["operands"][0]["shortest_history"] == 150_000 and a["operands"][0]["unavoidable_clip_steps"][-1] == 100
    assert b["operands"][0]["shortest_history"] == 1 and b["operands"][0]["unavoidable_clip_steps"] == []
    clipped_1024 = a["operands"][0]["recipes"][3]
    assert 150_100 in clipped_1024["clipped_steps"]
    assert elapsed < 15, elapsed  # (an O(n L) window would take minutes)


# -- a run ------------------------------------------------------------------------------------------------

def _segment(path, rows: list[dict], meta: dict[str, str]):
    """A hand-written run segment holding ``rows`` (GEMM rows, the other columns null)."""
    from ampdoctor.read.run import empty_table

    empty = empty_table()
    n = len(rows)
    columns = {name: pa.array([None] * n, empty.schema.field(name).type) for name in empty.column_names}
    get = lambda key, default=None: [r.get(key, default) for r in rows]
    columns.update(
        step=pa.array(get("step"), pa.int64()), rank=pa.array(get("rank", 0), pa.int32()),
        kind=pa.array(get("kind")).dictionary_encode(), name=pa.array(get("name")).dictionary_encode(),
        dtype=pa.array(["float32"] * n).dictionary_encode(), numel=pa.array([4096] * n, pa.int64()),
        scale=pa.array([1.0] * n, pa.float32()), skipped=pa.array([False] * n),
        call=pa.array(get("call"), pa.int32()), amax=pa.array([float(a) for a in get("amax")], pa.float32()),
        n_zero=pa.array(get("n_zero"), pa.int64()),
        fine_hist=pa.array([None if h is None else h.tolist() for h in get("fine_hist")], pa.list_(pa.int64())))
    table = pa.table(columns).cast(empty.schema)
    meta = {META_SCHEMA_VERSION: str(SCHEMA_VERSION), **meta}
    pq.write_table(table.replace_schema_metadata({k.encode(): v.encode() for k, v in meta.items()}), path)
    return path




def test_fp8_data_of_a_run_follows_the_contract(tmp_path):
    gen = torch.Generator().manual_seed(13)
    rows, _ = _model_rows(gen, steps=4)
    meta = {META_RUN_ID: "run-1", META_LEVEL: "full", "amp.dtype": "bfloat16", "device": "cpu",
            META_GEMM_LAYERS: json.dumps({"fc1": "Linear", "head": "Linear", "fc2": "Linear"})}
    path = _segment(tmp_path / "run.parquet", rows, meta)
    data = fp8.fp8_data(ampdoctor.read_run(path), flush_limit=0.02)
    check_contract(data, FP8_CONTRACT)
    assert (data["path"], data["run_id"], data["amp_dtype"]) == (str(path), "run-1", "bfloat16")
    assert data["flush_limit"] == 0.02
    assert list(data)[:2] == ["path", "run_id"]
    assert data["keep"] == ["head"] and data["limits"] == ["per_block_formats"]
    assert data["formats"]["e4m3"] == {"dtype": "float8_e4m3fn", "max": 448.0, "flushes_at_or_below": 2.0**-10}
    assert data["formats"]["e5m2"] == {"dtype": "float8_e5m2", "max": 57344.0, "flushes_at_or_below": 2.0**-17}
    for layer in data["layers"]:
        assert [(o["operand"], o["format"], o["variant"]) for o in layer["operands"]] == [
            ("input", "e4m3", "hybrid"), ("weight", "e4m3", "hybrid"), ("grad_output", "e5m2", "hybrid"),
            ("grad_output", "e4m3", "all_e4m3")]
        for op in layer["operands"]:
            assert [(r["recipe"], r["history"]) for r in op["recipes"]] == RECIPES
    json.dumps(data, allow_nan=False)
    # the same numbers as the frame's analysis, and predictions() reads the run the same way
    # (the segment has the block_stats column, null: a frame with it, null, says the same of block formats)
    same = fp8.frame_data(_frame(rows).assign(block_stats=None), meta, flush_limit=0.02)
    assert {k: v for k, v in data.items() if k not in ("path", "run_id")} == same
    pred = fp8.predictions(ampdoctor.read_run(path))
    # 3 layers x 4 (operand, format) x 4 recipes x 4 steps; 2 sampled layers at steps 0 and 2
    assert len(pred) == 3 * 4 * 4 * 4 and pred["flushed"].notna().sum() == 2 * 4 * 4 * 2


@pytest.mark.parametrize("level, why", [("params", "the run was recorded at level='params'"),
                                        ("full", "the run was recorded without them (fp8=False, or by an "
                                                 "ampdoctor before 2026-11-27)")])
def test_a_run_without_gemm_rows_is_a_one_line_run_error_that_says_what_to_do(tmp_path, level, why):
    rows = [{"step": 0, "kind": "step", "name": "", "call": None, "amax": 1.0, "fine_hist": None}]
    path = _segment(tmp_path / "run.parquet", rows, {META_LEVEL: level})
    for call in (fp8.fp8_data, fp8.predictions):
        with pytest.raises(RunError) as caught:
            call(ampdoctor.read_run(path))
        message = str(caught.value)
        assert message == (f"{path}: no FP8 operand statistics: {why}; "
                           f"record with GradScaler(..., level='full', model=model) (fp8=True, the default)")
    with pytest.raises(RunError, match="no FP8 operand statistics"):
        fp8.frame_data(pd.DataFrame({c: [] for c in fp8.COLUMNS}), {META_LEVEL: "steps"})
    with pytest.raises(ValueError, match="flush_limit"):
        fp8.frame_data(_frame(_layer_rows("fc", {INPUT: [torch.ones(4)]})), flush_limit=1.5)


def test_the_transformer_engine_config_selects_the_kept_layers_as_nvdlfw_inspect_names_them(monkeypatch):
    """The config ``te_debug_config`` writes, read as TransformerEngine's debug API reads it: the
    layers named by nvdlfw-inspect's own ``infer_and_assign_layer_names`` (``model.`` and the
    qualified name) and matched by its own ``is_layer_in_cfg``: exactly the kept ones, not the
    layer whose name the kept one's is a prefix of (blocks.1 of blocks.10 and blocks.11)."""
    yaml = pytest.importorskip("yaml")
    pytest.importorskip("nvdlfw_inspect")
    import types

    from nvdlfw_inspect import api as debug_api
    from nvdlfw_inspect.config_manager import ConfigSpec, is_layer_in_cfg

    monkeypatch.setattr(debug_api, "get_logger", lambda: types.SimpleNamespace(log_message=lambda *a, **k: None))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block() for _ in range(12)])
            self.head = torch.nn.Linear(4, 2)

    model = Model()
    debug_api.infer_and_assign_layer_names(model)
    kept = ["blocks.1.fc1", "head"]
    spec = ConfigSpec()
    spec.initialize(yaml.safe_load(fp8.te_debug_config(kept))["ampdoctor_keep_out_of_fp8"])
    selected = [name for name, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and is_layer_in_cfg(m.name, spec)]
    assert selected == kept
