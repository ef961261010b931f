"""What an analysis found, as data. A :class:`Finding` names one sentence of the output by its
``code`` and holds the raw values it is about: scales and rates as floats, steps as ints, names as
strings, never preformatted text. The sentences are the renderers': :mod:`ampdoctor.render.wording`
has one per code, and :func:`ampdoctor.render.contract` words the findings of a command's data
into the strings of its JSON contract (``reasons``, ``advice``, ``notes``, ``warnings``, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Finding:
    code: str                                            # which sentence (render/wording/)
    values: dict[str, Any] = field(default_factory=dict)  # what it says, as raw numbers and names
