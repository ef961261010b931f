"""Type checks of the JSON contracts (docs/json-contracts.md), shared by the command tests."""

from __future__ import annotations

# A point value where the record decides one (None where not), and the range it lies in.
UNDERFLOW_FIELDS = {"underflow_rate": (float, type(None)), "underflow_rate_min": float, "underflow_rate_max": float}
REPORT_CONTRACT = {
    "run": {"path": str, "steps": int, "ranks": int, "amp_dtype": str,
            "scaler": {"class": str, "init_scale": float, "growth_factor": float, "backoff_factor": float,
                       "growth_interval": int}},
    "scale": {"initial": float, "final": float, "min": float, "max": float, "skipped_steps": int,
              "skipped_fraction": float, "settle_step": (int, type(None))},
    "layers": [{"name": str, "kind": str, "underflow_rate": (float, type(None)),
                "underflow_rate_min": (float, type(None)), "underflow_rate_max": (float, type(None)),
                "zero_rate": (float, type(None)),
                "subnormal_rate": (float, type(None)),
                "headroom_log2": (float, type(None)), "amax": (float, type(None)), "amin": (float, type(None))}],
    "overflow_origins": [{"name": str, "kind": str, "rank": int, "count": int, "first_step": int,
                          "last_step": int}],
    "recommendation": {"init_scale": float, "growth_factor": float, "backoff_factor": float,
                       "growth_interval": int, "reasons": [str], "advice": [str],
                       "current": {"skipped_steps": int, **UNDERFLOW_FIELDS},
                       "predicted": {"skipped_steps": int, **UNDERFLOW_FIELDS}},
    "warnings": [str],
}
SIMULATE_CONTRACT = {"config": {"init_scale": float, "growth_factor": float, "backoff_factor": float,
                                "growth_interval": int},
                     "skipped_steps": int, "skipped_fraction": float, **UNDERFLOW_FIELDS,
                     "scale": {"final": float, "min": float, "max": float}}

# ampdoctor fp8 (docs/json-contracts.md, fp8)
FP8_CONTRACT = {
    "path": str, "run_id": str, "amp_dtype": (str, type(None)), "device": (str, type(None)),
    "steps": {"first": int, "last": int, "passes": int}, "sampled_steps": [int], "flush_limit": float,
    "histories": [int],
    "formats": {"e4m3": {"dtype": str, "max": float, "flushes_at_or_below": float},
                "e5m2": {"dtype": str, "max": float, "flushes_at_or_below": float}},
    "layers": [{
        "name": str, "type": (str, type(None)), "converted": bool, "calls_per_step": int, "verdict": str,
        "reasons": [{"operand": str, "format": str, "recipe": str, "flushed": float, "saturated": float,
                     "step": int}],
        "shortest_history": (int, type(None)),
        "operands": [{
            "operand": str, "format": str, "variant": str, "amax_max": (float, type(None)), "passes": int,
            "sampled_passes": int, "shortest_history": (int, type(None)), "unavoidable_clip_steps": [int], "unavoidable_clip_passes": int,
            "recipes": [{"recipe": str, "history": (int, type(None)), "flushed_mean": (float, type(None)),
                         "flushed_max": (float, type(None)), "flushed_max_step": (int, type(None)),
                         "saturated_mean": (float, type(None)), "saturated_max": (float, type(None)),
                         "clipped_passes": int, "clipped_steps": [int]}]}]}],
    "keep": [str], "ready": [str], "unknown": [str], "not_called": [str], "module_filter_fn": (str, type(None)),
    "te_debug_config": (str, type(None)), "shortest_history": (int, type(None)),
    "block_formats": {
        "assessed": bool, "why_not": (str, type(None)), "flush_limit": (float, type(None)), "sampled_steps": [int],
        "ranks": int, "left_out": {"non_finite": int, "damaged": int},
        "recipes": [{"name": str, "casts": {"input": str, "weight": str, "grad_output": str}, "describes": str,
                     "baseline_lost": {"input": float, "weight": float, "grad_output": float},
                     "keep": [str], "ready": [str], "unknown": [str], "filter_fn": (str, type(None)),
                     "te_debug_config": (str, type(None))}],
        "layers": [{
            "name": str, "converted": bool,
            "recipes": [{"recipe": str, "verdict": str, "lost_max": (float, type(None)),
                         "reasons": [{"operand": str, "cast": str, "flushed": float, "saturated": float,
                                      "baseline": float, "step": int}]}],
            "operands": [{
                "operand": str, "sampled_passes": int, "rows_read": (float, type(None)),
                "casts": [{"cast": str, "flushed_mean": (float, type(None)), "flushed_max": (float, type(None)),
                           "saturated_max": (float, type(None)), "clamped_blocks_max": (float, type(None)),
                           "error_mean": (float, type(None)), "error_max": (float, type(None)),
                           "worst_step": (int, type(None)), "worst_lost": (float, type(None)),
                           "worst_flushed": (float, type(None)), "worst_saturated": (float, type(None))}],
                "scale_spread": {"mx_block_exponents": [int],
                                 "nvfp4_block_ratio_median": (float, type(None)),
                                 "nvfp4_clamped_blocks": (float, type(None))}}]}]},
    "limits": [str],
}

def check_contract(value, spec, where="$"):
    """``value`` has every key of ``spec`` with the right type (ints count as floats; bools only
    where the spec says bool)."""
    if isinstance(spec, dict):
        assert isinstance(value, dict), where
        for key, sub in spec.items():
            assert key in value, f"{where}.{key} missing"
            check_contract(value[key], sub, f"{where}.{key}")
    elif isinstance(spec, list):
        assert isinstance(value, list), where
        for i, item in enumerate(value):
            check_contract(item, spec[0], f"{where}[{i}]")
    else:
        types = spec if isinstance(spec, tuple) else (spec,)
        if float in types:
            types = types + (int,)
        assert isinstance(value, types) and (bool in types or not isinstance(value, bool)), f"{where}: {value!r}"
