"""The words of ``fp8`` (FP8 readiness, :mod:`ampdoctor.analysis.fp8`): its data holds codes only
(verdicts, operands, formats, recipes, limits) and this module says them. The verdict paragraph
leads every output; code to paste is marked with backticks, which each renderer shows its own way.
Nothing here is registered as a finding's sentence: the JSON contract keeps the codes."""

from __future__ import annotations

from ..formatting import percent, scale_str

VERDICTS = {"ready": "ready", "keep": "keep", "unknown": "unknown"}
OPERANDS = {"input": "input", "weight": "weight", "grad_output": "output gradient"}
FORMATS = {"e4m3": "E4M3", "e5m2": "E5M2"}
VARIANTS = {"hybrid": "HYBRID", "all_e4m3": "all-E4M3"}
TE_DEFAULT_HISTORY = 1024  # TransformerEngine's DelayedScaling(amax_history_len=1024)
STEPS_SHOWN = 5  # clipped steps listed in a cell before "and N more"

# The per-layer table's flushed columns: (operand, format) under current scaling.
FLUSH_COLUMNS = (("input", "e4m3"), ("weight", "e4m3"), ("grad_output", "e5m2"), ("grad_output", "e4m3"))
NOT_CONVERTED_MARK = "*"


def flush_header(operand: str, fmt: str) -> str:
    """``input``, ``weight`` (E4M3 both), ``grad E5M2``, ``grad E4M3``."""
    return f"grad {FORMATS.get(fmt, fmt)}" if operand == "grad_output" else operand


def recipe_label(recipe: str, history: int | None) -> str:
    return "current scaling" if recipe == "current" else f"delayed scaling, history {history}"


def operand_label(operand: str, fmt: str) -> str:
    """``output gradient in E5M2``."""
    return f"{OPERANDS.get(operand, operand)} in {FORMATS.get(fmt, fmt)}"


def layer_type(layer: dict) -> str:
    """The module's class, marked when neither TransformerEngine nor torchao converts it."""
    kind = layer.get("type") or "?"
    return kind if layer.get("converted", True) else kind + NOT_CONVERTED_MARK


NOT_CONVERTED_LEGEND = f"{NOT_CONVERTED_MARK} a convolution: neither TransformerEngine nor torchao converts it"
TABLE_LEGEND = ("input, weight (E4M3), grad E5M2 (HYBRID), grad E4M3 (all-E4M3): the largest share of the operand's "
                "nonzero elements that its cast flushes to 0 under current scaling, over the sampled steps; "
                "history: the shortest amax history of delayed scaling that clips only where any history must "
                "(HYBRID formats)")


def _names(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _steps(steps: list[int], total: int | None = None) -> str:
    """``1, 3, 5, 8, 13 and 32 more``."""
    total = len(steps) if total is None else max(total, len(steps))
    shown = ", ".join(str(s) for s in steps[:STEPS_SHOWN])
    more = total - min(len(steps), STEPS_SHOWN)
    return shown + (f" and {more} more" if more > 0 else "")


def clipped_cell(recipe: dict) -> str:
    """A delayed recipe's clipped passes and the first few of their steps: ``3 (steps 1, 4, 9)``."""
    n = recipe.get("clipped_passes") or 0
    if n == 0:
        return "0"
    steps = recipe.get("clipped_steps") or []
    if not steps:
        return str(n)
    return f"{n} (step{'s' if len(steps) > 1 else ''} {_steps(steps)})"


def unavoidable_cell(operand: dict) -> str:
    steps = operand.get("unavoidable_clip_steps") or []
    return f"{len(steps)} ({_steps(steps)})" if steps else "0"


def history_cell(history: int | None) -> str:
    return "—" if history is None else str(history)


def summary_line(data: dict) -> str:
    """What was read: ``100 steps with GEMM operands (0..99), 5 sampled; bfloat16 on cuda; flush limit 1%``."""
    steps = data.get("steps") or {}
    sampled = data.get("sampled_steps") or []
    span = f" ({steps.get('first')}..{steps.get('last')})" if steps.get("passes") else ""
    return (f"{_count(steps.get('passes') or 0, 'step')} with GEMM operands{span}, {len(sampled)} sampled; "
            f"{data.get('amp_dtype')} on {data.get('device') or '?'}; flush limit {percent(data.get('flush_limit'))}")


def snippet(data: dict) -> str:
    """torchao's conversion, leaving out the layers to keep."""
    fn = data.get("module_filter_fn")
    return (f"convert_to_float8_training(model, module_filter_fn={fn})" if fn
            else "convert_to_float8_training(model)")


def _hybrid(layer: dict) -> list[dict]:
    return [op for op in layer.get("operands") or [] if op.get("variant", "hybrid") == "hybrid"]


def _recipe(operand: dict, recipe: str, history: int | None = None) -> dict | None:
    for r in operand.get("recipes") or []:
        if r.get("recipe") == recipe and (recipe == "current" or r.get("history") == history):
            return r
    return None


def _worst_reason(layers: list[dict]) -> tuple[str, dict] | None:
    worst = None
    for layer in layers:
        for reason in layer.get("reasons") or []:
            share = max(reason.get("flushed") or 0.0, reason.get("saturated") or 0.0)
            if worst is None or share > worst[0]:
                worst = (share, layer["name"], reason)
    return None if worst is None else (worst[1], worst[2])


def reason(r: dict) -> str:
    """One reason to keep a layer: ``output gradient in E5M2 flushes 3.4% of its nonzero elements at step 40``."""
    text = f"{operand_label(r.get('operand', '?'), r.get('format', '?'))} flushes {percent(r.get('flushed'))}"
    if r.get("saturated"):
        text += f" and saturates {percent(r['saturated'])}"
    return text + f" of its nonzero elements at step {r.get('step')} under {recipe_label(r.get('recipe', 'current'), None)}"


def verdict(data: dict) -> str:
    """The answer, one paragraph: how many layers are ready, which to keep and how (torchao's
    filter, TransformerEngine's layers), which are unknown, and the amax history to use."""
    layers = data.get("layers") or []
    ready, keep, unknown = data.get("ready") or [], data.get("keep") or [], data.get("unknown") or []
    dtype = data.get("amp_dtype") or "the AMP dtype"
    limit = percent(data.get("flush_limit"))
    out = [(f"Of {_count(len(layers), 'GEMM layer')}, {len(ready)} {'is' if len(ready) == 1 else 'are'} ready "
            f"for FP8 training, {len(keep)} to keep in {dtype} and {len(unknown)} unknown (flush limit {limit} of an "
            f"operand's nonzero elements under current scaling).")]
    convs = [layer["name"] for layer in layers if not layer.get("converted", True)]
    if convs:
        out.append(f"{_names(convs)} {'is a convolution' if len(convs) == 1 else 'are convolutions'}, which "
                   f"neither TransformerEngine nor torchao converts: {'it stays' if len(convs) == 1 else 'they stay'} "
                   f"in {dtype} whatever the verdict.")
    kept = [layer for layer in layers if layer.get("verdict") == "keep"]
    if keep:
        worst = _worst_reason(kept)
        why = "" if worst is None else f" ({reason(worst[1])})" if len(kept) == 1 else (
            f" (worst: `{worst[0]}`, {reason(worst[1])})")
        out.append(f"Keep {_names(keep)} in {dtype}: {'it loses' if len(keep) == 1 else 'each loses'} more than "
                   f"{limit} of an operand's nonzero elements to flushing or saturation{why}.")
        out.append(f"With torchao: `{snippet(data)}`; with TransformerEngine, leave the same layers as "
                   f"`torch.nn.Linear` (or run them under `te.fp8_autocast(enabled=False)`) and convert the others, "
                   f"or keep them out through its debug API (`--te-config FILE` writes the config).")
    else:
        out.append(f"Nothing to keep out: with torchao, `{snippet(data)}`; with TransformerEngine, every Linear "
                   f"layer can become `te.Linear`.")
    if unknown:
        out.append(f"{_names(unknown)} {'has' if len(unknown) == 1 else 'have'} an operand without a sampled pass: "
                   f"record more steps with module taps (a smaller `module_every`) to decide.")
    out.append(history_sentence(data))
    return " ".join(out)


def history_sentence(data: dict) -> str:
    """The shortest amax history for delayed scaling, and what TransformerEngine's default costs."""
    history = data.get("shortest_history")
    considered = [layer for layer in data.get("layers") or [] if layer.get("verdict") != "keep"]
    if history is None:
        return "No amax history to suggest for delayed scaling: no layer outside those to keep has a known one."
    must = sorted({s for layer in considered for op in _hybrid(layer) for s in op.get("unavoidable_clip_steps") or []})
    where = (f"clips only where any history must: at {_count(len(must), 'step')} where an amax exceeded every "
             f"earlier one ({_steps(must)})" if must else "clips no pass")
    text = (f"For delayed scaling, an amax history of {_count(history, 'pass', 'passes')} "
            f"(`DelayedScaling(amax_history_len={history}, amax_compute_algo=\"max\")`) is the shortest that {where}.")
    return text + " " + default_history_cost(considered, history)


def default_history_cost(layers: list[dict], history: int) -> str:
    """What TransformerEngine's default history of 1024 costs: the clipped passes beyond the
    unavoidable ones, and the flushes it adds over a history of 1 (both start at scale 1, so the
    first pass, which flushes alike under every history, is not counted as its cost)."""
    extra, worst = 0, None
    for layer in layers:
        for op in _hybrid(layer):
            long = _recipe(op, "delayed", TE_DEFAULT_HISTORY)
            if long is None:
                continue
            must = op.get("unavoidable_clip_passes", len(op.get("unavoidable_clip_steps") or []))
            extra += max(0, (long.get("clipped_passes") or 0) - must)
            flushed, short = long.get("flushed_max"), (_recipe(op, "delayed", 1) or {}).get("flushed_max")
            if flushed is None or short is None or flushed <= short:
                continue
            if worst is None or flushed - short > worst[0] - worst[3]:
                worst = (flushed, layer["name"], op, short)
    clips = ("clips no more" if extra == 0 else
             f"clips {_count(extra, 'pass', 'passes')} more than it must (too short for this run)")
    text = f"TransformerEngine's default history of {TE_DEFAULT_HISTORY} {clips}"
    if worst is None:
        return text + ", and flushes no more than a history of 1 at the sampled steps."
    flushed, name, op, short = worst
    return (text + f", but holds each scale to the largest amax of up to {TE_DEFAULT_HISTORY} passes back: it "
            f"flushes up to {percent(flushed)} of an operand (`{name}`, {operand_label(op['operand'], op['format'])}) "
            f"where a history of 1 flushes {percent(short)}.")


def _conv_names(data: dict) -> str:
    names = [f"`{layer['name']}`" for layer in data.get("layers") or [] if layer.get("converted") is False]
    return f" ({', '.join(names)})" if names else ""


def _several_calls(data: dict) -> str:
    names = [f"`{layer['name']}`: {layer['calls_per_step']} calls" for layer in data.get("layers") or []
             if (layer.get("calls_per_step") or 1) > 1]
    return f" ({', '.join(names)})" if names else ""


def _formats(data: dict) -> str:
    formats = data.get("formats") or {}
    return "; ".join(f"{FORMATS.get(k, k)} flushes scaled magnitudes at or below "
                     f"{scale_str(v.get('flushes_at_or_below'))} and saturates above {v.get('max'):g}"
                     for k, v in formats.items() if v.get("max") is not None)


LIMITS = {
    "per_block_formats": lambda data: (
        "Per-block formats (MXFP8, MXFP4, NVFP4) are not assessed: "
        f"{(data.get('block_formats') or {}).get('why_not') or 'the run has no block statistics'}."),
    "convolutions_not_converted": lambda data: (
        f"Convolutions{_conv_names(data)} are assessed as if they were converted, but neither TransformerEngine "
        f"nor torchao converts convolutions: they run in {data.get('amp_dtype') or 'the AMP dtype'}."),
    "no_sampled_steps": lambda data: (
        "No step of the run has fine histograms of the GEMM operands, so no flushed share is known and every "
        "layer is unknown: record with `GradScaler(..., level='full', model=model)` and a `module_every` that "
        "samples some of its steps."),
    "several_calls_per_step": lambda data: (
        f"Layers called several times per step{_several_calls(data)}: their input and output gradient have a "
        f"pass per call, in call order, and their weight one per step, so a history length counts passes, not "
        f"steps; the recipes' own bookkeeping of several calls may differ."),
    "not_called": lambda data: (
        f"GEMM layers never called as modules are not assessed ({_names(data.get('not_called') or [])}): "
        f"`nn.MultiheadAttention` uses its `out_proj` weight (and its input projection, which is no module) "
        f"inside its own forward, where no module hook sees them; whether a recipe converts them depends on "
        f"the recipe."),
    "several_ranks": lambda data: (
        "Several ranks: each pass takes the largest amax over the ranks (TransformerEngine reduces amaxes "
        "across ranks) and its shares are of the ranks' summed histograms; a recipe that scales each rank by "
        "its own amax flushes no more on any rank."),
}
HISTOGRAM_NOTE = ("Flushed and saturated shares are predictions from each operand's histogram of 8 bins per "
                  "binade (the density taken as flat inside a bin), not casts of the tensors: each is exact up "
                  "to the elements of the one bin its threshold falls in. Clipping is exact (from the amaxes).")


def limits(data: dict) -> list[str]:
    """The limits of the analysis in words: the data's codes, then the formats' thresholds and how
    shares are predicted."""
    out = [LIMITS[code](data) if code in LIMITS else str(code) for code in data.get("limits") or []]
    formats = _formats(data)
    if formats:
        out.append(f"Formats: {formats}.")
    out.append(HISTOGRAM_NOTE)
    blocks = data.get("block_formats") or {}
    if blocks.get("assessed"):
        out.append(BLOCK_NOTE)
        left = blocks.get("left_out") or {}
        parts = ([f"{_count(left['non_finite'], 'value')} of operands that held an inf or a NaN (steps the "
                  f"scaler skipped: no recipe casts them)"] if left.get("non_finite") else []) + (
                 [_count(left["damaged"], "damaged value")] if left.get("damaged") else [])
        if parts:
            out.append(f"Block formats leave out {' and '.join(parts)}.")
    return out


BLOCK_NOTE = ("Block formats: blocks run along each operand's reduction dimension (a Linear's input and weight in the "
              "forward GEMM, its output gradient in the input gradient's), one orientation only (the weight "
              "gradient's GEMM blocks the output gradient and the input along the tokens); operands of more than "
              "2^18 elements are read at every k-th row (k odd); NVFP4 training's random Hadamard transforms and "
              "stochastic rounding (torchao's and TransformerEngine's) and TransformerEngine's 16x16 weight "
              "blocks are not modelled.")


# -- block formats (issue 42) -----------------------------------------------------------------------

BLOCK_RECIPES = {"mxfp8": "MXFP8", "mxfp8_rceil": "MXFP8 RCEIL", "mxfp8_hybrid": "MXFP8 HYBRID",
                 "mxfp4": "MXFP4", "nvfp4": "NVFP4"}
CASTS = {"mxfp8_e4m3_floor": "MXFP8 E4M3 (floor scales)", "mxfp8_e4m3_round_up": "MXFP8 E4M3 (round-up scales)",
         "mxfp8_e5m2_floor": "MXFP8 E5M2 (floor scales)", "mxfp8_e5m2_round_up": "MXFP8 E5M2 (round-up scales)",
         "mxfp4_floor": "MXFP4 (floor scales)", "mxfp4_round_up": "MXFP4 (round-up scales)", "nvfp4": "NVFP4"}
BLOCK_VERDICTS = {"ready": "ready", "keep": "keep", "unknown": "unknown", "not_converted": "—"}
BLOCK_LEGEND = ("Each cell: the verdict for the recipe and the largest share of an operand's nonzero elements "
                "that its cast flushes or saturates at a sampled step (measured: each operand cast on the device "
                "as torchao's reference casts it); a layer is kept when that share exceeds what the recipe loses "
                "on Gaussian data by more than the flush limit.")


def block_recipe_label(name: str) -> str:
    return BLOCK_RECIPES.get(name, name)


def block_reason(r: dict) -> str:
    """``input in NVFP4 loses 14% of its nonzero elements at step 0 (10% on Gaussian data)``."""
    lost = (r.get("flushed") or 0.0) + (r.get("saturated") or 0.0)
    parts = [f"flushed {percent(r.get('flushed'))}"] + ([f"saturated {percent(r['saturated'])}"] if r.get("saturated")
                                                          else [])
    return (f"{OPERANDS.get(r.get('operand'), r.get('operand'))} in {CASTS.get(r.get('cast'), r.get('cast'))} loses "
            f"{percent(lost)} ({', '.join(parts)}) at step {r.get('step')}, "
            f"{percent(r.get('baseline'))} on Gaussian data")


def block_verdict(data: dict) -> str:
    """The block formats' answer, one paragraph: per recipe how many layers are ready and which to
    keep; or why the run cannot say."""
    blocks = data.get("block_formats") or {}
    if not blocks.get("assessed"):
        return (f"Block formats (MXFP8, MXFP4, NVFP4) are not assessed: {blocks.get('why_not') or 'no block statistics'}. "
                f"Record with `GradScaler(..., level='full', model=model)` (`fp8=True`, the default) to assess them.")
    layers = [layer for layer in blocks.get("layers") or [] if layer.get("converted", True)]
    steps = blocks.get("sampled_steps") or []
    parts = []
    for recipe in blocks.get("recipes") or []:
        name = recipe["name"]
        ready = len(recipe.get("ready") or [])
        keep, unknown = recipe.get("keep") or [], recipe.get("unknown") or []
        text = f"{block_recipe_label(name)}: {ready} of {len(layers)} ready"
        if keep:
            text += (", keep every layer" if len(keep) == len(layers) else
                     f", keep {_names(keep) if len(keep) <= 4 else _count(len(keep), 'layer')}")
        if unknown:
            text += f", {len(unknown)} unknown"
        parts.append(text)
    return (f"Block formats, from the block statistics of {_count(len(steps), 'sampled step')} "
            f"({_steps(steps)}): " + "; ".join(parts) + ". " + _round_up_advice(blocks)
            + f"A layer is kept out of a recipe when one of its operands loses more than "
            f"{percent(blocks.get('flush_limit'))} of its nonzero elements beyond what the recipe loses on "
            f"Gaussian data.")


def _round_up_advice(blocks: dict) -> str:
    """Where floor scales keep layers that round-up scales do not (saturation: a block amax's
    mantissa above E4M3's 1.75), the advice to use round-up scales."""
    recipes = {r["name"]: r for r in blocks.get("recipes") or []}
    floor, up = recipes.get("mxfp8"), recipes.get("mxfp8_rceil")
    if not floor or not up:
        return ""
    saved = [n for n in floor.get("keep") or [] if n in (up.get("ready") or [])]
    if not saved:
        return ""
    return (f"With round-up scales (torchao's `ScaleCalculationMode.RCEIL`, TransformerEngine's "
            f"`MXFP8BlockScaling`), {len(saved)} of the {_count(len(floor.get('keep') or []), 'layer')} that floor "
            f"scales would keep out {'is' if len(saved) == 1 else 'are'} ready: prefer them. ")


def block_keep_items(data: dict) -> list[str]:
    """Per recipe with layers to keep: which, the worst reason, and how to keep them out."""
    blocks = data.get("block_formats") or {}
    items = []
    for recipe in blocks.get("recipes") or []:
        keep = recipe.get("keep") or []
        if not keep:
            continue
        worst = None
        for layer in blocks.get("layers") or []:
            reasons = [r for entry in layer.get("recipes") or [] if entry.get("recipe") == recipe["name"]
                       for r in entry.get("reasons") or []]
            for r in reasons:
                lost = (r.get("flushed") or 0.0) + (r.get("saturated") or 0.0)
                if worst is None or lost > worst[0]:
                    worst = (lost, layer["name"], r)
        converted = [layer for layer in blocks.get("layers") or [] if layer.get("converted", True)]
        every = len(keep) == len(converted)
        label = block_recipe_label(recipe["name"])
        text = (f"{label} ({recipe.get('describes')}): keep "
                + (f"every layer ({len(keep)}): each loses more in {label} than Gaussian data does" if every
                   else _names(keep)))
        if worst is not None:
            text += f"; worst `{worst[1]}`: {block_reason(worst[2])}"
        if not every:
            text += f". With torchao: `quantize_(model, config, filter_fn={recipe.get('filter_fn')})`"
            if recipe.get("te_debug_config"):
                text += f"; with TransformerEngine's debug API: `--te-config FILE --recipe {recipe['name']}`"
        items.append(text + ".")
    return items
