"""Load and validate a run: a segment directory (or one segment file), any number of ranks.

Every way a path can fail to be a run raises :class:`RunError` with a one-line message. A
truncated or half-written segment is skipped with a warning and the rest is still read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from . import __version__
from .errors import RunError
from .schema import META_FINAL, META_SCHEMA_VERSION, META_WRITER, SCHEMA_VERSION

_MAGIC = b"PAR1"


@dataclass
class Segment:
    path: Path
    rows: int
    size: int
    metadata: dict[str, str]


@dataclass
class Run:
    """A loaded run: all rows as one DataFrame, plus what the segments said about themselves."""

    path: Path
    frame: pd.DataFrame
    segments: list[Segment]
    warnings: list[str] = field(default_factory=list)

    @property
    def metadata(self) -> dict[str, str]:
        """The metadata of the first segment (keys common to the run: run.id, scaler.*, ...)."""
        return self.segments[0].metadata

    @property
    def writers(self) -> dict[str, bool]:
        """Writer id → whether it was closed cleanly (wrote its final segment)."""
        out: dict[str, bool] = {}
        for s in self.segments:
            w = s.metadata.get(META_WRITER, "")
            out[w] = out.get(w, False) or s.metadata.get(META_FINAL) == "true"
        return out

    @property
    def ended_cleanly(self) -> bool:
        return all(self.writers.values())

    @property
    def size_bytes(self) -> int:
        return sum(s.size for s in self.segments)


def read_run(path: str | os.PathLike) -> Run:
    """Read and validate the run at ``path``. Raises :class:`RunError` for anything not a run."""
    root = Path(path)
    if not root.exists():
        raise RunError(f"{root}: no such file or directory")
    if root.is_dir():
        files = sorted(p for p in root.iterdir()
                       if p.is_file() and p.suffix == ".parquet" and not p.name.startswith((".", "_")))
        if not files:
            unfinished = any(p.name.startswith(".") and p.name.endswith(".tmp") for p in root.iterdir())
            raise RunError(f"{root}: no finished segments (only a segment still being written)"
                           if unfinished else f"{root}: empty directory, not an ampdoctor run")
    else:
        files = [root]

    segments, tables, problems, foreign = [], [], [], []
    for f in files:
        try:
            table = _read_segment(f, single=not root.is_dir())
        except _ForeignParquet:
            foreign.append(f)
            continue
        except _BadSegment as exc:
            problems.append(f"skipped unreadable segment {f.name} ({exc})")
            continue
        meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        segments.append(Segment(f, table.num_rows, f.stat().st_size, meta))
        tables.append(table.replace_schema_metadata(None))
    if not segments:
        if foreign:
            raise RunError(f"{root}: Parquet written by another tool, not an ampdoctor run "
                           f"(no {META_SCHEMA_VERSION} metadata)")
        raise RunError(f"{root}: no readable segments ({'; '.join(problems)})")
    problems.extend(f"ignored {f.name}: not an ampdoctor segment" for f in foreign)
    try:
        table = pa.concat_tables(tables)
        frame = table.to_pandas()
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise RunError(f"{root}: segments do not share one schema ({exc})") from None
    if "loss" in table.column_names:
        # Arrow-backed so that a NaN loss (non-finite) stays distinct from a null (not recorded).
        frame["loss"] = table.column("loss").to_pandas(types_mapper=pd.ArrowDtype)
    if frame.empty:
        raise RunError(f"{root}: empty run, no steps were recorded")
    frame.attrs.update({"metadata": segments[0].metadata, "warnings": list(problems)})
    return Run(root, frame, segments, problems)


def load(path: str | os.PathLike) -> pd.DataFrame:
    """The run at ``path`` as one DataFrame (one row per observation, DESIGN.md schema).
    ``df.attrs["metadata"]`` holds the run metadata and ``df.attrs["warnings"]`` the skipped
    segments. Raises :class:`RunError` for a path that is not a readable run."""
    return read_run(path).frame


class _BadSegment(Exception):
    pass


class _ForeignParquet(Exception):
    pass


def _read_segment(path: Path, *, single: bool) -> pa.Table:
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
            fh.seek(max(0, path.stat().st_size - 4))
            tail = fh.read(4)
    except OSError as exc:
        raise RunError(f"{path}: cannot read ({exc.strerror})") from None
    if head != _MAGIC:
        if single:
            raise RunError(f"{path}: not a Parquet file")
        raise _BadSegment("not Parquet")
    if tail != _MAGIC:
        if single:
            raise RunError(f"{path}: truncated Parquet file (no footer)")
        raise _BadSegment("truncated: no Parquet footer")
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        if single:
            raise RunError(f"{path}: unreadable Parquet file ({exc})") from None
        raise _BadSegment(str(exc)) from None
    meta = schema.metadata or {}
    version = meta.get(META_SCHEMA_VERSION.encode())
    if version is None:
        raise _ForeignParquet()
    try:
        version_number = int(version)
    except ValueError:
        raise RunError(f"{path}: unrecognised schema version {version.decode()!r}") from None
    if version_number > SCHEMA_VERSION:
        raise RunError(f"{path}: written with run schema version {version_number}, but ampdoctor "
                       f"{__version__} reads up to version {SCHEMA_VERSION}; upgrade ampdoctor")
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        if single:
            raise RunError(f"{path}: unreadable Parquet file ({exc})") from None
        raise _BadSegment(str(exc)) from None


def describe(run: Run) -> dict:
    """The facts ``ampdoctor info`` shows, as plain data."""
    df = run.frame
    steps = df[df["kind"] == "step"]
    meta = run.metadata
    kinds = {str(k): int(v) for k, v in df["kind"].value_counts().items() if v}
    return {
        "path": str(run.path),
        "schema_version": int(meta.get(META_SCHEMA_VERSION, SCHEMA_VERSION)),
        "written_by": meta.get("ampdoctor.version"),
        "torch_version": meta.get("torch.version"),
        "run_ids": sorted({s.metadata.get("run.id", "") for s in run.segments}),
        "started": meta.get("run.started"),
        "device": meta.get("device"),
        "amp_dtype": meta.get("amp.dtype"),
        "scaler": {"class": meta.get("scaler.class"), "init_scale": _num(meta.get("scaler.init_scale")),
                   "growth_factor": _num(meta.get("scaler.growth_factor")),
                   "backoff_factor": _num(meta.get("scaler.backoff_factor")),
                   "growth_interval": _num(meta.get("scaler.growth_interval"))},
        "steps": int(steps["step"].nunique()),
        "first_step": int(steps["step"].min()) if len(steps) else None,
        "last_step": int(steps["step"].max()) if len(steps) else None,
        "skipped_steps": int(steps.drop_duplicates(["step", "rank"])["skipped"].sum()),
        "ranks": sorted(int(r) for r in df["rank"].unique()),
        "world_size": _num(meta.get("world_size")),
        "tensors": int(df.loc[df["kind"] != "step", "name"].nunique()),
        "kinds": kinds,
        "rows": int(len(df)),
        "segments": len(run.segments),
        "size_bytes": run.size_bytes,
        "ended_cleanly": run.ended_cleanly,
        "warnings": list(run.warnings),
    }


def _num(text: str | None):
    if text in (None, ""):
        return None
    value = float(text)
    return int(value) if value.is_integer() else value
