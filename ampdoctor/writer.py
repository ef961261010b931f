"""Background writer: step records → Arrow → closed Parquet segment files.

One :class:`RunWriter` per recording process and rank. The training thread only ``put()``s records
into a bounded queue; a daemon thread, woken every :data:`POLL_SECONDS` (sooner when the queue is
half full or a sync or close is asked for) so that it takes the GIL in a few batches a second
rather than at every step, waits for each record's copy fence, turns it into rows and
writes a segment (temporary ``.name``, then an atomic rename) every ``flush_every`` steps,
every ``flush_seconds``, at once after an anomaly (a skipped step or a non-finite loss), and on
``close()``. So host memory is bounded by ``queue_size`` records plus one segment's rows, and a
killed process loses at most the steps since the last segment.

A failure in the worker (disk full, permission denied, a bug of ours) is kept and recording
stops: later records are dropped. ``error`` hands the exception back to the training thread,
which warns once, or raises it when the user asked for ``strict=True``.

**Training never waits on the writer beyond these bounds:**

* ``put`` never blocks: when the queue is full (a slow or stalled disk) the record is dropped and
  counted in ``dropped``;
* ``sync`` (after an anomaly) waits at most :data:`SYNC_TIMEOUT` seconds, and not at all while
  an earlier sync is still pending (the writer is behind);
* ``close`` waits at most :data:`CLOSE_TIMEOUT` seconds (or its ``timeout``), also when the
  queue is full; the signal path (:func:`close_all_writers` with ``from_signal``) takes no lock
  and no queue operation, since the interrupted code may hold them;
* a worker thread that died (not through a failure it caught) is noticed at the next ``put``,
  ``sync`` or ``failed`` and reported as the error.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .hist_column import hist_array
from .schema import (META_FINAL, META_RANK, META_SEGMENT, META_WRITER, run_schema)

_CLOSE = object()   # shutdown sentinel
SYNC_TIMEOUT = 30.0   # seconds an anomaly's sync may wait for the writer (once per stall)
CLOSE_TIMEOUT = 30.0  # seconds close() may wait for the writer
POLL_SECONDS = 0.05   # how often the worker looks for records (unless woken), a close or a flush
FLUSH_TIMEOUT = 5.0   # seconds a signal handler that lets the program go on waits for the flush


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

    def to_table(self, schema: pa.Schema, hist_bins: int) -> pa.Table:
        arrays = []
        for f in schema:
            parts = self.data.get(f.name, [])
            if f.name == "hist":
                arrays.append(hist_array(parts, hist_bins))
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
        self._wake = threading.Event()  # set when the worker must not wait for its next poll
        self._wake_at = max(1, queue_size // 2)
        self._pending = Columns()
        self._segment = 0
        self._last_flush = time.monotonic()
        self._error: BaseException | None = None
        self._closed = False
        self._closing = False      # set without a lock (the signal path); the worker finishes then
        self._finished = False     # the worker returned normally
        self._sync: threading.Event | None = None  # the last sync's, while pending
        self._flush_request: threading.Event | None = None  # set by the worker once flushed (signal path)
        self._flush_countdown: int | None = None  # records to take before serving it
        self._pid = os.getpid()    # a forked child inherits this object, not its thread
        self._close_lock = threading.Lock()
        self.dropped = 0           # records dropped because the queue was full
        # Daemon: a non-daemon thread would be joined before atexit handlers run, i.e. forever.
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()
        with _open_lock:
            _open_writers.add(self)

    # -- training-thread side -------------------------------------------------------------
    @property
    def error(self) -> BaseException | None:
        """The worker's failure, if any (recording has stopped then)."""
        self._check_alive()
        return self._error

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def closed(self) -> bool:
        return self._closing  # set by close() and by the signal path

    def _check_alive(self) -> None:
        if self._error is None and not self._finished and not self._thread.is_alive():
            self._error = RuntimeError("the writer thread died")

    def put(self, record: Any) -> bool:
        """Queue a record; never blocks. False if it was not queued: recording has stopped, or
        the queue is full (then it is counted in ``dropped``)."""
        if self.closed or self.failed:
            return False
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            return False
        if self._queue.qsize() >= self._wake_at:  # fast steps: drain before the queue fills
            self._wake.set()
        return True

    def sync(self, timeout: float | None = None) -> bool:
        """Wait until every record queued so far is written to a closed segment (used after an
        anomaly, so that its rows are on disk before the process can die), at most ``timeout``
        (:data:`SYNC_TIMEOUT`) seconds; not at all while an earlier sync is pending or the queue
        is full (the writer is behind). False when it did not complete. No device sync: the
        records' events have completed."""
        if self.closed or self.failed or (self._sync is not None and not self._sync.is_set()):
            return False
        done = threading.Event()
        try:
            self._queue.put_nowait(_Sync(done))
        except queue.Full:
            return False
        self._wake.set()
        self._sync = done
        return done.wait(SYNC_TIMEOUT if timeout is None else timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Write the last segment and stop the worker. Idempotent. Waits at most ``timeout``
        (:data:`CLOSE_TIMEOUT`) seconds; False if the worker did not finish in time (a stalled
        disk: what it still held is lost)."""
        with self._close_lock:
            first, self._closed = not self._closed, True
        if first:
            self._closing = True
            try:
                self._queue.put_nowait(_CLOSE)  # when full, the worker sees _closing once drained
            except queue.Full:
                pass
            self._wake.set()
        self._thread.join(CLOSE_TIMEOUT if timeout is None else timeout)
        finished = not self._thread.is_alive()
        if finished:  # one still writing stays registered: the exit handler gives it its time
            with _open_lock:
                _open_writers.discard(self)
        return finished

    def _answers(self) -> bool:
        """Whether a worker thread of this process can answer a signal handler's request."""
        return os.getpid() == self._pid and self._thread.is_alive()

    def close_from_signal(self, timeout: float) -> None:
        """``close`` for a signal handler: no lock, no queue operation (the interrupted frame may
        hold the queue's lock); the worker drains the queue and writes the last segment."""
        self._closing = True
        if self._answers():
            self._thread.join(timeout)

    def flush_from_signal(self, timeout: float) -> None:
        """Write what is queued to a segment and keep recording (a signal the program handles
        itself and may survive), waiting at most :data:`FLUSH_TIMEOUT` seconds. No lock, no queue
        operation, as ``close_from_signal``."""
        if not self._answers():
            return
        done = threading.Event()
        self._flush_request = done
        done.wait(min(timeout, FLUSH_TIMEOUT))

    # -- worker side ----------------------------------------------------------------------
    def _next(self) -> Any:
        """The next queued item; when there is none, sleep until woken or POLL_SECONDS have
        passed, then look again. The worker is not woken by every ``put``: it drains records in
        batches, so that it takes the GIL from the training thread a few times a second, not at
        every step."""
        self._serve_flush_request(drained=False)
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            pass
        self._serve_flush_request(drained=True)
        self._wake.wait(max(0.01, min(POLL_SECONDS, self._flush_seconds - (time.monotonic() - self._last_flush))))
        self._wake.clear()
        try:
            return self._queue.get_nowait()
        except queue.Empty:  # drained: a close requested without the sentinel, or the timer
            due = self._pending.rows and time.monotonic() - self._last_flush >= self._flush_seconds
            return _CLOSE if self._closing else (_FLUSH if due else None)

    def _work(self) -> None:
        while True:
            item = self._next()
            if item is _CLOSE:
                self._guarded(lambda: self._write_segment(final=True))
                self._finished = True
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

    def _serve_flush_request(self, *, drained: bool) -> None:
        """A signal handler asked for what is held to be written: served once the records queued
        when the worker saw the request are held (the queue drained, or that many taken since:
        training off the main thread may keep queueing)."""
        if self._flush_request is None:
            return
        if not drained:
            if self._flush_countdown is None:
                self._flush_countdown = self._queue.qsize()
            if self._flush_countdown > 0:
                self._flush_countdown -= 1
                return
        request, self._flush_request, self._flush_countdown = self._flush_request, None, None
        if self._pending.rows:
            self._guarded(lambda: self._write_segment(final=False))
        request.set()

    def _guarded(self, action: Callable[[], None]) -> None:
        if self._error is not None:
            return
        try:
            action()
        except BaseException as exc:  # noqa: BLE001 - every failure must stop recording, not training
            # The traceback's frames hold what failed (pyarrow's open file): let them go now.
            traceback.clear_frames(exc.__traceback__)
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
        table = self._pending.to_table(run_schema(metadata), self._hist_bins)
        self.path.mkdir(parents=True, exist_ok=True)
        name = f"part-r{self.rank:05d}-{self.writer_id}-{self._segment:06d}.parquet"
        tmp = self.path / f".{name}.tmp"
        try:
            with pa.OSFile(str(tmp), "wb") as sink:  # closed at once, also when the write fails
                pq.write_table(table, sink, compression="zstd")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.path / name)  # atomic: readers see whole segments only
        self._segment += 1
        self._pending = Columns()


def close_all_writers(*, from_signal: bool = False, timeout: float | None = None, finish: bool = True) -> None:
    """Close every open writer (at interpreter exit, from :mod:`ampdoctor.shutdown`, and on
    SIGTERM), within ``timeout``
    (:data:`CLOSE_TIMEOUT`) seconds in all. ``from_signal``: take no lock (see
    :meth:`RunWriter.close_from_signal`); with ``finish=False`` only write what is queued and
    keep recording (the program handles the signal itself and may go on)."""
    deadline = time.monotonic() + (CLOSE_TIMEOUT if timeout is None else timeout)
    if from_signal:
        writers = _snapshot_without_lock()
    else:
        with _open_lock:
            writers = list(_open_writers)
    for w in writers:
        left = max(0.0, deadline - time.monotonic())
        if from_signal and not finish:
            w.flush_from_signal(left)
        elif from_signal:
            w.close_from_signal(left)
        else:
            w.close(timeout=left)


def _snapshot_without_lock() -> list["RunWriter"]:
    for _ in range(10):  # another thread may add or remove a writer meanwhile
        try:
            return list(_open_writers)
        except RuntimeError:
            continue
    return []

