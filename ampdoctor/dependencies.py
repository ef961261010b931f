"""The packages ampdoctor imports, which of their versions work together, and one line that says
so when the installed ones do not (README, "Supported versions").

pip cannot refuse every broken combination at install time: pyarrow 26 needs numpy 2 and pyarrow
14 and 15 need numpy 1 without declaring it, and older pandas and matplotlib builds fail to import
under numpy 2. ampdoctor's own floors (pyproject.toml) exclude the pandas and matplotlib builds that
fail with any numpy; the pyarrow pairs are named here, so that a failed import says what to change
instead of looking like a bug of ours. Nothing here imports a package: versions come from the
installed distributions' metadata.
"""

from __future__ import annotations

from importlib import metadata

from .errors import AmpdoctorError, one_line

# The packages a run needs (writing: torch too; the HTML charts: matplotlib).
PACKAGES = ("numpy", "pyarrow", "pandas", "click", "matplotlib", "torch")

# (package, first version, end version, the numpy major it needs, the fix): pairs that fail to
# import whatever ampdoctor does. Measured in fresh environments (README, "Supported versions").
NUMPY_PAIRS = (
    ("pyarrow", (26,), None, 2, "pip install 'numpy>=2', or 'pyarrow<26'"),
    ("pyarrow", (0,), (16,), 1, "pip install 'pyarrow>=16', or 'numpy<2'"),
)


class DependencyError(AmpdoctorError, ImportError):
    """A package ampdoctor needs is missing or fails to import with the others installed."""


def installed(package: str) -> str | None:
    """The installed version of ``package`` (its distribution's metadata), or None."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def conflicts() -> list[str]:
    """The installed pairs that cannot import together, each with its fix."""
    numpy = installed("numpy")
    if numpy is None:
        return []
    major = _release(numpy)[:1]
    out = []
    for package, first, end, needs, fix in NUMPY_PAIRS:
        version = installed(package)
        if version is None or major == (needs,):
            continue
        release = _release(version)
        if release >= first and (end is None or release < end):
            out.append(f"{package} {version} needs numpy {needs}.x, not {numpy}: {fix}")
    return out


def import_problem(exc: BaseException, package: str | None = None) -> str:
    """One line for a failed import of a dependency (``package`` when the caller knows which):
    what failed, the known conflict behind it when there is one, else the installed versions."""
    name = (package or getattr(exc, "name", None) or "").split(".")[0]
    version = installed(name) if name else None
    if isinstance(exc, ModuleNotFoundError) and name and version is None:
        return f"{name} is not installed (pip install {name})"
    what = f"{name} {version}" if version else (name or "a package ampdoctor needs")
    known = conflicts()
    if known:
        return one_line(f"{what} failed to import ({exc}): {'; '.join(known)}")
    versions = ", ".join(f"{p} {v}" for p in PACKAGES if (v := installed(p)))
    return one_line(f"{what} failed to import ({exc}); installed: {versions}; the README's "
                    f"\"Supported versions\" lists the combinations that work")


def is_ours(exc: ImportError) -> bool:
    """Whether the failed import was of ampdoctor's own modules (a bug, not the environment)."""
    return (exc.name or "").split(".")[0] == __name__.split(".")[0]


def dependency_error(exc: ImportError) -> DependencyError:
    """``exc`` (an import of a dependency failed) as a :class:`DependencyError` with one line."""
    return DependencyError(import_problem(exc))
