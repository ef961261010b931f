"""Rewrite a run's schema version 1 segments in version 2 (``ampdoctor migrate RUN``), so that every
supported pyarrow reads them (docs/run-file.md, "The hist column").

Reading version 1's null histograms needs pyarrow >= 26 (Python >= 3.11, numpy 2): convert once
where that is installed, then read the run anywhere. Only the ``hist`` column's encoding and the
schema version change; rows, row order and every other metadata value are kept. Each segment is
written beside itself under a temporary name (hidden from readers, as the writer's are) and renamed
over the old one, so a reader never sees half a segment and an interrupted migration leaves every
segment in one version or the other; running it again converts what is left.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import RunError, one_line
from ..run_file.hist_column import BadHistogram, as_hist_column
from ..run_file.schema import META_SCHEMA_VERSION, SCHEMA_VERSION
from ..run_file.names import segment_files, temporary_name
from ..run_file.segment import BadSegment, ForeignParquet, read_segment


@dataclass
class Migration:
    """What :func:`migrate_run` did."""

    path: Path
    converted: list[str] = field(default_factory=list)   # segment names rewritten in the current version
    current: int = 0                                      # segments already in it
    skipped: list[str] = field(default_factory=list)     # damaged or another tool's files, left alone


def migrate_run(path: str | os.PathLike) -> Migration:
    """Convert every version 1 segment at ``path`` (a run directory, every run id in it, or one
    segment file) to the current schema version, in place. Raises :class:`RunError` for a path
    that holds no segment, or when the installed pyarrow cannot read a version 1 segment."""
    root = Path(path)
    if root.is_dir():
        files = segment_files(root.iterdir())
    elif root.is_file():
        files = [root]
    else:
        raise RunError(f"{root}: no such file or directory")
    done = Migration(root)
    for file in files:
        try:
            segment, _ = read_segment(file, single=False)
        except (BadSegment, ForeignParquet) as exc:
            done.skipped.append(f"{file.name} ({exc or 'not an ampdoctor segment'})")
            continue
        if int(segment.metadata.get(META_SCHEMA_VERSION, SCHEMA_VERSION)) >= SCHEMA_VERSION:
            done.current += 1
            continue
        if segment.unreadable:
            raise RunError(one_line(f"{file}: cannot convert here: {segment.unreadable.split(' (', 1)[0]}; "
                                    f"run `ampdoctor migrate` where pyarrow >= 26 is installed"))
        _rewrite(file, segment.hist_bins)
        done.converted.append(file.name)
    if not done.converted and not done.current:
        raise RunError(f"{root}: no ampdoctor segments to convert")
    return done


def _rewrite(file: Path, bins: int) -> None:
    try:
        table = pq.read_table(file)
        hist = as_hist_column(table.column("hist"), bins) if "hist" in table.column_names else None
    except (pa.ArrowException, OSError, BadHistogram) as exc:
        raise RunError(one_line(f"{file}: cannot read it to convert ({exc})")) from None
    metadata = dict(table.schema.metadata or {})
    metadata[META_SCHEMA_VERSION.encode()] = str(SCHEMA_VERSION).encode()
    if hist is not None:
        index = table.schema.get_field_index("hist")
        table = table.set_column(index, pa.field("hist", hist.type), hist)
    table = table.replace_schema_metadata(metadata)
    # Hidden and named as the writer names its temporaries (readers and `demo --out` know them),
    # with the pid: two migrations at once do not write into one file.
    temporary = file.with_name(temporary_name(file.name, tag=f"-migrate{os.getpid()}"))
    try:
        pq.write_table(table, temporary, compression="zstd")
        # The file's times and mode kept: readers order two writers of one second by the time
        # their segments were written (run._supersede), which a new time would reverse.
        shutil.copystat(file, temporary)
        os.replace(temporary, file)
    except (OSError, pa.ArrowException) as exc:
        raise RunError(one_line(f"{file}: cannot write the converted segment ({exc})")) from None
    finally:
        temporary.unlink(missing_ok=True)  # also on KeyboardInterrupt; gone already after the rename
