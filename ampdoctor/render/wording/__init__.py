"""Every sentence of ampdoctor's outputs, in one package: per finding code
(:class:`~ampdoctor.analysis.findings.Finding`) a small function named for it, or a fixed text, in
the module of the command whose analysis finds it (:mod:`.report`: the run as read, the replay and
the recommendation; :mod:`.postmortem`; :mod:`.compare`), with the phrases they share in
:mod:`.phrases`. Numbers read as everywhere else (:mod:`..formatting`); code to paste is marked
with backticks, which each renderer shows its own way. :func:`worded` turns a command's data into
the strings of its JSON contract."""

from __future__ import annotations

from collections.abc import Callable

from ...analysis.findings import Finding

_SENTENCES: dict[str, Callable[..., str]] = {}


def register(sentence: Callable[..., str]) -> Callable[..., str]:
    """Register the decorated function as the sentence of the finding code that is its name; the
    finding's values are its keyword arguments."""
    _SENTENCES[sentence.__name__] = sentence
    return sentence


def register_fixed(code: str, sentence: str) -> None:
    """Register the sentence of a finding without values."""
    _SENTENCES[code] = lambda: sentence


def word(finding: Finding) -> str:
    """The sentence of one finding."""
    sentence = _SENTENCES.get(finding.code)
    if sentence is None:
        raise KeyError(f"no wording for the finding {finding.code!r} (add one to render/wording/)")
    return sentence(**finding.values)


def worded(data):
    """``data`` with every finding in it replaced by its sentence; everything else as it is."""
    if isinstance(data, Finding):
        return word(data)
    if isinstance(data, dict):
        return {k: worded(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(worded(v) for v in data)
    return data


def codes() -> frozenset[str]:
    """The finding codes that have a sentence."""
    return frozenset(_SENTENCES)


# Each module registers its sentences when imported.
from . import compare, postmortem, report  # noqa: E402, F401
