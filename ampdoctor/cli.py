"""The ``ampdoctor`` command: thin wrappers over the library. Library errors become one-line
messages with exit code 2 here, and only here."""

from __future__ import annotations

import functools
import json
import sys

import click

from . import __version__
from .errors import AmpdoctorError


class CliError(click.ClickException):
    exit_code = 2


def library_errors(fn):
    """Turn an :class:`AmpdoctorError` into a one-line CLI error (exit 2)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except AmpdoctorError as exc:
            raise CliError(str(exc)) from None

    return run


def output_format(*choices: str):
    return click.option("--format", "fmt", type=click.Choice(choices), default=choices[0],
                        show_default=True, help="Output format.")


run_argument = click.argument("run", type=click.Path(path_type=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ampdoctor")
def main() -> None:
    """Diagnose PyTorch automatic mixed precision runs recorded by ampdoctor."""


@main.command()
@run_argument
@output_format("text", "json")
@library_errors
def info(run: str, fmt: str) -> None:
    """Summarise a run: steps, ranks, tensors, schema, size, clean end."""
    from .reports.render_text import info_text
    from .run import describe, read_run

    data = describe(read_run(run))
    click.echo(json.dumps(data, indent=2) if fmt == "json" else info_text(data))


@main.command()
@click.option("--out", "path", default="ampdoctor-demo.parquet", show_default=True,
              type=click.Path(path_type=str), help="Run directory to write.")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Training steps [default: 150 on the CPU, 500 on CUDA].")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@library_errors
def demo(path: str, steps: int | None, device: str, seed: int) -> None:
    """Train a small transformer with fp16 AMP on synthetic data and record a run."""
    import os
    import shutil

    from .demo import run_demo

    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise CliError("--device cuda: CUDA is not available on this machine")
    if os.path.isdir(path):
        shutil.rmtree(path)  # the demo owns its output; a stale run would mix two runs
    total = steps or (150 if device == "cpu" or not _cuda() else 500)
    with click.progressbar(length=total, label="training", file=sys.stderr) as bar:
        result = run_demo(path, steps=steps, device=None if device == "auto" else device,
                          seed=seed, progress=bar.update)
    click.echo(f"Trained {result.steps} steps on {result.device}: final loss {result.final_loss:.3f}, "
               f"final scale {result.final_scale:g}.")
    click.echo(f"Wrote {result.path}. Look at it with:\n  ampdoctor info {result.path}")


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


if __name__ == "__main__":  # pragma: no cover
    main()
