"""One segment file of a run, known from its footer alone: the Parquet magic bytes, the schema
version, the column types, the metadata values and the step span are read and checked; the data
pages are not read (docs/run-file.md, "Versioning and tolerance").

A problem with the path given as the run itself is a :class:`RunError`; a damaged segment in a
directory, or one this process cannot open (permission denied, an I/O error, a file removed since
the listing), is a :class:`BadSegment` for the caller to skip, and another tool's Parquet file a
:class:`ForeignParquet` for it to ignore."""

from __future__ import annotations

import errno
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import RunError
from ..float_formats import FORMATS
from ..version import __version__
from .hist_column import is_hist_type, unreadable_here
from .schema import (LEVELS, META_AMP_DTYPE, META_BACKOFF_FACTOR, META_DROPPED_STEPS, META_GROWTH_FACTOR,
                     META_GROWTH_INTERVAL, META_HIST_BINS, META_HIST_MIN_EXP, META_INIT_SCALE, META_LEVEL,
                     META_SCHEMA_VERSION, META_UNWRITTEN_AT_EXIT, META_WORLD_SIZE, SCHEMA_VERSION, HIST_BINS,
                     meta_number, run_schema)

MAGIC = b"PAR1"  # the first and last four bytes of every Parquet file
COLUMN_TYPES = {f.name: f.type for f in run_schema()}
REQUIRED_COLUMNS = ("step", "rank", "kind", "name", "scale", "skipped")  # every segment has these
# Columns whose values only some rows hold: measured underflow (one sampled step in ten), the counts
# of full rows (one step in a hundred at the default cadence).
PRESENCE_COLUMNS = ("n_underflow", "n_zero")


@dataclass
class Segment:
    path: Path
    rows: int
    size: int
    metadata: dict[str, str]
    steps: tuple[int, int] | None = None  # first and last step, from the footer's statistics
    until: int | None = None  # rows from this step on were superseded by a later process (read_run)
    unreadable: str | None = None  # why the installed pyarrow cannot read its histograms (read_run skips it)
    mtime: float = 0.0  # the file's modification time when its footer was read: no later stat can fail
    # Per column of PRESENCE_COLUMNS: its rows that hold a value, by the footer's statistics (absent:
    # unknown). A reader skips a segment with none of the values it wants without reading it.
    present: dict[str, int] = field(default_factory=dict)
    hist_type: pa.DataType | None = None  # the ``hist`` column's type (None: the segment has none)
    columns: tuple[str, ...] = ()  # the columns it has, by its footer

    @property
    def hist_bins(self) -> int:
        """Counts per histogram: the ``hist.bins`` metadata (checked against a version 1 column's
        own size when read), else the default."""
        bins = meta_number(self.metadata.get(META_HIST_BINS))
        return bins if isinstance(bins, int) else HIST_BINS


class BadSegment(Exception):
    """A damaged or unopenable segment in a run directory: skipped, the rest of the run read."""


class ForeignParquet(Exception):
    """A Parquet file without ampdoctor's schema version: another tool's, not a segment."""


def read_segment(path: Path, *, single: bool) -> tuple[Segment, list[str]]:
    """The segment at ``path`` from its footer, and a message for each metadata value that was
    ignored (not valid; the default applies). ``single``: ``path`` is the whole run, so a damaged
    file is a :class:`RunError` rather than a :class:`BadSegment`."""
    footer = _read_footer(path, single=single)
    meta, ignored = _checked_metadata(footer.metadata, footer.bins)
    return Segment(path, footer.rows, footer.size, meta, footer.steps,
                   unreadable=unreadable_here(footer.hist_type, footer.hist_nulls), mtime=footer.mtime,
                   present=footer.present, hist_type=footer.hist_type, columns=footer.columns), ignored


def read_failure(exc: BaseException) -> str:
    """Why reading a file failed, in words: ``cannot read: <the OS's reason>`` for an error of the
    OS (pyarrow's ``FileNotFoundError`` carries only the path, its other OS errors the whole call
    around the reason), else the message (damage)."""
    if isinstance(exc, OSError):
        code = exc.errno or {FileNotFoundError: errno.ENOENT, PermissionError: errno.EACCES}.get(type(exc))
        if code:
            return f"cannot read: {os.strerror(code)}"
    return str(exc)


@dataclass
class _Footer:
    rows: int
    metadata: dict[str, str]
    steps: tuple[int, int] | None
    bins: int | None                # counts per histogram, from the column itself (None: the metadata says)
    hist_type: pa.DataType | None
    hist_nulls: int | None          # null histograms by the statistics (None: unknown)
    size: int
    mtime: float
    present: dict[str, int]
    columns: tuple[str, ...]


def _read_footer(path: Path, *, single: bool) -> _Footer:
    """A segment's row count, metadata, step span and what its ``hist`` column is, from its
    footer; the data pages are not read."""
    try:
        with open(path, "rb") as fh:
            stat = os.fstat(fh.fileno())  # the file opened, not the path: it may be replaced or removed meanwhile
            head = fh.read(4)
            fh.seek(max(0, stat.st_size - 4))
            tail = fh.read(4)
    except OSError as exc:
        if single:
            raise RunError(f"{path}: {read_failure(exc)}") from None
        raise BadSegment(read_failure(exc)) from None
    if head != MAGIC:
        if single:
            raise RunError(f"{path}: not a Parquet file")
        raise BadSegment("not Parquet")
    if tail != MAGIC:
        if single:
            raise RunError(f"{path}: truncated Parquet file (no footer)")
        raise BadSegment("truncated: no Parquet footer")
    try:
        footer = pq.read_metadata(path)
        schema = footer.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as exc:
        if single:
            raise RunError(f"{path}: unreadable Parquet file ({read_failure(exc)})") from None
        raise BadSegment(read_failure(exc)) from None
    meta = schema.metadata or {}
    if META_SCHEMA_VERSION.encode() in meta:
        wrong = _schema_problem(schema)
        if wrong:
            if single:
                raise RunError(f"{path}: not a readable ampdoctor run ({wrong})")
            raise BadSegment(wrong)
    version = meta.get(META_SCHEMA_VERSION.encode())
    if version is None:
        raise ForeignParquet()
    try:
        version_number = int(version)
    except ValueError:
        raise RunError(f"{path}: unrecognised schema version {version.decode()!r}") from None
    if version_number > SCHEMA_VERSION:
        raise RunError(f"{path}: written with run schema version {version_number}, but ampdoctor "
                       f"{__version__} reads up to version {SCHEMA_VERSION}; upgrade ampdoctor")
    text = {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in meta.items()}
    hist = schema.field("hist").type if "hist" in schema.names else None
    leaf = _hist_statistics(footer, schema)
    # Version 1's fixed-size lists carry their size in the type; version 2's, its statistics.
    bins = hist.list_size if hist is not None and pa.types.is_fixed_size_list(hist) else _list_size(leaf)
    nulls = None if leaf is None or any(s is None for _, s in leaf) else sum(s.null_count for _, s in leaf)
    return _Footer(footer.num_rows, text, _step_span(footer, schema), bins, hist, nulls, stat.st_size, stat.st_mtime,
                   _present(footer), tuple(schema.names))


def _schema_problem(schema: pa.Schema) -> str | None:
    """What makes a segment's columns unusable: a required column missing, or a column whose type
    the run schema does not allow (a column of a later schema version may be missing)."""
    missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
    if missing:
        return f"no {', '.join(missing)} column"
    for column in schema:
        expected = COLUMN_TYPES.get(column.name)
        if expected is None:
            continue
        ok = _same_kind(column.type, expected)
        if column.name == "hist":
            ok = is_hist_type(column.type)
        if not ok:
            return f"column {column.name} is {column.type}, not {expected}"
    return None


def _same_kind(got: pa.DataType, expected: pa.DataType) -> bool:
    """Whether a column of type ``got`` reads as ``expected``: the same type, or its string, large
    or dictionary variant (another tool's rewrite), which the reader converts as it reads
    (``run._as_type``)."""
    def plain(t: pa.DataType) -> pa.DataType:
        if pa.types.is_dictionary(t):
            t = t.value_type
        if pa.types.is_large_string(t):
            return pa.string()
        if pa.types.is_large_list(t):
            return pa.list_(plain(t.value_type))
        return t
    return plain(got) == plain(expected)


# Metadata values the readers parse: a value that is not valid is ignored (the default applies), with a warning.
def _positive(v: float) -> bool:
    return math.isfinite(v) and 0 < v <= 3.4e38


_METADATA_CHECKS: dict[str, tuple[type, Callable[[float], bool], str]] = {
    META_INIT_SCALE: (float, _positive, "a positive float32"),
    META_GROWTH_FACTOR: (float, lambda v: math.isfinite(v) and v > 1, "a number above 1"),
    META_BACKOFF_FACTOR: (float, lambda v: 0 < v < 1, "a number between 0 and 1"),
    META_GROWTH_INTERVAL: (int, lambda v: v >= 1, "an integer of at least 1"),
    META_WORLD_SIZE: (int, lambda v: v >= 1, "an integer of at least 1"),
    META_HIST_BINS: (int, lambda v: 2 <= v <= 4096, "an integer from 2 to 4096"),
    META_HIST_MIN_EXP: (int, lambda v: -1100 <= v <= 1100, "an exponent from -1100 to 1100"),
    META_DROPPED_STEPS: (int, lambda v: v >= 0, "a count"),
    META_UNWRITTEN_AT_EXIT: (int, lambda v: v >= 0, "a count"),
}
_METADATA_CHOICES = {META_AMP_DTYPE: tuple(FORMATS), META_LEVEL: LEVELS}


def _checked_metadata(meta: dict[str, str], hist_bins: int | None = None) -> tuple[dict[str, str], list[str]]:
    """``meta`` without the values the readers could not use, and a message for each; ``hist.bins``
    is the ``hist`` column's own size (``hist_bins``) when the segment has one."""
    out, ignored = {k: v for k, v in meta.items() if v != ""}, []  # empty: not set (older writers)
    for key, (kind, valid, what) in _METADATA_CHECKS.items():
        if key not in out:
            continue
        try:
            value = kind(float(meta[key])) if kind is int else float(meta[key])
            good = valid(value) and (kind is not int or float(meta[key]).is_integer())
        except (ValueError, OverflowError):
            good = False
        if not good:
            ignored.append(f"ignored metadata {key}={meta[key]!r} (not {what})")
            del out[key]
    for key, allowed in _METADATA_CHOICES.items():
        if key in out and meta[key] not in allowed:
            ignored.append(f"ignored metadata {key}={meta[key]!r} (not one of {', '.join(allowed)})")
            del out[key]
    if hist_bins is not None and out.get(META_HIST_BINS, str(hist_bins)) != str(hist_bins):
        ignored.append(f"ignored metadata {META_HIST_BINS}={meta[META_HIST_BINS]!r} "
                       f"(the hist column has {hist_bins} bins)")
    if hist_bins is not None:
        out[META_HIST_BINS] = str(hist_bins)
    return out, ignored


def _hist_statistics(footer: pq.FileMetaData, schema: pa.Schema) -> list | None:
    """(rows, statistics) of the ``hist`` column's leaf in each row group (statistics None where
    a row group has none or no null count); None without a ``hist`` column."""
    if "hist" not in schema.names:
        return None
    leaf = next((i for i in range(footer.num_columns)
                 if footer.schema.column(i).path.split(".", 1)[0] == "hist"), None)
    if leaf is None:
        return None
    out = []
    for g in range(footer.num_row_groups):
        group = footer.row_group(g)
        if group.num_rows == 0:  # no rows, no statistics, nothing to read
            continue
        stats = group.column(leaf).statistics
        out.append((group.num_rows, stats if stats is not None and stats.has_null_count else None))
    return out


def _list_size(leaf: list | None) -> int | None:
    """The counts per histogram of a version 2 ``hist`` column, from its statistics: a row group's
    non-null leaf values over its non-null rows (a null row is one null leaf slot). None when a
    row group has no statistics, no histogram, or counts that do not divide evenly."""
    sizes = set()
    for rows, stats in leaf or []:
        if stats is None:
            return None
        full = rows - stats.null_count
        if full > 0:
            if stats.num_values % full:
                return None
            sizes.add(stats.num_values // full)
    return sizes.pop() if len(sizes) == 1 else None


def _present(footer: pq.FileMetaData) -> dict[str, int]:
    """Per column of :data:`PRESENCE_COLUMNS` the segment has: its non-null rows, from every row
    group's null count (a column whose statistics lack one is left out: unknown)."""
    out: dict[str, int] = {}
    if not footer.num_row_groups:
        return out
    leaves = {footer.row_group(0).column(i).path_in_schema: i for i in range(footer.num_columns)}
    for name in PRESENCE_COLUMNS:
        if name not in leaves:
            continue
        total = 0
        for g in range(footer.num_row_groups):
            group = footer.row_group(g)
            stats = group.column(leaves[name]).statistics
            if stats is None or not getattr(stats, "has_null_count", True):
                break
            total += group.num_rows - stats.null_count
        else:
            out[name] = total
    return out


def _step_span(footer: pq.FileMetaData, schema: pa.Schema) -> tuple[int, int] | None:
    """The first and last step of a segment from its row groups' statistics (None if unknown)."""
    index = schema.get_field_index("step")
    lo = hi = None
    for g in range(footer.num_row_groups):
        group = footer.row_group(g)
        if index < 0 or group.num_rows == 0:
            continue
        stats = group.column(index).statistics
        if stats is None or not stats.has_min_max:
            return None
        lo = stats.min if lo is None else min(lo, stats.min)
        hi = stats.max if hi is None else max(hi, stats.max)
    return None if lo is None else (int(lo), int(hi))


def as_column_type(column, expected: pa.DataType):
    """``column`` in the run schema's type ``expected``: a plain string column where the schema has
    a dictionary one (a segment written by another writer, or a query engine's answer) is
    dictionary-encoded (pyarrow 14 casts no string to a dictionary), so that tables concatenate."""
    if column.type == expected:
        return column
    if pa.types.is_dictionary(expected):
        plain = column.cast(pa.string()) if not pa.types.is_dictionary(column.type) else column
        return pc.dictionary_encode(plain) if not pa.types.is_dictionary(plain.type) else plain.cast(expected)
    return column.cast(expected)  # a large string or list variant (accepted by the segment's schema check)
