"""The packages ampdoctor imports, which of their versions work together, and one line that says
so when the installed ones do not (docs/supported-versions.md).

pip cannot refuse every broken combination at install time: pyarrow 26 needs numpy 2 without
declaring it, pyarrow 14 needs numpy 1 without declaring it (15 declares ``numpy<2``, which a
later numpy upgrade can still break), and matplotlib builds before 3.8.4 fail to import under numpy 2
while declaring no bound. ampdoctor's own floors (pyproject.toml) exclude the pandas and matplotlib
builds that fail with any numpy; the pairs are named here and checked before the first import of
pyarrow (:func:`check`), so that a broken environment gets one line saying what to change, not a
traceback (numpy prints a banner and a traceback before pyarrow 14's import fails) or what looks
like a bug of ours. Nothing here imports a package: versions come from the installed
distributions' metadata.
"""

from __future__ import annotations

import re
import traceback
from importlib import metadata

from .errors import AmpdoctorError, one_line

# The packages a run needs (writing: torch too; the HTML charts: matplotlib; the reading side: duckdb).
PACKAGES = ("numpy", "pyarrow", "pandas", "click", "matplotlib", "torch", "duckdb")

# (package, first version, end version, the numpy major it needs, the fix): pairs that fail to
# import whatever ampdoctor does. Measured in fresh environments (docs/supported-versions.md).
NUMPY_PAIRS = (
    ("pyarrow", (26,), None, 2, "pip install 'numpy>=2', or 'pyarrow<26'"),
    ("pyarrow", (0,), (16,), 1, "pip install 'pyarrow>=16', or 'numpy<2'"),
    ("matplotlib", (0,), (3, 8, 4), 1, "pip install 'matplotlib>=3.8.4'"),
    ("pandas", (0,), (2, 2, 2), 1, "pip install 'pandas>=2.2.2'"),
)


class DependencyError(AmpdoctorError, ImportError):
    """A package ampdoctor needs is missing or fails to import with the others installed."""


def installed(package: str) -> str | None:
    """The installed version of ``package`` (its distribution's metadata), or None."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version: ``2.0.0rc1`` → (2, 0, 0), ``2.6.0+cu124`` → (2, 6, 0)."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits[0]))
        if digits.end() < len(piece):  # a pre-release or dev suffix ends the release numbers
            break
    return tuple(parts)


def conflicts(packages: tuple[str, ...] = ("pyarrow",)) -> list[str]:
    """The installed pairs of ``packages`` with numpy that cannot import together, each with its
    fix (pyarrow: every run needs it; matplotlib: only the HTML charts)."""
    numpy = installed("numpy")
    if numpy is None:
        return []
    major = release(numpy)[:1]
    out = []
    for package, first, end, needs, fix in NUMPY_PAIRS:
        if package not in packages:
            continue
        version = installed(package)
        if version is None or major == (needs,):
            continue
        numbers = release(version)
        if numbers >= first and (end is None or numbers < end):
            out.append(f"{package} {version} needs numpy {needs}.x, not {numpy}: {fix}")
    return out


def check() -> None:
    """Raise :class:`DependencyError` when the installed pyarrow and numpy cannot import together
    (before anything imports pyarrow: the failure prints a traceback of its own). No import."""
    known = conflicts(("pyarrow", "pandas"))
    if known:
        raise DependencyError(one_line("; ".join(known)))


def _failed_package(exc: BaseException) -> str:
    """The dependency whose import raised ``exc``: its module name when the error has one, else the
    innermost frame of the traceback inside one of :data:`PACKAGES` (pandas importing pyarrow:
    pyarrow)."""
    name = (getattr(exc, "name", None) or "").split(".")[0]
    if name:
        return name
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        parts = frame.filename.replace("\\", "/").split("/")
        found = next((p for p in PACKAGES if p in parts[:-1]), None)
        if found:
            return found
    return ""


def import_problem(exc: BaseException, package: str | None = None) -> str:
    """One line for a failed import of a dependency (``package`` when the caller knows which):
    what failed, the known conflict behind it when there is one, else the installed versions."""
    name = (package or _failed_package(exc)).split(".")[0]
    version = installed(name) if name else None
    if isinstance(exc, ModuleNotFoundError) and name and version is None:
        return f"{name} is not installed (pip install {name})"
    what = f"{name} {version}" if version else (name or "a package ampdoctor needs")
    known = conflicts((name,) if name else ("pyarrow",))
    if known:
        return one_line(f"{what} failed to import ({exc}): {'; '.join(known)}")
    versions = ", ".join(f"{p} {v}" for p in PACKAGES if (v := installed(p)))
    return one_line(f"{what} failed to import ({exc}); installed: {versions}; "
                    f"docs/supported-versions.md lists the combinations that work")


def is_ours(exc: ImportError) -> bool:
    """Whether the failed import was of ampdoctor's own modules (a bug, not the environment)."""
    return (exc.name or "").split(".")[0] == __name__.split(".")[0]


def failed_import(exc: BaseException) -> bool:
    """Whether ``exc`` is a dependency failing to import, not a bug of ours: an ImportError of
    another package, or any error raised inside one of :data:`PACKAGES` while it was being
    imported (a build for another numpy raises ValueError or AttributeError there)."""
    if isinstance(exc, ImportError):
        return not is_ours(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    importing = any("importlib._bootstrap" in frame.filename for frame in frames)
    return importing and bool(_failed_package(exc))


def dependency_error(exc: BaseException) -> DependencyError:
    """``exc`` (an import of a dependency failed) as a :class:`DependencyError` with one line."""
    return DependencyError(import_problem(exc))
