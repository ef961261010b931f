"""Every sentence of ampdoctor's outputs, in one place: per finding code
(:class:`~ampdoctor.analysis.findings.Finding`) a small function named for it, or a fixed text,
grouped by the analysis that finds it. Numbers read as everywhere else (:mod:`.formatting`); code
to paste is marked with backticks, which each renderer shows its own way. :func:`worded` turns a
command's data into the strings of its JSON contract."""

from __future__ import annotations

import shlex
from collections.abc import Callable

from ..analysis.findings import Finding
from .formatting import percent, scale_str

_SENTENCES: dict[str, Callable[..., str]] = {}


def _sentence(sentence: Callable[..., str]) -> Callable[..., str]:
    """Register the decorated function as the sentence of the finding code that is its name; the
    finding's values are its keyword arguments."""
    _SENTENCES[sentence.__name__] = sentence
    return sentence


def _fixed(code: str, sentence: str) -> None:
    """Register the sentence of a finding without values."""
    _SENTENCES[code] = lambda: sentence


def word(finding: Finding) -> str:
    """The sentence of one finding."""
    sentence = _SENTENCES.get(finding.code)
    if sentence is None:
        raise KeyError(f"no wording for the finding {finding.code!r} (add one to render/wording.py)")
    return sentence(**finding.values)


def worded(data):
    """``data`` with every finding in it replaced by its sentence; everything else as it is."""
    if isinstance(data, Finding):
        return word(data)
    if isinstance(data, dict):
        return {k: worded(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(worded(v) for v in data)
    return data


def codes() -> frozenset[str]:
    """The finding codes that have a sentence."""
    return frozenset(_SENTENCES)


# -- shared pieces -------------------------------------------------------------------------------

def _underflow(fields: dict) -> str:
    """``no underflow``, ``0.5% underflow`` or ``between 0.001% and 96% underflow``."""
    if fields["underflow_rate"] is None:
        return (f"between {percent(fields['underflow_rate_min'])} and {percent(fields['underflow_rate_max'])} "
                f"underflow")
    rate = fields["underflow_rate"]
    return "no underflow" if rate == 0 else f"{percent(rate)} underflow"


def _settings(settings: dict) -> str:
    """``init_scale=2**12, growth_interval=500``: GradScaler keywords as they are pasted."""
    return ", ".join(f"{name}={scale_str(value)}" if name == "init_scale" else f"{name}={value!r}"
                     for name, value in settings.items())


def _to_record_modules(recorded_full: bool) -> str:
    """How to get module rows at a step that has none, given how the run was recorded."""
    if recorded_full:
        return ("keep the flight recorder on (flight_steps > 0, the default) or tap modules on every step "
                "(module_every=1)")
    return "record with level='full'"


def _parameter(name: str | None) -> str:
    return f"`{name}`" if name else "the parameters"


# -- the run as read (analysis/run_analysis.py, report.py) ----------------------------------------

@_sentence
def step_rows_without_scale(rows):
    return f"left out {rows} step row(s) whose scale is not a number"


_fixed("report_of_unclosed_run",
       "the run did not end with close() (killed, crashed or still running): this report covers the steps "
       "on disk")
_fixed("no_step_rows", "not enough data: the run has no step rows")
_fixed("no_layer_rows",
       "not enough data: the run was recorded at level='steps' (no per-parameter rows); record with "
       "level='params' (the default) or level='full'")
_fixed("no_layer_rows_to_list",
       "not enough data: the run was recorded at level='steps'; record with level='params' or level='full'")
_fixed("skips_without_module_rows",
       "no origin could be named: the skipped steps have no module rows; record with level='full' (or keep "
       "escalate_steps > 0) to see where overflows start")


@_sentence
def too_few_steps_to_recommend(needed):
    return f"not enough data: a recommendation needs at least {needed} recorded steps"


@_sentence
def origins_of_first_steps(read, anomalous):
    return f"origins are from the first {read} of {anomalous} anomalous steps"


@_sentence
def steps_without_origin(unnamed, anomalous):
    return (f"{unnamed} of the {anomalous} anomalous steps have no origin: their rows do not show where the "
            f"first non-finite value appeared (no module rows at those steps, a value received from another "
            f"rank, or several non-finite parameter gradients with no module order to tell which came first)")


@_sentence
def ranks_disagree_on_found_inf(steps, first):
    return (f"ranks disagree on found_inf at {steps} step(s) (first: step {first}): some ranks skipped the "
            f"optimizer step and others did not, so their weights and loss scales diverge, and a collective "
            f"inside step() can deadlock. Each rank's scaler saw only its own gradients: let DDP all-reduce the "
            f"gradients before step(), or use ShardedGradScaler with FSDP, which all-reduces found_inf")


# -- the replay (analysis/replay.py) ----------------------------------------------------------------

@_sentence
def threshold_from_overflows(overflows):
    return f"{overflows} observed overflow(s)"


@_sentence
def threshold_at_format_max(dtype, module_ratio):
    base = "the format's max" if dtype is None else f"the {dtype} max"
    return base + (f" / {module_ratio:.3g} (module output gradients)" if module_ratio > 1 else "")


@_sentence
def threshold_of_other_format(recorded, target, module_ratio, module_rows):
    if module_ratio > 1:
        why = " over the largest module-to-parameter gradient ratio seen"
    elif not module_rows:
        why = " (no module rows: record with level='full' to see overflow inside modules)"
    else:
        why = " (no module output gradient was larger than the parameter gradients)"
    return f"recorded in {recorded}: nothing could overflow {target}'s range, so the threshold is {target}'s max{why}"


@_sentence
def unexplained_skips(steps):
    return (f"{steps} skipped step(s) overflowed although the steps around them would not have: their magnitude "
            f"is only a lower bound, so at lower scales the prediction assumes they pass (counted as uncertain)")


@_sentence
def nonfinite_loss_steps(steps):
    return f"{steps} step(s) had a non-finite loss: skipped at any scale"


# -- the recommendation (analysis/recommend.py) ------------------------------------------------------

@_sentence
def scaler_code(device, settings):
    return f'torch.amp.GradScaler("{device}", {_settings(settings)})'


@_sentence
def replayed_without_loss_scaling(recorded, target, skipped, steps, underflow):
    return (f"recorded in {recorded} without loss scaling; replayed in {target}: torch's default GradScaler() "
            f"would skip {skipped} of {steps} steps with {_underflow(underflow)}")


@_sentence
def start_up_backoff(init_scale, skipped, settled_scale):
    return (f"init_scale={scale_str(init_scale)} overflowed at the start: the first {skipped} step(s) were "
            f"skipped while the scale backed off to {scale_str(settled_scale)}")


@_sentence
def skips_after_growth(after_growth, skipped, growth_interval):
    return (f"{after_growth} of the {skipped} skipped steps came right after the scale grew "
            f"(growth_interval={growth_interval}): the scale keeps growing back into overflow")


@_sentence
def recorded_underflow_range(median_scale, underflow, undecided):
    return (f"at the recorded scales (median {scale_str(median_scale)}) "
            f"{_underflow(underflow).removesuffix(' underflow')} of gradient elements underflowed to zero: "
            f"{percent(undecided)} are zeros the record cannot call underflow or structure (gradients 0 "
            f"everywhere, or zeros of gradients that reach the cut-off in numbers)")


@_sentence
def recorded_underflow(rate, median_scale):
    return (f"at the recorded scales an estimated {percent(rate)} of gradient elements underflowed to zero "
            f"(median scale {scale_str(median_scale)})")


@_sentence
def overflow_threshold(log2, source):
    return (f"overflow starts where the largest gradient times the scale reaches about 2**{log2:.1f} "
            f"(from {word(source)})")


@_sentence
def current_settings_best(skipped, underflow):
    return f"the current settings are the best found: {skipped} skipped step(s), {_underflow(underflow)}"


@_sentence
def replay_predicts(settings, skipped, recorded_skipped, underflow, recorded_underflow, uncertain):
    unchanged = underflow["underflow_rate"] == recorded_underflow["underflow_rate"] == 0
    change = (f"still {_underflow(underflow)}" if unchanged
              else f"{_underflow(underflow)} instead of {_underflow(recorded_underflow)}")
    return (f"with {_settings(settings)} the replay predicts {skipped} skipped step(s) instead of "
            f"{recorded_skipped}, and {change}" + (f" ({uncertain} more step(s) uncertain)" if uncertain else ""))


@_sentence
def activation_beyond_format(module, peak, dtype, dtype_max):
    return (f"`{module}` produced activations up to {peak:.3g}, beyond {dtype}'s max {dtype_max:g}: its "
            f"output overflows at any loss scale; keep it in float32 with "
            f"`torch.autocast(device_type, enabled=False)` or train in bfloat16")


@_sentence
def overflow_outside_modules(after, at_model_output, dtype, settings_fix_it):
    where = ("the gradient of the loss with respect to the model's output" if at_model_output else
             f"the gradient flowing back into `{after}`'s output from the code that consumes it (functional ops "
             f"after it, or the loss)")
    fix = ", which the settings above see to" if settings_fix_it else ""
    return (f"overflows start outside every tapped module, in {where}: {dtype} must hold it times the loss "
            f"scale{fix}" + ("" if at_model_output else "; to have the op named, move that code into a module"))


@_sentence
def undecided_zeros(median_scale, settings_changed):
    again = ("record again with the settings above" if settings_changed else
             "record again at a higher scale or with the loss scaled up")
    return (f"at scale {scale_str(median_scale)} some zeros cannot be called underflow or structure (the layers "
            f"whose 'at most' exceeds their underflow: gradients 0 everywhere, or zeros of gradients that reach "
            f"the cut-off in numbers). If those parameters should learn, {again} and compare: a gradient that "
            f"reappears at a higher scale had underflowed")


@_sentence
def no_scale_fits(max_skipped, max_underflow, dtype, span_log2, modules):
    span = f" (gradients span 2**{span_log2[0]:.0f} to 2**{span_log2[1]:.0f})" if span_log2 else ""
    named = ", ".join(f"`{m}`" for m in modules)
    return (f"no loss scale keeps both skipped steps under {percent(max_skipped)} and underflow under "
            f"{percent(max_underflow)} in {dtype}{span}: the window between overflow and underflow is too "
            f"narrow. Train in bfloat16 (`torch.autocast(..., dtype=torch.bfloat16)`, no GradScaler needed)"
            + (f", or keep {named} in float32 with `autocast(enabled=False)`" if named else ""))


@_sentence
def scale_collapsed(min_scale, late_skipped, clip):
    max_norm = f"{clip:.3g}" if clip is not None else "1.0"
    return (f"the scale collapsed (min {scale_str(min_scale)}, {percent(late_skipped)} of the last quarter's "
            f"steps skipped): gradients grew until they overflow at any scale, which is an optimisation problem: "
            f"lower the learning rate, or clip after unscaling with `scaler.unscale_(optimizer); "
            f"torch.nn.utils.clip_grad_norm_(model.parameters(), {max_norm})` (the 95th percentile of the "
            f"recorded gradient norm)")


@_sentence
def nonfinite_losses(steps, first):
    return (f"{steps} step(s) had a non-finite loss (first at step {first}); no scaler setting avoids that: run "
            f"`ampdoctor postmortem` on this run")


_fixed("settings_fine", "the current GradScaler settings are fine for this run")


# -- the postmortem's event (analysis/nonfinite_event.py) -------------------------------------------

@_sentence
def loss_nonfinite(loss, step, rank):
    return f"the loss was {loss} at step {step} on rank {rank}"


@_sentence
def params_written_outside_optimizer(finite_at, checked, rank, nonfinite_loss_at):
    used = f"; step {nonfinite_loss_at}'s loss was already non-finite" if nonfinite_loss_at is not None else ""
    return (f"the parameters were finite at the check after step {finite_at}'s optimizer step and non-finite at "
            f"the check of step {checked} on rank {rank}, and no optimizer step was applied in between{used}")


@_sentence
def params_nonfinite_from_start(first, checked, rank):
    skipped = "that step was" if first == checked else f"every step from {first} to it was"
    return (f"the parameters held a non-finite value before the first step ({first}) on rank {rank}: the check "
            f"at step {checked} saw them, and {skipped} skipped, so no optimizer step had changed them")


@_sentence
def params_nonfinite_after_step(step, checked, rank):
    seen = "" if step == checked else f" (seen by the check at step {checked}; the steps between were skipped)"
    return f"the parameters held a non-finite value after the optimizer step of step {step} on rank {rank}{seen}"


@_sentence
def scale_fell_below_floor(scale, step):
    return f"the scale fell to {scale:g} at step {step} and steps still overflowed"


@_sentence
def skip_run(length, first):
    return f"{length} or more steps in a row were skipped from step {first}"


# -- the postmortem's notes (analysis/postmortem.py, nonfinite_cause.py) -------------------------------

_fixed("postmortem_of_unclosed_run",
       "the run did not end with close() (killed or crashed): this covers the steps on disk")


@_sentence
def skips_without_module_rows_to_name(recorded_full):
    return ("no module rows at the skipped steps, so the module where the overflow starts is unknown: resume "
            f"from the last checkpoint and {_to_record_modules(recorded_full)} to record it")


@_sentence
def no_step_row_at_event(step):
    return (f"step {step} has no step row (training stopped between step() and update()), so its gradients are "
            f"unknown; the check at exit saw the parameters its optimizer left")


_fixed("gradients_nonfinite_too",
       "the gradients of that step were not finite either; the scaler should have skipped it")


@_sentence
def no_parameter_checks(module):
    return (f"the run has no parameter checks (check_params=False), so a non-finite weight of `{module}` would "
            f"look the same as a NaN in the batch")


@_sentence
def module_inferred_from_parameters(recorded_full):
    return ("no module rows at this step: the module is inferred from its parameters, which fp16 cannot hold; "
            f"{_to_record_modules(recorded_full)} to see the activations")


@_sentence
def no_module_rows_at_event(recorded_full):
    if recorded_full:
        return ("no module rows at this step (the flight recorder was off), so it cannot tell a NaN in the batch "
                "from an activation that overflowed: resume from the last checkpoint and "
                f"{_to_record_modules(recorded_full)} to record them")
    return ("no module rows at this step (the run was recorded at level='params' and the flight recorder had no "
            "taps), so it cannot tell a NaN in the batch from an activation that overflowed: resume from the last "
            "checkpoint with level='full' (or level='params' with the default escalate_steps) to record them")


@_sentence
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


@_sentence
def parameter_beyond_float16(name, amax):
    return (f"`{name}` holds values up to {amax:.3g}, beyond float16's max 65504: autocast casts it to inf. A "
            f"checkpoint trained in bfloat16 or float32 can have weights fp16 cannot hold: train in bfloat16, or "
            f"keep that module in float32")


@_sentence
def keep_module_in_float32(module, because):
    where = f"`{module}`" if module and not module.startswith("(") else "the module named above"
    return (f"keep {where} in float32: `with torch.autocast(device_type, enabled=False): ...` around its call "
            f"(and cast its input with `.float()`)" + _FLOAT32_BECAUSE[because])


_fixed("train_in_bfloat16_for_its_range",
       "or train in bfloat16 (`torch.autocast(..., dtype=torch.bfloat16)`), whose range is that of float32")
_fixed("normalise_growing_activation",
       "if the activation grows over training, add a normalisation before it or lower the learning rate")


@_sentence
def inspect_the_batch(module, step, rank, in_target, before_model, added_to):
    what = "the loss's target" if in_target else "the batch"
    way = (f" (it reached `{module}` added to the finite output of {', '.join(f'`{m}`' for m in added_to)}: a "
           f"float input such as `inputs_embeds`)") if added_to else ""
    return (f"inspect {what} of step {step} (rank {rank}): it held a NaN {'before' if before_model else 'after'} "
            f"the model{way}; check the data pipeline (`torch.isfinite(x).all()` on the batch)")


_fixed("skip_bad_batches", "skip such batches in the loop, or clean them in the dataset")
_fixed("clip_inside_backward", "or clip or rescale inside that module's backward; or train in bfloat16")
_fixed("init_scale_does_not_help", "a lower init_scale does not help when one module amplifies its gradient this much")
_fixed("gradients_beyond_float16",
       "the gradients overflow even without loss scaling (scale < 1): they are beyond float16's range "
       "themselves; lower the learning rate or clip the gradients")
_fixed("or_train_in_bfloat16", "or train in bfloat16")


@_sentence
def lower_the_learning_rate(loss_from, loss_to, grad_norm_from, grad_norm_to):
    return (f"lower the learning rate: the loss grew from {loss_from:.3g} to {loss_to:.3g} and the gradient norm "
            f"from {grad_norm_from:.3g} to {grad_norm_to:.3g} before the overflow")


@_sentence
def clip_after_unscaling(max_norm):
    if not max_norm:
        return "clip the gradient norm after `scaler.unscale_(optimizer)`"
    return (f"clip after unscaling: `scaler.unscale_(optimizer); torch.nn.utils.clip_grad_norm_("
            f"model.parameters(), {max_norm:.3g})` (the norm before the growth)")


_fixed("divergence_is_not_precision",
       "this is an optimisation problem, not a precision one: bfloat16 would fail later, not never")


@_sentence
def nonfinite_before_first_step(name, first, others):
    also = f" (and {others} other parameter(s))" if others > 0 else ""
    return (f"{_parameter(name)}{also} held NaN or inf before the first step of this run ({first}): the weights "
            f"it started from were non-finite, not made so by training. Check them right after loading: "
            f"`[n for n, p in model.named_parameters() if not p.isfinite().all()]`")


_fixed("load_an_earlier_checkpoint",
       "load a checkpoint saved before its weights went non-finite; if that run was recorded with ampdoctor, "
       "`ampdoctor postmortem` of it dates when they did")
_fixed("fix_the_initialisation",
       "if they come from an initialisation or a conversion (a custom `init`, a dtype cast of a checkpoint "
       "with values beyond the target format), fix that step")


@_sentence
def nonfinite_gradients_applied(step, name):
    return (f"step {step} applied non-finite gradients to `{name}`: update the weights only through "
            f"`scaler.step(optimizer)` for every optimizer, and do not change the gradients between "
            f"`scaler.unscale_(optimizer)` and `scaler.step(optimizer)`")


@_sentence
def inspect_the_step_rows(step, path):
    return f"inspect the rows of step {step}: `ampdoctor.load({path!r}).query('step == {step}')`"


_fixed("resume_before_that_step", "resume from the last checkpoint before that step")


@_sentence
def record_modules_and_resume(recorded_full):
    return f"resume from the last checkpoint and {_to_record_modules(recorded_full)} to see where it starts"


@_sentence
def written_outside_optimizer(name, finite_at, checked, before_forward_of):
    until = f"step {before_forward_of}'s forward" if before_forward_of is not None else f"the check of step {checked}"
    return (f"{_parameter(name)} was finite at the check after step {finite_at}'s optimizer step and non-finite "
            f"at the check of step {checked}, with no optimizer step applied in between: it was written outside "
            f"`optimizer.step()`, by code that ran after step {finite_at}'s `scaler.update()` and before {until} "
            f"(a manual edit or re-initialisation, `load_state_dict`, a hook or callback that writes into "
            f"parameters)")


@_sentence
def find_the_writer(name):
    return f"find what writes into {_parameter(name)} there, and check `torch.isfinite(p).all()` right after it"


@_sentence
def resume_from_checkpoint_at(step):
    return f"resume from a checkpoint saved at step {step} or before"


@_sentence
def written_by_optimizer_or_after(name, step, checked_later):
    why = ("no parameter check in between tells which: record with check_params='always' to date it to the step"
           if checked_later else "the step's row was not written, so whether its gradients were finite is unknown")
    return (f"{_parameter(name)} became non-finite in step {step}'s optimizer step or in code that ran after it, "
            f"before the next forward ({why})")


_fixed("if_the_optimizer_wrote_it", f"if the optimizer wrote it: {_CHECK_THE_OPTIMIZER}")
_fixed("check_code_writing_weights",
       "if your code writes into the weights between steps (a load, a hook, a manual edit), check it")


@_sentence
def optimizer_wrote_nonfinite(name):
    return (f"the optimizer wrote non-finite values into {_parameter(name)} from finite gradients: "
            f"{_CHECK_THE_OPTIMIZER}")
