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

**The hand-off takes no lock.** The queue is a ``collections.deque`` (``append`` and ``popleft``
are single C calls, atomic under the GIL) with a bound checked before each ``append``, and the
worker is woken by a byte down a non-blocking socket pair (:class:`_Doorbell`), not a
``threading.Event`` (whose condition lock a signal could interrupt a thread holding). So a signal
handler that waits for the worker (SIGTERM's) can never wait for a lock that the frame it
interrupted holds: ``queue.Queue`` did that once (the handler joined a worker that needed the
queue's mutex, held by the interrupted ``put``: the process hung for the whole timeout).

**Training, and every exit, waits on the writer at most** :data:`EXIT_SECONDS` **(5 s):**

* ``put`` never blocks: when the queue is full (a slow or stalled disk) the record is dropped and
  counted in ``dropped``;
* ``sync`` (after an anomaly) waits at most :data:`SYNC_TIMEOUT` seconds, and not at all while
  an earlier sync is still pending (the writer is behind);
* ``close`` waits at most :data:`CLOSE_TIMEOUT` seconds (or its ``timeout``), also when the
  queue is full or the disk hangs; the signal path (:func:`close_all_writers` with
  ``from_signal``) takes no lock and makes no queue operation but a ``deque`` attribute read;
* at exit (interpreter exit, SIGTERM) the worker is told the deadline: past 60% of it, it stops
  turning records into rows, counts the steps left as not written (``record.unwritten_at_exit``
  of its final segment: readers report them), and writes what it holds; a worker stuck in a write
  (a stalled disk) is left behind, and the run has no final segment (readers say it did not end
  cleanly);
* a worker thread that died (not through a failure it caught) is noticed at the next ``put``,
  ``sync`` or ``failed`` and reported as the error.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..run_file.hist_column import hist_array
from ..run_file.names import segment_name, temporary_name
from ..run_file.schema import (FINE_BINS, META_FINAL, META_RANK, META_SEGMENT, META_UNWRITTEN_AT_EXIT, META_WRITER,
                               run_schema)

_CLOSE = object()   # shutdown sentinel
EXIT_SECONDS = 5.0    # the one bound: each wait for the writer, and each exit path in all
SYNC_TIMEOUT = EXIT_SECONDS   # seconds an anomaly's sync may wait for the writer (once per stall)
CLOSE_TIMEOUT = EXIT_SECONDS  # seconds close() may wait for the writer
FLUSH_TIMEOUT = EXIT_SECONDS  # seconds a signal handler that lets the program go on waits for the flush
POLL_SECONDS = 0.05   # how often the worker looks for records (unless woken), a close or a flush
_WAIT_STEP = 0.002    # how often a waiting caller looks at a marker (a flag: no lock to wait on)
_GIVE_UP_SHARE = 0.6  # at exit: the share of the deadline spent turning records into rows


class _Marker:
    """A request the worker answers by setting ``done`` (a plain attribute: whoever waits polls it,
    so no lock is shared with a thread a signal may have interrupted)."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False

    def wait(self, timeout: float, worker: threading.Thread) -> bool:
        """Until done, ``timeout`` seconds, or ``worker`` has ended (it will never answer)."""
        deadline = time.monotonic() + timeout
        while not self.done and time.monotonic() < deadline and worker.is_alive():
            time.sleep(_WAIT_STEP)
        return self.done


class _Sync(_Marker):
    """A marker in the queue: write what is pending, then set ``done``."""


class _Doorbell:
    """Wakes the worker before its next poll, without a lock: a byte down a non-blocking socket
    pair. Ringing never blocks (a full buffer means it rang already) and never raises; the worker
    closes its end when it ends, ``close()`` the other once the worker has ended (a closed Python
    socket refuses to send rather than write to a reused descriptor), and an abandoned writer's
    close with it."""

    def __init__(self) -> None:
        self._receiver = self._sender = None  # opened with the worker: a writer never started holds none

    def open(self) -> None:
        """Make the socket pair (before the worker starts). Until then a ring does nothing."""
        try:
            receiver, sender = socket.socketpair()
            receiver.setblocking(False)
            sender.setblocking(False)
        except OSError:  # no sockets here: the worker only polls
            return
        self._receiver, self._sender = receiver, sender

    def ring(self) -> None:
        if self._sender is not None:
            try:
                self._sender.send(b"\0")
            except OSError:
                pass

    def close_receiver(self) -> None:
        """The worker is done: nothing waits on the bell any more (a ring then fails, quietly)."""
        if self._receiver is not None:
            self._receiver.close()

    def close(self) -> None:
        """Nobody rings any more (the worker has ended and the writer is closed)."""
        if self._sender is not None:
            self._sender.close()

    def wait(self, timeout: float) -> None:
        """Until rung or ``timeout`` seconds (worker side)."""
        if self._receiver is None:
            time.sleep(timeout)
            return
        try:
            if select.select([self._receiver], [], [], timeout)[0]:
                self._receiver.recv(4096)
        except (OSError, ValueError):
            time.sleep(timeout)


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
            if f.name in ("hist", "underflow_hist"):
                arrays.append(hist_array(parts, hist_bins))
            elif f.name == "fine_hist":
                arrays.append(hist_array(parts, FINE_BINS))
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
        self._queue: deque = deque()  # bounded by put(): no lock (module docstring)
        self._queue_size = queue_size
        self._wake = _Doorbell()  # rung when the worker must not wait for its next poll
        self._wake_at = max(1, queue_size // 2)
        self._pending = Columns()
        self._segment = 0
        self._last_flush = time.monotonic()
        self._error: BaseException | None = None
        self._closed = False
        self._closing = False      # set without a lock (the signal path); the worker finishes then
        self._finished = False     # the worker returned normally
        self._sync: _Sync | None = None  # the last sync's, while pending
        self._flush_request: _Marker | None = None  # done once flushed (signal path)
        self._give_up_at: float | None = None  # at exit: past this, records left are counted, not written
        self.unwritten = 0         # step records counted at exit instead of written
        self._progress_at = time.monotonic()  # when the worker last took an item (close() waits while it moves)
        self._flush_countdown: int | None = None  # records to take before serving it
        self._pid = os.getpid()    # a forked child inherits this object, not its thread
        self._close_lock = threading.Lock()
        self._start_lock = threading.Lock()
        self.dropped = 0           # records dropped because the queue was full
        # Started by the first record (_start): a scaler that is made and never steps (a
        # framework's set-up, a test) leaves no thread behind.
        self._thread = _Worker(self, name)
        self._started = False  # (registered in _open_writers then: the exit handler has nothing to do before)

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
        # (_finished is set before the thread ends: read after is_alive(), a worker finishing
        # between the two reads, as when a signal handler closes it, is not taken for dead)
        if self._error is None and self._started and not self._thread.is_alive() and not self._finished:
            self._error = RuntimeError("the writer thread died")

    def _start(self, *, closing: bool = False) -> None:
        """Start the worker, once, when there is something to write (``closing``: the final,
        empty segment of a run closed before its first record). Only in the process that made
        the writer: a forked child inherits this object, not its thread, and must not write into
        the parent's segments (it fails instead: the recorder warns)."""
        if self._started:
            return
        if os.getpid() != self._pid:
            if self._error is None:
                self._error = RuntimeError(f"the writer belongs to process {self._pid}: a forked child does not record")
            return
        with self._start_lock:
            if self._started or (self._closing and not closing):
                return
            with _open_lock:  # from now on the exit handler finishes it
                _open_writers.add(self)
            self._wake.open()
            try:
                self._thread.start()
            except BaseException:  # (no thread to be had: recording fails, the sockets go)
                self._wake.close_receiver()
                self._forget()
                raise
            self._started = True

    def put(self, record: Any) -> bool:
        """Queue a record; never blocks. False if it was not queued: recording has stopped, or
        the queue is full (then it is counted in ``dropped``). The first one starts the worker."""
        if not self._started:
            self._start()
        if self.closed or self.failed:
            return False
        queued = len(self._queue)
        if queued >= self._queue_size:  # (one producer in practice; two may overshoot by one)
            self.dropped += 1
            return False
        self._queue.append(record)
        if queued + 1 >= self._wake_at:  # fast steps: drain before the queue fills
            self._wake.ring()
        return True

    def sync(self, timeout: float | None = None) -> bool:
        """Wait until every record queued so far is written to a closed segment (used after an
        anomaly, so that its rows are on disk before the process can die), at most ``timeout``
        (:data:`SYNC_TIMEOUT`) seconds; not at all while an earlier sync is pending or the queue
        is full (the writer is behind). False when it did not complete. No device sync: the
        records' events have completed."""
        if self.closed or self.failed or (self._sync is not None and not self._sync.done):
            return False
        if not self._started:
            return True  # nothing was ever queued: all of it (nothing) is written
        if len(self._queue) >= self._queue_size:
            return False
        self._sync = marker = _Sync()
        self._queue.append(marker)
        self._wake.ring()
        return marker.wait(SYNC_TIMEOUT if timeout is None else timeout, self._thread)

    def close(self, timeout: float | None = None, *, at_exit: bool = False) -> bool:
        """Write the last segment and stop the worker. Idempotent. Without ``timeout`` (a
        program's own ``close()``) it waits while the worker makes progress and returns once
        the worker has made none for :data:`CLOSE_TIMEOUT` seconds (a stalled disk), so a slow
        but working disk still gets every step; with ``timeout``, at most that. False if the
        worker did not finish (it goes on in the background while the process lives).
        ``at_exit``: the process is ending, so the worker stops turning records into rows past
        60% of ``timeout``, counts the steps left and writes what it holds (a stalled disk: the
        last segment is lost)."""
        if at_exit:
            self._give_up(CLOSE_TIMEOUT if timeout is None else timeout)
        with self._close_lock:
            first, self._closed = not self._closed, True
        if first:
            self._closing = True
            self._queue.append(_CLOSE)  # (past the bound: the sentinel is never dropped)
            self._wake.ring()
        with self._start_lock:  # (a put() on another thread may be starting the worker now)
            started = self._started
        if not started:  # never given a record
            if not (first and not at_exit and os.getpid() == self._pid):
                return True  # at exit, or a scaler dropped or abandoned unused: nothing to write
            # The program closes a run that has no step: its one (empty) segment says so ("empty
            # run"), written by the worker, waited for as any close (a stalled disk: 5 s).
            try:
                self._start(closing=True)
            except Exception as exc:  # noqa: BLE001 - no thread: the run is not written
                self._error = self._error or exc
                return True
        if timeout is not None:
            self._thread.join(timeout)
        else:
            while self._thread.is_alive() and time.monotonic() - self._progress_at < CLOSE_TIMEOUT:
                self._thread.join(min(0.1, CLOSE_TIMEOUT))
        finished = not self._thread.is_alive()
        if finished:  # one still writing stays registered: the exit handler gives it its time
            self._forget()
        return finished

    def _forget(self) -> None:
        """The worker has ended (or never started): nothing is left for the exit handler."""
        with _open_lock:
            _open_writers.discard(self)
        self._wake.close()

    def close_when_dropped(self) -> None:
        """``close`` for a garbage collector callback (the scaler was dropped without
        ``close()``): no lock, no wait, no queue operation; the worker writes the last segment
        and ends by itself, so a dropped scaler leaves no thread behind. Idempotent."""
        self._closing = True
        self._wake.ring()

    def _answers(self) -> bool:
        """Whether a worker thread of this process can answer a signal handler's request."""
        return os.getpid() == self._pid and self._thread.is_alive()

    def _give_up(self, timeout: float) -> None:
        at = time.monotonic() + _GIVE_UP_SHARE * timeout
        self._give_up_at = at if self._give_up_at is None else min(self._give_up_at, at)

    def close_from_signal(self, timeout: float) -> None:
        """``close`` at exit for a signal handler: no lock, no queue operation (the interrupted
        frame may be anywhere); the worker drains the queue and writes the last segment."""
        self._give_up(timeout)
        self._closing = True
        self._wake.ring()
        if self._answers():
            self._thread.join(timeout)

    def flush_from_signal(self, timeout: float) -> None:
        """Write what is queued to a segment and keep recording (a signal the program handles
        itself and may survive), waiting at most :data:`FLUSH_TIMEOUT` seconds. No lock, no queue
        operation, as ``close_from_signal``."""
        if not self._answers():
            return
        self._flush_request = request = _Marker()
        self._wake.ring()
        request.wait(min(timeout, FLUSH_TIMEOUT), self._thread)

    # -- worker side ----------------------------------------------------------------------
    def _next(self) -> Any:
        """The next queued item; when there is none, sleep until woken or POLL_SECONDS have
        passed, then look again. The worker is not woken by every ``put``: it drains records in
        batches, so that it takes the GIL from the training thread a few times a second, not at
        every step."""
        self._serve_flush_request(drained=False)
        # A close is read *before* the queue: whatever was queued before it was asked is then
        # taken first (read after, a record put just before close() could be left behind).
        closing = self._closing
        try:
            return self._queue.popleft()
        except IndexError:
            pass
        self._serve_flush_request(drained=True)
        if closing:
            return _CLOSE  # (the signal path asks without a sentinel)
        self._wake.wait(max(0.01, min(POLL_SECONDS, self._flush_seconds - (time.monotonic() - self._last_flush))))
        closing = self._closing
        try:
            return self._queue.popleft()
        except IndexError:  # drained: a close requested without the sentinel, or the timer
            due = self._pending.rows and time.monotonic() - self._last_flush >= self._flush_seconds
            return _CLOSE if closing else (_FLUSH if due else None)

    def _work(self) -> None:
        try:
            self._serve()
        finally:
            self._wake.close_receiver()
        if self._finished and not self._closed:  # closed when dropped or by a signal: nobody else will
            # forget it. No lock: the thread a signal interrupted may hold _open_lock, and a signal
            # handler joins this thread (set.discard is atomic under the GIL).
            _open_writers.discard(self)

    def _serve(self) -> None:
        while True:
            self._progress_at = time.monotonic()
            item = self._next()
            if item is _CLOSE:
                self._guarded(lambda: self._write_segment(final=True))
                self._finished = True
                return
            if isinstance(item, _Sync):
                if self._pending.rows:
                    self._guarded(lambda: self._write_segment(final=False))
                item.done = True  # also after a failure: nobody waits forever
                continue
            if self._error is not None or item is None:
                continue  # failed: drain and drop until the sentinel
            if item is not _FLUSH and self._give_up_at is not None and time.monotonic() >= self._give_up_at:
                self.unwritten += bool(getattr(item, "is_step", False))  # the process is ending: the final segment says so
                continue
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
                self._flush_countdown = len(self._queue)
            if self._flush_countdown > 0:
                self._flush_countdown -= 1
                return
        request, self._flush_request, self._flush_countdown = self._flush_request, None, None
        if self._pending.rows:
            self._guarded(lambda: self._write_segment(final=False))
        request.done = True

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
        # Records left at exit (0 before): the run says it lacks them, and did not end cleanly.
        metadata[META_UNWRITTEN_AT_EXIT] = str(self.unwritten)
        metadata.update({META_WRITER: self.writer_id, META_SEGMENT: str(self._segment),
                         META_FINAL: "true" if final else "false", META_RANK: str(self.rank)})
        table = self._pending.to_table(run_schema(metadata), self._hist_bins)
        self.path.mkdir(parents=True, exist_ok=True)
        name = segment_name(self.rank, self.writer_id, self._segment)
        tmp = self.path / temporary_name(name)
        try:
            with pa.OSFile(str(tmp), "wb") as sink:  # closed at once, also when the write fails
                pq.write_table(table, sink, compression="zstd")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.path / name)  # atomic: readers see whole segments only
        self._segment += 1
        self._pending = Columns()


class _Worker(threading.Thread):
    """The writer's thread. Daemon: a non-daemon thread would be joined before atexit handlers
    run, i.e. forever. ``stop()`` closes its writer (the protocol of test suites' thread checks,
    Lightning's ``thread_police`` among them: a daemon thread left over with a ``stop`` is
    stopped, not reported)."""

    def __init__(self, writer: "RunWriter", name: str) -> None:
        super().__init__(target=writer._work, name=name, daemon=True)
        self._writer = writer

    def stop(self) -> None:
        """Close the writer: the last segment is written and the thread ends (within
        :data:`CLOSE_TIMEOUT` of its last progress, as ``close()``)."""
        self._writer.close()


def close_all_writers(*, from_signal: bool = False, timeout: float | None = None, finish: bool = True) -> None:
    """Close every open writer at exit (interpreter exit, from :mod:`ampdoctor.record.shutdown`, and
    SIGTERM), within ``timeout`` (:data:`EXIT_SECONDS`) seconds in all. ``from_signal``: take no
    lock (see :meth:`RunWriter.close_from_signal`); with ``finish=False`` only write what is
    queued and keep recording (the program handles the signal itself and may go on)."""
    deadline = time.monotonic() + (EXIT_SECONDS if timeout is None else timeout)
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
            w.close(timeout=left, at_exit=True)


def _snapshot_without_lock() -> list["RunWriter"]:
    for _ in range(10):  # another thread may add or remove a writer meanwhile
        try:
            return list(_open_writers)
        except RuntimeError:
            continue
    return []

