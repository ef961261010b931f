"""The run file's ``hist`` column, written and read (docs/run-file.md, "The hist column").

**Schema version 2** stores each binade histogram as a variable-length ``list<int32>`` of exactly
``hist.bins`` counts (the segment's metadata), null on light rows. **Version 1** stored a
``fixed_size_list<int32>[bins]``. Why the change: a null entry of a fixed-size list is written in
Parquet as an empty list, and pyarrow before 26.0 cannot read that back (``Expected all lists to be
of size=64 but index 2 had size=0``), while pyarrow 15 to 24 cannot even write one with a null
between two values (``Lists with non-zero length null components are not supported``). So a v1 run
with light rows, which is every run at the default ``every=100``, is readable only by pyarrow >= 26,
and recording stopped at the first flush under pyarrow 15 to 24. A variable-length list with the
same nulls round-trips on every pyarrow from 14 to 26, costs four bytes of offset per row before
compression, and reads into the same ``[rows, bins]`` matrix.

The readers accept both versions (and the large-list variant another tool's rewrite may produce):
:func:`as_hist_column` turns any of them into version 2's type, checking that every histogram has
``bins`` counts, and :func:`hist_matrix` turns that into a dense matrix for the analyses.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

HIST_TYPE = pa.list_(pa.int32())

# The first pyarrow that reads a version 1 segment whose ``hist`` column holds nulls.
READS_V1_NULLS = (26, 0)
_V1_NULLS_ERROR = re.compile(r"Expected all lists to be of size=\d+ but index \d+ had size=0")


class BadHistogram(ValueError):
    """A ``hist`` column that is not ``bins`` int32 counts per row: the segment is damaged."""


def is_hist_type(type_: pa.DataType) -> bool:
    """Whether a segment's ``hist`` column has a type the readers accept: int32 counts in a list
    (version 2), a large list (another tool's rewrite) or a fixed-size list (version 1)."""
    listlike = pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_fixed_size_list(type_)
    return listlike and type_.value_type == pa.int32()


def hist_array(parts: list[np.ndarray], bins: int) -> pa.ListArray:
    """The ``hist`` column of a segment being written: ``parts`` are 2-D int32 blocks of ``bins``
    columns (full rows) or 1-D object blocks of None (light rows, null)."""
    lengths, flat = [], []
    for block in parts:
        if block.ndim == 2:
            if block.shape[1] != bins:
                raise ValueError(f"a histogram block of {block.shape[1]} bins in a run of {bins}")
            lengths.append(np.full(len(block), bins, dtype=np.int64))
            flat.append(np.ascontiguousarray(block, dtype=np.int32).reshape(-1))
        else:
            lengths.append(np.zeros(len(block), dtype=np.int64))
    length = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    offsets = np.zeros(len(length) + 1, dtype=np.int32)
    np.cumsum(length, out=offsets[1:])
    values = pa.array(np.concatenate(flat) if flat else np.zeros(0, np.int32), type=pa.int32())
    null = length == 0
    # A null list with a zero-length span: the form every pyarrow from 14 on writes and reads.
    return pa.ListArray.from_arrays(pa.array(offsets), values, mask=pa.array(null) if null.any() else None)


def as_hist_column(column: pa.Array | pa.ChunkedArray, bins: int) -> pa.Array:
    """``column`` (any accepted ``hist`` type) as version 2's ``list<int32>``, one array. Raises
    :class:`BadHistogram` when a non-null row does not hold exactly ``bins`` counts."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks else pa.array([], HIST_TYPE)
    if pa.types.is_fixed_size_list(column.type):
        if column.type.list_size != bins:
            raise BadHistogram(f"hist column of {column.type.list_size} bins where hist.bins says {bins}")
        offsets = np.arange(len(column) + 1, dtype=np.int64) * bins
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        # Every row's counts, a null row's too (stored, never read): ``flatten`` would drop those.
        values = column.values.slice(column.offset * bins, len(column) * bins)
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values,
                                        mask=pa.array(~valid) if not valid.all() else None)
    if pa.types.is_large_list(column.type):
        column = column.cast(HIST_TYPE)
    if column.null_count < len(column):
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        wrong = valid & (lengths != bins)
        if wrong.any():
            raise BadHistogram(f"a histogram of {int(lengths[wrong][0])} counts where hist.bins says {bins}")
    return column


def hist_matrix(column: pa.Array | pa.ChunkedArray, bins: int) -> np.ndarray:
    """The histograms as float32 ``[rows, bins]``, zeros on null rows (exact below 2^24 per bin;
    half the memory traffic of float64 on the report's hottest path). ``column`` is a ``hist``
    column as the reader returns it (:func:`as_hist_column`)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks else pa.array([], HIST_TYPE)
    out = np.zeros((len(column), bins), dtype=np.float32)
    if column.null_count == len(column):
        return out
    values = np.asarray(column.flatten(), dtype=np.float32)  # the valid rows' counts, in order
    if column.null_count == 0:
        return values.reshape(len(column), bins)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    out[valid] = values.reshape(-1, bins)
    return out


def pyarrow_too_old_for(exc: BaseException) -> str | None:
    """Why the installed pyarrow failed to read a segment, when the cause is its own age rather
    than the file: a version 1 ``hist`` column with null rows, which pyarrow before 26 cannot
    read back. None for any other failure."""
    if not _V1_NULLS_ERROR.search(str(exc)):
        return None
    installed = pa.__version__
    needed = ".".join(map(str, READS_V1_NULLS))
    return (f"written in run schema version 1, whose histogram column pyarrow {installed} cannot read "
            f"(pyarrow >= {needed} can; it needs Python >= 3.11 and numpy >= 2): "
            f"pip install 'pyarrow>={needed}'")
