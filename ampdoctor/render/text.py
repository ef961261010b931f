"""Plain-text renderers: pure functions from report data to a string. They never print."""

from __future__ import annotations

import shlex
import textwrap

from . import sections
from .formatting import (VERDICTS, binades, number, origin_name, origin_steps, percent, scale_str, setting, shorten,
                         underflow, underflow_range)


def _ended(info: dict) -> str:
    if not info["ended_cleanly"]:
        return "without close() (killed or still running)"
    if info.get("unwritten_at_exit"):
        return f"at exit, without {info['unwritten_at_exit']} step(s) it could not write in time (a slow disk)"
    return "cleanly"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def info_text(info: dict) -> str:
    """``ampdoctor info`` as text, from :func:`ampdoctor.read.run.describe`'s data."""
    sc = info["scaler"]
    steps = info["steps"]
    span = f" (steps {info['first_step']}..{info['last_step']})" if steps else ""
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(info["kinds"].items()))
    lines = [
        f"run        {info['path']}",
        f"schema     version {info['schema_version']} (written by ampdoctor {info['written_by']}, "
        f"torch {info['torch_version']})",
        f"run id     {', '.join(info['run_ids'])}   started {info['started']}",
        f"device     {info['device']}   amp dtype {info['amp_dtype']}",
        f"scaler     {sc['class']}(init_scale={sc['init_scale']}, growth_factor={sc['growth_factor']}, "
        f"backoff_factor={sc['backoff_factor']}, growth_interval={sc['growth_interval']})",
        f"steps      {steps}{span}, {info['skipped_steps']} skipped",
        f"ranks      {len(info['ranks'])} ({', '.join(map(str, info['ranks']))}), world size "
        f"{info['world_size']}",
        f"tensors    {info['tensors']}",
        f"rows       {info['rows']} ({kinds})",
        f"on disk    {_size(info['size_bytes'])} in {info['segments']} segment(s)",
        f"ended      {_ended(info)}",
    ]
    lines += [f"warning    {w}" for w in info["warnings"]]
    return "\n".join(lines)


# -- report, simulate, layers ------------------------------------------------------------------

WIDTH = 100


def _style(text: str, color: bool, **kw) -> str:
    if not color:
        return text
    import click
    return click.style(text, **kw)


def _heading(title: str, color: bool) -> str:
    return _style(title, color, bold=True)


def _wrap(text: str, indent: str = "  - ", width: int = WIDTH) -> list[str]:
    import textwrap
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=" " * len(indent)) or [indent]


def layers_table(layers: list[dict], top: int | None = None, path: str | None = None) -> list[str]:
    """The per-layer table (fits 100 columns; long names are clipped from the left; the peak
    magnitude, ``amax``, is in the other formats: headroom says what it means here). Cut to
    ``top`` rows, it ends with the command that lists them all for the run at ``path``."""
    rows = layers if top is None else layers[:top]
    head = f"{'layer':<31} {'kind':<11} {'underflow':>9} {'range':>16} {'zero':>8} {'subnorm':>8} {'headroom':>8}"
    lines = [head]
    marks = [sections.measured_mark(r.get("underflow_measured")) for r in rows]
    for r, mark in zip(rows, marks):
        lines.append(f"{shorten(sections.layer_label(r), 31, keep_head=False):<31} {r['kind']:<11} "
                     f"{percent(r['underflow_rate']) + mark:>9} {underflow_range(r):>16} "
                     f"{percent(r['zero_rate']):>8} {percent(r['subnormal_rate']):>8} "
                     f"{binades(r['headroom_log2']):>8}")
    for legend in (sections.measured_legend(rows), sections.range_legend(rows)):
        if legend:
            lines.extend(textwrap.wrap(legend, 100, initial_indent="  ", subsequent_indent="    "))
    if top is not None and len(layers) > top:
        run = shlex.quote(str(path)) if path is not None else "RUN"
        lines.append(f"… {len(layers) - top} more (ampdoctor layers {run} --top N)")
    return lines


def report_text(report: dict, color: bool = False, top: int = 15) -> str:
    """``ampdoctor report`` for the terminal."""
    run, scale, rec, missing = report["run"], report["scale"], report["recommendation"], report["missing"]
    out = [_heading(f"ampdoctor report  {shorten(str(run['path']), WIDTH - 18, keep_head=False)}", color)]
    out += _wrap(f"{run['steps']} steps, {run['ranks']} rank(s), {run['amp_dtype']} on {run['device']}, level "
                 f"{run['level']}; {sections.scaler_call(run['scaler'])}", "")
    out.append("")
    out.append(_heading("Loss scale", color))
    if scale is None:
        out.append(f"  {missing.get('scale', 'not enough data')}")
    else:
        skipped = f"{scale['skipped_steps']} skipped ({percent(scale['skipped_fraction'])})"
        out.append(f"  initial {scale_str(scale['initial'])}, final {scale_str(scale['final'])}, range "
                   f"{scale_str(scale['min'])}..{scale_str(scale['max'])}; "
                   + _style(skipped, color, fg="red" if scale["skipped_steps"] else "green")
                   + (f"; settled at step {scale['settle_step']}" if scale["settle_step"] else ""))
    out += ["", _heading("Layers (worst underflow first)", color)]
    if "layers" in missing:
        out += _wrap(missing["layers"], "  ")
    else:
        out += ["  " + line for line in layers_table(report["layers"], top, run["path"])]
    out += ["", _heading("Overflow origins (most frequent first)", color)]
    if report["overflow_origins"]:
        for o in report["overflow_origins"][:10]:
            steps = (f"step {o['first_step']}" if o["first_step"] == o["last_step"]
                     else f"steps {o['first_step']}..{o['last_step']}")
            out.append(f"  {o['count']:>4}x  {shorten(origin_name(o), 50, keep_head=False)} ({o['kind']}, "
                       f"rank {o['rank']}), {steps}")
    else:
        out += _wrap(missing.get("overflow_origins", "none: no step overflowed"), "  ")
    out += ["", _heading("Recommendation", color)]
    if rec is None:
        out += _wrap(missing.get("recommendation", "not enough data"), "  ")
    else:
        out.append("  " + VERDICTS.get(rec["verdict"], rec["verdict"]))
        out.append("  " + _style(rec["code"], color, fg="cyan", bold=True))  # one line: pasteable
        cur, pred = rec["current"], rec["predicted"]
        out.append(f"  predicted: {pred['skipped_steps']} skipped step(s) instead of {cur['skipped_steps']}; "
                   f"underflow rate {underflow(pred)} instead of {underflow(cur)}")
        for reason in rec["reasons"]:
            out += _wrap(reason)
        if rec["advice"]:
            out += ["", _heading("Advice", color)]
            for item in rec["advice"]:
                out += _wrap(item)
    if report["warnings"]:
        out += ["", _heading("Warnings", color)]
        for w in report["warnings"]:
            out += _wrap(w)
    return "\n".join(out)


# The replay's settings beyond GradScaler's as torch behaves (the contract's values): not written out.
REPLAY_DEFAULTS = {"hysteresis": 1, "min_scale": 0.0, "max_scale": None}


def simulate_text(sim: dict) -> str:
    """``ampdoctor simulate``: the prediction next to what the run did (within 100 columns)."""
    cfg, actual = sim["config"], sim["actual"]
    settings = ", ".join(f"{k}={setting(k, cfg[k])}" for k in sections.SCALER_KEYS)
    extra = [f"{k}={setting(k, cfg[k])}" for k in sections.REPLAY_KEYS if cfg.get(k) != REPLAY_DEFAULTS[k]]
    lines = _wrap(f"simulated {sim['steps']} recorded steps in {sim['target_dtype']} with GradScaler({settings}"
                  + (", " + ", ".join(extra) if extra else "") + ")", "")
    lines += ["", f"{'':<18} {'simulated':>14} {'actual run':>14}"]
    a_cfg = actual["config"]
    rows = [("skipped steps", str(sim["skipped_steps"]), str(actual["skipped_steps"])),
            ("skipped fraction", percent(sim["skipped_fraction"]), percent(actual["skipped_fraction"])),
            ("underflow rate", underflow(sim), underflow(actual)),
            ("final scale", scale_str(sim["scale"]["final"]), scale_str(actual["scale"]["final"])),
            ("min scale", scale_str(sim["scale"]["min"]), scale_str(actual["scale"]["min"])),
            ("max scale", scale_str(sim["scale"]["max"]), scale_str(actual["scale"]["max"]))]
    lines += [f"{label:<18} {a:>14} {b:>14}" for label, a, b in rows]
    if a_cfg is None:
        lines.append("(the run itself used no loss scaling)")
    if sim["uncertain_steps"]:
        lines += _wrap(f"{sim['uncertain_steps']} more step(s) may also overflow: their magnitude is only a "
                       f"lower bound", "")
    lines += _wrap(f"overflow threshold: largest gradient x scale > 2**{sim['threshold']['overflow_log2']:.1f} "
                   f"({sim['threshold']['source']})", "")
    top = [layer for layer in sim["layers"]
           if (layer.get("underflow_rate_max") or layer["underflow_rate"] or 0) > 0][:10]
    if top:
        lines += ["", "layers that would underflow:"]
        lines += [f"  {shorten(layer['name'], 60, keep_head=False):<60} {underflow(layer):>15}" for layer in top]
    for note in sim["notes"]:
        lines += _wrap(note, "note: ", WIDTH)
    return "\n".join(lines)


def layers_text(data: dict) -> str:
    """``ampdoctor layers``."""
    lines = [data["missing"]] if data["missing"] else layers_table(data["layers"])
    return "\n".join(lines + [f"warning: {w}" for w in data.get("warnings") or []])


CAUSE_TITLES = {
    "forward_overflow": "an activation exceeded the format's range (forward overflow)",
    "backward_overflow": "gradients overflowed while the loss was finite (backward overflow)",
    "nonfinite_input": "a non-finite value came in with the data (non-finite input)",
    "scale_collapse": "repeated overflow drove the loss scale toward zero (scale collapse)",
    "divergence": "the loss and gradient norm grew until they overflowed (divergence)",
    "nonfinite_weights": "the parameters became non-finite during training (non-finite weights)",
    "nonfinite_checkpoint": "the parameters were non-finite before the first step (non-finite checkpoint)",
    "unknown": "the data recorded cannot tell (unknown)",
}


def postmortem_text(pm: dict, color: bool = False) -> str:
    """``ampdoctor postmortem`` for the terminal."""
    run = pm["run"]
    out = [_heading(f"ampdoctor postmortem  {shorten(str(run['path']), WIDTH - 22, keep_head=False)}", color),
           f"{run['steps']} steps, {run['ranks']} rank(s), level {run['level']}", ""]
    if pm["status"] == "healthy":
        out.append(_style("healthy: no non-finite loss, parameter or run of skipped steps", color, fg="green"))
        for item in pm["advice"]:
            out += _wrap(item, "but: ")
        for note in pm["notes"]:
            out += _wrap(note, "note: ")
        return "\n".join(out)
    origin = pm["origin"] or {}
    out.append(_style(f"{pm['cause']}: {CAUSE_TITLES[pm['cause']]}", color, fg="red", bold=True))
    out += _wrap(pm["event"]["description"], "event: ")
    if origin.get("name"):
        out.append(f"origin: {origin['name']} ({origin['kind']}), step {origin['step']}, rank {origin['rank']}")
    later = pm["evidence"].get("later_origins") or []
    if later:
        out += _wrap("; ".join(f"{origin_name(o)} ({o['kind']}), {origin_steps(o)}" for o in later), "later origins: ")
    if pm["timeline"]:
        out += ["", _heading("Steps before the event", color),
                f"  {'step':>7} {'scale':>9} {'skip':>5} {'loss':>10} {'grad norm':>10} "
                f"{'max activation':>15}  module"]
        for r in pm["timeline"]:
            step, scale, skipped, loss, grad_norm, activation = sections.timeline_cells(r)
            module = shorten(r["max_activation_module"] or "—", 32, keep_head=False)
            out.append(f"  {step:>7} {scale:>9} {skipped:>5} {loss:>10} {grad_norm:>10} {activation:>15}  {module}")
    if pm["advice"]:
        out += ["", _heading("What to change", color)]
        for i, item in enumerate(pm["advice"], 1):
            out += _wrap(item, f"  {i}. ")
    if pm["notes"]:
        out += ["", _heading("Not determined / notes", color)]
        for n in pm["notes"]:
            out += _wrap(n)
    return "\n".join(out)
