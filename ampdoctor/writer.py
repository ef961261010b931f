"""Background writer: step records → Arrow → closed Parquet segment files.

One :class:`RunWriter` per recording process and rank. The training thread only ``put()``s records
into a bounded queue; a daemon thread waits for each record's copy event, turns it into rows and
writes a segment (temporary ``.name``, then an atomic rename) every ``flush_every`` steps,
every ``flush_seconds``, at once after an anomaly (a skipped step or a non-finite loss), and on
``close()``. So host memory is bounded by ``queue_size`` records plus one segment's rows, and a
killed process loses at most the steps since the last segment.

A failure in the worker (disk full, permission denied, a bug of ours) is kept and recording
stops: later records are dropped. ``error`` hands the exception back to the training thread,
which warns once, or raises it when the user asked for ``strict=True``.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .schema import (META_FINAL, META_RANK, META_SEGMENT, META_WRITER, run_schema)

_CLOSE = object()   # shutdown sentinel


class _Sync:
    """A marker: write what is pending, then set ``done``."""

    def __init__(self, done: threading.Event) -> None:
        self.done = done
_FLUSH = object()   # "write what you have now" (the flush_seconds timer)

_open_writers: set["RunWriter"] = set()
_open_lock = threading.Lock()


@dataclass
class Columns:
    """Rows in column form, as the writer accumulates them between segments."""

    data: dict[str, list[np.ndarray]] = field(default_factory=dict)
    rows: int = 0
    records: int = 0  # training steps held

    def append(self, block: dict[str, np.ndarray], n: int) -> None:
        for key, values in block.items():
            self.data.setdefault(key, []).append(values)
        self.rows += n

    def to_table(self, schema: pa.Schema) -> pa.Table:
        arrays = []
        for f in schema:
            parts = self.data.get(f.name, [])
            if f.name == "hist":
                arrays.append(_hist_array(parts, f.type))
            elif pa.types.is_list(f.type):  # object blocks of int lists or None
                values = np.concatenate(parts) if parts else np.array([], dtype=object)
                arrays.append(pa.array(values.tolist(), type=f.type))
            elif pa.types.is_dictionary(f.type):
                values = np.concatenate(parts) if parts else np.array([], dtype=object)
                arrays.append(pa.array(values, type=pa.string()).dictionary_encode())
            else:
                values = np.concatenate(parts) if parts else np.array([])
                mask = None
                if f.nullable and values.dtype == object:
                    mask = np.array([v is None for v in values], dtype=bool)
                    values = np.array([0 if v is None else v for v in values])
                arrays.append(pa.array(values, type=f.type, mask=mask))
        return pa.Table.from_arrays(arrays, schema=schema)


def _hist_array(parts: list[np.ndarray], type_: pa.FixedSizeListType) -> pa.Array:
    """``parts`` are 2-D int32 blocks, or 1-D object blocks of None for rows without a histogram."""
    bins = type_.list_size
    flat, valid = [], []
    for block in parts:
        if block.ndim == 2:
            flat.append(block.reshape(-1))
            valid.append(np.ones(len(block), dtype=bool))
        else:
            flat.append(np.zeros(len(block) * bins, dtype=np.int32))
            valid.append(np.zeros(len(block), dtype=bool))
    values = pa.array(np.concatenate(flat) if flat else np.array([], np.int32), type=pa.int32())
    mask = pa.array(~np.concatenate(valid)) if valid else None
    return pa.FixedSizeListArray.from_arrays(values, bins, mask=mask)


class RunWriter:
    """Writes one process's rows of a run into the run directory ``path``.

    ``materialize(record)`` runs on the worker thread and returns ``([(columns, n_rows), ...], anomaly)``
    (every block holds every column);
    it is where device results are waited for and read. Nothing here syncs the training thread.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        metadata: Callable[[], dict[str, str]],
        materialize: Callable[[Any], tuple[list[tuple[dict[str, np.ndarray], int]], bool]],
        rank: int = 0,
        hist_bins: int,
        flush_every: int = 1000,
        flush_seconds: float = 60.0,
        queue_size: int = 256,
        name: str = "ampdoctor-writer",
    ) -> None:
        self.path = Path(path)
        self.rank = rank
        self.writer_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._metadata = metadata
        self._materialize = materialize
        self._hist_bins = hist_bins
        self._flush_every = flush_every
        self._flush_seconds = flush_seconds
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._pending = Columns()
        self._segment = 0
        self._last_flush = time.monotonic()
        self._error: BaseException | None = None
        self._closed = False
        self._close_lock = threading.Lock()
        self.rows_written = 0
        self.bytes_written = 0
        # Daemon: a non-daemon thread would be joined before atexit handlers run, i.e. forever.
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()
        with _open_lock:
            _open_writers.add(self)

    # -- training-thread side -------------------------------------------------------------
    @property
    def error(self) -> BaseException | None:
        """The worker's failure, if any (recording has stopped then)."""
        return self._error

    @property
    def failed(self) -> bool:
        return self._error is not None

    def put(self, record: Any) -> bool:
        """Queue a record; blocks only while the queue is full. False if recording has stopped."""
        if self._closed or self._error is not None:
            return False
        self._queue.put(record)
        return True

    def sync(self, timeout: float = 30.0) -> bool:
        """Block until every record queued so far is written to a closed segment (used after an
        anomaly, so that its rows are on disk before the process can die). False on time-out or
        when recording has stopped. No device sync: the records' events have completed."""
        if self._closed or self._error is not None:
            return False
        done = threading.Event()
        self._queue.put(_Sync(done))
        return done.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Write the last segment and stop the worker. Idempotent; waits for the worker."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(_CLOSE)
        self._thread.join(timeout)
        with _open_lock:
            _open_writers.discard(self)

    # -- worker side ----------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            timeout = max(0.05, self._flush_seconds - (time.monotonic() - self._last_flush))
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = _FLUSH if self._pending.rows else None
            if item is _CLOSE:
                self._guarded(lambda: self._write_segment(final=True))
                return
            if isinstance(item, _Sync):
                if self._pending.rows:
                    self._guarded(lambda: self._write_segment(final=False))
                item.done.set()  # also after a failure: nobody waits forever
                continue
            if self._error is not None or item is None:
                continue  # failed: drain and drop until the sentinel
            if item is _FLUSH:
                self._guarded(lambda: self._write_segment(final=False))
                continue
            self._guarded(lambda: self._add(item))

    def _guarded(self, action: Callable[[], None]) -> None:
        if self._error is not None:
            return
        try:
            action()
        except BaseException as exc:  # noqa: BLE001 - every failure must stop recording, not training
            self._error = exc  # handed back to the training thread, which warns once (or raises)
            self._pending = Columns()

    def _add(self, record: Any) -> None:
        blocks, anomaly = self._materialize(record)
        for block, n in blocks:
            self._pending.append(block, n)
        self._pending.records += 1
        due = (self._pending.rows and (
            anomaly or self._pending.records >= self._flush_every
            or time.monotonic() - self._last_flush >= self._flush_seconds))
        if due:
            self._write_segment(final=False)

    def _write_segment(self, *, final: bool) -> None:
        self._last_flush = time.monotonic()
        if not self._pending.rows and not final:
            return
        metadata = dict(self._metadata())
        metadata.update({META_WRITER: self.writer_id, META_SEGMENT: str(self._segment),
                         META_FINAL: "true" if final else "false", META_RANK: str(self.rank)})
        table = self._pending.to_table(run_schema(self._hist_bins, metadata))
        self.path.mkdir(parents=True, exist_ok=True)
        name = f"part-r{self.rank:05d}-{self.writer_id}-{self._segment:06d}.parquet"
        tmp = self.path / f".{name}.tmp"
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, self.path / name)  # atomic: readers see whole segments only
        self.bytes_written += (self.path / name).stat().st_size
        self.rows_written += table.num_rows
        self._segment += 1
        self._pending = Columns()


def close_all_writers() -> None:
    """Close every open writer (at interpreter exit and on SIGTERM)."""
    with _open_lock:
        writers = list(_open_writers)
    for w in writers:
        w.close(timeout=30)


atexit.register(close_all_writers)
