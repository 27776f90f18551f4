"""Per-attempt time limits.

Soft limit: ``SIGALRM`` raises :class:`JobTimeout` inside the job (main thread only); it stops
Python code and interruptible calls such as ``time.sleep``. Hard limit: a job stuck where no
signal reaches it (a C call, masked signals) is settled as failed by the heartbeat thread,
which then ends the process; the ``jobs_work`` supervisor starts a fresh one.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .exceptions import JobTimeout

# Seconds past the soft limit before the hard limit acts.
HARD_TIMEOUT_GRACE = 2.0


def _can_alarm() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`JobTimeout` in the block after ``seconds`` (no limit when ``None``)."""
    if not seconds or seconds <= 0 or not _can_alarm():
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise JobTimeout(f"attempt exceeded its {seconds:g}s timeout")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
