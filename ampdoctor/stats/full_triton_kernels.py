"""The kernels of the *triton* algorithm of the full statistics, which :mod:`.full_triton`
launches (it holds why a kernel, the tile table and the buffers); Triton compiles them on their
first launch, ``scripts/compile_triton_kernels.py`` ahead of time.

A tile is whole rows of a tensor's 2-D view (the view :func:`~.full.zero_line_elements` takes), read
in blocks of ``RB`` rows x ``CB`` columns; a tensor of fewer than 2 dimensions is read as rows of
``CB`` elements (the tile table: :class:`~.full_triton._Plan`). Kernel 1 (:func:`_tile_kernel`)
writes each tile's partial results: the histogram of the unscaled magnitudes over the run's
histogram bins (binades below the first bin and zeros in bin 0, those above the last in the last),
the zeros, the elements below the subnormal threshold, the non-finite elements and the quiet NaNs
among them, the largest finite magnitude, the smallest nonzero one (as bits) and the sum of squares
in float64; then it marks each row and column of the tile that holds a nonzero element (plain stores
of 1: a benign race). A row of zeros takes as many of the tile's zeros as it has columns, a column
of zeros (within the tile) as many as the tile has rows outside its zero rows: a tile with fewer
zeros than that (a dense gradient, or one with scattered zeros) marks all its rows, or all its
columns, at once without reading them again. Only otherwise (an embedding's rows of unused tokens, a
ReLU's output) does it read its blocks again, from cache, folding them per row block (or column
block) and reducing once per row block (or column block). (Marks made in the one pass per element
doubled the kernel's time on an H200, benchmarks/results/stats_kernels_h200_2026-11-26.json; per
block they cost two cross-warp reductions a block.) Kernel 2 (:func:`_slot_kernel`), one program per
slot, adds the tiles of its slot in order, fills the slot's row of ``FullStats.counts`` (each
histogram bin's count under the code of a binade in that bin, the first, which
:meth:`~.full_results.FullStats.decode` maps back to the same bin; the inf and NaN codes) and counts
the elements of its tensors' unmarked lines. The element judgements are those of the other two
algorithms (:mod:`.full`), on the same float32 products.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Constants the kernels read must be constexpr (Triton refuses plain globals when it compiles).
_ABS_MASK = tl.constexpr(0x7FFFFFFF)
_INF_BITS = tl.constexpr(0x7F800000)
_QNAN_BITS = tl.constexpr(0x7FC00000)  # the other algorithms' codes tell NaN from inf by this bit
_EXTRA = tl.constexpr(8)               # per tile: zeros, below, non-finite, NaN, 4 unused


@triton.jit
def _magnitudes(data, rb, cb, n_rows, n_cols, length, rr, cc, RB: tl.constexpr, CB: tl.constexpr,
                BF16: tl.constexpr):
    """The block of row block ``rb`` and column block ``cb`` of a tile: its rows, its columns and
    the magnitudes of its elements in float32 (0 outside the tile)."""
    rows = rb * RB + rr
    cols = cb * CB + cc
    linear = rows[:, None] * n_cols + cols[None, :]
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols) & (linear < length)
    if BF16:  # bfloat16 is the top half of a float32: widened by a shift (Triton's interpreter
        # flushed its subnormals when converting)
        raw = tl.load(data + linear, mask=inside, other=0).to(tl.int32)
        scaled = tl.abs((raw << 16).to(tl.float32, bitcast=True))
    else:
        scaled = tl.abs(tl.load(data + linear, mask=inside, other=0.0).to(tl.float32))
    return rows, cols, scaled


@triton.jit
def _mark_all(marks, n, rr, cc, RB: tl.constexpr, CB: tl.constexpr, FOR_LOOP: tl.constexpr):
    """Marks ``0 .. n`` set, ``RB * CB`` stores at a time."""
    if FOR_LOOP:
        for start in range(0, n, RB * CB):
            at = start + rr[:, None] * CB + cc[None, :]
            tl.store(marks + at, 1, mask=at < n)
    else:
        start = n * 0
        while start < n:
            at = start + rr[:, None] * CB + cc[None, :]
            tl.store(marks + at, 1, mask=at < n)
            start += RB * CB


@triton.jit
def _mark_rows(data, n_rows, n_cols, length, rr, cc, zeros, row_marks, RB: tl.constexpr, CB: tl.constexpr,
               BF16: tl.constexpr, FOR_LOOP: tl.constexpr):
    """Mark the tile's rows that hold a nonzero element (NaN too, as in zero_line_elements), and
    return how many rows hold none. A row of zeros takes ``n_cols`` of the tile's ``zeros``: with
    fewer, every row holds a nonzero, and all are marked without reading the tile again. Otherwise
    each row block is read again (from cache: it was just read), its column blocks folded
    together, and reduced across columns once."""
    col_blocks = tl.cdiv(n_cols, CB)
    zero_rows = zeros * 0
    if zeros < n_cols:
        _mark_all(row_marks, n_rows, rr, cc, RB, CB, FOR_LOOP)
    elif FOR_LOOP:
        for rb in range(0, tl.cdiv(n_rows, RB)):
            seen = tl.zeros([RB, CB], dtype=tl.int32)
            for cb in range(0, col_blocks):
                rows, cols, scaled = _magnitudes(data, rb, cb, n_rows, n_cols, length, rr, cc, RB, CB,
                                                 BF16)
                seen = tl.maximum(seen, (scaled != 0.0).to(tl.int32))
            held = tl.max(seen, axis=1)
            tl.store(row_marks + rb * RB + rr, 1, mask=held > 0)
            zero_rows += tl.sum(((held == 0) & (rb * RB + rr < n_rows)).to(tl.int32), axis=0)
    else:
        rb = n_rows * 0
        while rb < tl.cdiv(n_rows, RB):
            seen = tl.zeros([RB, CB], dtype=tl.int32)
            cb = rb * 0
            while cb < col_blocks:
                rows, cols, scaled = _magnitudes(data, rb, cb, n_rows, n_cols, length, rr, cc, RB, CB,
                                                 BF16)
                seen = tl.maximum(seen, (scaled != 0.0).to(tl.int32))
                cb += 1
            held = tl.max(seen, axis=1)
            tl.store(row_marks + rb * RB + rr, 1, mask=held > 0)
            zero_rows += tl.sum(((held == 0) & (rb * RB + rr < n_rows)).to(tl.int32), axis=0)
            rb += 1
    return zero_rows


@triton.jit
def _mark_columns(data, n_rows, n_cols, length, rr, cc, zeros, needed, col_marks, RB: tl.constexpr,
                  CB: tl.constexpr, BF16: tl.constexpr, FOR_LOOP: tl.constexpr):
    """The same for the columns, which hold the tile's rows only (a column is marked if any tile
    finds a nonzero in it). A column of zeros takes ``needed`` of ``zeros``: the tile's rows that
    are not zero rows, against the zeros outside those rows. With fewer, all columns are marked
    without reading (an embedding's rows of unused tokens do not make its columns read again).
    Otherwise each column block is read again, its row blocks folded, and reduced across rows once."""
    col_blocks = tl.cdiv(n_cols, CB)
    if zeros < needed:
        _mark_all(col_marks, n_cols, rr, cc, RB, CB, FOR_LOOP)
    elif FOR_LOOP:
        for cb in range(0, col_blocks):
            seen = tl.zeros([RB, CB], dtype=tl.int32)
            for rb in range(0, tl.cdiv(n_rows, RB)):
                rows, cols, scaled = _magnitudes(data, rb, cb, n_rows, n_cols, length, rr, cc, RB, CB,
                                                 BF16)
                seen = tl.maximum(seen, (scaled != 0.0).to(tl.int32))
            tl.store(col_marks + cb * CB + cc, 1, mask=tl.max(seen, axis=0) > 0)
    else:
        cb = n_cols * 0
        while cb < col_blocks:
            seen = tl.zeros([RB, CB], dtype=tl.int32)
            rb = cb * 0
            while rb < tl.cdiv(n_rows, RB):
                rows, cols, scaled = _magnitudes(data, rb, cb, n_rows, n_cols, length, rr, cc, RB, CB,
                                                 BF16)
                seen = tl.maximum(seen, (scaled != 0.0).to(tl.int32))
                rb += 1
            tl.store(col_marks + cb * CB + cc, 1, mask=tl.max(seen, axis=0) > 0)
            cb += 1


@triton.jit
def _block(data, rb, cb, n_rows, n_cols, length, rr, cc, inv, threshold,
           hist, zeros, below, nonfinite, nans, top, low, squares,
           HAS_SCALE: tl.constexpr, FIRST_E: tl.constexpr, LAST_BIN: tl.constexpr, NBINS: tl.constexpr,
           RB: tl.constexpr, CB: tl.constexpr, BF16: tl.constexpr):
    """Block ``b`` of a tile (``RB`` rows x ``CB`` columns of its 2-D view) added to the tile's
    accumulators (per lane, but ``hist``). Lanes outside the tile read 0: they count as zeros,
    subnormal and in bin 0, and are taken off once at the end (no mask per statistic)."""
    rows, cols, scaled = _magnitudes(data, rb, cb, n_rows, n_cols, length, rr, cc, RB, CB, BF16)
    zeros += (scaled == 0.0).to(tl.int32)
    below += (scaled < threshold).to(tl.int32)  # zeros too: taken off at the end
    if HAS_SCALE:
        unscaled = scaled * inv  # torch's unscale_ product, in float32
    else:
        unscaled = scaled
    bits = unscaled.to(tl.int32, bitcast=True) & _ABS_MASK  # abs() may keep the sign of -NaN
    nonfinite += (bits >= _INF_BITS).to(tl.int32)
    nans += (bits >= _QNAN_BITS).to(tl.int32)
    exponent = bits >> 23
    # The run's bin of each binade (exponent field 0, zeros and float32 subnormals, in bin 0);
    # non-finite ones land in the last bin and are taken off at the end.
    binned = tl.minimum(tl.maximum(exponent - FIRST_E, 0), LAST_BIN)
    if FIRST_E < 1:  # (else exponent 0 is below the first bin anyway)
        binned = tl.where(exponent == 0, 0, binned)
    hist += tl.histogram(tl.reshape(binned, [RB * CB], can_reorder=True), NBINS)
    finite = tl.where(bits < _INF_BITS, bits, 0).to(tl.float32, bitcast=True)
    top = tl.maximum(top, finite)
    # (bits - 1) & mask: zero wraps to the top, non-finite stays above every finite nonzero.
    low = tl.minimum(low, (bits - 1) & _ABS_MASK)
    wide = finite.to(tl.float64)
    squares += wide * wide
    return hist, zeros, below, nonfinite, nans, top, low, squares


@triton.jit
def _tile_kernel(tiles, addresses, single, inv_scale, hist_out, extra_out, amax_out, amin_out, sumsq_out, marks,
                 threshold, DTYPE: tl.constexpr, ESIZE: tl.constexpr, SINGLE: tl.constexpr,
                 HAS_SCALE: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr, FIRST_E: tl.constexpr,
                 LAST_BIN: tl.constexpr, NBINS: tl.constexpr, WIDE: tl.constexpr, FOR_LOOP: tl.constexpr,
                 BF16: tl.constexpr):
    pid = tl.program_id(0)
    entry = tiles + pid * 8
    first_element = tl.load(entry + 1)  # in its tensor
    if SINGLE:  # one tensor: passed as it is, no address table
        data = single + first_element
    else:
        data = (tl.load(addresses + tl.load(entry)) + first_element * ESIZE).to(tl.pointer_type(DTYPE))
    n_rows = tl.load(entry + 2)     # rows of the tile
    n_cols = tl.load(entry + 3)     # elements per row (a tensor without lines: rows of CB)
    length = tl.load(entry + 4)     # elements of the tile (the last row may be partial without lines)
    marks_on = tl.load(entry + 5)   # 1: its tensor's lines are counted
    row_marks = marks + tl.load(entry + 6)
    col_marks = marks + tl.load(entry + 7)
    if not WIDE:  # 32-bit index arithmetic unless a tile passes 2**31 elements
        n_rows = n_rows.to(tl.int32)
        n_cols = n_cols.to(tl.int32)
        length = length.to(tl.int32)
    rr = tl.arange(0, RB)
    cc = tl.arange(0, CB)
    if HAS_SCALE:
        # A scale of 0 (collapsed) would make 0 * inf = NaN of every zero: the largest float instead.
        inv = tl.minimum(tl.load(inv_scale), 3.4028234663852886e38)
    else:
        inv = 1.0
    hist = tl.zeros([NBINS], dtype=tl.int32)
    zeros = tl.zeros([RB, CB], dtype=tl.int32)
    below = tl.zeros([RB, CB], dtype=tl.int32)
    nonfinite = tl.zeros([RB, CB], dtype=tl.int32)
    nans = tl.zeros([RB, CB], dtype=tl.int32)
    top = tl.zeros([RB, CB], dtype=tl.float32)
    low = tl.full([RB, CB], _ABS_MASK, dtype=tl.int32)
    squares = tl.zeros([RB, CB], dtype=tl.float64)
    col_blocks = tl.cdiv(n_cols, CB)
    blocks = tl.cdiv(n_rows, RB) * col_blocks
    # Blocks row-major: (rb, cb) carried and wrapped by hand, not divided out of the block's
    # number (a GPU has no integer divider: a division is a sequence of some twenty
    # instructions, per block of 4 elements a thread, in a loop of ~100 PTX instructions per element).
    rb = n_rows * 0
    cb = n_cols * 0
    if FOR_LOOP:  # compiled: a for loop over a loaded bound is software-pipelined
        for b in range(0, blocks):
            hist, zeros, below, nonfinite, nans, top, low, squares = _block(
                data, rb, cb, n_rows, n_cols, length, rr, cc, inv, threshold,
                hist, zeros, below, nonfinite, nans, top, low, squares, HAS_SCALE, FIRST_E, LAST_BIN, NBINS, RB, CB,
                BF16)
            cb += 1
            rb = tl.where(cb == col_blocks, rb + 1, rb)
            cb = tl.where(cb == col_blocks, 0, cb)
    else:  # Triton's interpreter cannot take a loaded loop bound in range() under numpy 2
        b = blocks * 0
        while b < blocks:
            hist, zeros, below, nonfinite, nans, top, low, squares = _block(
                data, rb, cb, n_rows, n_cols, length, rr, cc, inv, threshold,
                hist, zeros, below, nonfinite, nans, top, low, squares, HAS_SCALE, FIRST_E, LAST_BIN, NBINS, RB, CB,
                BF16)
            cb += 1
            rb = tl.where(cb == col_blocks, rb + 1, rb)
            cb = tl.where(cb == col_blocks, 0, cb)
            b += 1
    padding = (blocks * (RB * CB) - length).to(tl.int32)
    n_zero = tl.sum(tl.sum(zeros, axis=1), axis=0)
    if marks_on:
        # The tile's own zeros (its padding lanes read 0), counted in 64 bits: a tile past 2**31
        # elements (WIDE) must not wrap to a count that would skip its zero lines.
        here = tl.sum(tl.sum(zeros.to(tl.int64), axis=1), axis=0) - (blocks * (RB * CB) - length).to(tl.int64)
        zero_rows = _mark_rows(data, n_rows, n_cols, length, rr, cc, here, row_marks, RB, CB, BF16, FOR_LOOP)
        _mark_columns(data, n_rows, n_cols, length, rr, cc, here - zero_rows * n_cols, n_rows - zero_rows, col_marks,
                      RB, CB, BF16, FOR_LOOP)
    n_nonfinite = tl.sum(tl.sum(nonfinite, axis=1), axis=0)
    bins = tl.arange(0, NBINS)
    hist -= tl.where(bins == 0, padding, 0) + tl.where(bins == LAST_BIN, n_nonfinite, 0)
    tl.store(hist_out + pid * NBINS + bins, hist)
    extra = tl.arange(0, _EXTRA)
    values = tl.where(extra == 0, n_zero - padding, 0)
    values += tl.where(extra == 1, tl.sum(tl.sum(below, axis=1), axis=0) - n_zero, 0)
    values += tl.where(extra == 2, n_nonfinite, 0)
    values += tl.where(extra == 3, tl.sum(tl.sum(nans, axis=1), axis=0), 0)
    tl.store(extra_out + pid * _EXTRA + extra, values)
    tl.store(amax_out + pid, tl.max(tl.max(top, axis=1), axis=0))
    tl.store(amin_out + pid, tl.min(tl.min(low, axis=1), axis=0))
    tl.store(sumsq_out + pid, tl.sum(tl.sum(squares, axis=1), axis=0))


@triton.jit
def _slot_rows(start, end, rows, bins, extra_index, hist_in, extra_in, amax_in, amin_in, sumsq_in,
               hist, extra, top, low, squares, NBINS: tl.constexpr):
    """Tiles ``start .. start + ROWS`` (those before ``end``) added to a slot's accumulators."""
    tile = start + rows
    inside = tile < end
    block = tl.load(hist_in + tile[:, None] * NBINS + bins[None, :], mask=inside[:, None], other=0)
    hist += tl.sum(block.to(tl.int64), axis=0)
    more = tl.load(extra_in + tile[:, None] * _EXTRA + extra_index[None, :], mask=inside[:, None], other=0)
    extra += tl.sum(more.to(tl.int64), axis=0)
    top = tl.maximum(top, tl.load(amax_in + tile, mask=inside, other=0.0))
    low = tl.minimum(low, tl.load(amin_in + tile, mask=inside, other=_ABS_MASK))
    squares += tl.load(sumsq_in + tile, mask=inside, other=0.0)
    return hist, extra, top, low, squares


@triton.jit
def _line_zeros(lines, marks, tensor, BLOCK: tl.constexpr, FOR_LOOP: tl.constexpr):
    """The elements in the unmarked rows and columns of one tensor's 2-D view (0 without lines)."""
    n_rows = tl.load(lines + tensor * 4)
    n_cols = tl.load(lines + tensor * 4 + 1)
    row_marks = marks + tl.load(lines + tensor * 4 + 2)
    col_marks = marks + tl.load(lines + tensor * 4 + 3)
    offsets = tl.arange(0, BLOCK)
    rows = tl.zeros([BLOCK], dtype=tl.int64)
    cols = tl.zeros([BLOCK], dtype=tl.int64)
    if FOR_LOOP:
        for start in range(0, n_rows, BLOCK):
            rows += tl.load(row_marks + start + offsets, mask=start + offsets < n_rows, other=0).to(tl.int64)
        for start in range(0, n_cols, BLOCK):
            cols += tl.load(col_marks + start + offsets, mask=start + offsets < n_cols, other=0).to(tl.int64)
    else:
        start = n_rows * 0
        while start < n_rows:
            rows += tl.load(row_marks + start + offsets, mask=start + offsets < n_rows, other=0).to(tl.int64)
            start += BLOCK
        start = n_cols * 0
        while start < n_cols:
            cols += tl.load(col_marks + start + offsets, mask=start + offsets < n_cols, other=0).to(tl.int64)
            start += BLOCK
    zero_rows = n_rows - tl.sum(rows, axis=0)
    zero_cols = n_cols - tl.sum(cols, axis=0)
    return zero_rows * n_cols + zero_cols * n_rows - zero_rows * zero_cols


@triton.jit
def _slot_kernel(first, hist_in, extra_in, amax_in, amin_in, sumsq_in, lines, marks, n_tensors, results, amax_at,
                 amin_at, sumsq_at, line_zeros_at, STRIDE: tl.constexpr, ABOVE_AT: tl.constexpr, ROWS: tl.constexpr,
                 FIRST_E: tl.constexpr, BINS: tl.constexpr, NBINS: tl.constexpr, PER_TENSOR: tl.constexpr,
                 LINE_BLOCK: tl.constexpr, FOR_LOOP: tl.constexpr):
    """One program per slot: its tiles' results added in tile order, and its tensors' zero lines,
    written into the packed ``results`` (uint8: the fields at the given byte offsets)."""
    counts = results.to(tl.pointer_type(tl.int64), bitcast=True)
    amax = (results + amax_at).to(tl.pointer_type(tl.float32), bitcast=True)
    amin = (results + amin_at).to(tl.pointer_type(tl.int32), bitcast=True)
    sumsq = (results + sumsq_at).to(tl.pointer_type(tl.float64), bitcast=True)
    line_zeros = (results + line_zeros_at).to(tl.pointer_type(tl.int64), bitcast=True)
    slot = tl.program_id(0)
    begin = tl.load(first + slot)
    end = tl.load(first + slot + 1)
    bins = tl.arange(0, NBINS)
    rows = tl.arange(0, ROWS)
    extra_index = tl.arange(0, _EXTRA)
    hist = tl.zeros([NBINS], dtype=tl.int64)
    extra = tl.zeros([_EXTRA], dtype=tl.int64)
    top = tl.zeros([ROWS], dtype=tl.float32)
    low = tl.full([ROWS], _ABS_MASK, dtype=tl.int32)
    squares = tl.zeros([ROWS], dtype=tl.float64)
    if FOR_LOOP:
        for start in range(begin, end, ROWS):
            hist, extra, top, low, squares = _slot_rows(start, end, rows, bins, extra_index, hist_in, extra_in,
                                                        amax_in, amin_in, sumsq_in, hist, extra, top, low, squares,
                                                        NBINS)
    else:
        start = begin
        while start < end:
            hist, extra, top, low, squares = _slot_rows(start, end, rows, bins, extra_index, hist_in, extra_in,
                                                        amax_in, amin_in, sumsq_in, hist, extra, top, low, squares,
                                                        NBINS)
            start += ROWS
    n_zero = tl.sum(tl.where(extra_index == 0, extra, 0), axis=0)
    n_below = tl.sum(tl.where(extra_index == 1, extra, 0), axis=0)
    n_nonfinite = tl.sum(tl.where(extra_index == 2, extra, 0), axis=0)
    n_nan = tl.sum(tl.where(extra_index == 3, extra, 0), axis=0)
    base = counts + slot * STRIDE  # zeroed by the caller: only these entries are written
    # Codes are bits >> 22 (exponent field, then the top mantissa bit); decode() reads the sum
    # per exponent field and maps it onto its bin, so bin b's count goes under the code of one
    # binade in it: bin 0 under exponent 0 (decode takes the zeros off there), bin b under
    # exponent FIRST_E + b. A bin whose exponent lies outside 1..254 holds no finite element.
    exponent = tl.where(bins == 0, 0, FIRST_E + bins)
    usable = (bins < BINS) & ((bins == 0) | ((exponent >= 1) & (exponent <= 254)))
    tl.store(base + 2 * exponent, hist, mask=usable)
    tl.store(base + 510, n_nonfinite - n_nan)  # inf
    tl.store(base + 511, n_nan)
    tl.store(base + ABOVE_AT + 1, n_below)
    tl.store(base + ABOVE_AT + 2, n_zero)
    tl.store(amax + slot, tl.max(top, axis=0))
    tl.store(amin + slot, tl.min(low, axis=0))
    tl.store(sumsq + slot, tl.sum(squares, axis=0))
    if PER_TENSOR:
        tl.store(line_zeros + slot, _line_zeros(lines, marks, slot, LINE_BLOCK, FOR_LOOP))
    else:  # one slot: every tensor's
        total = _line_zeros(lines, marks, 0, LINE_BLOCK, FOR_LOOP)
        if FOR_LOOP:
            for tensor in range(1, n_tensors):
                total += _line_zeros(lines, marks, tensor, LINE_BLOCK, FOR_LOOP)
        else:
            tensor = n_tensors * 0 + 1
            while tensor < n_tensors:
                total += _line_zeros(lines, marks, tensor, LINE_BLOCK, FOR_LOOP)
                tensor += 1
        tl.store(line_zeros + slot, total)
