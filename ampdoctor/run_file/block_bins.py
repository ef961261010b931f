"""The bins of a GEMM operand's block statistics (:mod:`ampdoctor.stats.block_stats` computes them
on the device; :mod:`ampdoctor.analysis.block_formats` reads them), torch-free like every reader.

Block formats (MXFP8, MXFP4, NVFP4) scale each block of 32 or 16 consecutive elements along the
reduction dimension by a scale of its own. What decides an element's fate there is its magnitude
relative to its block's scale, not the tensor's: so the statistics count each nonzero element by
that ratio, finely (eight bins per binade, the top three mantissa bits of its float32 value, as
:mod:`.fine_bins` does, which are exactly FP8 E4M3's grid points), over a window of binades.

* **MX** (blocks of :data:`MX_BLOCK`): ``rel = |x| / 2^floor(log2 amax_block)``, in [0, 2), by the
  block's class: where its amax's mantissa lies (at most 1.5, at most 1.75, above; the element
  formats' largest values are 1.5 · 2^k (E2M1) and 1.75 · 2^k (E4M3, E5M2), so a round-up scale
  halves ``rel`` exactly in the blocks above). One table serves every MX element format and both
  scale modes. The blocks and their nonzero elements by ``floor(log2 amax_block)`` and class: the
  E8M0 scale's range (a scale below 2^-127 is clamped).
* **NVFP4** (blocks of :data:`NV_BLOCK`): each element as the recipe scales it,
  ``q = |x| · (1 / s_t) / e4m3(clamp(amax_block / 6 / s_t))`` with ``s_t = amax_tensor / (448 · 6)``,
  exactly as torchao's ``nvfp4_quantize`` computes it; the blocks by ``amax_block / amax_tensor``
  (the spread of the block scales); and the blocks whose scale was clamped up to E4M3's smallest
  normal value (with their nonzero elements).

A window's index 0 counts the nonzero values below it, its last index those at or above it.

Beside the counts, per recipe (:data:`RECIPES`) the sums ``sum (q - Q(q))^2`` and ``sum q^2`` of the
operand's elements in their block's scale units (``q``) and cast (``Q``), measured: a few large
elements (a massive activation channel) weigh most in them, where no histogram places them
finely enough.
"""

from __future__ import annotations

import numpy as np

MX_BLOCK = 32
NV_BLOCK = 16
PER_BINADE = 8                 # bins per binade (3 mantissa bits)
KEY_SHIFT = 20                 # float32 bits >> 20: 8 exponent bits and 3 mantissa bits
MX_CLASSES = (1.5, 1.75)       # a block's class: how many of these its amax's mantissa exceeds
REL_WINDOW = (-40, 1)          # binades of rel counted one by one: below every MX flush threshold, to 2
Q_WINDOW = (-12, 3)            # binades of NVFP4's q: below its flush threshold (0.25), to 8 (> 6 · 1.07)
RATIO_WINDOW = (-48, 1)        # binades of amax_block / amax_tensor
EXP_RANGE = (-149, 127)        # floor(log2 amax_block) of a float32 block amax
NV_TENSOR_DIVISOR = 448.0 * 6.0  # s_t = amax_tensor / this (E4M3's max times E2M1's)
E4M3_EPS = 2.0 ** -6           # the smallest NVFP4 block scale (E4M3's smallest normal, as torchao)

# Element formats: (mantissa bits, exponent of the smallest normal, largest value).
ELEMENTS = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0), "e2m1": (1, 0, 6.0)}
# The recipes: (name, element format, scale: "floor" or "round-up" E8M0 scales of MX_BLOCK, or
# "nvfp4"), in the order of the measured sums.
RECIPES = (
    ("mxfp8_e4m3_floor", "e4m3", "floor"),
    ("mxfp8_e4m3_round_up", "e4m3", "round-up"),
    ("mxfp8_e5m2_floor", "e5m2", "floor"),
    ("mxfp8_e5m2_round_up", "e5m2", "round-up"),
    ("mxfp4_floor", "e2m1", "floor"),
    ("mxfp4_round_up", "e2m1", "round-up"),
    ("nvfp4", "e2m1", "nvfp4"),
)


def window_bins(window: tuple[int, int]) -> int:
    """The bins of a window: one below it, eight per binade, one at or above it."""
    low, high = window
    return (high - low) * PER_BINADE + 2


REL_BINS = window_bins(REL_WINDOW)
Q_BINS = window_bins(Q_WINDOW)
RATIO_BINS = window_bins(RATIO_WINDOW)
EXP_BINS = EXP_RANGE[1] - EXP_RANGE[0] + 1


def window_edges(window: tuple[int, int]) -> np.ndarray:
    """float64 ``[bins + 1]``: each bin's lower edge, then the top bin's upper edge (inf); the
    first bin (below the window) starts at 0."""
    low, high = window
    inner = np.arange((high - low) * PER_BINADE + 1)
    edges = np.ldexp(1.0 + (inner % PER_BINADE) / PER_BINADE, low + inner // PER_BINADE)
    return np.concatenate([[0.0], edges, [np.inf]])


def window_index(values: np.ndarray, window: tuple[int, int]) -> np.ndarray:
    """The bin of each nonzero magnitude (as float32) in a window (numpy; the device computes the
    same from the same bits)."""
    low, high = window
    key = (np.asarray(values, dtype=np.float32).view(np.int32) & 0x7FFFFFFF) >> KEY_SHIFT
    return np.clip(key - ((low + 127) << 3) + 1, 0, (high - low) * PER_BINADE + 1)


# The ``block_stats`` column (schema.py): one operand's statistics, flat, as float64 (the counts are
# integers below 2^53: exact), in this order. ``rows``: the rows of the operand's 2-D view (blocks
# along its last dimension) that were read, and how many it has (a large operand is read at a
# systematic sample of rows: stats/block_stats.py).
LAYOUT = (
    ("mx_rel", (len(MX_CLASSES) + 1, REL_BINS)),
    ("mx_blocks", (2, len(MX_CLASSES) + 1, EXP_BINS)),
    ("nv_q", (Q_BINS,)),
    ("nv_ratio", (RATIO_BINS,)),
    ("nv_clamped", (2,)),
    ("measured", (len(RECIPES), 4)),
    ("nonzero", ()),
    ("rows", (2,)),
)
SIZES = {name: int(np.prod(shape)) for name, shape in LAYOUT}
OFFSETS = {name: sum(SIZES[n] for n, _ in LAYOUT[:i]) for i, (name, _) in enumerate(LAYOUT)}  # where each starts
BLOCK_VALUES = sum(SIZES.values())


def unpack(values) -> dict[str, np.ndarray]:
    """The parts of one ``block_stats`` value (:data:`LAYOUT`), as float64 arrays of their shapes.
    Raises ValueError for a value of another length."""
    flat = np.asarray(values, dtype=np.float64)
    if flat.shape != (BLOCK_VALUES,):
        raise ValueError(f"a block_stats value holds {BLOCK_VALUES} numbers, not {flat.size}")
    return {name: flat[OFFSETS[name]:OFFSETS[name] + SIZES[name]].reshape(shape) for name, shape in LAYOUT}
