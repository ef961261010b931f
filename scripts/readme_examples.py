"""Regenerate (or check) the example outputs in README.md and the docs/ pages.

The pages checked are README.md and every ``docs/*.md`` page that holds an example (:func:`pages`):
the README keeps the quick start's, the pages under docs/ the others (``docs/guide.md``'s
``compare``, ``docs/fp8.md``'s ``fp8``). The same rules hold on every page. Each example sits
between two markers, with the command that produced it:

    <!-- example: ampdoctor demo --scenario overflow --report -->
    ```text
    ...the command's standard output...
    ```
    <!-- /example -->

The command runs with bash in a fresh temporary directory (so runs it writes never mix with
others) that links the checkout's ``docs/examples`` at ``docs/examples`` (so a command reads the
runs kept there by the same path from whichever page), with this checkout's package first on the
path, and its standard output replaces the block. ``--check`` changes nothing and exits 1, naming
the stale examples (``page: command``), when any output differs beyond another CPU's rounding
(below): CI runs it (``tests/test_readme.py``), so neither the README nor a docs/ page can show
output that the code no longer produces.

Training on the CPU is deterministic on one machine (the demo trains on one thread), not across
machines: fp16 kernels round differently from one CPU to the next, and torch does not name which
ones ran. Measured on one Xeon with AVX-512 FP16 and AMX: oneDNN's fp16 matmul (used where the CPU
has AVX-512 FP16 or AMX) and ATen's own (elsewhere) give different gradients, and ATen's AVX2 and
AVX-512 kernels differ again; all of these say ``AVX512`` or ``AVX2`` in
``torch.backends.cpu.get_cpu_capability()``, and the README's examples, generated on another
``AVX512`` machine, matched none of them. So the check never compares bits. An example is what its
command prints when, line for line (see :func:`same_output`):

* the words are the same (a run of spaces inside a line counts as one: a wider number shifts a
  column's padding, not its meaning);
* every number agrees up to the rounding of another CPU: integers (counts, steps, exponents such
  as the 16 of ``2**16``) exactly; numbers printed with a sign or as an exponent (headroom and other distances in
  binades: ``+4.0``, ``2**16.0``) within one unit of their last digit (0.1 binade, about 7% of a
  magnitude), never across 0 (a headroom turning negative is an overflow);
  other numbers (magnitudes, losses) within REL_TOLERANCE (5%) or one unit of their last digit,
  whichever is larger; percentages within PERCENT_POINTS (0.6 percentage points: one element of the smallest tensor
  shown) or 5%, a bare ``0``
  in a share's place being 0% (``0`` and ``0.521%`` agree; ``0`` and ``2%`` do not);
* lines keep their order, except table rows whose numbers all agree within those tolerances (a
  tie up to rounding), which may trade places: a row out of order by more than rounding is stale;
  the last row shown of a table cut by ``… N more`` may be another row that ties with it (the
  next one on the machine that generated the README, shown first by another CPU's rounding).

What the reader relies on, the verdicts, settings, skipped steps and the wording, is therefore
checked exactly; the measured magnitudes to the digit a CPU can change.

Provenance: every page that holds examples carries exactly one
``<!-- examples generated with: ... -->`` line, which says where that page's outputs were last
regenerated (:func:`environment`); rewriting a page regenerates all its outputs and its line, and
only its own. A page with examples and no such line (or more than one) fails both modes. The line
is a record, not a condition of the check.

    python scripts/readme_examples.py                    # rewrite README.md and the docs/ pages
    python scripts/readme_examples.py --check            # exit 1 if an example is stale
    python scripts/readme_examples.py docs/fp8.md        # only the pages named
"""

from __future__ import annotations

import argparse
import difflib
import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
EXAMPLE = re.compile(r"<!-- example: (?P<command>.+?) -->\n```text\n(?P<output>.*?)```\n<!-- /example -->", re.S)
GENERATED = re.compile(r"<!-- examples generated with: (?P<where>.*?) -->")
# A number as the renderers print it: ``150``, ``+4.0``, ``0.0384``, ``1.04858e+06``, ``0.521%``.
# Digits inside a name (``blocks.0.qkv``, ``float16``, ``part-r00000``) are words: not after a
# letter, a digit, or a letter and a dot. ``2**16..2**24`` holds the numbers 2, 16, 2, 24.
NUMBER = re.compile(r"(?<!\w)(?<!\w\.)[+-]?\d+(?:\.\d+)?(?:e[+-]?\d+)?%?(?!\w)")
REL_TOLERANCE = 0.05    # non-integers: relative, or one unit of the last printed digit if larger
# Percentages: absolute, as a fraction. One element of the smallest tensor in the demo's layer table
# (a bias of 192 elements) is 0.52 points: a CPU that rounds one element across the subnormal line
# moves a share by that much. Ten times the compare rule's "held" margin (0.1 points) would pass
# a real change; 0.6 points does not.
PERCENT_POINTS = 0.006
TIMEOUT = 600  # seconds per example command


@dataclass
class Example:
    command: str
    recorded: str
    span: tuple[int, int]


def examples(text: str) -> list[Example]:
    return [Example(m["command"], m["output"], m.span("output")) for m in EXAMPLE.finditer(text)]


def pages() -> list[Path]:
    """The pages whose examples are checked: README.md, then every ``docs/*.md`` page that holds an
    example, in name order."""
    docs = [page for page in sorted(DOCS.glob("*.md")) if examples(page.read_text(encoding="utf-8"))]
    return [README, *docs]


def page_name(page: Path) -> str:
    """``page`` as the messages name it: relative to the checkout where it lies inside it."""
    page = page.resolve()
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def provenance_problem(text: str, name: str) -> str | None:
    """Why the page ``name`` (its ``text``) breaks the provenance rule, if it does: a page with
    examples carries exactly one ``examples generated with`` line."""
    count = len(GENERATED.findall(text))
    if examples(text) and count != 1:
        return f"{name}: {count} '<!-- examples generated with: ... -->' lines (one per page with examples)"
    return None


def environment() -> str:
    """Where examples are regenerated, for the README's record: the torch build, the machine, ATen's
    kernel set and whose fp16 matmul runs (oneDNN's where the CPU has AVX-512 FP16 or AMX and
    ``ONEDNN_MAX_CPU_ISA`` allows them; else ATen's). Two machines with the same line may still
    round differently, which is why the check has tolerances and this line is no condition of it."""
    import torch

    try:
        onednn_fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN, or without this private op
        onednn_fp16 = False
    matmul = "oneDNN" if onednn_fp16 else "ATen"
    return (f"torch {torch.__version__}, {platform.machine()} {torch.backends.cpu.get_cpu_capability()}, "
            f"fp16 matmul by {matmul}")  # the demo trains on 1 thread


@dataclass(frozen=True)
class Number:
    """One printed number: its value (a percentage as a fraction), and how it was printed."""

    text: str
    value: float
    percent: bool
    integer: bool
    signed: bool  # printed with its sign (``+4.0``, ``-1.5``) or as an exponent (``2**16.0``): binades
    unit: float  # one unit of the last printed digit, in the units of ``value``

    @classmethod
    def parse(cls, text: str, exponent_of: bool = False) -> "Number":
        percent = text.endswith("%")
        digits = text.rstrip("%")
        mantissa, _, exponent = digits.lower().partition("e")
        decimals = len(mantissa.partition(".")[2])
        value = float(digits) / (100 if percent else 1)
        integer = not percent and "." not in mantissa and not exponent
        # A bare 0 is an exact zero (the renderers print nothing else so), not 0 rounded to units.
        unit = 0.0 if integer and value == 0 else 10.0 ** (int(exponent or 0) - decimals) / (100 if percent else 1)
        return cls(text, value, percent, integer=integer, signed=text[0] in "+-" or exponent_of, unit=unit)


def close(a: Number, b: Number) -> bool:
    """Whether two numbers printed in the same place agree up to another CPU's rounding (the
    module docstring's rules). ``percent()`` prints an exact zero share as a bare ``0``: beside a
    percentage it is 0%."""
    if a.percent or b.percent:
        allowed = max(PERCENT_POINTS, REL_TOLERANCE * max(abs(a.value), abs(b.value)))
        return abs(a.value - b.value) <= allowed * (1 + 1e-9)
    if a.integer and b.integer:
        return a.value == b.value
    if a.signed or b.signed:  # binades (headroom, a change of scale): logs, where "relative" means nothing
        if (a.value < 0) != (b.value < 0):  # a headroom turning negative is an overflow: never rounding
            return False
        return abs(a.value - b.value) <= max(a.unit, b.unit) * (1 + 1e-9)
    allowed = max(REL_TOLERANCE * max(abs(a.value), abs(b.value)), a.unit, b.unit)
    return abs(a.value - b.value) <= allowed * (1 + 1e-9)  # 1e-9: the decimal units are not exact in binary


@dataclass(frozen=True)
class Line:
    """A line of output as the check sees it: its words (numbers replaced by ``#``, inner runs of
    spaces as one, the indentation kept) and its numbers."""

    text: str
    words: str
    numbers: tuple[Number, ...]

    @classmethod
    def parse(cls, text: str) -> "Line":
        body = text.rstrip()
        indent = body[:len(body) - len(body.lstrip())]
        words = indent + " ".join(NUMBER.sub("#", body).split())
        numbers = tuple(Number.parse(m[0], exponent_of=body[:m.start()].endswith(("**", "^")))
                        for m in NUMBER.finditer(body))
        return cls(text, words, numbers)

    def matches(self, other: "Line") -> bool:
        """The same words, and every number close to its counterpart."""
        return self.words == other.words and all(close(a, b) for a, b in zip(self.numbers, other.numbers))

    def ties(self, other: "Line") -> bool:
        """Two table rows whose numbers all agree within the tolerances: which of them a table sorted
        on those numbers lists first is up to rounding. Lines with fewer than two numbers (prose,
        headings) never tie: their order is the output's structure."""
        return (len(self.numbers) >= 2 and len(self.numbers) == len(other.numbers)
                and all(close(a, b) for a, b in zip(self.numbers, other.numbers)))


def differences(recorded: str, fresh: str) -> list[str]:
    """Why ``fresh`` is not what ``recorded`` shows, up to the tolerances (empty: it is). Each line of
    ``fresh`` is paired with the first unpaired line of ``recorded`` it matches; lines paired out of
    order must tie."""
    old, new = [Line.parse(t) for t in recorded.splitlines()], [Line.parse(t) for t in fresh.splitlines()]
    if len(old) != len(new):
        return [f"{len(new)} lines instead of {len(old)}"]
    problems, paired, free = [], [], set(range(len(old)))
    for i, line in enumerate(new):
        j = next((j for j in sorted(free) if old[j].matches(line)), None)
        if j is None and i in free and i + 1 < len(new) and new[i + 1].text.lstrip().startswith("…") \
                and old[i].ties(line):
            # The last row shown of a cut table ("… N more"): a row that ties with it up to
            # rounding (the next one on the README's machine) may take its place on another CPU.
            j = i
        if j is None:
            problems.append(f"line {i + 1}: {line.text.strip()!r} instead of {old[i].text.strip()!r}")
            continue
        free.discard(j)
        paired.append(j)
    for a, j in enumerate(paired):
        for k in paired[a + 1:]:
            if k < j and not old[j].ties(old[k]):
                problems.append(f"{old[k].text.strip()!r} now comes after {old[j].text.strip()!r}, "
                                f"whose numbers differ by more than rounding")
    return problems


def same_output(recorded: str, fresh: str) -> bool:
    """Whether ``fresh`` is what ``recorded`` shows, up to another CPU's rounding."""
    return not differences(recorded, fresh)


def run_example(command: str) -> str:
    """The standard output of ``command`` run with bash in a fresh directory that links the
    checkout's ``docs/examples`` (no colour: not a terminal), this checkout's package and
    interpreter first. A failing command is an error."""
    with tempfile.TemporaryDirectory(prefix="ampdoctor-example-") as cwd:
        # The runs kept in the repository for examples whose training a CPU's rounding would change
        # (docs/examples), where a reader in the checkout finds them.
        os.makedirs(os.path.join(cwd, "docs"))
        os.symlink(ROOT / "docs" / "examples", os.path.join(cwd, "docs", "examples"))
        env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1",
               "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"example command failed ({done.returncode}): {command}\n{done.stderr[-2000:]}")
    out = done.stdout
    return out if out.endswith("\n") else out + "\n"


def refresh(text: str, name: str = "README.md") -> tuple[str, list[str]]:
    """``text`` (the page ``name``) with every example's output regenerated and marked as generated
    here, and the commands whose output changed beyond another CPU's rounding (:func:`same_output`)."""
    stale, pieces, last = [], [], 0
    for ex in examples(text):
        fresh = run_example(ex.command)
        problems = differences(ex.recorded, fresh)
        if problems:
            stale.append(ex.command)
            sys.stderr.writelines(difflib.unified_diff(ex.recorded.splitlines(True), fresh.splitlines(True),
                                                       f"{name}: {ex.command}", "now"))
            sys.stderr.writelines(f"  {p}\n" for p in problems)
        pieces += [text[last:ex.span[0]], fresh]
        last = ex.span[1]
    pieces.append(text[last:])
    marker = f"<!-- examples generated with: {environment()} -->"
    return GENERATED.sub(lambda _: marker, "".join(pieces)), stale


def check(paths: list[Path] | None = None) -> list[str]:
    """What is wrong with the examples of ``paths`` (default: :func:`pages`), changing nothing: each
    stale example as ``page: command``, a page with no example, a page that breaks the provenance
    rule. Empty: every example is what its command prints."""
    problems = []
    for page in paths or pages():
        text, name = page.read_text(encoding="utf-8"), page_name(page)
        if not examples(text):
            problems.append(f"{name}: no examples found")
            continue
        problems += filter(None, [provenance_problem(text, name)])
        problems += [f"{name}: {command}" for command in refresh(text, name)[1]]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if an example is stale")
    parser.add_argument("pages", type=Path, nargs="*",
                        help="the pages to regenerate or check (default: README.md and the docs/ pages with examples)")
    args = parser.parse_args(argv)
    paths = args.pages or pages()
    if args.check:
        problems = check(paths)
        if problems:
            print(f"examples to fix (a stale one: run python scripts/readme_examples.py): {problems}", file=sys.stderr)
            return 1
        return 0
    texts = {page: page.read_text(encoding="utf-8") for page in paths}
    problems = [f"{page_name(page)}: no examples found" for page, text in texts.items() if not examples(text)]
    problems += filter(None, (provenance_problem(text, page_name(page)) for page, text in texts.items()))
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    for page, text in texts.items():
        new, stale = refresh(text, page_name(page))
        if new != text:
            page.write_text(new, encoding="utf-8")
        print(f"{page_name(page)}: {len(examples(text))} examples, {len(stale)} updated", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
