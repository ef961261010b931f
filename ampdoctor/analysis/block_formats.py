"""What a block format would make of a GEMM operand, from its block statistics
(:mod:`ampdoctor.run_file.block_bins`): MXFP8 (E4M3 or E5M2 elements), MXFP4 (E2M1) with E8M0
block scales, floor (the OCP spec's) or round-up (cuBLAS's and torchao's RCEIL); NVFP4 (E2M1
elements, E4M3 block scales under a float32 tensor scale). Numpy on counts; nothing here reads a
run or a tensor.

Per operand and recipe (:class:`BlockFigures`), in shares of the nonzero elements:

* ``flushed``: elements that become 0 (their magnitude at most half the element format's
  smallest subnormal, in units of their block's scale); ``flushed_max``: with every element of a
  block whose scale the format clamps (an E8M0 scale below its range: the statistics cannot tell
  which of their elements survive, so these bound the share);
* ``saturated``: elements above the element format's largest value in their block's units (a
  floor scale lets a block's amax reach up to 2^(emax+1) · (1 - ulp): above E4M3's 448 when its
  mantissa exceeds 1.75), clamped to it; counted on the device (exact: a round-up scale never
  saturates, and NVFP4's block amax lands on 6 itself whenever its E4M3 scale is exact);
* ``clamped_blocks``: the share of the (nonzero) blocks whose scale was clamped;
* ``error``: the relative quantisation error, ``sqrt(sum (q - Q(q))^2 / sum q^2)`` with ``q`` each
  element in its block's scale units and ``Q`` the element format's rounding (nearest, ties to
  even, saturating): the root of what TransformerEngine's NVFP4 statistics call the MSE, relative.

Within a bin (an eighth of a binade) the elements are taken as spread evenly (an operand of
bfloat16 or float16, told so, over its own grid points): the bins' edges are E4M3's grid points
and every format's flush threshold lies on them, so only an element exactly on a threshold (a tie)
can be counted on the wrong side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..run_file.block_bins import ELEMENTS, EXP_RANGE, MX_BLOCK, MX_CLASSES, NV_BLOCK, Q_WINDOW, REL_WINDOW
from ..run_file.block_bins import RECIPES as RECIPE_SPECS
from ..run_file.block_bins import unpack, window_edges

_SUBPOINTS = 16  # evenly spread points per bin
_GRID_MBITS = 10  # operands of at most this many mantissa bits are taken on their grid (float16's: 128 a bin)


@dataclass(frozen=True)
class ElementFormat:
    """A block format's element: ``mbits`` mantissa bits, smallest normal 2^``emin``, ``max``."""

    name: str
    mbits: int
    emin: int
    max: float

    @property
    def emax(self) -> int:
        """The exponent of its largest binade (E8M0 scales put a block's amax there)."""
        return int(np.floor(np.log2(self.max)))

    def round(self, q: np.ndarray) -> np.ndarray:
        """Non-negative ``q`` rounded to the format (nearest, ties to even), saturating at ``max``."""
        q = np.asarray(q, dtype=np.float64)
        with np.errstate(divide="ignore"):
            exponent = np.maximum(np.floor(np.log2(np.where(q > 0, q, 1.0))), self.emin)
        spacing = np.ldexp(1.0, (exponent - self.mbits).astype(np.int64))
        return np.minimum(np.rint(q / spacing) * spacing, self.max)


FORMATS = {name: ElementFormat(name, *spec) for name, spec in ELEMENTS.items()}
E4M3, E5M2, E2M1 = FORMATS["e4m3"], FORMATS["e5m2"], FORMATS["e2m1"]


@dataclass(frozen=True)
class BlockRecipe:
    name: str
    element: ElementFormat
    scale: str   # "floor", "round-up" (E8M0 scales of blocks of 32) or "nvfp4"
    block: int


RECIPES = tuple(BlockRecipe(name, FORMATS[element], scale, NV_BLOCK if scale == "nvfp4" else MX_BLOCK)
                for name, element, scale in RECIPE_SPECS)


@dataclass
class BlockStatsHost:
    """A :class:`~ampdoctor.stats.block_stats.BlockStats` on the host (numpy)."""

    mx_rel: np.ndarray
    mx_blocks: np.ndarray
    nv_q: np.ndarray
    nv_ratio: np.ndarray
    nv_clamped: np.ndarray
    measured: np.ndarray       # [len(RECIPES), 4]: flushed, saturated, sum (q - Q)^2, sum q^2
    nonzero: int
    rows: tuple[int, int] = (1, 1)  # rows read, rows of the operand (a sample of a large one)

    @classmethod
    def from_values(cls, values) -> "BlockStatsHost":
        """From one ``block_stats`` value (a flat sequence, :data:`~ampdoctor.run_file.block_bins.LAYOUT`),
        or the sum of several (ranks, calls: every part adds up). ValueError for another length."""
        parts = unpack(values)
        counts = {k: parts[k].astype(np.int64) for k in ("mx_rel", "mx_blocks", "nv_q", "nv_ratio", "nv_clamped")}
        seen, total = parts["rows"]
        return cls(**counts, measured=parts["measured"], nonzero=int(parts["nonzero"]), rows=(int(seen), int(total)))

    @property
    def sampled(self) -> bool:
        """Whether only a sample of the operand's rows was read."""
        return self.rows[0] < self.rows[1]


@dataclass
class BlockFigures:
    recipe: str
    flushed: float
    flushed_max: float
    saturated: float
    clamped_blocks: float
    error: float


def measured(stats: BlockStatsHost, recipe: BlockRecipe) -> BlockFigures:
    """The figures the device measured for ``recipe`` (exact: the operand cast as torchao casts
    it); NaN where the operand has no nonzero element."""
    flushed, saturated, error, reference = np.asarray(stats.measured, dtype=np.float64)[RECIPES.index(recipe)]
    if not (np.isfinite(error) and np.isfinite(reference)):  # (no cast: NVFP4 of an operand below ~1e-35)
        return BlockFigures(recipe.name, *(np.nan,) * 5)
    return _figures(recipe, stats, flushed, saturated, error, reference, clamped_elements=0.0)


def predict(stats: BlockStatsHost, recipe: BlockRecipe, source_mbits: int | None = None) -> BlockFigures:
    """What ``recipe`` would make of the operand whose statistics are ``stats`` (module docstring),
    an operand of a format with ``source_mbits`` mantissa bits (bfloat16 7, float16 10; None: float32
    or unknown). NaN where it has no nonzero element."""
    if recipe.scale == "nvfp4":
        # (a clamped NVFP4 block scale is in q already: the figures hold for its elements)
        (flushed, error, reference), clamped = _tally(stats.nv_q, _points(window_edges(Q_WINDOW)), recipe.element), 0.0
    else:
        (flushed, error, reference), clamped = _mx(stats, recipe, source_mbits)
    # (saturation, a threshold that ties at it decide, is the device's count: see module docstring)
    saturated = float(np.asarray(stats.measured)[RECIPES.index(recipe), 1])
    return _figures(recipe, stats, flushed, saturated, error, reference, clamped)


def _mx(stats: BlockStatsHost, recipe: BlockRecipe, source_mbits: int | None) -> tuple[np.ndarray, float]:
    """(flushed, squared error, squared value) from the MX table, and the nonzero elements of the
    blocks whose scale is clamped."""
    fmt, above = recipe.element, _above(recipe.element)
    # An MX scale is a power of two: rel keeps the operand's own grid, whose points (bfloat16: 16 a
    # bin) are where its elements lie, ties included; finer formats spread evenly.
    grid = source_mbits is not None and source_mbits <= _GRID_MBITS
    points = _points(window_edges(REL_WINDOW), 2 ** (source_mbits - 3) if grid else None)
    tally = np.zeros(3)
    for c, counts in enumerate(np.asarray(stats.mx_rel, dtype=np.float64)):
        factor = 2.0 ** (fmt.emax - (1 if recipe.scale == "round-up" and above[c] else 0))
        # (no element of a block exceeds its amax, whose mantissa the class bounds: the bin at
        # that bound holds the bound alone)
        upper = (*MX_CLASSES, 2.0)[c]
        tally += _tally(counts, np.minimum(points, upper) * factor, fmt)
    return tally, float(np.asarray(stats.mx_blocks, dtype=np.float64)[1][_mx_clamped(recipe)].sum())


def _above(fmt: ElementFormat) -> list[bool]:
    """Per block class, whether its amax's mantissa exceeds the element's largest (1.75 for E4M3
    and E5M2, 1.5 for E2M1): a round-up scale takes the next power of two there."""
    top = fmt.max / 2.0 ** fmt.emax
    return [c > 0 and MX_CLASSES[c - 1] >= top for c in range(len(MX_CLASSES) + 1)]


def _mx_clamped(recipe: BlockRecipe) -> np.ndarray:
    """[classes, exponents]: the blocks whose E8M0 scale is clamped: floor (torchao) raises a scale
    below 2^-126 to it; round-up takes its smallest scale, 2^-127, as 1."""
    exponent = np.arange(EXP_RANGE[0], EXP_RANGE[1] + 1)[None, :]
    if recipe.scale == "floor":
        return np.broadcast_to(exponent - recipe.element.emax < -126, (len(MX_CLASSES) + 1, exponent.shape[1]))
    bump = np.array(_above(recipe.element), dtype=np.int64)[:, None]
    return exponent - recipe.element.emax + bump <= -127


def _clamped_blocks(stats: BlockStatsHost, recipe: BlockRecipe) -> float:
    """The share of the nonzero blocks whose scale is clamped."""
    if recipe.scale == "nvfp4":
        blocks, clamped = float(np.sum(stats.nv_ratio)), float(stats.nv_clamped[0])
    else:
        per_block = np.asarray(stats.mx_blocks, dtype=np.float64)[0]
        blocks, clamped = per_block.sum(), per_block[_mx_clamped(recipe)].sum()
    return clamped / blocks if blocks else 0.0


def _figures(recipe, stats, flushed, saturated, error, reference, clamped_elements) -> BlockFigures:
    n = float(stats.nonzero)
    if n <= 0:
        return BlockFigures(recipe.name, *(np.nan,) * 5)
    with np.errstate(invalid="ignore"):  # (a non-finite operand's sums are NaN: so are its figures)
        relative = float(np.sqrt(error / reference)) if reference > 0 else 0.0 if reference == 0 else np.nan
    return BlockFigures(recipe.name, flushed / n, min(1.0, (flushed + clamped_elements) / n), saturated / n,
                        _clamped_blocks(stats, recipe), relative)


def _points(edges: np.ndarray, grid: int | None = None) -> np.ndarray:
    """[bins, points]: evenly spread points inside each bin (the top bin's, unbounded, at its
    lower edge); ``grid``: that many grid points from each bin's lower edge instead."""
    low, high = edges[:-1], np.where(np.isfinite(edges[1:]), edges[1:], edges[:-1])
    step = np.arange(grid) / grid if grid else (np.arange(_SUBPOINTS) + 0.5) / _SUBPOINTS
    return low[:, None] + (high - low)[:, None] * step[None, :]


def _tally(counts: np.ndarray, q: np.ndarray, fmt: ElementFormat) -> np.ndarray:
    """(flushed, squared error, squared value) of elements counted by ``counts`` per bin, spread
    over the bin's points ``q`` (in block-scale units)."""
    counts, rounded = np.asarray(counts, dtype=np.float64), fmt.round(q)
    share = lambda v: (counts * v.mean(axis=1)).sum()  # noqa: E731
    return np.array([share((rounded == 0) & (q > 0)), share((q - rounded) ** 2), share(q ** 2)])
