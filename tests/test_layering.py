"""The package's layering (pyproject.toml, ``[tool.importlinter]``; docs/architecture.md), checked
with import-linter as CI runs it, and shown to catch what it forbids: an import planted in a copy
of the package breaks the contract it should. Also: every public name, and every import path the
README and docs/ give, still imports after the package was laid out in wings (issue 38)."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("importlinter", reason="import-linter is a test dependency (pip install -e '.[test]')")


def _lint(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with the project's configuration, on the package found first under ``root``."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, timeout=300)


def test_the_layering_contracts_hold():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "broken" in done.stdout and " 0 broken" in done.stdout


@pytest.mark.parametrize("module, planted, contract", [
    ("record/plan.py", "from ..read import run as _planted", "Recording never imports the reading side"),
    ("run_file/names.py", "import torch as _planted", "The run file imports neither wing, nor torch"),
    ("analysis/steps.py", "from ..render import formatting as _planted", "Analyses never import renderers"),
    ("read/watch.py", "from ..record import writer as _planted", "Reading a run needs no torch and no recorder"),
    ("record/transfer.py", "from . import recorder as _planted", "No import circle"),
    ("run_file/fine_bins.py", "from .. import float_formats as _fine, errors as _planted", None),
    ("analysis/origins.py", "from .. import commands as _planted", "two wings over the run file"),
    ("render/formatting.py", "from ..read import run as _planted", "Renderers are functions of data"),
    ("integrations/lightning.py", "from ..analysis import report as _planted", "Recording never imports"),
])
def test_a_planted_import_breaks_its_contract(tmp_path, module, planted, contract):
    shutil.copytree(ROOT / "ampdoctor", tmp_path / "ampdoctor", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "ampdoctor" / module
    text = target.read_text()
    # after the module's imports (its docstring stays first)
    at = text.index("from __future__ import annotations\n") + len("from __future__ import annotations\n")
    target.write_text(text[:at] + planted + "\n" + text[at:])
    done = _lint(tmp_path)
    if contract is None:  # an allowed import (the shared modules sit below the run file): still kept
        assert done.returncode == 0, done.stdout
        return
    assert done.returncode != 0
    broken = [line for line in done.stdout.splitlines() if line.rstrip().endswith("BROKEN")]
    assert any(contract in line for line in broken), done.stdout


PUBLIC = ["GradScaler", "wrap", "unwrap", "load", "read_run", "Run", "find_origins", "report", "postmortem", "compare",
          "simulate", "layers", "fp8", "AmpdoctorError", "RecorderError", "RunError", "__version__"]


def test_every_public_name_imports_from_the_package_root():
    import ampdoctor
    assert sorted(ampdoctor.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(ampdoctor, name) is not None, name


def _documented_paths() -> set[tuple[str, str]]:
    """(module, name) of every ``from ampdoctor.X import Y`` and dotted ``ampdoctor.X.Y`` reference in
    the README and docs/ (code spans and code blocks)."""
    found = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for module, names in re.findall(r"from (ampdoctor(?:\.\w+)+) import ([\w, ]+)", text):
            found.update((module, n.strip()) for n in names.split(",") if n.strip())
        for dotted in re.findall(r"`(ampdoctor(?:\.\w+){2,})`", text):
            module, _, name = dotted.rpartition(".")
            found.add((module, name))
    return found


def test_every_documented_import_path_works():
    paths = _documented_paths()
    assert ("ampdoctor.integrations.lightning", "AmpdoctorCallback") in paths  # the scan finds what it should
    for module, name in sorted(paths):
        if module.startswith("ampdoctor.integrations."):
            pytest.importorskip({"lightning": "lightning", "accelerate": "accelerate",
                                 "transformers": "transformers"}[module.rsplit(".", 1)[1]])
        try:
            imported = importlib.import_module(module)
        except ModuleNotFoundError:
            # a dotted reference to an attribute of an attribute (ampdoctor.GradScaler.state_dict)
            parent, _, attribute = module.rpartition(".")
            imported = getattr(importlib.import_module(parent), attribute)
        if not hasattr(imported, name) and isinstance(imported, types.ModuleType):
            # (a submodule is an attribute of its package once imported: run alone, nothing has)
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                pass
        assert hasattr(imported, name), f"{module}.{name} is documented but does not exist"


# The import paths the README and docs/ gave before the package was laid out in wings (commit
# a1ee0ab), for users' code: they must keep working. (``ampdoctor.writer.EXIT_SECONDS`` was cited
# as the source of a figure, not as an API: a re-export would not even serve the one use it could
# have, patching the bound; the docs now name ``ampdoctor.record.writer.EXIT_SECONDS``.)
DOCUMENTED_BEFORE = [("ampdoctor.integrations.transformers", "AmpdoctorCallback"),
                     ("ampdoctor.integrations.lightning", "AmpdoctorCallback"),
                     ("ampdoctor.integrations.accelerate", "instrument"),
                     ("ampdoctor.dependencies", "DependencyError"), ("ampdoctor.stats", "full_stats"),
                     ("ampdoctor.stats", "algorithm_for"), ("ampdoctor.stats", "ALGORITHMS")]


@pytest.mark.parametrize("module, name", DOCUMENTED_BEFORE)
def test_the_import_paths_documented_before_the_wings_still_work(module, name):
    if module.startswith("ampdoctor.integrations."):
        pytest.importorskip(module.rsplit(".", 1)[1])
    assert hasattr(importlib.import_module(module), name)


def test_every_command_pairs_an_analysis_with_a_renderer():
    """``commands.COMMANDS`` names its analyses and renderers by strings (loaded on first use), which
    import-linter cannot follow: each must resolve, an analysis in ``analysis/`` and a renderer in
    ``render/``, and the CLI must offer every command."""
    from click.testing import CliRunner

    from ampdoctor.cli.commands import main
    from ampdoctor.commands import COMMANDS
    assert sorted(COMMANDS) == ["compare", "fp8", "layers", "postmortem", "report", "simulate"]
    for name, command in COMMANDS.items():
        assert command.analysis.startswith("analysis.") and command.renderer.startswith("render"), name
        assert callable(command.analysis_function())
        assert CliRunner().invoke(main, [name, "--help"]).exit_code == 0, name
