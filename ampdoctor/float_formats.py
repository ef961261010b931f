"""The numeric facts of the floating-point formats that mixed precision uses (docs/numerics.md, Formats)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch at run time: reading a run needs none
    import torch


@dataclass(frozen=True)
class FloatFormat:
    name: str
    max: float
    smallest_normal: float
    smallest_subnormal: float

    @property
    def underflow_below(self) -> float:
        """Magnitudes below this round to zero (half the smallest subnormal, ties to even)."""
        return self.smallest_subnormal / 2


FLOAT16 = FloatFormat("float16", 65504.0, 2.0**-14, 2.0**-24)
BFLOAT16 = FloatFormat("bfloat16", (2 - 2.0**-7) * 2.0**127, 2.0**-126, 2.0**-133)
FLOAT32 = FloatFormat("float32", (2 - 2.0**-23) * 2.0**127, 2.0**-126, 2.0**-149)
FLOAT64 = FloatFormat("float64", sys.float_info.max, 2.0**-1022, 2.0**-1074)
FLOAT8_E4M3FN = FloatFormat("float8_e4m3fn", 448.0, 2.0**-6, 2.0**-9)
FLOAT8_E5M2 = FloatFormat("float8_e5m2", 57344.0, 2.0**-14, 2.0**-16)

FORMATS = {f.name: f for f in (FLOAT16, BFLOAT16, FLOAT32, FLOAT64, FLOAT8_E4M3FN, FLOAT8_E5M2)}
_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
            "float": "float32", "fp64": "float64", "double": "float64"}


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.float16`` or ``"fp16"`` → ``"float16"``."""
    name = str(dtype).removeprefix("torch.")  # str(torch.float16) == "torch.float16"
    return _ALIASES.get(name, name)


def float_format(dtype: torch.dtype | str) -> FloatFormat:
    """The :class:`FloatFormat` of a torch dtype or a dtype name; ValueError if it isn't a float format."""
    name = dtype_name(dtype)
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(
            f"{name!r} is not a floating-point format ampdoctor knows; use one of {sorted(FORMATS)}"
        ) from None
