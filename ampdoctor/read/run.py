"""Load and validate a run: a segment directory (or one segment file), any number of ranks;
one run id chosen, superseded rows marked, the rows read on demand (docs/architecture.md,
"Reading a run"). Each segment's footer is read and checked in :mod:`ampdoctor.run_file.segment`; the
directory's names and which run is the latest follow :mod:`ampdoctor.run_file.names`.

Every way a path can fail to be a run raises :class:`RunError` with a one-line message. A
truncated or half-written segment, or one this process cannot open or read (permission denied, an
I/O error, removed since the listing), is skipped with a warning and the rest is still read.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import RunError, one_line
from .ahead import read_ahead
from ..run_file.hist_column import BadHistogram, as_hist_column, pyarrow_too_old_for
from ..run_file.schema import (META_AMP_DTYPE, META_DEVICE, META_DROPPED_STEPS, META_FINAL, META_RANK, META_RUN_ID,
                               META_RUN_STARTED, META_SCALER_CLASS, META_SCHEMA_VERSION, META_SEGMENT,
                               META_TORCH_VERSION, META_UNWRITTEN_AT_EXIT, META_VERSION, META_WORLD_SIZE, META_WRITER,
                               SCALER_META, SCHEMA_VERSION, meta_number)
from ..run_file.names import is_temporary_name, runs_oldest_first, segment_files, started_at
from ..run_file.segment import (COLUMN_TYPES, BadSegment, ForeignParquet, Segment, as_column_type, read_failure,
                                read_segment)


_WARNINGS = threading.Lock()  # held only to check and append one warning


@dataclass
class Run:
    """A validated run: its segments (footers read, data not yet) and what they said about
    themselves. ``frame`` loads every row; the reports read only the columns they need with
    :meth:`table` or stream them with :meth:`batches`, so memory stays bounded on long runs."""

    path: Path
    segments: list[Segment]
    warnings: list[str] = field(default_factory=list)
    _frame: pd.DataFrame | None = field(default=None, repr=False)
    _bad_segments: set = field(default_factory=set, repr=False)  # paths whose data failed to read
    _too_old: str | None = field(default=None, repr=False)  # why the installed pyarrow cannot read one

    @property
    def metadata(self) -> dict[str, str]:
        """The metadata of the run's first segment: the earliest-started writer's segment 0 (keys
        common to the run: run.id, scaler.*, ...)."""
        return min(self.segments, key=_segment_order).metadata

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def writers(self) -> dict[str, bool]:
        """Writer id → whether it was closed cleanly (wrote its final segment)."""
        out: dict[str, bool] = {}
        for s in self.segments:
            w = s.metadata.get(META_WRITER, "")
            out[w] = out.get(w, False) or s.metadata.get(META_FINAL) == "true"
        return out

    @property
    def dropped_steps(self) -> int:
        """Steps the writers could not take (their queue was full), over all writers: each
        writer's latest count."""
        latest: dict[str, tuple[int, int]] = {}
        for seg in self.segments:
            try:
                number, count = int(seg.metadata.get(META_SEGMENT, 0)), int(seg.metadata.get(META_DROPPED_STEPS, 0))
            except ValueError:
                continue
            writer = seg.metadata.get(META_WRITER, "")
            if number >= latest.get(writer, (-1, 0))[0]:
                latest[writer] = (number, count)
        return sum(count for _, count in latest.values())

    @property
    def unwritten_at_exit(self) -> int:
        """Steps queued but not written because their process ended before its writer took them
        (the exit's deadline: a slow disk), over all writers' final segments. Such a run ended
        (:attr:`ended_cleanly` says whether every writer wrote its final segment) but lacks them:
        its warnings say so."""
        total = 0
        for seg in self.segments:
            if seg.metadata.get(META_FINAL) == "true":
                count = meta_number(seg.metadata.get(META_UNWRITTEN_AT_EXIT))
                total += int(count) if count is not None and count >= 0 else 0
        return total

    @property
    def ended_cleanly(self) -> bool:
        """Every writer wrote its final segment (``close()`` or the exit handler finished it)."""
        return all(self.writers.values())

    @property
    def size_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    @property
    def frame(self) -> pd.DataFrame:
        """Every row as one DataFrame (loaded on first use)."""
        if self._frame is None:
            frame = to_frame(self.table())
            frame.attrs.update({"metadata": self.metadata, "warnings": list(self.warnings)})
            self._frame = frame
        return self._frame

    def table(self, columns: Sequence[str] | None = None, kinds: Sequence[str] | None = None,
              steps: Sequence[int] | None = None) -> pa.Table:
        """The rows (of the given ``kinds`` and ``steps``, when given) as one Arrow table with
        only ``columns``. A segment that fails to read is skipped with a warning."""
        wanted = None if steps is None else np.unique(np.asarray(list(steps), dtype=np.int64))
        tables = [t for t in (self._read(s, columns, kinds, steps) for s in self.segments
                              if wanted is None or _may_hold(s, wanted)) if t is not None]
        self._check_readable()
        if not tables:
            return empty_table(columns)
        try:
            return pa.concat_tables(tables, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise RunError(f"{self.path}: segments do not share one schema ({exc})") from None

    def batches(self, columns: Sequence[str], kinds: Sequence[str] | None = None,
                batch_rows: int = 1 << 18, present: str | None = None) -> Iterator[pa.RecordBatch]:
        """Stream the rows segment by segment in record batches of at most ``batch_rows`` rows;
        memory is bounded by a few batches whatever the run's length. ``present``: only rows where
        that column holds a value (segments whose footers say none hold one are not read). The
        next batches are read on a thread while the caller works on this one (:mod:`.ahead`)."""
        return read_ahead(self._segment_batches(columns, kinds, batch_rows, present))

    def batch_groups(self, columns: Sequence[str], kinds: Sequence[str] | None = None, batch_rows: int = 1 << 16,
                     group_rows: int = 1 << 18, present: str | None = None
                     ) -> Iterator[tuple[pa.RecordBatch, list[int]]]:
        """The batches of :meth:`batches`, in consecutive groups of at least ``group_rows`` rows
        (the last one less), each joined into one batch (:func:`one_batch`, on the reading
        thread) with the sizes of the batches it joins: a run of many small segments in few
        groups, for a caller whose cost is per call while its results must not depend on how the
        rows were grouped (it sees each batch's bounds)."""
        groups = self._grouped(columns, kinds, batch_rows, group_rows, present)
        return read_ahead((one_batch(group), [b.num_rows for b in group]) for group in groups)

    def _grouped(self, columns, kinds, batch_rows, group_rows, present) -> Iterator[list[pa.RecordBatch]]:
        held: list[pa.RecordBatch] = []
        rows = 0
        for batch in self._segment_batches(columns, kinds, batch_rows, present):
            held.append(batch)
            rows += batch.num_rows
            if rows >= group_rows:
                yield held
                held, rows = [], 0
        if held:
            yield held

    def _segment_batches(self, columns: Sequence[str], kinds: Sequence[str] | None,
                         batch_rows: int, where_present: str | None) -> Iterator[pa.RecordBatch]:
        for segment in self.segments:
            if where_present is not None and segment.present.get(where_present) == 0:
                continue
            try:
                source = pq.ParquetFile(segment.path)
                present = [c for c in columns if c in source.schema_arrow.names]
                if segment.until is not None and "step" not in present:
                    present.append("step")
                if where_present is not None and where_present not in source.schema_arrow.names:
                    continue
                for batch in source.iter_batches(batch_size=batch_rows, columns=present):
                    if where_present is not None:
                        batch = batch.filter(batch.column(where_present).is_valid())
                    if kinds is not None:
                        batch = batch.filter(kind_mask(batch.column("kind"), kinds))
                    if segment.until is not None:
                        batch = batch.filter(pc.less(batch.column("step"), segment.until))
                    if batch.num_rows:
                        yield _with_columns(batch, columns, segment.hist_bins)
            except (pa.ArrowException, OSError, BadHistogram) as exc:
                self._unreadable(segment, exc)
        self._check_readable()

    def step_range(self) -> tuple[int, int] | None:
        """The first and last step, from the footers' column statistics (no data read); None when
        a segment with rows has none."""
        spans = [s.steps for s in self.segments if s.rows]
        if not spans or any(span is None for span in spans):
            return None
        return min(lo for lo, _ in spans), max(hi for _, hi in spans)

    def _read(self, segment: Segment, columns, kinds, steps) -> pa.Table | None:
        filters = []
        if kinds is not None:
            filters.append(("kind", "in", list(kinds)))
        if steps is not None:
            filters.append(("step", "in", [int(s) for s in steps]))
        if segment.until is not None:
            filters.append(("step", "<", int(segment.until)))
        try:
            present = None if columns is None else [
                c for c in columns if c in pq.read_schema(segment.path).names]
            table = pq.read_table(segment.path, columns=present, filters=filters or None)
            table = table.replace_schema_metadata(None)
            return _with_columns(table, table.column_names if columns is None else columns, segment.hist_bins)
        except (pa.ArrowException, OSError, BadHistogram) as exc:
            self._unreadable(segment, exc)
            return None

    @property
    def unreadable_segments(self) -> frozenset:
        """The paths of the segments whose data failed to read (skipped with a warning)."""
        return frozenset(self._bad_segments)

    def read_failure(self, segment: Segment, columns: Sequence[str] | None) -> bool:
        """Read ``columns`` of ``segment`` (None: all); when that fails, the segment is skipped
        from then on with a warning (as a failed read in :meth:`table` is). Whether it failed.
        Raises :class:`RunError` when no readable segment is left."""
        failed = self._read(segment, columns, None, None) is None
        if failed:
            self._check_readable()
        return failed

    def _unreadable(self, segment: Segment, exc: BaseException) -> None:
        """A segment whose data pages failed to read (its footer was fine): skipped, with a
        warning that says whether the file is damaged, could not be read (permission denied, an
        I/O error, removed since its footer was read) or the installed pyarrow is too old for it."""
        self._bad_segments.add(segment.path)
        too_old = pyarrow_too_old_for(exc)
        if too_old is not None:
            self._too_old = self._too_old or too_old
            self._warn_once(f"skipped segment {segment.path.name}: {too_old}")
        else:
            self._warn_once(f"skipped unreadable segment {segment.path.name} ({read_failure(exc)})")

    def _check_readable(self) -> None:
        """Every segment failed to read: this is no readable run (a partial one is reported)."""
        with_rows = {s.path for s in self.segments if s.rows}
        if not with_rows or not with_rows <= self._bad_segments:
            return
        if self._too_old:  # the files are fine: name the fix, not damage
            raise RunError(one_line(f"{self.path}: {self._too_old}"))
        # Damage, or files made unreadable or removed since their footers were read: the warnings say which.
        raise RunError(one_line(f"{self.path}: no readable segments (the data of no segment could be read: "
                                f"{'; '.join(self.warnings[-3:])})"))

    def _warn_once(self, message: str) -> None:
        message = one_line(message)
        with _WARNINGS:  # (a read-ahead thread may warn while the caller does)
            if message not in self.warnings:
                self.warnings.append(message)


def expect_run(run: object, taker: str) -> Run:
    """``run`` if it is a read :class:`Run`; else a ``TypeError`` that says how to get one. The
    analyses take a ``Run`` and never open a path (docs/architecture.md)."""
    if not isinstance(run, Run):
        raise TypeError(f"{taker} takes a Run, not {type(run).__name__}: read one with ampdoctor.read_run(path) "
                        f"(ampdoctor.report(path) and the other command functions read the path themselves)")
    return run


def read_run(path: str | os.PathLike, run_id: str | None = None, footers: dict | None = None) -> Run:
    """Validate the run at ``path`` (every segment's footer and schema version; the data is read
    later, on demand). Raises :class:`RunError` for anything not a run.

    A directory may hold several runs (a path reused by a new run): each ``run.id`` is one run,
    never mixed with another. ``run_id`` (or a unique prefix of it) selects one; by default the
    latest started is read, with a warning naming the others. A resumed run (its scaler's
    ``state_dict`` loaded) keeps its run id, so it continues the same run.

    ``footers``: a dict kept by a caller that reads the same path again (``watch``): the footers
    read, by file, and reused while the file's size and modification time are unchanged, so that
    a run of thousands of segments costs a listing and the new segments' footers."""
    root, segments, warnings = _located(path, run_id, footers)
    segments, skipped = _readable_here(root, segments)
    run = Run(root, segments, warnings + skipped + _supersede(segments))
    if run.rows == 0:
        raise RunError(f"{root}: empty run, no steps were recorded")
    if run.dropped_steps:
        run.warnings.append(f"{run.dropped_steps} step(s) were not recorded: the writer fell behind (a slow or "
                            f"stalled disk) and training did not wait for it")
    if run.unwritten_at_exit:
        run.warnings.append(f"{run.unwritten_at_exit} step(s) at the end were not written: the process ended "
                            f"while the writer was behind (a slow disk), and its exit waits only so long")
    return run


def _located(path: str | os.PathLike, run_id: str | None,
             footers: dict | None = None) -> tuple[Path, list[Segment], list[str]]:
    """The segments of one run at ``path`` from their footers (``read_run``'s choice of run), and
    the warnings so far. Raises :class:`RunError` for anything not a run."""
    root = Path(path)
    if not root.exists():
        raise RunError(f"{root}: no such file or directory")
    if root.is_dir():
        try:
            entries = list(root.iterdir())
        except OSError as exc:
            raise RunError(f"{root}: cannot list the directory ({exc.strerror})") from None
        files = segment_files(entries)
        if not files:
            unfinished = any(is_temporary_name(p.name) for p in entries)
            raise RunError(f"{root}: no finished segments (only a segment still being written)"
                           if unfinished else f"{root}: empty directory, not an ampdoctor run")
    elif not root.is_file():
        raise RunError(f"{root}: not a regular file or directory")  # a FIFO would block the read
    else:
        files = [root]

    segments, problems, foreign = [], [], []
    ignored_counts: dict[str, int] = {}  # metadata problems, once each with the segments they were in
    for f in files:
        try:
            segment, ignored = _footer(f, not root.is_dir(), footers)
        except ForeignParquet:
            foreign.append(f)
            continue
        except BadSegment as exc:
            problems.append(one_line(f"skipped unreadable segment {f.name} ({exc})"))
            continue
        for message in ignored:
            ignored_counts[message] = ignored_counts.get(message, 0) + 1
        segments.append(segment)
    if not segments:
        if foreign:
            raise RunError(f"{root}: Parquet written by another tool, not an ampdoctor run "
                           f"(no {META_SCHEMA_VERSION} metadata)")
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""  # one line, however many segments
        raise RunError(one_line(f"{root}: no readable segments ({'; '.join(problems[:3])}{more})"))
    problems.extend(f"{message} (in {n} segment(s))" for message, n in ignored_counts.items())
    problems.extend(f"ignored {f.name}: not an ampdoctor segment" for f in foreign)
    segments, choice = _one_run(root, segments, run_id)
    return root, segments, choice + problems


def _footer(path: Path, single: bool, footers: dict | None) -> tuple[Segment, list[str]]:
    """``read_segment(path)``, or what ``footers`` kept of it while the file is unchanged (a copy:
    reading a run marks its segments)."""
    if footers is None:
        return read_segment(path, single=single)
    try:
        stat = path.stat()
        key = (stat.st_size, stat.st_mtime_ns)
    except OSError:
        return read_segment(path, single=single)  # (says why, as a segment or the run's error)
    kept = footers.get(path)
    if kept is None or kept[0] != key:
        kept = footers[path] = (key, read_segment(path, single=single))
    segment, ignored = kept[1]
    return replace(segment, until=None), list(ignored)


def _one_run(root: Path, segments: list[Segment], run_id: str | None) -> tuple[list[Segment], list[str]]:
    """The segments of one run: ``run_id`` (or a unique prefix), else the latest started."""
    groups: dict[str, list[Segment]] = {}
    for seg in segments:
        groups.setdefault(seg.metadata.get(META_RUN_ID, ""), []).append(seg)

    def started(rid: str) -> str:
        return max((s.metadata.get(META_RUN_STARTED, "") for s in groups[rid]), key=lambda t: t or "") or "?"

    order = runs_oldest_first((s.metadata, s.mtime) for s in segments)
    listing = ", ".join(f"{rid or '(no id)'} (started {started(rid)})" for rid in order)
    if run_id is not None:
        matches = [rid for rid in groups if rid == run_id] or [rid for rid in groups if rid.startswith(run_id)]
        if len(matches) != 1:
            raise RunError(f"{root}: {'no run' if not matches else 'more than one run'} matches {run_id!r} "
                           f"(runs here: {listing})")
        return groups[matches[0]], []
    if len(groups) == 1:
        return segments, []
    chosen = order[-1]
    return groups[chosen], [f"{root} holds {len(groups)} runs; reading the latest, {chosen or '(no id)'}; choose "
                            f"another with --run ID (runs here: {listing})"]


def _readable_here(root: Path, segments: list[Segment]) -> tuple[list[Segment], list[str]]:
    """The segments this process can read as one run, and a warning for each other: whole
    segments, decided from their footers, so that no command uses part of one. Skipped are those
    whose histograms the installed pyarrow cannot read (schema version 1 before pyarrow 26), and
    those whose histograms have another length than the run's (a run resumed with another
    ``hist_bins``). Raises :class:`RunError`, naming the fix, when none is left."""
    warnings = [f"skipped segment {s.path.name}: {s.unreadable}" for s in segments if s.unreadable]
    readable = [s for s in segments if not s.unreadable]
    unreadable = next((s.unreadable for s in segments if s.unreadable), None)
    if unreadable and not any(s.rows for s in readable):  # what is left holds no row: name the fix
        raise RunError(one_line(f"{root}: {unreadable}"))
    bins = min(readable, key=_segment_order).hist_bins
    for s in readable:
        if s.hist_bins != bins:
            warnings.append(f"skipped segment {s.path.name}: histograms of {s.hist_bins} bins where the run "
                            f"has {bins} (hist.bins)")
    return [s for s in readable if s.hist_bins == bins], warnings


def _supersede(segments: list[Segment]) -> list[str]:
    """Two processes of one run that recorded the same steps on one rank: a run resumed from a
    checkpoint older than where it stopped, or restarted. The later process's rows stand from
    its first step on; the earlier one's rows from there are dropped (``Segment.until``). Returns
    a warning for each rank where that happened."""
    writers: dict[tuple[str, str], list[Segment]] = {}
    for seg in segments:
        key = (seg.metadata.get(META_RANK, "0"), seg.metadata.get(META_WRITER, ""))
        writers.setdefault(key, []).append(seg)
    spans = {}
    for key, segs in writers.items():
        known = [s.steps for s in segs if s.steps is not None]
        if known:
            first = (min(started_at(s.metadata, s.mtime) for s in segs), min(s.mtime for s in segs))
            spans[key] = (min(lo for lo, _ in known), max(hi for _, hi in known), first)
    warnings = []
    for rank in sorted({rank for rank, _ in spans}):
        order = sorted((k for k in spans if k[0] == rank), key=lambda k: (spans[k][2], k[1]))
        dropped = []
        for i, key in enumerate(order):
            later = [spans[k][0] for k in order[i + 1:]]
            cutoff = min(later) if later else None
            if cutoff is not None and cutoff <= spans[key][1]:
                for seg in writers[key]:
                    seg.until = cutoff
                dropped.append(f"{cutoff}..{spans[key][1]}")
        if dropped:
            warnings.append(f"rank {rank}: steps {', '.join(dropped)} were recorded again by a later process of this "
                            f"run (resumed from an earlier checkpoint, or restarted): the later ones are read")
    return warnings


def load(path: str | os.PathLike, run_id: str | None = None) -> pd.DataFrame:
    """The run at ``path`` as one DataFrame (one row per observation, in the columns of
    docs/run-file.md).
    ``df.attrs["metadata"]`` holds the run metadata and ``df.attrs["warnings"]`` the skipped
    segments. Raises :class:`RunError` for a path that is not a readable run. ``run_id``: as
    :func:`read_run`."""
    return read_run(path, run_id).frame


def _segment_order(segment: Segment) -> tuple[str, int, str]:
    meta = segment.metadata
    try:
        number = int(meta.get(META_SEGMENT, "0"))
    except ValueError:
        number = 0
    return meta.get(META_RUN_STARTED, ""), number, segment.path.name


def _may_hold(segment: Segment, steps: np.ndarray) -> bool:
    """Whether the segment's step span (its footer's statistics) holds one of the sorted
    ``steps``; True where the span is unknown."""
    if segment.steps is None:
        return True
    lo, hi = segment.steps
    i = np.searchsorted(steps, lo)
    return bool(i < len(steps) and steps[i] <= hi)


def one_batch(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """Consecutive batches of one schema as one (their dictionaries unified)."""
    if len(batches) == 1:
        return batches[0]
    table = pa.Table.from_batches(batches).unify_dictionaries().combine_chunks()
    return table.to_batches(max_chunksize=table.num_rows)[0]


def kind_mask(column: pa.Array, kinds: Sequence[str]) -> pa.Array:
    """Which rows of a (dictionary-encoded) ``kind`` column are one of ``kinds``: compares the
    few dictionary entries, not every row's string."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if isinstance(column, pa.DictionaryArray):
        wanted = np.flatnonzero(np.isin(np.asarray(column.dictionary.to_pylist(), dtype=object), list(kinds)))
        return pa.array(np.isin(column.indices.to_numpy(zero_copy_only=False), wanted))
    return pc.is_in(column, pa.array(list(kinds)))


def to_frame(table: pa.Table) -> pd.DataFrame:
    """A run table as pandas, with ``loss`` Arrow-backed so that a NaN loss (non-finite) stays
    distinct from a null one (not recorded)."""
    frame = table.to_pandas()
    if "loss" in table.column_names:
        frame["loss"] = table.column("loss").to_pandas(types_mapper=pd.ArrowDtype)
    return frame


def _with_columns(data, columns: Sequence[str], hist_bins: int):
    """``data`` with exactly ``columns``, in that order, in the current schema's types (``hist``
    checked to hold ``hist_bins`` counts a row); a column an older segment lacks is null."""
    n = data.num_rows
    def column(name: str):
        if name not in data.column_names:
            return pa.nulls(n, COLUMN_TYPES[name])
        if name in ("hist", "underflow_hist"):
            return as_hist_column(data.column(name), hist_bins)
        if name not in COLUMN_TYPES:  # another tool's extra column, as it is
            return data.column(name)
        return as_column_type(data.column(name), COLUMN_TYPES[name])

    arrays = [column(c) for c in columns]
    cls = pa.RecordBatch if isinstance(data, pa.RecordBatch) else pa.Table
    return cls.from_arrays(arrays, names=list(columns))


def empty_table(columns: Sequence[str] | None = None) -> pa.Table:
    """A table of no rows with ``columns`` (every column when None) in their run-schema types."""
    names = columns if columns is not None else COLUMN_TYPES
    return pa.table({c: pa.array([], COLUMN_TYPES[c]) for c in names})




def describe(run: Run) -> dict:
    """The facts ``ampdoctor info`` shows, as plain data: counted by the query engine
    (:mod:`.engine`), so that no row is loaded; every column is read (a segment damaged anywhere is
    skipped with its warning, as when the rows are loaded), only aggregates are kept."""
    from .engine import EngineCannot, Session, lists_here

    try:
        with Session(run, lists=lists_here(run)) as session:
            counted = _counted(session)
    except EngineCannot:
        counted = _counted_in_frame(run)
    meta = run.metadata
    return {
        "path": str(run.path),
        "schema_version": int(meta.get(META_SCHEMA_VERSION, SCHEMA_VERSION)),
        "written_by": meta.get(META_VERSION),
        "torch_version": meta.get(META_TORCH_VERSION),
        "run_ids": sorted({s.metadata.get(META_RUN_ID, "") for s in run.segments}),
        "started": meta.get(META_RUN_STARTED),
        "device": meta.get(META_DEVICE),
        "amp_dtype": meta.get(META_AMP_DTYPE),
        "scaler": {"class": meta.get(META_SCALER_CLASS),
                   **{key: meta_number(meta.get(name)) for key, name in SCALER_META.items()}},
        **{k: counted[k] for k in ("steps", "first_step", "last_step", "skipped_steps", "ranks")},
        "world_size": meta_number(meta.get(META_WORLD_SIZE)),
        **{k: counted[k] for k in ("tensors", "kinds", "rows")},
        "segments": len(run.segments),
        "size_bytes": run.size_bytes,
        "ended_cleanly": run.ended_cleanly,
        "unwritten_at_exit": run.unwritten_at_exit,
        "warnings": list(run.warnings),
    }


def _counted(session) -> dict:
    """``info``'s counts, by the engine."""
    from .engine import COLUMNS, LISTS

    # Every column read once (its values aggregated), so that damage anywhere is found first.
    touched = [f'max("{c}")' for c in COLUMNS] + ([f"max(list_sum({c}))" for c in LISTS] if session.lists else [])
    session.query(f"SELECT {', '.join(touched)} FROM rows")
    # Each kind's rows, most first; of equal counts the kind met first in the run's order.
    kinds = session.query("SELECT kind, count(*) AS n, min(position) AS first "
                          "FROM rows GROUP BY kind").to_pylist()
    kinds.sort(key=lambda k: (-k["n"], k["first"]))
    facts = session.query("""
        WITH step_rows AS (SELECT step, rank, skipped, position FROM rows WHERE kind = 'step'),
             -- each (step, rank)'s first row in the run's order, null included (1: skipped)
             firsts AS (SELECT arg_min(CASE WHEN skipped IS NULL THEN 2 WHEN skipped THEN 1 ELSE 0 END, position)
                               AS skipped
                        FROM step_rows GROUP BY step, rank)
        SELECT (SELECT count(DISTINCT step) FROM step_rows) AS steps,
               (SELECT min(step) FROM step_rows) AS first_step,
               (SELECT max(step) FROM step_rows) AS last_step,
               (SELECT count(*) FILTER (WHERE skipped = 1) FROM firsts) AS skipped_steps,
               (SELECT list(DISTINCT rank) FROM rows) AS ranks,
               (SELECT count(DISTINCT name) FROM rows WHERE kind <> 'step' AND name <> '') AS tensors,
               (SELECT count(*) FROM rows) AS rows""").to_pylist()[0]
    return {"steps": int(facts["steps"]),
            "first_step": None if facts["first_step"] is None else int(facts["first_step"]),
            "last_step": None if facts["last_step"] is None else int(facts["last_step"]),
            "skipped_steps": int(facts["skipped_steps"]),
            "ranks": sorted(int(r) for r in facts["ranks"] or [] if r is not None),
            "tensors": int(facts["tensors"]),
            "kinds": {str(k["kind"]): int(k["n"]) for k in kinds if k["n"]},
            "rows": int(facts["rows"])}


def _counted_in_frame(run: Run) -> dict:
    """``info``'s counts from every row loaded (a run the engine cannot read)."""
    df = run.frame
    steps = df[df["kind"] == "step"]
    return {"steps": int(steps["step"].nunique()),
            "first_step": int(steps["step"].min()) if len(steps) else None,
            "last_step": int(steps["step"].max()) if len(steps) else None,
            "skipped_steps": int(steps.drop_duplicates(["step", "rank"])["skipped"].sum()),
            "ranks": sorted(int(r) for r in df["rank"].unique()),
            "tensors": int(df.loc[(df["kind"] != "step") & (df["name"] != ""), "name"].nunique()),
            "kinds": {str(k): int(v) for k, v in df["kind"].value_counts().items() if v},
            "rows": int(len(df))}
