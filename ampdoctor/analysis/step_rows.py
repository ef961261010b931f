"""Every rank's step rows as the layer scan keeps them: in chunks, each without the columns it
holds no value in (a light step row records its peak and norm, not its counts or histograms).

A run of 1,024 ranks has millions of step rows; six count columns and two histogram columns of
eight bytes a row, null on 99 rows in 100, would be a third of a report's memory. The consumers
(:func:`~ampdoctor.analysis.steps.load_steps`, the report's and the postmortem's per-rank reading)
read one column at a time, or a few: :meth:`StepRows.column` builds one whole column, nulls
included, only when asked. Limits: a column is built anew at each call (the consumers ask each
once or twice); the chunks share the run schema's types, with no dictionary columns.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa

from ..run_file.segment import COLUMN_TYPES

# Left out of a chunk where every row of it is null there.
SPARSE_STEP_COLUMNS = ("n_zero", "n_subnormal", "n_nan", "n_inf", "n_zero_lines", "n_underflow", "hist",
                       "underflow_hist")


class StepRows:
    """Step rows in chunks (record batches of the columns ``names``, a sparse one left out where
    all null), read as one table: ``num_rows``, ``column_names``, ``column``, ``select``,
    ``filter``, ``schema`` (what pyarrow's ``Table`` offers for these)."""

    def __init__(self, names: Sequence[str], chunks: list[pa.RecordBatch] | None = None,
                 types: dict[str, pa.DataType] | None = None) -> None:
        self.column_names = list(names)
        self._chunks: list[pa.RecordBatch] = []
        self._types = dict(types or {})
        for chunk in chunks or []:
            self.append(chunk)

    def append(self, batch: pa.RecordBatch) -> None:
        """Rows with (at least) every column of ``names``; kept without their all-null sparse ones."""
        keep = []
        for name in self.column_names:
            column = batch.column(name)
            self._types.setdefault(name, column.type)
            if not (name in SPARSE_STEP_COLUMNS and column.null_count == len(column)):
                keep.append(name)
        self._chunks.append(batch.select(keep))

    @property
    def schema(self) -> pa.Schema:
        return pa.schema([(name, self._types.get(name, COLUMN_TYPES.get(name))) for name in self.column_names])

    @property
    def num_rows(self) -> int:
        return sum(c.num_rows for c in self._chunks)

    def column(self, name: str) -> pa.Array:
        """The whole column, in the rows' order (built now: one column's memory)."""
        kind = self._types.get(name, COLUMN_TYPES.get(name))
        parts = [c.column(name) if name in c.schema.names else pa.nulls(c.num_rows, kind) for c in self._chunks]
        if not parts:
            return pa.array([], kind)
        return pa.concat_arrays(parts) if len(parts) > 1 else parts[0]

    def select(self, names: Sequence[str]) -> pa.Table:
        return pa.table({name: self.column(name) for name in names})

    def filter(self, mask) -> "StepRows":
        """The rows where ``mask`` (one boolean per row) is true."""
        mask = np.asarray(mask.to_numpy(zero_copy_only=False) if hasattr(mask, "to_numpy") else mask, dtype=bool)
        out = StepRows(self.column_names, types=self._types)
        start = 0
        for chunk in self._chunks:
            part = chunk.filter(pa.array(mask[start:start + chunk.num_rows]))
            start += chunk.num_rows
            out._chunks.append(part)
        return out
