"""Finishing runs when the process ends: at interpreter exit, and on SIGTERM.

One exit handler closes the open recorders first (each finishes its run as ``close()`` would,
final parameter check included), then every writer still open (one whose recorder is gone),
all within :data:`EXIT_TIMEOUT` seconds in all, whatever the disk does. The SIGTERM handler takes
no lock (the interrupted frame may hold any of them), closes every writer within the same bound,
and then lets the previous handler, or the default, act. SIGINT is Python's KeyboardInterrupt:
the interpreter's exit, so the exit handler's bound. A writer that has not finished by then is
left behind (a daemon thread): the run keeps its closed segments and says it did not end cleanly,
or, when the writer only had records left to turn into rows, how many steps it lacks. Last, in a
process with ``torch.distributed`` loaded, the handler lets go of the GIL for
:data:`NATIVE_RELEASE_SECONDS` (within the same bound), which keeps torch's gloo thread from being
ended inside a destructor by the finalizing interpreter (SIGABRT after the work is done).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Protocol

from .writer import EXIT_SECONDS, close_all_writers


class OpenRun(Protocol):
    """What the exit handler needs of a recorder: something it can close within a time bound."""

    path: Path

    def close(self, timeout: float | None = None, *, at_exit: bool = False) -> None: ...


EXIT_TIMEOUT = EXIT_SECONDS  # seconds the exit may take in all: a hung disk must not hang the exit
# At exit, with torch.distributed loaded: how long the main thread lets go of the GIL last, so that
# a native thread still waiting for it drops its Python references before the interpreter
# finalizes. gloo's worker thread (pt_gloo_runloop) frees each finished all-reduce's work object,
# whose saved thread-local state holds the contextvars.Context torch stashes for every backward;
# if it takes the GIL only once finalization has begun, Python ends it with pthread_exit inside a
# noexcept destructor: std::terminate ("terminate called without an active exception"), SIGABRT,
# after the work is done. Plain torch does it too (about one two-rank DDP run in ten on a loaded
# 2-core machine); benchmarks/spawn_probe.py counts it (docs/benchmarks.md).
NATIVE_RELEASE_SECONDS = 0.05

_open_recorders: "weakref.WeakSet[OpenRun]" = weakref.WeakSet()
_sigterm_installed = False
_exit_deadline: float | None = None  # set when the exit handler starts: a SIGTERM then gets what is left


def opened(recorder: OpenRun) -> None:
    """``recorder`` has a run open: finish it at exit, flush it on SIGTERM."""
    _open_recorders.add(recorder)
    _install_sigterm_handler()


def closed(recorder: OpenRun) -> None:
    _open_recorders.discard(recorder)


@atexit.register
def _at_exit() -> None:
    """At interpreter exit (training is over, also after an exception): finish every open run,
    recorders first, then writers left without one. Never raises: one run's failure (even with
    ``strict=True``) must not keep the others from closing."""
    global _exit_deadline
    release = NATIVE_RELEASE_SECONDS if "torch.distributed" in sys.modules else 0.0
    deadline = _exit_deadline = time.monotonic() + EXIT_TIMEOUT - release
    for recorder in list(_open_recorders):
        try:
            recorder.close(max(0.0, deadline - time.monotonic()), at_exit=True)
        except BaseException as exc:  # noqa: BLE001
            warnings.warn(f"ampdoctor: closing {recorder.path} at exit failed ({type(exc).__name__}: {exc})",
                          RuntimeWarning)
    close_all_writers(timeout=max(0.0, deadline - time.monotonic()))
    if release:  # (atexit handlers run before finalization begins: a thread waiting for the GIL gets it now)
        time.sleep(release)


def _install_sigterm_handler() -> None:
    """Flush every open run on SIGTERM, then let the previous handler (or the default) act."""
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        # No lock here: the interrupted frame may hold any of them (a queue's, ours). A program
        # that handles SIGTERM itself may train on: its runs are flushed, not finished (exit or
        # close() finishes them); otherwise the default action ends the process: finish them.
        dies = not callable(previous) and previous != signal.SIG_IGN
        # (during the exit handler: what is left of its bound, not a second one)
        left = EXIT_TIMEOUT if _exit_deadline is None else max(0.0, _exit_deadline - time.monotonic())
        close_all_writers(from_signal=True, timeout=left, finish=dies)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
        _sigterm_installed = True
    except (ValueError, OSError):  # not allowed here (embedded interpreter); atexit still flushes
        pass
