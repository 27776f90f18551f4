"""Per-attempt time limits, and the end of an aborted attempt.

Soft limit: ``SIGALRM`` raises :class:`JobTimeout` inside the job (main thread only); it stops
Python code and interruptible calls such as ``time.sleep``. Hard limit: a job stuck where no
signal reaches it (a C call, masked signals) is settled as failed by the heartbeat thread,
which then ends the process; the ``jobs_work`` supervisor starts a fresh one.

An abort uses the same alarm: once asked (from the heartbeat thread), the alarm goes off within
the grace and raises :class:`JobAborted` instead; past that, the heartbeat ends the process.
"""

from __future__ import annotations

import signal
import threading
from types import TracebackType
from typing import Any, Self

from .exceptions import JobAborted, JobTimeout

# Seconds past the soft limit before the hard limit acts.
HARD_TIMEOUT_GRACE = 2.0


def _can_alarm() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


class TimeLimit:
    """``with TimeLimit(seconds):`` raises :class:`JobTimeout` in the block after ``seconds``
    (no limit when ``None``), or :class:`JobAborted` once :meth:`abort` was called. Outside the
    main thread (or without ``setitimer``) it does nothing."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds if seconds and seconds > 0 else None
        self.aborted_by: str | None = None
        self._lock = threading.Lock()
        self._grace = 0.0
        self._armed = False  # the handler is installed: the alarm may be set
        self._previous: Any = None

    def __enter__(self) -> Self:
        if _can_alarm():
            self._previous = signal.signal(signal.SIGALRM, self._on_alarm)
            with self._lock:
                self._armed = True
                delay = self.seconds
                if self.aborted_by is not None:  # asked before the block began
                    delay = min(delay or self._grace, self._grace)
                if delay is not None:
                    signal.setitimer(signal.ITIMER_REAL, max(delay, 0.001))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        with self._lock:
            if not self._armed:
                return
            self._armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._previous)

    def abort(self, requested_by: str, grace: float) -> None:
        """Any thread: raise :class:`JobAborted` in the block within ``grace`` seconds (at once
        when ``grace`` is 0), unless it ends first. A timeout due earlier fires as an abort."""
        with self._lock:
            self.aborted_by, self._grace = requested_by, grace
            if not self._armed:
                return
            left, _ = signal.getitimer(signal.ITIMER_REAL)
            if left == 0 or left > grace:
                signal.setitimer(signal.ITIMER_REAL, max(grace, 0.001))

    def _on_alarm(self, signum: int, frame: Any) -> None:
        if self.aborted_by is not None:
            raise JobAborted(f"{JobAborted.describe(self.aborted_by)}: still running after the abort grace")
        raise JobTimeout(f"attempt exceeded its {self.seconds or 0:g}s timeout")
