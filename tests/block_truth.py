"""Ground truth for the block formats (issue 42), measured independently of ampdoctor: an operand
cast by torchao's reference implementations (CPU), ``to_mx`` (MXFP8 E4M3/E5M2 and MXFP4, scale
modes FLOOR and RCEIL, blocks of 32) and ``nvfp4_quantize`` (blocks of 16, a per-tensor scale
from the operand's amax), along its last dimension, padded with zeros to a whole block.

Per operand: ``flushed`` (nonzero elements cast to 0), ``saturated`` (elements beyond the element
format's maximum in their block's scale units, which the cast clamps) and ``error``
(``sqrt(sum (q - Q)^2 / sum q^2)`` with ``q`` the element in its block's scale units and ``Q`` its
cast), each over the operand's nonzero elements.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

ELEMENTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.float4_e2m1fn_x2}
MODES = {"floor": ScaleCalculationMode.FLOOR, "round-up": ScaleCalculationMode.RCEIL}


@dataclass
class BlockCast:
    flushed: float
    saturated: float
    error: float


def cast(x: torch.Tensor, element: str, scale: str, block: int, fmax: float,
         tensor_amax: torch.Tensor | None = None) -> BlockCast:
    """``x`` (float32 or bfloat16, any shape) cast by the recipe (``scale``: "floor", "round-up"
    or "nvfp4"; NVFP4's per-tensor scale from ``tensor_amax``, by default ``x``'s own amax)."""
    x = x.detach().float().reshape(-1, x.shape[-1] if x.dim() else 1)
    pad = (-x.shape[1]) % block
    x = torch.nn.functional.pad(x, (0, pad)).contiguous()
    blocks = x.reshape(x.shape[0], -1, block)
    if scale == "nvfp4":
        tensor_scale = per_tensor_amax_to_scale(x.abs().amax() if tensor_amax is None else tensor_amax.float())
        scales, data = nvfp4_quantize(x, block, tensor_scale)
        q = blocks * ((1.0 / tensor_scale) / scales.float())[..., None]
        cast_q = f4_unpacked_to_f32(unpack_uint4(data))
    else:
        biased, data = to_mx(x, ELEMENTS[element], block, MODES[scale])
        biased = biased.view(torch.uint8).to(torch.int32)
        if scale == "floor":  # (to_mx divides by the scale, raised to float32's smallest normal)
            q = blocks / torch.clamp(torch.exp2((biased - 127).float()), min=2.0 ** -126)[..., None]
        else:  # (RCEIL multiplies by the reciprocal, 1 for the smallest scale)
            q = blocks * torch.where(biased == 0, 1.0, torch.exp2((127 - biased).float()))[..., None]
        cast_q = f4_unpacked_to_f32(unpack_uint4(data)) if element == "e2m1" else data.float()
    q, cast_q = q.reshape(x.shape).abs().double(), cast_q.reshape(x.shape).abs().double()
    nonzero = x != 0
    n = int(nonzero.sum())
    squares = float((q ** 2).sum())
    return BlockCast(int((nonzero & (cast_q == 0)).sum()) / n, int((q > fmax).sum()) / n,
                     float(((q - cast_q) ** 2).sum()) ** 0.5 / squares ** 0.5 if squares else 0.0)
