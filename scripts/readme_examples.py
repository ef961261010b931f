"""Regenerate (or check) the example outputs in README.md.

Each example in the README sits between two markers, with the command that produced it:

    <!-- example: ampdoctor demo --scenario overflow --report -->
    ```text
    ...the command's standard output...
    ```
    <!-- /example -->

The command runs with bash in a fresh temporary directory (so runs it writes never mix with
others), with this checkout's package first on the path, and its standard output replaces the
block. ``--check`` changes nothing and exits 1, naming the stale examples, when any output
differs: CI runs it (``tests/test_readme.py``), so the README cannot show output that the code no
longer produces.

Training on the CPU is deterministic for one torch build and CPU instruction set (the demo
trains on one thread), not across them (kernels round differently). The README records where its examples were
generated (``<!-- examples generated with: ... -->``); elsewhere the check compares the outputs
with every number masked, so the words, layout and structure are still checked.

    python scripts/readme_examples.py           # rewrite README.md
    python scripts/readme_examples.py --check   # exit 1 if an example is stale
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
EXAMPLE = re.compile(r"<!-- example: (?P<command>.+?) -->\n```text\n(?P<output>.*?)```\n<!-- /example -->", re.S)
GENERATED = re.compile(r"<!-- examples generated with: (?P<where>.*?) -->")
NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[+-]?\d+)?")
TIMEOUT = 600  # seconds per example command


@dataclass
class Example:
    command: str
    recorded: str
    span: tuple[int, int]


def examples(text: str) -> list[Example]:
    return [Example(m["command"], m["output"], m.span("output")) for m in EXAMPLE.finditer(text)]


def environment() -> str:
    """What makes the demo's CPU training reproducible: the torch build and the instruction set."""
    import torch

    return f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}"  # the demo uses 1 thread


def same_output(recorded: str, fresh: str, exact: bool) -> bool:
    return recorded == fresh if exact else NUMBER.sub("#", recorded) == NUMBER.sub("#", fresh)


def exact_here(text: str) -> bool:
    """Whether this machine is where the README's examples were generated."""
    m = GENERATED.search(text)
    return m is not None and m["where"] == environment()


def run_example(command: str) -> str:
    """The standard output of ``command`` run with bash in a fresh directory (no colour: not a
    terminal), this checkout's package and interpreter first. A failing command is an error."""
    with tempfile.TemporaryDirectory(prefix="ampdoctor-example-") as cwd:
        env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1",
               "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"example command failed ({done.returncode}): {command}\n{done.stderr[-2000:]}")
    out = done.stdout
    return out if out.endswith("\n") else out + "\n"


def refresh(text: str) -> tuple[str, list[str]]:
    """``text`` with every example's output regenerated and marked as generated here, and the
    commands whose output changed (numbers masked when the README was generated elsewhere)."""
    exact = exact_here(text)
    stale, pieces, last = [], [], 0
    for ex in examples(text):
        fresh = run_example(ex.command)
        if not same_output(ex.recorded, fresh, exact):
            stale.append(ex.command)
            sys.stderr.writelines(difflib.unified_diff(ex.recorded.splitlines(True), fresh.splitlines(True),
                                                       f"README: {ex.command}", "now"))
        pieces += [text[last:ex.span[0]], fresh]
        last = ex.span[1]
    pieces.append(text[last:])
    marker = f"<!-- examples generated with: {environment()} -->"
    return GENERATED.sub(lambda _: marker, "".join(pieces)), stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if an example is stale")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    text = args.readme.read_text(encoding="utf-8")
    if not examples(text):
        print(f"{args.readme}: no examples found", file=sys.stderr)
        return 1
    new, stale = refresh(text)
    if args.check:
        if stale:
            print(f"stale README examples (run python scripts/readme_examples.py): {stale}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        args.readme.write_text(new, encoding="utf-8")
    print(f"{len(examples(text))} examples, {len(stale)} updated", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
