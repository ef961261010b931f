"""``ampdoctor fp8``'s data: FP8 readiness (issue 29; docs/numerics.md, FP8 readiness). Per GEMM
layer, what a tensorwise FP8 recipe would do to the three tensors its GEMMs cast (the input and the
weight in E4M3, the output gradient in E5M2, TransformerEngine's HYBRID, or in E4M3), predicted
from the run's GEMM operand rows (``schema.GEMM_KINDS``): each operand's amax at every *pass* (one
row, ordered by step and call), and on module-sampled steps its fine histogram
(:mod:`ampdoctor.stats.fine_hist`).

**Verdicts.** ``keep`` a layer that current scaling (the best a tensorwise recipe does) would make
lose more than ``flush_limit`` of an operand's nonzero elements at a sampled pass whose amax is
finite (a non-finite one overflowed in the AMP dtype already); ``unknown`` one with an operand
never sampled so; else ``ready``. The *shortest history* is the least L whose delayed
scaling clips only the passes that any history must clip (those whose amax exceeds every earlier
one).

The rows become passes in :mod:`.fp8_passes`; the recipes (current and delayed scaling, and what
each flushes, saturates and clips) are replayed over them in :mod:`.fp8_recipes`; here, their
predictions and the verdicts per layer. The core works on a DataFrame of GEMM rows and the run's
metadata (:func:`frame_data`, :func:`frame_predictions`), so it is testable without recording;
:func:`fp8_data` and :func:`predictions` take a :class:`Run` (never a path: the caller reads it).
No torch is imported: reading a run needs none.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import pandas as pd

from ..errors import RunError
from ..read.engine import EngineCannot
from ..read.run import Run, expect_run, to_frame
from ..run_file.schema import (GEMM_KINDS, meta_names, META_AMP_DTYPE, META_DEVICE, META_GEMM_LAYERS, META_LEVEL,
                               META_RUN_ID, ROOT_NAME)
from .block_readiness import RECORDED_SINCE as BLOCKS_SINCE
from .block_readiness import BlockPasses, block_data, not_assessed, passes_of, recorded, run_block_passes
from .fp8_passes import COLUMNS, GRAD, INPUT, WEIGHT, Passes, gemm_passes, run_passes
from .fp8_recipes import FORMATS, HISTORIES, OPERANDS, Cells, cells
from .te_config import te_debug_config

DEFAULT_FLUSH_LIMIT = 0.01
VERDICT_OPERANDS = OPERANDS[:3]  # what the default recipe (HYBRID) casts
CONVOLUTIONS = frozenset({"Conv1d", "Conv2d", "Conv3d"})  # neither TransformerEngine nor torchao converts them
RECORDED_SINCE = "2026-11-27"   # the first ampdoctor that recorded GEMM operand rows


# -- the data ------------------------------------------------------------------------------------------

def frame_predictions(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (layer, operand, format, recipe, history, step, call) of the GEMM rows of
    ``frame``: ``variant``, ``amax``, ``scale``, ``allowed`` (the amax the scale was made from),
    ``clipped`` (bool), ``flushed`` and ``saturated`` (shares of the nonzero elements; NaN where not
    sampled). ``history`` is NaN for current scaling; ``call`` is -1 where the row did not say."""
    p = gemm_passes(frame)
    columns = ["layer", "operand", "format", "variant", "recipe", "history", "step", "call", "amax", "scale",
               "allowed", "clipped", "flushed", "saturated"]
    if p is None:
        return pd.DataFrame({c: [] for c in columns})
    parts = []
    for c in cells(p):
        n = c.hi - c.lo
        lengths = np.diff(p.starts[c.seqs[0]:c.seqs[-1] + 2])
        layer = np.repeat(np.array([p.layer[s] for s in c.seqs], dtype=object), lengths)
        for cast in c.casts:
            parts.append(pd.DataFrame({
                "layer": layer, "operand": c.operand, "format": c.fmt, "variant": c.variant, "recipe": cast.recipe,
                "history": np.full(n, np.nan if cast.history is None else float(cast.history)),
                "step": p.step[c.lo:c.hi], "call": p.call[c.lo:c.hi], "amax": p.amax[c.lo:c.hi],
                "scale": cast.scale, "allowed": cast.allowed, "clipped": cast.clipped,
                "flushed": cast.flushed, "saturated": cast.saturated}))
    return pd.concat(parts, ignore_index=True)[columns]


def frame_data(frame: pd.DataFrame, metadata: Mapping[str, str] | None = None, *,
               flush_limit: float = DEFAULT_FLUSH_LIMIT, path: str = "") -> dict:
    """:func:`fp8_data` of the rows of ``frame`` (columns :data:`COLUMNS`, and ``block_stats``
    where the rows have it) and the run's ``metadata``, without ``path`` and ``run_id``. Raises
    :class:`RunError` when ``frame`` holds no GEMM rows (``path`` names the run in its message)."""
    blocks = passes_of(frame) if "block_stats" in frame else None
    return passes_data(gemm_passes(frame), metadata, flush_limit=flush_limit, path=path, blocks=blocks)


def passes_data(p: Passes | None, metadata: Mapping[str, str] | None = None, *,
                flush_limit: float = DEFAULT_FLUSH_LIMIT, path: str = "", blocks: BlockPasses | None = None) -> dict:
    """:func:`frame_data` of the passes ``p`` (:func:`~.fp8_passes.gemm_passes`,
    :func:`~.fp8_passes.run_passes`; None: no GEMM rows) and the block passes ``blocks`` (None:
    the run has no ``block_stats`` column)."""
    if not (0.0 <= flush_limit <= 1.0):
        raise ValueError(f"flush_limit must be between 0 and 1, not {flush_limit!r}")
    metadata = dict(metadata or {})
    if p is None:
        raise RunError(no_operands_message(path, metadata))
    types = _layer_types(metadata)
    operand_data: dict[tuple[int, str, str], tuple[dict, tuple]] = {}
    for c in cells(p):
        for j, s in enumerate(c.seqs):
            operand_data[(s, c.operand, c.fmt)] = _operand_data(p, c, j, s)

    by_layer: dict[str, dict[str, int]] = {}
    for s, (layer, kind) in enumerate(zip(p.layer, p.kind)):
        by_layer.setdefault(layer, {})[kind] = s
    order = _layer_order(p, types)
    # A layer of model.gemm_layers with no row at all was never called as a module (the out_proj
    # of nn.MultiheadAttention, whose forward uses its weight directly): nothing to assess.
    not_called = [name for name in order if name not in by_layer]
    layers = [_layer_data(name, types.get(name), by_layer[name], operand_data, p, flush_limit)
              for name in order if name in by_layer]

    verdicts = {v: [layer["name"] for layer in layers if layer["verdict"] == v] for v in ("keep", "ready", "unknown")}
    kept = sorted("" if layer["name"] == ROOT_NAME else layer["name"]
                  for layer in layers if layer["verdict"] == "keep" and layer["converted"])
    histories = [layer["shortest_history"] for layer in layers
                 if layer["verdict"] != "keep" and layer["shortest_history"] is not None]
    steps = p.step
    sampled_steps = np.unique(p.step[p.sampled]).tolist()
    block_formats = _block_formats(blocks, layers, flush_limit)
    limits = [] if block_formats["assessed"] else ["per_block_formats"]
    if any(not layer["converted"] for layer in layers):
        limits.append("convolutions_not_converted")
    if not sampled_steps:
        limits.append("no_sampled_steps")
    if any(layer["calls_per_step"] > 1 for layer in layers):
        limits.append("several_calls_per_step")
    if p.ranks > 1:
        limits.append("several_ranks")
    if not_called:
        limits.append("not_called")
    return {
        "amp_dtype": metadata.get(META_AMP_DTYPE), "device": metadata.get(META_DEVICE),
        "steps": {"first": int(steps.min()), "last": int(steps.max()), "passes": int(pd.Series(steps).nunique())},
        "sampled_steps": sampled_steps,
        "flush_limit": float(flush_limit),
        "histories": list(HISTORIES),
        "formats": {key: {"dtype": f.name, "max": float(f.max), "flushes_at_or_below": float(f.underflow_below)}
                    for key, f in FORMATS.items()},
        "layers": layers,
        **verdicts,
        "not_called": not_called,
        "module_filter_fn": ("lambda mod, fqn: fqn not in {" + ", ".join(repr(n) for n in kept) + "}"
                             if kept else None),
        "te_debug_config": te_debug_config(kept) if kept else None,
        "shortest_history": max(histories) if histories else None,
        "block_formats": block_formats,
        "limits": limits,
    }


def _block_formats(blocks: BlockPasses | None, layers: list[dict], flush_limit: float) -> dict:
    """The ``block_formats`` part, or why the run cannot say."""
    if blocks is None:
        return not_assessed(f"the run was recorded by an ampdoctor before {BLOCKS_SINCE}, which did not record "
                            f"block statistics")
    if not any(layer["converted"] for layer in layers):
        return not_assessed("the run's GEMM layers are all convolutions, which block-format recipes do not convert")
    if not blocks.operands and (blocks.non_finite or blocks.damaged):
        return not_assessed(f"every block statistics value of the run was left out ({blocks.non_finite} of operands "
                            f"holding an inf or a NaN: skipped steps; {blocks.damaged} damaged)")
    if not blocks.operands:
        return not_assessed("no step on the module_every cadence was recorded (block statistics are taken on "
                            "steps whose number is a multiple of module_every)")
    return block_data(blocks, [(layer["name"], layer["converted"]) for layer in layers], flush_limit=flush_limit)


def _operand_data(p: Passes, c: Cells, j: int, s: int) -> tuple[dict, tuple]:
    """One (operand, format) of one layer (sequence ``s``, the ``j``-th of ``c``): its passes'
    facts and each recipe's summary; and its current scaling's (flushed, saturated, step) at the
    sampled passes, which the verdict reads."""
    lo, hi = int(p.starts[s]), int(p.starts[s + 1])
    a, b = lo - c.lo, hi - c.lo
    steps = p.step[lo:hi]
    i0, i1 = np.searchsorted(p.sampled, [lo, hi])
    sampled = p.sampled[i0:i1] - c.lo
    sampled_steps = p.step[sampled + c.lo]
    amax = p.amax[lo:hi]
    seen = amax[~np.isnan(amax)]
    recipes = []
    for cast in c.casts:
        clipped = cast.clipped[a:b]
        entry = {"recipe": cast.recipe, "history": cast.history}
        if len(sampled):
            flushed, saturated = cast.flushed[sampled], cast.saturated[sampled]
            worst = int(np.argmax(flushed))
            entry.update(flushed_mean=float(flushed.mean()), flushed_max=float(flushed[worst]),
                         flushed_max_step=int(sampled_steps[worst]),
                         saturated_mean=float(saturated.mean()), saturated_max=float(saturated.max()))
        else:
            entry.update(flushed_mean=None, flushed_max=None, flushed_max_step=None, saturated_mean=None,
                         saturated_max=None)
        entry.update(clipped_passes=int(clipped.sum()), clipped_steps=np.unique(steps[clipped]).tolist())
        recipes.append(entry)
    data = {
        "operand": c.operand, "format": c.fmt, "variant": c.variant,
        # the peak, inf included (JSON writes it as null); None when every pass was NaN
        "amax_max": float(seen.max()) if len(seen) else None,
        "passes": int(hi - lo), "sampled_passes": len(sampled),
        "shortest_history": int(c.shortest[j]),
        "unavoidable_clip_steps": np.unique(steps[c.unavoidable[a:b]]).tolist(),
        "unavoidable_clip_passes": int(c.unavoidable[a:b].sum()),  # (several calls a step: passes, not steps)
        "recipes": recipes,
    }
    current = c.casts[0]
    # The verdict leaves out passes whose amax is not finite: the AMP run itself overflowed there
    # (its report and postmortem say so), and no FP8 recipe makes that better or worse.
    finite = np.isfinite(p.amax[sampled + c.lo])
    return data, (current.flushed[sampled][finite], current.saturated[sampled][finite], sampled_steps[finite])


def _empty_operand(operand: str, fmt: str, variant: str) -> tuple[dict, None]:
    """An operand the run has no row of (a layer that never ran backward has no output gradient)."""
    return {"operand": operand, "format": fmt, "variant": variant, "amax_max": None, "passes": 0,
            "sampled_passes": 0, "shortest_history": None, "unavoidable_clip_steps": [], "unavoidable_clip_passes": 0,
            "recipes": [{"recipe": r, "history": h, "flushed_mean": None, "flushed_max": None,
                         "flushed_max_step": None, "saturated_mean": None, "saturated_max": None,
                         "clipped_passes": 0, "clipped_steps": []}
                        for r, h in [("current", None)] + [("delayed", h) for h in HISTORIES]]}, None


def _layer_data(name: str, kind: str | None, seqs: dict[str, int], operand_data: dict, p: Passes,
                flush_limit: float) -> dict:
    """One layer: its operands, its verdict and the reasons for it, its shortest history."""
    operands, reasons, unsampled, known = [], [], False, []
    for entry in OPERANDS:
        operand, row_kind, fmt, variant = entry
        s = seqs.get(row_kind)
        op, current = _empty_operand(operand, fmt, variant) if s is None else operand_data[(s, operand, fmt)]
        operands.append(op)
        if entry not in VERDICT_OPERANDS:
            continue
        if op["shortest_history"] is not None:
            known.append(op["shortest_history"])
        if current is None or not len(current[0]):
            unsampled = True
            continue
        flushed, saturated, steps = current
        lost = flushed + saturated
        worst = int(np.argmax(lost))
        if lost[worst] > flush_limit:  # its worst sampled pass
            reasons.append({"operand": operand, "format": fmt, "recipe": "current", "flushed": float(flushed[worst]),
                            "saturated": float(saturated[worst]), "step": int(steps[worst])})
    reasons.sort(key=lambda r: -(r["flushed"] + r["saturated"]))
    # (a known reason to keep a layer stands even where another operand was never sampled)
    verdict = "keep" if reasons else "unknown" if unsampled else "ready"
    calls = [int(p.calls_per_step[seqs[k]]) for k in (INPUT, GRAD, WEIGHT) if k in seqs]
    return {"name": name, "type": kind, "converted": kind not in CONVOLUTIONS,
            "calls_per_step": calls[0] if calls else 0, "verdict": verdict, "reasons": reasons,
            "shortest_history": max(known) if known else None, "operands": operands}


def _layer_types(metadata: Mapping[str, str]) -> dict[str, str]:
    """``model.gemm_layers``: {layer name: class name}; {} when absent (older runs) or unreadable."""
    return meta_names(metadata.get(META_GEMM_LAYERS))


def _layer_order(p: Passes, types: Mapping[str, str]) -> list[str]:
    """The recorded layers in ``model.gemm_layers``'s order, then the others in the order of
    their first pass (step, call)."""
    first: dict[str, tuple[int, int]] = {}
    for s, layer in enumerate(p.layer):
        lo = int(p.starts[s])
        key = (int(p.step[lo]), int(p.call[lo]))
        first[layer] = min(first.get(layer, key), key)
    return list(types) + sorted((n for n in first if n not in types), key=lambda n: (first[n], n))


def no_operands_message(path: str, metadata: Mapping[str, str]) -> str:
    """Why a run has no GEMM operand rows, and what to do, on one line."""
    level = metadata.get(META_LEVEL)
    why = (f"the run was recorded without them (fp8=False, or by an ampdoctor before {RECORDED_SINCE})"
           if level in (None, "full") else f"the run was recorded at level={level!r}")
    return (f"{path}: no FP8 operand statistics: {why}; record with GradScaler(..., level='full', model=model) "
            f"(fp8=True, the default)")


# -- a run ---------------------------------------------------------------------------------------------

def _gemm_frame(run: Run) -> pd.DataFrame:
    return to_frame(run.table(COLUMNS, kinds=GEMM_KINDS))


def fp8_data(run: Run, *, flush_limit: float = DEFAULT_FLUSH_LIMIT) -> dict:
    """``ampdoctor fp8``'s data (the JSON contract of ``ampdoctor.fp8(path)``): per GEMM layer its
    verdict (``ready``, ``keep``, ``unknown``), the reasons to keep it, and per operand and
    format what current and delayed scaling (histories :data:`HISTORIES`) flush, saturate and
    clip; the layers to keep as torchao's ``module_filter_fn``, the shortest history. Raises
    :class:`RunError` for a run without GEMM operand rows."""
    meta = expect_run(run, "fp8_data()").metadata
    if not (0.0 <= flush_limit <= 1.0):
        raise ValueError(f"flush_limit must be between 0 and 1, not {flush_limit!r}")
    try:
        passes = run_passes(run)  # (reduced over ranks by the query engine)
    except EngineCannot:
        passes = gemm_passes(_gemm_frame(run))
    blocks = run_block_passes(run) if recorded(run) else None
    data = passes_data(passes, meta, flush_limit=flush_limit, path=str(run.path), blocks=blocks)
    return {"path": str(run.path), "run_id": meta.get(META_RUN_ID, ""), **data}


def predictions(run: Run) -> pd.DataFrame:
    """Every pass's prediction (:func:`frame_predictions`) of ``run``, for tests and notebooks.
    Raises :class:`RunError` for a run without GEMM operand rows."""
    frame = _gemm_frame(expect_run(run, "predictions()"))
    if not len(frame):
        raise RunError(no_operands_message(str(run.path), run.metadata))
    return frame_predictions(frame)
