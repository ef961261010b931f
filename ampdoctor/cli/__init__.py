"""The ``ampdoctor`` command: ``commands`` (the click group and its commands, thin over the
library), ``demo`` (``ampdoctor demo``: a short recorded training run) and ``scenarios`` (the
demo's built-in faults)."""

from .commands import main

__all__ = ["main"]
