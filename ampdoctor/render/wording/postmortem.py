"""The sentences of ``postmortem``: the event, the notes, the advice."""

from __future__ import annotations

import shlex

from . import register, register_fixed
from .phrases import parameter_phrase, to_record_modules

# -- the postmortem's event (analysis/nonfinite_event.py) -------------------------------------------

@register
def loss_nonfinite(loss, step, rank):
    return f"the loss was {loss} at step {step} on rank {rank}"


@register
def params_written_outside_optimizer(finite_at, checked, rank, nonfinite_loss_at):
    used = f"; step {nonfinite_loss_at}'s loss was already non-finite" if nonfinite_loss_at is not None else ""
    return (f"the parameters were finite at the check after step {finite_at}'s optimizer step and non-finite at "
            f"the check of step {checked} on rank {rank}, and no optimizer step was applied in between{used}")


@register
def params_nonfinite_from_start(first, checked, rank):
    skipped = "that step was" if first == checked else f"every step from {first} to it was"
    return (f"the parameters held a non-finite value before the first step ({first}) on rank {rank}: the check "
            f"at step {checked} saw them, and {skipped} skipped, so no optimizer step had changed them")


@register
def params_nonfinite_after_step(step, checked, rank):
    seen = "" if step == checked else f" (seen by the check at step {checked}; the steps between were skipped)"
    return f"the parameters held a non-finite value after the optimizer step of step {step} on rank {rank}{seen}"


@register
def scale_fell_below_floor(scale, step):
    return f"the scale fell to {scale:g} at step {step} and steps still overflowed"


@register
def skip_run(length, first):
    return f"{length} or more steps in a row were skipped from step {first}"


# -- the postmortem's notes (analysis/postmortem.py, nonfinite_cause.py) -------------------------------

register_fixed("postmortem_of_unclosed_run",
       "the run did not end with close() (killed or crashed): this covers the steps on disk")


@register
def skips_without_module_rows_to_name(recorded_full):
    return ("no module rows at the skipped steps, so the module where the overflow starts is unknown: resume "
            f"from the last checkpoint and {to_record_modules(recorded_full)} to record it")


@register
def origin_from_a_later_skipped_step(first, step, recorded_full):
    before = f"step {first} has" if step == first + 1 else f"steps {first} to {step - 1} have"
    return (f"the origin is from step {step}: {before} no module rows that name one, so where the first "
            f"skipped step overflowed is not known; to record it, {to_record_modules(recorded_full)}")


@register
def no_step_row_at_event(step):
    return (f"step {step} has no step row (training stopped between step() and update()), so its gradients are "
            f"unknown; the check at exit saw the parameters its optimizer left")


register_fixed("gradients_nonfinite_too",
       "the gradients of that step were not finite either; the scaler should have skipped it")


@register
def no_parameter_checks(module):
    return (f"the run has no parameter checks (check_params=False), so a non-finite weight of `{module}` would "
            f"look the same as a NaN in the batch")


@register
def module_inferred_from_parameters(recorded_full):
    return ("no module rows at this step: the module is inferred from its parameters, which fp16 cannot hold; "
            f"{to_record_modules(recorded_full)} to see the activations")


@register
def no_module_rows_at_event(recorded_full):
    if recorded_full:
        return ("no module rows at this step (the flight recorder was off), so it cannot tell a NaN in the batch "
                "from an activation that overflowed: resume from the last checkpoint and "
                f"{to_record_modules(recorded_full)} to record them")
    return ("no module rows at this step (the run was recorded at level='params' and the flight recorder had no "
            "taps), so it cannot tell a NaN in the batch from an activation that overflowed: resume from the last "
            "checkpoint with level='full' (or level='params' with the default escalate_steps) to record them")


@register
def healthy_run_that_trains_badly(path, dtype, steps, skipped, underflow, underflow_min, underflow_max,
                                  underflow_decided):
    found = []
    if skipped is not None:
        found.append(f"{skipped} of its {steps} steps ({skipped / steps:.1%}) were skipped (no update at those steps)")
    if underflow == "lost":
        amount = (f"{underflow_min:.1%}" if underflow_decided else
                  f"at least {underflow_min:.1%} (up to {underflow_max:.1%})")
        found.append(f"{amount} of its gradient elements underflowed to zero in {dtype} (no update for them)")
    elif underflow == "possible":
        found.append(f"up to {underflow_max:.1%} of its gradient elements may have underflowed to zero in {dtype} "
                     f"(zeros the record cannot call underflow or structure)")
    command = f"ampdoctor report {shlex.quote(path)}"
    return f"{' and '.join(found)}: run `{command}` to see where, and the scaler settings that avoid it"


# -- the postmortem's advice (analysis/postmortem_advice.py) ------------------------------------------

_CHECK_THE_OPTIMIZER = ("check the optimizer's hyper-parameters (eps of Adam-like optimizers in low precision, a "
                        "zero division in a custom step), and keep optimizer state in float32")
_FLOAT32_BECAUSE = {"output_overflowed": "; its output exceeded float16's range",
                    "backward_overflowed": "; its backward produced gradients beyond float16's range",
                    "gradients_from_one_module": " if one module produces them"}


@register
def parameter_beyond_float16(name, amax):
    return (f"`{name}` holds values up to {amax:.3g}, beyond float16's max 65504: autocast casts it to inf. A "
            f"checkpoint trained in bfloat16 or float32 can have weights fp16 cannot hold: train in bfloat16, or "
            f"keep that module in float32")


@register
def keep_module_in_float32(module, because):
    where = f"`{module}`" if module and not module.startswith("(") else "the module named above"
    return (f"keep {where} in float32: `with torch.autocast(device_type, enabled=False): ...` around its call "
            f"(and cast its input with `.float()`)" + _FLOAT32_BECAUSE[because])


register_fixed("train_in_bfloat16_for_its_range",
       "or train in bfloat16 (`torch.autocast(..., dtype=torch.bfloat16)`), whose range is that of float32")
register_fixed("normalise_growing_activation",
       "if the activation grows over training, add a normalisation before it or lower the learning rate")


@register
def inspect_the_batch(module, step, rank, in_target, before_model, added_to):
    what = "the loss's target" if in_target else "the batch"
    way = (f" (it reached `{module}` added to the finite output of {', '.join(f'`{m}`' for m in added_to)}: a "
           f"float input such as `inputs_embeds`)") if added_to else ""
    return (f"inspect {what} of step {step} (rank {rank}): it held a NaN {'before' if before_model else 'after'} "
            f"the model{way}; check the data pipeline (`torch.isfinite(x).all()` on the batch)")


register_fixed("skip_bad_batches", "skip such batches in the loop, or clean them in the dataset")
register_fixed("clip_inside_backward", "or clip or rescale inside that module's backward; or train in bfloat16")
register_fixed("init_scale_does_not_help", "a lower init_scale does not help when one module amplifies its gradient this much")
register_fixed("gradients_beyond_float16",
       "the gradients overflow even without loss scaling (scale < 1): they are beyond float16's range "
       "themselves; lower the learning rate or clip the gradients")
register_fixed("or_train_in_bfloat16", "or train in bfloat16")


@register
def lower_the_learning_rate(loss_from, loss_to, grad_norm_from, grad_norm_to):
    return (f"lower the learning rate: the loss grew from {loss_from:.3g} to {loss_to:.3g} and the gradient norm "
            f"from {grad_norm_from:.3g} to {grad_norm_to:.3g} before the overflow")


@register
def clip_after_unscaling(max_norm):
    if not max_norm:
        return "clip the gradient norm after `scaler.unscale_(optimizer)`"
    return (f"clip after unscaling: `scaler.unscale_(optimizer); torch.nn.utils.clip_grad_norm_("
            f"model.parameters(), {max_norm:.3g})` (the norm before the growth)")


register_fixed("divergence_is_not_precision",
       "this is an optimisation problem, not a precision one: bfloat16 would fail later, not never")


@register
def nonfinite_before_first_step(name, first, others):
    also = f" (and {others} other parameter(s))" if others > 0 else ""
    return (f"{parameter_phrase(name)}{also} held NaN or inf before the first step of this run ({first}): the weights "
            f"it started from were non-finite, not made so by training. Check them right after loading: "
            f"`[n for n, p in model.named_parameters() if not p.isfinite().all()]`")


register_fixed("load_an_earlier_checkpoint",
       "load a checkpoint saved before its weights went non-finite; if that run was recorded with ampdoctor, "
       "`ampdoctor postmortem` of it dates when they did")
register_fixed("fix_the_initialisation",
       "if they come from an initialisation or a conversion (a custom `init`, a dtype cast of a checkpoint "
       "with values beyond the target format), fix that step")


@register
def nonfinite_gradients_applied(step, name):
    return (f"step {step} applied non-finite gradients to `{name}`: update the weights only through "
            f"`scaler.step(optimizer)` for every optimizer, and do not change the gradients between "
            f"`scaler.unscale_(optimizer)` and `scaler.step(optimizer)`")


@register
def inspect_the_step_rows(step, path):
    return f"inspect the rows of step {step}: `ampdoctor.load({path!r}).query('step == {step}')`"


register_fixed("resume_before_that_step", "resume from the last checkpoint before that step")


@register
def record_modules_and_resume(recorded_full):
    return f"resume from the last checkpoint and {to_record_modules(recorded_full)} to see where it starts"


@register
def written_outside_optimizer(name, finite_at, checked, before_forward_of):
    until = f"step {before_forward_of}'s forward" if before_forward_of is not None else f"the check of step {checked}"
    return (f"{parameter_phrase(name)} was finite at the check after step {finite_at}'s optimizer step and non-finite "
            f"at the check of step {checked}, with no optimizer step applied in between: it was written outside "
            f"`optimizer.step()`, by code that ran after step {finite_at}'s `scaler.update()` and before {until} "
            f"(a manual edit or re-initialisation, `load_state_dict`, a hook or callback that writes into "
            f"parameters)")


@register
def find_the_writer(name):
    return f"find what writes into {parameter_phrase(name)} there, and check `torch.isfinite(p).all()` right after it"


@register
def resume_from_checkpoint_at(step):
    return f"resume from a checkpoint saved at step {step} or before"


@register
def written_by_optimizer_or_after(name, step, checked_later):
    why = ("no parameter check in between tells which: record with check_params='always' to date it to the step"
           if checked_later else "the step's row was not written, so whether its gradients were finite is unknown")
    return (f"{parameter_phrase(name)} became non-finite in step {step}'s optimizer step or in code that ran after it, "
            f"before the next forward ({why})")


register_fixed("if_the_optimizer_wrote_it", f"if the optimizer wrote it: {_CHECK_THE_OPTIMIZER}")
register_fixed("check_code_writing_weights",
       "if your code writes into the weights between steps (a load, a hook, a manual edit), check it")


@register
def optimizer_wrote_nonfinite(name):
    return (f"the optimizer wrote non-finite values into {parameter_phrase(name)} from finite gradients: "
            f"{_CHECK_THE_OPTIMIZER}")
