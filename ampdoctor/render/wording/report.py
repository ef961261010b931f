"""The sentences of ``report`` and ``simulate``: the run as read, the replay, the recommendation."""

from __future__ import annotations

from ..formatting import percent, scale_str
from . import register, register_fixed, word
from .phrases import settings_phrase, underflow_phrase

# -- the run as read (analysis/run_analysis.py, report.py) ----------------------------------------

@register
def step_rows_without_scale(rows):
    return f"left out {rows} step row(s) whose scale is not a number"


@register
def light_rows_without_sample(rows):
    return (f"{rows} light parameter row(s) (peak and norm only) have no sampled step of their parameter to "
            f"read underflow from (a parameter that got gradients on unsampled steps only, or more than 2**20 "
            f"such rows before its first sample): the steps' underflow leaves them out; a smaller every= samples "
            f"them")


register_fixed("report_of_unclosed_run",
       "the run did not end with close() (killed, crashed or still running): this report covers the steps "
       "on disk")
register_fixed("no_step_rows", "not enough data: the run has no step rows")
register_fixed("no_layer_rows",
       "not enough data: the run was recorded at level='steps' (no per-parameter rows); record with "
       "level='params' (the default) or level='full'")
register_fixed("no_layer_rows_to_list",
       "not enough data: the run was recorded at level='steps'; record with level='params' or level='full'")
register_fixed("skips_without_module_rows",
       "no origin could be named: the skipped steps have no module rows; record with level='full' (or keep "
       "escalate_steps > 0) to see where overflows start")


@register
def too_few_steps_to_recommend(needed):
    return f"not enough data: a recommendation needs at least {needed} recorded steps"


@register
def origins_of_first_steps(read, anomalous):
    return f"origins are from the first {read} of {anomalous} anomalous steps"


@register
def steps_without_origin(unnamed, anomalous):
    return (f"{unnamed} of the {anomalous} anomalous steps have no origin: their rows do not show where the "
            f"first non-finite value appeared (no module rows at those steps, a value received from another "
            f"rank, or several non-finite parameter gradients with no module order to tell which came first)")


@register
def ranks_disagree_on_found_inf(steps, first):
    return (f"ranks disagree on found_inf at {steps} step(s) (first: step {first}): some ranks skipped the "
            f"optimizer step and others did not, so their weights and loss scales diverge, and a collective "
            f"inside step() can deadlock. Each rank's scaler saw only its own gradients: let DDP all-reduce the "
            f"gradients before step(), or use ShardedGradScaler with FSDP, which all-reduces found_inf")


# -- the replay (analysis/replay.py) ----------------------------------------------------------------

@register
def threshold_from_overflows(overflows):
    return f"{overflows} observed overflow(s)"


@register
def threshold_at_format_max(dtype, module_ratio):
    base = "the format's max" if dtype is None else f"the {dtype} max"
    return base + (f" / {module_ratio:.3g} (module output gradients)" if module_ratio > 1 else "")


@register
def threshold_of_other_format(recorded, target, module_ratio, module_rows):
    if module_ratio > 1:
        why = " over the largest module-to-parameter gradient ratio seen"
    elif not module_rows:
        why = " (no module rows: record with level='full' to see overflow inside modules)"
    else:
        why = " (no module output gradient was larger than the parameter gradients)"
    return f"recorded in {recorded}: nothing could overflow {target}'s range, so the threshold is {target}'s max{why}"


@register
def unexplained_skips(steps):
    return (f"{steps} skipped step(s) overflowed although the steps around them would not have: their magnitude "
            f"is only a lower bound, so at lower scales the prediction assumes they pass (counted as uncertain)")


@register
def nonfinite_loss_steps(steps):
    return f"{steps} step(s) had a non-finite loss: skipped at any scale"


# -- the recommendation (analysis/recommend.py) ------------------------------------------------------

@register
def scaler_code(device, settings, scaler="torch.amp.GradScaler", framework=None):
    """The line to paste: the run's scaler class constructed with the settings, or, for a run that
    came through a framework, the framework's own constructor that passes them on."""
    keywords = settings_phrase(settings)
    if framework == "accelerate":
        return f'Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs({keywords})])'
    call = f'{scaler}("{device}", {keywords})'
    if framework in ("lightning", "fabric") and scaler.endswith(".ShardedGradScaler"):
        # Lightning's FSDPPrecision refuses a scaler passed to it (2.6): set the plugin's own
        holder = "trainer.precision_plugin" if framework == "lightning" else "fabric.strategy.precision"
        return f"{holder}.scaler = {call}  # before fit"
    if framework in ("lightning", "fabric"):
        owner = "Trainer" if framework == "lightning" else "Fabric"
        return f'{owner}(plugins=[MixedPrecision("16-mixed", "{device}", scaler={call})])  # in place of precision="16-mixed"'
    return call


@register
def replayed_without_loss_scaling(recorded, target, skipped, steps, underflow):
    return (f"recorded in {recorded} without loss scaling; replayed in {target}: torch's default GradScaler() "
            f"would skip {skipped} of {steps} steps with {underflow_phrase(underflow)}")


@register
def start_up_backoff(init_scale, skipped, settled_scale):
    return (f"init_scale={scale_str(init_scale)} overflowed at the start: the first {skipped} step(s) were "
            f"skipped while the scale backed off to {scale_str(settled_scale)}")


@register
def skips_after_growth(after_growth, skipped, growth_interval):
    return (f"{after_growth} of the {skipped} skipped steps came right after the scale grew "
            f"(growth_interval={growth_interval}): the scale keeps growing back into overflow")


@register
def recorded_underflow_range(median_scale, underflow, undecided, drift=0.0):
    why = []
    if undecided > 1e-6 or not drift:
        why.append(f"{percent(undecided)} are zeros the record cannot call underflow or structure (gradients 0 "
                   f"everywhere, or zeros of gradients that reach the cut-off in numbers)")
    if drift > 1e-6:
        why.append(f"{percent(drift)} depend on how far the smallest values drifted on the steps between sampled "
                   f"ones, where only each gradient's norm and peak are recorded (every= samples more often)")
    return (f"at the recorded scales (median {scale_str(median_scale)}) "
            f"{underflow_phrase(underflow).removesuffix(' underflow')} of gradient elements underflowed to zero: "
            + "; ".join(why))


@register
def recorded_underflow(rate, median_scale, measured_steps=0, steps=0):
    how = ("a measured" if steps and measured_steps == steps else
           "an estimated" if not measured_steps else f"({measured_steps} of {steps} steps measured, the rest estimated)")
    return (f"at the recorded scales {how} {percent(rate)} of gradient elements underflowed to zero "
            f"(median scale {scale_str(median_scale)})")


@register
def overflow_threshold(log2, source):
    return (f"overflow starts where the largest gradient times the scale reaches about 2**{log2:.1f} "
            f"(from {word(source)})")


@register
def current_settings_best(skipped, underflow):
    return f"the current settings are the best found: {skipped} skipped step(s), {underflow_phrase(underflow)}"


@register
def replay_predicts(settings, skipped, recorded_skipped, underflow, recorded_underflow, uncertain):
    unchanged = underflow["underflow_rate"] == recorded_underflow["underflow_rate"] == 0
    change = (f"still {underflow_phrase(underflow)}" if unchanged
              else f"{underflow_phrase(underflow)} instead of {underflow_phrase(recorded_underflow)}")
    return (f"with {settings_phrase(settings)} the replay predicts {skipped} skipped step(s) instead of "
            f"{recorded_skipped}, and {change}" + (f" ({uncertain} more step(s) uncertain)" if uncertain else ""))


@register
def activation_beyond_format(module, peak, dtype, dtype_max):
    return (f"`{module}` produced activations up to {peak:.3g}, beyond {dtype}'s max {dtype_max:g}: its "
            f"output overflows at any loss scale; keep it in float32 with "
            f"`torch.autocast(device_type, enabled=False)` or train in bfloat16")


@register
def overflow_outside_modules(after, at_model_output, dtype, settings_fix_it):
    where = ("the gradient of the loss with respect to the model's output" if at_model_output else
             f"the gradient flowing back into `{after}`'s output from the code that consumes it (functional ops "
             f"after it, or the loss)")
    fix = ", which the settings above see to" if settings_fix_it else ""
    return (f"overflows start outside every tapped module, in {where}: {dtype} must hold it times the loss "
            f"scale{fix}" + ("" if at_model_output else "; to have the op named, move that code into a module"))


@register
def drift_between_samples(drift):
    return (f"{percent(drift)} of gradient elements may or may not have underflowed on the steps between sampled "
            f"ones, where only each gradient's norm and peak are recorded and its smallest values may drift "
            f"faster than its norm: a smaller every= (or measure_every=) narrows that range")


@register
def undecided_zeros(median_scale, settings_changed):
    again = ("record again with the settings above" if settings_changed else
             "record again at a higher scale or with the loss scaled up")
    return (f"at scale {scale_str(median_scale)} some zeros cannot be called underflow or structure (the layers "
            f"whose range reaches above their underflow: gradients 0 everywhere, or zeros of gradients that reach "
            f"the cut-off in numbers). If those parameters should learn, {again} and compare: a gradient that "
            f"reappears at a higher scale had underflowed")


@register
def no_scale_fits(max_skipped, max_underflow, dtype, span_log2, modules):
    span = f" (gradients span 2**{span_log2[0]:.0f} to 2**{span_log2[1]:.0f})" if span_log2 else ""
    named = ", ".join(f"`{m}`" for m in modules)
    return (f"no loss scale keeps both skipped steps under {percent(max_skipped)} and underflow under "
            f"{percent(max_underflow)} in {dtype}{span}: the window between overflow and underflow is too "
            f"narrow. Train in bfloat16 (`torch.autocast(..., dtype=torch.bfloat16)`, no GradScaler needed)"
            + (f", or keep {named} in float32 with `autocast(enabled=False)`" if named else ""))


@register
def scale_collapsed(min_scale, late_skipped, clip):
    max_norm = f"{clip:.3g}" if clip is not None else "1.0"
    return (f"the scale collapsed (min {scale_str(min_scale)}, {percent(late_skipped)} of the last quarter's "
            f"steps skipped): gradients grew until they overflow at any scale, which is an optimisation problem: "
            f"lower the learning rate, or clip after unscaling with `scaler.unscale_(optimizer); "
            f"torch.nn.utils.clip_grad_norm_(model.parameters(), {max_norm})` (the 95th percentile of the "
            f"recorded gradient norm)")


@register
def nonfinite_losses(steps, first):
    return (f"{steps} step(s) had a non-finite loss (first at step {first}); no scaler setting avoids that: run "
            f"`ampdoctor postmortem` on this run")


register_fixed("settings_fine", "the current GradScaler settings are fine for this run")
