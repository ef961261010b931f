"""A read run's rows as one SQL table, in an embedded query engine (DuckDB).

What the commands ask of a whole run but want only a little of (a count per kind, the steps of
one rank, the rows of a few steps, a maximum per module) is a query here: the engine reads only
the columns a query names, skips row groups by the footers' statistics, uses every core and
stays within :data:`MEMORY_LIMIT`, whatever the run's size; only the answer becomes Arrow. The
streaming numpy pass of the layer scan (:mod:`ampdoctor.analysis.layer_scan`) stays where the
arithmetic must be exactly the analyses' own.

The table ``rows`` holds every row of the run's segments (``Run.segments``: one run id, readable
here) less those a later process superseded (``Segment.until``), with three more columns:
``segment`` (the segment's index in ``Run.segments``), ``segment_row`` (the row's index in its
file) and ``position`` (both as one number), so that ``ORDER BY position`` is the order
``Run.table`` reads. Columns a segment lacks (an older schema version) are NULL. The scalar columns of the run schema are in it
(:data:`COLUMNS`), and with ``lists=True`` the histograms and the call graph's lists (:data:`LISTS`)
where every segment has schema version 2's types (version 1's fixed-size histograms stay with
pyarrow's reader: :class:`NoLists`).

A segment the engine cannot read (damaged past its footer, removed since it was listed) is found
with pyarrow and skipped with the warning every reader gives, and the query run again; a failure
no segment explains is :class:`EngineCannot`, and the caller reads with pyarrow.
"""

from __future__ import annotations

import os
import tempfile
from typing import Iterator, Sequence

import pyarrow as pa

from ..errors import one_line
from ..run_file.segment import COLUMN_TYPES, as_column_type

# The run schema's scalar columns (docs/run-file.md): what ``rows`` holds.
COLUMNS = ("step", "rank", "kind", "name", "order", "dtype", "numel", "scale", "skipped", "loss", "amax", "amin",
           "l2", "n_zero", "n_subnormal", "n_nan", "n_inf", "n_zero_lines", "n_underflow", "call", "parent")
LISTS = ("hist", "underflow_hist", "inputs", "computed_inputs", "fine_hist")  # with ``lists=True``
# A row's verdicts, in SQL every engine runs (partials.py reuses them): finite means between
# ±3.5e38 (float32's largest is 3.40e38; NaN is outside on DuckDB, Spark and Trino alike); a row
# is non-finite as the layer scan judges it: its counts say so (a null count says nothing), or a
# light row's peak is not a number.
FINITE = "({x} < 3.5e38 AND {x} > -3.5e38)"
NONFINITE = ("(COALESCE(n_nan + n_inf > 0, false) OR (n_zero IS NULL AND NOT COALESCE("
             + FINITE.format(x="amax") + ", false)))")
MEMORY_LIMIT = "512MB"  # the engine's own buffers (Arrow results come on top): docs/benchmarks.md
SORT_MEMORY_LIMIT = "256MB"  # a streamed answer's (present_batches): the sort spills beyond it
_SQL_TYPES = {"step": "BIGINT", "rank": "INTEGER", "kind": "VARCHAR", "name": "VARCHAR", "order": "INTEGER",
              "dtype": "VARCHAR", "numel": "BIGINT", "scale": "FLOAT", "skipped": "BOOLEAN", "loss": "FLOAT",
              "amax": "FLOAT", "amin": "FLOAT", "l2": "FLOAT", "n_zero": "BIGINT", "n_subnormal": "BIGINT",
              "n_nan": "BIGINT", "n_inf": "BIGINT", "n_zero_lines": "BIGINT", "n_underflow": "BIGINT",
              "call": "INTEGER", "parent": "INTEGER", "hist": "BIGINT[]", "underflow_hist": "BIGINT[]",
              "inputs": "INTEGER[]", "computed_inputs": "INTEGER[]", "fine_hist": "BIGINT[]",
              "block_stats": "DOUBLE[]"}


class EngineCannot(Exception):
    """What the engine cannot read as the run's readers do: the caller reads with pyarrow instead.
    A run whose lists are not version 2's (:class:`NoLists`), a segment path the engine would read
    as a pattern (``*``, ``?``, ``[``), an answer streamed part way when a segment failed, a
    failure no unreadable segment explains (files another tool rewrote in types it does not
    unify)."""


class NoLists(EngineCannot):
    """The run's histograms are not all of schema version 2's type (``list<int64>``): a query that
    wants the list columns reads with pyarrow instead (:func:`lists_here`)."""


def lists_here(run) -> bool:
    """Whether ``rows`` can hold the list columns (:data:`LISTS`): every segment's ``hist`` is
    version 2's list (version 1's fixed-size lists stay with pyarrow's reader)."""
    return all(s.hist_type is not None and pa.types.is_list(s.hist_type) and s.hist_type.value_type == pa.int64()
               for s in run.segments if s.rows)


class Session:
    """One connection to the engine over a run's segments, for several queries (``with``, or
    :meth:`close`). ``lists``: ``rows`` has the list columns too (:data:`LISTS`; :class:`NoLists`
    where not :func:`lists_here`). ``present``: a column the session's queries want values of:
    ``rows`` leaves out the segments whose footers say it holds none there (not read at all)."""

    def __init__(self, run, lists: bool = False, memory_limit: str = MEMORY_LIMIT, present: str | None = None) -> None:
        import duckdb

        if lists and not lists_here(run):
            raise NoLists()
        if any(c in str(s.path) for s in run.segments for c in "*?["):
            raise EngineCannot("a segment's path holds a pattern character")
        self.run, self.lists, self.present = run, lists, present
        # What does not fit in ``memory_limit`` (a sort of many rows) spills to a directory of
        # the session's own, removed on close (DuckDB's default is ".tmp" in the current directory).
        self._spill = tempfile.TemporaryDirectory(prefix="ampdoctor-engine-")
        self._connection = duckdb.connect(":memory:", config={"threads": _cores(), "memory_limit": memory_limit,
                                                              "temp_directory": self._spill.name})
        self._connection.execute("SET enable_progress_bar = false")  # (it would print on a terminal)
        # The segments' footers read once for the session's queries, not once a query.
        self._connection.execute("SET enable_object_cache = true")
        self._registered = False

    def query(self, sql: str, params: Sequence | None = None, tables: dict[str, pa.Table] | None = None) -> pa.Table:
        """The answer of ``sql`` (over the table ``rows``, see the module docstring) as Arrow.
        ``tables``: more tables the query names (small ones: keys to join)."""
        import duckdb

        for name, table in (tables or {}).items():
            self._connection.register(name, table)
        while True:
            try:
                return self._answer(sql, params)
            except duckdb.Error as exc:
                # A segment whose data the engine could not read: found and skipped with a warning,
                # as Run.table skips it (Run raises RunError when none is left), and the query run
                # again; a failure no segment explains (or out of memory, which no segment
                # explains: not probed): the caller reads with pyarrow.
                if isinstance(exc, duckdb.OutOfMemoryException) or not self._skip_unreadable():
                    raise EngineCannot(one_line(f"the query engine failed on this run ({exc})")) from None

    def _answer(self, sql: str, params: Sequence | None) -> pa.Table:
        if not self._registered:
            _register(self._connection, self.run, self.lists, self.present)
            self._registered = True
        connection = self._connection
        return arrow_of(connection.sql(sql, params=list(params)) if params else connection.sql(sql))

    def batches(self, sql: str, rows: int = 4096) -> Iterator[pa.RecordBatch]:
        """The answer of ``sql`` as record batches of at most ``rows`` rows, streamed (for an
        answer too large to hold at once). A segment that fails to read part way: skipped with its
        warning, then :class:`EngineCannot` (what was streamed is not the whole answer)."""
        import duckdb

        self.query("SELECT 1")  # (registers the views)
        try:
            relation = self._connection.sql(sql)
            # (DuckDB 2 renamed the reader; 1.0 has fetch_arrow_reader, which 2 keeps)
            reader = getattr(relation, "to_arrow_reader", None) or relation.fetch_arrow_reader
            yield from reader(rows)
        except duckdb.Error as exc:
            if not isinstance(exc, duckdb.OutOfMemoryException):
                self._skip_unreadable()
            raise EngineCannot(one_line(f"the query engine failed part way through a streamed answer ({exc})")
                               ) from None

    def _skip_unreadable(self) -> bool:
        """Read each segment with pyarrow; those that fail are marked unreadable in the run, with
        its warning. Whether any was (the views then leave it
        out). Raises RunError when none is left."""
        found = False
        for segment in self.run.segments:
            if segment.path in self.run.unreadable_segments or not segment.rows:
                continue
            if self.run.read_failure(segment, None):  # (every column: what Run.frame reads)
                found = True
        self._registered = not found and self._registered
        return found

    def close(self) -> None:
        self._connection.close()
        self._spill.cleanup()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def query(run, sql: str, params: Sequence | None = None, lists: bool = False) -> pa.Table:
    """The answer of one query (see :class:`Session`), on a connection of its own. ``run``: a
    read :class:`~ampdoctor.read.run.Run`."""
    with Session(run, lists) as session:
        return session.query(sql, params)


def _cores() -> int:
    """The cores this process may use (a container's quota, not the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _register(connection, run, lists: bool, present: str | None = None, by_index: bool | None = None) -> None:
    """The view ``rows`` over the run's segments (see the module docstring; ``present``: see
    :class:`Session`). Each row's segment comes from its file's index in the listing (DuckDB 1.3's
    ``file_index``, a constant per file), else (``by_index`` False, or an older DuckDB) from a
    join on each row's file name, which costs a third of a simple query's time."""
    import duckdb

    segments = [s for s in run.segments if s.rows and s.path not in run.unreadable_segments
                and (present is None or s.present.get(present) != 0)]
    names = COLUMNS + (LISTS if lists else ())
    if not segments:
        columns = ", ".join(f"NULL::{_SQL_TYPES[c]} AS {_quoted(c)}" for c in names)
        connection.execute(f"CREATE OR REPLACE VIEW rows AS SELECT {columns}, NULL::INTEGER AS segment, "
                           f"NULL::BIGINT AS segment_row, NULL::BIGINT AS position WHERE false")
        return
    index = {id(s): i for i, s in enumerate(run.segments)}
    numbers, untils = [index[id(s)] for s in segments], [s.until for s in segments]
    present = _columns_present(segments, names)
    # Segments of one schema are read by position (each file's schema bound only when read: the
    # binding of thousands at once holds their footers, about 50 KB each); of several, by name.
    union = "true" if len({s.columns for s in segments}) > 1 else "false"
    columns = ", ".join(f"CAST({_quoted(c)} AS {_SQL_TYPES[c]}) AS {_quoted(c)}" if c in present
                        else f"NULL::{_SQL_TYPES[c]} AS {_quoted(c)}" for c in names)
    listing = "[" + ", ".join(_literal(str(s.path)) for s in segments) + "]"
    if by_index is not False:
        try:
            connection.execute(f"CREATE OR REPLACE VIEW rows AS SELECT {columns}, "
                               + _by_file_index(numbers, untils, listing, union))
            return
        except duckdb.BinderException:  # (no file_index before DuckDB 1.3)
            if by_index:
                raise
    files = pa.table({"filename": [str(s.path) for s in segments], "segment": pa.array(numbers, pa.int32()),
                      "until": pa.array(untils, pa.int64())})
    connection.register("segment_files", files)  # (replaces an earlier registration)
    connection.execute(
        f"CREATE OR REPLACE VIEW rows AS SELECT {columns}, f.segment AS segment, p.file_row_number AS segment_row, "
        f"f.segment::BIGINT * 4294967296 + p.file_row_number AS position "
        f"FROM read_parquet({listing}, union_by_name = {union}, filename = true, file_row_number = true) p "
        f"JOIN segment_files f ON p.filename = f.filename WHERE f.until IS NULL OR p.step < f.until")


def _by_file_index(numbers: list[int], untils: list[int | None], listing: str, union: str) -> str:
    """The rest of the view's SELECT: segment, segment_row and position by each file's index in
    the listing (``numbers``: their segment numbers; ``untils``: their Segment.until)."""
    at = "[file_index::BIGINT + 1]"
    segment = ("file_index::BIGINT" if numbers == list(range(len(numbers)))
               else f"[{', '.join(map(str, numbers))}]{at}::BIGINT")
    until = "[" + ", ".join("NULL" if u is None else str(int(u)) for u in untils) + "]" + at
    where = "" if all(u is None for u in untils) else f" WHERE {until} IS NULL OR step < {until}"
    return (f"({segment})::INTEGER AS segment, file_row_number AS segment_row, "
            f"({segment}) * 4294967296 + file_row_number AS position "
            f"FROM read_parquet({listing}, union_by_name = {union}, file_row_number = true){where}")


def _columns_present(segments, names) -> set[str]:
    """The columns of ``names`` some segment has, by their footers (a column no segment has
    cannot be named in a query of them: NULL instead)."""
    return {c for s in segments for c in s.columns} & set(names)


def arrow_of(relation) -> pa.Table:
    """A query's answer as an Arrow table (DuckDB 2 renamed the call)."""
    fetch = getattr(relation, "to_arrow_table", None) or relation.fetch_arrow_table
    return fetch()


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _ordered(columns: Sequence[str], where: str, kinds: Sequence[str] | None) -> str:
    """The query of ``columns`` of the rows ``where`` holds (of ``kinds``, when given), in the run's order."""
    of_kinds = "" if kinds is None else " AND kind IN (" + ", ".join(_literal(k) for k in kinds) + ")"
    return f"SELECT {', '.join(_quoted(c) for c in columns)} FROM rows WHERE {where}{of_kinds} ORDER BY position"


def _typed(answer, columns: Sequence[str]) -> list[pa.Array]:
    """An answer's ``columns`` in the run schema's types."""
    return [as_column_type(answer.column(c), COLUMN_TYPES[c]) for c in columns]


def steps_rows(run, columns: Sequence[str], steps: Sequence[int], kinds: Sequence[str] | None = None) -> pa.Table:
    """Every row of ``steps`` (of ``kinds``, when given) with ``columns``, in the run's order and
    the run schema's types: ``Run.table(columns, kinds, steps)``, which it is where the engine
    cannot read the run (:class:`EngineCannot`)."""
    wanted = ", ".join(str(int(s)) for s in steps) or "NULL"
    try:
        table = query(run, _ordered(columns, f"step IN ({wanted})", kinds), lists=any(c in LISTS for c in columns))
    except EngineCannot:
        return run.table(list(columns), kinds=kinds, steps=list(steps))
    return pa.Table.from_arrays(_typed(table, columns), names=list(columns))


def present_batches(run, columns: Sequence[str], present: str, kinds: Sequence[str] | None = None,
                    rows: int = 1 << 16) -> Iterator[pa.RecordBatch]:
    """The rows where ``present`` holds a value (of ``kinds``, when given) with ``columns``, in the
    run's order and the run schema's types, streamed in batches of at most ``rows`` rows: what
    ``Run.batches(columns, kinds, present=present)`` yields, without decoding the other rows
    (the engine filters on the one column first). :class:`EngineCannot`, also part way (the
    caller then starts again with pyarrow)."""
    # (the answer is sorted before its first row streams: a small buffer, the rest spilled)
    with Session(run, lists=any(c in LISTS for c in columns), memory_limit=SORT_MEMORY_LIMIT,
                 present=present) as session:
        for batch in session.batches(_ordered(columns, f"{_quoted(present)} IS NOT NULL", kinds), rows):
            yield pa.RecordBatch.from_arrays(_typed(batch, columns), names=list(columns))
