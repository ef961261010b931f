"""Read ahead: the next record batches decoded on a thread while the caller reduces this one.

Decoding Parquet (pyarrow) and the analyses' numpy reductions both release the GIL for most of
their time, so a reader one or two batches ahead keeps a second core busy. Bounded: at most
``depth`` batches wait (memory: the caller's batch plus ``depth``). The thread never outlives the
caller's interest: closing the generator (a ``break``, an exception, garbage collection) stops it
at its next hand-over, within :data:`HAND_OVER_SECONDS`; an error on the thread is raised in the
caller, at the batch where it happened. Nothing here holds a lock the caller waits on without a
bound: a thread that died without a word is an error, not a hang.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator, TypeVar

T = TypeVar("T")

HAND_OVER_SECONDS = 0.1  # how often each side looks up from a full or empty queue


def read_ahead(source: Iterator[T], depth: int = 2) -> Iterator[T]:
    """The items of ``source`` in order, produced on a thread up to ``depth`` items ahead."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def hand_over(item) -> bool:
        while not stop.is_set():
            try:
                slots.put(item, timeout=HAND_OVER_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in source:
                if not hand_over(("item", item)):
                    return
            hand_over(("done", None))
        except BaseException as exc:  # (raised again in the caller)
            hand_over(("error", exc))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name="ampdoctor-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            try:
                kind, item = slots.get(timeout=HAND_OVER_SECONDS)
            except queue.Empty:
                if not thread.is_alive() and slots.empty():
                    raise RuntimeError("the read-ahead thread ended without a result") from None
                continue
            if kind == "done":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()
        # The thread ends at its next hand-over; a batch it is still decoding is waited for no
        # longer than that bound (it is a daemon: it never holds the process open).
        thread.join(timeout=2 * HAND_OVER_SECONDS)
