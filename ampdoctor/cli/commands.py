"""The ``ampdoctor`` command: thin wrappers over the library. Library errors become one-line
messages with exit code 2 here, and only here."""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from ..read.run import Run

from ..version import __version__
from .scenarios import CPU_STEPS, CUDA_STEPS, DEFAULT_PATH, SCENARIOS
from ..dependencies import check as check_dependencies, failed_import, import_problem
from ..commands import COMMANDS
from ..errors import AmpdoctorError, one_line


class CliError(click.ClickException):
    exit_code = 2


DEBUG_VARIABLE = "AMPDOCTOR_DEBUG"
# fp8 --recipe: tensorwise FP8 and the block recipes TransformerEngine has (analysis.block_readiness's
# VERDICT_RECIPES with te=True; named here so that --help imports no analysis; a test holds them equal)
TE_RECIPES = ("fp8", "mxfp8_rceil", "mxfp8_hybrid", "nvfp4")


def library_errors(fn):
    """Turn an :class:`AmpdoctorError` into a one-line CLI error (exit 2); any other exception
    (a bug of ours) too, named as an internal error, unless ``--traceback`` or
    ``$AMPDOCTOR_DEBUG`` asks for its traceback."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            check_dependencies()  # a pyarrow that cannot import with this numpy: one line, before its traceback
            return fn(*args, **kwargs)
        except AmpdoctorError as exc:
            raise CliError(one_line(str(exc))) from None
        except click.ClickException:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug of ours still gets one line, not a traceback
            if _show_tracebacks():
                raise
            if failed_import(exc):
                # The environment, not a bug: a dependency missing or broken; say what to change.
                raise CliError(import_problem(exc)) from None
            raise CliError(one_line(f"internal error: {type(exc).__name__}: {exc} (a bug in ampdoctor; "
                                    f"please report it; --traceback or {DEBUG_VARIABLE}=1 shows where)")) from None

    return run


def _show_tracebacks() -> bool:
    ctx = click.get_current_context(silent=True)
    asked = ctx is not None and (ctx.find_root().obj or {}).get("traceback", False)
    return asked or os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")


class Scale(click.ParamType):
    """A loss scale as the reports print it (``2**24``, ``2^24``) or as a number (``16777216``,
    ``1.5e3``); positive, or zero where ``allow_zero``."""

    name = "scale"

    def __init__(self, allow_zero: bool = False) -> None:
        self.allow_zero = allow_zero

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            number = float(value)
        else:
            text = str(value).strip().replace("^", "**")
            base, sep, exponent = text.partition("**")
            try:
                if sep and not float(base) > 0:
                    raise ValueError(base)
                number = float(base) ** float(exponent) if sep else float(text)
            except (ValueError, OverflowError):
                self.fail(f"{value!r} is not a scale: give a number or a power of two such as 2**16", param, ctx)
        if not (number > 0 or (self.allow_zero and number == 0)) or number != number:
            self.fail(f"{value!r} must be {'>= 0' if self.allow_zero else '> 0'}", param, ctx)
        return number


def _command(name: str, *runs: Run, fmt: str, analysis: dict | None = None, **display) -> str:
    """Command ``name`` (:data:`ampdoctor.commands.COMMANDS`) on read runs, rendered in ``fmt``."""
    command = COMMANDS[name]
    return command.render(command.analyse(*runs, **(analysis or {})), fmt, **display)


def output_format(*choices: str):
    return click.option("--format", "fmt", type=click.Choice(choices), default=choices[0],
                        show_default=True, help="Output format.")


def run_argument(fn):
    """The RUN path argument and the ``--run ID`` option, handed to the command as one read
    :class:`~ampdoctor.read.run.Run` (a directory may hold several runs; the latest by default)."""

    @functools.wraps(fn)
    @library_errors
    def with_run(*, run: str, run_id: str | None, **kwargs):
        from ..read.run import read_run
        return fn(run=read_run(run, run_id), **kwargs)

    with_run = click.option("--run", "run_id", metavar="ID", default=None,
                            help="Which run of the directory (a run id or its prefix) [default: the latest]")(with_run)
    # readable=False: an unreadable path gets our one-line error, not click's usage message
    return click.argument("run", type=click.Path(path_type=str, readable=False))(with_run)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ampdoctor")
@click.option("--traceback", is_flag=True, help=f"Show the traceback of an internal error (also: {DEBUG_VARIABLE}=1).")
@click.pass_context
def main(ctx: click.Context, traceback: bool) -> None:
    """Diagnose PyTorch automatic mixed precision runs recorded by ampdoctor."""
    ctx.obj = {"traceback": traceback}


@main.command()
@run_argument
@output_format("text", "json")
@library_errors
def info(run: Run, fmt: str) -> None:
    """Summarise a run: steps, ranks, tensors, schema, size, clean end."""
    from ..render.text import info_text
    from ..read.run import describe

    data = describe(run)
    click.echo(json.dumps(data, indent=2) if fmt == "json" else info_text(data))


@main.command()
@click.argument("run", type=click.Path(path_type=str, readable=False))
@library_errors
def migrate(run: str) -> None:
    """Rewrite a run's segments of run schema version 1 in the current version, in place, so that
    every supported pyarrow reads them (reading version 1 needs pyarrow >= 26)."""
    from ..read.migrate import migrate_run
    from ..run_file.schema import SCHEMA_VERSION

    done = migrate_run(run)
    click.echo(f"Converted {len(done.converted)} segment(s) of {run} to run schema version {SCHEMA_VERSION}; "
               f"{done.current} already were.")
    for name in done.skipped:
        click.echo(f"Left alone: {name}", err=True)


def _emit(text: str, output: str | None) -> None:
    """Print ``text``, or write it to ``output`` (a library error if the path is unwritable)."""
    if output is None:
        click.echo(text)
        return
    try:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(text if text.endswith("\n") else text + "\n")
    except OSError as exc:
        raise CliError(f"{output}: cannot write ({exc.strerror})") from None
    click.echo(f"Wrote {output}", err=True)


output_option = click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=str), default=None,
                             help="Write to this file instead of standard output.")


def _color() -> bool:
    return sys.stdout.isatty()


@main.command()
@run_argument
@output_format("text", "md", "json", "html")
@click.option("--top", type=click.IntRange(min=1), default=15, show_default=True,
              help="Layers shown in the text table.")
@output_option
@library_errors
def report(run: Run, fmt: str, top: int, output: str | None) -> None:
    """What happened to the loss scale, which layers underflow or lack headroom, where overflows
    came from, and which GradScaler settings to use instead."""
    _emit(_command("report", run, fmt=fmt, color=output is None and _color(), top=top), output)


@main.command()
@run_argument
@click.option("--init-scale", type=Scale(), default=None,
              help="A number or a power of two such as 2**16 [default: the run's own, or 2**16 for a run "
                   "without loss scaling]")
@click.option("--growth-factor", type=click.FloatRange(min=1, min_open=True), default=None,
              help="Factor by which the scale grows after a growth interval without overflow "
                   "[default: the run's own, else 2.0].")
@click.option("--backoff-factor", type=click.FloatRange(min=0, max=1, min_open=True, max_open=True), default=None,
              help="Factor by which the scale shrinks on a step that overflows "
                   "[default: the run's own, else 0.5].")
@click.option("--growth-interval", type=click.IntRange(min=1), default=None,
              help="Steps in a row without overflow before the scale grows [default: the run's own, else 2000].")
@click.option("--hysteresis", type=click.IntRange(min=1), default=None,
              help="Overflows in a row before backing off (Megatron/DeepSpeed) [default: 1, as torch].")
@click.option("--min-scale", type=Scale(allow_zero=True), default=None,
              help="Lowest scale a backoff may reach, a number or a power of two (Megatron/DeepSpeed's "
                   "min_loss_scale) [default: 0, no bound, as torch].")
@click.option("--max-scale", type=Scale(), default=None,
              help="Highest scale growth may reach, a number or a power of two [default: no bound, as torch].")
@output_format("text", "md", "json")
@output_option
@library_errors
def simulate(run: Run, fmt: str, output: str | None, **settings) -> None:
    """Replay GradScaler settings on the recorded gradients: predicted skipped steps, scale and
    underflow, next to what the run actually did."""
    # Imported outside the try: a dependency's import error is not a setting torch cannot hold.
    simulate_data = COMMANDS["simulate"].analysis_function()
    try:
        data = simulate_data(run, **settings)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    _emit(COMMANDS["simulate"].render(data, fmt), output)


@main.command()
@run_argument
@click.option("--sort", type=click.Choice(["underflow", "headroom", "amax"]), default="underflow",
              show_default=True)
@click.option("--top", type=click.IntRange(min=1), default=None, help="Only the first N layers.")
@output_format("text", "md", "json")
@output_option
@library_errors
def layers(run: Run, sort: str, top: int | None, fmt: str, output: str | None) -> None:
    """The per-layer table: underflow, zero and subnormal rates, headroom, amax and amin."""
    _emit(_command("layers", run, analysis={"sort": sort, "top": top}, fmt=fmt), output)


@main.command()
@run_argument
@output_format("text", "md", "json", "html")
@output_option
@library_errors
def postmortem(run: Run, fmt: str, output: str | None) -> None:
    """Why the loss (or the parameters) went non-finite: the first event, its cause and origin,
    the steps that led there, and what to change. Exit 0 either way; `status` says which."""
    _emit(_command("postmortem", run, fmt=fmt, color=output is None and _color()), output)


@main.command()
@run_argument
@output_format("text", "md", "json", "html")
@click.option("--flush-limit", type=click.FloatRange(min=0, max=1, min_open=True, max_open=True), default=0.01,
              show_default=True, help="Keep a layer out of FP8 when current scaling flushes or saturates more than "
                                      "this share of an operand's nonzero elements at a sampled step.")
@click.option("--top", type=click.IntRange(min=1), default=6, show_default=True,
              help="Rows of the delayed-scaling table in text and Markdown (the layers to keep first, then "
                   "the operands that need the longest history).")
@click.option("--te-config", type=click.Path(dir_okay=False, path_type=str), default=None, metavar="FILE",
              help="Also write TransformerEngine's debug API config (YAML) that keeps the layers to keep "
                   "out of the recipe (--recipe).")
@click.option("--recipe", type=click.Choice(TE_RECIPES), default=None,
              help="With --te-config: the recipe whose layers to keep it keeps out: tensorwise FP8 (the default), "
                   "or a block format TransformerEngine has (MXFP8BlockScaling with E4M3 or HYBRID, "
                   "NVFP4BlockScaling).")
@output_option
@library_errors
def fp8(run: Run, fmt: str, flush_limit: float, top: int, te_config: str | None, recipe: str | None,
        output: str | None) -> None:
    """FP8 readiness: which GEMM layers (Linear) can train in FP8 with TransformerEngine or torchao,
    which to keep in the AMP dtype and why, and the shortest amax history for delayed scaling; and
    per block format (MXFP8, MXFP4, NVFP4) which layers to keep out of it. Needs a run recorded
    with level='full' and model=."""
    if recipe is not None and te_config is None:
        raise click.UsageError("--recipe chooses what --te-config writes: give --te-config FILE too")
    recipe = recipe or "fp8"
    command = COMMANDS["fp8"]
    data = command.analyse(run, flush_limit=flush_limit)
    if te_config is not None:
        _write_te_config(_te_config_of(data, recipe), te_config, recipe)
    _emit(command.render(data, fmt, color=output is None and _color(), top=top), output)


def _te_config_of(data: dict, recipe: str) -> str | None:
    """The config of ``recipe`` in ``data``; CliError where the run cannot say for a block format."""
    if recipe == "fp8":
        return data.get("te_debug_config")
    blocks = data.get("block_formats") or {}
    if not blocks.get("assessed"):
        raise CliError(f"--recipe {recipe}: block formats are not assessed on this run: {blocks.get('why_not')}")
    found = [r for r in blocks.get("recipes") or [] if r.get("name") == recipe]
    if not found:
        raise CliError(f"--recipe {recipe}: the run's analysis has no such recipe")
    return found[0].get("te_debug_config")


def _write_te_config(config: str | None, path: str, recipe: str = "fp8") -> None:
    """``fp8 --te-config``: the config, or a word that there is nothing to keep out."""
    if config is None:
        click.echo(f"Nothing to keep out of {'FP8' if recipe == 'fp8' else recipe}: {path} not written"
                   + (" (the one there is left as it was)" if os.path.exists(path) else ""), err=True)
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(config)
    except OSError as exc:
        raise CliError(f"{path}: cannot write ({exc.strerror})") from None
    click.echo(f"Wrote {path}", err=True)


@main.command()
@click.argument("run_a", type=click.Path(path_type=str, readable=False))
@click.argument("run_b", type=click.Path(path_type=str, readable=False))
@click.option("--run-a", "run_id_a", metavar="ID", default=None,
              help="Which run of RUN_A's directory (a run id or its prefix) [default: the latest]")
@click.option("--run-b", "run_id_b", metavar="ID", default=None,
              help="Which run of RUN_B's directory [default: the latest]")
@output_format("text", "md", "json", "html")
@click.option("--top", type=click.IntRange(min=1), default=15, show_default=True,
              help="Layers shown in the text table.")
@output_option
@library_errors
def compare(run_a: str, run_b: str, run_id_a: str | None, run_id_b: str | None, fmt: str, top: int,
            output: str | None) -> None:
    """Two runs side by side: skipped steps, loss scale, underflow, per-layer changes, and, when RUN_B
    used the settings RUN_A's report recommended, whether its prediction held."""
    from ..read.run import read_run

    runs = read_run(run_a, run_id_a), read_run(run_b, run_id_b)  # both paths checked before any analysis
    _emit(_command("compare", *runs, fmt=fmt, color=output is None and _color(), top=top), output)


@main.command()
@run_argument
@click.option("--tensorboard", "logdir", required=True, metavar="DIR",
              type=click.Path(file_okay=False, path_type=str),
              help="Write TensorBoard event files here, one subdirectory per rank (rank0, rank1, ...).")
@output_format("text", "json")
@library_errors
def export(run: Run, logdir: str, fmt: str) -> None:
    """Export a run to TensorBoard: scale, skipped steps, loss and gradient norm per step; per layer
    the binade histograms and underflow rates of the sampled steps. Needs the tensorboard extra."""
    import shlex

    from ..export.tensorboard import export_tensorboard

    written = export_tensorboard(run, logdir)
    if fmt == "json":
        click.echo(json.dumps(written, indent=2))
        return
    for rank in written["ranks"]:
        click.echo(f"rank {rank['rank']}: {rank['steps']} steps, {rank['scalars']} scalar points, "
                   f"{rank['histograms']} histograms -> {rank['dir']}")
    for warning in written["warnings"]:  # segments skipped: steps the event files do not hold
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"View with:\n  tensorboard --logdir {shlex.quote(logdir)}")


class WatchTimeout(click.ClickException):
    """``watch`` gave up waiting: exit 3, apart from bad input (2)."""

    exit_code = 3


@main.command()
@click.argument("run", type=click.Path(path_type=str, readable=False))
@click.option("--run", "run_id", metavar="ID", default=None,
              help="Which run of the directory (a run id or its prefix) [default: the latest when first seen]")
@click.option("--interval", metavar="SECONDS", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="Seconds between two looks at the run.")
@click.option("--timeout", metavar="SECONDS", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Give up after this many seconds, exit 3 [default: wait until the run ends].")
@output_format("text", "json")
@library_errors
def watch(run: str, run_id: str | None, interval: float, timeout: float | None, fmt: str) -> None:
    """Follow a run while another process writes it: a line per poll with new steps (latest step,
    scale, skipped steps so far, loss, anomalous steps); exit 0 once every writer has closed the run.
    Waits for a run that does not exist yet."""
    from ..render import watch as lines
    from ..read.watch import TimedOut, follow

    first, said_waiting = True, False
    try:
        for progress in follow(run, run_id, interval=interval, timeout=timeout):
            if progress is None:
                if not said_waiting:
                    click.echo(lines.waiting_line(run), err=True)
                    said_waiting = True
                continue
            if first:
                click.echo(lines.following_line(progress), err=True)
                first = False
            for warning in progress.warnings:
                click.echo(f"Warning: {warning}", err=True)
            if progress.new_steps:
                click.echo(lines.json_line(progress, "progress") if fmt == "json" else lines.progress_line(progress))
            if progress.ended:
                click.echo(lines.json_line(progress, "ended") if fmt == "json" else lines.ended_line(progress))
    except TimedOut as exc:
        raise WatchTimeout(lines.timeout_message(run, timeout, exc.last)) from None


def _demo_help() -> str:
    """The command's help, listing SCENARIOS (so that it cannot go stale); \b keeps the list's lines."""
    names = "\n".join(f"  {name:<10} {s.description}" for name, s in SCENARIOS.items())
    return ("Train a small transformer with fp16 AMP on synthetic data and record a run: healthy, or with "
            "one problem for `ampdoctor report` (or `postmortem`, or `fp8`) to explain. Scenarios:\n\n\b\n" + names)


@main.command(help=_demo_help())
@click.option("--scenario", type=click.Choice(list(SCENARIOS)), default="healthy", show_default=True,
              help="What the run shows (listed above).")
@click.option("--out", "path", default=DEFAULT_PATH, show_default=True,
              type=click.Path(path_type=str), help="Run directory to write (replaces a demo run already there).")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help=f"Training steps [default: {CPU_STEPS} on the CPU, {CUDA_STEPS} on CUDA].")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--report", "show_report", is_flag=True,
              help="Then print what explains the run: the report (for --scenario nan, the postmortem; for fp8, "
                   "ampdoctor fp8).")
@click.option("--settings-from", "settings_from", metavar="RUN", type=click.Path(path_type=str, readable=False),
              default=None, help="Train with the GradScaler settings RUN's report recommends (then check them with "
                                 "`ampdoctor compare RUN OUT`); the options below override single settings.")
@click.option("--init-scale", type=Scale(), default=None,
              help="GradScaler init_scale, a number or a power of two such as 2**16 [default: the scenario's].")
@click.option("--growth-factor", type=click.FloatRange(min=1, min_open=True), default=None,
              help="GradScaler growth_factor [default: the scenario's, 2].")
@click.option("--backoff-factor", type=click.FloatRange(min=0, max=1, min_open=True, max_open=True), default=None,
              help="GradScaler backoff_factor [default: the scenario's, 0.5].")
@click.option("--growth-interval", type=click.IntRange(min=1), default=None,
              help="GradScaler growth_interval [default: the scenario's].")
@library_errors
def demo(scenario: str, path: str, steps: int | None, device: str, seed: int, show_report: bool,
         settings_from: str | None, **overrides) -> None:
    from .demo import StepTimer, clear_previous_run, default_steps, recommended_settings, resolve_device, run_demo

    explained_by = SCENARIOS[scenario].explained_by
    device = resolve_device(device)
    clear_previous_run(path)  # run_demo does too; here, to refuse a bad --out before training starts
    settings = {**(recommended_settings(settings_from) if settings_from else {}),
                **{k: v for k, v in overrides.items() if v is not None}}
    click.echo(f"Scenario {scenario}: {SCENARIOS[scenario].description}.")
    if settings:
        from ..render.formatting import setting
        given = ", ".join(f"{k}={setting(k, v)}" for k, v in settings.items())
        click.echo(f"Scaler settings: {given}" + (f" (recommended by {settings_from})" if settings_from else "") + ".")
    total = steps or default_steps(device)
    timer = StepTimer(total)  # click's own ETA averages from the start, warm-up included: far too long
    with click.progressbar(length=total, label="training", file=sys.stderr, show_eta=False,
                           item_show_func=lambda eta: eta) as bar:
        def progress(n: int) -> None:
            timer.advance(n)
            bar.update(n, timer.eta())

        result = run_demo(path, scenario=scenario, steps=steps, device=device, seed=seed, progress=progress,
                          **settings)
    fault = f" (weight blown up at step {result.fault_step})" if result.fault_step is not None else ""
    click.echo(f"Trained {result.steps} steps on {result.device}{fault}: final loss {result.final_loss:.3f}, "
               f"final scale {result.final_scale:g}.")
    if not show_report:
        click.echo(f"Wrote {result.path}. Read it with:\n  ampdoctor {explained_by} {result.path}")
        if settings_from:
            click.echo(f"Check the recommendation with:\n  ampdoctor compare {settings_from} {result.path}")
        return
    from ..read.run import read_run

    text = _command(explained_by if explained_by in ("postmortem", "fp8") else "report", read_run(result.path),
                    fmt="text", color=_color())
    click.echo(f"Wrote {result.path}.\n")
    click.echo(text)
