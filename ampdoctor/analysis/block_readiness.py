"""``ampdoctor fp8``'s block formats (issue 42; docs/numerics.md, Block formats): per GEMM layer and
block-scaled recipe (MXFP8, MXFP4, NVFP4), what casting its operands would flush and saturate,
from the ``block_stats`` rows a run records on its module-sampled steps (the cadence's:
:mod:`ampdoctor.record.gemm_operands`).

**Passes.** A pass is one operand of one layer at a sampled step (the recorder keeps one call's:
the first to arrive), its statistics summed over the ranks (each rank casts its own tensor: every count and sum
adds up); the rows of an operand whose recorded amax is not finite (a step the scaler skipped: no
recipe casts it) and damaged values are left out, and counted. **Figures** per pass and cast (:data:`~ampdoctor.run_file.block_bins.RECIPES`) are the
measured ones (:func:`~.block_formats.measured`: the operand cast on the device exactly as torchao's
reference casts it); the histograms' predictions (:func:`~.block_formats.predict`) are given beside
them by :func:`block_predictions`.

**Recipes** (:data:`VERDICT_RECIPES`): the casts a training recipe applies to a layer's input,
weight and output gradient. **Verdicts** per layer and recipe: ``keep`` when one of its operands,
at its worst sampled pass, loses (flushed plus saturated) more than ``flush_limit`` beyond what the
recipe loses on well-behaved data (:func:`baseline`: a Gaussian operand, which FP4 recipes already
flush a few percent of); ``unknown`` when an operand was never sampled; else ``ready``.

Numpy on the rows; no torch (reading a run needs none).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ..read.engine import EngineCannot, present_batches
from ..run_file.block_bins import (BLOCK_VALUES, E4M3_EPS, ELEMENTS, EXP_RANGE, NV_TENSOR_DIVISOR, OFFSETS,
                                   RATIO_WINDOW, window_edges)
from ..run_file.block_bins import RECIPES as RECIPE_SPECS
from ..run_file.schema import GEMM_KINDS, ROOT_NAME
from .block_formats import E4M3, RECIPES, BlockRecipe, BlockStatsHost, measured, predict
from .te_config import te_debug_config

INPUT, WEIGHT, GRAD = GEMM_KINDS
OPERAND_NAMES = {INPUT: "input", WEIGHT: "weight", GRAD: "grad_output"}
COLUMNS = ["step", "rank", "kind", "name", "amax", "block_stats"]  # (one pass an operand a step: no call)
CAST = {r.name: r for r in RECIPES}
RECORDED_SINCE = "2026-11-28"   # the first ampdoctor that recorded block statistics


@dataclass(frozen=True)
class VerdictRecipe:
    """A training recipe: the cast of each operand (``input``, ``weight``, ``grad_output``)."""

    name: str
    casts: Mapping[str, str]
    describes: str          # what implements it (docs/numerics.md)
    te: bool                # TransformerEngine has it (its debug config applies)


def _all(cast: str) -> dict[str, str]:
    return {"input": cast, "weight": cast, "grad_output": cast}


VERDICT_RECIPES = (
    VerdictRecipe("mxfp8", _all("mxfp8_e4m3_floor"),
                  "E4M3 elements, floor scales: the OCP spec's rounding, torchao's ScaleCalculationMode.FLOOR", False),
    VerdictRecipe("mxfp8_rceil", _all("mxfp8_e4m3_round_up"),
                  "E4M3 elements, round-up scales: torchao's MXFP8TrainingOpConfig (its default RCEIL), "
                  "TransformerEngine's MXFP8BlockScaling", True),
    VerdictRecipe("mxfp8_hybrid", {"input": "mxfp8_e4m3_round_up", "weight": "mxfp8_e4m3_round_up",
                                   "grad_output": "mxfp8_e5m2_round_up"},
                  "E5M2 output gradients: TransformerEngine's MXFP8BlockScaling(fp8_format=Format.HYBRID)", True),
    VerdictRecipe("mxfp4", _all("mxfp4_floor"),
                  "E2M1 elements, floor scales: torchao's MX elements float4_e2m1fn_x2 (no MXFP4 training recipe "
                  "in torchao 0.18)", False),
    VerdictRecipe("nvfp4", _all("nvfp4"),
                  "as torchao's nvfp4_quantize casts: a per-tensor scale and E4M3 block scales; torchao's "
                  "NVFP4TrainingConfig and TransformerEngine's NVFP4BlockScaling add random Hadamard transforms and "
                  "stochastic rounding (TransformerEngine also 16x16 weight blocks), not modelled", True),
)


@dataclass
class BlockPasses:
    """The sampled passes with block statistics: per (layer, row kind), (step, -1, statistics) in step
    order (-1: one pass an operand a step, whichever call; the shape of the other passes' keys)."""

    operands: dict[tuple[str, str], list[tuple[int, int, BlockStatsHost]]] = field(default_factory=dict)
    ranks: int = 0
    non_finite: int = 0   # rows left out: the operand held an inf or a NaN (its recorded amax; a skipped step)
    damaged: int = 0      # rows left out: a value that is no block statistics (not finite, negative, fractional counts)

    @property
    def steps(self) -> list[int]:
        return sorted({s for passes in self.operands.values() for s, _, _ in passes})


def passes_of(frame: pd.DataFrame) -> BlockPasses:
    """:class:`BlockPasses` of GEMM rows (columns :data:`COLUMNS`; ``block_stats`` a list or
    array per row, null where none): summed per pass over the ranks."""
    acc = _Sums()
    rows = frame[frame["block_stats"].notna()] if len(frame) else frame
    if len(rows):
        values = [np.asarray(v, dtype=np.float64) for v in rows["block_stats"]]
        ok = np.array([v.shape == (BLOCK_VALUES,) for v in values], dtype=bool)
        acc.damaged += int((~ok).sum())
        if ok.any():
            acc.add(rows[ok], np.stack([v for v, k in zip(values, ok) if k]))
    return acc.passes()


def run_block_passes(run) -> BlockPasses:
    """The block passes of a read run: the rows that hold ``block_stats`` (a few per layer in a
    thousand steps), found by the query engine on that column, or by pyarrow reading the segments
    whose footers say they hold any (the same rows)."""
    try:
        return _stream(present_batches(run, COLUMNS, "block_stats", GEMM_KINDS))
    except EngineCannot:
        return _stream(run.batches(COLUMNS, kinds=GEMM_KINDS, present="block_stats"))


def _stream(batches: Iterable[pa.RecordBatch]) -> BlockPasses:
    acc = _Sums()
    for batch in batches:
        column = batch.column("block_stats")
        lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy()
        keep = lengths == BLOCK_VALUES  # (another tool's or a damaged value: not a pass of ours)
        acc.damaged += int(((lengths != BLOCK_VALUES) & column.is_valid().to_numpy(zero_copy_only=False)).sum())
        if not keep.any():
            continue
        taken = pa.array(np.flatnonzero(keep))
        values = pc.list_flatten(column.take(taken)).to_numpy(zero_copy_only=False).reshape(-1, BLOCK_VALUES)
        keys = pa.RecordBatch.from_arrays([batch.column(c).take(taken) for c in COLUMNS[:-1]], names=COLUMNS[:-1])
        acc.add(keys.to_pandas(), values)
    return acc.passes()


def _sound(values: np.ndarray) -> np.ndarray:
    """Per row of ``values`` [n, BLOCK_VALUES]: whether it is block statistics as the recorder
    writes them (counts finite non-negative integers, sums non-negative, no more rows read than
    the operand has)."""
    # (the sums may be inf: NVFP4's tensor scale of an operand below ~1e-35 has no float32
    # reciprocal, as in torchao's cast; its NVFP4 figures are then unknown, the rest stands)
    counts = np.delete(values, _SUMS, axis=1)
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(counts).all(axis=1) & (values[:, _SUMS] >= 0).all(axis=1)
    with np.errstate(invalid="ignore"):
        whole = ((counts >= 0) & (counts == np.floor(counts))).all(axis=1)
    rows = values[:, _ROWS]
    return finite & whole & (rows[:, 0] <= rows[:, 1])


# The positions of the float sums (``measured``'s last two columns: [recipes, 4]) and of ``rows``.
_SUMS = OFFSETS["measured"] + np.array([4 * r + c for r in range(len(RECIPE_SPECS)) for c in (2, 3)])
_ROWS = OFFSETS["rows"] + np.arange(2)


class _Sums:
    """Block statistics summed per pass (integer counts and float64 sums: the counts exact in any
    order)."""

    def __init__(self) -> None:
        self.sums: dict[tuple, np.ndarray] = {}
        self.ranks: set = set()
        self.non_finite = self.damaged = 0

    def add(self, keys: pd.DataFrame, values: np.ndarray) -> None:
        """Rows ``keys`` (kind, name, step, rank, amax) and their values, one row each: those
        of a non-finite operand and damaged values left out, counted."""
        finite = (np.isfinite(keys["amax"].to_numpy(dtype=np.float64, na_value=np.nan)) if "amax" in keys
                  else np.ones(len(keys), dtype=bool))
        sound = _sound(values)
        self.non_finite += int((~finite).sum())
        self.damaged += int((finite & ~sound).sum())
        keep = finite & sound
        if not keep.all():
            keys, values = keys[keep], values[keep]
        if not len(keys):
            return
        # (one pass per operand a step on each rank, whichever call it came from: ranks whose
        # calls are numbered apart still make one pass)
        frame = pd.DataFrame({"name": keys["name"].astype(str).to_numpy(), "kind": keys["kind"].astype(str).to_numpy(),
                              "step": keys["step"].to_numpy(dtype=np.int64)})
        self.ranks.update(pd.unique(keys["rank"]).tolist())
        for (name, kind, step), index in frame.groupby(["name", "kind", "step"], sort=False).indices.items():
            key = (str(name), str(kind), int(step))
            total = values[index].sum(axis=0)
            previous = self.sums.get(key)
            self.sums[key] = total if previous is None else previous + total

    def passes(self) -> BlockPasses:
        out = BlockPasses(ranks=len(self.ranks), non_finite=self.non_finite, damaged=self.damaged)
        for (name, kind, step), values in sorted(self.sums.items(), key=lambda kv: kv[0][2]):
            out.operands.setdefault((name, kind), []).append((step, -1, BlockStatsHost.from_values(values)))
        return out


def recorded(run) -> bool:
    """Whether the run's segments have the ``block_stats`` column (written by an ampdoctor of
    :data:`RECORDED_SINCE` or later), by their footers."""
    return any("block_stats" in s.columns for s in run.segments)


# -- the baseline ----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def baseline(cast: str) -> tuple[float, float]:
    """(flushed, saturated): the shares of nonzero elements ``cast`` loses on a Gaussian operand
    (2^16 blocks of 32 standard normal values, a fixed seed), by the same arithmetic as the
    device's (:mod:`ampdoctor.stats.block_stats`), in numpy: what the recipe loses on
    well-behaved data, which a verdict does not hold against a layer."""
    recipe = CAST[cast]
    x = np.abs(np.random.default_rng(0).standard_normal((1 << 16, 32)).astype(np.float32)).astype(np.float64)
    q = _scaled(x, recipe)
    fmt = recipe.element
    return float(np.mean(fmt.round(q) == 0)), float(np.mean(q > fmt.max))


def _scaled(x: np.ndarray, recipe: BlockRecipe) -> np.ndarray:
    """``x`` (non-negative, no zeros) in its block's scale units, blocks of the recipe's size."""
    b = x.reshape(-1, recipe.block)
    amax = b.max(axis=1)
    if recipe.scale == "nvfp4":
        tensor_scale = amax.max() / NV_TENSOR_DIVISOR
        block_scale = E4M3.round(np.clip(amax / 6.0 / tensor_scale, E4M3_EPS, 448.0))
        return b / tensor_scale / block_scale[:, None]
    fmax = ELEMENTS[recipe.element.name][2]
    emax = int(np.floor(np.log2(fmax)))
    mantissa, exponent = np.frexp(amax)  # (exact, as the device's: no logarithm)
    floor = exponent - 1
    if recipe.scale == "round-up":  # ceil(log2(amax / max)) + emax
        floor = floor + (2 * mantissa > fmax / 2.0 ** emax)
    return b / np.ldexp(1.0, floor - emax)[:, None]


# -- the figures -----------------------------------------------------------------------------------------

def _pass_figures(stats: BlockStatsHost) -> dict[str, dict]:
    out = {}
    for recipe in RECIPES:
        f = measured(stats, recipe)
        out[recipe.name] = {"flushed": f.flushed, "saturated": f.saturated, "clamped_blocks": f.clamped_blocks,
                            "error": f.error}
    return out


def _scale_spread(stats: BlockStatsHost | None) -> dict:
    """The spread of the block scales: the binades of ``floor(log2 amax_block)`` (MX blocks, the
    E8M0 scales' exponents up to their element format's offset) and NVFP4's ``amax_block /
    amax_tensor`` (the E4M3 block scales' range)."""
    if stats is None:
        return {"mx_block_exponents": [], "nvfp4_block_ratio_median": None, "nvfp4_clamped_blocks": None}
    blocks = stats.mx_blocks[0].sum(axis=0)
    present = np.flatnonzero(blocks)
    ratio = stats.nv_ratio
    edges = window_edges(RATIO_WINDOW)
    total = ratio.sum()
    median = None
    if total:
        at = int(np.searchsorted(np.cumsum(ratio), total / 2.0))
        median = float(edges[at])
    return {"mx_block_exponents": [int(present[0] + EXP_RANGE[0]), int(present[-1] + EXP_RANGE[0])] if len(present)
            else [],
            "nvfp4_block_ratio_median": median,
            "nvfp4_clamped_blocks": float(stats.nv_clamped[0] / total) if total else None}


def _operand_data(passes: list[tuple[int, int, BlockStatsHost]]) -> dict:
    figures = [(step, call, _pass_figures(stats)) for step, call, stats in passes]
    casts = []
    for recipe in RECIPES:
        lost = np.array([f[recipe.name]["flushed"] + f[recipe.name]["saturated"] for _, _, f in figures])
        worst = int(np.nanargmax(lost)) if len(lost) and not np.all(np.isnan(lost)) else None
        of = lambda key: [f[recipe.name][key] for _, _, f in figures]  # noqa: E731
        casts.append({
            "cast": recipe.name,
            "flushed_mean": _mean(of("flushed")), "flushed_max": _max(of("flushed")),
            "saturated_max": _max(of("saturated")), "clamped_blocks_max": _max(of("clamped_blocks")),
            "error_mean": _mean(of("error")), "error_max": _max(of("error")),
            "worst_step": None if worst is None else int(figures[worst][0]),
            "worst_lost": None if worst is None else float(lost[worst]),
            "worst_flushed": None if worst is None else float(figures[worst][2][recipe.name]["flushed"]),
            "worst_saturated": None if worst is None else float(figures[worst][2][recipe.name]["saturated"]),
        })
    last = passes[-1][2]
    return {"sampled_passes": len(passes), "rows_read": _rows_read(passes), "casts": casts,
            "scale_spread": _scale_spread(last)}


def _rows_read(passes) -> float:
    seen = sum(s.rows[0] for _, _, s in passes)
    total = sum(s.rows[1] for _, _, s in passes)
    return float(seen / total) if total else 1.0


def _mean(values: list[float]) -> float | None:
    v = np.array(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    return float(v.mean()) if len(v) else None


def _max(values: list[float]) -> float | None:
    v = np.array(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    return float(v.max()) if len(v) else None


def block_data(passes: BlockPasses, layers: list[tuple[str, bool]], *, flush_limit: float) -> dict:
    """The ``block_formats`` part of ``ampdoctor fp8``'s data (docs/json-contracts.md): per layer
    (``layers``: (name, converted) in report order) and recipe its verdict, the largest share an
    operand loses, and the reasons to keep it; per operand and cast the figures; per recipe the
    layers to keep out of it, as the ``filter_fn`` of torchao's ``quantize_`` and, for the recipes
    TransformerEngine has, its debug config."""
    out_layers = []
    for name, converted in layers:
        operands = []
        for kind, operand in OPERAND_NAMES.items():
            passes_here = passes.operands.get((name, kind))
            operands.append({"operand": operand, **(_operand_data(passes_here) if passes_here else _no_passes())})
        by_operand = {op["operand"]: op for op in operands}
        recipes = []
        for recipe in VERDICT_RECIPES:
            verdict, reasons, lost = _verdict(recipe, by_operand, flush_limit, converted)
            recipes.append({"recipe": recipe.name, "verdict": verdict, "lost_max": lost, "reasons": reasons})
        out_layers.append({"name": name, "converted": converted, "recipes": recipes, "operands": operands})
    recipes = []
    for i, recipe in enumerate(VERDICT_RECIPES):
        of = lambda verdict: [layer["name"] for layer in out_layers  # noqa: E731
                              if layer["recipes"][i]["verdict"] == verdict]
        keep = sorted("" if n == ROOT_NAME else n for n in of("keep"))
        recipes.append({
            "name": recipe.name, "casts": dict(recipe.casts), "describes": recipe.describes,
            "baseline_lost": {operand: _allowance(cast) for operand, cast in recipe.casts.items()},
            "keep": keep, "ready": of("ready"), "unknown": of("unknown"),
            # (quantize_ calls its filter on every module, the root (fqn "") first: a filter that is
            # true there replaces the root and stops; so only Linear layers, as its default filter)
            "filter_fn": ("lambda mod, fqn: isinstance(mod, torch.nn.Linear) and fqn not in {"
                          + ", ".join(repr(n) for n in keep) + "}" if keep else None),
            "te_debug_config": te_debug_config(keep, recipe.name) if keep and recipe.te else None,
        })
    return {"assessed": True, "why_not": None, "flush_limit": float(flush_limit), "sampled_steps": passes.steps,
            "ranks": passes.ranks, "left_out": {"non_finite": passes.non_finite, "damaged": passes.damaged},
            "recipes": recipes, "layers": out_layers}


def _no_passes() -> dict:
    return {"sampled_passes": 0, "rows_read": None, "casts": [], "scale_spread": _scale_spread(None)}


def _allowance(cast: str) -> float:
    flushed, saturated = baseline(cast)
    return flushed + saturated


def _verdict(recipe: VerdictRecipe, operands: dict, flush_limit: float, converted: bool
             ) -> tuple[str, list, float | None]:
    """(verdict, reasons worst first, the largest share an operand loses at a sampled pass)."""
    reasons, unsampled, lost = [], False, None
    for operand, cast in recipe.casts.items():
        entry = next((c for c in operands[operand]["casts"] if c["cast"] == cast), None)
        if entry is None or entry["worst_lost"] is None:
            unsampled = True
            continue
        lost = max(lost or 0.0, entry["worst_lost"])
        if entry["worst_lost"] - _allowance(cast) > flush_limit:
            reasons.append({"operand": operand, "cast": cast, "flushed": entry["worst_flushed"],
                            "saturated": entry["worst_saturated"], "baseline": _allowance(cast),
                            "step": entry["worst_step"]})
    reasons.sort(key=lambda r: -(r["flushed"] + r["saturated"]))
    if not converted:
        return "not_converted", [], lost
    return ("keep" if reasons else "unknown" if unsampled else "ready"), reasons, lost


def not_assessed(why: str) -> dict:
    """The ``block_formats`` part of a run that has no block statistics, with the reason."""
    return {"assessed": False, "why_not": why, "flush_limit": None, "sampled_steps": [], "ranks": 0,
            "left_out": {"non_finite": 0, "damaged": 0}, "recipes": [], "layers": []}


def block_predictions(passes: BlockPasses, source_mbits: int | None = None) -> list[dict]:
    """Every pass and cast: the measured figures and the histograms' predictions (for tests and
    notebooks; ``source_mbits``: the operands' format, see :func:`~.block_formats.predict`)."""
    out = []
    for (name, kind), items in passes.operands.items():
        for step, call, stats in items:
            for recipe in RECIPES:
                m, p = measured(stats, recipe), predict(stats, recipe, source_mbits)
                out.append({"layer": name, "operand": OPERAND_NAMES[kind], "step": step, "call": call,
                            "cast": recipe.name, "flushed": m.flushed, "saturated": m.saturated,
                            "clamped_blocks": m.clamped_blocks, "error": m.error,
                            "predicted_flushed": p.flushed, "predicted_flushed_max": p.flushed_max,
                            "predicted_saturated": p.saturated, "predicted_error": p.error,
                            "rows_read": stats.rows[0] / stats.rows[1] if stats.rows[1] else 1.0})
    return out
