"""The README's promises, run as a newcomer would: the quick start in a clean virtual environment,
and every example output of the README and the docs/ pages regenerated from its command
(``scripts/readme_examples.py``); and the documentation's links and metadata keys against the
repository and the code."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
sys.path.insert(0, str(ROOT / "scripts"))
import readme_examples  # noqa: E402

QUICK_RUN = "ampdoctor demo && ampdoctor report ampdoctor-demo.parquet"


def quick_start() -> list[str]:
    """The bash blocks of the README's "Quick start" section: [run the demo, run the tests]."""
    section = README.read_text(encoding="utf-8").split("\n## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_quick_start_has_the_two_documented_commands():
    run, tests = quick_start()
    assert run.endswith(QUICK_RUN) and 'pip install torch==2.13.0' in run and "pip install -e ." in run
    assert tests.endswith("python3 -m pytest") and 'pip install -e ".[test]"' in tests
    # CI runs the same test command (.ci/run spells the same steps one per line).
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]"' in ci and "python3 -m pytest" in ci and "torch==2.13.0" in ci


def test_readme_examples_are_what_the_commands_print():
    """Every example of the README and of the docs/ pages (the script's own check, which also holds
    each page with examples to one provenance line)."""
    found = readme_examples.examples(README.read_text(encoding="utf-8"))
    assert {ex.command for ex in found} >= {QUICK_RUN}, "the quick start's output is not shown"
    checked = readme_examples.pages()
    assert README in checked and ROOT / "docs" / "guide.md" in checked and ROOT / "docs" / "fp8.md" in checked
    stale = readme_examples.check(checked)
    assert not stale, f"stale examples (run python scripts/readme_examples.py): {stale}"


def test_every_page_with_examples_is_checked_and_says_where_they_were_generated():
    """A docs/ page that holds an example is among the checked pages, and every checked page
    carries exactly one provenance line (cheap: runs no command)."""
    with_examples = {page for page in (ROOT / "docs").glob("*.md")
                     if readme_examples.examples(page.read_text(encoding="utf-8"))}
    assert with_examples and with_examples <= set(readme_examples.pages())
    for page in readme_examples.pages():
        text = page.read_text(encoding="utf-8")
        assert readme_examples.provenance_problem(text, page.name) is None
    assert readme_examples.provenance_problem("<!-- example: x -->\n```text\ny\n```\n<!-- /example -->\n", "p")


# -- the check's tolerances: another CPU's rounding passes, a real change does not ------------------

SHOWN = """\
Trained 150 steps on cpu: final loss 0.303, final scale 65536.
  initial 2**16, final 2**16, range 2**16..2**16; 0 skipped (0)

Layers (worst underflow first)
  layer                           kind        underflow  at most     zero  subnorm headroom     amax
  head.weight                     param_grad          0        0        0        0     +3.6   0.0804
  ln_f.weight                     param_grad          0        0        0        0     +4.0   0.0646
  blocks.0.qkv.bias               param_grad          0        0        0        0     +4.0   0.0641
  blocks.1.qkv.weight             param_grad          0        0        0        0     +4.9   0.0343
  blocks.0.ln2.bias               param_grad          0        0        0        0     +4.9   0.0342
  blocks.0.mlp.2.weight (Linear)  param_grad          0        0        0        0     +4.9    0.034
  … 14 more (ampdoctor layers ampdoctor-demo.parquet --top N)

Recommendation
  Keep the current scaler settings.
  skipped steps     17 (11.3%)               0 (0)                    -17
"""


def _edit(old: str, new: str, text: str = SHOWN) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def test_another_cpus_rounding_is_the_same_output():
    """What a Xeon with oneDNN's fp16 matmul printed against what the README's machine printed: a
    digit of an amax, a bias's subnormal share (0.521% against 0), a column widened by a digit."""
    assert readme_examples.same_output(SHOWN, SHOWN)
    fresh = _edit("0        0     +4.0   0.0641", "0   0.521%     +4.0   0.0641")
    fresh = _edit("+4.9    0.034", "+4.9   0.0341", fresh)
    fresh = _edit("loss 0.303", "loss 0.304", fresh)
    fresh = _edit("+3.6   0.0804", "+3.7   0.0790", fresh)  # a unit of the last digit; under 5%
    assert readme_examples.differences(SHOWN, fresh) == []
    # Rows whose numbers tie up to rounding may trade places (a table sorted on them).
    lines = SHOWN.splitlines(True)
    i = next(n for n, line in enumerate(lines) if "blocks.1.qkv.weight" in line)
    assert "blocks.0.ln2.bias" in lines[i + 1]  # +4.9 0.0343, then +4.9 0.0342
    lines[i], lines[i + 1] = lines[i + 1], lines[i]
    ties = "".join(lines)
    assert readme_examples.same_output(SHOWN, ties)


@pytest.mark.parametrize("old, new", [
    ("Keep the current", "Change the"),                  # the verdict
    ("17 (11.3%)", "18 (12%)"),                          # a count of skipped steps
    ("final 2**16", "final 2**15"),                      # a scale: an exponent is a count
    ("65536.", "32768."),
    ("+3.6   0.0804", "+3.6   0.0900"),                  # a magnitude 12% off
    ("+3.6   0.0804", "+3.8   0.0804"),                  # headroom two units of its last digit off
    ("0        0     +4.0   0.0641", "0       2%     +4.0   0.0641"),  # a share 2 points off
    ("0        0     +4.0   0.0641", "0   <0.001%     +4.0   0.0641"),  # another word
    ("blocks.0.qkv.bias  ", "blocks.1.qkv.bias  "),      # another layer
    ("\nRecommendation\n", "\n"),                        # a missing line
])
def test_a_real_change_is_stale(old, new):
    assert not readme_examples.same_output(SHOWN, _edit(old, new))


def test_binades_compare_by_their_last_digit_and_sign():
    """Headroom and exponents (``about 2**16.0``) within one unit of their last digit, never across
    0; shares within 0.6 points ("underflow rate 0.9% instead of 0" is a change)."""
    parse, close = readme_examples.Number.parse, readme_examples.close
    line = readme_examples.Line.parse
    assert line("reaches about 2**16.0 (from").matches(line("reaches about 2**16.1 (from"))
    assert not line("reaches about 2**16.0 (from").matches(line("reaches about 2**16.8 (from"))
    assert close(parse("+0.0"), parse("+0.1")) and not close(parse("+0.0"), parse("-0.1"))  # -: it overflowed
    assert close(parse("16.0", exponent_of=True), parse("16.1", exponent_of=True))
    assert not close(parse("16.0", exponent_of=True), parse("16.8", exponent_of=True))   # 5% would pass it
    assert close(parse("0"), parse("0.521%")) and not close(parse("0"), parse("0.9%"))
    assert close(parse("11.3%"), parse("11.8%"))  # within 5% of itself


def test_a_tied_row_may_take_the_last_place_of_a_cut_table():
    """Rows 15 and 16 of the quick start's layer table differ by 4% in amax: on another CPU the 16th
    may be shown in the 15th's place, the other cut ("… 14 more"). A row that does not tie may not."""
    last = "  blocks.0.mlp.2.weight (Linear)  param_grad          0        0        0        0     +4.9    0.034\n"
    tied = "  blocks.1.ln1.bias               param_grad          0        0        0        0     +4.9   0.0329\n"
    other = "  blocks.1.ln1.bias               param_grad          0        0        0        0     +5.6   0.0205\n"
    assert readme_examples.same_output(SHOWN, _edit(last, tied))
    assert not readme_examples.same_output(SHOWN, _edit(last, other))


def test_rows_out_of_order_by_more_than_rounding_are_stale():
    head = "  head.weight                     param_grad          0        0        0        0     +3.6   0.0804\n"
    moved = _edit(head, "").replace("  … 14 more", head + "  … 14 more")
    problems = readme_examples.differences(SHOWN, moved)
    assert problems and "head.weight" in " ".join(problems)


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_readme_is_a_front_door_that_links_every_docs_page():
    """The README stays short (the rest lives under docs/), and it and the docs index link every
    page of docs/."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 400
    pages = {page.name for page in (ROOT / "docs").glob("*.md")} - {"README.md"}
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    for linked_from, prefix in [(text, "docs/"), (index, "")]:
        targets = {target.partition("#")[0] for target in LINK.findall(linked_from)}
        assert {f"{prefix}{name}" for name in pages} <= targets, sorted(pages - {t.removeprefix(prefix) for t in targets})


def _anchors(page: Path) -> set[str]:
    """The link targets a Markdown page offers: its headings as GitHub spells them, and explicit
    ``<a id="...">`` anchors (headings inside code blocks do not count)."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    headings = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", text, re.M)}
    return headings | set(re.findall(r'<a id="([^"]+)"', text))


def test_readme_and_docs_link_only_inside_the_repository():
    """Every link of the README and docs/ is a file of this repository (a clone holds all it needs)
    and every #anchor a heading of the page it names."""
    broken = []
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if re.match(r"[a-z]+:", target) or not dest.is_relative_to(ROOT) or not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_the_run_file_page_lists_the_metadata_keys_of_the_code():
    """docs/run-file.md's footer table names exactly ``schema.META_KEYS``."""
    from ampdoctor.run_file.schema import META_KEYS

    page = (ROOT / "docs" / "run-file.md").read_text(encoding="utf-8")
    table = page.split("\n## Footer metadata", 1)[1].split("\n## ", 1)[0]
    documented = {key for row in re.findall(r"^\| (.+?) \|", table, re.M) for key in re.findall(r"`([^`]+)`", row)}
    assert documented == set(META_KEYS)


def _copy_checkout(dest: Path) -> Path:
    """The project's files without build outputs or runs: what a fresh clone holds."""
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", "dist", "*.parquet",
                                    ".pytest_cache", ".hypothesis", "venv", ".venv")
    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


def test_quick_start_in_a_clean_venv(tmp_path):
    """The README's first command, verbatim, in a new virtual environment and a fresh copy of the
    project. The venv sees the machine's packages (torch is not downloaded again; pip keeps it,
    which is what the command's torch check is for) but not this checkout's install."""
    run, _ = quick_start()
    checkout = _copy_checkout(tmp_path / "checkout")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               COLUMNS="100", NO_COLOR="1")
    done = subprocess.run(["bash", "-c", run], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    installed = subprocess.run([str(venv / "bin" / "python"), "-c", "import ampdoctor; print(ampdoctor.__file__)"],
                               env=env, cwd=venv, capture_output=True, text=True, check=True).stdout
    assert Path(installed.strip()).is_relative_to(checkout), installed  # the venv's install, not ours
    assert (checkout / "ampdoctor-demo.parquet").is_dir()
    text = README.read_text(encoding="utf-8")
    shown = {ex.command: ex.recorded for ex in readme_examples.examples(text)}[QUICK_RUN]
    printed = "".join(done.stdout.splitlines(True)[-len(shown.splitlines()):])  # pip's output comes first
    assert readme_examples.same_output(shown, printed), (readme_examples.differences(shown, printed), printed)
