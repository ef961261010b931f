"""The run file's ``hist`` column, written and read (docs/run-file.md, "The hist column").

**Schema version 2** stores each binade histogram as a variable-length ``list<int64>`` of exactly
``hist.bins`` counts (the segment's metadata), null on light rows. **Version 1** stored a
``fixed_size_list<int32>[bins]``. Why the change: a null entry of a fixed-size list is written in
Parquet as an empty list, and pyarrow before 26.0 cannot read that back (``Expected all lists to be
of size=64 but index 2 had size=0``), while pyarrow 14 to 24 cannot even write one with a null
between two values (``Lists with non-zero length null components are not supported``). So a v1 run
with light rows, which is every run at the default ``every=100``, is readable only by pyarrow >= 26,
and recording stopped at the first flush under pyarrow 14 to 24. A variable-length list with the
same nulls round-trips on every pyarrow from 14 to 26 and reads into the same ``[rows, bins]``
matrix. The counts became int64 with it: the step row's histogram sums every gradient of the step,
and a model of more than 2**31 parameters in one binade wrapped an int32.

The readers accept both versions (and the large-list variant another tool's rewrite may produce):
:func:`as_hist_column` turns any of them into version 2's type, checking that every histogram has
``bins`` counts, and :func:`hist_matrix` turns that into a dense matrix for the analyses.
:func:`unreadable_here` says, from a segment's footer, when the installed pyarrow cannot read its
histograms, so that the readers skip it whole and name the fix instead of calling it damaged.
"""

from __future__ import annotations

import re
import sys

import numpy as np
import pyarrow as pa

from ..dependencies import release

HIST_TYPE = pa.list_(pa.int64())
_LARGE_HIST_TYPE = pa.large_list(pa.int64())
LIST_VALUES = 2**31  # a list array's int32 offsets address fewer values than this; the large variant more

# The first pyarrow that reads a version 1 segment whose ``hist`` column holds nulls.
READS_V1_NULLS = (26, 0)
_V1_NULLS_ERROR = re.compile(r"Expected all lists to be of size=\d+ but index \d+ had size=0")


class BadHistogram(ValueError):
    """A ``hist`` column that is not ``bins`` counts per row: the segment is damaged."""


def is_hist_type(type_: pa.DataType) -> bool:
    """Whether a segment's ``hist`` column has a type the readers accept: integer counts in a list
    (version 2), a large list (another tool's rewrite) or a fixed-size list (version 1)."""
    listlike = pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_fixed_size_list(type_)
    return listlike and type_.value_type in (pa.int32(), pa.int64())


def hist_array(parts: list[np.ndarray], bins: int) -> pa.Array:
    """The ``hist`` column (or ``fine_hist``, of its own ``bins``) of a segment being written:
    ``parts`` are 2-D integer blocks of ``bins`` columns (full rows) or 1-D object blocks of None
    (light rows, null) or of some rows' counts. A ``list<int64>``, or
    its large variant when the counts of one segment pass 2**31 values (int32 offsets)."""
    lengths, flat = [], []
    for block in parts:
        if block.ndim == 2:
            if block.shape[1] != bins:
                raise ValueError(f"a histogram block of {block.shape[1]} bins in a run of {bins}")
            lengths.append(np.full(len(block), bins, dtype=np.int64))
            flat.append(np.ascontiguousarray(block, dtype=np.int64).reshape(-1))
        else:  # (an object block: None, or a row's counts where some rows have them: GEMM rows)
            present = [v for v in block if v is not None]
            if any(len(v) != bins for v in present):
                raise ValueError(f"a histogram of another length than {bins} bins")
            lengths.append(np.array([0 if v is None else bins for v in block], dtype=np.int64))
            if present:
                flat.append(np.concatenate([np.asarray(v, dtype=np.int64) for v in present]))
    length = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    values = pa.array(np.concatenate(flat) if flat else np.zeros(0, np.int64), type=pa.int64())
    return _lists(length, values)


def _lists(length: np.ndarray, values: pa.Array) -> pa.Array:
    """Lists of ``length[i]`` of ``values`` each, a zero length being a null list (the form every
    pyarrow from 14 on writes and reads); the large variant past :data:`LIST_VALUES` values."""
    large = int(length.sum()) >= LIST_VALUES
    offsets = np.zeros(len(length) + 1, dtype=np.int64 if large else np.int32)
    np.cumsum(length, out=offsets[1:])
    null = length == 0
    cls = pa.LargeListArray if large else pa.ListArray
    return cls.from_arrays(pa.array(offsets), values, mask=pa.array(null) if null.any() else None)


def as_hist_column(column: pa.Array | pa.ChunkedArray, bins: int) -> pa.Array:
    """``column`` (any accepted ``hist`` type) as version 2's ``list<int64>``, one array. Raises
    :class:`BadHistogram` when a non-null row does not hold exactly ``bins`` counts, or holds a
    null count."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks else pa.array([], HIST_TYPE)
    if pa.types.is_fixed_size_list(column.type):
        if column.type.list_size != bins:
            raise BadHistogram(f"hist column of {column.type.list_size} bins where hist.bins says {bins}")
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        # The valid rows' counts only: a null row's stored counts are never read, nor kept.
        column = _lists(valid * np.int64(bins), column.flatten().cast(pa.int64()))
    elif pa.types.is_large_list(column.type) or column.type.value_type != pa.int64():
        # One type for every segment, so that they concatenate: the large variant only when needed.
        span = np.asarray(column.offsets)[[0, -1]] if pa.types.is_large_list(column.type) else (0, 0)
        column = column.cast(_LARGE_HIST_TYPE if span[1] - span[0] >= LIST_VALUES else HIST_TYPE)
    if column.null_count < len(column):
        offsets = np.asarray(column.offsets)  # this (maybe sliced) array's n + 1 offsets
        lengths = np.diff(offsets)
        wrong = lengths != bins
        if column.null_count:
            wrong &= column.is_valid().to_numpy(zero_copy_only=False)
        if wrong.any():
            raise BadHistogram(f"a histogram of {int(lengths[wrong][0])} counts where hist.bins says {bins}")
        if column.values.null_count and column.values.slice(offsets[0], offsets[-1] - offsets[0]).null_count:
            raise BadHistogram("a histogram with a null count")
    return column


def hist_matrix(column: pa.Array | pa.ChunkedArray, bins: int, dtype=np.float32) -> np.ndarray:
    """The histograms as a ``[rows, bins]`` matrix, zeros on null rows. float32 by default (exact
    below 2^24 per bin; half the memory traffic of float64 on the report's hottest path); float64
    where sums of many rows must stay exact. ``column`` is a ``hist`` column as the reader returns
    it (:func:`as_hist_column`): the counts are read in place, converted once."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks else pa.array([], HIST_TYPE)
    if column.null_count == len(column):
        return np.zeros((len(column), bins), dtype=dtype)
    offsets = np.asarray(column.offsets)
    counts = np.asarray(column.values.slice(offsets[0], offsets[-1] - offsets[0]))
    if column.null_count == 0:
        return counts.reshape(len(column), bins).astype(dtype)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    if np.diff(offsets)[~valid].any():  # null rows spanning counts (another writer's): skip them
        counts = np.asarray(column.flatten())
    out = np.zeros((len(column), bins), dtype=dtype)
    out[valid] = counts.reshape(-1, bins)
    return out


def _pyarrow_release() -> tuple[int, ...]:
    return release(pa.__version__)


def unreadable_here(hist_type: pa.DataType | None, null_rows: int | None) -> str | None:
    """Why the installed pyarrow cannot read a segment's histograms, or None: a version 1
    (fixed-size) ``hist`` column with null rows (``null_rows`` from the footer's statistics;
    None when they do not say) under pyarrow before 26."""
    if hist_type is None or not pa.types.is_fixed_size_list(hist_type) or null_rows == 0:
        return None
    return None if _pyarrow_release() >= READS_V1_NULLS else _too_old_message()


def pyarrow_too_old_for(exc: BaseException) -> str | None:
    """The same reason, from the error pyarrow raised while reading (the footer's statistics may
    not have said): None for any other failure."""
    return _too_old_message() if _V1_NULLS_ERROR.search(str(exc)) else None


def _too_old_message() -> str:
    """What to do, for this environment: pyarrow >= 26 needs Python >= 3.11 and numpy 2."""
    needed = ".".join(map(str, READS_V1_NULLS))
    why = f"written in run schema version 1, whose histogram column pyarrow {pa.__version__} cannot read"
    if sys.version_info < (3, 11):
        return (f"{why} (pyarrow >= {needed} can, on Python >= 3.11): convert it once where that is installed "
                f"with `ampdoctor migrate RUN`, and every supported pyarrow reads it")
    import numpy  # the one in use (pyarrow 26 refuses numpy 1 at import)
    install = f"pip install 'pyarrow>={needed}'" + (" 'numpy>=2'" if release(numpy.__version__) < (2,) else "")
    return (f"{why} (pyarrow >= {needed} can): {install}, or convert it once where that is installed with "
            f"`ampdoctor migrate RUN`")
