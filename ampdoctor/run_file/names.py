"""What a run directory holds: the one naming rule of segments that the writer, the
reader, ``watch``, ``migrate`` and the demo share (docs/run-file.md, "Layout"), and which run of a
directory is the latest (the one read by default, and the one a resumed recording continues).

A segment is ``part-r{rank:05d}-{writer id}-{number:06d}.parquet``; while it is written it is
``.{name}.tmp`` beside it, renamed into place whole. Readers take every visible ``*.parquet``
(another writer's names included: the footer, not the name, says whose it is) and skip hidden
names and names beginning with ``_`` (other tools', as pyarrow's dataset discovery skips them).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

from .schema import META_RUN_ID, META_RUN_STARTED
from .segment import BadSegment, ForeignParquet, read_segment

SUFFIX = ".parquet"
TEMPORARY_SUFFIX = ".tmp"
PREFIX = "part-"


def segment_name(rank: int, writer_id: str, number: int) -> str:
    """The file name of a writer's ``number``-th segment (0-based) on ``rank``."""
    return f"{PREFIX}r{rank:05d}-{writer_id}-{number:06d}{SUFFIX}"


def temporary_name(name: str, tag: str = "") -> str:
    """The hidden name a segment is written under before it is renamed to ``name``; ``tag`` makes
    it unique to one writer of the same segment (``migrate`` uses its pid)."""
    stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
    return f".{stem}{tag}{SUFFIX}{TEMPORARY_SUFFIX}"


def is_segment_name(name: str) -> bool:
    """Whether a directory entry's name is a finished segment's: ``*.parquet``, not hidden, not
    another tool's (``_*``)."""
    return name.endswith(SUFFIX) and not name.startswith((".", "_"))


def is_temporary_name(name: str) -> bool:
    """A hidden temporary file: a segment still being written (or left half-written by a process
    that died)."""
    return name.startswith(".") and name.endswith(TEMPORARY_SUFFIX)


def is_written_by_ampdoctor(name: str) -> bool:
    """A name ampdoctor's writer gives, finished or not (the demo removes only such files)."""
    return name.startswith((PREFIX, "." + PREFIX)) and name.endswith((SUFFIX, SUFFIX + TEMPORARY_SUFFIX))


def is_finished_segment(path: Path) -> bool:
    """Whether a directory entry is a closed segment (:func:`is_segment_name`, a regular file)."""
    if not is_segment_name(path.name):
        return False
    try:
        return path.is_file()
    except OSError:  # cannot even stat it (EACCES, EIO): kept, so that reading it skips it, saying why
        return True


def segment_files(entries: Iterable[Path]) -> list[Path]:
    """The finished segments among a directory's entries, in name order."""
    return sorted(p for p in entries if is_finished_segment(p))


def started_at(metadata: dict[str, str], mtime: float) -> float:
    """When the process that wrote a segment started (seconds since the epoch), from its
    ``run.started`` footer key; the file's time when the footer does not say. Comparable across
    time zones."""
    try:
        return datetime.strptime(metadata.get(META_RUN_STARTED, ""), "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return mtime


def runs_oldest_first(segments: Iterable[tuple[dict[str, str], float]]) -> list[str]:
    """The run ids of segments given as (footer metadata, file time), oldest first: a run is as
    recent as its latest-started process, then its latest-written file. The last is the latest."""
    started: dict[str, float] = {}
    written: dict[str, float] = {}
    for metadata, mtime in segments:
        rid = metadata.get(META_RUN_ID, "")
        started[rid] = max(started.get(rid, -float("inf")), started_at(metadata, mtime))
        written[rid] = max(written.get(rid, -float("inf")), mtime)
    return sorted(started, key=lambda rid: (started[rid], written[rid]))


def latest_run_id(path: str | os.PathLike) -> str | None:
    """The id of the latest run at ``path`` (a run directory or one segment), or None when there is
    none: the run ``read_run`` reads by default, from the footers it accepts (data pages are not
    read, so also where the installed pyarrow cannot read them). For the recording side, which
    continues that run when it resumes: never raises for what it finds."""
    root = Path(path)
    try:
        files = segment_files(root.iterdir()) if root.is_dir() else [root]
        segments = []
        for f in files:
            try:
                segment, _ = read_segment(f, single=False)
            except (BadSegment, ForeignParquet):
                continue  # skipped by the reader too
            segments.append((segment.metadata, segment.mtime))
        order = runs_oldest_first(segments)
    except Exception:  # noqa: BLE001 - nothing a reader would take (a newer schema, no such path): a new run
        return None
    return (order[-1] or None) if order else None
