"""What to change after a run's first non-finite event, by its cause (``ampdoctor postmortem``'s
``advice``): findings, most likely first; their sentences are in :mod:`ampdoctor.render.wording`."""

from __future__ import annotations

from .findings import Finding
from .nonfinite_event import BY_OPTIMIZER_OR_OUTSIDE, BY_OUTSIDE


def advice(cause: str, origin: dict | None, evidence: dict, *, has_module_rows: bool, recorded_full: bool,
           path: str) -> list[Finding]:
    """What to change, most likely first. ``has_module_rows``: the event's step has module rows (so
    recording more would not tell more); ``recorded_full``: the run was recorded at level='full';
    ``path``: the run's, for a command to paste."""
    name = origin.get("name") if origin else None
    out: list[Finding] = []
    large = [p for p in evidence.get("large_parameters") or [] if p["amax"] is not None]  # finite ones
    if large and cause in ("forward_overflow", "unknown"):
        out.append(Finding("parameter_beyond_float16", {"name": large[0]["name"], "amax": large[0]["amax"]}))
    if cause == "forward_overflow":
        out += [Finding("keep_module_in_float32", {"module": name, "because": "output_overflowed"}),
                Finding("train_in_bfloat16_for_its_range"), Finding("normalise_growing_activation")]
    elif cause == "nonfinite_input":
        batch = evidence.get("first_nonfinite_output", {})
        out += [Finding("inspect_the_batch", {"module": name, "step": origin["step"], "rank": origin["rank"],
                                              "in_target": name == "(loss)", "before_model": bool(batch),
                                              "added_to": batch.get("added_to") or []}),
                Finding("skip_bad_batches")]
    elif cause == "backward_overflow":
        out += [Finding("keep_module_in_float32", {"module": name, "because": "backward_overflowed"}),
                Finding("clip_inside_backward"), Finding("init_scale_does_not_help")]
    elif cause == "scale_collapse":
        out += [Finding("gradients_beyond_float16"),
                Finding("keep_module_in_float32", {"module": name, "because": "gradients_from_one_module"}),
                Finding("or_train_in_bfloat16")]
    elif cause == "divergence":
        trend = evidence.get("trend", {})
        out += [Finding("lower_the_learning_rate", {k: trend.get(k, 0) for k in
                                                    ("loss_from", "loss_to", "grad_norm_from", "grad_norm_to")}),
                Finding("clip_after_unscaling", {"max_norm": trend.get("grad_norm_from") or None}),
                Finding("divergence_is_not_precision")]
    elif cause == "nonfinite_weights":
        out += _weights_advice(name, origin, evidence)
    elif cause == "nonfinite_checkpoint":
        out += [Finding("nonfinite_before_first_step", {"name": name, "first": origin["step"],
                                                        "others": evidence.get("nonfinite_parameters", 0) - 1}),
                Finding("load_an_earlier_checkpoint"), Finding("fix_the_initialisation")]
    elif has_module_rows:
        # Module rows were recorded at the event: recording more would not tell more.
        step = origin["step"] if origin else None
        out += [Finding("nonfinite_gradients_applied", {"step": step, "name": name}) if name else
                Finding("inspect_the_step_rows", {"step": step, "path": path}),
                Finding("resume_before_that_step")]
    else:
        out.append(Finding("record_modules_and_resume", {"recorded_full": recorded_full}))
    return out


def _weights_advice(name: str | None, origin: dict, evidence: dict) -> list[Finding]:
    """Advice for parameters that became non-finite during training, by what wrote them."""
    by = evidence.get("written_by")
    step, finite_at, checked = origin["step"], evidence.get("finite_at"), evidence.get("checked_at")
    if by == BY_OUTSIDE:
        # A non-finite loss at the event step shows the weights were already non-finite in its forward.
        return [Finding("written_outside_optimizer", {
                    "name": name, "finite_at": finite_at, "checked": checked,
                    "before_forward_of": step if evidence.get("loss_nonfinite") else None}),
                Finding("find_the_writer", {"name": name}),
                Finding("resume_from_checkpoint_at", {"step": finite_at})]
    if by == BY_OPTIMIZER_OR_OUTSIDE:
        return [Finding("written_by_optimizer_or_after", {
                    "name": name, "step": step, "checked_later": checked is not None and checked > step}),
                Finding("if_the_optimizer_wrote_it"), Finding("check_code_writing_weights"),
                Finding("resume_before_that_step")]
    return [Finding("optimizer_wrote_nonfinite", {"name": name}), Finding("resume_before_that_step")]
