"""Declared dependency floors against what the compatibility job installs, and the one line a user
gets when installed packages cannot work together (``ampdoctor/dependencies.py``). The real
broken environments are built and run in ``.ci/compat``; here the same paths are driven by
monkeypatched versions and imports."""

from __future__ import annotations

import builtins
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ampdoctor import dependencies
from ampdoctor.cli.commands import main

ROOT = Path(__file__).resolve().parent.parent

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None


def _release(version: str) -> tuple[int, ...]:
    parts = tuple(int(p) for p in version.split("."))
    return parts + (0,) * (3 - len(parts))


def _project() -> dict:
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_every_declared_floor_is_installed_exactly_by_the_compatibility_job():
    floors = {}
    for requirement in _project()["dependencies"]:
        name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement).groups()
        floors[name] = _release(version)
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([0-9.]+)$", (ROOT / ".ci" / "floors.txt").read_text(), re.M))
    assert set(floors) <= set(pins), f"floors without a pin in .ci/floors.txt: {set(floors) - set(pins)}"
    assert {name: _release(pins[name]) for name in floors} == floors
    assert set(floors) == set(dependencies.PACKAGES), "dependencies.PACKAGES names every declared package"
    # The floor environment runs on the oldest Python the project declares.
    assert re.fullmatch(r">=\s*3\.10", _project()["requires-python"])
    compat = (ROOT / ".ci" / "compat").read_text()
    assert "requires-python" in compat and "floors.txt" in compat and "floors-extras.txt" in compat


def test_every_extra_s_floor_is_installed_exactly_too():
    extras = {}
    for requirements in _project()["optional-dependencies"].values():
        for requirement in requirements:
            found = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement)
            if found:  # the test extra's exact pins (==) are what the main suite runs
                extras.setdefault(found[1], set()).add(_release(found[2]))
    assert all(len(v) == 1 for v in extras.values()), f"one floor per package across the extras: {extras}"
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([0-9.]+)$", (ROOT / ".ci" / "floors-extras.txt").read_text(), re.M))
    assert {name: _release(version) for name, version in pins.items()} == {k: v.pop() for k, v in extras.items()}
    assert "bash .ci/compat" in (ROOT / ".ci" / "run").read_text()


@pytest.fixture
def versions(monkeypatch):
    """Pretend these distributions are installed (None: not installed)."""
    def set_versions(**installed):
        monkeypatch.setattr(dependencies, "installed", lambda name: installed.get(name))
    return set_versions


@pytest.mark.parametrize("numpy, pyarrow, conflict", [
    ("1.26.4", "26.0.1", "pyarrow 26.0.1 needs numpy 2.x, not 1.26.4: pip install 'numpy>=2', or 'pyarrow<26'"),
    ("2.1.3", "15.0.2", "pyarrow 15.0.2 needs numpy 1.x, not 2.1.3: pip install 'pyarrow>=16', or 'numpy<2'"),
    ("2.4.6", "26.0.1", None), ("1.26.0", "14.0.1", None), ("1.26.4", "25.0.1", None), ("2.0.0", "16.0.0", None),
])
def test_the_known_numpy_pairs(versions, numpy, pyarrow, conflict):
    versions(numpy=numpy, pyarrow=pyarrow)
    assert dependencies.conflicts() == ([conflict] if conflict else [])


def test_a_failed_import_says_what_to_change(versions):
    versions(numpy="1.26.4", pyarrow="26.0.1", pandas="2.2.3", torch="2.13.0")
    message = dependencies.import_problem(ImportError("pyarrow requires NumPy 2.0 or newer, found 1.26.4"))
    assert message == ("a package ampdoctor needs failed to import (pyarrow requires NumPy 2.0 or newer, found "
                       "1.26.4): pyarrow 26.0.1 needs numpy 2.x, not 1.26.4: pip install 'numpy>=2', or 'pyarrow<26'")
    versions(numpy="2.4.6", pandas="2.1.0")  # a known pair: its fix
    message = dependencies.import_problem(ValueError("numpy.dtype size changed, may indicate binary incompatibility"),
                                          "pandas")
    assert message == ("pandas 2.1.0 failed to import (numpy.dtype size changed, may indicate binary incompatibility): "
                       "pandas 2.1.0 needs numpy 1.x, not 2.4.6: pip install 'pandas>=2.2.2'")
    versions(numpy="2.4.6", pandas="2.2.3")  # no known pair: the versions, and where the working ones are
    message = dependencies.import_problem(ValueError("numpy.dtype size changed"), "pandas")
    assert message.startswith("pandas 2.2.3 failed to import (numpy.dtype size changed)")
    assert "installed: numpy 2.4.6, pandas 2.2.3" in message and "docs/supported-versions.md" in message
    missing = ModuleNotFoundError("No module named 'pyarrow'", name="pyarrow")
    assert dependencies.import_problem(missing) == "pyarrow is not installed (pip install pyarrow)"


def test_a_known_broken_pair_is_refused_before_pyarrow_is_imported(versions, monkeypatch, tmp_path):
    """The pair is named from the installed versions alone, before any command imports pyarrow
    (whose failure prints numpy's banner and a traceback of its own)."""
    import ampdoctor.read.run

    monkeypatch.setattr(ampdoctor.read.run, "read_run", lambda *a, **k: pytest.fail("read before the check"))
    versions(numpy="1.26.4", pyarrow="26.0.1")
    for command in (["report", str(tmp_path)], ["demo", "--out", str(tmp_path / "x")]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 2
        assert result.output.strip().splitlines() == [
            "Error: pyarrow 26.0.1 needs numpy 2.x, not 1.26.4: pip install 'numpy>=2', or 'pyarrow<26'"]
    versions(numpy="2.1.3", pyarrow="14.0.1")
    result = CliRunner().invoke(main, ["info", str(tmp_path)])
    assert result.output.strip() == ("Error: pyarrow 14.0.1 needs numpy 1.x, not 2.1.3: pip install 'pyarrow>=16', "
                                     "or 'numpy<2'")


def _import_failing_in(tmp_path, package: str, error: str):
    """A function that imports a module of ``package``'s directory whose import raises ``error``
    (as a build for another numpy raises ValueError: "numpy.dtype size changed")."""
    import importlib.util

    source = tmp_path / "site-packages" / package / "_broken.py"
    source.parent.mkdir(parents=True)
    source.write_text(f"raise {error}\n")

    def fail(*args, **kwargs):
        spec = importlib.util.spec_from_file_location(f"{package}_broken_for_test", source)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return fail


def test_any_other_failed_import_names_the_package_and_the_versions(versions, monkeypatch, tmp_path):
    import ampdoctor.read.run

    versions(numpy="2.4.6", pyarrow="26.0.1", pandas="2.2.3")
    monkeypatch.setattr(ampdoctor.read.run, "read_run",
                        _import_failing_in(tmp_path, "pandas", "ValueError('numpy.dtype size changed')"))
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "Error: pandas 2.2.3 failed to import (numpy.dtype size changed); installed: numpy 2.4.6, pyarrow 26.0.1, "
        "pandas 2.2.3; docs/supported-versions.md lists the combinations that work"]
    # The known pair is named before the import is tried.
    versions(numpy="2.4.6", pyarrow="26.0.1", pandas="2.1.4")
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.output.strip() == "Error: pandas 2.1.4 needs numpy 1.x, not 2.4.6: pip install 'pandas>=2.2.2'"
    # A ValueError of our own, not raised while importing a dependency, stays an internal error.
    monkeypatch.setattr(ampdoctor.read.run, "read_run", lambda *a, **k: (_ for _ in ()).throw(ValueError("ours")))
    versions(numpy="2.4.6", pyarrow="26.0.1", pandas="2.2.3")
    assert "internal error: ValueError: ours" in CliRunner().invoke(main, ["report", str(tmp_path)]).output
    # An import of ampdoctor's own modules that fails is a bug, and says so.
    monkeypatch.setattr(ampdoctor.read.run, "read_run",
                        lambda *a, **k: (_ for _ in ()).throw(ModuleNotFoundError("x", name="ampdoctor.nothing")))
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "internal error" in result.output


def test_the_library_raises_a_dependency_error(versions, monkeypatch):
    import ampdoctor

    monkeypatch.delitem(ampdoctor.__dict__, "read_run", raising=False)
    monkeypatch.delitem(ampdoctor.__dict__, "GradScaler", raising=False)
    versions(numpy="1.26.4", pyarrow="26.0.1")
    with pytest.raises(dependencies.DependencyError, match="pip install 'numpy>=2', or 'pyarrow<26'") as caught:
        ampdoctor.GradScaler
    assert isinstance(caught.value, ImportError) and isinstance(caught.value, ampdoctor.AmpdoctorError)
    # No known pair, but the import fails all the same: one line, the failure and the versions.
    versions(numpy="2.4.6", pyarrow="26.0.1")
    monkeypatch.delitem(sys.modules, "ampdoctor.read.run", raising=False)
    real = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.split(".")[0] == "pyarrow":
            raise ImportError("libarrow.so.2600: cannot open shared object file", name="pyarrow")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(dependencies.DependencyError, match="pyarrow 26.0.1 failed to import"):
        ampdoctor.read_run


def test_charts_tell_a_broken_matplotlib_from_a_missing_one(versions, monkeypatch):
    from ampdoctor.render import charts

    assert charts.unavailable() is None  # the test environment's matplotlib imports
    real = builtins.__import__

    def broken(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise AttributeError("_ARRAY_API not found")  # a numpy 1 build under numpy 2
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    for module in [m for m in sys.modules if m.startswith("matplotlib")]:
        monkeypatch.delitem(sys.modules, module)
    # A known pair: named without importing it.
    versions(matplotlib="3.8.3", numpy="2.4.6")
    assert charts.unavailable() == ("Charts need matplotlib, which fails to import here: matplotlib 3.8.3 needs numpy "
                                    "1.x, not 2.4.6: pip install 'matplotlib>=3.8.4'")
    # Any other breakage: imported, and its error shown.
    versions(matplotlib="3.9.0", numpy="2.4.6")
    assert charts.unavailable().startswith("Charts need matplotlib: matplotlib 3.9.0 failed to import "
                                           "(_ARRAY_API not found)")
    versions(numpy="2.4.6")
    assert charts.unavailable() == "Charts need matplotlib, which is not installed (pip install matplotlib)"


def test_every_html_page_says_why_it_has_no_charts(monkeypatch, tmp_path):
    """The report, postmortem and compare pages all take the reason from charts.unavailable()."""
    from ampdoctor.render import charts

    run = tmp_path / "run.parquet"  # a NaN loss at step 25: the postmortem has a timeline to chart
    assert CliRunner().invoke(main, ["demo", "--scenario", "nan", "--steps", "30", "--out", str(run)]).exit_code == 0
    reason = "Charts need matplotlib: matplotlib 9.9 failed to import (a reason)"
    monkeypatch.setattr(charts, "unavailable", lambda: reason)
    for command in (["report", run], ["postmortem", run], ["compare", run, run]):
        page = tmp_path / "page.html"
        result = CliRunner().invoke(main, [*map(str, command), "--format", "html", "-o", str(page)])
        assert result.exit_code == 0, result.output
        html = page.read_text()
        assert f'<p class="nodata">{reason}.</p>' in html and "<svg" not in html, command[0]
