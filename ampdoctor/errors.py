"""Exceptions raised by ampdoctor's library API.

The CLI turns every :class:`AmpdoctorError` into a one-line message (:func:`one_line`) with exit
code 2; nothing here prints.
"""


class AmpdoctorError(Exception):
    """Base class of every error ampdoctor raises on purpose."""


class RunError(AmpdoctorError):
    """A path that is not a readable ampdoctor run: missing, not Parquet, another tool's Parquet,
    a newer schema, or no rows at all."""


class RecorderError(AmpdoctorError):
    """Recording failed and the scaler was created with ``strict=True``.

    Without ``strict`` the same failure only warns once and recording stops."""


def one_line(text: str) -> str:
    """``text`` on one line of printable characters: the messages of pyarrow and the OS may hold
    newlines and control bytes."""
    return " ".join("".join(ch if ch.isprintable() else " " for ch in str(text)).split())
